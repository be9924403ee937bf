//! Target side: serves READ, WRITE and NOTIFY requests on the regions
//! registered with the backend.
//!
//! One listener thread accepts connections; each connection gets a thread
//! with blocking I/O (a connection is one ordered request stream, so a
//! thread per connection needs no locking on the hot path and lets the
//! kernel move bytes straight between the socket and region memory).
//! Every request passes [`check_request`] before memory is touched.

use super::io::{tune_socket, FrameReader, FrameWriter, SocketOptions};
use super::wire::{
    FrameError, Hello, Request, RequestKind, Response, Status, HELLO_ACK, HELLO_LEN, REQUEST_LEN,
    TOKEN_LEN,
};
use super::{lock, Shared};
use crate::error::DataError;
use crate::ids::{PeerId, RemoteKey};
use crate::loopback::check_remote;
use crate::memory::Region;
use bytes::Bytes;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Answers are flushed at the latest once they acknowledge this many
/// payload bytes, even while more requests are waiting.
const ACK_BATCH: u64 = 1 << 20;

/// How long a new connection may take to present its token.
const AUTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Regions served, by key.
pub(crate) type RegionTable = RwLock<HashMap<RemoteKey, Region>>;

/// Counters of the target side, for monitoring and tests
/// (see [`TcpBackend::counters`](super::TcpBackend::counters)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpCounters {
    /// Connections accepted by the listener.
    pub connections_accepted: u64,
    /// Connections refused because the connection cap was reached.
    pub connections_refused: u64,
    /// Connections dropped because their hello or token was wrong.
    pub auth_failures: u64,
    /// Connections closed because a header did not decode.
    pub framing_errors: u64,
    /// Requests refused: no region under the key.
    pub refused_unknown_key: u64,
    /// Requests refused: range outside the region.
    pub refused_out_of_bounds: u64,
    /// Requests refused: the region lacks the remote right.
    pub refused_access: u64,
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
}

#[derive(Default)]
pub(crate) struct Counters {
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    auth_failures: AtomicU64,
    framing_errors: AtomicU64,
    refused_unknown_key: AtomicU64,
    refused_out_of_bounds: AtomicU64,
    refused_access: AtomicU64,
    reads_served: AtomicU64,
    writes_served: AtomicU64,
    notifications: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> TcpCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TcpCounters {
            connections_accepted: g(&self.connections_accepted),
            connections_refused: g(&self.connections_refused),
            auth_failures: g(&self.auth_failures),
            framing_errors: g(&self.framing_errors),
            refused_unknown_key: g(&self.refused_unknown_key),
            refused_out_of_bounds: g(&self.refused_out_of_bounds),
            refused_access: g(&self.refused_access),
            reads_served: g(&self.reads_served),
            writes_served: g(&self.writes_served),
            notifications: g(&self.notifications),
            bytes_read: g(&self.bytes_read),
            bytes_written: g(&self.bytes_written),
        }
    }

    fn refused(&self, status: Status) {
        match status {
            Status::Ok => {}
            Status::UnknownKey => bump(&self.refused_unknown_key, 1),
            Status::OutOfBounds(_) => bump(&self.refused_out_of_bounds, 1),
            Status::AccessDenied(_) => bump(&self.refused_access, 1),
        }
    }
}

