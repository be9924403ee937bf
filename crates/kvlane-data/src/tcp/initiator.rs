//! Initiator side: one [`PeerConn`] per connected peer, with several TCP
//! streams, each driven by a sender thread (requests and WRITE payloads,
//! coalesced) and a receiver thread (responses and READ payloads, straight
//! into region memory).
//!
//! A transfer is split into chunks striped over the streams. Its
//! [`XferState`] counts outstanding chunks; when the last one is answered
//! the notification (if any) is sent, so the target sees it only after
//! every byte has landed on every stream, and the transfer completes when
//! the notification is acknowledged.

use super::wire::{
    Hello, Request, RequestKind, Response, Status, HELLO_ACK, RESPONSE_LEN, TOKEN_LEN,
};
use super::{lock, Shared, SOCKET_IO_BUF};
use crate::error::DataError;
use crate::ids::{PeerId, RemoteKey, TransferId};
use crate::memory::{Access, Region};
use crate::transfer::{Completion, Op};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Requests and small payloads are gathered into one buffer of up to this
/// many bytes per `write` syscall.
const COALESCE: usize = 256 << 10;
/// WRITE payloads up to this size are copied into the coalescing buffer;
/// larger ones go from region memory to the socket directly.
const INLINE_MAX: u64 = 16 << 10;

/// Progress of one submitted transfer, shared by the streams.
pub(crate) struct XferState {
    pub(crate) id: TransferId,
    pub(crate) peer: PeerId,
    pub(crate) deadline: Instant,
    /// Chunks not yet answered, plus one while the transfer is being
    /// submitted (so it cannot finish half-submitted).
    remaining: AtomicUsize,
    error: Mutex<Option<DataError>>,
    notify: Option<Bytes>,
    done: AtomicBool,
}

impl XferState {
    pub(crate) fn new(
        id: TransferId,
        peer: PeerId,
        deadline: Instant,
        notify: Option<Bytes>,
    ) -> Self {
        Self {
            id,
            peer,
            deadline,
            remaining: AtomicUsize::new(1),
            error: Mutex::new(None),
            notify,
            done: AtomicBool::new(false),
        }
    }

