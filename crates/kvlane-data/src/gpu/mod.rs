//! GPU memory: CUDA (driver API, `libcuda.so.1`) and ROCm (HIP,
//! `libamdhip64.so`), both loaded at run time with `libloading`.
//!
//! Nothing here needs a toolkit to build: the handful of driver functions
//! kvlane calls are declared in [`cuda`] and [`hip`] and resolved with
//! `dlopen`/`dlsym` the first time a device is used. Without the library, or
//! without the device, every entry point returns
//! [`GpuError::Unsupported`] naming the device and the reason.
//!
//! What the rest of the crate uses:
//!
//! - [`gpu_devices`]: enumeration with PCI bus ids (`kvlane devices`).
//! - [`Region::alloc_device`](crate::Region::alloc_device) and the `unsafe`
//!   [`Region::from_device_ptr`](crate::Region::from_device_ptr): regions
//!   of kind [`MemoryKind::Gpu`](crate::MemoryKind::Gpu), checked against
//!   the driver's pointer attributes.
//! - [`staging`]: chunked, double-buffered copies through pinned host
//!   buffers on the device's own streams, for the backends that move bytes
//!   with the CPU (tcp, loopback).
//! - dma-buf export for the verbs backend
//!   ([`Region::export_dmabuf`](crate::Region::export_dmabuf)).
//!
//! Library paths: `KVLANE_CUDA_LIBRARY` and `KVLANE_HIP_LIBRARY` override
//! the defaults (`libcuda.so.1`, `libamdhip64.so`); the tests point them at
//! mocks that implement the same functions on host memory.

pub(crate) mod cuda;
mod device;
mod error;
pub(crate) mod hip;
mod region;
pub(crate) mod staging;

pub(crate) use device::DeviceMemory;
pub use error::{GpuError, GpuUnavailable};
pub use region::DmaBuf;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::os::fd::OwnedFd;
use std::str::FromStr;

/// A GPU runtime kvlane can load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GpuRuntime {
    /// NVIDIA CUDA driver API (`libcuda.so.1`).
    Cuda,
    /// AMD ROCm HIP (`libamdhip64.so`).
    Rocm,
}

impl GpuRuntime {
    /// `"cuda"` or `"rocm"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Rocm => "rocm",
        }
    }
}

impl fmt::Display for GpuRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One GPU: a runtime and the device's ordinal in it. Displays and parses
/// as `cuda:0` / `rocm:1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GpuDevice {
    /// The runtime that owns the device.
    pub runtime: GpuRuntime,
    /// The device's ordinal in that runtime.
    pub ordinal: u32,
}

impl GpuDevice {
    /// CUDA device `ordinal`.
    pub const fn cuda(ordinal: u32) -> Self {
        Self {
            runtime: GpuRuntime::Cuda,
            ordinal,
        }
    }

    /// ROCm device `ordinal`.
    pub const fn rocm(ordinal: u32) -> Self {
        Self {
            runtime: GpuRuntime::Rocm,
            ordinal,
        }
    }
}

impl fmt::Display for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.runtime, self.ordinal)
    }
}

/// Why a string is not a [`GpuDevice`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a GPU device: expected cuda:N or rocm:N")]
pub struct ParseGpuDeviceError(String);

impl FromStr for GpuDevice {
    type Err = ParseGpuDeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseGpuDeviceError(s.to_owned());
        let (rt, n) = s.split_once(':').ok_or_else(bad)?;
        let runtime = match rt {
            "cuda" => GpuRuntime::Cuda,
            "rocm" | "hip" => GpuRuntime::Rocm,
            _ => return Err(bad()),
        };
        let ordinal = n.parse().map_err(|_| bad())?;
        Ok(Self { runtime, ordinal })
    }
}

/// What [`gpu_devices`] reports for one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// The device.
    pub device: GpuDevice,
    /// The driver's name for it, e.g. `"NVIDIA H200"`.
    pub name: String,
    /// PCI address, `domain:bus:device.function` (lower case), as sysfs
    /// spells it under `/sys/bus/pci/devices/`.
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_mem: u64,
}

impl fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} pci {} memory {} MiB",
            self.device,
            self.name,
            self.pci_bus_id,
            self.total_mem >> 20
        )
    }
}

