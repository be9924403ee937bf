//! Configuration, engine identity and the rank → port plan.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::PlanError;
use crate::ids::Ranks;
use crate::wire::Identity;

/// Tunables of the control plane. Every field has a documented default.
#[derive(Debug, Clone)]
pub struct Config {
    /// Interval between keep-alive pings. Default 1 s.
    pub keepalive_interval: Duration,
    /// Number of consecutive unanswered pings before a peer is dead. After the
    /// first unanswered ping the peer is `Suspect`. Default 3.
    pub liveness_budget: u32,
    /// Deadline for a handshake (all connect attempts of one round). Default 5 s.
    pub handshake_timeout: Duration,
    /// First reconnect backoff. Default 100 ms.
    pub backoff_min: Duration,
    /// Backoff cap. Default 5 s.
    pub backoff_max: Duration,
    /// Whether an initiator keeps reconnecting after its peer died. Default true.
    pub reconnect: bool,
    /// Largest accepted frame in bytes. Default 16 MiB.
    pub frame_cap: usize,
    /// Largest number of peers (inbound + outbound) past the handshake.
    /// Accepted connections still handshaking (not yet authenticated) never
    /// count here. Default 1024.
    pub peer_cap: usize,
    /// Largest number of accepted connections still handshaking; past it
    /// the oldest handshake is dropped for the new one (counted), so a
    /// flood of unauthenticated hellos cycles through these slots and never
    /// takes a `peer_cap` slot. Default 256.
    pub handshake_cap: usize,
    /// Largest notification payload in bytes; larger ones are refused when
    /// sending and dropped (counted as oversized) when received. Default 64 KiB.
    pub notify_cap: usize,
    /// Events buffered for [`ControlNode::events`](crate::ControlNode::events)
    /// subscribers (a slow subscriber lags, losing the oldest, instead of
    /// blocking the driver), and unread notifications held for the owner's
    /// stream ([`ControlNode::take_events`](crate::ControlNode::take_events),
    /// which never drops a lifecycle event). With `notify_cap` this bounds
    /// the memory held for unread notifications. Default 1024.
    pub event_capacity: usize,
    /// How long `close` waits for the remote `bye` that proves our last
    /// frames were delivered. Default 200 ms.
    pub close_linger: Duration,
    /// Optional pre-shared key; when set the handshake is authenticated
    /// (HMAC-SHA256 over the handshake transcript: both nonces, both
    /// identities, both data-plane blobs) and neither identity nor blob is
    /// sent before the other side has proven the key. An empty key is
    /// refused by [`validate`](Self::validate). Default none.
    pub psk: Option<Psk>,
    /// Seed of the jitter RNG (deterministic simulations). Default: random.
    pub rng_seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            keepalive_interval: Duration::from_secs(1),
            liveness_budget: 3,
            handshake_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            reconnect: true,
            frame_cap: 16 << 20,
            peer_cap: 1024,
            handshake_cap: 256,
            notify_cap: 64 << 10,
            event_capacity: 1024,
            close_linger: Duration::from_millis(200),
            psk: None,
            rng_seed: rand::random(),
        }
    }
}

/// Longest interval or timeout accepted (one day): keeps `now + d` far from
/// `Instant` overflow.
const MAX_INTERVAL: Duration = Duration::from_secs(86_400);

/// Largest liveness budget accepted.
const MAX_BUDGET: u32 = 1_000;

impl Config {
    /// Checks the values a node cannot work with (zero intervals would spin,
    /// a zero cap refuses everything, intervals over a day or a budget over
    /// 1000 are refused). The error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |d: Duration| d.is_zero() || d > MAX_INTERVAL;
        let checks: [(&'static str, bool); 11] = [
            ("keepalive_interval", bad(self.keepalive_interval)),
            (
                "liveness_budget",
                self.liveness_budget == 0 || self.liveness_budget > MAX_BUDGET,
            ),
            ("handshake_timeout", bad(self.handshake_timeout)),
            ("backoff_min", bad(self.backoff_min)),
            (
                "backoff_max",
                self.backoff_max < self.backoff_min || bad(self.backoff_max),
            ),
            ("close_linger", self.close_linger > MAX_INTERVAL),
            ("frame_cap", self.frame_cap < 64),
            ("peer_cap", self.peer_cap == 0),
            ("handshake_cap", self.handshake_cap == 0),
            ("event_capacity", self.event_capacity == 0),
            // An empty key proves nothing: anyone can compute its MACs.
            (
                "psk",
                self.psk.as_ref().is_some_and(|k| k.as_bytes().is_empty()),
            ),
        ];
        match checks.iter().find(|(_, bad)| *bad) {
            Some((field, _)) => Err(ConfigError { field }),
            None => Ok(()),
        }
    }

