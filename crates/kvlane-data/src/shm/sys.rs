//! The system calls of the shm backend: messages with descriptors over a
//! `SOCK_SEQPACKET` Unix socket, mapping a peer's region after checking
//! that it cannot fault, and cross-memory attach (`process_vm_readv` /
//! `process_vm_writev`) for regions that are not memory files. The only
//! `unsafe` of the backend.

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

/// The pid of the process that listens on the other end of `sock` (a
/// connected Unix socket), as the kernel recorded it when that process
/// called `listen` (`SO_PEERCRED`): not a claim the peer makes. 0 when
/// that process is not visible from this pid namespace.
pub(crate) fn peer_pid(sock: BorrowedFd<'_>) -> io::Result<libc::pid_t> {
    // SAFETY: ucred is plain data; all-zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is
    // that long, and sets `len`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}

/// One piece of a cross-memory copy: `len` bytes at `offset` of a
/// registered region of this process, and at `remote` in the other
/// process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece<'a> {
    /// This process's side.
    pub(crate) local: &'a Region,
    /// Offset in `local`.
    pub(crate) offset: u64,
    /// The address in the other process.
    pub(crate) remote: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// Where a cross-memory copy stopped, and why.
#[derive(Debug)]
pub(crate) struct CrossFault {
    /// The piece it stopped in.
    pub(crate) piece: usize,
    /// Bytes of that piece that were copied.
    pub(crate) done: u64,
    /// The kernel's answer: `EFAULT` (the other process has no such
    /// memory there, or it is not writable), `ESRCH` (it is gone),
    /// `EPERM` (this process may not attach to it); or this side's range
    /// was refused (bad bounds, device memory) before any syscall.
    pub(crate) error: io::Error,
}

/// Copies every piece between this process and process `pid` with
/// `process_vm_readv` (`to_remote` false: the other process's memory into
/// this one's regions) or `process_vm_writev`, [`IOV_MAX`](crate::IOV_MAX)
/// pieces per call, resuming after short counts (the kernel stops at the
/// first address the other process has not mapped, and caps one call's
/// bytes). Every local range is checked inside its region first (host
/// memory, in bounds); nothing is copied when one is not. The kernel
/// checks that this process may attach to `pid` (same user and dumpable,
/// or `CAP_SYS_PTRACE`) and walks the other process's page tables itself:
/// a bad remote address is an error, never a fault here.
pub(crate) fn cross_copy(
    pid: libc::pid_t,
    to_remote: bool,
    pieces: &[Piece<'_>],
) -> Result<(), CrossFault> {
    let mut ptrs = Vec::with_capacity(pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        let ptr = p.local.host_ptr(p.offset, p.len).map_err(|e| CrossFault {
            piece: i,
            done: 0,
            error: io::Error::new(io::ErrorKind::InvalidInput, e),
        })?;
        ptrs.push(ptr);
    }
    let (mut i, mut done) = (0usize, 0u64);
    let mut local = Vec::with_capacity(pieces.len().min(crate::IOV_MAX));
    let mut remote = Vec::with_capacity(local.capacity());
    while i < pieces.len() {
        if pieces[i].len == done {
            (i, done) = (i + 1, 0);
            continue;
        }
        local.clear();
        remote.clear();
        for (j, p) in pieces[i..].iter().take(crate::IOV_MAX).enumerate() {
            let skip = if j == 0 { done } else { 0 };
            // `len` fits in usize: host_ptr checked it against the region.
            local.push(libc::iovec {
                iov_base: ptrs[i + j].wrapping_add(skip as usize).cast(),
                iov_len: (p.len - skip) as usize,
            });
            remote.push(libc::iovec {
                iov_base: p.remote.wrapping_add(skip) as *mut libc::c_void,
                iov_len: (p.len - skip) as usize,
            });
        }
        let n = retry_eintr(|| {
            // SAFETY: `local` and `remote` hold `local.len()` (at most
            // IOV_MAX) iovecs each, alive for the call. Each local iovec
            // lies inside a registered host region (host_ptr checked the
            // range), valid for reads and writes by the registration
            // contract while the caller holds the region; the kernel reads
            // or writes it as a NIC would, and no Rust reference to it
            // exists. The kernel checks the remote iovecs against the other
            // process's mappings (EFAULT where they are not there).
            unsafe {
                if to_remote {
                    libc::process_vm_writev(
                        pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                } else {
                    libc::process_vm_readv(
                        pid,
                        local.as_ptr(),
                        local.len() as libc::c_ulong,
                        remote.as_ptr(),
                        remote.len() as libc::c_ulong,
                        0,
                    )
                }
            }
        })
        .map_err(|error| CrossFault {
            piece: i,
            done,
            error,
        })?;
        if n == 0 {
            return Err(CrossFault {
                piece: i,
                done,
                error: io::Error::from_raw_os_error(libc::EFAULT),
            });
        }
        // Advance over what was copied.
        let mut left = n as u64;
        while left > 0 && i < pieces.len() {
            let room = pieces[i].len - done;
            if left < room {
                done += left;
                left = 0;
            } else {
                left -= room;
                (i, done) = (i + 1, 0);
            }
        }
    }
    Ok(())
}

/// Reads one byte at `addr` in process `pid`: whether this process may
/// attach to it and it has memory there.
pub(crate) fn probe_attach(pid: libc::pid_t, addr: u64) -> io::Result<()> {
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 1,
    };
    let n = retry_eintr(|| {
        // SAFETY: the local iovec is `byte`, alive and unborrowed for the
        // call; the kernel checks the remote one.
        unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) }
    })?;
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }
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
    fn cross_copy_spans_more_pieces_than_one_call_and_stops_where_memory_ends() {
        // This process as the "other" one: the kernel allows attaching to
        // oneself.
        let me = std::process::id() as libc::pid_t;
        let src = Region::alloc(3000 * 1000, Access::LOCAL_WRITE).unwrap();
        let bytes: Vec<u8> = (0..src.len()).map(|i| (i % 251) as u8).collect();
        src.write(0, &bytes).unwrap();
        let dst = Region::alloc(3000 * 1000, Access::LOCAL_WRITE).unwrap();
        // 3000 pieces (three calls of IOV_MAX), reversed order: READ from
        // `src` "over there" into `dst`.
        let pieces: Vec<Piece<'_>> = (0..3000u64)
            .map(|k| Piece {
                local: &dst,
                offset: k * 1000,
                remote: src.addr() + (2999 - k) * 1000,
                len: 1000,
            })
            .collect();
        cross_copy(me, false, &pieces).unwrap();
        let got = dst.to_vec().unwrap();
        for k in 0..3000usize {
            let r = (2999 - k) * 1000;
            assert!(
                got[k * 1000..(k + 1) * 1000] == bytes[r..r + 1000],
                "piece {k}"
            );
        }
        // A mapping whose second page is gone: the copy stops at its end,
        // naming the piece and the bytes of it that were copied.
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of two pages; the second is
        // unmapped at once and the first with the test's end.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        // SAFETY: the second page of the mapping just made.
        assert_eq!(
            unsafe { libc::munmap(map.cast::<u8>().add(page).cast(), page) },
            0
        );
        let base = map as u64;
        let pieces = [
            Piece {
                local: &src,
                offset: 0,
                remote: base,
                len: 100,
            },
            Piece {
                local: &src,
                offset: 100,
                remote: base + page as u64 - 300,
                len: 1000,
            },
        ];
        let f = cross_copy(me, true, &pieces).unwrap_err();
        assert_eq!((f.piece, f.done), (1, 300), "{f:?}");
        assert_eq!(f.error.raw_os_error(), Some(libc::EFAULT));
        // A local range outside its region is refused before any syscall.
        let bad = [Piece {
            local: &src,
            offset: src.len() - 10,
            remote: base,
            len: 20,
        }];
        let f = cross_copy(me, true, &bad).unwrap_err();
        assert_eq!(f.error.kind(), io::ErrorKind::InvalidInput);
        // SAFETY: the first page, still mapped, unmapped once.
        assert_eq!(unsafe { libc::munmap(map, page) }, 0);
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
