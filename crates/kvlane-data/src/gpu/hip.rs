//! ROCm HIP (`libamdhip64.so`), loaded at run time.
//!
//! Written against the HIP 6 headers and not yet run on an AMD GPU (see the
//! README's GPU section). The tests run it against a mock runtime
//! (`testdata/mock_hip.c`) built as ROCm 6.2 and as ROCm 5.7.

use super::{
    dmabuf_fd, CallError, Driver, GpuDevice, GpuInfo, GpuRuntime, GpuUnavailable, IpcHandle,
    PointerKind, Stream,
};
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::OwnedFd;

type HipError = c_int;
type HipStream = *mut c_void;

const HIP_SUCCESS: HipError = 0;
const HIP_ERROR_INVALID_VALUE: HipError = 1;
const HIP_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const HIP_HOST_MALLOC_PORTABLE: c_uint = 1;
const HIP_STREAM_NON_BLOCKING: c_uint = 1;
const HIP_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Environment variable naming the library to load instead of `libamdhip64.so`.
pub(crate) const ENV: &str = "KVLANE_HIP_LIBRARY";
const DEFAULT: &str = "libamdhip64.so";

struct Fns {
    init: unsafe extern "C" fn(c_uint) -> HipError,
    get_error_name: unsafe extern "C" fn(HipError) -> *const c_char,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> HipError,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> HipError,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> HipError,
    set_device: unsafe extern "C" fn(c_int) -> HipError,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, u64) -> HipError,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
    free: unsafe extern "C" fn(*mut c_void) -> HipError,
    host_malloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> HipError,
    host_free: unsafe extern "C" fn(*mut c_void) -> HipError,
    stream_create_with_flags: unsafe extern "C" fn(*mut HipStream, c_uint) -> HipError,
    stream_destroy: unsafe extern "C" fn(HipStream) -> HipError,
    stream_synchronize: unsafe extern "C" fn(HipStream) -> HipError,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, HipStream) -> HipError,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, HipStream) -> HipError,
    memcpy_dtod_async: unsafe extern "C" fn(u64, u64, usize, HipStream) -> HipError,
    /// ROCm 6.2+.
    get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> HipError>,
    /// IPC (`hipIpc*`) and `hipMemGetAddressRange`: optional, their
    /// absence an unsupported error where they are needed.
    mem_get_address_range: Option<unsafe extern "C" fn(*mut u64, *mut usize, u64) -> HipError>,
    ipc_get_mem_handle: Option<unsafe extern "C" fn(*mut IpcHandle, u64) -> HipError>,
    ipc_open_mem_handle: Option<unsafe extern "C" fn(*mut u64, IpcHandle, c_uint) -> HipError>,
    ipc_close_mem_handle: Option<unsafe extern "C" fn(u64) -> HipError>,
}

/// The loaded HIP runtime.
pub(crate) struct Hip {
    f: Fns,
    /// `hipMemoryTypeDevice`: 2 since ROCm 6.0, 1 before.
    device_type: c_uint,
    // Last: the function pointers above point into it.
    _lib: Library,
}

