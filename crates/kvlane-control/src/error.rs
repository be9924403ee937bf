//! Typed errors of the control plane. Every error names what it is about:
//! the peer address, the rank, the number of attempts.

use std::fmt;
use std::time::Duration;

use crate::ids::{ConnectionId, Ranks};

/// Errors produced while encoding or decoding a control-plane frame.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// The frame is larger than the configured cap.
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    Oversized {
        /// Size of the refused frame.
        len: usize,
        /// Configured cap.
        cap: usize,
    },
    /// The frame is not a msgpack map with the fields of its `type`.
    #[error("malformed frame: {reason}")]
    Malformed {
        /// Decoder message.
        reason: String,
    },
    /// The `type` tag is not one this version knows.
    #[error("unknown message type {kind:?}")]
    UnknownType {
        /// The received tag.
        kind: String,
    },
    /// The protocol version differs from ours.
    #[error("protocol version mismatch: local {local}, remote {remote}")]
    VersionMismatch {
        /// Our version.
        local: u16,
        /// The version in the frame.
        remote: u16,
    },
    /// Encoding failed (only possible for unserializable payloads).
    #[error("encode failed: {reason}")]
    Encode {
        /// Encoder message.
        reason: String,
    },
}

/// Why a sealed message did not open
/// ([`SessionKey::open`](crate::SessionKey::open)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// Shorter than a nonce and a tag: not a sealed message.
    #[error("sealed message of {len} bytes is shorter than the {min} bytes of its nonce and tag")]
    TooShort {
        /// Its length.
        len: usize,
        /// The least a sealed message has.
        min: usize,
    },
    /// The tag does not verify: altered on the way, or sealed under
    /// another session's key or for another purpose.
    #[error("sealed message does not open as {label:?} under this session's key (altered, or sealed for another session or purpose)")]
    Mismatch {
        /// The purpose it was opened for.
        label: String,
    },
}

/// Why a handshake was refused (by us or by the remote side).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// Protocol versions differ.
    #[error("protocol version mismatch: local {local}, remote {remote}")]
    Version {
        /// Our version.
        local: u16,
        /// The remote version.
        remote: u16,
    },
    /// Configuration fingerprints differ.
    #[error("config fingerprint mismatch: local {local:?}, remote {remote:?}")]
    Fingerprint {
        /// Our fingerprint.
        local: String,
        /// The remote fingerprint.
        remote: String,
    },
    /// The pre-shared key check failed (wrong key, or only one side has a key).
    #[error("authentication failed: {reason}")]
    Auth {
        /// What failed.
        reason: String,
    },
    /// The handshake came back to the node that started it: whoever is at
    /// `peer` relayed this node's own handshake to it (a reflection), or
    /// another node runs with the very same identity (incarnation included).
    #[error("{peer} reflected this node's own handshake back to it")]
    Reflected {
        /// The address the reflected handshake came from or went to.
        peer: String,
    },
    /// The peer claims an engine id that cannot name an engine.
    #[error("{peer} sent a malformed engine id: {problem}")]
    EngineId {
        /// The address the handshake came from or went to.
        peer: String,
        /// What is wrong with the id.
        problem: crate::config::EngineIdError,
    },
    /// The remote node has reached its peer cap.
    #[error("peer cap of {cap} reached")]
    PeerCap {
        /// The cap.
        cap: usize,
    },
    /// The remote side refused with an `error` message.
    #[error("remote refused ({code}): {reason}")]
    Remote {
        /// Error code sent by the remote.
        code: String,
        /// Reason sent by the remote.
        reason: String,
    },
}

impl Refusal {
    /// Stable wire code of this refusal.
    pub fn code(&self) -> &str {
        match self {
            Self::Version { .. } => "version_mismatch",
            Self::Fingerprint { .. } => "fingerprint_mismatch",
            Self::Auth { .. } => "auth_failed",
            Self::Reflected { .. } => "reflected",
            Self::EngineId { .. } => "bad_engine_id",
            Self::PeerCap { .. } => "peer_cap",
            Self::Remote { code, .. } => code,
        }
    }
}

/// The last error seen on a connection before it was declared dead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// No answer to the handshake within the deadline.
    #[error("handshake timed out after {0:?}")]
    HandshakeTimeout(Duration),
    /// Pings went unanswered past the liveness budget.
    #[error("{missed} keep-alive pings unanswered")]
    KeepAliveTimeout {
        /// Number of unanswered pings.
        missed: u32,
    },
    /// The channel reported an I/O failure.
    #[error("channel error: {0}")]
    Channel(String),
    /// The remote side said goodbye.
    #[error("remote closed the connection")]
    RemoteClosed,
    /// The handshake was refused.
    #[error("handshake refused: {0}")]
    Refused(Refusal),
    /// A newer connection from the same peer replaced this one.
    #[error("replaced by a newer connection from the same peer")]
    Replaced,
}

/// Failure of one rank in a group handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank that failed.
    pub ranks: Ranks,
    /// The address that was tried.
    pub addr: String,
    /// Its own cause.
    pub cause: String,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp_rank {} tp_rank {} at {}: {}",
            self.ranks.dp_rank, self.ranks.tp_rank, self.addr, self.cause
        )
    }
}

