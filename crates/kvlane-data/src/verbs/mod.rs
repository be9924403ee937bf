//! RDMA verbs backend (cargo feature `verbs`): libibverbs through the
//! `sideway` crate, which loads `libibverbs.so.1` at run time.
//!
//! * Discovery: [`list_devices`], [`probe`] (what `kvlane devices` prints),
//!   [`select`] (by [`DeviceConfig`], [`ENV_DEVICE`], or first ACTIVE port;
//!   GID: RoCE v2 IPv4-mapped by default).
//! * Resources (RAII, child holds parent by `Arc`): [`Context`] →
//!   [`ProtectionDomain`] → [`MemoryRegistration`] (host or dma-buf),
//!   [`CompletionQueue`], and the queue-pair typestate [`QpBuilder`] →
//!   [`PreparedQp`] (its [`QpEndpoint`] goes into the handshake) →
//!   [`ConnectedQp`].
//!
//! * Data path: [`VerbsBackend`] implements [`Backend`](crate::Backend):
//!   several RC QPs per peer, transfers split at the port's max message
//!   size and striped over the QPs (start QP rotates by transfer id), one
//!   work-request chain and doorbell per QP per transfer, selective
//!   signaling, send-queue depth and `max_rd_atomic` respected (a full queue
//!   hands the transfer back as [`SubmitError::QueueFull`](crate::SubmitError)),
//!   notifications as WRITE_WITH_IMM once all data landed (also for READ),
//!   non-blocking CQ polling. A failed work request fails only its transfer
//!   ([`DataError::Rdma`](crate::DataError) names peer, op, device, QP and
//!   status); the failed QP is retired until the next handshake.
//!
//! # Testing without hardware
//!
//! `ci/softroce.sh` boots a throw-away QEMU guest with Soft-RoCE (`rxe0`);
//! `ci/verbs.sh` builds with `--features verbs`, runs `tests/verbs.rs` in it
//! and compares `examples/verbs_bench.rs` with perftest in the same VM.
//!
//! A host without RDMA gets one [`VerbsError::Unsupported`] whose
//! [`Unsupported`] reason says which piece is missing (library, kernel
//! support, device, active port), never a panic.
//!
//! `unsafe` is confined to this module: foreign-memory registration and
//! posting work requests that make the NIC access memory.

mod backend;
mod config;
mod device;
mod engine;
mod error;
mod failure;
mod plan;
mod qp;
mod resources;
mod state;

pub use backend::QpStats;
pub use config::VerbsConfig;
pub use device::{
    list_devices, pick_gid, probe, select, DeviceConfig, DeviceInfo, DeviceLimits, GidInfo,
    GidKind, GidSelector, PortInfo, PortStatus, Selection, ENV_DEVICE, ENV_GID_INDEX,
};
pub use error::{Unsupported, VerbsError};
pub use qp::{
    ConnectedQp, PreparedQp, QpBuilder, QpEndpoint, QpOptions, SendWr, WrOp, ENV_QP_TIMEOUT,
};
pub use resources::{
    CompletionQueue, Context, MemoryRegistration, MrAccess, ProtectionDomain, WorkCompletion,
};
pub use state::VerbsBackend;
