//! Shareable host memory that `kvlane.host_buffer` allocates
//! (`Region::alloc_shared`: a sealed memory file), so that `Auto` reaches
//! peers on this host over shm with it.
//!
//! Python sees the memory as a numpy array over its address (made in
//! `kvlane/_memory.py`), which keeps a [`SharedAlloc`] alive. Registering
//! that array whole finds the allocation here by address and length and
//! registers its region, the memory file the shm backend can pass; any
//! other buffer (a slice of it, numpy's or torch's memory) is registered
//! as foreign memory, as before.

use crate::errors::to_py;
use kvlane::data::{Access, Region};
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

/// Live allocations by address: each entry lives as long as its
/// [`SharedAlloc`] (the array's owner); a registration holds its own clone
/// of the region, so the memory outlives both while an agent uses it.
static LIVE: Mutex<BTreeMap<u64, Region>> = Mutex::new(BTreeMap::new());

/// The shareable region whose memory is exactly `addr..addr + len`, when
/// `kvlane.host_buffer` allocated it and it is still alive.
pub(crate) fn region_at(addr: u64, len: u64) -> Option<Region> {
    let live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    live.get(&addr).filter(|r| r.len() == len).cloned()
}

/// `nbytes` of zeroed shareable memory (`Region::alloc_shared`, every
/// right); owner of the memory behind a `kvlane.host_buffer` array.
#[pyclass(module = "kvlane", frozen, name = "_SharedAlloc")]
pub(crate) struct SharedAlloc {
    addr: u64,
    len: u64,
}

impl Drop for SharedAlloc {
    fn drop(&mut self) {
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.addr);
    }
}

#[pymethods]
impl SharedAlloc {
    #[new]
    fn py_new(py: Python<'_>, nbytes: usize) -> PyResult<Self> {
        // Its pages are allocated up front: release the GIL meanwhile.
        let region = py
            .detach(|| Region::alloc_shared(nbytes, Access::ALL))
            .map_err(|e| to_py(e.into()))?;
        let (addr, len) = (region.addr(), region.len());
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(addr, region);
        Ok(Self { addr, len })
    }

    /// Address of the first byte.
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.len
    }
}
