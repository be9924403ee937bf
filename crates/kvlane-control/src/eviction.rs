//! Which unproven accepted connection makes room for a new one when the
//! channel's accept cap is reached, or that none may go yet. Pure: the
//! channel passes what it knows of each connection and `now`; no socket,
//! no clock.
//!
//! The stalest connection that waits on its peer goes first: a refused,
//! silent, slow or stuck one, never one this side still owes work.
//!
//! 1. A connection waits on its peer from the moment its read half finds
//!    no more input after the last handshake stage it reached (greeting,
//!    READY, first message). It is a candidate once it has waited
//!    [`PATIENCE`]; the candidate whose peer took its last new step
//!    earliest (its accept, for one that never completed a stage) goes
//!    first, so silent connections go in the order they were accepted.
//!    Only a new stage counts, so neither a trickle of bytes nor a
//!    repeated step makes a peer look fresh.
//! 2. A connection this side owes work (accepted but not read yet, or a
//!    stage decoded and not answered yet) is not evicted: under a burst of
//!    new connections the accept loop would otherwise evict peers before
//!    their handshake ever ran (seen in the flood test: a real peer
//!    accepted, evicted 4 ms later before its greeting was read). When no
//!    connection may go, the accept loop holds the new one until a slot
//!    frees or one may go. Bound: past [`Eviction::spare_for`] after its
//!    accept, an owed connection is a candidate, ranked by its accept time.
//! 3. A connection whose first message arrived (a hello, waiting for the
//!    node's verdict or in a keyed handshake) is *spared* for
//!    [`Eviction::spare_for`] after that message (the handshake timeout,
//!    after which the node has released or proven it anyway), at most
//!    [`Eviction::max_spared`] at once (the handshake slots, the newest
//!    first messages); past either bound it ranks by (1) and (2). A
//!    refused hello closes its connection at once, so a hello flood holds
//!    spares only while its hellos are being judged.

use std::time::{Duration, Instant};

use crate::config::Config;

/// What the channel knows of one open accepted connection that has not
/// proven itself (not `Ready`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unproven {
    /// When it was accepted.
    pub(crate) accepted: Instant,
    /// When its peer reached its last new handshake stage (`accepted`
    /// before the first).
    pub(crate) last_step: Instant,
    /// Since when it has waited on its peer; `None` while this side owes
    /// it work.
    pub(crate) waiting_since: Option<Instant>,
    /// When its first message arrived.
    pub(crate) first_message: Option<Instant>,
}

/// The eviction choice and its bounds on sparing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Eviction {
    /// How long after its first message a connection is spared, and how
    /// long after its accept one that is owed work is.
    pub(crate) spare_for: Duration,
    /// How many connections whose first message arrived are spared at once
    /// at most.
    pub(crate) max_spared: usize,
    /// How long a connection may wait on its peer, after its last new
    /// handshake stage, before it may be evicted.
    pub(crate) patience: Duration,
}

/// How long an unproven connection may wait on its peer at each handshake
/// stage before a newer connection may evict it: a peer that answers
/// within it is never evicted for a silent one. A flood of silent
/// connections is accepted at most `slots / PATIENCE` a second (3,200 a
/// second for the flood test's 16 slots). Chosen from the flood test
/// (debug build, 2 loaded cores): the real peer answered a stage in under
/// 1 ms typically and in 25 ms at worst, so under such load it can still
/// be evicted; its dialer then sees the close and retries at once. A
/// longer patience slows the accept loop under a silent flood, and the
/// peer waits longer in the listener's queue.
pub(crate) const PATIENCE: Duration = Duration::from_millis(5);

impl Eviction {
    /// Spared for the handshake timeout, as many as there are handshake slots.
    pub(crate) fn from_config(config: &Config) -> Self {
        Self {
            spare_for: config.handshake_timeout,
            max_spared: config.handshake_cap,
            patience: PATIENCE.min(config.handshake_timeout),
        }
    }