    /// A copy with every value clamped into the workable range, so a
    /// machine never spins on a zero interval nor overflows on a huge one.
    pub fn normalized(&self) -> Self {
        let min = Duration::from_millis(1);
        let clamp = |d: Duration| d.clamp(min, MAX_INTERVAL);
        let backoff_min = clamp(self.backoff_min);
        Self {
            keepalive_interval: clamp(self.keepalive_interval),
            liveness_budget: self.liveness_budget.clamp(1, MAX_BUDGET),
            handshake_timeout: clamp(self.handshake_timeout),
            backoff_min,
            backoff_max: clamp(self.backoff_max).max(backoff_min),
            close_linger: self.close_linger.min(MAX_INTERVAL),
            frame_cap: self.frame_cap.max(64),
            peer_cap: self.peer_cap.max(1),
            handshake_cap: self.handshake_cap.max(1),
            event_capacity: self.event_capacity.max(1),
            ..self.clone()
        }
    }

    /// Upper bound between the last frame heard from a peer and its `Dead`
    /// event: `keepalive_interval * (liveness_budget + 1)`.
    pub fn death_bound(&self) -> Duration {
        self.keepalive_interval
            .saturating_mul(self.liveness_budget.clamp(1, MAX_BUDGET) + 1)
    }
}

/// A configuration value a node cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid config: `{field}` is zero or out of range")]
pub struct ConfigError {
    /// The offending field.
    pub field: &'static str,
}

/// Why a string cannot be an engine id: peers are told apart, and their
/// notifications attributed, by it, so it must name something.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineIdError {
    /// The id is empty.
    #[error("engine id is empty")]
    Empty,
    /// The id is longer than [`MAX_ENGINE_ID_LEN`].
    #[error("engine id is {len} bytes, more than the {max} allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// The id holds a control character (a newline, NUL, escape, ...).
    #[error("engine id {id:?} holds a control character at byte {at}")]
    ControlChar {
        /// The id, as sent (at most the allowed length, so short).
        id: String,
        /// Byte offset of the first control character.
        at: usize,
    },
}

/// The longest engine id, in bytes.
pub const MAX_ENGINE_ID_LEN: usize = 256;

/// Checks that `id` can name an engine: not empty, at most
/// [`MAX_ENGINE_ID_LEN`] bytes, no control characters. Both ends of a
/// handshake check it: a node refuses to start with a malformed id of its
/// own, and refuses a peer that claims one.
pub fn check_engine_id(id: &str) -> Result<(), EngineIdError> {
    if id.is_empty() {
        return Err(EngineIdError::Empty);
    }
    if id.len() > MAX_ENGINE_ID_LEN {
        return Err(EngineIdError::TooLong {
            len: id.len(),
            max: MAX_ENGINE_ID_LEN,
        });
    }
    match id.char_indices().find(|(_, c)| c.is_control()) {
        Some((at, _)) => Err(EngineIdError::ControlChar {
            id: id.to_owned(),
            at,
        }),
        None => Ok(()),
    }
}

/// A pre-shared key. Its `Debug` output is redacted so keys never reach logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk(Vec<u8>);

impl Psk {
    /// Wraps key bytes.
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        Self(key.into())
    }

    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Psk(<redacted>)")
    }
}

/// What this process tells its peers in the handshake.
#[derive(Debug, Clone)]
pub struct LocalInfo {
    /// Who this process is; peers with a different
    /// [`fingerprint`](Identity::fingerprint) are refused.
    pub identity: Identity,
    /// Opaque data-plane blob (endpoints and regions, msgpack).
    pub data_plane: Vec<u8>,
}

impl LocalInfo {
    /// A new identity with a fresh random incarnation and no capabilities.
    pub fn new(engine_id: impl Into<String>, ranks: Ranks, fingerprint: impl Into<String>) -> Self {
        Self {
            identity: Identity {
                engine_id: engine_id.into(),
                incarnation: rand::random(),
                dp_rank: ranks.dp_rank,
                tp_rank: ranks.tp_rank,
                tp_size: ranks.tp_size,
                fingerprint: fingerprint.into(),
                capabilities: Vec::new(),
            },
            data_plane: Vec::new(),
        }
    }