    /// Marks the transfer finished; true for the one caller that did it.
    pub(crate) fn take_done(&self) -> bool {
        !self.done.swap(true, Ordering::AcqRel)
    }

    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// One request to send.
pub(crate) struct Job {
    pub(crate) kind: RequestKind,
    pub(crate) key: RemoteKey,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    /// Local memory (WRITE source, READ destination).
    pub(crate) local: Option<Region>,
    pub(crate) local_offset: u64,
    pub(crate) xfer: Arc<XferState>,
}

enum Msg {
    Job(Job),
    Stop,
}

/// A sent request waiting for its response.
struct Pending {
    tag: u64,
    job: Job,
}

#[derive(Default)]
struct Transfers {
    dead: bool,
    map: HashMap<TransferId, Arc<XferState>>,
}

/// The connection to one peer.
pub(crate) struct PeerConn {
    peer: PeerId,
    addr: SocketAddr,
    shared: Arc<Shared>,
    senders: Vec<Sender<Msg>>,
    sockets: Vec<TcpStream>,
    transfers: Mutex<Transfers>,
    rr: AtomicUsize,
}

pub(crate) struct ConnectConfig {
    pub(crate) streams: usize,
    pub(crate) timeout: Duration,
    pub(crate) socket_buffer: Option<usize>,
}

fn io_err(op: String, source: io::Error) -> DataError {
    DataError::Io { op, source }
}

fn open_stream(
    peer: PeerId,
    addr: SocketAddr,
    token: &[u8; TOKEN_LEN],
    i: usize,
    cfg: &ConnectConfig,
) -> Result<TcpStream, DataError> {
    let what = || format!("connect tcp stream {i} to {peer} at {addr}");
    let s = TcpStream::connect_timeout(&addr, cfg.timeout).map_err(|e| io_err(what(), e))?;
    super::server::tune_socket(&s, cfg.socket_buffer);
    let mut ack = [0u8; HELLO_ACK.len()];
    s.set_read_timeout(Some(cfg.timeout))
        .and_then(|()| (&s).write_all(&Hello { token: *token }.encode()))
        .and_then(|()| (&s).read_exact(&mut ack))
        .and_then(|()| s.set_read_timeout(None))
        .map_err(|e| io_err(format!("{} (authentication)", what()), e))?;
    if ack != HELLO_ACK {
        return Err(io_err(
            what(),
            io::Error::new(io::ErrorKind::InvalidData, "unexpected hello answer"),
        ));
    }
    Ok(s)
}

impl PeerConn {
    /// Opens `cfg.streams` authenticated connections and starts their
    /// threads. Blocks up to `cfg.timeout` per stream.
    pub(crate) fn connect(
        peer: PeerId,
        addr: SocketAddr,
        token: &[u8; TOKEN_LEN],
        cfg: &ConnectConfig,
        shared: Arc<Shared>,
    ) -> Result<Arc<Self>, DataError> {
        let mut sockets = Vec::new();
        for i in 0..cfg.streams.max(1) {
            sockets.push(open_stream(peer, addr, token, i, cfg)?);
        }
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for _ in &sockets {
            let (tx, rx) = mpsc::channel();
            senders.push(tx);
            receivers.push(rx);
        }
        let conn = Arc::new(Self {
            peer,
            addr,
            shared,
            senders,
            sockets,
            transfers: Mutex::new(Transfers::default()),
            rr: AtomicUsize::new(0),
        });
        for (i, rx) in receivers.into_iter().enumerate() {
            let pending = Arc::new(Mutex::new(VecDeque::new()));
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                thread::Builder::new()
                    .name(name)
                    .spawn(f)
                    .map_err(|e| io_err(format!("spawn a tcp stream thread for {peer}"), e))
            };
            let (c, p) = (conn.clone(), pending.clone());
            let started = spawn(
                format!("kvlane-tcp-tx-{}-{i}", peer.0),
                Box::new(move || send_loop(&c, i, &rx, &p)),
            )
            .and_then(|_| {
                let c = conn.clone();
                spawn(
                    format!("kvlane-tcp-rx-{}-{i}", peer.0),
                    Box::new(move || receive_loop(&c, i, &pending)),
                )
            });
            if let Err(e) = started {
                conn.fail("could not start stream threads", None);
                return Err(e);
            }
        }
        Ok(conn)
    }

    /// The target's `host:port`.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Registers a transfer; fails when the connection is dead.
    pub(crate) fn start(&self, x: &Arc<XferState>) -> Result<(), DataError> {
        let mut t = lock(&self.transfers);
        if t.dead {
            return Err(DataError::PeerLost {
                peer: self.peer,
                reason: "the connection to the peer is down",
                source: None,
            });
        }
        t.map.insert(x.id, x.clone());
        Ok(())
    }

    /// Queues one chunk of a started transfer on the next stream.
    pub(crate) fn send_chunk(&self, job: Job) {
        job.xfer.remaining.fetch_add(1, Ordering::AcqRel);
        let i = self.rr.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        // A closed channel means the connection failed, which already
        // failed the transfer.
        let _ = self.senders[i].send(Msg::Job(job));
    }

    /// Forgets a transfer that finished elsewhere (deadline).
    pub(crate) fn forget(&self, id: TransferId) {
        lock(&self.transfers).map.remove(&id);
    }

    /// One outstanding unit of `x` is done (a chunk, the notification, or
    /// the submission itself).
    pub(crate) fn release(&self, x: &Arc<XferState>, was_notify: bool) {
        if x.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if let Some(e) = lock(&x.error).take() {
            return self.finish(x, Err(e));
        }
        if !was_notify && x.notify.is_some() && !x.is_done() {
            // Every chunk was acknowledged: now the notification.
            x.remaining.store(1, Ordering::Release);
            let _ = self.senders[0].send(Msg::Job(Job {
                kind: RequestKind::Notify,
                key: RemoteKey(0),
                remote_offset: 0,
                len: x.notify.as_ref().map_or(0, |n| n.len() as u64),
                local: None,
                local_offset: 0,
                xfer: x.clone(),
            }));
            return;
        }
        self.finish(x, Ok(()));
    }