    /// The index of the connection in `open` to evict, or `None` when none
    /// may go now (every one is spared or owed work, or `open` is empty).
    pub(crate) fn choose(&self, open: &[Unproven], now: Instant) -> Option<usize> {
        let within = |t: Instant| now.saturating_duration_since(t) < self.spare_for;
        let waited = |t: Instant| now.saturating_duration_since(t) >= self.patience;
        // Within the time bound, newest first message first.
        let mut spared: Vec<usize> = (0..open.len())
            .filter(|&i| open[i].first_message.is_some_and(within))
            .collect();
        spared.sort_by_key(|&i| std::cmp::Reverse((open[i].first_message, i)));
        spared.truncate(self.max_spared);
        (0..open.len())
            .filter(|i| !spared.contains(i))
            .filter_map(|i| {
                let c = &open[i];
                match c.waiting_since {
                    Some(t) if !waited(t) => None,
                    Some(_) => Some((c.last_step, i)),
                    None if !within(c.accepted) => Some((c.accepted, i)),
                    None => None,
                }
            })
            .min()
            .map(|(_, i)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn policy() -> Eviction {
        Eviction {
            spare_for: Duration::from_secs(5),
            max_spared: 2,
            patience: Duration::ZERO,
        }
    }

    /// Accepted at `t0 + at` ms, waiting on its peer since `+ wait` ms
    /// (`None`: owed work), first message at `+ msg` ms.
    fn conn(t0: Instant, at: u64, wait: Option<u64>, msg: Option<u64>) -> Unproven {
        Unproven {
            accepted: t0 + ms(at),
            // The peer's last step shortly before this side's answer.
            last_step: t0 + ms(wait.unwrap_or(at).saturating_sub(1).max(at)),
            waiting_since: wait.map(|w| t0 + ms(w)),
            first_message: msg.map(|m| t0 + ms(m)),
        }
    }

    #[test]
    fn nothing_to_evict_when_none_is_open() {
        assert_eq!(policy().choose(&[], Instant::now()), None);
    }

    /// The stalest waiting one goes: a mute one before one accepted
    /// earlier whose peer stepped since.
    #[test]
    fn the_longest_waiting_connection_goes_first() {
        let t0 = Instant::now();
        let open = [
            conn(t0, 0, Some(9), None), // accepted first, answered, waits since 9 ms
            conn(t0, 3, Some(4), None), // mute since 4 ms
            conn(t0, 5, Some(6), None), // mute since 6 ms
        ];
        assert_eq!(policy().choose(&open, t0 + ms(10)), Some(1));
    }

    /// A burst of new connections that this side has not read yet evicts
    /// nobody: the accept loop waits instead (the real peer of the flood
    /// test was evicted before its handshake task ran).
    #[test]
    fn connections_owed_work_are_not_evicted() {
        let t0 = Instant::now();
        let open: Vec<Unproven> = (0..16).map(|i| conn(t0, i, None, None)).collect();
        assert_eq!(policy().choose(&open, t0 + ms(20)), None);
        // One that waits on its peer goes, even though it is the newest.
        let mut open = open;
        open.push(conn(t0, 17, Some(18), None));
        assert_eq!(policy().choose(&open, t0 + ms(20)), Some(16));
    }

    /// Patience: a connection that has waited on its peer for less than
    /// `patience` since its last new stage is not evicted, so a slow but
    /// live peer is not evicted by a burst of newer silent connections.
    #[test]
    fn a_connection_waits_on_its_peer_for_patience_before_it_may_go() {
        let t0 = Instant::now();
        let p = Eviction {
            patience: ms(20),
            ..policy()
        };
        let open = [conn(t0, 0, Some(5), None), conn(t0, 1, Some(1), None)];
        assert_eq!(p.choose(&open, t0 + ms(20)), None);
        assert_eq!(p.choose(&open, t0 + ms(21)), Some(1));
        assert_eq!(p.choose(&open[..1], t0 + ms(24)), None);
        assert_eq!(p.choose(&open[..1], t0 + ms(25)), Some(0));
    }

    /// The bound on owing: a connection not read for `spare_for` after its
    /// accept is a candidate, ranked by its accept time.
    #[test]
    fn a_connection_owed_work_past_the_bound_goes() {
        let t0 = Instant::now();
        let open = [conn(t0, 0, None, None), conn(t0, 4000, Some(4500), None)];
        let p = policy();
        assert_eq!(p.choose(&open, t0 + ms(4999)), Some(1));
        assert_eq!(p.choose(&open, t0 + ms(5000)), Some(0));
        assert_eq!(p.choose(&open[..1], t0 + ms(4999)), None);
    }

    /// The real peer of the flood test: its hello arrived, and it waits
    /// for the verdict (its read half is idle since): it is spared while
    /// any connection that waits on its peer is left, however new.
    #[test]
    fn a_peer_whose_hello_arrived_is_spared_for_newer_waiting_ones() {
        let t0 = Instant::now();
        let mut open = vec![conn(t0, 0, Some(2), Some(2))];
        for i in 1..16 {
            open.push(conn(t0, i, Some(i + 3), None));
        }
        let now = t0 + ms(20);
        assert_eq!(policy().choose(&open, now), Some(1));
        let mut order = Vec::new();
        while let Some(i) = policy().choose(&open, now) {
            order.push(open.remove(i).accepted);
        }
        assert_eq!(open.len(), 1, "the peer is never chosen: {order:?}");
        assert_eq!(open[0].accepted, t0);
    }

    /// The time bound on sparing: past `spare_for` after its first message
    /// a connection (a keyed hello, then nothing) ranks by that last step,
    /// before fresher waiting connections.
    #[test]
    fn a_spared_connection_that_is_stuck_past_the_bound_goes_first() {
        let t0 = Instant::now();
        let open = [
            conn(t0, 0, Some(1), Some(1)),          // hello at 1 ms, then nothing
            conn(t0, 5000, Some(5000), None),       // mute, just accepted
            conn(t0, 5001, Some(5002), Some(5002)), // hello just now
        ];
        let p = policy();
        assert_eq!(p.choose(&open, t0 + ms(5000)), Some(1), "within the bound");
        assert_eq!(p.choose(&open, t0 + ms(5003)), Some(0), "past the bound");
    }

    /// The count bound: at most `max_spared` are spared (the newest first
    /// messages); the excess ranks by its last step.
    #[test]
    fn at_most_max_spared_are_spared() {
        let t0 = Instant::now();
        let open = [
            conn(t0, 0, Some(1), Some(1)),
            conn(t0, 1, Some(2), Some(2)),
            conn(t0, 2, Some(3), Some(3)),
            conn(t0, 9, Some(9), None),
        ];
        let now = t0 + ms(10);
        assert_eq!(policy().choose(&open, now), Some(0));
        let unbounded = Eviction {
            max_spared: 3,
            ..policy()
        };
        assert_eq!(unbounded.choose(&open, now), Some(3));
    }

    /// A flood that keeps opening mute connections, one per eviction, never
    /// evicts a connection whose first message arrived; a flood of
    /// connections that each send a message evicts it only once
    /// `max_spared` newer ones are spared and one more must go.
    #[test]
    fn a_flood_evicts_the_spared_peer_only_past_the_count_bound() {
        let t0 = Instant::now();
        let p = policy();
        let peer = conn(t0, 0, Some(1), Some(1));
        let mut open = vec![peer];
        for i in 1..4 {
            open.push(conn(t0, i, Some(i), None));
        }
        for i in 4..1000 {
            let now = t0 + ms(i);
            let v = p.choose(&open, now).expect("a victim");
            assert_ne!(open[v], peer, "mute flood evicted the peer at {i}");
            open.remove(v);
            open.push(conn(t0, i, Some(i), None));
        }
        let mut open = vec![peer];
        let mut evicted_at = None;
        for i in 2..100 {
            open.push(conn(t0, i, Some(i), Some(i)));
            if open.len() > 3 {
                let v = p.choose(&open, t0 + ms(i)).expect("a victim");
                if open.remove(v) == peer {
                    evicted_at = Some(i);
                    break;
                }
            }
        }
        assert_eq!(evicted_at, Some(4));
    }
}
