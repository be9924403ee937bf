//! The system calls of the shm backend: messages with descriptors over a
//! `SOCK_SEQPACKET` Unix socket, and mapping a peer's region after
//! checking that it cannot fault. The only `unsafe` of the backend.

use crate::memory::{retry_eintr, Access, MemoryKind, Region};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Most descriptors one message carries (the kernel allows 253).
pub(crate) const MAX_FDS: usize = 64;

/// Control-message buffer for `n` descriptors, aligned for `cmsghdr`.
fn cmsg_buffer(n: usize) -> (Vec<u64>, usize) {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE((n * size_of::<libc::c_int>()) as u32) } as usize;
    (vec![0u64; space.div_ceil(8)], space)
}

/// Sends one message (`data`, with `fds` attached) on `sock`. Returns the
/// bytes sent; on a non-blocking socket `WouldBlock` when it is full. A
/// seqpacket socket sends all of `data` or nothing.
pub(crate) fn send_msg(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let (mut cbuf, space) = cmsg_buffer(fds.len());
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg_control` points at `space` zeroed, aligned bytes,
        // room for one cmsghdr with `fds.len()` descriptors (CMSG_SPACE);
        // CMSG_FIRSTHDR is therefore non-null and CMSG_DATA points inside
        // the buffer, with room for every descriptor written.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * size_of::<libc::c_int>()) as u32) as _;
            let p = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                p.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    retry_eintr(|| {
        // SAFETY: `msg` points at `data` (alive for the call, only read)
        // and at the control buffer filled above.
        unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }
    })
}

/// Receives one message into `buf`; descriptors that came with it are
/// appended to `fds` (owned: closed when dropped). Returns its length; 0
/// is the end of the stream. A message longer than `buf`, or with more
/// descriptors than [`MAX_FDS`], is `InvalidData` (its descriptors are
/// closed).
pub(crate) fn recv_msg(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let (mut cbuf, space) = cmsg_buffer(MAX_FDS);
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = retry_eintr(|| {
        // SAFETY: `msg` points at `buf` and `cbuf`, both alive and
        // writable for their lengths; the kernel writes at most those.
        unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) }
    })?;
    // Take every descriptor first, so that each is closed whatever
    // happens next.
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with
    // well-formed control messages; CMSG_FIRSTHDR/NXTHDR walk only those.
    // SCM_RIGHTS data is `c_int` descriptors the kernel just installed in
    // this process, owned by no one else.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                let p = data.cast::<libc::c_int>();
                for i in 0..bytes / size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message or its descriptors longer than allowed",
        ));
    }
    Ok(n)
}

/// Why a peer's region descriptor was refused.
#[derive(Debug)]
pub(crate) enum MapRefusal {
    /// Not a sealed memfd of at least the advertised length.
    Unsafe(&'static str),
    /// A syscall failed.
    Os(&'static str, io::Error),
}

/// A mapping of a peer's region; unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; the pointer is only used to
// unmap it, once, in Drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; `Mapping` has no methods that touch the memory.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping `map_peer` made;
        // it is unmapped exactly once, here, after the last clone of the
        // region wrapping it was dropped (the region holds this value).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Maps the region a peer passed as `fd`, `len` bytes long, granting
/// `access` (mapped writable only with [`Access::REMOTE_WRITE`]), as a
/// [`Region`] of this process. Refuses, before mapping, a descriptor that
/// is not a regular file sealed against shrinking or is shorter than
/// `len`: every byte of the returned region stays backed by the file for
/// as long as the mapping lives, whatever the peer does, so a copy into
/// it cannot fault.
pub(crate) fn map_peer(fd: &OwnedFd, len: u64, access: Access) -> Result<Region, MapRefusal> {
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l > 0 && l <= isize::MAX as usize)
        .ok_or(MapRefusal::Unsafe("its length is 0 or too large"))?;
    // SAFETY: fstat writes into the zeroed struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a live descriptor; `st` is writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(MapRefusal::Os("fstat", io::Error::last_os_error()));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(MapRefusal::Unsafe("its descriptor is not a memory file"));
    }
    // SAFETY: fcntl on a live descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(MapRefusal::Unsafe(
            "its memory file is not sealed against shrinking (it could be truncated under a copy)",
        ));
    }
    if u64::try_from(st.st_size).unwrap_or(0) < len as u64 {
        return Err(MapRefusal::Unsafe(
            "its memory file is shorter than the region",
        ));
    }
    let writable = access.contains(Access::REMOTE_WRITE);
    let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
    // SAFETY: a new shared mapping of `len` bytes of the file at an
    // address of the kernel's choosing: it touches no existing memory.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(MapRefusal::Os("mmap", io::Error::last_os_error()));
    }
    let mapping = Mapping {
        ptr: ptr.cast(),
        len,
    };
    // The region's own rights: local read (always), local write only when
    // the mapping is writable. The shm backend checks the peer's grant
    // (`access`, kept beside the region) before every copy, and writes
    // into this region only for a WRITE the grant allows.
    let local = if writable {
        Access::LOCAL_WRITE
    } else {
        Access::NONE
    };
    // SAFETY: `ptr..ptr+len` is a mapping owned by `mapping`, which the
    // region keeps alive until its last clone is dropped. Every byte of it
    // is backed by the file (size checked above, shrinking sealed), so
    // reads cannot fault; it is writable exactly when the grant includes
    // REMOTE_WRITE, and the backend writes into it only after checking
    // that grant (`shm::execute`). The region never leaves the backend.
    unsafe {
        Region::from_raw(
            ptr.cast(),
            len,
            MemoryKind::Host,
            local,
            Some(Box::new(mapping)),
        )
    }
    .map_err(|_| MapRefusal::Unsafe("its length is 0"))
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `Instant` reads, shared by
/// every process of the host (a notification's deadline crosses the
/// process boundary in it).
pub(crate) fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the zeroed struct it is given.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: i64, seals: libc::c_int) -> OwnedFd {
        // SAFETY: plain syscalls creating and sizing a descriptor we own.
        unsafe {
            let fd = libc::memfd_create(
                c"test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len), 0);
            if seals != 0 {
                assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, seals), 0);
            }
            OwnedFd::from_raw_fd(fd)
        }
    }

    #[test]
    fn a_target_that_could_truncate_its_memory_is_refused_before_mapping() {
        // Unsealed: it could be shrunk under a copy (SIGBUS). Refused.
        let unsealed = memfd(8192, 0);
        assert!(matches!(
            map_peer(&unsealed, 8192, Access::ALL),
            Err(MapRefusal::Unsafe(why)) if why.contains("not sealed")
        ));
        // Sealed but shorter than it claims: refused.
        let short = memfd(4096, libc::F_SEAL_SHRINK);
        assert!(matches!(
            map_peer(&short, 8192, Access::ALL),
            Err(MapRefusal::Unsafe(why)) if why.contains("shorter")
        ));
        // Not a memory file at all (a pipe): refused.
        let mut p = [0; 2];
        // SAFETY: pipe writes two descriptors we then own.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: both just returned by pipe, owned by nothing else.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        assert!(matches!(
            map_peer(&r, 4096, Access::ALL),
            Err(MapRefusal::Unsafe(_))
        ));
        // Sealed and long enough: mapped, and once mapped the target can
        // no longer shrink it.
        let good = memfd(8192, libc::F_SEAL_SHRINK);
        let region = map_peer(&good, 8192, Access::ALL).expect("mapped");
        region.write(8000, &[1; 192]).unwrap();
        // SAFETY: ftruncate on a live descriptor; refused by the seal.
        assert_eq!(unsafe { libc::ftruncate(good.as_raw_fd(), 0) }, -1);
        let mut b = [0u8; 192];
        region.read(8000, &mut b).unwrap();
        assert_eq!(b, [1; 192]);
    }

    #[test]
    fn a_read_only_grant_is_mapped_read_only() {
        let fd = memfd(4096, libc::F_SEAL_SHRINK);
        let region = map_peer(&fd, 4096, Access::REMOTE_READ).expect("mapped");
        assert!(!region.access().contains(Access::LOCAL_WRITE));
        // A grant of WRITE on a file sealed against writable mappings
        // fails to map rather than mapping read-only.
        let sealed = memfd(4096, libc::F_SEAL_SHRINK | libc::F_SEAL_FUTURE_WRITE);
        assert!(matches!(
            map_peer(&sealed, 4096, Access::REMOTE_WRITE),
            Err(MapRefusal::Os("mmap", _))
        ));
    }
}
