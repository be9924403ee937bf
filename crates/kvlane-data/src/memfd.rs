//! Shareable host memory: [`Region::alloc_shared`], a region backed by a
//! sealed memfd that the shm backend passes to same-host peers.
//!
//! The seals are what make sharing safe for both processes:
//!
//! - `F_SEAL_SHRINK` and `F_SEAL_GROW`: nobody holding the descriptor (this
//!   process or a peer) can change the file's size, so no page of any
//!   mapping of it can fall past the end of the file and fault (`SIGBUS`)
//!   under a copy. A peer checks the seal before it maps a region.
//! - `F_SEAL_FUTURE_WRITE` when the region does not grant
//!   [`Access::REMOTE_WRITE`]: the owner's mapping (made before the seal)
//!   stays writable, but no new writable mapping and no `write(2)` can be
//!   made through any descriptor of the file, including one a peer reopens
//!   through `/proc/<pid>/fd`. Read-only means read-only, enforced by the
//!   kernel rather than by the peer's good will.
//! - `F_SEAL_SEAL`: no one can add seals later (a peer adding
//!   `F_SEAL_FUTURE_WRITE` would keep later peers from mapping it writable).
//!
//! The file's pages are allocated up front (`fallocate`), so a copy into
//! the mapping never allocates a page and cannot fail for want of memory
//! at fault time: a region that the system cannot back fails at
//! allocation, with a typed error.

use crate::error::DataError;
use crate::memory::{check_len, Access, MemoryKind, Owner, Region, MAX_REGION_LEN};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The page size of this machine.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn os_err(op: &str, len: usize) -> DataError {
    DataError::Io {
        op: format!("{op} for a shared region of {len} bytes"),
        source: io::Error::last_os_error(),
    }
}

impl Region {
    /// Allocates `len` zeroed bytes of host memory that a peer on the same
    /// host can map: a memfd, sealed against resizing (and against writes
    /// through new mappings unless `access` grants
    /// [`Access::REMOTE_WRITE`]), with every page allocated now. This is
    /// the memory the shm backend serves to peers ([`crate::shm`]); the
    /// other backends use it like any host region.
    ///
    /// A `len` of 0 or past `isize::MAX` is refused like
    /// [`Region::alloc`]; memory the system cannot give fails with
    /// [`DataError::Io`] naming the call.
    pub fn alloc_shared(len: usize, access: Access) -> Result<Self, DataError> {
        check_len(len)?;
        let mapped = len
            .checked_next_multiple_of(page_size())
            .filter(|&m| m <= MAX_REGION_LEN)
            .ok_or(DataError::RegionTooLarge {
                len,
                max: MAX_REGION_LEN,
            })?;
        // SAFETY: the name is a NUL-terminated string; memfd_create only
        // creates a new descriptor.
        let raw = unsafe {
            libc::memfd_create(
                c"kvlane-region".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(os_err("memfd_create", len));
        }
        // SAFETY: `raw` is a descriptor just returned to us and owned by
        // nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(mapped).map_err(|_| DataError::RegionTooLarge {
            len,
            max: MAX_REGION_LEN,
        })?;
        // SAFETY: plain syscalls on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_err("ftruncate", len));
        }
        // SAFETY: as above; fallocate allocates the file's pages.
        if unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, size) } != 0 {
            return Err(os_err("fallocate", len));
        }
        // SAFETY: a new shared mapping of the whole file, at an address of
        // the kernel's choosing: it touches no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap", len));
        }
        // From here on the region owns the mapping (and unmaps it on drop,
        // also when sealing fails below).
        let region = Self::wrap(
            ptr.cast(),
            len,
            MemoryKind::Host,
            access,
            Owner::Shared { fd, mapped },
        );
        let mut seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if !access.contains(Access::REMOTE_WRITE) {
            seals |= libc::F_SEAL_FUTURE_WRITE;
        }
        let fd = region.shared_fd().expect("made shared above");
        // SAFETY: fcntl on a descriptor the region owns.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals | libc::F_SEAL_SEAL) } != 0
        {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                return Err(DataError::Unsupported {
                    backend: "shared memory",
                    what: "this kernel cannot seal memfds (F_SEAL_FUTURE_WRITE needs Linux 5.1)",
                });
            }
            return Err(DataError::Io {
                op: format!("seal the memfd of a shared region of {len} bytes"),
                source: e,
            });
        }
        Ok(region)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seals(r: &Region) -> i32 {
        let fd = r.shared_fd().unwrap();
        // SAFETY: fcntl on a live descriptor.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }
    }

    #[test]
    fn shared_regions_are_zeroed_sealed_and_bounds_checked() {
        let r = Region::alloc_shared(10_000, Access::ALL).unwrap();
        assert!(r.is_shared());
        assert_eq!(r.len(), 10_000);
        assert!(r.to_vec().unwrap().iter().all(|&b| b == 0));
        r.write(9_990, &[7; 10]).unwrap();
        assert!(matches!(
            r.write(9_991, &[7; 10]),
            Err(DataError::OutOfBounds { .. })
        ));
        let s = seals(&r);
        assert_eq!(
            s & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL
        );
        assert_eq!(s & libc::F_SEAL_FUTURE_WRITE, 0, "remote write granted");
        // Nobody can shrink it: the truncation a hostile peer would try.
        let fd = r.shared_fd().unwrap();
        // SAFETY: ftruncate on a live descriptor; it is refused.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        assert_eq!(rc, -1);
        assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        let mut b = [0u8; 10];
        r.read(9_990, &mut b).unwrap();
        assert_eq!(b, [7; 10]);
        assert!(!Region::alloc(64, Access::ALL).unwrap().is_shared());
    }

    #[test]
    fn read_only_regions_refuse_new_writable_mappings_but_stay_writable_here() {
        let r = Region::alloc_shared(4096, Access::REMOTE_READ | Access::LOCAL_WRITE).unwrap();
        assert_ne!(seals(&r) & libc::F_SEAL_FUTURE_WRITE, 0);
        // The owner's mapping still takes writes.
        r.write(0, b"mine").unwrap();
        let fd = r.shared_fd().unwrap();
        // SAFETY: a new mapping of a live descriptor; refused by the seal.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_eq!(
            p,
            libc::MAP_FAILED,
            "a writable mapping of a read-only region"
        );
        assert!(matches!(
            Region::alloc_shared(0, Access::ALL),
            Err(DataError::EmptyRegion)
        ));
    }
}
