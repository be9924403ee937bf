//! Target side: serves READ, WRITE and NOTIFY requests on the regions
//! registered with the backend.
//!
//! A fixed set of I/O threads ([`TcpConfig::io_threads`](super::TcpConfig::io_threads),
//! O(cores), not O(connections), shared by the tcp backends of a process)
//! each runs an epoll loop (`mio`) over its share of the connections of
//! every backend; a backend's listener is polled on one of them, which
//! hands accepted connections out round-robin. A connection is a non-blocking
//! state machine ([`ServeConn`]); every request passes [`check_request`]
//! before memory is touched.
//!
//! Hostile peers:
//!
//! - A connection must present a **per-peer credential** (issued by
//!   [`Credentials::issue`] for one [`PeerId`], revoked by
//!   [`Server::revoke`], which also closes that peer's connections) within
//!   **one auth deadline per connection**, counted from the accept.
//! - **Unauthenticated connections are capped apart** from authenticated
//!   ones (`max_unauthenticated`, split over the threads); past the cap the
//!   oldest unauthenticated connection is closed to make room, so a flood
//!   of silent connections neither takes an authenticated slot nor keeps
//!   a legitimate newcomer out for longer than it takes to accept it.
//! - **Authenticated connections are counted after the hello**
//!   (`max_connections`); past the cap a hello is refused.
//! - A connection whose serving **panics** is closed, its slot freed and
//!   the panic counted; a panic of an I/O thread's loop is logged and
//!   closes that thread's connections (their peers see the connection end).
//!
//! Deregistration: a request that passed the checks holds a lease on its
//! region until it is done with the memory (`lease.rs`);
//! [`Server::deregister`] waits for the leases, then cuts those left on
//! every thread, so that no byte of the region is touched once it returns.

use super::io::{tune_socket, SocketOptions};
use super::lease::{Lease, Served};
use super::serve::{Ctx, Drove, End, PeerFence, ServeConn};
use super::shared::{lock, Shared};
use super::wire::{
    credential_id, Challenge, Hello, Request, RequestKind, Status, HELLO_LEN, ID_LEN, REQUEST_LEN,
    TOKEN_LEN,
};
use crate::error::DataError;
use crate::ids::{FastMap, PeerId, RegionId, RemoteKey};
use crate::memory::Region;
use crate::progress::process_pool;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Accepted connections waiting for their I/O thread (per thread).
const HANDOFF: usize = 1024;

/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 1024;

const WAKE: Token = Token(0);
/// Listeners and connections take tokens from here up, one counter per
/// thread.
const FIRST_TOKEN: usize = 1;

/// Regions served, by key, with the accesses to each in flight.
pub(crate) type RegionTable = RwLock<HashMap<RemoteKey, Arc<Served>>>;

/// Counters of the target side, for monitoring and tests
/// (see [`TcpBackend::counters`](super::TcpBackend::counters)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpCounters {
    /// Connections accepted by the listener.
    pub connections_accepted: u64,
    /// Authenticated connections refused because the connection cap was
    /// reached, and accepted connections dropped because an I/O thread's
    /// hand-over queue was full.
    pub connections_refused: u64,
    /// Connections dropped because their hello or token was wrong (a
    /// revoked credential included).
    pub auth_failures: u64,
    /// Connections closed because they did not authenticate within the
    /// auth deadline.
    pub auth_timeouts: u64,
    /// Unauthenticated connections closed to make room for newer ones
    /// (the unauthenticated cap was reached).
    pub unauthenticated_evicted: u64,
    /// Served connections closed because their credential was revoked
    /// (the peer was removed).
    pub connections_revoked: u64,
    /// Connections closed because serving them panicked (a bug; logged).
    pub connection_panics: u64,
    /// Connections closed because a header did not decode.
    pub framing_errors: u64,
    /// Connections closed because a newer generation of their peer fenced
    /// them (see [`wire`](super::wire)): a WRITE or notification that
    /// arrived on one afterwards was dropped before it reached memory or
    /// the application.
    pub connections_fenced: u64,
    /// Connections admitted to FENCE only, through the credential of a
    /// sibling tcp backend of this process (another rail of the agent)
    /// whose own address could not be reached (see
    /// [`TcpBackend::fence_through_each_other`](super::TcpBackend::fence_through_each_other)).
    pub sibling_fences: u64,
    /// Requests refused: no region under the key.
    pub refused_unknown_key: u64,
    /// Requests refused: range outside the region.
    pub refused_out_of_bounds: u64,
    /// Requests refused: the region lacks the remote right.
    pub refused_access: u64,
    /// Notifications refused because the queue of notifications the
    /// application has not taken yet was full (see
    /// [`TcpConfig::max_notifications`](super::TcpConfig::max_notifications)).
    pub refused_notify_queue_full: u64,
    /// Requests cut because their region was deregistered while they were
    /// in progress (past [`TcpConfig::deregister_grace`](super::TcpConfig::deregister_grace)):
    /// a WRITE is answered with a refusal
    /// ([`DataError::RemoteRegionRevoked`]) and the rest of its payload
    /// dropped; a READ whose answer is being sent ends its connection.
    pub requests_cut: u64,
    /// READ requests served.
    pub reads_served: u64,
    /// WRITE requests served.
    pub writes_served: u64,
    /// Notifications delivered.
    pub notifications: u64,
    /// Bytes sent to peers by READs.
    pub bytes_read: u64,
    /// Bytes stored by peers' WRITEs.
    pub bytes_written: u64,
    /// Initiator side: failed connections whose target could not be
    /// fenced within [`TcpConfig::fence_timeout`](super::TcpConfig::fence_timeout)
    /// before their failed WRITEs and notifications were reported.
    pub unfenced_failures: u64,
}

