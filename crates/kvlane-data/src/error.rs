//! The data plane's error types.

use crate::ids::{PeerId, RegionId, RemoteKey, TransferId};
use crate::memory::Access;
use crate::transfer::{Op, Transfer};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// [`DataError::Rdma`]'s status when the target's NIC refused the access
/// (`IBV_WC_REM_ACCESS_ERR`).
pub(crate) const REMOTE_ACCESS_ERROR: &str = "remote access error";

/// Everything that can go wrong in the data plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A region of zero bytes was registered.
    #[error("cannot register an empty region")]
    EmptyRegion,
    /// A null pointer was registered.
    #[error("cannot register memory at a null address")]
    NullPointer,
    /// Host memory could not be allocated.
    #[error("could not allocate {len} bytes of host memory")]
    Alloc {
        /// Requested length.
        len: usize,
    },
    /// A region longer than any allocation can be (`isize::MAX` bytes) was
    /// asked for.
    #[error("cannot allocate a region of {len} bytes: at most {max} bytes")]
    RegionTooLarge {
        /// Requested length.
        len: usize,
        /// The largest length a region can have.
        max: usize,
    },
    /// A local range is outside its region.
    #[error("range {offset}+{len} is outside {region} of {region_len} bytes")]
    OutOfBounds {
        /// The region.
        region: RegionId,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// A remote range is outside the region the target serves under `key`.
    #[error("remote range {offset}+{len} is outside {key} of {region_len} bytes at {peer}")]
    RemoteOutOfBounds {
        /// The target.
        peer: PeerId,
        /// The remote key.
        key: RemoteKey,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the remote region.
        region_len: u64,
    },
    /// A local region id is not registered with this backend.
    #[error("{0} is not registered with this backend")]
    UnknownRegion(RegionId),
    /// The target serves no region under this key.
    #[error("{peer} serves no region under {key}")]
    UnknownKey {
        /// The target.
        peer: PeerId,
        /// The unknown key.
        key: RemoteKey,
    },
    /// The region lacks a right the operation needs.
    #[error("{op} needs {needed} on {target}, which only grants {granted}")]
    AccessDenied {
        /// The operation.
        op: Op,
        /// `"local region#N"` or `"remote key#N at peer#M"`.
        target: String,
        /// The missing right.
        needed: Access,
        /// What the region grants.
        granted: Access,
    },
    /// Local and remote descriptor lists do not move the same number of bytes.
    #[error("local descriptors cover {local} bytes but remote descriptors cover {remote}")]
    LengthMismatch {
        /// Sum of local lengths.
        local: u64,
        /// Sum of remote lengths.
        remote: u64,
    },
    /// The transfer missed its deadline; the target bytes are unspecified.
    #[error("{id} to {peer} missed its deadline by {overdue:?}")]
    Timeout {
        /// The transfer.
        id: TransferId,
        /// The target.
        peer: PeerId,
        /// How late the backend noticed.
        overdue: Duration,
    },
    /// The peer is gone (connection broken, peer removed or dead).
    #[error("{peer} was lost: {reason}")]
    PeerLost {
        /// The peer.
        peer: PeerId,
        /// What happened, e.g. "connection reset" or "peer removed".
        reason: &'static str,
        /// The I/O error behind it, if any.
        #[source]
        source: Option<Arc<io::Error>>,
    },
    /// The peer id is not known to this backend.
    #[error("{0} is not connected to this backend")]
    UnknownPeer(PeerId),
    /// A cpu placement (`KVLANE_CPUS`, `AgentBuilder::cpus`) that does not
    /// parse.
    #[error(
        "invalid cpu placement {value:?}: it {reason} (use inherit, all, or a cpu list like 0-3,8)"
    )]
    InvalidCpus {
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A cpu placement that the kernel refused for this process (none of
    /// its cpus is one the process may use).
    #[error("cannot place kvlane's threads on cpus {cpus}: {source}")]
    Placement {
        /// The placement asked for.
        cpus: String,
        /// The error of `sched_setaffinity`.
        #[source]
        source: io::Error,
    },
    /// The backend cannot do this here.
    #[error("{backend}: unsupported: {what}")]
    Unsupported {
        /// Which backend (or facility).
        backend: &'static str,
        /// What is missing, and why.
        what: &'static str,
    },
    /// The transfer id is already in flight on this backend.
    #[error("{0} is already in flight")]
    DuplicateTransfer(TransferId),
    /// A notification payload is larger than the backend can deliver.
    #[error("notification of {len} bytes exceeds the limit of {max}")]
    NotificationTooLarge {
        /// Payload length.
        len: usize,
        /// The backend's limit.
        max: usize,
    },
    /// The target refused the transfer's notification because its queue
    /// of notifications not yet taken by its application is full. The
    /// transfer's data landed; the notification was not delivered.
    #[error(
        "{peer} at {addr} refused the notification: the target's notification queue is full \
         (its application is not taking notifications); the data landed, retry later"
    )]
    NotificationQueueFull {
        /// The target.
        peer: PeerId,
        /// The target's `host:port`.
        addr: std::net::SocketAddr,
    },
    /// The target refused a notification (shm backend): its queue of
    /// notifications not yet taken by its application is full. The
    /// transfer's data landed; the notification was not delivered.
    #[error(
        "{peer} refused the notification: the target's notification queue is full \
         (its application is not taking notifications); the data landed, retry later"
    )]
    NotificationRefused {
        /// The target.
        peer: PeerId,
    },
    /// A same-host peer passed a region this side will not map (shm
    /// backend): not a memory file sealed against shrinking, shorter than
    /// it claims, or not mappable with the rights it grants.
    #[error("{backend}: region {key} of {peer} refused: {reason}")]
    PeerRegionRefused {
        /// The backend.
        backend: &'static str,
        /// The peer that passed it.
        peer: PeerId,
        /// The key it was granted under.
        key: RemoteKey,
        /// Why it was refused.
        reason: String,
    },
    /// A same-host peer's region served by cross-memory attach (shm
    /// backend) could not be copied at `offset`: the target unmapped or
    /// freed that memory, mapped it read-only for a WRITE, or the kernel
    /// refused the attach (`reason` says which and what to do). Bytes
    /// before `offset` may have been copied.
    #[error("{backend}: {op} at offset {offset} of region {key} of {peer} failed: {reason}")]
    RemoteMemoryFault {
        /// The backend.
        backend: &'static str,
        /// The target.
        peer: PeerId,
        /// READ or WRITE.
        op: Op,
        /// The region's key.
        key: RemoteKey,
        /// Where in the region the copy stopped.
        offset: u64,
        /// Why, from the kernel's answer.
        reason: String,
    },
    /// The target deregistered the region under `key` while this WRITE's
    /// payload was arriving: part of it may have landed, the rest was
    /// dropped. Requests for the key fail with
    /// [`UnknownKey`](Self::UnknownKey) from now on.
    #[error(
        "{peer} at {addr} deregistered the region under {key} while this write was in progress; the bytes may have partly landed"
    )]
    RemoteRegionRevoked {
        /// The target.
        peer: PeerId,
        /// The remote key.
        key: RemoteKey,
        /// The target's `host:port`.
        addr: std::net::SocketAddr,
    },
    /// The transfer's local region was deregistered while the transfer
    /// was using it, and the transfer did not end within the backend's
    /// grace: it was stopped (verbs: its queue pairs failed) so that the
    /// region's memory is reached no more once `deregister` returns. Part
    /// of the data may have moved.
    #[error("{region} was deregistered while {id} was using it; the transfer was stopped and may have partly moved")]
    LocalRegionDeregistered {
        /// The transfer.
        id: TransferId,
        /// The deregistered region.
        region: RegionId,
    },
    /// Deregistering a region could not confirm that the backend stopped
    /// touching its memory (an I/O thread did not answer): the region is no
    /// longer served, but its memory must not be freed or reused; keep it
    /// alive (a bug: please report it with the log).
    #[error(
        "{region} was deregistered but {in_flight} accesses to it did not end within {waited:?}; do not free its memory"
    )]
    DeregisterStuck {
        /// The region.
        region: RegionId,
        /// Accesses still in flight.
        in_flight: usize,
        /// How long deregistration waited.
        waited: Duration,
    },
    /// A peer's advertised data-plane address cannot be reached from where
    /// this side reached the peer.
    #[error(
        "data endpoint {advertised} (the target listens on {listen}) cannot be reached: {why}"
    )]
    Unreachable {
        /// The address the target advertised.
        advertised: std::net::SocketAddr,
        /// What its listener is bound to.
        listen: std::net::SocketAddr,
        /// Why it cannot be reached (naming the host this side reached the
        /// target's control plane at).
        why: String,
    },
    /// An endpoint from a peer could not be decoded.
    #[error("endpoint for the {backend} backend could not be decoded: {reason}")]
    BadEndpoint {
        /// The backend that tried.
        backend: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The backend was shut down before the transfer completed.
    #[error("backend shut down with {0} still in flight")]
    Shutdown(TransferId),
    /// The RDMA NIC failed a work request of the transfer (verbs backend):
    /// remote access error, retry exceeded, queue pair flushed, ...
    #[error("{op} to {peer} failed on rdma device {device} queue pair {qpn}: {status} (vendor error {vendor_err:#x})")]
    Rdma {
        /// The target.
        peer: PeerId,
        /// The operation.
        op: Op,
        /// The local RDMA device.
        device: String,
        /// The local queue pair number.
        qpn: u32,
        /// The work completion status, e.g. "remote access error".
        status: &'static str,
        /// Vendor-specific error code from the completion.
        vendor_err: u32,
    },
    /// GPU memory cannot be used here (no runtime, no device) or a driver
    /// call failed; the error names the device.
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    /// Setting up or using the verbs backend failed (device, registration,
    /// queue pair); the error names the device.
    #[cfg(feature = "verbs")]
    #[error(transparent)]
    Verbs(#[from] crate::verbs::VerbsError),
    /// An I/O operation failed.
    #[error("{op} failed")]
    Io {
        /// The operation, e.g. "bind tcp listener 127.0.0.1:0".
        op: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl DataError {
    /// Whether the error is a missed deadline.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }

    /// Whether the target could not take the work now, and retrying later
    /// may succeed (its notification queue was full).
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            Self::NotificationQueueFull { .. } | Self::NotificationRefused { .. }
        )
    }

    /// Whether the error means the peer is gone.
    pub fn is_peer_lost(&self) -> bool {
        matches!(self, Self::PeerLost { .. })
    }

    /// Whether the target (or the local checks standing in for it) refused
    /// the request: unknown key, out of bounds, missing access right. Over
    /// RDMA the target's NIC refuses with a remote access error (a dead or
    /// wrong rkey, a range outside the memory registration).
    pub fn is_refused(&self) -> bool {
        match self {
            Self::UnknownKey { .. }
            | Self::RemoteRegionRevoked { .. }
            | Self::RemoteMemoryFault { .. }
            | Self::RemoteOutOfBounds { .. }
            | Self::OutOfBounds { .. }
            | Self::AccessDenied { .. }
            | Self::UnknownRegion(_) => true,
            Self::Rdma { status, .. } => *status == REMOTE_ACCESS_ERROR,
            _ => false,
        }
    }
}

/// Why [`Backend::submit`](crate::Backend::submit) did not accept a transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The submission queue is full: poll completions and submit again.
    /// The transfer is handed back untouched; nothing was lost.
    #[error("submission queue full ({} still in flight); poll and retry {}", .in_flight, .transfer.id)]
    QueueFull {
        /// The transfer, handed back.
        transfer: Box<Transfer>,
        /// Transfers in flight at the time.
        in_flight: usize,
    },
    /// The transfer is malformed or names something unknown locally.
    #[error("transfer rejected")]
    Rejected(#[source] DataError),
}

impl SubmitError {
    /// Whether submitting again later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::QueueFull { .. })
    }

    /// The transfer, when it was handed back.
    pub fn into_transfer(self) -> Option<Transfer> {
        match self {
            Self::QueueFull { transfer, .. } => Some(*transfer),
            Self::Rejected(_) => None,
        }
    }
}
