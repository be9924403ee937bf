//! The exception hierarchy: `kvlane.Error` and one subclass per
//! [`kvlane::ErrorKind`]; the message is the Rust error's.

use kvlane::ErrorKind;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    kvlane,
    Error,
    PyException,
    "Base class of every kvlane error."
);
create_exception!(
    kvlane,
    TimeoutError,
    Error,
    "A deadline passed (transfer, handshake)."
);
create_exception!(
    kvlane,
    PeerLostError,
    Error,
    "The peer died, restarted or was disconnected."
);
create_exception!(
    kvlane,
    StaleError,
    PeerLostError,
    "The transfer was prepared against an older incarnation of the peer."
);
create_exception!(
    kvlane,
    RefusedError,
    Error,
    "The peer or target refused (keys, bounds, rights, handshake, peer cap)."
);
create_exception!(
    kvlane,
    BusyError,
    Error,
    "The submission queue is full; retry after earlier transfers completed."
);
create_exception!(
    kvlane,
    InvalidInputError,
    Error,
    "The request itself is invalid (layout, ids, spans, lengths, a released handle)."
);
create_exception!(
    kvlane,
    UnsupportedError,
    Error,
    "The backend or device cannot do this here."
);
create_exception!(kvlane, ClosedError, Error, "The agent is closed.");
create_exception!(kvlane, IoError, Error, "Network or OS failure.");

/// The Python exception of `kind` with `msg`.
pub(crate) fn error_of(kind: ErrorKind, msg: String) -> PyErr {
    match kind {
        ErrorKind::Timeout => TimeoutError::new_err(msg),
        ErrorKind::PeerLost => PeerLostError::new_err(msg),
        ErrorKind::Stale => StaleError::new_err(msg),
        ErrorKind::Refused => RefusedError::new_err(msg),
        ErrorKind::Busy => BusyError::new_err(msg),
        ErrorKind::InvalidInput => InvalidInputError::new_err(msg),
        ErrorKind::Unsupported => UnsupportedError::new_err(msg),
        ErrorKind::Closed => ClosedError::new_err(msg),
        ErrorKind::Io => IoError::new_err(msg),
        _ => Error::new_err(msg),
    }
}

/// Converts a facade error.
pub(crate) fn to_py(e: kvlane::Error) -> PyErr {
    error_of(e.kind(), e.to_string())
}

/// `kvlane.InvalidInputError(msg)`.
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidInputError::new_err(msg.into())
}

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("StaleError", py.get_type::<StaleError>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    m.add("BusyError", py.get_type::<BusyError>())?;
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    Ok(())
}
