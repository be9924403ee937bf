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
//! A host without RDMA gets one [`VerbsError::Unsupported`] whose
//! [`Unsupported`] reason says which piece is missing (library, kernel
//! support, device, active port), never a panic.
//!
//! `unsafe` is confined to this module: foreign-memory registration and
//! posting work requests that make the NIC access memory.

mod backend;
mod device;
mod engine;
mod error;
mod qp;
mod resources;

pub use backend::{QpStats, VerbsBackend, VerbsConfig};
pub use device::{
    list_devices, pick_gid, probe, select, DeviceConfig, DeviceInfo, DeviceLimits, GidInfo,
    GidKind, GidSelector, PortInfo, PortStatus, Selection, ENV_DEVICE, ENV_GID_INDEX,
};
pub use error::{Unsupported, VerbsError};
pub use qp::{ConnectedQp, PreparedQp, QpBuilder, QpEndpoint, QpOptions, SendWr, WrOp};
pub use resources::{
    CompletionQueue, Context, MemoryRegistration, MrAccess, ProtectionDomain, WorkCompletion,
};
