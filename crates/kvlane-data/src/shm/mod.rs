//! The shm backend: one-sided READ and WRITE between processes of one host
//! through shared memory. Memory kvlane allocates for it
//! ([`Region::alloc_shared`]) is shared as a sealed memory file; memory the
//! engine allocated itself (a torch tensor, a numpy array, [`Region::alloc`],
//! [`Region::from_raw`]) is served by cross-memory attach, **opt-in**
//! ([`ShmConfig::cross_memory_attach`]; see *Cross-memory attach*); GPU
//! memory registered through its runtime is served by CUDA or HIP IPC
//! handle (see *GPU memory*). The facade's `auto` runs it beside tcp or
//! verbs through [`SameHost`](crate::SameHost), per peer.
//!
//! # How registered memory becomes reachable
//!
//! By default only regions made by [`Region::alloc_shared`] are served
//! (for the others see *Cross-memory attach*): host memory backed by a
//! memfd, its pages allocated up front, sealed against
//! resizing (`F_SEAL_SHRINK | F_SEAL_GROW`), against new writable mappings
//! when the region grants no [`Access::REMOTE_WRITE`]
//! (`F_SEAL_FUTURE_WRITE`), and against further seals (`F_SEAL_SEAL`).
//!
//! 1. Each backend listens on an abstract Unix `SOCK_SEQPACKET` socket
//!    with a random name (`\0kvlane-shm-<pid>-<random>`; no file to clean
//!    up, scoped to the network namespace). Its [`Endpoint`] carries that
//!    name, the host's boot id, and a random 128-bit credential that
//!    [`prepare_peer`](Backend::prepare_peer) issues for one peer (as tcp
//!    does; the control plane hands it only to a peer that completed the
//!    handshake).
//! 2. The initiator refuses an endpoint from another boot id (another
//!    host, or this host before a reboot) with a typed error naming both,
//!    then connects and presents the credential. The target's I/O thread
//!    checks it before anything else; a connection with no valid
//!    credential within [`ShmConfig::auth_timeout`] is closed having
//!    learnt nothing.
//! 3. The target then passes the memfd of every registered region with a
//!    remote right (`SCM_RIGHTS`), with its key, length and rights (a
//!    region served by cross-memory attach: its address instead).
//!    For GPU memory: the driver's IPC handle of its allocation instead
//!    (see *GPU memory*). Regions registered later are passed to connected
//!    peers as they are registered; a deregistered region is revoked (see
//!    *Trust*).
//! 4. The initiator maps each descriptor only after checking that it is a
//!    memory file sealed against shrinking and at least as long as the
//!    region: every byte of the mapping then stays backed whatever the
//!    target does later (a `ftruncate` is refused by the seal), so a copy
//!    cannot fault with `SIGBUS`. It maps writable only regions that grant
//!    WRITE; for the others the target's seal makes a writable mapping
//!    impossible, even through `/proc/<pid>/fd`.
//! 5. READ and WRITE are `memcpy` between the initiator's region and its
//!    mapping of the target's, in the initiator's own thread: the one that
//!    submits the transfer when nothing is queued before it
//!    ([`submit_now`](Backend::submit_now): a transfer without a
//!    notification is then finished before the call returns), else the
//!    one that calls [`poll`](Backend::poll); the target's threads copy
//!    nothing.
//!    Every segment is checked first, as a NIC would (key granted, range
//!    inside the grant, remote right, local range and right); nothing
//!    moves when one check fails, and a lying peer gets a typed error,
//!    never another byte of memory.
//! 6. A notification goes to the target over the socket only after every
//!    byte of its transfer was copied; the target's I/O thread queues it
//!    and answers (delivered, queue full, past the deadline). The transfer
//!    completes on that answer. The deadline crosses the process boundary
//!    as `CLOCK_MONOTONIC`, which every process of the host shares: a
//!    notification that arrives late is refused, never delivered late.
//!
//! # Cross-memory attach (opt-in)
//!
//! Memory the engine allocated is anonymous memory of its process: no
//! file backs it, so there is nothing to pass or map. Three ways were
//! weighed:
//!
//! - **Cross-memory attach** (`process_vm_readv` / `process_vm_writev`):
//!   one copy, made by the initiator's thread straight between the two
//!   processes' memory, as for memory files; the target's threads copy
//!   nothing. The kernel walks the target's page tables itself, so memory
//!   the target unmaps or frees under a transfer is an error (`EFAULT`),
//!   never a fault in the initiator. But the kernel's permission is
//!   ptrace's: it covers the **whole** target process, not its regions.
//! - **The target copies** into and out of a per-peer shared staging
//!   buffer, checking every request as the tcp target does: only
//!   registered regions are ever reachable, but two copies and the
//!   target's CPU per transfer: what tcp over loopback already does.
//! - **Remapping the memory into a file** after the fact: Linux cannot
//!   turn anonymous memory into shared file memory in place.
//!
//! So cross-memory attach it is, as an opt-in of the target
//! ([`ShmConfig::cross_memory_attach`]; the facade's
//! `AgentBuilder::shm_cross_memory_attach`, Python's
//! `shm_cross_memory_attach=True`), and without it such regions stay
//! refused by [`register`] ([`DataError::Unsupported`], naming the
//! opt-in), so that [`SameHost`](crate::SameHost) serves them over its
//! other backend, which exposes only registered regions.
//!
//! With the opt-in, a region that is not a memory file is granted with its
//! address in the target's process. The initiator learns the target's pid
//! from the kernel (`SO_PEERCRED` on the socket: the process that listens
//! on it), never from a message, so a lying target cannot point it at
//! another process. Before each copy it checks the key, the bounds and the
//! rights exactly as for a memory file, then copies with one batch of
//! `process_vm_readv`/`process_vm_writev` calls per transfer. When the
//! target's memory is gone the transfer fails with
//! [`DataError::RemoteMemoryFault`] naming the peer, the region's key, the
//! offset and the reason (`EFAULT`: unmapped, freed, or read-only for a
//! WRITE; `EPERM`: the kernel refused the attach); when its process is
//! gone, with [`DataError::PeerLost`]. Connecting probes each such region
//! (one byte read), so a refused attach fails the connect (and `SameHost`
//! falls back to its other backend) rather than the first transfer.
//!
//! **What the opt-in exposes.** Every process the kernel lets attach to
//! the target (the same user, with the target dumpable, which is the
//! default; or `CAP_SYS_PTRACE`, e.g. root) can read and write **all** of
//! the target's memory through these calls, whatever it was granted;
//! kvlane's checks keep a well-behaved peer inside the registered regions
//! and their rights, but a hostile peer is not held by them, and a
//! region's missing [`Access::REMOTE_WRITE`] is not enforced by the kernel
//! for it. Such a process could do the same without kvlane (ptrace,
//! `/proc/<pid>/mem`), unless the target made itself non-dumpable or Yama
//! restricts ptrace, which also makes the attach fail (`EPERM`); what the
//! opt-in adds is that the target hands out the addresses. Memory files
//! are unaffected: they stay limited by their seals and mappings. The
//! initiator runs no risk of its own: the kernel reaches only the pid it
//! names, copies into this side's registered regions only, and reports a
//! bad remote address as an error. One residual race: if the target dies
//! and its pid is reused by another process of the same user between the
//! liveness check (the socket, read before every batch) and the copy, the
//! copy reaches that process; the kernel hands out pids in order, so that
//! needs `pid_max` new processes within those microseconds.
//!
//! # GPU memory (CUDA / HIP IPC)
//!
//! A region of GPU memory registered through its runtime
//! ([`Region::alloc_device`], [`Region::from_device_ptr`]) is served by
//! the driver's IPC handle (`cuIpcGetMemHandle` / `hipIpcGetMemHandle`),
//! made once when the region is registered; a driver without the IPC
//! calls refuses the registration ([`DataError::Gpu`], unsupported). The
//! grant carries the handle (64 bytes, opaque to kvlane), the runtime, the
//! device's PCI address (ordinals differ between processes:
//! `CUDA_VISIBLE_DEVICES`), and the region's offset inside its allocation
//! (`cuMemGetAddressRange_v2` / `hipMemGetAddressRange`), beside its key,
//! length and rights, as for host regions.
//!
//! The initiator opens the handle once per region
//! (`cuIpcOpenMemHandle_v2` / `hipIpcOpenMemHandle`) on its device with
//! that PCI address, and refuses the grant (connect fails, typed, naming
//! the key and the reason) when it sees no such device, when the driver
//! refuses the handle, or when the granted range is not inside the
//! allocation as its own driver reports it: a lying target cannot stretch
//! a region past the memory the handle maps. Every segment is checked as
//! for host memory (key, bounds, rights, local range); the copies are the
//! driver's, in the initiator's thread: between the remote region and a
//! local region of the same device, one device-to-device copy
//! (`cuMemcpyDtoDAsync_v2` / `hipMemcpyDtoDAsync`); with local host memory
//! or another device, through pinned staging buffers on the device's
//! streams (as [`Region::read_chunks`] does). Every stream is synchronized
//! before the transfer completes and before its notification is sent. A failing
//! driver call fails the transfer with [`DataError::RemoteMemoryFault`]
//! naming the peer, the key, the offset, the device and the call. The
//! mapping is closed (`cuIpcCloseMemHandle` / `hipIpcCloseMemHandle`) when
//! the region is revoked, when the connection ends, and when the backend
//! drops. A peer closes a revoked region's mapping when it next reads its
//! connection; free GPU memory only after deregistering it, and expect a
//! peer's driver to keep what it mapped until it closes it (what a driver
//! does when the exporter frees memory still open elsewhere is the
//! driver's to define; not tested here).
//!
//! **What the handle exposes: the whole allocation that contains the
//! region.** The drivers map allocations, not ranges: a region that is a
//! slice of a larger `cudaMalloc` (a tensor inside PyTorch's caching
//! allocator's segment, one layer of a KV cache allocated in one piece)
//! gives a peer's driver the whole allocation, read-write (IPC mappings
//! have no read-only mode). kvlane's checks keep a well-behaved peer
//! inside the granted range and rights; a hostile peer process with the
//! handle is held by nothing, as with a memory file's descriptor. Serve a
//! region that is its own allocation ([`Region::alloc_device`]) to expose
//! exactly it.
//!
//! Limits: the target and the initiator must be different processes
//! (opening a handle in the process that made it is not what the IPC
//! calls are for, and the mocks refuse it; two agents in one process fall
//! back, under `SameHost`, to the other backend). A copy between two
//! different devices goes through host staging buffers (two copies), not
//! a peer-to-peer copy. Memory the legacy IPC calls do not cover (CUDA
//! virtual memory management, `cudaMallocAsync` pools) should fail at
//! registration with the driver's error from `cuIpcGetMemHandle`; not
//! verified. **All of this ran only against the mock CUDA driver and mock
//! HIP runtime** (`testdata/`: "device" memory in memfds, handles opened
//! through `/proc/<pid>/fd`), never on a GPU.
//!
//! # Liveness
//!
//! The socket is the liveness signal: when the target's process ends, the
//! kernel closes it and the initiator's next read returns end-of-stream
//! (no timer involved). The backend's I/O thread watches its connections
//! to targets and wakes the driver, and `poll` reads every connection with
//! work in flight before copying, so in-flight transfers fail with
//! [`DataError::PeerLost`] at once. A restarted target has a new socket
//! name and new credentials: the old endpoint no longer connects, and the
//! mappings of the dead process's memory are dropped with the connection;
//! the control plane reports the new incarnation (`Stale`).
//!
//! # Trust
//!
//! For memory files: a peer that holds a region's descriptor keeps its
//! mapping for as long as it likes: revocation (on
//! [`deregister`](Backend::deregister) and
//! [`remove_peer`](Backend::remove_peer)) is honoured by this backend but
//! cannot be forced on a hostile process. It never reaches more than the
//! regions it was granted, and never writes a read-only one. Memory that
//! must become private to its owner again must be dropped and a new
//! region allocated. A WRITE-only grant is readable too: no page table
//! maps memory write-only. A peer with a writable region could punch holes
//! in its file (`fallocate`), which reads as zeros afterwards, no worse
//! than writing zeros.
//!
//! For cross-memory attach (opt-in): a hostile peer that the kernel lets
//! attach reaches the whole target process (see *What the opt-in
//! exposes* above); revocation stops well-behaved peers only. Without the
//! opt-in, memory the engine allocated works as local memory (a READ's
//! destination, a WRITE's source) but is not served.
//!
//! # Not yet
//!
//! - GPU memory as the local side of a cross-memory-attach transfer (it
//!   works with memory files and with GPU regions served by IPC handle).
//! - GPU IPC on a real GPU: only the mock drivers ran it (see *GPU
//!   memory*).
//! - Cross-memory attach needs the target's pid to be visible in the
//!   initiator's pid namespace (containers sharing a host but not a pid
//!   namespace get a clear refusal at connect).
//!
//! [`register`]: Backend::register

