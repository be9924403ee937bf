//! Loaded drivers, per-device contexts and device allocations.

use super::staging::Stager;
use super::{
    cuda, hip, CallError, Driver, GpuDevice, GpuError, GpuRuntime, GpuUnavailable, IpcHandle,
    PointerKind,
};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock};

type Loaded = Result<Arc<dyn Driver>, GpuUnavailable>;

/// The runtime's driver, loaded once per process.
pub(crate) fn driver(device: GpuDevice) -> Result<Arc<dyn Driver>, GpuError> {
    static CUDA: OnceLock<Loaded> = OnceLock::new();
    static HIP: OnceLock<Loaded> = OnceLock::new();
    let loaded = match device.runtime {
        GpuRuntime::Cuda => {
            CUDA.get_or_init(|| cuda::Cuda::load().map(|d| Arc::new(d) as Arc<dyn Driver>))
        }
        GpuRuntime::Rocm => {
            HIP.get_or_init(|| hip::Hip::load().map(|d| Arc::new(d) as Arc<dyn Driver>))
        }
    };
    loaded
        .clone()
        .map_err(|why| GpuError::Unsupported { device, why })
}

/// Pinned staging buffers kept per device once returned; more are made on
/// demand (one per concurrent transfer stream) and freed past this many.
const POOL_MAX: usize = 16;

/// One usable device: its driver and its pool of staging buffers.
pub(crate) struct DeviceContext {
    device: GpuDevice,
    driver: Arc<dyn Driver>,
    pool: Mutex<Vec<Stager>>,
}

impl DeviceContext {
    /// The context of `device`, made on first use. No driver, or no device
    /// with this ordinal, is [`GpuError::Unsupported`].
    pub(crate) fn get(device: GpuDevice) -> Result<Arc<Self>, GpuError> {
        static ALL: Mutex<Vec<Arc<DeviceContext>>> = Mutex::new(Vec::new());
        let driver = driver(device)?;
        let mut all = ALL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = all.iter().find(|c| c.device == device) {
            return Ok(Arc::clone(c));
        }
        let count = driver.device_count().map_err(|e| e.on(device))?;
        if device.ordinal >= count {
            return Err(GpuError::Unsupported {
                device,
                why: GpuUnavailable::NoDevice { count },
            });
        }
        driver.bind(device.ordinal).map_err(|e| e.on(device))?;
        let ctx = Arc::new(Self {
            device,
            driver,
            pool: Mutex::new(Vec::new()),
        });
        all.push(Arc::clone(&ctx));
        Ok(ctx)
    }

    /// The driver.
    pub(crate) fn driver(&self) -> &dyn Driver {
        &*self.driver
    }

    /// Makes the device current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), GpuError> {
        self.driver
            .bind(self.device.ordinal)
            .map_err(|e| e.on(self.device))
    }

    /// A staging pair from the pool, or a new one. The device is bound.
    pub(crate) fn stager(&self) -> Result<Stager, GpuError> {
        self.bind()?;
        let pooled = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        match pooled {
            Some(s) => Ok(s),
            None => Stager::new(Arc::clone(&self.driver), self.device),
        }
    }

    /// Returns a quiet (synchronized) stager to the pool.
    pub(crate) fn give_back(&self, s: Stager) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOL_MAX {
            pool.push(s);
        }
    }
}

/// A range of device memory behind a [`Region`](crate::Region) of kind
/// [`MemoryKind::Gpu`](crate::MemoryKind::Gpu); freed on drop when kvlane
/// allocated it.
pub(crate) struct DeviceMemory {
    ctx: Arc<DeviceContext>,
    addr: u64,
    len: usize,
    release: Release,
}

/// What dropping a [`DeviceMemory`] releases.
#[derive(Debug)]
enum Release {
    /// Nothing: foreign memory.
    Nothing,
    /// `free`: kvlane allocated it.
    Free,
    /// `ipc_close` of this base: another process's allocation, mapped here
    /// through an IPC handle.
    IpcClose(u64),
}

/// What another process needs to map the allocation that holds a region
/// (see [`DeviceMemory::export_ipc`]).
#[derive(Clone, Debug)]
pub(crate) struct IpcExport {
    /// The driver's handle of the whole allocation.
    pub(crate) handle: IpcHandle,
    /// The region's first byte, from the allocation's base.
    pub(crate) offset: u64,
}

/// Maps a failed IPC call: a driver without the call, or one that says it
/// cannot, is unsupported.
fn ipc_error(e: CallError, device: GpuDevice) -> GpuError {
    if e.code == super::MISSING_SYMBOL {
        GpuError::Unsupported {
            device,
            why: GpuUnavailable::MissingSymbol {
                runtime: device.runtime,
                symbol: e.call,
            },
        }
    } else if e.is_unsupported() {
        GpuError::Unsupported {
            device,
            why: GpuUnavailable::Operation(
                "CUDA/HIP IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle_v2, hipIpc*): the driver \
                 does not support it for this memory",
            ),
        }
    } else {
        e.on(device)
    }
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:#x}+{}", self.ctx.device, self.addr, self.len)
    }
}

impl DeviceMemory {
    /// Allocates `len` bytes on the context's device.
    pub(crate) fn alloc(ctx: Arc<DeviceContext>, len: usize) -> Result<Self, GpuError> {
        ctx.bind()?;
        let addr = ctx.driver.alloc(len).map_err(|e| e.on(ctx.device))?;
        Ok(Self {
            ctx,
            addr,
            len,
            release: Release::Free,
        })
    }

