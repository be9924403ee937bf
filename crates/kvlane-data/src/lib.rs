//! kvlane data plane: registered memory, KV layouts and one-sided
//! READ/WRITE backends.
//!
//! # Quick start
//!
//! ```
//! use kvlane_data::{connect_pair, Access, Backend, Descriptor, LoopbackBackend, Op,
//!                   Region, RemoteDescriptor, Transfer, Transport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two in-process backends: an initiator and a target.
//! let mut init = LoopbackBackend::default();
//! let mut target = LoopbackBackend::default();
//! let src = Region::from_vec(b"hello, kv cache!".to_vec(), Access::ALL)?;
//! let dst = Region::alloc(4096, Access::REMOTE_WRITE | Access::REMOTE_READ)?;
//! let src_ad = init.register(&src)?;
//! let dst_ad = target.register(&dst)?;
//! let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad])?;
//!
//! // Drive the initiator from a progress thread and wait for the WRITE.
//! let transport = Transport::new(init)?;
//! let write = Transfer::new(
//!     peer,
//!     Op::Write,
//!     vec![Descriptor { region: src.id(), offset: 0, len: 16 }],
//!     vec![RemoteDescriptor { key: dst_ad.key, offset: 100, len: 16 }],
//! );
//! transport.submit(write)?.wait()?;
//! let mut out = [0u8; 16];
//! dst.read(100, &mut out)?;
//! assert_eq!(&out, b"hello, kv cache!");
//! # drop(target);
//! # Ok(())
//! # }
//! ```
//!
//! # Cargo features
//!
//! - `verbs`: the libibverbs backend (crate `sideway`). Building it needs
//!   cmake and libclang; running it needs libibverbs and an RDMA device.
//!
//! # GPU memory
//!
//! CUDA (`libcuda.so.1`) and ROCm HIP (`libamdhip64.so`) are loaded at run
//! time; building needs neither toolkit. [`Region::alloc_device`] and the
//! `unsafe` [`Region::from_device_ptr`] register GPU memory (checked
//! against the driver's pointer attributes); [`gpu_devices`] lists GPUs
//! with their PCI addresses. verbs registers GPU memory by dma-buf, then
//! by device address, else fails naming both; tcp and loopback stage it
//! through pinned host buffers with asynchronous copies, pipelined with
//! their I/O ([`Region::read_chunks`], [`Region::write_chunks`]). Without a
//! driver or device every entry point returns [`GpuError::Unsupported`]
//! naming the device and why. `KVLANE_CUDA_LIBRARY` / `KVLANE_HIP_LIBRARY`
//! override the library paths (the tests use a mock CUDA driver and a mock
//! HIP runtime, see [`conformance::use_mock_cuda`] and
//! [`conformance::use_mock_hip`]).
//!
//! # Thread safety
//!
//! [`Region`] is `Send + Sync` and cheap to clone. Backends are `Send` and
//! driven through `&mut self` (one owner); [`Transport`] wraps a backend in
//! a progress thread and is `Sync`, so any thread may submit.
//!
//! # Resource cleanup
//!
//! A region's memory is freed when its last clone is dropped; backends hold
//! clones of the regions registered with them until `deregister` or drop.
//! Once the tcp or loopback backend's `deregister` returns, it no longer
//! touches the region for peers' requests (accepted ones included: tcp
//! cuts those still running after [`TcpConfig::deregister_grace`]).
//! Dropping a [`Transport`] stops its thread and fails transfers still in
//! flight with [`DataError::Shutdown`]; nothing is left waiting forever.
//! Dropping a [`TcpBackend`] closes its listener and every connection,
//! and stops and joins its I/O threads (a fixed number per side,
//! [`TcpConfig::io_threads`], whatever the number of peers).
#![deny(missing_docs)]
// `unsafe` is allowed only where foreign memory is touched: `memory` (raw
// copies and socket I/O on region memory, registration of foreign
// pointers) and `verbs` (libibverbs FFI), and for the one affinity call of
// `placement` (`sched_setaffinity`). Everything else is safe code.
#![deny(unsafe_code)]

mod backend;
pub mod conformance;
mod error;
#[allow(unsafe_code)] // CUDA and HIP driver FFI, device memory and pinned staging
mod gpu;
mod handle;
mod host_registry;
mod ids;
pub mod intercept;
pub mod layout;
pub mod loopback;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // memfd_create, mmap and seals of shareable regions
mod memfd;
#[allow(unsafe_code)] // raw copies on region memory; see the module's Soundness
mod memory;
#[allow(unsafe_code)] // sched_setaffinity (libc), in `set_affinity` only
mod placement;
mod progress;
pub mod rails;
#[cfg(target_os = "linux")]
pub mod samehost;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod tcp;
pub mod topology;
mod transfer;
#[cfg(feature = "verbs")]
#[allow(unsafe_code)] // libibverbs FFI and memory registration
pub mod verbs;

pub use backend::{connect_pair, Backend, Connected, Connecting, Submitted};
pub use error::{DataError, SubmitError};
pub use gpu::{
    gpu_device_of, gpu_devices, DmaBuf, GpuDevice, GpuError, GpuInfo, GpuRuntime, GpuUnavailable,
    ParseGpuDeviceError,
};
pub use handle::{
    Ended, Observer, OnDone, Then, TransferHandle, Transport, NOTIFY_CHANNEL, SPIN_WINDOW,
};
pub use ids::{FastMap, IdHasher, PeerId, RegionId, RemoteKey, TransferId};
pub use layout::{plan, plan_into, KvLayout, KvParts, LayoutError, LayoutOrder, PlannedCopy};
pub use loopback::{LoopbackBackend, LoopbackConfig};
#[cfg(unix)]
pub use memory::send_vectored;
pub use memory::{Access, IoPart, MemoryKind, Region, RemoteRegion, IOV_MAX, REGION_ALIGN};
pub use placement::{CpuPlacement, ENV_CPUS, MAX_CPU};
pub use rails::{RailStats, Rails, RailsConfig};
#[cfg(target_os = "linux")]
pub use samehost::SameHost;
#[cfg(target_os = "linux")]
pub use shm::{ShmBackend, ShmConfig, ShmEndpoint};
pub use smallvec::{smallvec, SmallVec};
pub use tcp::{TcpBackend, TcpConfig, TcpCounters, TcpEndpoint};
pub use transfer::{
    BackendKind, Completion, Descriptor, Descriptors, Endpoint, Notification, Op, RemoteDescriptor,
    RemoteDescriptors, Segment, Segments, Transfer, DEFAULT_DEADLINE,
};