mod copy;
mod peer;
mod run;
#[allow(unsafe_code)] // sendmsg/recvmsg with SCM_RIGHTS, mmap of peer regions, process_vm_*
mod sys;
mod target;
mod wire;

use crate::backend::{Backend, Connected, Connecting, Submitted};
use crate::error::{DataError, SubmitError};
use crate::host_registry::HostRegistry;
use crate::ids::{FastMap, PeerId, RegionId, RemoteKey, TransferId};
use crate::memory::{Access, MemoryKind, Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Segment, Transfer};
use peer::{Conn, Event};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::task::Waker;
use std::time::{Duration, Instant};
use target::{lock, Cmd, Target};
use wire::{NotifyStatus, MAX_MESSAGE, TOKEN_LEN};

/// Settings of a [`ShmBackend`].
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Transfers in flight (queued or waiting for the answer to their
    /// notification) before `submit` hands them back. Default 4096.
    pub queue_depth: usize,
    /// Bytes copied per `poll` call before it returns (at least one
    /// transfer is always done). Default 8 MiB; bounds how long `poll`
    /// holds the caller.
    pub poll_budget: u64,
    /// Notifications held for the application before the target refuses
    /// more ([`DataError::NotificationRefused`]). Default 4096.
    pub notification_capacity: usize,
    /// Bound of each blocking step of connecting to a target. Default 5 s.
    pub connect_timeout: Duration,
    /// How long a connection to this target may take to present its
    /// credential. Default 5 s.
    pub auth_timeout: Duration,
    /// How long past its deadline a transfer waits for the answer to its
    /// notification before failing with [`DataError::Timeout`]: the target
    /// decides delivery by the deadline, and its answer is on its way.
    /// Default 1 s.
    pub notify_grace: Duration,
    /// Serve regions that are not memory files (memory the engine
    /// allocated: [`Region::alloc`], [`Region::from_raw`] over a tensor or
    /// a numpy array) by cross-memory attach: peers copy with
    /// `process_vm_readv` / `process_vm_writev` into and out of this
    /// process. **Exposes the whole process** to every peer that the
    /// kernel lets attach to it (same user, or `CAP_SYS_PTRACE`): kvlane's
    /// checks keep a well-behaved peer inside the registered regions and
    /// their rights, but nothing in the kernel does. See the module docs
    /// (*Cross-memory attach*). Default false: such regions are refused
    /// by [`register`](Backend::register) when they have remote rights.
    pub cross_memory_attach: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            queue_depth: 4096,
            poll_budget: 8 << 20,
            notification_capacity: 4096,
            connect_timeout: Duration::from_secs(5),
            auth_timeout: Duration::from_secs(5),
            notify_grace: Duration::from_secs(1),
            cross_memory_attach: false,
        }
    }
}

