//! The CUDA driver API (`libcuda.so.1`), loaded at run time.
//!
//! Only the functions kvlane calls are declared, with the `_v2` symbols
//! that 64-bit code links against (the unsuffixed `cuMemAlloc` & co. are the
//! old 32-bit ABI).

use super::{
    dmabuf_fd, CallError, Driver, GpuDevice, GpuInfo, GpuRuntime, GpuUnavailable, IpcHandle,
    PointerKind, Stream,
};
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::OwnedFd;
use std::sync::Mutex;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Environment variable naming the library to load instead of `libcuda.so.1`.
pub(crate) const ENV: &str = "KVLANE_CUDA_LIBRARY";
const DEFAULT: &str = "libcuda.so.1";

struct Fns {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    memcpy_htod_async:
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    memcpy_dtod_async: unsafe extern "C" fn(CuDevicePtr, CuDevicePtr, usize, CuStream) -> CuResult,
    /// CUDA 11.7+; absent from older drivers.
    get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, c_int, u64) -> CuResult>,
    /// IPC (`cuIpc*`) and `cuMemGetAddressRange_v2`: optional, so that a
    /// driver without them still serves everything else; their absence is
    /// an unsupported error where they are needed.
    mem_get_address_range:
        Option<unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, CuDevicePtr) -> CuResult>,
    ipc_get_mem_handle: Option<unsafe extern "C" fn(*mut IpcHandle, CuDevicePtr) -> CuResult>,
    ipc_open_mem_handle:
        Option<unsafe extern "C" fn(*mut CuDevicePtr, IpcHandle, c_uint) -> CuResult>,
    ipc_close_mem_handle: Option<unsafe extern "C" fn(CuDevicePtr) -> CuResult>,
}

/// The loaded driver. Primary contexts are retained on first use and kept
/// for the life of the process (the driver releases them at exit).
pub(crate) struct Cuda {
    f: Fns,
    contexts: Mutex<Vec<Option<usize>>>,
    // Last: the function pointers above point into it.
    _lib: Library,
}

