//! Identifiers every control module uses: a leaf module, so that none of
//! them imports up into the crate root.

use serde::{Deserialize, Serialize};

/// Identifies one connection (never reused within a node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

impl std::fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conn#{}", self.0)
    }
}

/// Ranks of one engine worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Ranks {
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel group size.
    pub tp_size: u32,
}