/// What a peer needs to reach a [`ShmBackend`] (inside [`Endpoint::data`],
/// msgpack).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmEndpoint {
    /// `/proc/sys/kernel/random/boot_id` of the target's host.
    pub boot_id: String,
    /// Abstract socket name, without the leading NUL.
    pub name: String,
    /// The credential issued for the peer.
    #[serde(with = "serde_bytes")]
    pub token: [u8; TOKEN_LEN],
}

impl ShmEndpoint {
    /// The endpoint as carried in a handshake.
    pub fn to_endpoint(&self) -> Endpoint {
        Endpoint {
            backend: BackendKind::Shm,
            data: rmp_serde::to_vec_named(self).expect("shm endpoint encodes"),
        }
    }

    /// Decodes a shm endpoint (or the shm part of a
    /// [`SameHost`](crate::SameHost) endpoint).
    pub fn from_endpoint(ep: &Endpoint) -> Result<Self, DataError> {
        let part = crate::samehost::shm_part(ep);
        let ep = part.as_ref().unwrap_or(ep);
        let bad = |reason: String| DataError::BadEndpoint {
            backend: "shm",
            reason,
        };
        if ep.backend != BackendKind::Shm {
            return Err(bad(format!("endpoint is for the {} backend", ep.backend)));
        }
        rmp_serde::from_slice(&ep.data).map_err(|e| bad(e.to_string()))
    }