impl Cuda {
    /// Loads the driver (`KVLANE_CUDA_LIBRARY` or `libcuda.so.1`) and runs
    /// `cuInit`.
    pub(crate) fn load() -> Result<Self, GpuUnavailable> {
        let path = std::env::var(ENV).unwrap_or_else(|_| DEFAULT.to_owned());
        // SAFETY: loading the CUDA driver runs its initializers, which have no
        // preconditions; it is the library the user (or the default soname)
        // names as the CUDA driver.
        let lib = unsafe { Library::new(&path) }.map_err(|e| GpuUnavailable::NoLibrary {
            runtime: GpuRuntime::Cuda,
            library: path.clone(),
            reason: e.to_string(),
            env: ENV,
        })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the field's type is the function's C prototype from
                // `cuda.h` (CUDA 12); the pointer is used only while `lib`
                // lives (it is stored beside it).
                match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                    Ok(s) => *s,
                    Err(_) => {
                        return Err(GpuUnavailable::MissingSymbol {
                            runtime: GpuRuntime::Cuda,
                            symbol: $name,
                        })
                    }
                }
            }};
        }
        let f = Fns {
            init: sym!("cuInit"),
            get_error_name: sym!("cuGetErrorName"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            device_get_name: sym!("cuDeviceGetName"),
            device_get_pci_bus_id: sym!("cuDeviceGetPCIBusId"),
            device_total_mem: sym!("cuDeviceTotalMem_v2"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            pointer_get_attribute: sym!("cuPointerGetAttribute"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            mem_host_alloc: sym!("cuMemHostAlloc"),
            mem_free_host: sym!("cuMemFreeHost"),
            stream_create: sym!("cuStreamCreate"),
            stream_destroy: sym!("cuStreamDestroy_v2"),
            stream_synchronize: sym!("cuStreamSynchronize"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
            memcpy_dtod_async: sym!("cuMemcpyDtoDAsync_v2"),
            // SAFETY: as in `sym!`.
            get_handle_for_address_range: unsafe { lib.get(b"cuMemGetHandleForAddressRange\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as in `sym!` (prototypes from `cuda.h`, CUDA 12; the
            // header maps cuMemGetAddressRange and cuIpcOpenMemHandle to
            // these `_v2` symbols).
            mem_get_address_range: unsafe { lib.get(b"cuMemGetAddressRange_v2\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as above.
            ipc_get_mem_handle: unsafe { lib.get(b"cuIpcGetMemHandle\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            ipc_open_mem_handle: unsafe { lib.get(b"cuIpcOpenMemHandle_v2\0") }
                .ok()
                .map(|s| *s),
            // SAFETY: as above.
            ipc_close_mem_handle: unsafe { lib.get(b"cuIpcCloseMemHandle\0") }
                .ok()
                .map(|s| *s),
        };
        let cuda = Self {
            f,
            contexts: Mutex::new(Vec::new()),
            _lib: lib,
        };
        // SAFETY: `cuInit(0)` has no pointer arguments.
        let rc = unsafe { (cuda.f.init)(0) };
        if rc != CUDA_SUCCESS {
            return Err(GpuUnavailable::Init {
                code: rc,
                name: cuda.error_name(rc),
            });
        }
        Ok(cuda)
    }

    fn error_name(&self, rc: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out pointer; on success the driver stores a
        // static NUL-terminated string in it.
        if unsafe { (self.f.get_error_name)(rc, &mut p) } == CUDA_SUCCESS && !p.is_null() {
            // SAFETY: as above, a static C string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("CUDA error {rc}")
        }
    }

    fn check(&self, call: &'static str, rc: CuResult) -> Result<(), CallError> {
        if rc == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CallError {
                call,
                code: rc,
                name: self.error_name(rc),
            })
        }
    }

    fn device(&self, ordinal: u32) -> Result<CuDevice, CallError> {
        let mut dev: CuDevice = 0;
        let ord = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        // SAFETY: `dev` is a valid out pointer.
        self.check("cuDeviceGet", unsafe { (self.f.device_get)(&mut dev, ord) })?;
        Ok(dev)
    }

    fn string(
        &self,
        call: &'static str,
        f: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
        dev: CuDevice,
    ) -> Result<String, CallError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` holds `len` bytes; the driver writes a NUL-terminated
        // string of at most `len` bytes into it.
        self.check(call, unsafe {
            f(buf.as_mut_ptr(), buf.len() as c_int - 1, dev)
        })?;
        // SAFETY: the buffer is NUL-terminated (its last byte is never written).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

impl Driver for Cuda {
    fn device_count(&self) -> Result<u32, CallError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.f.device_get_count)(&mut n)
        })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    fn info(&self, ordinal: u32) -> Result<GpuInfo, CallError> {
        let dev = self.device(ordinal)?;
        let name = self.string("cuDeviceGetName", self.f.device_get_name, dev)?;
        let pci = self.string("cuDeviceGetPCIBusId", self.f.device_get_pci_bus_id, dev)?;
        let mut total = 0usize;
        // SAFETY: `total` is a valid out pointer.
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.f.device_total_mem)(&mut total, dev)
        })?;
        Ok(GpuInfo {
            device: GpuDevice::cuda(ordinal),
            name,
            pci_bus_id: pci.to_ascii_lowercase(),
            total_mem: total as u64,
        })
    }

    fn bind(&self, ordinal: u32) -> Result<(), CallError> {
        let ctx = {
            let mut ctxs = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
            let i = ordinal as usize;
            if ctxs.len() <= i {
                ctxs.resize(i + 1, None);
            }
            match ctxs[i] {
                Some(c) => c,
                None => {
                    let dev = self.device(ordinal)?;
                    let mut c: CuContext = std::ptr::null_mut();
                    // SAFETY: `c` is a valid out pointer; the retained context
                    // is kept for the life of the process.
                    self.check("cuDevicePrimaryCtxRetain", unsafe {
                        (self.f.primary_ctx_retain)(&mut c, dev)
                    })?;
                    ctxs[i] = Some(c as usize);
                    c as usize
                }
            }
        };
        // SAFETY: `ctx` is a primary context retained above and never released.
        self.check("cuCtxSetCurrent", unsafe {
            (self.f.ctx_set_current)(ctx as CuContext)
        })
    }

    fn pointer_kind(&self, addr: u64) -> Result<PointerKind, CallError> {
        let mut ty: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one `CUmemorytype` (an unsigned int).
        let rc = unsafe {
            (self.f.pointer_get_attribute)(
                (&mut ty as *mut c_uint).cast(),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if rc == CUDA_ERROR_INVALID_VALUE {
            return Ok(PointerKind::Unknown);
        }
        self.check("cuPointerGetAttribute", rc)?;
        if ty != CU_MEMORYTYPE_DEVICE {
            return Ok(PointerKind::Host);
        }
        let mut ord: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int.
        self.check("cuPointerGetAttribute", unsafe {
            (self.f.pointer_get_attribute)(
                (&mut ord as *mut c_int).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })?;
        Ok(PointerKind::Device(u32::try_from(ord).unwrap_or(u32::MAX)))
    }

    fn alloc(&self, len: usize) -> Result<u64, CallError> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: `p` is a valid out pointer.
        self.check("cuMemAlloc_v2", unsafe { (self.f.mem_alloc)(&mut p, len) })?;
        Ok(p)
    }

    unsafe fn free(&self, addr: u64) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.mem_free)(addr) };
        if let Err(e) = self.check("cuMemFree_v2", rc) {
            tracing::warn!(addr = format_args!("{addr:#x}"), "{}: {}", e.call, e.name);
        }
    }

    fn host_alloc(&self, len: usize) -> Result<*mut u8, CallError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out pointer.
        self.check("cuMemHostAlloc", unsafe {
            (self.f.mem_host_alloc)(&mut p, len, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    unsafe fn host_free(&self, ptr: *mut u8) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.mem_free_host)(ptr.cast()) };
        if let Err(e) = self.check("cuMemFreeHost", rc) {
            tracing::warn!("{}: {}", e.call, e.name);
        }
    }

    fn stream_create(&self) -> Result<Stream, CallError> {
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out pointer.
        self.check("cuStreamCreate", unsafe {
            (self.f.stream_create)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream(s as usize))
    }

    unsafe fn stream_destroy(&self, stream: Stream) {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { (self.f.stream_destroy)(stream.0 as CuStream) };
        if let Err(e) = self.check("cuStreamDestroy_v2", rc) {
            tracing::warn!("{}: {}", e.call, e.name);
        }
    }

    fn stream_sync(&self, stream: Stream) -> Result<(), CallError> {
        // SAFETY: `stream` is a live stream (the caller owns it).
        self.check("cuStreamSynchronize", unsafe {
            (self.f.stream_synchronize)(stream.0 as CuStream)
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
        self.check("cuMemcpyHtoDAsync_v2", unsafe {
            (self.f.memcpy_htod_async)(dst, src.cast(), len, stream.0 as CuStream)
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
        self.check("cuMemcpyDtoHAsync_v2", unsafe {
            (self.f.memcpy_dtoh_async)(dst.cast(), src, len, stream.0 as CuStream)
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
        self.check("cuMemcpyDtoDAsync_v2", unsafe {
            (self.f.memcpy_dtod_async)(dst, src, len, stream.0 as CuStream)
        })
    }

    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd, CallError> {
        let call = "cuMemGetHandleForAddressRange";
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
                CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        dmabuf_fd(call, fd)
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64), CallError> {
        let call = "cuMemGetAddressRange_v2";
        let f = self
            .f
            .mem_get_address_range
            .ok_or(CallError::missing(call))?;
        let (mut base, mut size): (CuDevicePtr, usize) = (0, 0);
        // SAFETY: two valid out pointers.
        self.check(call, unsafe { f(&mut base, &mut size, addr) })?;
        Ok((base, size as u64))
    }

    fn ipc_handle(&self, base: u64) -> Result<IpcHandle, CallError> {
        let call = "cuIpcGetMemHandle";
        let f = self.f.ipc_get_mem_handle.ok_or(CallError::missing(call))?;
        let mut h = IpcHandle([0; super::IPC_HANDLE_LEN]);
        // SAFETY: `h` is a valid out pointer to a `CUipcMemHandle`.
        self.check(call, unsafe { f(&mut h, base) })?;
        Ok(h)
    }

    fn ipc_open(&self, handle: &IpcHandle) -> Result<u64, CallError> {
        let call = "cuIpcOpenMemHandle_v2";
        let f = self.f.ipc_open_mem_handle.ok_or(CallError::missing(call))?;
        let mut p: CuDevicePtr = 0;
        // SAFETY: `p` is a valid out pointer; the handle is passed by value.
        self.check(call, unsafe {
            f(&mut p, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p)
    }

    unsafe fn ipc_close(&self, base: u64) {
        let call = "cuIpcCloseMemHandle";
        let Some(f) = self.f.ipc_close_mem_handle else {
            return;
        };
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { f(base) };
        if let Err(e) = self.check(call, rc) {
            tracing::warn!(addr = format_args!("{base:#x}"), "{}: {}", e.call, e.name);
        }
    }
}