impl Hip {
    /// Loads HIP (`KVLANE_HIP_LIBRARY` or `libamdhip64.so`) and runs `hipInit`.
    pub(crate) fn load() -> Result<Self, GpuUnavailable> {
        let path = std::env::var(ENV).unwrap_or_else(|_| DEFAULT.to_owned());
        // SAFETY: loading the HIP runtime runs its initializers, which have
        // no preconditions; it is the library the user names as HIP.
        let lib = unsafe { Library::new(&path) }.map_err(|e| GpuUnavailable::NoLibrary {
            runtime: GpuRuntime::Rocm,
            library: path.clone(),
            reason: e.to_string(),
            env: ENV,
        })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the field's type is the function's C prototype from
                // `hip_runtime_api.h` (ROCm 6); the pointer is used only while
                // `lib` lives (it is stored beside it).
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(_) => {
                        return Err(GpuUnavailable::MissingSymbol {
                            runtime: GpuRuntime::Rocm,
                            symbol: $name,
                        })
                    }
                }
            }};
        }
        let f = Fns {
            init: sym!("hipInit"),
            get_error_name: sym!("hipGetErrorName"),
            runtime_get_version: sym!("hipRuntimeGetVersion"),
            get_device_count: sym!("hipGetDeviceCount"),
            device_get_name: sym!("hipDeviceGetName"),
            device_get_pci_bus_id: sym!("hipDeviceGetPCIBusId"),
            device_total_mem: sym!("hipDeviceTotalMem"),
            set_device: sym!("hipSetDevice"),
            pointer_get_attribute: sym!("hipPointerGetAttribute"),
            malloc: sym!("hipMalloc"),
            free: sym!("hipFree"),
            host_malloc: sym!("hipHostMalloc"),
            host_free: sym!("hipHostFree"),
            stream_create_with_flags: sym!("hipStreamCreateWithFlags"),
            stream_destroy: sym!("hipStreamDestroy"),
            stream_synchronize: sym!("hipStreamSynchronize"),
            memcpy_htod_async: sym!("hipMemcpyHtoDAsync"),
            memcpy_dtoh_async: sym!("hipMemcpyDtoHAsync"),
            memcpy_dtod_async: sym!("hipMemcpyDtoDAsync"),
            // SAFETY: as in `sym!`.
            get_handle_for_address_range: unsafe { lib.get(b"hipMemGetHandleForAddressRange\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as in `sym!` (device pointers are `void *`, passed as
            // 64-bit addresses).
            mem_get_address_range: unsafe { lib.get(b"hipMemGetAddressRange\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as above.
            ipc_get_mem_handle: unsafe { lib.get(b"hipIpcGetMemHandle\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            ipc_open_mem_handle: unsafe { lib.get(b"hipIpcOpenMemHandle\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as above.
            ipc_close_mem_handle: unsafe { lib.get(b"hipIpcCloseMemHandle\0") }
                .ok()
                .map(|s| *s),
        };
        // SAFETY: `hipInit(0)` has no pointer arguments.
        let rc = unsafe { (f.init)(0) };
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out pointer.
        let vrc = unsafe { (f.runtime_get_version)(&mut version) };
        let hip = Self {
            device_type: if vrc == HIP_SUCCESS && version >= 60_000_000 {
                2
            } else {
                1
            },
            f,
            _lib: lib,
        };
        if rc != HIP_SUCCESS {
            return Err(GpuUnavailable::Init {
                code: rc,
                name: hip.error_name(rc),
            });
        }
        Ok(hip)
    }

    fn error_name(&self, rc: HipError) -> String {
        // SAFETY: returns a static NUL-terminated string (or null).
        let p = unsafe { (self.f.get_error_name)(rc) };
        if p.is_null() {
            format!("HIP error {rc}")
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    fn check(&self, call: &'static str, rc: HipError) -> Result<(), CallError> {
        if rc == HIP_SUCCESS {
            Ok(())
        } else {
            Err(CallError {
                call,
                code: rc,
                name: self.error_name(rc),
            })
        }
    }

    fn string(
        &self,
        call: &'static str,
        f: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
        dev: c_int,
    ) -> Result<String, CallError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the runtime writes a NUL-terminated string of at most `len`
        // bytes; the last byte of `buf` is never written.
        self.check(call, unsafe {
            f(buf.as_mut_ptr(), buf.len() as c_int - 1, dev)
        })?;
        // SAFETY: NUL-terminated, as above.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

fn ordinal(o: u32) -> c_int {
    c_int::try_from(o).unwrap_or(c_int::MAX)
}

impl Driver for Hip {
    fn device_count(&self) -> Result<u32, CallError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer.
        let rc = unsafe { (self.f.get_device_count)(&mut n) };
        // hipErrorNoDevice (100): zero devices, not a failure.
        if rc == 100 {
            return Ok(0);
        }
        self.check("hipGetDeviceCount", rc)?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    fn info(&self, o: u32) -> Result<GpuInfo, CallError> {
        let dev = ordinal(o);
        let name = self.string("hipDeviceGetName", self.f.device_get_name, dev)?;
        let pci = self.string("hipDeviceGetPCIBusId", self.f.device_get_pci_bus_id, dev)?;
        let mut total = 0usize;
        // SAFETY: `total` is a valid out pointer.
        self.check("hipDeviceTotalMem", unsafe {
            (self.f.device_total_mem)(&mut total, dev)
        })?;
        Ok(GpuInfo {
            device: GpuDevice::rocm(o),
            name,
            pci_bus_id: pci.to_ascii_lowercase(),
            total_mem: total as u64,
        })
    }

    fn bind(&self, o: u32) -> Result<(), CallError> {
        // SAFETY: no pointer arguments.
        self.check("hipSetDevice", unsafe { (self.f.set_device)(ordinal(o)) })
    }

    fn pointer_kind(&self, addr: u64) -> Result<PointerKind, CallError> {
        let mut ty: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one `hipMemoryType` (an unsigned int).
        let rc = unsafe {
            (self.f.pointer_get_attribute)(
                (&mut ty as *mut c_uint).cast(),
                HIP_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if rc == HIP_ERROR_INVALID_VALUE {
            return Ok(PointerKind::Unknown);
        }
        self.check("hipPointerGetAttribute", rc)?;
        if ty != self.device_type {
            return Ok(PointerKind::Host);
        }
        let mut ord: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int.
        self.check("hipPointerGetAttribute", unsafe {
            (self.f.pointer_get_attribute)(
                (&mut ord as *mut c_int).cast(),
                HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })?;
        Ok(PointerKind::Device(u32::try_from(ord).unwrap_or(u32::MAX)))
    }

    fn alloc(&self, len: usize) -> Result<u64, CallError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out pointer.
        self.check("hipMalloc", unsafe { (self.f.malloc)(&mut p, len) })?;
        Ok(p as u64)
    }

    unsafe fn free(&self, addr: u64) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.free)(addr as *mut c_void) };
        if let Err(e) = self.check("hipFree", rc) {
            tracing::warn!(addr = format_args!("{addr:#x}"), "{}: {}", e.call, e.name);
        }
    }

    fn host_alloc(&self, len: usize) -> Result<*mut u8, CallError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out pointer.
        self.check("hipHostMalloc", unsafe {
            (self.f.host_malloc)(&mut p, len, HIP_HOST_MALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    unsafe fn host_free(&self, ptr: *mut u8) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.host_free)(ptr.cast()) };
        if let Err(e) = self.check("hipHostFree", rc) {
            tracing::warn!("{}: {}", e.call, e.name);
        }
    }

    fn stream_create(&self) -> Result<Stream, CallError> {
        let mut s: HipStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out pointer.
        self.check("hipStreamCreateWithFlags", unsafe {
            (self.f.stream_create_with_flags)(&mut s, HIP_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream(s as usize))
    }

    unsafe fn stream_destroy(&self, stream: Stream) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.stream_destroy)(stream.0 as HipStream) };
        if let Err(e) = self.check("hipStreamDestroy", rc) {
            tracing::warn!("{}: {}", e.call, e.name);
        }
    }

    fn stream_sync(&self, stream: Stream) -> Result<(), CallError> {
        // SAFETY: `stream` is a live stream (the caller owns it).
        self.check("hipStreamSynchronize", unsafe {
            (self.f.stream_synchronize)(stream.0 as HipStream)
        })
    }

    unsafe fn htod_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError> {
        // SAFETY: forwarded from this function's contract.
        self.check("hipMemcpyHtoDAsync", unsafe {
            (self.f.memcpy_htod_async)(dst, src.cast(), len, stream.0 as HipStream)
        })
    }

    unsafe fn dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError> {
        // SAFETY: forwarded from this function's contract.
        self.check("hipMemcpyDtoHAsync", unsafe {
            (self.f.memcpy_dtoh_async)(dst.cast(), src, len, stream.0 as HipStream)
        })
    }

    unsafe fn dtod_async(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), CallError> {
        // SAFETY: forwarded from this function's contract.
        self.check("hipMemcpyDtoDAsync", unsafe {
            (self.f.memcpy_dtod_async)(dst, src, len, stream.0 as HipStream)
        })
    }

    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd, CallError> {
        let call = "hipMemGetHandleForAddressRange";
        let f = self
            .f
            .get_handle_for_address_range
            .ok_or(CallError::missing(call))?;
        let mut fd: c_int = -1;
        // SAFETY: DMA_BUF_FD writes one int (the new fd) into `fd`.
        self.check(call, unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                addr,
                len,
                HIP_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        dmabuf_fd(call, fd)
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64), CallError> {
        let call = "hipMemGetAddressRange";
        let f = self
            .f
            .mem_get_address_range
            .ok_or(CallError::missing(call))?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: two valid out pointers.
        self.check(call, unsafe { f(&mut base, &mut size, addr) })?;
        Ok((base, size as u64))
    }

    fn ipc_handle(&self, base: u64) -> Result<IpcHandle, CallError> {
        let call = "hipIpcGetMemHandle";
        let f = self.f.ipc_get_mem_handle.ok_or(CallError::missing(call))?;
        let mut h = IpcHandle([0; super::IPC_HANDLE_LEN]);
        // SAFETY: `h` is a valid out pointer to a `hipIpcMemHandle_t`.
        self.check(call, unsafe { f(&mut h, base) })?;
        Ok(h)
    }

    fn ipc_open(&self, handle: &IpcHandle) -> Result<u64, CallError> {
        let call = "hipIpcOpenMemHandle";
        let f = self.f.ipc_open_mem_handle.ok_or(CallError::missing(call))?;
        let mut p = 0u64;
        // SAFETY: `p` is a valid out pointer; the handle is passed by value.
        self.check(call, unsafe {
            f(&mut p, *handle, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p)
    }

    unsafe fn ipc_close(&self, base: u64) {
        let Some(f) = self.f.ipc_close_mem_handle else {
            return;
        };
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { f(base) };
        if let Err(e) = self.check("hipIpcCloseMemHandle", rc) {
            tracing::warn!(addr = format_args!("{base:#x}"), "{}: {}", e.call, e.name);
        }
    }
}