impl TcpCounters {
    /// Adds `other`'s counts to these (the rails of one agent).
    pub fn merge(&mut self, other: &Self) {
        let Self {
            connections_accepted,
            connections_refused,
            auth_failures,
            auth_timeouts,
            unauthenticated_evicted,
            connections_revoked,
            connection_panics,
            framing_errors,
            connections_fenced,
            sibling_fences,
            refused_unknown_key,
            refused_out_of_bounds,
            refused_access,
            refused_notify_queue_full,
            requests_cut,
            reads_served,
            writes_served,
            notifications,
            bytes_read,
            bytes_written,
            unfenced_failures,
        } = other;
        self.connections_accepted += connections_accepted;
        self.connections_refused += connections_refused;
        self.auth_failures += auth_failures;
        self.auth_timeouts += auth_timeouts;
        self.unauthenticated_evicted += unauthenticated_evicted;
        self.connections_revoked += connections_revoked;
        self.connection_panics += connection_panics;
        self.framing_errors += framing_errors;
        self.connections_fenced += connections_fenced;
        self.sibling_fences += sibling_fences;
        self.refused_unknown_key += refused_unknown_key;
        self.refused_out_of_bounds += refused_out_of_bounds;
        self.refused_access += refused_access;
        self.refused_notify_queue_full += refused_notify_queue_full;
        self.requests_cut += requests_cut;
        self.reads_served += reads_served;
        self.writes_served += writes_served;
        self.notifications += notifications;
        self.bytes_read += bytes_read;
        self.bytes_written += bytes_written;
        self.unfenced_failures += unfenced_failures;
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) connections_accepted: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) auth_failures: AtomicU64,
    pub(crate) auth_timeouts: AtomicU64,
    pub(crate) unauthenticated_evicted: AtomicU64,
    pub(crate) connections_revoked: AtomicU64,
    pub(crate) connection_panics: AtomicU64,
    pub(crate) framing_errors: AtomicU64,
    pub(crate) connections_fenced: AtomicU64,
    pub(crate) sibling_fences: AtomicU64,
    pub(crate) refused_unknown_key: AtomicU64,
    pub(crate) refused_out_of_bounds: AtomicU64,
    pub(crate) refused_access: AtomicU64,
    pub(crate) refused_notify_queue_full: AtomicU64,
    pub(crate) requests_cut: AtomicU64,
    pub(crate) reads_served: AtomicU64,
    pub(crate) writes_served: AtomicU64,
    pub(crate) notifications: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> TcpCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TcpCounters {
            connections_accepted: g(&self.connections_accepted),
            connections_refused: g(&self.connections_refused),
            auth_failures: g(&self.auth_failures),
            auth_timeouts: g(&self.auth_timeouts),
            unauthenticated_evicted: g(&self.unauthenticated_evicted),
            connections_revoked: g(&self.connections_revoked),
            connection_panics: g(&self.connection_panics),
            framing_errors: g(&self.framing_errors),
            connections_fenced: g(&self.connections_fenced),
            sibling_fences: g(&self.sibling_fences),
            refused_unknown_key: g(&self.refused_unknown_key),
            refused_out_of_bounds: g(&self.refused_out_of_bounds),
            refused_access: g(&self.refused_access),
            refused_notify_queue_full: g(&self.refused_notify_queue_full),
            requests_cut: g(&self.requests_cut),
            reads_served: g(&self.reads_served),
            writes_served: g(&self.writes_served),
            notifications: g(&self.notifications),
            bytes_read: g(&self.bytes_read),
            bytes_written: g(&self.bytes_written),
            unfenced_failures: 0,
        }
    }

    pub(crate) fn refused(&self, status: Status) {
        match status {
            Status::Ok => {}
            Status::UnknownKey => bump(&self.refused_unknown_key, 1),
            Status::OutOfBounds(_) => bump(&self.refused_out_of_bounds, 1),
            Status::AccessDenied(_) => bump(&self.refused_access, 1),
            Status::NotifyQueueFull => bump(&self.refused_notify_queue_full, 1),
            Status::Revoked => bump(&self.requests_cut, 1),
        }
    }
}

/// The target's checks for one request: key known, right present, range
/// inside the region (overflow-safe). `Ok(None)` for notifications, which
/// touch no region. Nothing is read or written before this returns `Ok`,
/// and then only under the returned lease (called under the table's read
/// lock, so that a deregistration waits for or cuts the access).
pub(crate) fn check_request(
    regions: &HashMap<RemoteKey, Arc<Served>>,
    req: &Request,
) -> Result<Option<Lease>, Status> {
    let Some(op) = req.kind.op() else {
        return Ok(None);
    };
    let served = regions.get(&req.key).ok_or(Status::UnknownKey)?;
    let region = served.region();
    // The peer id only names the peer in the error, which the target does
    // not report; the status carries what the initiator needs.
    match region
        .advert(req.key)
        .check(PeerId(0), op, req.offset, req.len)
    {
        Ok(()) => Ok(Some(served.lease())),
        Err(DataError::AccessDenied { granted, .. }) => Err(Status::AccessDenied(granted.bits())),
        Err(DataError::RemoteOutOfBounds { region_len, .. }) => {
            Err(Status::OutOfBounds(region_len))
        }
        Err(_) => Err(Status::AccessDenied(region.access().bits())),
    }
}

/// Feeds arbitrary bytes to the request decoder and checker over a small
/// region table and asserts that whatever is accepted lies inside its
/// region. For the `tcp_request` fuzz target; not a stable API.
#[doc(hidden)]
pub fn fuzz_request(data: &[u8]) {
    use crate::memory::Access;
    use std::sync::OnceLock;
    static TABLE: OnceLock<HashMap<RemoteKey, Arc<Served>>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = HashMap::new();
        for (key, len, access) in [
            (1, 4096, Access::ALL),
            (2, 100, Access::REMOTE_READ),
            (3, 1, Access::REMOTE_WRITE),
            (u32::MAX, 65_536, Access::NONE),
        ] {
            if let Ok(region) = Region::alloc(len, access) {
                t.insert(RemoteKey(key), Served::new(region));
            }
        }
        t
    });
    for chunk in data.chunks_exact(REQUEST_LEN) {
        let mut h = [0u8; REQUEST_LEN];
        h.copy_from_slice(chunk);
        let Ok(req) = Request::decode(&h) else {
            continue;
        };
        assert_eq!(Request::decode(&req.encode()), Ok(req));
        match check_request(table, &req) {
            Ok(Some(lease)) => {
                let region = lease.region();
                let end = req.offset.checked_add(req.len);
                assert!(end.is_some_and(|e| e <= region.len()), "{req:?} accepted");
                let needed = req.kind.op().map(crate::transfer::Op::remote_access);
                assert!(needed.is_some(), "{req:?} accepted");
                let needed = needed.unwrap_or(Access::ALL);
                assert!(region.access().contains(needed), "{req:?} accepted");
                // Touch exactly what the server would.
                assert!(region.check_range(req.offset, req.len).is_ok(), "{req:?}");
            }
            Ok(None) => assert!(matches!(req.kind, RequestKind::Notify | RequestKind::Fence)),
            Err(status) => assert_ne!(status, Status::Ok),
        }
    }
}