/// The uniform verdict of a failed group handshake: every failing rank with
/// its own cause.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// One or more ranks failed; the group is not usable.
    #[error("group handshake with {host} failed on {} of {total} ranks: {}", failures.len(), join(failures))]
    RanksFailed {
        /// Remote host.
        host: String,
        /// Number of ranks in the group.
        total: usize,
        /// Every failing rank.
        failures: Vec<RankFailure>,
    },
    /// The port plan is invalid.
    #[error("invalid port plan: {0}")]
    Plan(#[from] PlanError),
}

fn join(failures: &[RankFailure]) -> String {
    failures
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// An invalid rank/port plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// `tp_size` is zero.
    #[error("tp_size must be at least 1")]
    ZeroTpSize,
    /// A rank is outside the group.
    #[error("tp_rank {tp_rank} is not below tp_size {tp_size}")]
    RankOutOfRange {
        /// The rank.
        tp_rank: u32,
        /// The group size.
        tp_size: u32,
    },
    /// Two ranks map to the same port.
    #[error("port {port} is used by both {first} and {second}")]
    Collision {
        /// The port.
        port: u16,
        /// First rank as `dp/tp`.
        first: String,
        /// Second rank as `dp/tp`.
        second: String,
    },
    /// A port is outside 1..=65535.
    #[error("port of dp_rank {dp_rank} tp_rank {tp_rank} overflows (base {base})")]
    Overflow {
        /// dp rank.
        dp_rank: u32,
        /// tp rank.
        tp_rank: u32,
        /// Base port.
        base: u16,
    },
}

/// Errors of the tokio driver ([`crate::ControlNode`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Binding the listener failed.
    #[error("bind {addr} failed: {reason}")]
    Bind {
        /// Requested address.
        addr: String,
        /// OS or channel reason.
        reason: String,
    },
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// This node's own engine id cannot name an engine.
    #[error("invalid local identity: {0}")]
    EngineId(#[from] crate::config::EngineIdError),
    /// Connecting to a peer failed.
    #[error("connect to {addr} failed after {attempts} attempts: {last_error}")]
    Connect {
        /// Peer address.
        addr: String,
        /// Attempts made.
        attempts: u32,
        /// Last error.
        last_error: PeerError,
    },
    /// Connecting did not finish within the deadline.
    #[error("connect to {addr} timed out after {after:?}")]
    ConnectTimeout {
        /// Peer address.
        addr: String,
        /// The deadline.
        after: Duration,
    },
    /// The peer cap is reached.
    #[error("peer cap of {cap} reached; refusing {addr}")]
    PeerCap {
        /// Refused address.
        addr: String,
        /// The cap.
        cap: usize,
    },
    /// No such peer.
    #[error("unknown peer {0}")]
    UnknownPeer(ConnectionId),
    /// An explicit ping was given up before its pong came: newer pings
    /// of the same peer took its place (at most `waiting` wait per peer;
    /// the peer machine no longer recognizes an older one's pong). The
    /// peer is up but does not answer explicit pings.
    #[error("ping of peer {peer} ({addr}) dropped unanswered: {waiting} newer pings are waiting")]
    PingDropped {
        /// Peer id.
        peer: ConnectionId,
        /// Peer address.
        addr: String,
        /// Pings that wait per peer at most.
        waiting: usize,
    },
    /// The peer is not ready to carry messages.
    #[error("peer {peer} ({addr}) is not ready: {state:?}")]
    NotReady {
        /// Peer id.
        peer: ConnectionId,
        /// Peer address.
        addr: String,
        /// Its state.
        state: crate::State,
    },
    /// The peer restarted (or reconnected with a new incarnation) since
    /// the caller learned about it: state derived from the old incarnation
    /// (rkeys, regions) must not be used.
    #[error(
        "peer {peer} ({addr}) restarted: expected incarnation {expected:#x}, now {current:#x}"
    )]
    StaleIncarnation {
        /// Peer id.
        peer: ConnectionId,
        /// Peer address.
        addr: String,
        /// Incarnation the caller prepared against.
        expected: u64,
        /// Current incarnation.
        current: u64,
    },
    /// A notification payload is over [`Config::notify_cap`](crate::Config::notify_cap).
    #[error("notification payload of {len} bytes exceeds the cap of {cap} bytes")]
    PayloadTooLarge {
        /// Payload size.
        len: usize,
        /// The cap.
        cap: usize,
    },
    /// The driver did not answer in time (it is overloaded or stuck).
    #[error("{op} timed out after {after:?} waiting for the control driver")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The node is closed.
    #[error("control node is closed")]
    Closed,
    /// A frame could not be encoded.
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// A preflight probe failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The TCP connect failed with an OS error.
    #[error("{addr} is unreachable: {source}")]
    Unreachable {
        /// Probed `host:port`.
        addr: String,
        /// OS reason.
        #[source]
        source: std::io::Error,
    },
    /// The connect did not finish in time.
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout {
        /// Probed `host:port`.
        addr: String,
        /// The timeout.
        timeout: Duration,
    },
}
