//! State shared by the backend and its I/O threads: the completion and
//! notification queues, the waker, and the lock helper they all use.

use super::initiator::PeerConn;
use crate::ids::{FastMap, PeerId, TransferId};
use crate::transfer::Completion;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

/// A map keyed by transfer id.
pub(crate) type IdMap<V> = FastMap<TransferId, V>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Tables behind these locks stay consistent if a holder panicked.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Notifications that arrived and were not yet taken by
/// [`poll_notifications`](crate::Backend::poll_notifications), bounded
/// (see [`Shared::notify`]).
#[derive(Default)]
pub(crate) struct Notes {
    pub(crate) queue: VecDeque<(Option<PeerId>, Bytes)>,
    /// Payload bytes in `queue`.
    pub(crate) bytes: usize,
    /// Entries and payload bytes in `queue` by sender: what each holds of
    /// its share.
    pub(crate) held: FastMap<Option<PeerId>, (usize, usize)>,
}

impl Notes {
    /// Empties the queue (the application took everything).
    pub(crate) fn take(&mut self) -> impl Iterator<Item = (Option<PeerId>, Bytes)> + '_ {
        self.bytes = 0;
        self.held.clear();
        self.queue.drain(..)
    }
}

/// Bounds of the queue of notifications not yet taken (see
/// [`TcpConfig::max_notifications`](super::TcpConfig::max_notifications)).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NoteCaps {
    pub(crate) entries: usize,
    pub(crate) bytes: usize,
}

impl Default for NoteCaps {
    fn default() -> Self {
        Self {
            entries: super::MAX_NOTIFICATIONS,
            bytes: super::MAX_NOTIFICATION_BYTES,
        }
    }
}

/// State shared by the backend and its I/O threads.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) completions: Mutex<Vec<Completion>>,
    pub(crate) notifications: Mutex<Notes>,
    pub(crate) note_caps: NoteCaps,
    pub(crate) waker: Mutex<Option<Waker>>,
    /// Requests the submitting thread wrote itself (see
    /// `PeerConn::send_direct`).
    pub(crate) direct_sends: AtomicU64,
    /// Peers holding a credential: the queue of notifications is shared
    /// among them (see [`notify`](Self::notify)).
    pub(crate) peers: AtomicUsize,
    /// Connections made to replace failed ones, by peer and the failed
    /// one's generation (see `PeerConn::fail`); the backend takes them
    /// at its next `submit` or `poll`.
    pub(crate) replacements: Mutex<Vec<(PeerId, u64, Arc<PeerConn>)>>,
    /// Failed connections whose target could not be fenced.
    pub(crate) unfenced: AtomicU64,
    /// The backend dropped: replacements are closed, not queued (set
    /// under `replacements`' lock).
    pub(crate) closed: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Queues a completion; wakes the poller only when the queue was empty
    /// (otherwise an earlier push already woke it and it has not drained
    /// the queue since), which saves a syscall per completion in bursts.
    pub(crate) fn complete(&self, c: Completion) {
        let mut q = lock(&self.completions);
        let was_empty = q.is_empty();
        q.push(c);
        drop(q);
        if was_empty {
            self.wake();
        }
    }

    /// Queues a notification that arrived; wakes like [`complete`](Self::complete).
    /// False, queueing nothing, when the queue is at its caps (entries or
    /// payload bytes; an empty queue takes any one notification), or when
    /// the queue is half full and `from` holds its share: each peer with a
    /// credential gets an equal share of both caps (a peer that holds none
    /// may queue one while the queue has room). Below half, anyone queues
    /// (a lone peer's burst is not cut at its share of many idle peers);
    /// past it, only peers under their share do, so one peer cannot fill
    /// the queue for every peer. The caller refuses the notification on
    /// the wire rather than lose it.
    #[must_use]
    pub(crate) fn notify(&self, from: Option<PeerId>, payload: Bytes) -> bool {
        let caps = self.note_caps;
        let peers = self.peers.load(Ordering::Relaxed).max(1);
        let mut q = lock(&self.notifications);
        let was_empty = q.queue.is_empty();
        let full =
            q.queue.len() >= caps.entries || q.bytes.saturating_add(payload.len()) > caps.bytes;
        if full && !was_empty {
            return false;
        }
        let (entries, bytes) = q.held.get(&from).copied().unwrap_or_default();
        let over_share = entries >= (caps.entries / peers).max(1)
            || bytes.saturating_add(payload.len()) > caps.bytes / peers;
        let pressed = q.queue.len() >= caps.entries / 2
            || q.bytes.saturating_add(payload.len()) > caps.bytes / 2;
        if over_share && pressed && entries > 0 {
            return false;
        }
        q.bytes += payload.len();
        q.held.insert(from, (entries + 1, bytes + payload.len()));
        q.queue.push_back((from, payload));
        drop(q);
        if was_empty {
            self.wake();
        }
        true
    }

    /// Wakes the poller (deferred to the end of an I/O thread's turn; the
    /// waker may poll the backend right here, so it is not called under
    /// the lock).
    pub(crate) fn wake(&self) {
        let w = lock(&self.waker).clone();
        if let Some(w) = w {
            crate::progress::wake(w);
        }
    }
}
