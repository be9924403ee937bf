//! Registered memory: [`Region`], [`Access`], [`MemoryKind`], [`RemoteRegion`].
//!
//! A [`Region`] is a span of memory that backends may read and write on
//! behalf of local or remote transfers. Owned host memory is registered
//! safely ([`Region::alloc`], [`Region::from_vec`]): the region keeps the
//! buffer alive. Foreign memory (an engine's KV tensors, GPU memory exported
//! as dma-buf) is registered with the `unsafe` [`Region::from_raw`], whose
//! contract is that the memory outlives every clone of the region.
//! GPU memory is registered with [`Region::alloc_device`] or the `unsafe`
//! [`Region::from_device_ptr`] (in `gpu/region.rs`); the region then holds
//! the device's runtime handle, through which backends stage its bytes.
//!
//! Like memory registered with an RDMA NIC, the contents of bytes targeted
//! by an in-flight transfer are unspecified until that transfer completes.
//!
//! # Soundness
//!
//! A region is shared: `Clone` is a reference count, it is `Sync`, and NICs,
//! the kernel and remote peers write its memory behind Rust's back. So its
//! memory is treated like device memory: safe code reaches it only through
//! bounds-checked copies made with raw pointers ([`Region::read`],
//! [`Region::write`], [`Region::fill`], [`Region::copy_to`]) and through
//! syscalls that hand a raw range to the kernel ([`Region::recv_from`],
//! [`Region::send_to`], [`send_vectored`]). None of them creates a
//! `&[u8]` or `&mut [u8]` to region memory, so two threads (or a thread
//! and a NIC) touching the same bytes can leave them unspecified, as RDMA
//! does, but can never alias a Rust reference. Slice views exist only as
//! the `unsafe` [`Region::with_slice`] / [`Region::with_slice_mut`], whose
//! `# Safety` sections state the exclusivity they need:
//!
//! ```compile_fail,E0133
//! use kvlane_data::{Access, Region};
//! let r = Region::alloc(16, Access::ALL).unwrap();
//! let alias = r.clone();
//! // Two `&mut` to the same bytes from safe code: refused (E0133, call to
//! // an unsafe function), so this no longer compiles.
//! r.with_slice_mut(0, 16, |a| {
//!     alias.with_slice_mut(0, 16, |b| { a[0] = 1; b[0] = 2; })
//! }).unwrap().unwrap();
//! ```
//!
//! It is refused only for being unsafe: the same lines in an `unsafe`
//! block compile (this one is only built, never run: running it is exactly
//! the aliasing the `# Safety` contract forbids).
//!
//! ```no_run
//! use kvlane_data::{Access, Region};
//! let r = Region::alloc(16, Access::ALL).unwrap();
//! let alias = r.clone();
//! unsafe {
//!     r.with_slice_mut(0, 16, |a| {
//!         alias.with_slice_mut(0, 16, |b| { a[0] = 1; b[0] = 2; })
//!     }).unwrap().unwrap();
//! }
//! ```
//!
//! The same accesses through the safe copies compile, and the last write
//! wins:
//!
//! ```
//! use kvlane_data::{Access, Region};
//! let r = Region::alloc(16, Access::ALL).unwrap();
//! let alias = r.clone();
//! r.write(0, &[1]).unwrap();
//! alias.write(0, &[2]).unwrap();
//! let mut b = [0u8; 1];
//! r.read(0, &mut b).unwrap();
//! assert_eq!(b, [2]);
//! ```

use crate::error::DataError;
use crate::ids::{RegionId, RemoteKey};
use serde::{Deserialize, Serialize};
use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::io;
use std::ops::BitOr;
#[cfg(unix)]
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

/// Access rights of a region. Local read is always allowed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Access(u8);

impl Access {
    /// No rights beyond local read.
    pub const NONE: Self = Self(0);
    /// The local backend may write into the region (the target of a READ).
    pub const LOCAL_WRITE: Self = Self(1);
    /// Peers may READ from the region.
    pub const REMOTE_READ: Self = Self(2);
    /// Peers may WRITE into the region.
    pub const REMOTE_WRITE: Self = Self(4);
    /// Every right.
    pub const ALL: Self = Self(7);

