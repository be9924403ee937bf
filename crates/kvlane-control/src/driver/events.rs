//! The owner's event stream ([`ControlNode::take_events`](super::ControlNode::take_events)):
//! lossless for peer lifecycle, bounded for notifications.
//!
//! State changes (`Ready`, `Suspect`, `Recovered`, `Dead`, `Restarted`,
//! `Closed`, and refusals of connections we dialed) are never dropped:
//! they come only from connections we dialed or that proved themselves
//! (reached `Ready`), so there are at most a few per such connection, and
//! those are capped by [`Config::peer_cap`](crate::Config::peer_cap).
//! Events of accepted connections that never reached `Ready` (refused,
//! evicted or timed-out handshakes: anybody can cause them, in any number)
//! are not queued at all; they are counted in [`Stats`](crate::Stats).
//! Notifications are noise in this sense: at most
//! [`Config::event_capacity`](crate::Config::event_capacity) wait unread,
//! more are dropped and counted ([`Stats::events_dropped`](crate::Stats::events_dropped)).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::ids::ConnectionId;
use crate::peer::{Event, Role};
use crate::registry::PeerEvent;

#[derive(Debug, Default)]
struct Shared {
    /// Notifications queued and not yet read.
    notes: AtomicUsize,
    /// Events of any kind queued and not yet read.
    queued: AtomicUsize,
    /// Whether the stream was handed out; until then everything is bounded
    /// (nobody may ever read it).
    taken: AtomicBool,
}

/// A node's owner event stream; see [`ControlNode::take_events`](super::ControlNode::take_events).
#[derive(Debug)]
pub struct EventStream {
    rx: mpsc::UnboundedReceiver<PeerEvent>,
    shared: Arc<Shared>,
}

impl EventStream {
    /// The next event; `None` once the node's driver has stopped and every
    /// event was read. Cancel-safe.
    pub async fn recv(&mut self) -> Option<PeerEvent> {
        let ev = self.rx.recv().await?;
        self.read(&ev);
        Some(ev)
    }

    /// The next event if one is queued now.
    pub fn try_recv(&mut self) -> Option<PeerEvent> {
        let ev = self.rx.try_recv().ok()?;
        self.read(&ev);
        Some(ev)
    }

    fn read(&self, ev: &PeerEvent) {
        // Saturating: the supervisor's last word is not counted.
        let down = |n: usize| Some(n.saturating_sub(1));
        let _ = self
            .shared
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, down);
        if matches!(ev.event, Event::Notification { .. }) {
            let _ = self
                .shared
                .notes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, down);
        }
    }
}

/// The driver's end of the stream.
#[derive(Debug)]
pub(super) struct EventQueue {
    tx: mpsc::UnboundedSender<PeerEvent>,
    shared: Arc<Shared>,
    cap: usize,
    /// Accepted connections that reached `Ready` (their lifecycle is
    /// queued); forgotten at `Closed`.
    proven: HashSet<ConnectionId>,
    dropped: u64,
}

impl EventQueue {
    /// A queue holding at most `cap` unread notifications.
    pub(super) fn new(cap: usize) -> (Self, EventStream) {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::default());
        let queue = Self {
            tx,
            shared: Arc::clone(&shared),
            cap,
            proven: HashSet::new(),
            dropped: 0,
        };
        (queue, EventStream { rx, shared })
    }

    /// Marks the stream as handed to its owner.
    pub(super) fn mark_taken(stream: &EventStream) {
        stream.shared.taken.store(true, Ordering::Release);
    }

    /// A sender for the supervisor's last word (a `Closed` when the driver
    /// died), which is always delivered.
    pub(super) fn last_word(&self) -> mpsc::UnboundedSender<PeerEvent> {
        self.tx.clone()
    }

    /// Events dropped so far (notifications past the cap, or anything past
    /// it before the stream was taken).
    pub(super) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Whether `ev` belongs in the stream at all (see the module docs).
    pub(super) fn wants(&mut self, ev: &PeerEvent) -> bool {
        match (&ev.event, ev.role) {
            (Event::Pong { .. }, _) => false,
            (_, Role::Initiator) => true,
            (Event::Ready(_) | Event::Restarted { .. }, Role::Acceptor) => {
                self.proven.insert(ev.id);
                true
            }
            (Event::Closed, Role::Acceptor) => self.proven.remove(&ev.id),
            (_, Role::Acceptor) => self.proven.contains(&ev.id),
        }
    }

    /// Queues `ev` (which [`wants`](Self::wants) accepted).
    pub(super) fn push(&mut self, ev: PeerEvent) {
        let note = matches!(ev.event, Event::Notification { .. });
        let taken = self.shared.taken.load(Ordering::Acquire);
        let full = if taken {
            note && self.shared.notes.load(Ordering::Acquire) >= self.cap
        } else {
            self.shared.queued.load(Ordering::Acquire) >= self.cap
        };
        if full {
            self.dropped += 1;
            return;
        }
        if note {
            self.shared.notes.fetch_add(1, Ordering::AcqRel);
        }
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(ev).is_err() {
            // The owner dropped its stream: nothing more to keep.
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            if note {
                self.shared.notes.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Forgets proven connections the registry no longer tracks (one that
    /// was released without a `Closed` reaching here).
    pub(super) fn prune(&mut self, live: usize, tracked: impl Fn(ConnectionId) -> bool) {
        if self.proven.len() > live {
            self.proven.retain(|id| tracked(*id));
        }
    }
}