    fn socket_name(&self) -> String {
        format!("\0{}", self.name)
    }

    fn display_name(&self) -> String {
        format!("@{}", self.name)
    }
}

/// This host's boot id: two processes with the same one share a kernel.
pub fn boot_id() -> Result<String, DataError> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .map_err(|source| DataError::Io {
            op: "read /proc/sys/kernel/random/boot_id".into(),
            source,
        })
}

struct Slot {
    token: [u8; TOKEN_LEN],
    conn: Option<Conn>,
    /// Why the connection ended, once it did.
    lost: Option<&'static str>,
}

struct Waiting {
    id: TransferId,
    peer: PeerId,
    deadline: Instant,
}

/// Same-host shared-memory backend (see the [module docs](self)).
pub struct ShmBackend {
    config: ShmConfig,
    endpoint: ShmEndpoint,
    target: Target,
    registry: HostRegistry,
    peers: FastMap<PeerId, Slot>,
    next_peer: u64,
    queue: VecDeque<Transfer>,
    /// Completions found outside `poll` (failures, answers read by a
    /// submission), reported by the next poll.
    failed: VecDeque<Completion>,
    /// Whether the last submission left something only `poll` moves on
    /// ([`Backend::poll_after_submit`]).
    due: bool,
    /// The answers a submission reads (reused).
    answers: Vec<Completion>,
    /// Transfers whose notification awaits the target's answer, by seq.
    waiting: FastMap<u64, Waiting>,
    next_seq: u64,
    scratch: Vec<Segment>,
    events: Vec<Event>,
    buf: Vec<u8>,
}