    /// Whether every right in `other` is present.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bit set.
    pub const fn bits(self) -> u8 {
        self.0
    }
}

impl BitOr for Access {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = vec!["local_read"];
        for (flag, name) in [
            (Self::LOCAL_WRITE, "local_write"),
            (Self::REMOTE_READ, "remote_read"),
            (Self::REMOTE_WRITE, "remote_write"),
        ] {
            if self.contains(flag) {
                parts.push(name);
            }
        }
        write!(f, "{}", parts.join("|"))
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Where the memory of a region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Ordinary host memory, addressable by the CPU.
    Host,
    /// Accelerator memory exported as a dma-buf (ROCm, CUDA). Only backends
    /// that can register dma-bufs (verbs) serve it; the others refuse it
    /// with [`DataError::Unsupported`].
    Device {
        /// The dma-buf file descriptor.
        dmabuf_fd: i32,
        /// Offset of the region inside the dma-buf.
        offset: u64,
        /// Accelerator ordinal.
        device: u32,
    },
    /// GPU memory registered through its runtime ([`Region::alloc_device`],
    /// [`Region::from_device_ptr`]): verbs registers it by dma-buf or by
    /// address, tcp and loopback stage it through pinned host buffers.
    /// The address is a device address; the CPU never dereferences it.
    Gpu {
        /// The device.
        device: crate::gpu::GpuDevice,
    },
}

/// What a target advertises for one of its regions: enough for a peer to
/// address it in [`RemoteDescriptor`](crate::RemoteDescriptor)s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Key the target serves the region under.
    pub key: RemoteKey,
    /// Address of the region's first byte in the target's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Rights the target grants.
    pub access: Access,
}