/// Runs arbitrary bytes through the server's real request loop
/// ([`ServeConn::drive`], the code every served connection runs) over an
/// in-memory stream that hands the input out in pieces of the sizes the
/// first bytes pick and takes output only in small pieces (so partial
/// reads and writes and the output cap are exercised), against a small
/// region table. Asserts that the loop ends (EOF or an error), never
/// panics, and never writes outside the writable regions. For the
/// `tcp_serve` fuzz target; not a stable API.
#[doc(hidden)]
pub fn fuzz_serve(data: &[u8]) {
    use crate::memory::Access;
    let Some((&shape, input)) = data.split_first() else {
        return;
    };
    let regions = RegionTable::default();
    let mut guards = Vec::new();
    for (key, len, access) in [
        (1, 4096, Access::ALL),
        (2, 100, Access::REMOTE_READ),
        (3, 20_000, Access::REMOTE_WRITE),
        (u32::MAX, 65_536, Access::NONE),
    ] {
        let Ok(region) = Region::alloc(len, access) else {
            return;
        };
        regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(RemoteKey(key), Served::new(region.clone()));
        guards.push(region);
    }
    let shared = Shared::default();
    let counters = Counters::default();
    let ctx = Ctx {
        regions: &regions,
        shared: &shared,
        counters: &counters,
        authenticate: &|_, _| Err(End::Auth),
    };
    let mut stream = FuzzStream {
        input,
        read_piece: 1 + usize::from(shape & 0x0f) * 97,
        write_piece: (1 + usize::from(shape >> 4)) * 4099,
        blocked: false,
        write_blocked: false,
        output: 0,
    };
    let mut conn = ServeConn::authenticated(PeerId(1));
    let mut scratch = vec![0u8; super::io::IO_BUF];
    // Every round consumes input or output, so this ends.
    for _ in 0..input.len() + 4 * super::serve::OUT_MAX + 16 {
        stream.blocked = false;
        stream.write_blocked = false;
        if conn.drive(&mut stream, &ctx, &mut scratch).is_err() {
            break;
        }
    }
    // Untouched: the read-only and no-access regions.
    assert!(guards[1].to_vec().is_ok_and(|v| v.iter().all(|&b| b == 0)));
    assert!(guards[3].to_vec().is_ok_and(|v| v.iter().all(|&b| b == 0)));
    let c = counters.snapshot();
    assert!(c.bytes_written <= input.len() as u64);
}

/// The fuzz target's socket: input in pieces and output taken in pieces,
/// one read and one write per round, `WouldBlock` after that, so the loop
/// sees both outcomes (and must return when both block); output counted
/// and dropped.
struct FuzzStream<'a> {
    input: &'a [u8],
    read_piece: usize,
    write_piece: usize,
    blocked: bool,
    write_blocked: bool,
    output: usize,
}

impl super::outq::Sock for FuzzStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.blocked {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.blocked = true;
        let n = buf.len().min(self.read_piece).min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }

    fn read_into(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<usize> {
        region.check_range(offset, len).map_err(io::Error::other)?;
        let mut tmp = vec![
            0u8;
            usize::try_from(len)
                .unwrap_or(usize::MAX)
                .min(self.read_piece)
        ];
        let n = self.read(&mut tmp)?;
        region.write(offset, &tmp[..n]).map_err(io::Error::other)?;
        Ok(n)
    }

    fn write_parts(&mut self, parts: &[crate::memory::IoPart<'_>]) -> io::Result<usize> {
        for part in parts {
            if let crate::memory::IoPart::Region(r, off, len) = *part {
                // What a real `writev` would send must lie in its region.
                assert!(r.check_range(off, len).is_ok(), "answer outside its region");
            }
        }
        if self.write_blocked {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.write_blocked = true;
        let total: u64 = parts.iter().map(|p| p.len()).sum();
        let n = usize::try_from(total)
            .unwrap_or(usize::MAX)
            .min(self.write_piece);
        self.output += n;
        Ok(n)
    }
}

/// Per-peer credentials the server accepts: a random 128-bit token each
/// (from `rand`'s thread-local CSPRNG, seeded by the OS), named on the
/// wire by its public [`credential_id`] and proven per connection (see
/// [`wire`](super::wire)).
#[derive(Default)]
pub(crate) struct Credentials {
    table: RwLock<CredTable>,
    /// The credentials of the other tcp backends of this process that
    /// fence through this one (rails of one agent): a hello that proves
    /// one of theirs is admitted here to FENCE that peer's connections
    /// there, and for nothing else (see
    /// [`TcpBackend::fence_through_each_other`](super::TcpBackend::fence_through_each_other)).
    siblings: RwLock<Vec<Weak<Self>>>,
}

#[derive(Default)]
struct CredTable {
    /// The peer, its token and its fence (see [`wire`](super::wire); kept
    /// when the credential is re-issued, dropped when it is revoked).
    by_id: HashMap<[u8; ID_LEN], (PeerId, [u8; TOKEN_LEN], Arc<PeerFence>)>,
    by_peer: FastMap<PeerId, [u8; ID_LEN]>,
}

impl Credentials {
    /// Issues (or re-issues, revoking the old one) the credential of `peer`.
    pub(crate) fn issue(&self, peer: PeerId) -> [u8; TOKEN_LEN] {
        let token: [u8; TOKEN_LEN] = rand::random();
        let id = credential_id(&token);
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        // A peer's live connections keep their admission (and their
        // fence); callers issue once per peer and revoke through the server.
        let fence = match t.by_peer.insert(peer, id) {
            Some(old) => t.by_id.remove(&old).map(|(_, _, f)| f).unwrap_or_default(),
            None => Arc::default(),
        };
        t.by_id.insert(id, (peer, token, fence));
        token
    }

    /// Revokes `peer`'s credential; true if it had one.
    fn revoke(&self, peer: PeerId) -> bool {
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        let Some(id) = t.by_peer.remove(&peer) else {
            return false;
        };
        t.by_id.remove(&id);
        true
    }

    /// The peer whose credential `hello` proves for `challenge` (the one
    /// this connection was sent). The id is public, so looking it up
    /// leaks nothing; the proof is checked in constant time.
    fn authenticate(
        &self,
        hello: &[u8; HELLO_LEN],
        challenge: &Challenge,
    ) -> Option<(PeerId, Arc<PeerFence>)> {
        let hello = Hello::decode(hello).ok()?;
        let t = self.table.read().unwrap_or_else(|e| e.into_inner());
        let (peer, token, fence) = t.by_id.get(&hello.id)?;
        hello
            .verify(challenge, token)
            .then(|| (*peer, fence.clone()))
    }

    /// The fence of the sibling's peer whose credential `hello` proves
    /// for `challenge` (see `siblings`).
    fn authenticate_sibling(
        &self,
        hello: &[u8; HELLO_LEN],
        challenge: &Challenge,
    ) -> Option<Arc<PeerFence>> {
        let hello = Hello::decode(hello).ok()?;
        let siblings = self.siblings.read().unwrap_or_else(|e| e.into_inner());
        for s in siblings.iter().filter_map(Weak::upgrade) {
            let t = s.table.read().unwrap_or_else(|e| e.into_inner());
            if let Some((_, token, fence)) = t.by_id.get(&hello.id) {
                return hello.verify(challenge, token).then(|| fence.clone());
            }
        }
        None
    }

    /// Admits hellos proving `other`'s credentials to FENCE here.
    pub(crate) fn add_sibling(&self, other: &Arc<Self>) {
        let mut siblings = self.siblings.write().unwrap_or_else(|e| e.into_inner());
        siblings.retain(|w| w.strong_count() > 0);
        if !siblings
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(other)))
        {
            siblings.push(Arc::downgrade(other));
        }
    }

    fn is_valid(&self, peer: PeerId) -> bool {
        self.table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_peer
            .contains_key(&peer)
    }
}

