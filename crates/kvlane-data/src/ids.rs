//! Newtype identifiers.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// Process-unique identifier of a registered [`Region`](crate::Region).
    RegionId(u64),
    "region#"
);
id_type!(
    /// Key under which a target serves one of its regions to peers (an
    /// rkey for verbs, a table key for loopback and tcp).
    RemoteKey(u32),
    "key#"
);
id_type!(
    /// Identifier of one submitted transfer, chosen by the caller.
    TransferId(u64),
    "transfer#"
);
id_type!(
    /// A peer as known to one backend instance (assigned by `add_peer`).
    PeerId(u64),
    "peer#"
);

static NEXT_REGION: AtomicU64 = AtomicU64::new(1);
static NEXT_TRANSFER: AtomicU64 = AtomicU64::new(1);

impl RegionId {
    pub(crate) fn next() -> Self {
        Self(NEXT_REGION.fetch_add(1, Ordering::Relaxed))
    }
}

impl TransferId {
    /// A fresh process-unique transfer id.
    pub fn next() -> Self {
        Self(NEXT_TRANSFER.fetch_add(1, Ordering::Relaxed))
    }
}

/// Hasher for maps keyed by small local ids (transfer, region, peer, key,
/// the facade's connection ids): one multiply per key instead of SipHash.
/// Only for keys that come from the local process, never from the network
/// (it offers no defence against chosen collisions).
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by a local id (see [`IdHasher`]).
pub type FastMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;
