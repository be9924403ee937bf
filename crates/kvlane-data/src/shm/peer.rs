//! The initiator side of the shm backend: a connection to one target,
//! with the target's regions mapped into this process (or, for regions
//! served by cross-memory attach, their addresses in the target's).

use super::sys::{map_peer, peer_pid, probe_attach, recv_msg, send_msg, MapRefusal};
use super::wire::{self, GpuGrant, Granted, NotifyStatus, ToInitiator, ToTarget, MAX_MESSAGE};
use super::ShmEndpoint;
use crate::error::DataError;
use crate::gpu::{gpu_device_at, IpcHandle, IPC_HANDLE_LEN};
use crate::ids::{FastMap, PeerId, RemoteKey};
use crate::memory::{Access, Region, RemoteRegion};
use socket2::{Domain, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// How this side reaches a target's region.
pub(crate) enum Reach {
    /// Its memory file, mapped here (writable only when the grant allows
    /// WRITE); or its GPU memory, mapped here through the driver's IPC
    /// handle (a region of kind `Gpu`, moved by the driver; the mapping is
    /// closed when the region drops: on revocation, disconnect or drop).
    Mapped(Region),
    /// Cross-memory attach: `process_vm_readv` / `process_vm_writev` at
    /// this address in the target's process (the pid is the connection's).
    Attached(u64),
}

/// A target's region as this side reaches it, with what the target
/// granted.
pub(crate) struct PeerRegion {
    /// The mapping or the address.
    pub(crate) reach: Reach,
    /// The grant: key, length, remote rights.
    pub(crate) grant: Granted,
}

impl PeerRegion {
    /// The grant as the checks every backend makes see it.
    pub(crate) fn advert(&self) -> RemoteRegion {
        RemoteRegion {
            key: self.grant.key,
            addr: match &self.reach {
                Reach::Mapped(r) => r.addr(),
                Reach::Attached(addr) => *addr,
            },
            len: self.grant.len,
            access: self.grant.access,
        }
    }
}

/// What draining a connection found.
pub(crate) enum Event {
    /// The target answered notification `seq`.
    Notified(u64, NotifyStatus),
    /// The connection ended: the target is gone.
    Lost(&'static str, Option<io::Error>),
}

/// A connection to one target.
pub(crate) struct Conn {
    /// The socket (non-blocking once connected); shared with the I/O
    /// thread, which only watches it.
    pub(crate) sock: Arc<OwnedFd>,
    /// The target's regions, mapped or attached.
    pub(crate) regions: FastMap<RemoteKey, PeerRegion>,
    /// The target's pid as the kernel gave it (`SO_PEERCRED`): the process
    /// that listens on the socket, whose memory attached regions are in.
    pub(crate) pid: libc::pid_t,
    /// Notifications the socket could not take yet.
    unsent: VecDeque<Vec<u8>>,
}

fn io_err(op: String, source: io::Error) -> DataError {
    DataError::Io { op, source }
}

/// Maps (or, for cross-memory attach, probes) the regions of one grant
/// message; `pid` is the target's, from the kernel.
fn map_grants(
    peer: PeerId,
    pid: libc::pid_t,
    regions: Vec<Granted>,
    fds: Vec<OwnedFd>,
    into: &mut FastMap<RemoteKey, PeerRegion>,
) -> Result<(), DataError> {
    let refused = |key: RemoteKey, reason: String| DataError::PeerRegionRefused {
        backend: "shm",
        peer,
        key,
        reason,
    };
    let files = regions
        .iter()
        .filter(|g| g.attach.is_none() && g.gpu.is_none())
        .count();
    if files != fds.len() {
        return Err(refused(
            regions.first().map_or(RemoteKey(0), |g| g.key),
            format!(
                "the grant names {files} memory files but carries {} descriptors",
                fds.len()
            ),
        ));
    }
    let mut fds = fds.into_iter();
    for grant in regions {
        let reach = match (&grant.gpu, grant.attach) {
            (Some(gpu), None) => Reach::Mapped(
                open_gpu(gpu, grant.len, grant.access).map_err(|r| refused(grant.key, r))?,
            ),
            (Some(_), Some(_)) => {
                return Err(refused(
                    grant.key,
                    "the grant names both an IPC handle and an address".into(),
                ))
            }
            (None, Some(addr)) => Reach::Attached(
                probe(pid, addr, grant.len).map_err(|reason| refused(grant.key, reason))?,
            ),
            (None, None) => {
                let fd = fds.next().expect("counted above");
                Reach::Mapped(map_peer(&fd, grant.len, grant.access).map_err(|r| {
                    let reason = match r {
                        MapRefusal::Unsafe(why) => why.to_owned(),
                        MapRefusal::Os(op, e) => format!("{op}: {e}"),
                    };
                    refused(grant.key, reason)
                })?)
            }
        };
        into.insert(grant.key, PeerRegion { reach, grant });
    }
    Ok(())
}

/// Maps a target's region of GPU memory through its driver's IPC handle,
/// on the device with the same PCI address here. The driver maps the whole
/// allocation that holds the region; the region covers only the granted
/// range, which must lie inside the allocation as the driver reports it
/// here (a lying target cannot stretch it).
fn open_gpu(gpu: &GpuGrant, len: u64, access: Access) -> Result<Region, String> {
    let handle = <[u8; IPC_HANDLE_LEN]>::try_from(gpu.handle.as_slice()).map_err(|_| {
        format!(
            "its IPC handle has {} bytes, not {IPC_HANDLE_LEN}",
            gpu.handle.len()
        )
    })?;
    let device = gpu_device_at(gpu.runtime, &gpu.pci_bus_id)
        .map_err(|e| {
            format!(
                "it is {} memory, and this process cannot use it: {e}",
                gpu.runtime
            )
        })?
        .ok_or_else(|| {
            format!(
                "it is memory of the {} device at PCI {}, which this process does not see \
                 (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or another host's device)",
                gpu.runtime, gpu.pci_bus_id
            )
        })?;
    Region::from_ipc(device, &IpcHandle(handle), gpu.offset, len, access)
        .map_err(|e| format!("opening its IPC handle on {device} failed: {e}"))
}

/// Checks that a region served by cross-memory attach is reachable: its
/// range does not wrap, and the kernel lets this process read its first
/// byte (which proves the permission, so that a connect fails at once,
/// and `SameHost` falls back to its other backend, where a transfer
/// would fail later).
fn probe(pid: libc::pid_t, addr: u64, len: u64) -> Result<u64, String> {
    if pid <= 0 {
        return Err(
            "it is served by cross-memory attach, but the target's process is not \
                    visible from this pid namespace"
                .into(),
        );
    }
    if len == 0 || addr.checked_add(len).is_none() {
        return Err(format!("its range {addr:#x}+{len} is empty or wraps"));
    }
    probe_attach(pid, addr)
        .map(|()| addr)
        .map_err(|e| attach_refusal(pid, &e))
}

/// Why the kernel refused a cross-memory attach to `pid`, saying what to
/// do.
pub(crate) fn attach_refusal(pid: libc::pid_t, e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) => format!(
            "the kernel refused cross-memory attach to the target (pid {pid}): EPERM. This \
             process may not ptrace it: another user, a target that made itself non-dumpable \
             (PR_SET_DUMPABLE), or Yama's ptrace_scope; run both as one user, or serve the \
             region with Region::alloc_shared or over tcp"
        ),
        Some(libc::ESRCH) => format!("the target's process (pid {pid}) is gone: ESRCH"),
        Some(libc::EFAULT) => format!(
            "the target (pid {pid}) has no memory mapped there (EFAULT): it unmapped or freed \
             the region, or, for a WRITE, mapped it read-only"
        ),
        _ => format!("cross-memory attach to the target (pid {pid}) failed: {e}"),
    }
}