pub(crate) struct ServerConfig {
    pub(crate) listen: SocketAddr,
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_peer: usize,
    pub(crate) max_unauthenticated: usize,
    pub(crate) auth_timeout: Duration,
    pub(crate) io_threads: usize,
    pub(crate) socket: SocketOptions,
}

/// One server (one backend's target side): what its connections need,
/// wherever they are served.
struct ServerState {
    /// Tells this server's listener and connections apart from the other
    /// servers' on a shared thread.
    id: u64,
    /// Set as the server drops, before its threads are told: a connection
    /// accepted meanwhile and handed to a thread that already let the
    /// server go is closed, not served.
    closed: AtomicBool,
    regions: Arc<RegionTable>,
    shared: Arc<Shared>,
    counters: Arc<Counters>,
    creds: Arc<Credentials>,
    /// Authenticated connections served now, all threads together.
    authenticated: AtomicUsize,
    max_connections: usize,
    /// Authenticated connections of each peer served now (entries of
    /// peers with none are removed).
    per_peer: Mutex<FastMap<PeerId, usize>>,
    max_connections_per_peer: usize,
    /// Unauthenticated connections of this server one thread holds at most.
    unauth_per_thread: usize,
    auth_timeout: Duration,
    socket: SocketOptions,
    /// The threads accepted connections are handed to, in turn.
    homes: Vec<Arc<Home>>,
    next_home: AtomicUsize,
    /// Tests: serving a connection of this peer panics.
    #[cfg(test)]
    panic_peer: Mutex<Option<PeerId>>,
}

/// What one I/O thread is asked to do.
enum Cmd {
    /// Poll this server's listener here.
    Listen(Arc<ServerState>, TcpListener),
    /// Serve a connection the listener's thread accepted.
    Adopt(Arc<ServerState>, TcpStream, SocketAddr),
    /// Close the connections of this server whose credential was revoked.
    Revoked(u64),
    /// The server is going away: drop its listener and connections, then
    /// answer.
    Detach(u64, mpsc::Sender<()>),
    /// A region of this server was deregistered: cut the accesses to it
    /// its connections here still hold, then answer.
    Cut(u64, Arc<Served>, mpsc::Sender<()>),
}

/// How other threads reach one I/O thread.
struct Home {
    waker: Waker,
    inbox: Mutex<Vec<Cmd>>,
    /// Connections handed over and not adopted yet (bounded by [`HANDOFF`]).
    handed: AtomicUsize,
    stop: AtomicBool,
    index: usize,
}

impl Home {
    fn send(&self, cmd: Cmd) {
        lock(&self.inbox).push(cmd);
        if let Err(e) = self.waker.wake() {
            tracing::error!(thread = self.index, error = %e, "could not wake a tcp I/O thread");
        }
    }
}

/// The target-side I/O threads of the tcp backends of a process (those
/// with the same `io_threads`): a server's listener is polled on one of
/// them, its connections are spread over all of them. The threads stop
/// when the last server using them is dropped. Before, each backend ran
/// its own: 1,000 agents in two processes held 2,000 target threads that
/// served nobody.
struct ServePool {
    homes: Vec<Arc<Home>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
}

/// The pools of this process, by thread count.
static POOLS: Mutex<Vec<(usize, Weak<ServePool>)>> = Mutex::new(Vec::new());
static NEXT_SERVER: AtomicU64 = AtomicU64::new(1);

impl ServePool {
    fn for_process(threads: usize) -> Result<Arc<Self>, DataError> {
        process_pool(&POOLS, threads, Self::start)
    }

    fn start(n: usize) -> Result<Self, DataError> {
        let mut pool = Self {
            homes: Vec::new(),
            threads: Vec::new(),
            next: AtomicUsize::new(0),
        };
        for index in 0..n {
            let poll = Poll::new().map_err(io_err(format!("create tcp I/O poller {index}")))?;
            let waker = Waker::new(poll.registry(), WAKE)
                .map_err(io_err(format!("create tcp I/O waker {index}")))?;
            let home = Arc::new(Home {
                waker,
                inbox: Mutex::new(Vec::new()),
                handed: AtomicUsize::new(0),
                stop: AtomicBool::new(false),
                index,
            });
            let worker = Worker {
                home: home.clone(),
                poll,
                listeners: FastMap::default(),
                conns: FastMap::default(),
                servers: FastMap::default(),
                deadlines: BTreeSet::new(),
                next_token: FIRST_TOKEN,
                scratch: vec![0u8; super::io::IO_BUF].into_boxed_slice(),
                again: Vec::new(),
            };
            let handle = crate::placement::spawn(
                thread::Builder::new().name(format!("kvlane-tcp-io-{index}")),
                move || worker.run(),
            )
            .map_err(io_err(format!("spawn tcp I/O thread {index}")))?;
            pool.homes.push(home);
            // On an error `pool` drops here, which stops the threads
            // already started.
            pool.threads.push(handle);
        }
        Ok(pool)
    }
}

impl Drop for ServePool {
    fn drop(&mut self) {
        for h in &self.homes {
            h.stop.store(true, Ordering::Release);
            let _ = h.waker.wake();
        }
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!("a tcp I/O thread panicked");
            }
        }
    }
}