    /// Sets the data-plane blob.
    pub fn with_data_plane(mut self, blob: Vec<u8>) -> Self {
        self.data_plane = blob;
        self
    }
}

/// What a peer told us in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteInfo {
    /// Who the peer is.
    pub identity: Identity,
    /// Remote data-plane blob (uninterpreted).
    pub data_plane: Vec<u8>,
    /// The peer's IP address as this side reaches it: the address dialed
    /// (connections this side made), or the address the peer says its
    /// packets to us leave from (connections it made). `None` when
    /// unknown (a name that did not resolve, an old peer). A data plane
    /// advertised on a wildcard address is dialed at this host.
    pub peer_host: Option<std::net::IpAddr>,
    /// The secret of this session, derived by both sides of a handshake
    /// with a pre-shared key and by nobody else (see [`SessionKey`](crate::SessionKey));
    /// `None` without a key.
    pub session: Option<crate::SessionKey>,
}

/// How a dialed connection reaches its peer, found by the driver before it
/// dials (the state machine does no I/O): the peer's address, and this
/// side's address towards it, which the `hello` carries so that the peer
/// can dial back a data plane advertised on a wildcard address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Route {
    /// The peer's resolved IP address.
    pub peer: Option<std::net::IpAddr>,
    /// This side's source address towards it.
    pub source: Option<std::net::IpAddr>,
}

/// Port layout of an engine: `base + dp_rank * tp_size + tp_rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPlan {
    base: u16,
    tp_size: u32,
    dp_ranks: Vec<u32>,
}

impl PortPlan {
    /// Builds the plan for the given data-parallel ranks, rejecting a zero
    /// group size, overflowing ports and collisions. `base == 0` means every
    /// rank binds any port and advertises the real one.
    pub fn new(base: u16, dp_ranks: &[u32], tp_size: u32) -> Result<Self, PlanError> {
        if tp_size == 0 {
            return Err(PlanError::ZeroTpSize);
        }
        let plan = Self {
            base,
            tp_size,
            dp_ranks: dp_ranks.to_vec(),
        };
        if base != 0 {
            let mut seen: HashMap<u16, String> = HashMap::new();
            for ranks in plan.ranks() {
                let port = plan.port(ranks)?;
                let name = format!("{}/{}", ranks.dp_rank, ranks.tp_rank);
                if let Some(first) = seen.insert(port, name.clone()) {
                    return Err(PlanError::Collision {
                        port,
                        first,
                        second: name,
                    });
                }
            }
        }
        Ok(plan)
    }

    /// All ranks of the plan, dp-major.
    pub fn ranks(&self) -> impl Iterator<Item = Ranks> + '_ {
        let tp_size = self.tp_size;
        self.dp_ranks.iter().flat_map(move |&dp| {
            (0..tp_size).map(move |tp| Ranks {
                dp_rank: dp,
                tp_rank: tp,
                tp_size,
            })
        })
    }

    /// Port of one rank (0 when the plan binds any port).
    pub fn port(&self, ranks: Ranks) -> Result<u16, PlanError> {
        if ranks.tp_rank >= self.tp_size {
            return Err(PlanError::RankOutOfRange {
                tp_rank: ranks.tp_rank,
                tp_size: self.tp_size,
            });
        }
        if self.base == 0 {
            return Ok(0);
        }
        let overflow = PlanError::Overflow {
            dp_rank: ranks.dp_rank,
            tp_rank: ranks.tp_rank,
            base: self.base,
        };
        let offset = u64::from(ranks.dp_rank) * u64::from(self.tp_size) + u64::from(ranks.tp_rank);
        let port = u64::from(self.base) + offset;
        u16::try_from(port).map_err(|_| overflow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_ids_are_checked() {
        assert_eq!(check_engine_id(""), Err(EngineIdError::Empty));
        assert_eq!(
            check_engine_id(&"e".repeat(257)),
            Err(EngineIdError::TooLong { len: 257, max: 256 })
        );
        assert!(matches!(
            check_engine_id("a\tb"),
            Err(EngineIdError::ControlChar { at: 1, .. })
        ));
        assert!(matches!(
            check_engine_id("a\u{85}"),
            Err(EngineIdError::ControlChar { at: 1, .. })
        ));
        for ok in ["e", "prefill-0", "décode 1/8", &"e".repeat(256)] {
            assert_eq!(check_engine_id(ok), Ok(()), "{ok:?}");
        }
    }
}