    fn finish(&self, x: &XferState, result: Result<(), DataError>) {
        if !x.take_done() {
            return;
        }
        lock(&self.transfers).map.remove(&x.id);
        lock(&self.shared.completions).push(Completion {
            id: x.id,
            peer: x.peer,
            result,
        });
        self.shared.wake();
    }

    /// Fails every transfer in flight with `PeerLost` and closes the
    /// streams. Idempotent.
    pub(crate) fn fail(&self, reason: &'static str, source: Option<io::Error>) {
        let lost = {
            let mut t = lock(&self.transfers);
            if t.dead {
                return;
            }
            t.dead = true;
            std::mem::take(&mut t.map)
        };
        let source =
            source.map(|e| Arc::new(io::Error::new(e.kind(), format!("{}: {e}", self.addr))));
        let mut completions = lock(&self.shared.completions);
        for x in lost.values() {
            if x.take_done() {
                completions.push(Completion {
                    id: x.id,
                    peer: self.peer,
                    result: Err(DataError::PeerLost {
                        peer: self.peer,
                        reason,
                        source: source.clone(),
                    }),
                });
            }
        }
        drop(completions);
        self.shared.wake();
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
        for tx in &self.senders {
            let _ = tx.send(Msg::Stop);
        }
    }

    fn is_dead(&self) -> bool {
        lock(&self.transfers).dead
    }

    /// A stream broke: log it (unless we closed it) and fail the peer.
    fn lost(&self, stream: usize, e: io::Error) {
        if self.is_dead() {
            return;
        }
        let reason = match e.kind() {
            io::ErrorKind::UnexpectedEof => "the target closed the connection",
            io::ErrorKind::InvalidData => "the target broke the protocol",
            _ => "the connection to the target failed",
        };
        tracing::warn!(peer = %self.peer, addr = %self.addr, stream, error = %e, "{reason}");
        self.fail(reason, Some(e));
    }

    fn refusal(&self, job: &Job, status: Status) -> DataError {
        let (peer, key) = (self.peer, job.key);
        match status {
            Status::Ok => unreachable_ok(),
            Status::UnknownKey => DataError::UnknownKey { peer, key },
            Status::OutOfBounds(region_len) => DataError::RemoteOutOfBounds {
                peer,
                key,
                offset: job.remote_offset,
                len: job.len,
                region_len,
            },
            Status::AccessDenied(bits) => {
                let op = if job.kind == RequestKind::Read {
                    Op::Read
                } else {
                    Op::Write
                };
                DataError::AccessDenied {
                    op,
                    target: format!("remote {key} at {peer} ({})", self.addr),
                    needed: match op {
                        Op::Read => Access::REMOTE_READ,
                        Op::Write => Access::REMOTE_WRITE,
                    },
                    granted: access_from_bits(bits),
                }
            }
        }
    }
}

fn unreachable_ok() -> DataError {
    DataError::Unsupported {
        backend: "tcp",
        what: "a successful response is not a refusal",
    }
}

/// Rebuilds an [`Access`] from wire bits (unknown bits are ignored).
pub(crate) fn access_from_bits(bits: u8) -> Access {
    [
        Access::LOCAL_WRITE,
        Access::REMOTE_READ,
        Access::REMOTE_WRITE,
    ]
    .into_iter()
    .filter(|f| bits & f.bits() != 0)
    .fold(Access::NONE, |a, f| a | f)
}

/// Writes `a` then `b` with vectored writes (one syscall when possible).
fn write_two(w: &mut &TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() {
        let n = w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if n >= a.len() {
            b = &b[n - a.len()..];
            a = &[];
        } else {
            a = &a[n..];
        }
    }
    w.write_all(b)
}

struct Outbox<'a> {
    stream: &'a TcpStream,
    buf: Vec<u8>,
    staged: Vec<Pending>,
    pending: &'a Mutex<VecDeque<Pending>>,
}

impl Outbox<'_> {
    /// Publishes staged requests to the receiver, then writes `buf` and
    /// `tail` (the order matters: a response may arrive at once).
    fn flush(&mut self, tail: &[u8]) -> io::Result<()> {
        if !self.staged.is_empty() {
            lock(self.pending).extend(self.staged.drain(..));
        }
        let r = write_two(&mut &*self.stream, &self.buf, tail);
        self.buf.clear();
        r
    }
}