/// One backend's listener and connections, served on the process's
/// shared I/O threads; shut down (listener closed, every connection
/// closed, the threads told and done) on drop.
pub(crate) struct Server {
    state: Arc<ServerState>,
    addr: SocketAddr,
    pool: Arc<ServePool>,
}

fn io_err(op: String) -> impl FnOnce(io::Error) -> DataError {
    move |source| DataError::Io { op, source }
}

impl Server {
    pub(crate) fn start(
        config: ServerConfig,
        regions: Arc<RegionTable>,
        shared: Arc<Shared>,
        counters: Arc<Counters>,
        creds: Arc<Credentials>,
    ) -> Result<Self, DataError> {
        let listen = config.listen;
        let std_listener = std::net::TcpListener::bind(listen)
            .map_err(io_err(format!("bind tcp listener {listen}")))?;
        let addr = std_listener
            .local_addr()
            .map_err(io_err(format!("local address of tcp listener {listen}")))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io_err(format!("make tcp listener {addr} non-blocking")))?;
        let listener = TcpListener::from_std(std_listener);
        let pool = ServePool::for_process(config.io_threads)?;
        let n = pool.homes.len();
        let state = Arc::new(ServerState {
            id: NEXT_SERVER.fetch_add(1, Ordering::Relaxed),
            closed: AtomicBool::new(false),
            regions,
            shared,
            counters,
            creds,
            authenticated: AtomicUsize::new(0),
            max_connections: config.max_connections.max(1),
            per_peer: Mutex::new(FastMap::default()),
            max_connections_per_peer: config.max_connections_per_peer.max(1),
            unauth_per_thread: config.max_unauthenticated.div_ceil(n).max(1),
            auth_timeout: config.auth_timeout,
            socket: config.socket,
            homes: pool.homes.clone(),
            next_home: AtomicUsize::new(0),
            #[cfg(test)]
            panic_peer: Mutex::new(None),
        });
        // Listeners go to the threads in turn too.
        let home = pool.next.fetch_add(1, Ordering::Relaxed) % n;
        pool.homes[home].send(Cmd::Listen(state.clone(), listener));
        Ok(Self { state, addr, pool })
    }

    /// The address the listener is bound to (with the real port).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Revokes `peer`'s credential and closes its connections (at the
    /// I/O threads' next turn, promptly: they are told).
    pub(crate) fn revoke(&self, peer: PeerId) {
        if self.state.creds.revoke(peer) {
            for h in &self.pool.homes {
                h.send(Cmd::Revoked(self.state.id));
            }
        }
    }

    /// Stops serving the region under `key` (`region` names it in errors).
    /// Requests that arrive from now on are refused (unknown key).
    /// Requests already accepted may finish within `grace`; past it,
    /// every I/O thread cuts those left ([`ServeConn::cut`]: a WRITE is
    /// refused, the rest of its payload dropped; a READ being answered
    /// ends its connection). Returns once no access to the region is in
    /// flight: from then on its memory is neither read nor written. An
    /// I/O thread that does not answer within [`DETACH_WAIT`] (it would
    /// be stuck inside one copy) makes this an error, and the memory must
    /// then be kept.
    pub(crate) fn deregister(
        &self,
        key: RemoteKey,
        region: RegionId,
        grace: Duration,
    ) -> Result<(), DataError> {
        let served = self
            .state
            .regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        let Some(served) = served else {
            return Ok(());
        };
        if served.wait_idle(grace) {
            return Ok(());
        }
        let (tx, rx) = mpsc::channel();
        for h in &self.pool.homes {
            h.send(Cmd::Cut(self.state.id, served.clone(), tx.clone()));
        }
        drop(tx);
        let started = Instant::now();
        for _ in &self.pool.homes {
            // A thread that is gone answered when it left (see `run`).
            if rx.recv_timeout(DETACH_WAIT).is_err() {
                break;
            }
        }
        // Every lease was dropped by the threads that held it; none can be
        // taken since the entry left the table.
        if served.wait_idle(Duration::ZERO) {
            return Ok(());
        }
        tracing::error!(%region, addr = %self.addr, "a tcp I/O thread did not let a deregistered region go");
        Err(DataError::DeregisterStuck {
            region,
            in_flight: served.leases(),
            waited: grace + started.elapsed(),
        })
    }

    /// Authenticated connections served now.
    #[cfg(test)]
    fn authenticated(&self) -> usize {
        self.state.authenticated.load(Ordering::Acquire)
    }
}

/// How long dropping a server waits for each thread to let its
/// connections go (a thread answers at its next turn; one that died does
/// not answer at all).
const DETACH_WAIT: Duration = Duration::from_secs(5);

impl Drop for Server {
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::Release);
        let (tx, rx) = mpsc::channel();
        for h in &self.pool.homes {
            h.send(Cmd::Detach(self.state.id, tx.clone()));
        }
        drop(tx);
        for _ in &self.pool.homes {
            if rx.recv_timeout(DETACH_WAIT).is_err() {
                tracing::error!(addr = %self.addr, "a tcp I/O thread did not let a closing server's connections go");
                break;
            }
        }
    }
}

/// One served connection on its I/O thread.
struct Conn {
    server: Arc<ServerState>,
    stream: TcpStream,
    from: SocketAddr,
    serve: ServeConn,
    /// Set once authenticated.
    peer: Option<PeerId>,
    accepted: Instant,
}

impl Conn {
    fn auth_deadline(&self) -> Instant {
        self.accepted + self.server.auth_timeout
    }
}

/// What one thread holds of one server.
#[derive(Default)]
struct OnThread {
    /// Its unauthenticated connections here, by auth deadline (oldest first).
    unauth: BTreeSet<(Instant, usize)>,
    /// Its connections here (all of them).
    conns: usize,
}

/// One I/O thread: its poller, its listeners and connections (of any
/// server of the process).
struct Worker {
    home: Arc<Home>,
    poll: Poll,
    listeners: FastMap<usize, (Arc<ServerState>, TcpListener)>,
    conns: FastMap<usize, Conn>,
    servers: FastMap<u64, OnThread>,
    /// Every unauthenticated connection here, by auth deadline.
    deadlines: BTreeSet<(Instant, usize)>,
    next_token: usize,
    scratch: Box<[u8]>,
    /// Connections that yielded (read budget used): driven again after
    /// this turn's events, before the thread waits.
    again: Vec<usize>,
}