impl RemoteRegion {
    /// The checks a target NIC makes before serving `op` on
    /// `offset..offset+len` of this region for `peer`: the remote right,
    /// then the bounds (overflow-safe).
    pub(crate) fn check(
        &self,
        peer: crate::ids::PeerId,
        op: crate::transfer::Op,
        offset: u64,
        len: u64,
    ) -> Result<(), DataError> {
        let needed = op.remote_access();
        if !self.access.contains(needed) {
            return Err(DataError::AccessDenied {
                op,
                target: format!("remote {} at {peer}", self.key),
                needed,
                granted: self.access,
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(DataError::RemoteOutOfBounds {
                peer,
                key: self.key,
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

pub(crate) enum Owner {
    /// Allocated by [`Region::alloc`]; freed with this layout.
    Aligned(Layout),
    /// Mapped by [`Region::alloc`] (large regions); unmapped with this length.
    #[cfg(target_os = "linux")]
    Mapped(usize),
    /// Mapped from a sealed memfd by [`Region::alloc_shared`]; unmapped
    /// with this length, the descriptor closed after.
    #[cfg(target_os = "linux")]
    Shared {
        fd: std::os::fd::OwnedFd,
        mapped: usize,
    },
    /// A boxed slice from [`Region::from_vec`]; rebuilt and dropped.
    Boxed,
    /// Foreign memory; the optional value is dropped with the region.
    Foreign(#[allow(dead_code)] Option<Box<dyn Any + Send + Sync>>),
}

struct Inner {
    id: RegionId,
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
    access: Access,
    owner: Owner,
    /// The runtime handle of GPU memory (set once, by `gpu/region.rs`).
    gpu: std::sync::OnceLock<Arc<crate::gpu::DeviceMemory>>,
}

// SAFETY: `ptr` is only dereferenced through bounds-checked raw copies in
// this module; the memory is either owned by `Inner` (freed once, in Drop)
// or foreign memory whose registrant promised (see `Region::from_raw`) that
// it stays valid and may be accessed from any thread while registered.
unsafe impl Send for Inner {}
// SAFETY: as above; `Inner` has no interior mutability besides the memory
// behind `ptr`, whose concurrent access follows RDMA semantics (contents of
// in-flight bytes are unspecified, never out of bounds).
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Aligned(layout) => {
                // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` in
                // `Region::alloc` and is freed exactly once, here.
                unsafe { std::alloc::dealloc(self.ptr, *layout) }
            }
            #[cfg(target_os = "linux")]
            Owner::Mapped(len) => {
                // SAFETY: `ptr..ptr+len` is exactly the mapping `map_huge`
                // made (and trimmed to); it is unmapped exactly once, here.
                // munmap of a valid mapping cannot fail.
                unsafe { libc::munmap(self.ptr.cast(), *len) };
            }
            #[cfg(target_os = "linux")]
            Owner::Shared { mapped, .. } => {
                // SAFETY: `ptr..ptr+mapped` is exactly the mapping
                // `alloc_shared` made; it is unmapped exactly once, here.
                // The descriptor is closed when `owner` drops, after this.
                unsafe { libc::munmap(self.ptr.cast(), *mapped) };
            }
            Owner::Boxed => {
                // SAFETY: `ptr`/`len` come from `Box::into_raw` of a
                // `Box<[u8]>` in `Region::from_vec`; rebuilt exactly once.
                drop(unsafe {
                    Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len))
                })
            }
            Owner::Foreign(_) => {}
        }
    }
}

/// Registered memory. Cheap to clone (a reference count); the memory lives
/// until the last clone is dropped.
#[derive(Clone)]
pub struct Region {
    inner: Arc<Inner>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.inner.len)
            .field("kind", &self.inner.kind)
            .field("access", &self.inner.access)
            .finish()
    }
}

/// Alignment of [`Region::alloc`] buffers: one page, as NICs prefer.
pub const REGION_ALIGN: usize = 4096;

/// A transparent huge page on x86-64 and most aarch64 kernels.
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// Maps `len` (a non-zero multiple of [`HUGE_PAGE`]) zeroed bytes, aligned to
/// [`HUGE_PAGE`], and asks for transparent huge pages. `None` if the kernel
/// refuses the mapping.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<*mut u8> {
    let span = len.checked_add(HUGE_PAGE)?;
    // SAFETY: an anonymous private mapping at an address of the kernel's
    // choosing touches no existing memory.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (start - base, base + span - (start + len));
    // SAFETY: `head` and `tail` bytes at either end lie inside the mapping
    // just made and outside `start..start+len`; both are page multiples
    // (mmap returns page-aligned addresses, `len` and HUGE_PAGE are page
    // multiples). Nothing refers to them. madvise only gives advice about
    // the kept range; its failure (THP off) leaves ordinary pages.
    unsafe {
        if head > 0 {
            libc::munmap(base as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    Some(start as *mut u8)
}

/// The longest region: no Rust allocation or valid memory range is longer
/// than `isize::MAX` bytes, and the raw copies of this module rely on it.
pub(crate) const MAX_REGION_LEN: usize = isize::MAX as usize;

/// Refuses a region length of 0 or past [`MAX_REGION_LEN`].
pub(crate) fn check_len(len: usize) -> Result<(), DataError> {
    if len == 0 {
        return Err(DataError::EmptyRegion);
    }
    if len > MAX_REGION_LEN {
        return Err(DataError::RegionTooLarge {
            len,
            max: MAX_REGION_LEN,
        });
    }
    Ok(())
}

impl Region {
    /// Allocates `len` zeroed, page-aligned bytes of host memory. A `len`
    /// of 0 or past `isize::MAX` is refused ([`DataError::EmptyRegion`],
    /// [`DataError::RegionTooLarge`]), memory the system cannot give with
    /// [`DataError::Alloc`].
    ///
    /// On Linux, regions of 2 MiB and more are mapped directly, aligned to
    /// 2 MiB and advised to use transparent huge pages (`MADV_HUGEPAGE`):
    /// fewer TLB misses for the CPU copying them and fewer translation
    /// entries for a NIC registering them. Their pages are faulted in on
    /// first touch.
    pub fn alloc(len: usize, access: Access) -> Result<Self, DataError> {
        check_len(len)?;
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            // `len <= isize::MAX` (checked above), so rounding up to a huge
            // page cannot wrap; checked all the same, as every size is.
            let mapped = len
                .checked_next_multiple_of(HUGE_PAGE)
                .filter(|&m| m <= MAX_REGION_LEN)
                .ok_or(DataError::RegionTooLarge {
                    len,
                    max: MAX_REGION_LEN,
                })?;
            let ptr = map_huge(mapped).ok_or(DataError::Alloc { len })?;
            return Ok(Self::wrap(
                ptr,
                len,
                MemoryKind::Host,
                access,
                Owner::Mapped(mapped),
            ));
        }
        let layout =
            Layout::from_size_align(len, REGION_ALIGN).map_err(|_| DataError::Alloc { len })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(DataError::Alloc { len });
        }
        Ok(Self::wrap(
            ptr,
            len,
            MemoryKind::Host,
            access,
            Owner::Aligned(layout),
        ))
    }

    /// Registers an owned buffer; the region keeps it alive.
    pub fn from_vec(buf: Vec<u8>, access: Access) -> Result<Self, DataError> {
        if buf.is_empty() {
            return Err(DataError::EmptyRegion);
        }
        let len = buf.len();
        let ptr = Box::into_raw(buf.into_boxed_slice()).cast::<u8>();
        Ok(Self::wrap(ptr, len, MemoryKind::Host, access, Owner::Boxed))
    }

    /// Registers foreign memory: an engine's KV tensor, or device memory
    /// exported as a dma-buf (`kind = MemoryKind::Device`, where `ptr` is the
    /// device virtual address). `keep_alive` is dropped with the last clone
    /// of the region (use it to hold the tensor's owner). A `len` of 0 or
    /// past `isize::MAX` is refused.
    ///
    /// # Safety
    ///
    /// For host memory, `ptr..ptr + len` must be valid for reads and writes
    /// from any thread until every clone of the returned region has been
    /// dropped (and every backend it was registered with has deregistered
    /// it), and must not be freed or remapped before then. Bytes targeted by
    /// an in-flight transfer must not be accessed by other code while that
    /// transfer runs, except through this region. For device memory the
    /// dma-buf and the mapping at `ptr` must stay valid for the same time.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        access: Access,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<Self, DataError> {
        check_len(len)?;
        if ptr.is_null() {
            return Err(DataError::NullPointer);
        }
        Ok(Self::wrap(
            ptr,
            len,
            kind,
            access,
            Owner::Foreign(keep_alive),
        ))
    }

