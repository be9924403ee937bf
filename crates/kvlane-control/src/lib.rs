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
//! # Invariants
//!
//! Each one is held by named tests (`tests/`):
//!
//! 1. Keep-alive never kills its owner; missed pings make a peer `Suspect`,
//!    then `Dead` after the liveness budget, with an event naming the peer,
//!    the attempts and the last error (`invariant_1_*`,
//!    `keepalive_holds_20x_liveness_budget`, `total_loss_dead_within_bound`).
//!    Dead takes unanswered pings, not only time: a node whose driver did
//!    not run (its thread starved on a shared core) reads what arrived
//!    meanwhile and sends the pings it owes before it judges a peer
//!    (`a_stalled_driver_keeps_its_live_peers`).
//! 2. A restarted peer (new incarnation) is re-handshaken and reported as
//!    `Restarted` (`invariant_2_*`); the `kvlane` facade then fails
//!    transfers prepared against the old incarnation as stale
//!    (`restarted_peer_makes_prepared_transfers_stale`).
//! 3. At most one live connection per peer; a dead one is retired first
//!    (`invariant_3_*`, the 10,000-cycle churn test).
//! 4. `close()` releases everything, also after `Dead`, and is idempotent
//!    (`invariant_4_*`).
//! 5. Per-connection resources are unique per connection, never derived
//!    from the peer id (`invariant_5_*`).
//! 6. Dead connections are reaped before inbound traffic is routed
//!    (`invariant_6_*`).
//! 7. A group handshake is uniform and names every failing rank
//!    (`invariant_7_*`); at the facade, a rank whose data plane cannot be
//!    attached fails the group and no rank stays connected
//!    (`a_group_with_a_rank_whose_data_plane_fails_leaves_no_rank_connected`).
//! 8. One peer's death leaves the others untouched (`invariant_8_*`); the
//!    facade fails the dead peer's in-flight transfers with `PeerLost`
//!    (`killed_target_fails_transfers_then_restart_recovers`).
//! 9. Malformed, oversized and unknown frames are dropped and counted, and
//!    never end a listener (`invariant_9_*`, fuzz target `control_decode`).
//! 10. Peers are capped, with a clear refusal past the cap
//!     (`invariant_10_*`).
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
mod channel;
mod config;
mod driver;
mod error;
mod eviction;
mod group;
mod hedge;
mod ids;
mod keepalive;
mod peer;
mod probe;
mod registry;
mod session;
mod timer;
pub mod wire;

pub use config::{
    check_engine_id, Config, ConfigError, EngineIdError, LocalInfo, PortPlan, Psk, RemoteInfo,
    Route, MAX_ENGINE_ID_LEN,
};
pub use error::{
    ControlError, GroupError, PeerError, PlanError, ProbeError, RankFailure, Refusal, SealError,
    WireError,
};
pub use ids::{ConnectionId, Ranks};
pub use keepalive::Backoff;
pub use peer::{Event, Peer, Role, State, Stats, Transmit};
pub use registry::{ConnectRefused, Link, PeerEvent, Registry};
pub use session::{SessionKey, SESSION_KEY_LEN};

pub use channel::{Channel, ChannelEvent, MemChannel, MemNetwork, ZmqChannel};
pub use driver::{ControlNode, EventStream, PeerSnapshot};
pub use group::{GroupHandshake, GroupMember};
pub use probe::probe;