impl std::fmt::Debug for ShmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmBackend")
            .field("socket", &self.endpoint.display_name())
            .field("regions", &self.registry.len())
            .field("peers", &self.peers.len())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl ShmBackend {
    /// Starts a backend: listens on a fresh abstract Unix socket and
    /// starts its I/O thread.
    pub fn new(config: ShmConfig) -> Result<Self, DataError> {
        let boot_id = boot_id()?;
        let name = format!(
            "kvlane-shm-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let io = |op: &str, source| DataError::Io {
            op: format!("{op} shm socket @{name}"),
            source,
        };
        let listener = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)
            .map_err(|e| io("create", e))?;
        let addr = SockAddr::unix(format!("\0{name}")).map_err(|e| io("address", e))?;
        listener.bind(&addr).map_err(|e| io("bind", e))?;
        listener.listen(128).map_err(|e| io("listen on", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io("configure", e))?;
        let target = Target::start(listener, config.notification_capacity, config.auth_timeout)
            .map_err(|e| io("start the I/O thread of", e))?;
        Ok(Self {
            config,
            endpoint: ShmEndpoint {
                boot_id,
                name,
                token: [0; TOKEN_LEN],
            },
            target,
            registry: HostRegistry::default(),
            peers: FastMap::default(),
            next_peer: 1,
            queue: VecDeque::new(),
            failed: VecDeque::new(),
            due: false,
            answers: Vec::new(),
            waiting: FastMap::default(),
            next_seq: 1,
            scratch: Vec::new(),
            events: Vec::new(),
            buf: vec![0; MAX_MESSAGE],
        })
    }

    /// Connections refused by this target (bad credential or message,
    /// no credential in time, answers not read).
    pub fn refused(&self) -> u64 {
        self.target
            .shared
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks `peer`'s connection lost: its mappings are dropped and every
    /// transfer waiting for its answers fails.
    fn lose(&mut self, peer: PeerId, reason: &'static str, source: Option<std::io::Error>) {
        let Some(slot) = self.peers.get_mut(&peer) else {
            return;
        };
        if slot.conn.take().is_some() {
            self.target.send(Cmd::Unwatch(peer));
            tracing::info!(%peer, reason, error = ?source, "shm: target lost");
        }
        slot.lost = Some(reason);
        let source = source.map(std::sync::Arc::new);
        let gone: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.peer == peer)
            .map(|(s, _)| *s)
            .collect();
        for seq in gone {
            let w = self.waiting.remove(&seq).expect("listed above");
            self.failed.push_back(Completion {
                id: w.id,
                peer,
                result: Err(DataError::PeerLost {
                    peer,
                    reason,
                    source: source.clone(),
                }),
            });
        }
    }

    /// Reads what `peer`'s target sent: answers complete transfers, an
    /// ended connection fails them.
    fn drain(&mut self, peer: PeerId, now: Instant, completions: &mut Vec<Completion>) {
        let Some(conn) = self.peers.get_mut(&peer).and_then(|s| s.conn.as_mut()) else {
            return;
        };
        let mut events = std::mem::take(&mut self.events);
        conn.drain(peer, &mut self.buf, &mut events);
        if let Err(e) = conn.flush() {
            events.push(Event::Lost("sending to the target failed", Some(e)));
        }
        for ev in events.drain(..) {
            match ev {
                Event::Notified(seq, status) => {
                    // An answer for a transfer that already timed out is
                    // dropped: it was reported once.
                    let Some(w) = self.waiting.remove(&seq) else {
                        continue;
                    };
                    let result = match status {
                        NotifyStatus::Delivered => Ok(()),
                        NotifyStatus::QueueFull => Err(DataError::NotificationRefused { peer }),
                        NotifyStatus::Expired => Err(DataError::Timeout {
                            id: w.id,
                            peer,
                            overdue: now.saturating_duration_since(w.deadline),
                        }),
                    };
                    completions.push(Completion {
                        id: w.id,
                        peer,
                        result,
                    });
                }
                Event::Lost(reason, source) => self.lose(peer, reason, source),
            }
        }
        self.events = events;
    }
}