impl Worker {
    fn run(mut self) {
        let index = self.home.index;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.event_loop()));
        if r.is_err() {
            // The connections close as `self` drops; their peers see it.
            tracing::error!(
                thread = index,
                "a tcp I/O thread panicked; its connections are closed"
            );
        }
        // Detaching servers must not wait on a thread that is gone.
        for cmd in lock(&self.home.inbox).drain(..) {
            // This thread serves nothing any more: it touches no region.
            if let Cmd::Detach(_, done) | Cmd::Cut(_, _, done) = cmd {
                let _ = done.send(());
            }
        }
    }

    fn event_loop(&mut self) {
        let mut events = Events::with_capacity(EVENTS);
        let mut cmds = Vec::new();
        loop {
            let timeout = if self.again.is_empty() {
                self.deadlines
                    .first()
                    .map(|(d, _)| d.saturating_duration_since(Instant::now()))
            } else {
                Some(Duration::ZERO)
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(thread = self.home.index, error = %e, "tcp poll failed; the I/O thread stops");
                    return;
                }
            }
            if self.home.stop.load(Ordering::Acquire) {
                return;
            }
            // Notifications this turn received are delivered at its end.
            let _wakes = crate::progress::WakeBatch::begin();
            let again = std::mem::take(&mut self.again);
            for ev in &events {
                match ev.token() {
                    WAKE => {}
                    Token(t) if self.listeners.contains_key(&t) => self.accept(t),
                    Token(t) if !again.contains(&t) => self.serve(t),
                    Token(_) => {}
                }
            }
            for t in again {
                self.serve(t);
            }
            std::mem::swap(&mut cmds, &mut *lock(&self.home.inbox));
            for cmd in cmds.drain(..) {
                self.command(cmd);
            }
            self.expire(Instant::now());
        }
    }

    fn token(&mut self) -> usize {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Listen(server, mut listener) => {
                let token = self.token();
                if let Err(e) =
                    self.poll
                        .registry()
                        .register(&mut listener, Token(token), Interest::READABLE)
                {
                    tracing::error!(error = %e, "could not register a tcp listener; it accepts nothing");
                    return;
                }
                self.listeners.insert(token, (server, listener));
                // Connections may be waiting already.
                self.accept(token);
            }
            Cmd::Adopt(server, stream, from) => {
                self.home.handed.fetch_sub(1, Ordering::AcqRel);
                self.adopt(server, stream, from);
            }
            Cmd::Revoked(id) => self.close_revoked(id),
            Cmd::Cut(id, served, done) => {
                self.cut(id, &served);
                let _ = done.send(());
            }
            Cmd::Detach(id, done) => {
                self.listeners.retain(|_, (s, _)| s.id != id);
                let gone: Vec<usize> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.server.id == id)
                    .map(|(t, _)| *t)
                    .collect();
                for t in gone {
                    self.close(t);
                }
                self.servers.remove(&id);
                let _ = done.send(());
            }
        }
    }

    fn accept(&mut self, token: usize) {
        loop {
            let Some((server, listener)) = self.listeners.get(&token) else {
                return;
            };
            let (stream, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of fds and the like: the connection stays in the
                    // backlog; try again at the next turn.
                    tracing::warn!(error = %e, "tcp accept failed");
                    return;
                }
            };
            let server = server.clone();
            bump(&server.counters.connections_accepted, 1);
            let n = server.homes.len();
            let i = server.next_home.fetch_add(1, Ordering::Relaxed) % n;
            if i == self.home.index {
                self.adopt(server, stream, from);
                continue;
            }
            let home = &server.homes[i];
            if home.handed.fetch_add(1, Ordering::AcqRel) >= HANDOFF {
                home.handed.fetch_sub(1, Ordering::AcqRel);
                bump(&server.counters.connections_refused, 1);
                continue;
            }
            home.send(Cmd::Adopt(server.clone(), stream, from));
        }
    }

    fn adopt(&mut self, server: Arc<ServerState>, mut stream: TcpStream, from: SocketAddr) {
        if server.closed.load(Ordering::Acquire) {
            return;
        }
        // Past this thread's unauthenticated cap for the server, its
        // oldest goes.
        while let Some(here) = self.servers.get_mut(&server.id) {
            if here.unauth.len() < server.unauth_per_thread {
                break;
            }
            let Some((_, token)) = here.unauth.pop_first() else {
                break;
            };
            if self.conns.contains_key(&token) {
                bump(&server.counters.unauthenticated_evicted, 1);
            }
            self.close(token);
        }
        tune_socket(socket2::SockRef::from(&stream), server.socket);
        let token = self.token();
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(token),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::warn!(%from, error = %e, "could not register a tcp connection");
            return;
        }
        let accepted = Instant::now();
        let deadline = accepted + server.auth_timeout;
        let here = self.servers.entry(server.id).or_default();
        here.unauth.insert((deadline, token));
        here.conns += 1;
        self.deadlines.insert((deadline, token));
        self.conns.insert(
            token,
            Conn {
                server,
                stream,
                from,
                serve: ServeConn::new(),
                peer: None,
                accepted,
            },
        );
        // Bytes may have arrived before the registration.
        self.serve(token);
    }

    fn serve(&mut self, token: usize) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let scratch = &mut self.scratch;
        let state = conn.server.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let ctx = Ctx {
                regions: &state.regions,
                shared: &state.shared,
                counters: &state.counters,
                authenticate: &|hello, challenge| admit(&state, hello, challenge),
            };
            let r = conn.serve.drive(&mut conn.stream, &ctx, scratch);
            #[cfg(test)]
            if conn.serve.peer().is_some() && conn.serve.peer() == *lock(&state.panic_peer) {
                panic!("test: serving {:?} panics", conn.serve.peer());
            }
            r
        }));
        let newly_authed = conn.peer.is_none() && conn.serve.peer().is_some();
        if newly_authed {
            conn.peer = conn.serve.peer();
            let deadline = conn.auth_deadline();
            self.deadlines.remove(&(deadline, token));
            if let Some(here) = self.servers.get_mut(&state.id) {
                here.unauth.remove(&(deadline, token));
            }
        }
        let end = match r {
            Ok(Ok(Drove::Blocked)) => return,
            Ok(Ok(Drove::Yielded)) => {
                self.again.push(token);
                return;
            }
            Ok(Err(end)) => end,
            Err(_) => {
                bump(&state.counters.connection_panics, 1);
                let (from, peer) = (conn.from, conn.peer);
                tracing::error!(%from, ?peer, "serving a tcp connection panicked; it is closed");
                self.close(token);
                return;
            }
        };
        let (from, peer) = (conn.from, conn.peer);
        match end {
            // Gone before a complete hello: a failed authentication too.
            End::Eof | End::Io(_) if peer.is_none() => {
                bump(&state.counters.auth_failures, 1);
                tracing::debug!(%from, "tcp connection ended before authenticating");
            }
            End::Eof => tracing::debug!(%from, ?peer, "connection closed by peer"),
            End::Auth => {
                bump(&state.counters.auth_failures, 1);
                tracing::debug!(%from, "unauthenticated tcp connection dropped");
            }
            End::Refused => {
                bump(&state.counters.connections_refused, 1);
                tracing::debug!(%from, cap = state.max_connections, "tcp connection cap reached");
            }
            End::Frame(e) => {
                bump(&state.counters.framing_errors, 1);
                tracing::debug!(%from, ?peer, error = %e, "framing error; connection closed");
            }
            End::Fenced { gen, floor } => {
                bump(&state.counters.connections_fenced, 1);
                tracing::info!(%from, ?peer, gen, floor, "connection fenced by a newer generation of its peer; closed");
            }
            End::Io(e) => tracing::debug!(%from, ?peer, error = %e, "connection ended"),
        }
        self.close(token);
    }

    /// Drops a connection and frees its slot.
    fn close(&mut self, token: usize) {
        let Some(conn) = self.conns.remove(&token) else {
            return;
        };
        let id = conn.server.id;
        if let Some(peer) = conn.peer {
            conn.server.authenticated.fetch_sub(1, Ordering::AcqRel);
            conn.server.leave(peer);
        } else {
            let deadline = conn.auth_deadline();
            self.deadlines.remove(&(deadline, token));
            if let Some(here) = self.servers.get_mut(&id) {
                here.unauth.remove(&(deadline, token));
            }
        }
        if let Some(here) = self.servers.get_mut(&id) {
            here.conns -= 1;
            if here.conns == 0 {
                self.servers.remove(&id);
            }
        }
    }

    /// Cuts the accesses to `served` that the connections of server `id`
    /// here hold (see [`ServeConn::cut`]); a connection that was sending a
    /// READ answer from it is closed.
    fn cut(&mut self, id: u64, served: &Arc<Served>) {
        let mut closing = Vec::new();
        for (token, c) in &mut self.conns {
            if c.server.id != id {
                continue;
            }
            let cut = c.serve.cut(served);
            if cut.requests > 0 {
                bump(&c.server.counters.requests_cut, cut.requests as u64);
                tracing::debug!(from = %c.from, peer = ?c.peer, requests = cut.requests, close = cut.close, "requests cut: their region was deregistered");
            }
            if cut.close {
                closing.push(*token);
            }
        }
        for token in closing {
            self.close(token);
        }
    }

    fn close_revoked(&mut self, id: u64) {
        let revoked: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.server.id == id && c.peer.is_some_and(|p| !c.server.creds.is_valid(p))
            })
            .map(|(t, _)| *t)
            .collect();
        for token in revoked {
            if let Some(c) = self.conns.get(&token) {
                bump(&c.server.counters.connections_revoked, 1);
            }
            self.close(token);
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&(deadline, token)) = self.deadlines.first() {
            if deadline > now {
                return;
            }
            self.deadlines.pop_first();
            if let Some(conn) = self.conns.get(&token) {
                bump(&conn.server.counters.auth_timeouts, 1);
            }
            self.close(token);
        }
    }
}