fn send_loop(conn: &PeerConn, i: usize, rx: &Receiver<Msg>, pending: &Mutex<VecDeque<Pending>>) {
    let span = tracing::debug_span!("tcp-tx", peer = %conn.peer, stream = i);
    let _g = span.enter();
    let mut out = Outbox {
        stream: &conn.sockets[i],
        buf: Vec::with_capacity(COALESCE + 64),
        staged: Vec::new(),
        pending,
    };
    let mut tag = 0u64;
    while let Ok(mut msg) = rx.recv() {
        loop {
            let Msg::Job(job) = msg else { return };
            if job.xfer.is_done() {
                // Timed out or failed: nothing left to send for it.
                conn.release(&job.xfer, job.kind == RequestKind::Notify);
            } else {
                tag = tag.wrapping_add(1);
                if let Err(e) = stage(&mut out, tag, job) {
                    return conn.lost(i, e);
                }
            }
            if out.buf.len() >= COALESCE {
                if let Err(e) = out.flush(&[]) {
                    return conn.lost(i, e);
                }
            }
            match rx.try_recv() {
                Ok(m) => msg = m,
                Err(_) => break,
            }
        }
        if let Err(e) = out.flush(&[]) {
            return conn.lost(i, e);
        }
    }
}

/// Adds one request (and its payload) to the outbox.
fn stage(out: &mut Outbox<'_>, tag: u64, job: Job) -> io::Result<()> {
    let header = Request {
        kind: job.kind,
        key: job.key,
        tag,
        offset: job.remote_offset,
        len: job.len,
    }
    .encode();
    out.buf.extend_from_slice(&header);
    match job.kind {
        RequestKind::Read => out.staged.push(Pending { tag, job }),
        RequestKind::Notify => {
            if let Some(n) = &job.xfer.notify {
                out.buf.extend_from_slice(n);
            }
            out.staged.push(Pending { tag, job });
        }
        RequestKind::Write => {
            let Some(region) = job.local.clone() else {
                return Err(io::Error::other("WRITE without local memory"));
            };
            let (off, len) = (job.local_offset, job.len);
            out.staged.push(Pending { tag, job });
            let r = if len <= INLINE_MAX {
                region.with_slice(off, len, |s| {
                    out.buf.extend_from_slice(s);
                    Ok(())
                })
            } else {
                region.with_slice(off, len, |s| out.flush(s))
            };
            r.map_err(|e| io::Error::other(e.to_string()))??;
        }
    }
    Ok(())
}

fn receive_loop(conn: &PeerConn, i: usize, pending: &Mutex<VecDeque<Pending>>) {
    let span = tracing::debug_span!("tcp-rx", peer = %conn.peer, stream = i);
    let _g = span.enter();
    let mut rd = BufReader::with_capacity(SOCKET_IO_BUF, &conn.sockets[i]);
    let protocol = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    loop {
        let mut h = [0u8; RESPONSE_LEN];
        if let Err(e) = rd.read_exact(&mut h) {
            return conn.lost(i, e);
        }
        let resp = match Response::decode(&h) {
            Ok(r) => r,
            Err(e) => return conn.lost(i, protocol(&e.to_string())),
        };
        let Some(p) = lock(pending).pop_front() else {
            return conn.lost(i, protocol("response without a request"));
        };
        if p.tag != resp.tag {
            return conn.lost(i, protocol("response out of order"));
        }
        let job = p.job;
        if resp.status == Status::Ok {
            if job.kind == RequestKind::Read {
                let Some(region) = &job.local else {
                    return conn.lost(i, protocol("READ without local memory"));
                };
                let r = region
                    .with_slice_mut(job.local_offset, job.len, |s| rd.read_exact(s))
                    .map_err(|e| io::Error::other(e.to_string()))
                    .and_then(|r| r);
                if let Err(e) = r {
                    return conn.lost(i, e);
                }
            }
        } else {
            let e = conn.refusal(&job, resp.status);
            lock(&job.xfer.error).get_or_insert(e);
        }
        conn.release(&job.xfer, job.kind == RequestKind::Notify);
    }
}
