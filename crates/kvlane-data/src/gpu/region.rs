//! Regions of GPU memory: allocation, registration by pointer, dma-buf
//! export.

use super::device::{DeviceContext, DeviceMemory};
use super::GpuDevice;
use super::IpcHandle;
use crate::error::DataError;
use crate::memory::{Access, MemoryKind, Region};
use std::any::Any;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// A dma-buf exported from GPU memory ([`Region::export_dmabuf`]).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf; closed on drop (a registration made from it keeps its
    /// own reference).
    pub fd: OwnedFd,
    /// Offset of the region's first byte inside the dma-buf (the export
    /// covers whole pages).
    pub offset: u64,
    /// Length of the dma-buf in bytes.
    pub len: usize,
}

impl Region {
    /// Allocates `len` bytes of memory on `device` and registers them; the
    /// memory is freed with the last clone of the region. Without the
    /// device's runtime or without the device this is
    /// [`GpuError::Unsupported`](crate::GpuError::Unsupported) naming the
    /// device and why.
    pub fn alloc_device(device: GpuDevice, len: usize, access: Access) -> Result<Self, DataError> {
        if len == 0 {
            return Err(DataError::EmptyRegion);
        }
        let ctx = DeviceContext::get(device)?;
        let mem = Arc::new(DeviceMemory::alloc(ctx, len)?);
        // SAFETY: the memory is device memory (never dereferenced by the
        // CPU: regions of kind `Gpu` are reached only through the runtime)
        // owned by `mem`, which the region holds until its last clone drops.
        let region = unsafe {
            Self::from_raw(
                mem.addr() as *mut u8,
                len,
                MemoryKind::Gpu { device },
                access,
                None,
            )
        }?;
        region.set_gpu(mem);
        Ok(region)
    }

    /// Registers GPU memory another owner allocated (an engine's KV cache,
    /// a torch tensor): `len` bytes at device address `ptr` on `device`.
    /// The driver's pointer attributes must say that the first and last
    /// bytes are memory of `device`; host memory is refused, never
    /// registered as host memory. `keep_alive` is dropped with the last
    /// clone of the region (use it to hold the memory's owner).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be one live allocation on `device` (or a range
    /// inside one) that stays allocated, and is not remapped, until every
    /// clone of the returned region has been dropped and every backend it
    /// was registered with has deregistered it. Bytes targeted by an
    /// in-flight transfer must not be accessed by other code (kernels
    /// included) while that transfer runs.
    pub unsafe fn from_device_ptr(
        device: GpuDevice,
        ptr: u64,
        len: usize,
        access: Access,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<Self, DataError> {
        if len == 0 {
            return Err(DataError::EmptyRegion);
        }
        if ptr == 0 {
            return Err(DataError::NullPointer);
        }
        let ctx = DeviceContext::get(device)?;
        let mem = Arc::new(DeviceMemory::foreign(ctx, ptr, len)?);
        // SAFETY: the caller promises the device range outlives the region;
        // the CPU never dereferences it (kind `Gpu`).
        let region = unsafe {
            Self::from_raw(
                ptr as *mut u8,
                len,
                MemoryKind::Gpu { device },
                access,
                keep_alive,
            )
        }?;
        region.set_gpu(mem);
        Ok(region)
    }

    /// The GPU the region's memory lives on; `None` for host memory.
    pub fn device(&self) -> Option<GpuDevice> {
        match self.kind() {
            MemoryKind::Gpu { device } => Some(device),
            _ => None,
        }
    }

    /// Exports a GPU region as a dma-buf (for `ibv_reg_dmabuf_mr`). A
    /// driver or kernel without dma-buf export is
    /// [`GpuError::Unsupported`](crate::GpuError::Unsupported).
    pub fn export_dmabuf(&self) -> Result<DmaBuf, DataError> {
        let mem = self.gpu().ok_or(DataError::Unsupported {
            backend: "dma-buf export",
            what: "the region is not GPU memory registered through its runtime",
        })?;
        let (fd, offset, len) = mem.export_dmabuf()?;
        Ok(DmaBuf { fd, offset, len })
    }

    /// Maps `len` bytes at `offset` of an allocation another process of
    /// this host exported as `handle` (`cuIpcGetMemHandle` /
    /// `hipIpcGetMemHandle`), on `device` (as this process numbers it). The
    /// driver maps the whole allocation; the region covers the range asked
    /// for, which must lie inside it. The mapping is closed with the last
    /// clone of the region.
    pub(crate) fn from_ipc(
        device: GpuDevice,
        handle: &IpcHandle,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Self, DataError> {
        let ctx = DeviceContext::get(device)?;
        let mem = Arc::new(DeviceMemory::open_ipc(ctx, handle, offset, len)?);
        // SAFETY: the range is inside the allocation the driver mapped
        // (checked by `open_ipc`), which stays mapped until `mem`, held by
        // the region until its last clone drops, closes it; the CPU never
        // dereferences it (kind `Gpu`).
        let region = unsafe {
            Self::from_raw(
                mem.addr() as *mut u8,
                mem.len(),
                MemoryKind::Gpu { device },
                access,
                None,
            )
        }?;
        region.set_gpu(mem);
        Ok(region)
    }
}
