//! Local registrations of the host-memory backends (loopback, tcp).

use crate::error::DataError;
use crate::ids::{FastMap, RegionId, RemoteKey};
use crate::memory::{MemoryKind, Region};

/// Regions registered with one backend, and the key each is served under.
/// Registering the same region again keeps its key.
#[derive(Debug, Default)]
pub(crate) struct HostRegistry {
    regions: FastMap<RegionId, Region>,
    keys: FastMap<RegionId, RemoteKey>,
}

impl HostRegistry {
    /// Registers host memory, or GPU memory registered through its runtime
    /// (staged through pinned host buffers), for `backend`; returns the key
    /// to serve it under. A bare dma-buf is refused: only verbs registers
    /// those.
    pub(crate) fn register(
        &mut self,
        backend: &'static str,
        region: &Region,
    ) -> Result<RemoteKey, DataError> {
        self.register_as(backend, region, None)
    }

    /// [`register`](Self::register), serving the region under `key` when
    /// given (a wrapper backend that serves one region over two backends
    /// under one key); a key another region holds is refused.
    pub(crate) fn register_as(
        &mut self,
        backend: &'static str,
        region: &Region,
        key: Option<RemoteKey>,
    ) -> Result<RemoteKey, DataError> {
        match region.kind() {
            MemoryKind::Host => {}
            MemoryKind::Gpu { .. } if region.gpu().is_some() => {}
            MemoryKind::Gpu { .. } | MemoryKind::Device { .. } => {
                return Err(DataError::Unsupported {
                    backend,
                    what: "dma-buf memory without its GPU runtime; use the verbs backend, or register it with Region::from_device_ptr to stage it",
                })
            }
        }
        let key = match (self.keys.get(&region.id()), key) {
            (Some(old), Some(key)) if *old != key => {
                return Err(DataError::Unsupported {
                    backend,
                    what: "registering a region again under another key",
                })
            }
            (Some(key), _) => *key,
            (None, Some(key)) => {
                if key.0 == 0 || self.keys.values().any(|k| *k == key) {
                    return Err(DataError::Unsupported {
                        backend,
                        what: "a key that is zero or already serves another region",
                    });
                }
                key
            }
            // Not guessable from other keys: random (`rand`'s thread-local
            // CSPRNG, seeded by the OS), non-zero, unused.
            (None, None) => loop {
                let key = RemoteKey(rand::random::<u32>());
                if key.0 != 0 && !self.keys.values().any(|k| *k == key) {
                    break key;
                }
            },
        };
        self.regions.insert(region.id(), region.clone());
        self.keys.insert(region.id(), key);
        Ok(key)
    }

    /// Forgets a region; returns the key it was served under.
    pub(crate) fn deregister(&mut self, id: RegionId) -> Result<RemoteKey, DataError> {
        self.regions
            .remove(&id)
            .ok_or(DataError::UnknownRegion(id))?;
        self.keys.remove(&id).ok_or(DataError::UnknownRegion(id))
    }

    /// A registered region.
    pub(crate) fn get(&self, id: RegionId) -> Option<&Region> {
        self.regions.get(&id)
    }

    /// Number of registered regions.
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }
}
