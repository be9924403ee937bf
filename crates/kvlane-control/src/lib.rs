//! kvlane control plane.
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

pub use config::{Config, LocalInfo, PortPlan, Ranks, RemoteInfo};
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