impl ShmBackend {
    /// Whether this backend can serve `region` to peers ([`serves`]).
    pub(crate) fn serves(&self, region: &Region) -> bool {
        serves(region, self.config.cross_memory_attach)
    }

    /// Whether this backend serves host memory by cross-memory attach
    /// ([`ShmConfig::cross_memory_attach`]).
    pub(crate) fn attaches(&self) -> bool {
        self.config.cross_memory_attach
    }

    /// [`register`](Backend::register) under `key` when given (see
    /// [`SameHost`](crate::SameHost), which serves a region over shm under
    /// the key its other backend chose).
    pub(crate) fn register_as(
        &mut self,
        region: &Region,
        key: Option<RemoteKey>,
    ) -> Result<RemoteRegion, DataError> {
        let served = remote_rights(region.access());
        if served && !self.serves(region) {
            return Err(if region.kind() != MemoryKind::Host {
                DataError::Unsupported {
                    backend: "shm",
                    what: "device memory is served by CUDA/HIP IPC handle, which needs its \
                           runtime: register it with Region::alloc_device or \
                           Region::from_device_ptr, or use the verbs backend",
                }
            } else {
                DataError::Unsupported {
                    backend: "shm",
                    what: "a region with remote rights must be shareable memory: allocate it \
                           with Region::alloc_shared, or opt in to cross-memory attach \
                           (ShmConfig::cross_memory_attach, which exposes this whole process \
                           to same-user peers) for memory the engine allocated, or use the tcp \
                           backend",
                }
            });
        }
        // GPU memory: its IPC handle, made once, here, so that a driver
        // that cannot is a refusal of the registration.
        let gpu = match region.gpu() {
            Some(mem) if served => Some(gpu_grant(mem)?),
            _ => None,
        };
        let key = self.registry.register_as("shm", region, key)?;
        if served {
            let served = target::Served {
                region: region.clone(),
                gpu,
            };
            lock(&self.target.shared.regions).insert(key, served);
            self.target.send(Cmd::Grant(key));
        }
        Ok(region.advert(key))
    }

