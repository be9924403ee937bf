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