/// Lists the GPUs of `runtime`. No library or no device is
/// [`GpuError::Unsupported`] (for device 0 of the runtime), not an empty
/// list, so callers can say why.
pub fn gpu_devices(runtime: GpuRuntime) -> Result<Vec<GpuInfo>, GpuError> {
    let first = GpuDevice {
        runtime,
        ordinal: 0,
    };
    let driver = device::driver(first)?;
    let count = driver.device_count().map_err(|e| e.on(first))?;
    if count == 0 {
        return Err(GpuError::Unsupported {
            device: first,
            why: GpuUnavailable::NoDevice { count },
        });
    }
    (0..count)
        .map(|ordinal| {
            let device = GpuDevice { runtime, ordinal };
            driver.info(ordinal).map_err(|e| e.on(device))
        })
        .collect()
}

/// The GPU of `runtime` whose memory `addr` is, per the driver's pointer
/// attributes; `None` for host or unknown memory. Used where only an
/// address is known (`__cuda_array_interface__` names no device).
pub fn gpu_device_of(runtime: GpuRuntime, addr: u64) -> Result<Option<GpuDevice>, GpuError> {
    let first = GpuDevice {
        runtime,
        ordinal: 0,
    };
    let ctx = device::DeviceContext::get(first)?;
    ctx.bind()?;
    match ctx.driver().pointer_kind(addr).map_err(|e| e.on(first))? {
        PointerKind::Device(ordinal) => Ok(Some(GpuDevice { runtime, ordinal })),
        PointerKind::Host | PointerKind::Unknown => Ok(None),
    }
}

/// The device of `runtime` at PCI address `pci_bus_id` (as
/// [`GpuInfo::pci_bus_id`] spells it), as this process numbers it; `None`
/// when this process sees no such device (`CUDA_VISIBLE_DEVICES`,
/// `HIP_VISIBLE_DEVICES`, a container).
pub(crate) fn gpu_device_at(
    runtime: GpuRuntime,
    pci_bus_id: &str,
) -> Result<Option<GpuDevice>, GpuError> {
    Ok(gpu_devices(runtime)?
        .into_iter()
        .find(|i| i.pci_bus_id.eq_ignore_ascii_case(pci_bus_id))
        .map(|i| i.device))
}

/// Where a pointer lives, per the driver's pointer attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PointerKind {
    /// Device memory of this ordinal.
    Device(u32),
    /// Host memory the driver knows (pinned, registered or managed).
    Host,
    /// Memory the driver does not know (ordinary pageable host memory).
    Unknown,
}

/// A failed driver call, before it is attributed to a device.
#[derive(Debug, Clone)]
pub(crate) struct CallError {
    pub(crate) call: &'static str,
    pub(crate) code: i32,
    pub(crate) name: String,
}

/// `CUDA_ERROR_NOT_SUPPORTED` and `hipErrorNotSupported` (the same value).
pub(crate) const ERROR_NOT_SUPPORTED: i32 = 801;
/// The code of a [`CallError`] for a function the library does not export.
pub(crate) const MISSING_SYMBOL: i32 = -1;

impl CallError {
    pub(crate) fn missing(call: &'static str) -> Self {
        Self {
            call,
            code: MISSING_SYMBOL,
            name: "not exported by this driver".to_owned(),
        }
    }

    /// Whether the driver says it cannot do this at all (old driver, kernel
    /// without dma-buf support), as opposed to failing this once.
    pub(crate) fn is_unsupported(&self) -> bool {
        self.code == ERROR_NOT_SUPPORTED || self.code == MISSING_SYMBOL
    }

    pub(crate) fn on(self, device: GpuDevice) -> GpuError {
        GpuError::Driver {
            device,
            call: self.call,
            code: self.code,
            name: self.name,
        }
    }
}