impl Conn {
    /// Connects to `ep`, presents its credential and maps every region the
    /// target grants. Blocks up to `timeout` per step.
    pub(crate) fn connect(
        peer: PeerId,
        ep: &ShmEndpoint,
        timeout: Duration,
    ) -> Result<Self, DataError> {
        let what = || format!("shm target {} (peer {peer})", ep.display_name());
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)
            .map_err(|e| io_err(format!("create a socket for {}", what()), e))?;
        let addr = SockAddr::unix(ep.socket_name())
            .map_err(|e| io_err(format!("address of {}", what()), e))?;
        sock.set_read_timeout(Some(timeout))
            .and_then(|()| sock.set_write_timeout(Some(timeout)))
            .map_err(|e| io_err(format!("set timeouts for {}", what()), e))?;
        sock.connect(&addr)
            .map_err(|e| io_err(format!("connect to {}", what()), e))?;
        let pid =
            peer_pid(sock.as_fd()).map_err(|e| io_err(format!("read the pid of {}", what()), e))?;
        let hello = wire::encode(&ToTarget::Hello {
            version: wire::VERSION,
            token: ep.token.to_vec(),
        });
        send_msg(sock.as_fd(), &hello, &[])
            .map_err(|e| io_err(format!("send the credential to {}", what()), e))?;
        let mut regions = FastMap::default();
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let mut fds = Vec::new();
            let n = recv_msg(sock.as_fd(), &mut buf, &mut fds).map_err(|e| {
                io_err(
                    format!("receive the regions of {} (credential refused?)", what()),
                    e,
                )
            })?;
            if n == 0 {
                return Err(DataError::PeerLost {
                    peer,
                    reason: "the shm target closed the connection before granting its regions (credential refused, or the target is gone)",
                    source: None,
                });
            }
            match wire::decode::<ToInitiator>(&buf[..n]) {
                Some(ToInitiator::Grant { regions: g, last }) => {
                    map_grants(peer, pid, g, fds, &mut regions)?;
                    if last {
                        break;
                    }
                }
                _ => {
                    return Err(DataError::BadEndpoint {
                        backend: "shm",
                        reason: format!("{} answered the hello with something else", what()),
                    })
                }
            }
        }
        sock.set_nonblocking(true)
            .map_err(|e| io_err(format!("make the socket to {} non-blocking", what()), e))?;
        Ok(Self {
            sock: Arc::new(sock.into()),
            regions,
            pid,
            unsent: VecDeque::new(),
        })
    }

    /// Reads every message waiting; appends answers to `out`. Grants map
    /// new regions, revocations forget them. Returns after the socket is
    /// empty or the connection ended (`Event::Lost`, last).
    pub(crate) fn drain(&mut self, peer: PeerId, buf: &mut [u8], out: &mut Vec<Event>) {
        loop {
            let mut fds = Vec::new();
            let n = match recv_msg(self.sock.as_fd(), buf, &mut fds) {
                Ok(0) => return out.push(Event::Lost(
                    "the target closed the connection (its process ended or it removed this peer)",
                    None,
                )),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return out.push(Event::Lost("the target sent an oversized message", Some(e)))
                }
                Err(e) => return out.push(Event::Lost("receive from the target failed", Some(e))),
            };
            match wire::decode::<ToInitiator>(&buf[..n]) {
                Some(ToInitiator::Notified { seq, status }) => {
                    out.push(Event::Notified(seq, status))
                }
                Some(ToInitiator::Revoke { key }) => {
                    self.regions.remove(&key);
                }
                Some(ToInitiator::Grant { regions, .. }) => {
                    let keys: Vec<_> = regions.iter().map(|g| g.key).collect();
                    if let Err(e) = map_grants(peer, self.pid, regions, fds, &mut self.regions) {
                        // The keys stay unknown: transfers naming them fail
                        // with UnknownKey.
                        tracing::warn!(%peer, ?keys, error = %e, "shm: a late grant was refused");
                    }
                }
                None => return out.push(Event::Lost("the target sent a malformed message", None)),
            }
        }
    }

    /// Sends (or queues) a notification; an error means the connection is
    /// broken.
    pub(crate) fn notify(&mut self, msg: Vec<u8>) -> io::Result<()> {
        self.unsent.push_back(msg);
        self.flush()
    }

    /// Sends queued notifications until the socket is full.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        while let Some(msg) = self.unsent.front() {
            match send_msg(self.sock.as_fd(), msg, &[]) {
                Ok(_) => {
                    self.unsent.pop_front();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether notifications wait for room in the socket.
    pub(crate) fn has_unsent(&self) -> bool {
        !self.unsent.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuRuntime;

    /// What a target's grant of GPU memory can get wrong, against the mock
    /// CUDA driver (which opens a handle in the process that made it only
    /// with `KVLANE_MOCK_IPC_SAME_PROCESS`, a test knob).
    #[test]
    fn gpu_grants_outside_their_allocation_or_with_bad_handles_are_refused() {
        let dev = crate::conformance::use_mock_cuda();
        std::env::set_var("KVLANE_MOCK_IPC_SAME_PROCESS", "1");
        let region = Region::alloc_device(dev, 8192, Access::ALL).unwrap();
        region.copy_in(100, b"device bytes").unwrap();
        let export = region.gpu().unwrap().export_ipc().unwrap();
        let pci = crate::gpu::gpu_devices(GpuRuntime::Cuda).unwrap()[0]
            .pci_bus_id
            .clone();
        let grant = |offset: u64| GpuGrant {
            runtime: GpuRuntime::Cuda,
            pci_bus_id: pci.clone(),
            handle: export.handle.0.to_vec(),
            offset,
        };
        // Inside the allocation: mapped, the bytes are the target's.
        let mapped = open_gpu(&grant(100), 12, Access::ALL).unwrap();
        let mut buf = [0u8; 12];
        mapped.copy_out(0, &mut buf).unwrap();
        assert_eq!(&buf, b"device bytes");
        // Past the end, straddling it, wrapping, empty.
        for (offset, len) in [(8192, 1), (4096, 8192), (u64::MAX - 10, 20), (0, 0)] {
            let err = open_gpu(&grant(offset), len, Access::ALL).unwrap_err();
            assert!(
                err.contains("outside the allocation"),
                "{offset}+{len}: {err}"
            );
        }
        // A handle of the wrong length, a forged one, a device not here.
        let mut short = grant(0);
        short.handle.pop();
        assert!(open_gpu(&short, 16, Access::ALL)
            .unwrap_err()
            .contains("not 64"));
        let mut forged = grant(0);
        forged.handle = vec![0x42; 64];
        let err = open_gpu(&forged, 16, Access::ALL).unwrap_err();
        assert!(err.contains("cuIpcOpenMemHandle_v2"), "{err}");
        let mut elsewhere = grant(0);
        elsewhere.pci_bus_id = "0000:ff:1f.7".into();
        let err = open_gpu(&elsewhere, 16, Access::ALL).unwrap_err();
        assert!(err.contains("does not see"), "{err}");
    }
}
