//! kvlane control plane: handshake, keep-alive, peer lifecycle and
//! notifications between inference engines.
//!
//! The lifecycle is a **sans-IO state machine** ([`Peer`], owned by a
//! [`Registry`]): no sockets, no clock; `handle_*` inputs with `now` passed
//! in, `poll_*` outputs. [`ControlNode`] drives it with tokio over a
//! [`Channel`]: [`ZmqChannel`] (ZeroMQ ROUTER/DEALER, pure Rust) or
//! [`MemChannel`] (in memory, for tests).
//!
//! States: `Connecting → Handshaking → Ready → Suspect → Dead`; `Closed` is a
//! separate fact (a dead peer still owns resources until it is closed).
//! Wire format: msgpack maps with named fields ([`wire`]).
//!
//! # Quick start
//!
//! ```
//! use kvlane_control::{Config, ControlNode, Event, LocalInfo, MemNetwork, Ranks};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), kvlane_control::ControlError> {
//! let net = MemNetwork::new(); // `ControlNode::bind(config, local, "0.0.0.0:0")` for ZeroMQ
//! let ranks = Ranks { dp_rank: 0, tp_rank: 0, tp_size: 1 };
//! let target = ControlNode::with_channel(
//!     Config::default(),
//!     LocalInfo::new("decode", ranks, "model-v1").with_data_plane(b"endpoints".to_vec()),
//!     net.bind("decode:5600"),
//! );
//! let initiator = ControlNode::with_channel(
//!     Config::default(),
//!     LocalInfo::new("prefill", ranks, "model-v1"),
//!     net.bind("prefill:5600"),
//! );
//! let mut events = target.events();
//! let (peer, remote) = initiator.connect("decode:5600").await?;
//! assert_eq!(remote.data_plane, b"endpoints");
//! initiator.notify(peer, 1, b"kv blocks landed".to_vec()).await?;
//! loop {
//!     let ev = events.recv().await.expect("event");
//!     if let Event::Notification { transfer_id, .. } = ev.event {
//!         assert_eq!(transfer_id, 1);
//!         break;
//!     }
//! }
//! initiator.close().await;
//! target.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Cargo features
//!
//! None. The ZeroMQ channel (`zeromq` crate, tokio runtime) is always built.
//!
//! # Thread safety
//!
//! [`Peer`] and [`Registry`] are plain `Send` data driven by one owner.
//! [`ControlNode`] is `Send + Sync`; its methods may be called from any task
//! (they talk to the single driver task through a command queue).
//!
//! # Resource cleanup
//!
//! [`ControlNode::close`] is idempotent: it says `bye` to every peer, waits
//! (bounded by [`Config::close_linger`]) for the acknowledgements that prove
//! earlier frames arrived, then releases every socket and task, also for
//! peers that were already dead. Every await of the crate is bounded.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod auth;
pub mod channel;
pub mod config;
pub mod driver;
pub mod error;
pub mod group;
pub mod keepalive;
pub mod peer;
pub mod probe;
pub mod registry;
pub mod timer;
pub mod wire;

pub use config::{Config, ConfigError, LocalInfo, PortPlan, Psk, Ranks, RemoteInfo};
pub use error::{
    ControlError, GroupError, PeerError, PlanError, ProbeError, RankFailure, Refusal, WireError,
};
pub use peer::{Event, Peer, Role, State, Stats, Transmit};
pub use registry::{ConnectRefused, Link, PeerEvent, Registry};

/// Identifies one connection (never reused within a node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

impl std::fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conn#{}", self.0)
    }
}

pub use channel::{Channel, ChannelEvent, MemChannel, MemNetwork, ZmqChannel};
pub use driver::{ControlNode, PeerSnapshot};
pub use group::{GroupHandshake, GroupMember};
pub use probe::probe;