    pub(crate) fn wrap(
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        access: Access,
        owner: Owner,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                id: RegionId::next(),
                ptr,
                len,
                kind,
                access,
                owner,
                gpu: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The memfd behind a region of [`Region::alloc_shared`].
    #[cfg(target_os = "linux")]
    pub(crate) fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match &self.inner.owner {
            Owner::Shared { fd, .. } => Some(fd.as_fd()),
            _ => None,
        }
    }

    /// Whether a same-host peer can map this region: it was made by
    /// [`Region::alloc_shared`] (the shm backend serves only those).
    pub fn is_shared(&self) -> bool {
        #[cfg(target_os = "linux")]
        return self.shared_fd().is_some();
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// The runtime handle of a GPU region.
    pub(crate) fn gpu(&self) -> Option<&Arc<crate::gpu::DeviceMemory>> {
        self.inner.gpu.get()
    }

    /// Attaches the runtime handle to a region just made for it.
    pub(crate) fn set_gpu(&self, mem: Arc<crate::gpu::DeviceMemory>) {
        // A fresh region has none; `set` only fails if one is present.
        let _ = self.inner.gpu.set(mem);
    }

    /// The region's process-unique id.
    pub fn id(&self) -> RegionId {
        self.inner.id
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.inner.ptr as u64
    }

    /// Raw pointer to the first byte (for backends that hand it to a NIC).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len as u64
    }