    /// Wraps foreign memory after checking with the driver that its first
    /// and last bytes are memory of the context's device.
    pub(crate) fn foreign(
        ctx: Arc<DeviceContext>,
        addr: u64,
        len: usize,
    ) -> Result<Self, GpuError> {
        ctx.bind()?;
        let device = ctx.device;
        for probe in [addr, addr.saturating_add(len as u64 - 1)] {
            let kind = ctx.driver.pointer_kind(probe).map_err(|e| e.on(device))?;
            let found = match kind {
                PointerKind::Device(o) if o == device.ordinal => continue,
                PointerKind::Device(o) => format!(
                    "memory of {}",
                    GpuDevice {
                        runtime: device.runtime,
                        ordinal: o
                    }
                ),
                PointerKind::Host => "host memory".to_owned(),
                PointerKind::Unknown => "memory it does not know".to_owned(),
            };
            return Err(GpuError::NotDeviceMemory {
                device,
                addr,
                len: len as u64,
                found: if probe == addr {
                    found
                } else {
                    format!("{found} at the last byte {probe:#x}")
                },
            });
        }
        Ok(Self {
            ctx,
            addr,
            len,
            release: Release::Nothing,
        })
    }

    /// The device.
    pub(crate) fn device(&self) -> GpuDevice {
        self.ctx.device
    }

    /// The context (driver, staging pool).
    pub(crate) fn context(&self) -> &DeviceContext {
        &self.ctx
    }

    /// The device address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Exports the memory as a dma-buf: the page-aligned range around it,
    /// and the offset of the first byte inside that range.
    pub(crate) fn export_dmabuf(&self) -> Result<(OwnedFd, u64, usize), GpuError> {
        const PAGE: u64 = 4096;
        let start = self.addr & !(PAGE - 1);
        let end = (self.addr + self.len as u64).next_multiple_of(PAGE);
        self.ctx.bind()?;
        let span = (end - start) as usize;
        match self.ctx.driver.export_dmabuf(start, span) {
            Ok(fd) => Ok((fd, self.addr - start, span)),
            Err(e) if e.is_unsupported() => Err(GpuError::Unsupported {
                device: self.ctx.device,
                why: GpuUnavailable::Operation(
                    "dma-buf export (cuMemGetHandleForAddressRange / hipMemGetHandleForAddressRange): the driver or kernel does not support it",
                ),
            }),
            Err(e) => Err(e.on(self.ctx.device)),
        }
    }
}

impl DeviceMemory {
    /// An IPC handle of the allocation that contains this memory, and the
    /// offset of the first byte inside it. The handle names the **whole**
    /// allocation: a process that opens it maps all of it.
    pub(crate) fn export_ipc(&self) -> Result<IpcExport, GpuError> {
        let device = self.ctx.device;
        self.ctx.bind()?;
        let d = &self.ctx.driver;
        let (base, size) = d
            .address_range(self.addr)
            .map_err(|e| ipc_error(e, device))?;
        if self.addr < base || self.addr - base + self.len as u64 > size {
            return Err(GpuError::NotDeviceMemory {
                device,
                addr: self.addr,
                len: self.len as u64,
                found: format!("not inside one allocation (the driver says {base:#x}+{size})"),
            });
        }
        let handle = d.ipc_handle(base).map_err(|e| ipc_error(e, device))?;
        Ok(IpcExport {
            handle,
            offset: self.addr - base,
        })
    }

    /// Maps `len` bytes at `offset` of the allocation another process of
    /// this host exported as `handle`, on the context's device. The whole
    /// allocation is mapped (the driver knows no less); what is returned
    /// covers the range asked for, checked against the allocation's length
    /// as the driver reports it here, and closes the mapping on drop.
    pub(crate) fn open_ipc(
        ctx: Arc<DeviceContext>,
        handle: &IpcHandle,
        offset: u64,
        len: u64,
    ) -> Result<Self, GpuError> {
        let device = ctx.device;
        ctx.bind()?;
        let base = ctx
            .driver
            .ipc_open(handle)
            .map_err(|e| ipc_error(e, device))?;
        let mut mem = Self {
            ctx,
            addr: base,
            len: 0,
            release: Release::IpcClose(base),
        };
        let (_, size) = mem
            .ctx
            .driver
            .address_range(base)
            .map_err(|e| ipc_error(e, device))?;
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|end| end > size) {
            // Dropping `mem` closes the mapping.
            return Err(GpuError::NotDeviceMemory {
                device,
                addr: base.wrapping_add(offset),
                len,
                found: format!("outside the allocation the handle maps ({size} bytes)"),
            });
        }
        let len = usize::try_from(len).map_err(|_| GpuError::NotDeviceMemory {
            device,
            addr: base,
            len,
            found: "a range longer than the address space".into(),
        })?;
        mem.addr = base + offset;
        mem.len = len;
        Ok(mem)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if matches!(self.release, Release::Nothing) {
            return;
        }
        if let Err(e) = self.ctx.bind() {
            tracing::warn!("leaking {self:?}: {e}");
            return;
        }
        match self.release {
            Release::Nothing => {}
            // SAFETY: `addr` came from `alloc` on this device and is freed
            // once, here; the region that held this value (and every
            // backend's clone) is gone, so no copy uses it (staged copies
            // are synchronized before they return).
            Release::Free => unsafe { self.ctx.driver.free(self.addr) },
            // SAFETY: `base` came from `ipc_open` and is closed once, here;
            // as above, no copy uses it.
            Release::IpcClose(base) => unsafe { self.ctx.driver.ipc_close(base) },
        }
    }
}