/// Takes ownership of the dma-buf fd a successful export call returned.
fn dmabuf_fd(call: &'static str, fd: std::ffi::c_int) -> Result<OwnedFd, CallError> {
    if fd < 0 {
        return Err(CallError {
            call,
            code: 0,
            name: "returned no file descriptor".to_owned(),
        });
    }
    // SAFETY: the driver's export call succeeded and returned this new
    // dma-buf fd, which nothing else owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// An opaque stream handle (`CUstream` / `hipStream_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stream(pub(crate) usize);

/// The operations kvlane needs from a GPU driver. Implemented over the
/// CUDA driver API and over HIP. Everything except `device_count`, `info`
/// and `bind` acts on the device last bound on the calling thread:
/// [`DeviceContext`] binds before every call.
pub(crate) trait Driver: Send + Sync {
    fn device_count(&self) -> Result<u32, CallError>;
    fn info(&self, ordinal: u32) -> Result<GpuInfo, CallError>;
    /// Makes `ordinal` current on the calling thread (retaining its
    /// primary context the first time).
    fn bind(&self, ordinal: u32) -> Result<(), CallError>;
    fn pointer_kind(&self, addr: u64) -> Result<PointerKind, CallError>;
    fn alloc(&self, len: usize) -> Result<u64, CallError>;
    /// # Safety
    /// `addr` came from [`alloc`](Self::alloc) and is freed once.
    unsafe fn free(&self, addr: u64);
    fn host_alloc(&self, len: usize) -> Result<*mut u8, CallError>;
    /// # Safety
    /// `ptr` came from [`host_alloc`](Self::host_alloc), is freed once, and
    /// no copy into or out of it is in flight.
    unsafe fn host_free(&self, ptr: *mut u8);
    fn stream_create(&self) -> Result<Stream, CallError>;
    /// # Safety
    /// `stream` came from [`stream_create`](Self::stream_create) and is
    /// destroyed once.
    unsafe fn stream_destroy(&self, stream: Stream);
    fn stream_sync(&self, stream: Stream) -> Result<(), CallError>;
    /// # Safety
    /// `dst..dst+len` is device memory and `src..src+len` pinned host memory,
    /// both valid until the stream is synchronized; `src` is not written
    /// before then.
    unsafe fn htod_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError>;
    /// # Safety
    /// As [`htod_async`](Self::htod_async), with the roles swapped; `dst` is
    /// not read or written before the stream is synchronized.
    unsafe fn dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError>;
    /// # Safety
    /// `dst..dst+len` and `src..src+len` are device memory (of the bound
    /// device, or reachable from it), valid until the stream is
    /// synchronized, and not otherwise written before then.
    unsafe fn dtod_async(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError>;
    /// Exports `addr..addr+len` (page-aligned) as a dma-buf. A driver or
    /// kernel that cannot fails with [`CallError::is_unsupported`].
    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd, CallError>;
    /// The allocation that contains `addr`: its base and length
    /// (`cuMemGetAddressRange_v2` / `hipMemGetAddressRange`).
    fn address_range(&self, addr: u64) -> Result<(u64, u64), CallError>;
    /// An IPC handle for the allocation that starts at `base`
    /// (`cuIpcGetMemHandle` / `hipIpcGetMemHandle`): 64 bytes, opaque,
    /// that another process of this host opens with
    /// [`ipc_open`](Self::ipc_open). It names the **whole** allocation.
    fn ipc_handle(&self, base: u64) -> Result<IpcHandle, CallError>;
    /// Maps the allocation another process exported as `handle` into this
    /// process, on the bound device; its base address here
    /// (`cuIpcOpenMemHandle_v2` / `hipIpcOpenMemHandle`).
    fn ipc_open(&self, handle: &IpcHandle) -> Result<u64, CallError>;
    /// # Safety
    /// `base` came from [`ipc_open`](Self::ipc_open), is closed once, and
    /// no copy into or out of it is in flight.
    unsafe fn ipc_close(&self, base: u64);
}

/// Bytes of a CUDA or HIP IPC memory handle (`CU_IPC_HANDLE_SIZE`,
/// `HIP_IPC_HANDLE_SIZE`).
pub(crate) const IPC_HANDLE_LEN: usize = 64;

/// `CUipcMemHandle` / `hipIpcMemHandle_t`: passed by value to the open
/// call, so laid out as the C struct.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IpcHandle(pub(crate) [u8; IPC_HANDLE_LEN]);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_display_and_parse() {
        for (s, d) in [
            ("cuda:0", GpuDevice::cuda(0)),
            ("rocm:3", GpuDevice::rocm(3)),
        ] {
            assert_eq!(s.parse::<GpuDevice>(), Ok(d));
            assert_eq!(d.to_string(), s);
        }
        assert_eq!("hip:1".parse::<GpuDevice>(), Ok(GpuDevice::rocm(1)));
        for bad in ["cuda", "cuda:", "cuda:-1", "gpu:0", "cuda:0x1", ""] {
            let e = bad.parse::<GpuDevice>().unwrap_err();
            assert!(e.to_string().contains("cuda:N or rocm:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn unsupported_errors_name_device_and_cause() {
        let e = GpuError::Unsupported {
            device: GpuDevice::cuda(2),
            why: GpuUnavailable::NoDevice { count: 1 },
        };
        assert!(e.is_unsupported());
        assert_eq!(e.device(), GpuDevice::cuda(2));
        assert_eq!(
            e.to_string(),
            "cuda:2: unsupported: the driver reports 1 device(s)"
        );
        assert!(CallError::missing("cuMemGetHandleForAddressRange").is_unsupported());
    }
}