    /// Always false: empty regions cannot be created.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.inner.kind
    }

    /// Rights granted on this region.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// What a target advertises for this region when it serves it under `key`.
    pub fn advert(&self, key: RemoteKey) -> RemoteRegion {
        RemoteRegion {
            key,
            addr: self.addr(),
            len: self.len(),
            access: self.access(),
        }
    }

    /// Checks that `offset..offset+len` lies inside the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), DataError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(DataError::OutOfBounds {
                region: self.id(),
                offset,
                len,
                region_len: self.len(),
            }),
        }
    }

    pub(crate) fn host_ptr(&self, offset: u64, len: u64) -> Result<*mut u8, DataError> {
        if self.kind() != MemoryKind::Host {
            return Err(DataError::Unsupported {
                backend: "host copy",
                what: "device memory is not CPU-addressable",
            });
        }
        self.check_range(offset, len)?;
        // `offset <= len <= isize::MAX` (checked above), so the addition
        // stays inside the allocation.
        Ok(self.inner.ptr.wrapping_add(offset as usize))
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), DataError> {
        let src = self.host_ptr(offset, dst.len() as u64)?;
        // SAFETY: `src..src+dst.len()` is inside the region (host_ptr checked
        // the range) and valid per the registration contract; `dst` is a
        // distinct Rust buffer, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Appends `len` bytes of the region from `offset` to `out`, with no
    /// zero-fill of `out`'s new part first (as `resize` then
    /// [`read`](Self::read) would do). Nothing is appended when the range
    /// is bad or the memory is not host memory.
    pub fn extend_vec(&self, offset: u64, len: u64, out: &mut Vec<u8>) -> Result<(), DataError> {
        let src = self.host_ptr(offset, len)?;
        // `len` fits the region, whose length fits `isize`.
        let len = len as usize;
        out.reserve(len);
        let at = out.len();
        // SAFETY: `reserve` made room for `len` more bytes, so
        // `at..at+len` lies in `out`'s allocation; `src..src+len` is
        // inside the region (host_ptr checked it) and valid for reads per
        // the registration contract, and does not overlap `out`, a
        // distinct Rust allocation. After the copy the first `at + len`
        // bytes are initialised, so `set_len` exposes no uninitialised byte.
        unsafe {
            std::ptr::copy_nonoverlapping(src, out.as_mut_ptr().add(at), len);
            out.set_len(at + len);
        }
        Ok(())
    }

    /// Copies `src` into the region starting at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), DataError> {
        let dst = self.host_ptr(offset, src.len() as u64)?;
        // SAFETY: as in `read`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Fills `offset..offset+len` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), DataError> {
        let dst = self.host_ptr(offset, len)?;
        // SAFETY: the range is inside the region (checked by host_ptr).
        unsafe { std::ptr::write_bytes(dst, byte, len as usize) };
        Ok(())
    }

    /// Copies the whole region into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>, DataError> {
        let mut out = vec![0u8; self.inner.len];
        self.read(0, &mut out)?;
        Ok(out)
    }

    /// Copies `len` bytes from `self[src_offset..]` to `dst[dst_offset..]`.
    /// Both ranges are checked first; nothing moves when either is bad.
    /// Overlapping ranges (same region) are handled like `memmove`.
    pub fn copy_to(
        &self,
        src_offset: u64,
        dst: &Self,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), DataError> {
        let src_ptr = self.host_ptr(src_offset, len)?;
        let dst_ptr = dst.host_ptr(dst_offset, len)?;
        // SAFETY: both ranges are inside their regions (checked above) and
        // valid per the registration contract; `copy` allows overlap.
        unsafe { std::ptr::copy(src_ptr, dst_ptr, len as usize) };
        Ok(())
    }

    /// Runs `f` on the bytes `offset..offset+len` as a shared slice.
    ///
    /// Safe code never sees region memory as a Rust slice: a region is
    /// `Clone + Sync`, and other clones, backends and peers may write the
    /// same bytes at any time. Use [`read`](Self::read),
    /// [`write`](Self::write), [`copy_to`](Self::copy_to) or the socket I/O
    /// of [`recv_from`](Self::recv_from) / [`send_to`](Self::send_to) /
    /// [`send_vectored`] instead; they copy through raw pointers and never
    /// create a reference to region memory.
    ///
    /// # Safety
    ///
    /// While `f` runs, no one may write `offset..offset+len`: no other
    /// thread through any clone of this region, no transfer a backend runs
    /// on it (local or remote), and no foreign owner of the memory.
    pub unsafe fn with_slice<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, DataError> {
        let ptr = self.host_ptr(offset, len)?;
        // SAFETY: the range is inside the region and valid for reads per the
        // registration contract; the caller promised that nothing writes it
        // while `f` runs, and the slice does not outlive `f`.
        let slice = unsafe { std::slice::from_raw_parts(ptr, len as usize) };
        Ok(f(slice))
    }

    /// Runs `f` on the bytes `offset..offset+len` as a mutable slice.
    ///
    /// # Safety
    ///
    /// While `f` runs, no one else may read or write `offset..offset+len`:
    /// no other thread through any clone of this region (this includes a
    /// nested `with_slice`/`with_slice_mut` call on an overlapping range),
    /// no transfer a backend runs on it (local or remote), and no foreign
    /// owner of the memory.
    pub unsafe fn with_slice_mut<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, DataError> {
        let ptr = self.host_ptr(offset, len)?;
        // SAFETY: the range is inside the region and valid for writes per
        // the registration contract; the caller promised exclusive access
        // while `f` runs, and the slice does not outlive `f`.
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
        Ok(f(slice))
    }

    /// One `read(2)` from `src` (a socket, pipe or file) straight into
    /// `offset..offset+len` of the region, with no intermediate copy and no
    /// Rust reference to region memory. Returns the bytes read: fewer than
    /// `len` is a short read, 0 the end of the stream (or `len == 0`).
    /// A bad range or device memory is refused before the syscall.
    /// `EINTR` is retried; `WouldBlock` is returned as is.
    #[cfg(unix)]
    pub fn recv_from(&self, offset: u64, len: u64, src: BorrowedFd<'_>) -> io::Result<usize> {
        let ptr = self.host_ptr(offset, len).map_err(io::Error::other)?;
        retry_eintr(|| {
            // SAFETY: `ptr..ptr+len` lies inside the region (host_ptr) and
            // is valid for writes per the registration contract. The kernel
            // writes it like a NIC would; no Rust reference to it exists.
            unsafe { libc::read(src.as_raw_fd(), ptr.cast(), len as usize) }
        })
    }

    /// One `write(2)` of `offset..offset+len` of the region to `dst`,
    /// straight from region memory. Returns the bytes written (a short
    /// write is possible). For several pieces in one syscall use
    /// [`send_vectored`].
    #[cfg(unix)]
    pub fn send_to(&self, offset: u64, len: u64, dst: BorrowedFd<'_>) -> io::Result<usize> {
        send_vectored(dst, &[IoPart::Region(self, offset, len)])
    }
}