    /// [`prepare_peer`](Backend::prepare_peer) under the id `peer` when
    /// given (what [`SameHost`](crate::SameHost) uses, so that both of its
    /// backends name a peer alike); an id in use is refused.
    pub(crate) fn prepare_peer_as(
        &mut self,
        peer: Option<PeerId>,
    ) -> Result<(PeerId, Endpoint), DataError> {
        let peer = match peer {
            Some(p) if self.peers.contains_key(&p) => {
                return Err(DataError::Unsupported {
                    backend: "shm",
                    what: "preparing a peer under an id already in use",
                })
            }
            Some(p) => p,
            None => {
                while self.peers.contains_key(&PeerId(self.next_peer)) {
                    self.next_peer += 1;
                }
                let p = PeerId(self.next_peer);
                self.next_peer += 1;
                p
            }
        };
        let token: [u8; TOKEN_LEN] = rand::random();
        lock(&self.target.shared.creds).insert(token, peer);
        self.peers.insert(
            peer,
            Slot {
                token,
                conn: None,
                lost: None,
            },
        );
        let ep = ShmEndpoint {
            token,
            ..self.endpoint.clone()
        };
        Ok((peer, ep.to_endpoint()))
    }
}

/// What a peer needs to map a region of GPU memory: the IPC handle of the
/// allocation that holds it, the region's offset in it, and the device's
/// PCI address.
fn gpu_grant(mem: &crate::gpu::DeviceMemory) -> Result<wire::GpuGrant, DataError> {
    let device = mem.device();
    let export = mem.export_ipc()?;
    let info = crate::gpu::gpu_devices(device.runtime)?
        .into_iter()
        .find(|i| i.device == device)
        .ok_or(crate::gpu::GpuError::Unsupported {
            device,
            why: crate::gpu::GpuUnavailable::Operation("the driver no longer lists the device"),
        })?;
    Ok(wire::GpuGrant {
        runtime: device.runtime,
        pci_bus_id: info.pci_bus_id,
        handle: export.handle.0.to_vec(),
        offset: export.offset,
    })
}

/// A copy of a lost-peer error for each transfer it fails.
fn clone_lost(e: &DataError) -> DataError {
    match e {
        DataError::PeerLost {
            peer,
            reason,
            source,
        } => DataError::PeerLost {
            peer: *peer,
            reason,
            source: source.clone(),
        },
        DataError::UnknownPeer(p) => DataError::UnknownPeer(*p),
        _ => DataError::Unsupported {
            backend: "shm",
            what: "unexpected error",
        },
    }
}

/// Whether `access` grants a peer anything.
pub(crate) fn remote_rights(access: Access) -> bool {
    access.contains(Access::REMOTE_READ) || access.contains(Access::REMOTE_WRITE)
}

/// Whether shm can serve `region` to peers: a memory file, GPU memory
/// registered through its runtime (by IPC handle), or host memory when
/// `cross_memory_attach` is on.
pub(crate) fn serves(region: &Region, cross_memory_attach: bool) -> bool {
    region.is_shared()
        || (cross_memory_attach && region.kind() == MemoryKind::Host)
        || region.gpu().is_some()
}