/// The target's checks for one request: key known, right present, range
/// inside the region (overflow-safe). `Ok(None)` for notifications, which
/// touch no region. Nothing is read or written before this returns `Ok`.
pub(crate) fn check_request(
    regions: &HashMap<RemoteKey, Region>,
    req: &Request,
) -> Result<Option<Region>, Status> {
    let Some(op) = req.kind.op() else {
        return Ok(None);
    };
    let region = regions.get(&req.key).ok_or(Status::UnknownKey)?;
    // The peer id only names the peer in the error, which the target does
    // not report; the status carries what the initiator needs.
    match check_remote(PeerId(0), req.key, region, op, req.offset, req.len) {
        Ok(()) => Ok(Some(region.clone())),
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
    static TABLE: OnceLock<HashMap<RemoteKey, Region>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = HashMap::new();
        for (key, len, access) in [
            (1, 4096, Access::ALL),
            (2, 100, Access::REMOTE_READ),
            (3, 1, Access::REMOTE_WRITE),
            (u32::MAX, 65_536, Access::NONE),
        ] {
            if let Ok(region) = Region::alloc(len, access) {
                t.insert(RemoteKey(key), region);
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
            Ok(Some(region)) => {
                let end = req.offset.checked_add(req.len);
                assert!(end.is_some_and(|e| e <= region.len()), "{req:?} accepted");
                let needed = match req.kind {
                    RequestKind::Read => Access::REMOTE_READ,
                    _ => Access::REMOTE_WRITE,
                };
                assert!(region.access().contains(needed), "{req:?} accepted");
                // Touch exactly what the server would.
                assert!(region.check_range(req.offset, req.len).is_ok(), "{req:?}");
            }
            Ok(None) => assert_eq!(req.kind, RequestKind::Notify),
            Err(status) => assert_ne!(status, Status::Ok),
        }
    }
}

pub(crate) struct ServerConfig {
    pub(crate) listen: SocketAddr,
    pub(crate) token: [u8; TOKEN_LEN],
    pub(crate) max_connections: usize,
    pub(crate) socket: SocketOptions,
}

struct ServerState {
    regions: Arc<RegionTable>,
    shared: Arc<Shared>,
    counters: Arc<Counters>,
    token: [u8; TOKEN_LEN],
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    max_connections: usize,
    socket: SocketOptions,
}

/// The listener and its connections; shut down on drop.
pub(crate) struct Server {
    state: Arc<ServerState>,
    addr: SocketAddr,
    listener: Option<JoinHandle<()>>,
}

impl Server {
    pub(crate) fn start(
        config: ServerConfig,
        regions: Arc<RegionTable>,
        shared: Arc<Shared>,
        counters: Arc<Counters>,
    ) -> Result<Self, DataError> {
        let listener = TcpListener::bind(config.listen).map_err(|source| DataError::Io {
            op: format!("bind tcp listener {}", config.listen),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| DataError::Io {
            op: format!("local address of tcp listener {}", config.listen),
            source,
        })?;
        let state = Arc::new(ServerState {
            regions,
            shared,
            counters,
            token: config.token,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            max_connections: config.max_connections,
            socket: config.socket,
        });
        let thread_state = state.clone();
        let handle = thread::Builder::new()
            .name(format!("kvlane-tcp-listen-{}", addr.port()))
            .spawn(move || accept_loop(&listener, &thread_state))
            .map_err(|source| DataError::Io {
                op: format!("spawn tcp listener thread for {addr}"),
                source,
            })?;
        Ok(Self {
            state,
            addr,
            listener: Some(handle),
        })
    }

    /// The address the listener is bound to (with the real port).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let woken = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(h) = self.listener.take() {
            match woken {
                Ok(_) => {
                    if h.join().is_err() {
                        tracing::error!(addr = %self.addr, "tcp listener thread panicked");
                    }
                }
                // Joining could block forever: leave the thread parked in
                // `accept`; it exits at the next connection.
                Err(e) => {
                    tracing::warn!(addr = %self.addr, error = %e, "could not wake the tcp listener")
                }
            }
        }
        for (_, s) in lock(&self.state.conns).drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &TcpListener, state: &Arc<ServerState>) {
    let mut next_id = 0u64;
    loop {
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                if state.stop.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!(error = %e, "tcp accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if state.stop.load(Ordering::Acquire) {
            return;
        }
        let clone = stream.try_clone();
        let mut conns = lock(&state.conns);
        if conns.len() >= state.max_connections {
            bump(&state.counters.connections_refused, 1);
            tracing::warn!(%from, cap = state.max_connections, "tcp connection cap reached");
            continue;
        }
        let Ok(clone) = clone else { continue };
        next_id += 1;
        let id = next_id;
        conns.insert(id, clone);
        drop(conns);
        bump(&state.counters.connections_accepted, 1);
        let conn_state = state.clone();
        let spawned = thread::Builder::new()
            .name(format!("kvlane-tcp-serve-{id}"))
            .spawn(move || {
                let span = tracing::debug_span!("tcp-serve", %from, id);
                let _g = span.enter();
                match serve(stream, &conn_state) {
                    Ok(()) => tracing::debug!("connection closed by peer"),
                    Err(End::Auth) => {
                        bump(&conn_state.counters.auth_failures, 1);
                        tracing::warn!(%from, "unauthenticated tcp connection dropped");
                    }
                    Err(End::Frame(e)) => {
                        bump(&conn_state.counters.framing_errors, 1);
                        tracing::warn!(%from, error = %e, "framing error; connection closed");
                    }
                    Err(End::Io(e)) => tracing::debug!(%from, error = %e, "connection ended"),
                }
                if let Some(s) = lock(&conn_state.conns).remove(&id) {
                    let _ = s.shutdown(Shutdown::Both);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not spawn a tcp connection thread");
            if let Some(s) = lock(&state.conns).remove(&id) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

enum End {
    Auth,
    Frame(FrameError),
    Io(io::Error),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn serve(stream: TcpStream, state: &ServerState) -> Result<(), End> {
    tune_socket(&stream, state.socket);
    // Authenticate before reading any request.
    stream.set_read_timeout(Some(AUTH_TIMEOUT))?;
    let mut hello = [0u8; HELLO_LEN];
    if (&stream).read_exact(&mut hello).is_err() || !Hello::verify(&hello, &state.token) {
        return Err(End::Auth);
    }
    stream.set_read_timeout(None)?;
    (&stream).write_all(&HELLO_ACK)?;
    let mut rd = FrameReader::new(&stream);
    let mut wr = FrameWriter::new(&stream);
    let c = &state.counters;
    // Payload bytes answered but not yet flushed.
    let mut unflushed = 0u64;
    loop {
        // Answers go out in batches: flush before we would block, or once
        // a batch acknowledges `ACK_BATCH` bytes (so acks keep flowing
        // while the initiator streams without pause).
        if wr.buffered() > 0 && (unflushed >= ACK_BATCH || rd.would_block()) {
            wr.flush()?;
            unflushed = 0;
        }
        let mut h = [0u8; REQUEST_LEN];
        match rd.header(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                // Half-closed: the initiator may still read its answers.
                let _ = wr.flush();
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        let req = Request::decode(&h).map_err(End::Frame)?;
        // After decoding: a peer's raw length field never reaches arithmetic.
        unflushed = unflushed.saturating_add(req.len);
        let checked = {
            let regions = state.regions.read().unwrap_or_else(|e| e.into_inner());
            check_request(&regions, &req)
        };
        let status = match checked {
            Ok(Some(region)) if req.kind == RequestKind::Write => {
                if region.device().is_some() {
                    // GPU memory: staged; returns once the bytes are on the device.
                    region
                        .write_chunks(req.offset, req.len, |s| rd.payload(s))
                        .map_err(|e| io::Error::other(e.to_string()))??;
                } else {
                    rd.payload_into(&region, req.offset, req.len)?;
                }
                bump(&c.writes_served, 1);
                bump(&c.bytes_written, req.len);
                Status::Ok
            }
            Ok(Some(region)) => {
                wr.put(&Response::ok(req.tag).encode());
                wr.region(&region, req.offset, req.len)?;
                bump(&c.reads_served, 1);
                bump(&c.bytes_read, req.len);
                if wr.is_full() {
                    wr.flush()?;
                    unflushed = 0;
                }
                continue;
            }
            Ok(None) => {
                // `len <= MAX_NOTIFY` (checked by decode).
                let mut payload = vec![0u8; req.len as usize];
                rd.payload(&mut payload)?;
                state.shared.notify(Bytes::from(payload));
                bump(&c.notifications, 1);
                Status::Ok
            }
            Err(status) => {
                c.refused(status);
                // Skip a refused WRITE's payload; it never reaches memory.
                rd.skip(req.payload_len())?;
                status
            }
        };
        wr.put(
            &Response {
                status,
                tag: req.tag,
            }
            .encode(),
        );
        if wr.is_full() {
            wr.flush()?;
            unflushed = 0;
        }
    }
}

impl Response {
    fn ok(tag: u64) -> Self {
        Self {
            status: Status::Ok,
            tag,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Access;
    use proptest::prelude::*;

    fn table() -> HashMap<RemoteKey, Region> {
        let mut t = HashMap::new();
        t.insert(RemoteKey(1), Region::alloc(4096, Access::ALL).unwrap());
        t.insert(
            RemoteKey(2),
            Region::alloc(100, Access::REMOTE_READ).unwrap(),
        );
        t.insert(
            RemoteKey(3),
            Region::alloc(10, Access::REMOTE_WRITE).unwrap(),
        );
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
                Some(region) => {
                    let needed = if write { Access::REMOTE_WRITE } else { Access::REMOTE_READ };
                    let fits = offset.checked_add(len).is_some_and(|e| e <= region.len());
                    match r {
                        Ok(Some(got)) => {
                            prop_assert!(fits && region.access().contains(needed));
                            prop_assert_eq!(got.id(), region.id());
                        }
                        Err(Status::AccessDenied(bits)) => {
                            prop_assert!(!region.access().contains(needed));
                            prop_assert_eq!(bits, region.access().bits());
                        }
                        Err(Status::OutOfBounds(n)) => {
                            prop_assert!(!fits && region.access().contains(needed));
                            prop_assert_eq!(n, region.len());
                        }
                        other => prop_assert!(false, "unexpected {:?}", other.map(|r| r.map(|r| r.id()))),
                    }
                }
            }
        }
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