/// One piece of a vectored write: plain bytes or a span of region memory.
#[derive(Clone, Copy, Debug)]
pub enum IoPart<'a> {
    /// Bytes owned by the caller.
    Bytes(&'a [u8]),
    /// `len` bytes of the region from `offset` (checked when written).
    Region(&'a Region, u64, u64),
}

impl IoPart<'_> {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Self::Bytes(b) => b.len() as u64,
            Self::Region(_, _, len) => *len,
        }
    }

    /// Whether the piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The piece without its first `n` bytes (`n` at most its length).
    pub fn advance(self, n: u64) -> Self {
        match self {
            Self::Bytes(b) => Self::Bytes(&b[(n as usize).min(b.len())..]),
            Self::Region(r, off, len) => {
                let n = n.min(len);
                // A span whose end overflows stays refused when written:
                // saturate instead of wrapping to an in-bounds offset.
                Self::Region(r, off.saturating_add(n), len - n)
            }
        }
    }
}

/// Most pieces one [`send_vectored`] call hands the kernel (Linux's
/// `IOV_MAX`); later pieces wait for the next call.
pub const IOV_MAX: usize = 1024;

/// One `writev(2)` of `parts` (at most [`IOV_MAX`] of them) to `dst`:
/// region spans go from region memory to the kernel with no copy and no
/// Rust reference to region memory. Every region span is checked (bounds,
/// host memory) before anything is written. Returns the bytes written; a
/// short write is possible. `EINTR` is retried.
#[cfg(unix)]
pub fn send_vectored(dst: BorrowedFd<'_>, parts: &[IoPart<'_>]) -> io::Result<usize> {
    let parts = &parts[..parts.len().min(IOV_MAX)];
    let mut iov = Vec::with_capacity(parts.len());
    for part in parts {
        let (base, len) = match *part {
            IoPart::Bytes(b) => (b.as_ptr().cast_mut(), b.len()),
            IoPart::Region(r, off, len) => (
                r.host_ptr(off, len).map_err(io::Error::other)?,
                len as usize,
            ),
        };
        iov.push(libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        });
    }
    retry_eintr(|| {
        // SAFETY: every iovec points at `len` readable bytes: a live Rust
        // slice borrowed for this call, or a range inside a region (checked
        // by host_ptr) that is valid per the registration contract and that
        // the kernel only reads. `iov.len() <= IOV_MAX` fits a c_int.
        unsafe { libc::writev(dst.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) }
    })
}

