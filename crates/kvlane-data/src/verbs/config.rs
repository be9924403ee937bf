//! [`VerbsConfig`]: what a [`VerbsBackend`](super::VerbsBackend) is built with.

use super::device::DeviceConfig;
use super::qp::QpOptions;
use std::time::Duration;

/// Configuration of a [`VerbsBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device, port and GID selection.
    pub device: DeviceConfig,
    /// Queue pairs per peer; transfers are striped over them.
    pub qps_per_peer: usize,
    /// Queue-pair options (send queue depth, timeouts).
    pub qp: QpOptions,
    /// Largest piece a descriptor is split into before striping (further
    /// capped by the port's max message size). 1 MiB: not tuned on
    /// hardware; big enough that per-WR overhead is negligible, small enough
    /// that large descriptors spread over every QP.
    pub stripe_chunk: u64,
    /// Request a completion every this many work requests of one chain
    /// (selective signaling). 16: not measured; frees send-queue slots well
    /// before a 512-deep queue fills.
    pub signal_every: u32,
    /// Notification slots per peer (= receives kept posted for WRITE_WITH_IMM).
    pub notify_slots: u32,
    /// Transfers accepted but not yet returned by `poll` before `submit`
    /// answers [`SubmitError::QueueFull`](crate::SubmitError).
    pub max_in_flight: usize,
    /// Peers (prepared or connected) at once; past it `prepare_peer`
    /// refuses with [`DataError::Unsupported`](crate::DataError). Each peer
    /// costs `qps_per_peer` QPs, a mailbox and a staging buffer of
    /// `notify_slots` x 4 KiB each, and its share of a completion queue
    /// (CQs are opened as needed, so the cap is this, not one CQ's size).
    pub max_peers: usize,
    /// How long [`deregister`](crate::Backend::deregister) lets this
    /// backend's own transfers that use the region (as their local side)
    /// finish before it stops them; peers' accesses end with the memory
    /// registration itself. Default 100 ms, as tcp's.
    pub deregister_grace: Duration,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            device: DeviceConfig::default(),
            qps_per_peer: 2,
            qp: QpOptions::default(),
            stripe_chunk: 1 << 20,
            signal_every: 16,
            notify_slots: 64,
            max_in_flight: 4096,
            max_peers: 1024,
            deregister_grace: Duration::from_millis(100),
        }
    }
}
