//! What an agent reports: peer events and notifications.

use bytes::Bytes;
use kvlane_control::ConnectionId;

/// A notification delivered to this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Engine id of the sender.
    pub from: String,
    /// What the sender attached.
    pub payload: Bytes,
}

/// What happened to a peer, as seen by the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEventKind {
    /// Handshake done; the peer's KV cache is reachable (for a peer that
    /// dialed this agent and whose data plane cannot be reached from here,
    /// transfers only go from it to us; see [`Peer::prepare`](crate::Peer::prepare)).
    Up {
        /// Its engine id.
        engine_id: String,
        /// Its incarnation.
        incarnation: u64,
    },
    /// Keep-alives went unanswered.
    Suspect,
    /// It answered again.
    Recovered,
    /// It is dead; its in-flight transfers failed with `PeerLost`.
    Dead {
        /// Attempts or unanswered pings.
        attempts: u32,
        /// Last error.
        last_error: String,
    },
    /// It restarted; transfers prepared against `old` fail as stale.
    Restarted {
        /// Old incarnation.
        old: u64,
        /// New incarnation.
        new: u64,
    },
    /// The handshake, or connecting the data plane after it, was refused.
    Refused {
        /// Why.
        reason: String,
    },
    /// Connection released.
    Closed,
}

/// A peer event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerEvent {
    /// The connection.
    pub peer: ConnectionId,
    /// Its address.
    pub addr: String,
    /// What happened.
    pub kind: PeerEventKind,
}