/// Authenticates a hello and admits its connection under the cap. A
/// hello proving a sibling's credential is admitted to FENCE only, outside
/// the caps (it stays unauthenticated here: its auth deadline closes it).
fn admit(
    state: &ServerState,
    hello: &[u8; HELLO_LEN],
    challenge: &Challenge,
) -> Result<(Option<PeerId>, Arc<PeerFence>), End> {
    let Some((peer, fence)) = state.creds.authenticate(hello, challenge) else {
        let fence = state
            .creds
            .authenticate_sibling(hello, challenge)
            .ok_or(End::Auth)?;
        bump(&state.counters.sibling_fences, 1);
        return Ok((None, fence));
    };
    {
        let mut per_peer = lock(&state.per_peer);
        let n = per_peer.entry(peer).or_insert(0);
        if *n >= state.max_connections_per_peer {
            tracing::debug!(
                ?peer,
                cap = state.max_connections_per_peer,
                "tcp per-peer connection cap reached"
            );
            return Err(End::Refused);
        }
        *n += 1;
    }
    if state.authenticated.fetch_add(1, Ordering::AcqRel) >= state.max_connections {
        state.authenticated.fetch_sub(1, Ordering::AcqRel);
        state.leave(peer);
        return Err(End::Refused);
    }
    Ok((Some(peer), fence))
}