impl Backend for ShmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Shm
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        self.register_as(region, None)
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        let key = self.registry.deregister(region)?;
        if lock(&self.target.shared.regions).remove(&key).is_some() {
            self.target.send(Cmd::Revoke(key));
        }
        Ok(())
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        self.prepare_peer_as(None)
    }

    fn endpoint_per_peer(&self) -> bool {
        // A credential per peer, as tcp.
        true
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let connected = self.start_connect(peer, remote, regions)?.run()?;
        self.finish_connect(peer, connected)
    }

    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        _regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        if !self.peers.contains_key(&peer) {
            return Err(DataError::UnknownPeer(peer));
        }
        let ep = ShmEndpoint::from_endpoint(remote)?;
        if ep.boot_id != self.endpoint.boot_id {
            return Err(DataError::BadEndpoint {
                backend: "shm",
                reason: format!(
                    "the peer runs on another host (boot id {}, this host {}): use tcp",
                    ep.boot_id, self.endpoint.boot_id
                ),
            });
        }
        let timeout = self.config.connect_timeout;
        Ok(Connecting::new(move || {
            let conn = Conn::connect(peer, &ep, timeout)?;
            Ok(Box::new(conn) as Box<dyn std::any::Any + Send>)
        }))
    }

    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        let conn = connected.take::<Conn>().ok_or(DataError::BadEndpoint {
            backend: "shm",
            reason: "connect produced no connection".into(),
        })?;
        let slot = self
            .peers
            .get_mut(&peer)
            .ok_or(DataError::UnknownPeer(peer))?;
        let sock = conn.sock.clone();
        slot.conn = Some(*conn);
        slot.lost = None;
        self.target.send(Cmd::Watch(peer, sock));
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerId) {
        self.lose(peer, "peer removed", None);
        let Some(slot) = self.peers.remove(&peer) else {
            return;
        };
        lock(&self.target.shared.creds).remove(&slot.token);
        self.target.send(Cmd::Close(peer));
        Completion::fail_removed(&mut self.queue, &mut self.failed, peer);
    }

    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        if let Err(e) = self.admit(&transfer) {
            return Err(SubmitError::Rejected(e));
        }
        self.enqueue(transfer)
    }

    /// Copies the transfer here when nothing is queued before it (see
    /// `run.rs`): finished unless it carries a notification, whose answer
    /// `poll` awaits.
    fn submit_now(&mut self, transfer: Transfer, now: Instant) -> Result<Submitted, SubmitError> {
        // The deadline is checked against the clock as the copy begins, not
        // the caller's reading, which may be a wait for the backend old.
        let now = now.max(Instant::now());
        self.due = false;
        let mut budget = self.config.poll_budget.max(1);
        self.submit_inline(transfer, now, &mut budget, &mut None)
    }

    /// [`submit_now`](Backend::submit_now) for each, in order, the copies
    /// bounded by one poll's budget for the batch (the rest queued), each
    /// peer's connection read once.
    fn submit_batch_now(
        &mut self,
        transfers: Vec<Transfer>,
        now: Instant,
        results: &mut Vec<Result<Submitted, SubmitError>>,
    ) -> bool {
        let now = now.max(Instant::now());
        self.due = false;
        let mut budget = self.config.poll_budget.max(1);
        let mut drained = None;
        for t in transfers {
            results.push(self.submit_inline(t, now, &mut budget, &mut drained));
        }
        self.due
    }

    fn poll_after_submit(&self) -> bool {
        self.due
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        let before = completions.len();
        let now = Instant::now();
        // Answers (and losses) of targets with notifications outstanding.
        let mut answering: Vec<PeerId> = self.waiting.values().map(|w| w.peer).collect();
        answering.extend(
            self.peers
                .iter()
                .filter(|(_, s)| s.conn.as_ref().is_some_and(Conn::has_unsent))
                .map(|(p, _)| *p),
        );
        answering.sort_unstable();
        answering.dedup();
        for peer in answering {
            self.drain(peer, now, completions);
        }
        let mut budget = self.config.poll_budget.max(1);
        while budget > 0 && !self.queue.is_empty() {
            self.run_peer(now, &mut budget, completions);
        }
        // Notifications whose answer did not come by the deadline and the
        // grace: the target is alive (its socket is open) but not answering.
        let grace = self.config.notify_grace;
        let late: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, w)| now > w.deadline + grace)
            .map(|(s, _)| *s)
            .collect();
        for seq in late {
            let w = self.waiting.remove(&seq).expect("listed above");
            completions.push(Completion {
                id: w.id,
                peer: w.peer,
                result: Err(DataError::Timeout {
                    id: w.id,
                    peer: w.peer,
                    overdue: now - w.deadline,
                }),
            });
        }
        completions.extend(self.failed.drain(..));
        completions.len() - before
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        let mut q = lock(&self.target.shared.notes);
        let n = q.len();
        out.extend(q.drain(..));
        n
    }

    fn in_flight(&self) -> usize {
        self.queue.len() + self.waiting.len() + self.failed.len()
    }

    fn set_waker(&mut self, waker: Waker) {
        *lock(&self.target.shared.waker) = Some(waker);
    }

    /// The copies are `poll`'s: the submitting thread does them.
    fn completes_inline(&self) -> bool {
        true
    }

    fn poll_by(&self) -> Option<Instant> {
        if !self.queue.is_empty() || !self.failed.is_empty() {
            return Some(Instant::now());
        }
        // The I/O thread wakes the driver when an answer arrives; only a
        // missing answer needs a timer.
        self.waiting
            .values()
            .map(|w| w.deadline + self.config.notify_grace)
            .min()
    }
}

impl Drop for ShmBackend {
    fn drop(&mut self) {
        // Connections and mappings close with the slots; the target's I/O
        // thread is stopped and joined by `Target`'s drop.
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for peer in peers {
            if let Some(slot) = self.peers.get_mut(&peer) {
                slot.conn = None;
            }
        }
    }
}