/// Runs a `read`/`write`-style syscall until it is not interrupted.
#[cfg(unix)]
pub(crate) fn retry_eintr(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        match usize::try_from(call()) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extend_vec_appends_the_range_or_nothing() {
        let r = Region::from_vec((0..=255u8).collect(), Access::ALL).unwrap();
        let mut out = b"hd".to_vec();
        r.extend_vec(10, 3, &mut out).unwrap();
        r.extend_vec(250, 6, &mut out).unwrap();
        r.extend_vec(0, 0, &mut out).unwrap();
        assert_eq!(out, [b'h', b'd', 10, 11, 12, 250, 251, 252, 253, 254, 255]);
        // Past the end, or an offset whose sum overflows: refused, and
        // `out` keeps its length and bytes.
        for (off, len) in [(250, 7), (u64::MAX, 2), (256, 1)] {
            let err = r.extend_vec(off, len, &mut out).unwrap_err();
            assert!(matches!(err, DataError::OutOfBounds { .. }), "{err}");
            assert_eq!(out.len(), 11);
        }
    }

    #[test]
    fn alloc_is_zeroed_aligned_and_bounds_checked() {
        let r = Region::alloc(10_000, Access::ALL).unwrap();
        assert_eq!(r.addr() % REGION_ALIGN as u64, 0);
        assert!(r.to_vec().unwrap().iter().all(|&b| b == 0));
        r.write(9_990, &[7; 10]).unwrap();
        let err = r.write(9_991, &[7; 10]).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::OutOfBounds {
                    offset: 9_991,
                    len: 10,
                    ..
                }
            ),
            "{err}"
        );
        let mut b = [0u8; 10];
        r.read(9_990, &mut b).unwrap();
        assert_eq!(b, [7; 10]);
        assert!(matches!(
            r.check_range(u64::MAX, 2),
            Err(DataError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn large_regions_are_zeroed_mapped_and_bounds_checked() {
        // Not a multiple of the huge-page size: the bounds are `len`, not
        // the mapping's rounded-up length.
        let len = (3 << 20) + 5;
        for round in 0..3u8 {
            let r = Region::alloc(len, Access::ALL).unwrap();
            #[cfg(target_os = "linux")]
            assert_eq!(r.addr() % HUGE_PAGE as u64, 0);
            assert_eq!(r.len(), len as u64);
            assert!(r.to_vec().unwrap().iter().all(|&b| b == 0), "round {round}");
            r.write(len as u64 - 5, &[round + 1; 5]).unwrap();
            let mut tail = [0u8; 5];
            r.read(len as u64 - 5, &mut tail).unwrap();
            assert_eq!(tail, [round + 1; 5]);
            assert!(matches!(
                r.write(len as u64 - 4, &[0; 5]),
                Err(DataError::OutOfBounds { .. })
            ));
            // Clones share the mapping; it outlives the first drop.
            let c = r.clone();
            drop(r);
            c.read(len as u64 - 5, &mut tail).unwrap();
            assert_eq!(tail, [round + 1; 5]);
        }
    }

    #[test]
    fn alloc_refuses_lengths_whose_rounding_would_wrap() {
        // The top 2 MiB of `usize` used to round up to 0 for the huge-page
        // mapping (a panic in debug builds, a near-2^64 region over unmapped
        // memory in release builds). Every length past `isize::MAX` is
        // refused with a typed error; no region is made.
        for len in [
            usize::MAX,
            usize::MAX - 1,
            usize::MAX - (2 << 20) + 2,
            usize::MAX / 2 + 1,
        ] {
            match Region::alloc(len, Access::ALL) {
                Err(DataError::RegionTooLarge { len: l, max }) => {
                    assert_eq!((l, max), (len, isize::MAX as usize));
                }
                Err(other) => panic!("alloc({len}): {other}"),
                Ok(r) => panic!("alloc({len}) made a region of {} bytes", r.len()),
            }
        }
        // A span whose end overflows never advances to an in-bounds offset.
        let r = Region::alloc(64, Access::ALL).unwrap();
        match IoPart::Region(&r, u64::MAX - 2, 10).advance(5) {
            IoPart::Region(_, off, len) => {
                assert_eq!((off, len), (u64::MAX, 5));
                assert!(r.check_range(off, len).is_err());
            }
            IoPart::Bytes(_) => unreachable!(),
        }
        // Just below the cap: refused by the allocator (no such memory), as
        // a typed error too, never a region.
        assert!(matches!(
            Region::alloc(isize::MAX as usize, Access::ALL),
            Err(DataError::Alloc { .. } | DataError::RegionTooLarge { .. })
        ));
    }

    #[test]
    fn empty_regions_are_refused() {
        assert!(matches!(
            Region::alloc(0, Access::ALL),
            Err(DataError::EmptyRegion)
        ));
        assert!(matches!(
            Region::from_vec(vec![], Access::ALL),
            Err(DataError::EmptyRegion)
        ));
    }

    #[test]
    fn from_vec_keeps_contents_and_copy_to_moves_bytes() {
        let a = Region::from_vec((0..=255u8).collect(), Access::ALL).unwrap();
        let b = Region::alloc(256, Access::ALL).unwrap();
        a.copy_to(10, &b, 20, 5).unwrap();
        let v = b.to_vec().unwrap();
        assert_eq!(&v[20..25], &[10, 11, 12, 13, 14]);
        assert!(a.copy_to(250, &b, 0, 10).is_err());
        assert_eq!(b.to_vec().unwrap(), v, "a refused copy moves nothing");
    }

    #[cfg(unix)]
    #[test]
    fn socket_io_moves_region_bytes_and_refuses_bad_ranges() {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixStream;
        let (mut a, b) = UnixStream::pair().unwrap();
        let src = Region::from_vec((0..=255u8).collect(), Access::ALL).unwrap();
        // Gathered: plain bytes, then two region spans, one emptied.
        let parts = [
            IoPart::Bytes(b"hd"),
            IoPart::Region(&src, 10, 3),
            IoPart::Region(&src, 0, 5).advance(5),
            IoPart::Region(&src, 250, 6),
        ];
        assert_eq!(send_vectored(a.as_fd(), &parts).unwrap(), 11);
        let dst = Region::alloc(64, Access::ALL).unwrap();
        let mut got = 0;
        while got < 11 {
            got += dst
                .recv_from(got as u64, 11 - got as u64, b.as_fd())
                .unwrap();
        }
        let mut out = [0u8; 11];
        dst.read(0, &mut out).unwrap();
        assert_eq!(out, [b'h', b'd', 10, 11, 12, 250, 251, 252, 253, 254, 255]);
        // A span past the end refuses the whole write before any byte moves.
        let bad = [IoPart::Bytes(b"x"), IoPart::Region(&src, 250, 7)];
        assert!(send_vectored(a.as_fd(), &bad).is_err());
        assert!(src.send_to(u64::MAX, 2, a.as_fd()).is_err());
        // A receive past the end is refused before reading: the byte stays.
        a.write_all(b"z").unwrap();
        assert!(dst.recv_from(60, 5, b.as_fd()).is_err());
        let mut z = [0u8; 1];
        (&b).read_exact(&mut z).unwrap();
        assert_eq!(&z, b"z");
        // End of stream is a zero-length read.
        drop(a);
        assert_eq!(dst.recv_from(0, 4, b.as_fd()).unwrap(), 0);
    }

    #[test]
    fn access_flags_compose() {
        let a = Access::REMOTE_READ | Access::LOCAL_WRITE;
        assert!(a.contains(Access::REMOTE_READ));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert_eq!(format!("{a}"), "local_read|local_write|remote_read");
    }
}
