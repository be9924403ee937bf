//! The facade's opaque error.

use kvlane_control::{ControlError, GroupError, PeerError};
use kvlane_data::{DataError, LayoutError, SubmitError};
use std::fmt;

/// What kind of failure an [`Error`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A deadline passed (transfer, handshake).
    Timeout,
    /// The peer died, restarted or was disconnected.
    PeerLost,
    /// The transfer was prepared against an older incarnation of the peer.
    Stale,
    /// The peer or target refused: wrong key, bounds, rights, handshake
    /// refusal (pre-shared key, version, fingerprint), peer cap.
    Refused,
    /// The request itself is invalid (layout, block ids, lengths).
    InvalidInput,
    /// A queue is full (the submission queue, or the target's queue of
    /// notifications its application has not taken); retry later.
    Busy,
    /// The backend or device cannot do this here.
    Unsupported,
    /// The agent is closed.
    Closed,
    /// Network or OS failure.
    Io,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Debug, thiserror::Error)]
enum Repr {
    #[error(transparent)]
    Data(DataError),
    #[error(transparent)]
    Submit(SubmitError),
    #[error(transparent)]
    Control(ControlError),
    #[error(transparent)]
    Group(GroupError),
    #[error(transparent)]
    Layout(LayoutError),
    #[error("{0}")]
    Message(String),
}

/// The error of every facade call: opaque, one pointer wide, `Send + Sync`.
/// Ask [`kind`](Self::kind) or the predicates; the message names the peer,
/// address, region or rank involved, and `source()` gives the crate error.
pub struct Error {
    inner: Box<(ErrorKind, Repr)>,
}

impl Error {
    fn new(kind: ErrorKind, repr: Repr) -> Self {
        Self {
            inner: Box::new((kind, repr)),
        }
    }

    pub(crate) fn msg(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Self::new(kind, Repr::Message(msg.into()))
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.inner.0
    }

    /// A deadline passed.
    pub fn is_timeout(&self) -> bool {
        self.kind() == ErrorKind::Timeout
    }

    /// The peer is gone (dead, restarted, disconnected).
    pub fn is_peer_lost(&self) -> bool {
        matches!(self.kind(), ErrorKind::PeerLost | ErrorKind::Stale)
    }

    /// The transfer targeted an older incarnation of a restarted peer.
    pub fn is_stale(&self) -> bool {
        self.kind() == ErrorKind::Stale
    }

    /// The peer refused (keys, bounds, rights, handshake).
    pub fn is_refused(&self) -> bool {
        self.kind() == ErrorKind::Refused
    }

    /// Retrying later may succeed (full queue).
    pub fn is_busy(&self) -> bool {
        self.kind() == ErrorKind::Busy
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.inner.0)
            .field("error", &self.inner.1)
            .finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner.1, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.inner.1 {
            Repr::Data(e) => Some(e),
            Repr::Submit(e) => Some(e),
            Repr::Control(e) => Some(e),
            Repr::Group(e) => Some(e),
            Repr::Layout(e) => Some(e),
            Repr::Message(_) => None,
        }
    }
}

pub(crate) fn data_kind(e: &DataError) -> ErrorKind {
    match e {
        e if e.is_timeout() => ErrorKind::Timeout,
        e if e.is_peer_lost() => ErrorKind::PeerLost,
        e if e.is_refused() => ErrorKind::Refused,
        e if e.is_busy() => ErrorKind::Busy,
        DataError::Unsupported { .. } => ErrorKind::Unsupported,
        DataError::Gpu(g) if g.is_unsupported() => ErrorKind::Unsupported,
        DataError::Gpu(kvlane_data::GpuError::NotDeviceMemory { .. }) => ErrorKind::InvalidInput,
        DataError::Gpu(_) => ErrorKind::Io,
        DataError::Shutdown(_) => ErrorKind::Closed,
        DataError::UnknownPeer(_) => ErrorKind::PeerLost,
        DataError::Io { .. } | DataError::Rdma { .. } | DataError::Unreachable { .. } => {
            ErrorKind::Io
        }
        #[cfg(feature = "verbs")]
        DataError::Verbs(kvlane_data::verbs::VerbsError::Unsupported(_)) => ErrorKind::Unsupported,
        #[cfg(feature = "verbs")]
        DataError::Verbs(_) => ErrorKind::Io,
        _ => ErrorKind::InvalidInput,
    }
}

impl From<DataError> for Error {
    fn from(e: DataError) -> Self {
        Self::new(data_kind(&e), Repr::Data(e))
    }
}

impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Self {
        let kind = match &e {
            SubmitError::QueueFull { .. } => ErrorKind::Busy,
            SubmitError::Rejected(d) => data_kind(d),
            _ => ErrorKind::InvalidInput,
        };
        Self::new(kind, Repr::Submit(e))
    }
}

impl From<ControlError> for Error {
    fn from(e: ControlError) -> Self {
        let kind = match &e {
            ControlError::ConnectTimeout { .. } => ErrorKind::Timeout,
            ControlError::Connect {
                last_error: PeerError::Refused(_),
                ..
            } => ErrorKind::Refused,
            ControlError::Connect {
                last_error: PeerError::HandshakeTimeout(_),
                ..
            } => ErrorKind::Timeout,
            ControlError::PeerCap { .. } => ErrorKind::Refused,
            ControlError::EngineId(_) => ErrorKind::InvalidInput,
            ControlError::UnknownPeer(_) | ControlError::NotReady { .. } => ErrorKind::PeerLost,
            ControlError::Closed => ErrorKind::Closed,
            _ => ErrorKind::Io,
        };
        Self::new(kind, Repr::Control(e))
    }
}

impl From<GroupError> for Error {
    fn from(e: GroupError) -> Self {
        let kind = match &e {
            GroupError::Plan(_) => ErrorKind::InvalidInput,
            _ => ErrorKind::PeerLost,
        };
        Self::new(kind, Repr::Group(e))
    }
}

impl From<LayoutError> for Error {
    fn from(e: LayoutError) -> Self {
        Self::new(ErrorKind::InvalidInput, Repr::Layout(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_one_pointer_and_thread_safe() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Error>();
        assert_eq!(size_of::<Error>(), size_of::<usize>());
    }

    #[test]
    fn kinds_follow_the_cause() {
        let e = Error::from(DataError::PeerLost {
            peer: kvlane_data::PeerId(3),
            reason: "connection reset",
            source: None,
        });
        assert!(e.is_peer_lost() && !e.is_timeout());
        assert!(e.to_string().contains("peer#3"), "{e}");
        let e = Error::from(DataError::NotificationQueueFull {
            peer: kvlane_data::PeerId(4),
            addr: "10.0.0.2:7000".parse().unwrap(),
        });
        assert!(e.is_busy(), "{e}");
        assert!(e.to_string().contains("10.0.0.2:7000"), "{e}");
        let e = Error::from(ControlError::ConnectTimeout {
            addr: "10.0.0.1:5555".into(),
            after: std::time::Duration::from_secs(1),
        });
        assert!(e.is_timeout());
        assert!(e.to_string().contains("10.0.0.1:5555"));
        let e = Error::from(LayoutError::CountMismatch {
            local: 1,
            remote: 2,
        });
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}