impl ServerState {
    /// One authenticated connection of `peer` ended (or was refused).
    fn leave(&self, peer: PeerId) {
        let mut per_peer = lock(&self.per_peer);
        if let Some(n) = per_peer.get_mut(&peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_peer.remove(&peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::wait_for;
    use super::*;
    use crate::memory::Access;
    use proptest::prelude::*;

    fn table() -> HashMap<RemoteKey, Arc<Served>> {
        let mut t = HashMap::new();
        for (key, len, access) in [
            (1, 4096, Access::ALL),
            (2, 100, Access::REMOTE_READ),
            (3, 10, Access::REMOTE_WRITE),
        ] {
            t.insert(
                RemoteKey(key),
                Served::new(Region::alloc(len, access).unwrap()),
            );
        }
        t
    }

    proptest! {
        /// A request is accepted exactly when the key exists, the right is
        /// granted and `offset + len` fits (without overflow).
        #[test]
        fn check_request_accepts_exactly_the_valid_requests(
            key in 0u32..5,
            write in any::<bool>(),
            offset in prop_oneof![0u64..5000, any::<u64>()],
            len in prop_oneof![0u64..5000, any::<u64>()],
        ) {
            let t = table();
            let kind = if write { RequestKind::Write } else { RequestKind::Read };
            let req = Request { kind, key: RemoteKey(key), tag: 0, offset, len };
            let r = check_request(&t, &req);
            match t.get(&RemoteKey(key)) {
                None => prop_assert_eq!(r.err(), Some(Status::UnknownKey)),
                Some(served) => {
                    let region = served.region();
                    let needed = if write { Access::REMOTE_WRITE } else { Access::REMOTE_READ };
                    let fits = offset.checked_add(len).is_some_and(|e| e <= region.len());
                    match r {
                        Ok(Some(got)) => {
                            prop_assert!(fits && region.access().contains(needed));
                            prop_assert_eq!(got.region().id(), region.id());
                        }
                        Err(Status::AccessDenied(bits)) => {
                            prop_assert!(!region.access().contains(needed));
                            prop_assert_eq!(bits, region.access().bits());
                        }
                        Err(Status::OutOfBounds(n)) => {
                            prop_assert!(!fits && region.access().contains(needed));
                            prop_assert_eq!(n, region.len());
                        }
                        other => prop_assert!(false, "unexpected {:?}", other.map(|r| r.map(|r| r.region().id()))),
                    }
                }
            }
        }
    }

    fn server(max_connections: usize) -> (Server, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        let server = Server::start(
            ServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                max_connections,
                max_connections_per_peer: max_connections,
                max_unauthenticated: 16,
                auth_timeout: Duration::from_secs(5),
                io_threads: 2,
                socket: SocketOptions {
                    buffer: None,
                    keepalive: None,
                },
            },
            Arc::new(RegionTable::default()),
            Arc::new(Shared::default()),
            counters.clone(),
            Arc::new(Credentials::default()),
        )
        .unwrap();
        (server, counters)
    }

    /// Connects and presents `peer`'s credential; the ack, or what the
    /// server sent before closing (nothing) when it refused.
    fn hello(server: &Server, token: [u8; TOKEN_LEN]) -> (std::net::TcpStream, Vec<u8>) {
        use super::super::wire::{CHALLENGE_LEN, HELLO_LEN};
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut c).unwrap();
        let challenge = Challenge::decode(&c).unwrap();
        let h: [u8; HELLO_LEN] = Hello::answer(&challenge, &token).encode();
        s.write_all(&h).unwrap();
        let mut ack = vec![0u8; super::super::wire::HELLO_ACK.len()];
        let n = s.read(&mut ack).unwrap_or(0);
        ack.truncate(n);
        (s, ack)
    }

    #[test]
    fn a_panicking_connection_is_closed_and_frees_its_slot() {
        use std::io::Read;
        let (server, counters) = server(1);
        let (bad, good) = (PeerId(1), PeerId(2));
        let bad_token = server.state.creds.issue(bad);
        let good_token = server.state.creds.issue(good);
        *lock(&server.state.panic_peer) = Some(bad);
        // The hello is accepted, then serving panics: the connection ends.
        let (mut s, _) = hello(&server, bad_token);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        wait_for("the panic to be counted", || {
            counters.connection_panics.load(Ordering::Acquire) >= 1
        });
        wait_for("the slot to be freed", || server.authenticated() == 0);
        // The only slot is free again: another peer is admitted and served.
        let (_s, ack) = hello(&server, good_token);
        assert_eq!(ack, super::super::wire::HELLO_ACK);
        assert_eq!(server.authenticated(), 1);
        // The I/O threads survived the panic.
        let (_s2, refused) = hello(&server, good_token);
        assert!(refused.is_empty(), "past the cap of 1, a hello is refused");
        wait_for("the refusal to be counted", || {
            counters.connections_refused.load(Ordering::Acquire) == 1
        });
    }

    #[test]
    fn a_revoked_credential_is_refused_and_its_connections_closed() {
        use std::io::Read;
        let (server, counters) = server(8);
        let (a, b) = (PeerId(1), PeerId(2));
        let ta = server.state.creds.issue(a);
        let tb = server.state.creds.issue(b);
        let (mut sa, ack) = hello(&server, ta);
        assert_eq!(ack, super::super::wire::HELLO_ACK);
        let (_sb, ack) = hello(&server, tb);
        assert_eq!(ack, super::super::wire::HELLO_ACK);
        server.revoke(a);
        let mut rest = Vec::new();
        let _ = sa.read_to_end(&mut rest);
        assert!(rest.is_empty());
        wait_for("the revoked connection to be counted", || {
            counters.connections_revoked.load(Ordering::Acquire) == 1
        });
        let (_s, refused) = hello(&server, ta);
        assert!(refused.is_empty(), "a revoked credential was accepted");
        // The other peer's connection is untouched.
        assert_eq!(server.authenticated(), 1);
    }

    #[test]
    fn notifications_touch_no_region() {
        let req = Request {
            kind: RequestKind::Notify,
            key: RemoteKey(0),
            tag: 0,
            offset: 0,
            len: 10,
        };
        assert!(matches!(check_request(&table(), &req), Ok(None)));
    }

    #[test]
    fn the_serve_fuzz_entry_survives_requests_of_every_kind() {
        let mut data = vec![0x37u8];
        for (kind, key, offset, len) in [
            (1u8, 1u32, 0u64, 4096u64),
            (2, 1, 4000, 96),
            (2, 3, 0, 20_000),
            (2, 2, 0, 10),
            (1, u32::MAX, 0, 10),
            (3, 0, 0, 5),
        ] {
            let mut h = [0u8; REQUEST_LEN];
            h[0] = kind;
            h[4..8].copy_from_slice(&key.to_le_bytes());
            h[16..24].copy_from_slice(&offset.to_le_bytes());
            h[24..32].copy_from_slice(&len.to_le_bytes());
            data.extend_from_slice(&h);
            if kind != 1 {
                data.extend(std::iter::repeat_n(0xab, len as usize));
            }
        }
        // Then many READs whose answers pile up past the output cap.
        for _ in 0..2000 {
            let mut h = [0u8; REQUEST_LEN];
            h[0] = 1;
            h[4..8].copy_from_slice(&1u32.to_le_bytes());
            h[24..32].copy_from_slice(&4096u64.to_le_bytes());
            data.extend_from_slice(&h);
        }
        data.extend_from_slice(&[0xff; 40]);
        fuzz_serve(&data);
        data[0] = 0;
        fuzz_serve(&data);
    }

    #[test]
    fn fuzz_entry_survives_edge_headers() {
        let mut data = Vec::new();
        for (kind, key, offset, len) in [
            (1u8, 1u32, 4095u64, 1u64),
            (2, 1, 4096, 0),
            (2, 3, 0, 1),
            (1, 2, u64::MAX, 2),
            (3, 0, 0, 5),
            (1, u32::MAX, 0, 65_536),
        ] {
            let mut h = [0u8; REQUEST_LEN];
            h[0] = kind;
            h[4..8].copy_from_slice(&key.to_le_bytes());
            h[16..24].copy_from_slice(&offset.to_le_bytes());
            h[24..32].copy_from_slice(&len.to_le_bytes());
            data.extend_from_slice(&h);
        }
        fuzz_request(&data);
    }
}
