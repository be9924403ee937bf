//! kvlane: a KV-cache transport for LLM inference engines.
//!
//! An [`Agent`] registers an engine's KV cache, listens for peers, and
//! moves blocks to and from them with one-sided READ and WRITE. The control
//! plane ([`control`]) does the handshake, keep-alive and peer lifecycle;
//! the data plane ([`data`]) moves the bytes.
//!
//! # Quick start
//!
//! ```
//! use kvlane::{Agent, BackendChoice};
//! use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), kvlane::Error> {
//! // 2 layers x 16 blocks x 4 KiB, K and V separate.
//! let layout = KvLayout::new(2, 16, 4096, KvParts::Separate, LayoutOrder::LayerMajor)?;
//! let len = layout.required_len().unwrap() as usize;
//!
//! let prefill_kv = Region::alloc(len, Access::ALL)?;
//! prefill_kv.fill(0, len as u64, 7)?;
//! let prefill = Agent::builder().engine_id("prefill").backend(BackendChoice::Loopback)
//!     .register_kv(layout, prefill_kv).build().await?;
//! let decode_kv = Region::alloc(len, Access::ALL)?;
//! let decode = Agent::builder().engine_id("decode").backend(BackendChoice::Loopback)
//!     .register_kv(layout, decode_kv.clone()).build().await?;
//!
//! // Prefill writes blocks 0..4 into decode's blocks 8..12 and notifies.
//! let peer = prefill.connect(decode.local_addr()).await?;
//! let mut notes = decode.notifications().unwrap();
//! peer.write_blocks(0..2, &[0, 1, 2, 3], &[8, 9, 10, 11], Some(b"req-1"))?.await?;
//! let note = notes.recv().await.unwrap();
//! assert_eq!((note.from.as_str(), &note.payload[..]), ("prefill", &b"req-1"[..]));
//! prefill.close().await;
//! decode.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Memory by address
//!
//! Callers that move memory regions rather than KV blocks (NIXL-style
//! descriptor lists, the Python `kvlane.nixl`) register plain regions with
//! [`AgentBuilder::register_region`]; they are advertised in the handshake
//! next to the KV caches ([`Peer::remote_regions`]), and
//! [`Peer::prepare_spans`] plans a transfer of [`MemSpan`]s (address and
//! length on each side, paired one to one), checked against the
//! registrations and their rights, with contiguous runs merged.
//!
//! # Cargo features
//!
//! - `verbs`: the libibverbs backend of `kvlane-data`.
//!
//! # Thread safety
//!
//! [`Agent`] and [`Peer`] are `Send + Sync` and cheap to clone; transfers
//! may be posted from any thread. [`TransferHandle`] is a future and can
//! also be waited on from non-async threads.
//!
//! # Resource cleanup
//!
//! [`Agent::close`] says `bye` to every peer, flushes pending control
//! messages, stops the data plane (in-flight transfers fail) and the
//! agent's tasks; it is idempotent. Registered memory lives as long as the
//! [`Region`](data::Region) clones do.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod agent;
mod attach;
mod backend;
pub mod blocking;
mod dial;
mod error;
mod events;
mod frames;
pub mod metrics;
mod peer;
mod spans;
mod state;

pub use agent::{Agent, AgentBuilder, BackendChoice, DEFAULT_NOTIFICATION_CAPACITY};
pub use backend::{ENV_IB_DEVICES, ENV_SAME_HOST_SHM};
pub use blocking::BlockingAgent;
pub use error::{Error, ErrorKind};
pub use events::{Notification, PeerEvent, PeerEventKind};
pub use kvlane_control as control;
pub use kvlane_data as data;
pub use kvlane_data::{CpuPlacement, ENV_CPUS};
pub use peer::{
    Peer, PreparedTransfer, TransferHandle, DEFAULT_TRANSFER_DEADLINE, MAX_TRANSFER_DEADLINE,
};
pub use spans::MemSpan;
