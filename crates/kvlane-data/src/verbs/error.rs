//! Errors of the verbs backend.

use std::error::Error as StdError;
use std::io;

/// Why RDMA verbs cannot be used on this host at all.
///
/// Returned inside [`VerbsError::Unsupported`] by [`probe`](super::probe) and every
/// constructor; `auto` backend selection treats any of these as "fall back to tcp".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// `libibverbs.so.1` could not be loaded at run time.
    #[error("libibverbs.so.1 could not be loaded (install rdma-core: libibverbs1 and ibverbs-providers)")]
    LibraryMissing,
    /// libibverbs is there but the kernel has no verbs support (`ENOSYS`).
    #[error(
        "the kernel has no rdma verbs support (no /sys/class/infiniband_verbs; \
         load ib_uverbs and an rdma driver, e.g. `modprobe rdma_rxe`)"
    )]
    NoKernelSupport,
    /// The kernel supports verbs but no RDMA device exists.
    #[error("no rdma device found (/sys/class/infiniband is empty; for soft-roce: `rdma link add rxe0 type rxe netdev <if>`)")]
    NoDevices,
    /// Devices exist but none has a port in the ACTIVE state.
    #[error("no rdma device has an active port (devices: {devices})")]
    NoActivePort {
        /// Names of the devices that were inspected, comma separated.
        devices: String,
    },
    /// The operation is not supported by the provider (`EOPNOTSUPP`).
    #[error("{what} is not supported by device {device}")]
    Operation {
        /// The device that refused.
        device: String,
        /// What was attempted.
        what: &'static str,
    },
}

/// Error of the verbs backend. Every variant names the device (and port, queue
/// pair, peer or operation where there is one).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// RDMA cannot be used on this host; the reason says why.
    #[error("rdma verbs unavailable: {0}")]
    Unsupported(#[from] Unsupported),
    /// Listing devices failed for another reason than missing support.
    #[error("failed to list rdma devices")]
    ListDevices(#[source] io::Error),
    /// The requested device does not exist.
    #[error("rdma device {name} not found (available: {available})")]
    DeviceNotFound {
        /// The name that was asked for.
        name: String,
        /// Devices that do exist, comma separated.
        available: String,
    },
    /// The requested port does not exist or is not ACTIVE.
    #[error("port {port} of rdma device {device} is not usable: {state}")]
    PortNotUsable {
        /// Device name.
        device: String,
        /// Port number (1-based).
        port: u8,
        /// Port state as reported by the device.
        state: String,
    },
    /// Opening the device failed.
    #[error("failed to open rdma device {device}")]
    OpenDevice {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A device, port or GID query failed.
    #[error("failed to query {what} of rdma device {device}")]
    Query {
        /// Device name.
        device: String,
        /// What was queried (`device attributes`, `port 1`, `gid table`).
        what: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// No GID matching the selection exists on the port.
    #[error("no {wanted} gid on port {port} of rdma device {device} (gids: {available})")]
    NoGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// What was asked for.
        wanted: String,
        /// GIDs present on the port.
        available: String,
    },
    /// Allocating a verbs object (PD, CQ, QP) failed.
    #[error("failed to create {what} on rdma device {device}")]
    Create {
        /// Device name.
        device: String,
        /// Object kind and size, e.g. `completion queue (4096 entries)`.
        what: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Memory registration failed.
    #[error("failed to register {len} bytes of {kind} memory on rdma device {device}")]
    RegisterMemory {
        /// Device name.
        device: String,
        /// `host` or `dma-buf`.
        kind: &'static str,
        /// Length in bytes.
        len: usize,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// GPU memory could be registered neither by dma-buf nor by address;
    /// both failures are named. It is never registered as host memory.
    #[error("cannot register {len} bytes of {gpu} memory on rdma device {device}: by dma-buf: {dmabuf}; by address (needs a peer-memory module such as nvidia-peermem): {address}")]
    RegisterGpu {
        /// RDMA device name.
        device: String,
        /// The GPU.
        gpu: crate::gpu::GpuDevice,
        /// Length in bytes.
        len: usize,
        /// Why dma-buf export or `ibv_reg_dmabuf_mr` failed.
        dmabuf: Box<crate::DataError>,
        /// Why `ibv_reg_mr` on the device address failed.
        #[source]
        address: Box<Self>,
    },
    /// A queue pair state transition failed.
    #[error("failed to move queue pair {qpn} on rdma device {device} to {state}")]
    ModifyQp {
        /// Device name.
        device: String,
        /// Local queue pair number.
        qpn: u32,
        /// Target state (`INIT`, `RTR`, `RTS`, `ERR`).
        state: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The remote endpoint cannot be connected to (e.g. GID type mismatch).
    #[error("invalid remote endpoint for queue pair {qpn} on rdma device {device}: {reason}")]
    InvalidEndpoint {
        /// Device name.
        device: String,
        /// Local queue pair number.
        qpn: u32,
        /// What is wrong.
        reason: &'static str,
    },
    /// Posting work requests failed.
    #[error("failed to post {what} on queue pair {qpn} of rdma device {device}")]
    Post {
        /// Device name.
        device: String,
        /// Local queue pair number.
        qpn: u32,
        /// `send work requests` or `receive work requests`.
        what: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Polling the completion queue failed.
    #[error("failed to poll completion queue of rdma device {device}")]
    PollCq {
        /// Device name.
        device: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

/// Finds the errno behind a sideway error and returns it as an owned
/// `io::Error`. sideway wraps every errno in kind enums marked
/// `#[error(transparent)]`, which hide the `io::Error` from `source()`
/// chains; their `Display` is the io error's, which ends in `(os error N)`.
pub(crate) fn io_cause(err: &(dyn StdError + 'static)) -> io::Error {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return match io.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(io.kind(), io.to_string()),
            };
        }
        if let Some(code) = os_error_code(&e.to_string()) {
            return io::Error::from_raw_os_error(code);
        }
        cur = e.source();
    }
    io::Error::other(err.to_string())
}

/// Parses the `(os error N)` suffix `io::Error`'s `Display` ends with.
fn os_error_code(msg: &str) -> Option<i32> {
    let rest = &msg[msg.rfind("(os error ")? + "(os error ".len()..];
    rest.strip_suffix(')')?.parse().ok()
}

/// `true` when the errno says "not supported by this provider / kernel".
pub(crate) fn is_unsupported(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(code) if code == libc_errno::EOPNOTSUPP || code == libc_errno::ENOSYS
    )
}

/// The two errno values we classify, without a `libc` dependency.
pub(crate) mod libc_errno {
    /// Function not implemented (Linux).
    pub(crate) const ENOSYS: i32 = 38;
    /// Operation not supported (Linux).
    pub(crate) const EOPNOTSUPP: i32 = 95;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error(transparent)]
    enum Kind {
        Ibverbs(#[from] io::Error),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("failed to get device list")]
    struct Outer(#[from] Kind);

    #[test]
    fn errno_is_found_behind_transparent_wrappers() {
        let e = Outer(Kind::Ibverbs(io::Error::from_raw_os_error(
            libc_errno::EOPNOTSUPP,
        )));
        assert_eq!(io_cause(&e).raw_os_error(), Some(libc_errno::EOPNOTSUPP));
        assert!(is_unsupported(&io_cause(&e)));
        let plain = io::Error::from_raw_os_error(libc_errno::ENOSYS);
        assert_eq!(io_cause(&plain).raw_os_error(), Some(libc_errno::ENOSYS));
        assert_eq!(os_error_code("x (os error 12)"), Some(12));
        assert_eq!(os_error_code("no code"), None);
    }
}
