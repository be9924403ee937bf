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

use super::io::{tune_socket, FrameReader, FrameWriter, SocketOptions};
use super::shared::{lock, IdMap, Shared};
use super::wire::{Hello, Request, RequestKind, Response, Status, HELLO_ACK, RESPONSE_LEN};
use super::TcpEndpoint;
use crate::error::DataError;
use crate::ids::{PeerId, RemoteKey, TransferId};
use crate::memory::{Access, Region};
use crate::transfer::{Completion, Op};
use bytes::Bytes;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

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
    /// Held while READ bytes of this transfer are copied into local
    /// memory (one socket read's worth at a time): whoever finishes the
    /// transfer otherwise (deadline, lost peer) takes it first, so once a
    /// failure is reported no late reply lands in the caller's buffer.
    landing: Mutex<()>,
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
            landing: Mutex::new(()),
        }
    }

    /// Marks the transfer finished; true for the one caller that did it.
    pub(crate) fn take_done(&self) -> bool {
        !self.done.swap(true, Ordering::AcqRel)
    }

    /// Marks the transfer finished unless READ bytes are landing right
    /// now (then `None`: try again shortly; the copy in progress is one
    /// socket read's worth of available bytes, it does not wait).
    pub(crate) fn try_take_done_unlanded(&self) -> Option<bool> {
        let _g = match self.landing.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(self.take_done())
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
    Jobs(Vec<Job>),
    Stop,
}

/// A sent request waiting for its response.
struct Pending {
    tag: u64,
    job: Job,
}

#[derive(Default)]
struct Transfers {
    /// Why the connection failed, once it has: later submissions fail
    /// with the same reason and cause.
    dead: Option<(&'static str, Option<Arc<io::Error>>)>,
    map: IdMap<Arc<XferState>>,
}

/// The connection to one peer.
pub(crate) struct PeerConn {
    peer: PeerId,
    addr: SocketAddr,
    shared: Arc<Shared>,
    senders: Vec<Sender<Msg>>,
    sockets: Vec<TcpStream>,
    transfers: Mutex<Transfers>,
    /// Bytes queued so far; picks the stream (see `add_chunk`).
    striped: AtomicU64,
}

pub(crate) struct ConnectConfig {
    pub(crate) streams: usize,
    pub(crate) timeout: Duration,
    pub(crate) socket: SocketOptions,
}

fn io_err(op: String, source: io::Error) -> DataError {
    DataError::Io { op, source }
}

fn open_stream(
    peer: PeerId,
    ep: &TcpEndpoint,
    i: usize,
    cfg: &ConnectConfig,
) -> Result<TcpStream, DataError> {
    let (addr, token) = (ep.addr, &ep.token);
    // A dial that fails names the listen address too when it differs from
    // the dialed one (advertised, or a wildcard filled in with the host the
    // control connection reached), so a wrong `advertise` is easy to tell.
    let what = || {
        if ep.listen == addr {
            format!("connect tcp stream {i} to {peer} at {addr}")
        } else {
            format!(
                "connect tcp stream {i} to {peer} at {addr} (advertised; the target listens on {})",
                ep.listen
            )
        }
    };
    let s = TcpStream::connect_timeout(&addr, cfg.timeout).map_err(|e| io_err(what(), e))?;
    tune_socket(socket2::SockRef::from(&s), cfg.socket);
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
        ep: &TcpEndpoint,
        cfg: &ConnectConfig,
        shared: Arc<Shared>,
    ) -> Result<Arc<Self>, DataError> {
        let addr = ep.addr;
        let mut sockets = Vec::new();
        for i in 0..cfg.streams.max(1) {
            sockets.push(open_stream(peer, ep, i, cfg)?);
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
            striped: AtomicU64::new(0),
        });
        for (i, rx) in receivers.into_iter().enumerate() {
            let pending = Arc::new(Mutex::new(VecDeque::new()));
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                let c = conn.clone();
                thread::Builder::new()
                    .name(name)
                    .spawn(move || {
                        // A panicking I/O thread must not leave transfers
                        // hanging until their deadline.
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                            tracing::error!(peer = %c.peer, addr = %c.addr, "tcp I/O thread panicked");
                            c.fail("an I/O thread of the connection panicked", None);
                        }
                    })
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
        if let Some((reason, source)) = &t.dead {
            return Err(DataError::PeerLost {
                peer: self.peer,
                reason,
                source: source.clone(),
            });
        }
        t.map.insert(x.id, x.clone());
        Ok(())
    }

    /// Number of streams.
    pub(crate) fn streams(&self) -> usize {
        self.senders.len()
    }

    /// Counts one more chunk of `x` and picks its stream. Streams take
    /// turns every `stripe` bytes: a chunk of `stripe` bytes gets a stream
    /// to itself, while a run of small requests stays on one stream (fewer
    /// wake-ups and larger coalesced writes than spreading them thinly).
    pub(crate) fn add_chunk(&self, x: &XferState, len: u64, stripe: u64) -> usize {
        x.remaining.fetch_add(1, Ordering::AcqRel);
        let at = self.striped.fetch_add(len.max(1), Ordering::Relaxed);
        ((at / stripe.max(1)) % self.senders.len() as u64) as usize
    }

    /// Hands chunks (counted by [`add_chunk`](Self::add_chunk)) to stream
    /// `i`'s sender.
    pub(crate) fn send_jobs(&self, i: usize, jobs: Vec<Job>) {
        // A closed channel means the connection failed, which already
        // failed the transfers.
        let _ = self.senders[i].send(Msg::Jobs(jobs));
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
        self.shared.complete(Completion {
            id: x.id,
            peer: x.peer,
            result,
        });
    }

    /// Fails every transfer in flight with `PeerLost` and closes the
    /// streams. Idempotent.
    pub(crate) fn fail(&self, reason: &'static str, source: Option<io::Error>) {
        // The cause always names the target's `host:port`.
        let addr = self.addr;
        let source = Some(Arc::new(match source {
            Some(e) => io::Error::new(e.kind(), format!("{addr}: {e}")),
            None => io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!("connection to {addr} closed locally"),
            ),
        }));
        let lost = {
            let mut t = lock(&self.transfers);
            if t.dead.is_some() {
                return;
            }
            t.dead = Some((reason, source.clone()));
            std::mem::take(&mut t.map)
        };
        let mut completions = lock(&self.shared.completions);
        for x in lost.values() {
            // After a READ's in-progress copy, never during it.
            let landed = lock(&x.landing);
            let first = x.take_done();
            drop(landed);
            if first {
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
            // Abort, do not close gracefully: bytes still queued in the
            // kernel belong to transfers just reported as failed, and must
            // not reach the target later (after a link comes back, say)
            // on top of newer writes. Linger 0 discards them and resets
            // once the last handle of the socket closes; a 1 ms user
            // timeout aborts it at the next retransmission meanwhile.
            let sock = socket2::SockRef::from(s);
            let _ = sock.set_linger(Some(Duration::ZERO));
            #[cfg(target_os = "linux")]
            let _ = sock.set_tcp_user_timeout(Some(Duration::from_millis(1)));
            let _ = s.shutdown(Shutdown::Both);
        }
        for tx in &self.senders {
            let _ = tx.send(Msg::Stop);
        }
    }

    fn is_dead(&self) -> bool {
        lock(&self.transfers).dead.is_some()
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

    /// The error for a refused request; `None` when it succeeded.
    fn refusal(&self, job: &Job, status: Status) -> Option<DataError> {
        let (peer, key) = (self.peer, job.key);
        Some(match status {
            Status::Ok => return None,
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
                let needed = op.remote_access();
                DataError::AccessDenied {
                    op,
                    target: format!("remote {key} at {peer} ({})", self.addr),
                    needed,
                    granted: access_from_bits(bits),
                }
            }
        })
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

struct Outbox<'a> {
    w: FrameWriter<'a>,
    staged: Vec<Pending>,
    pending: &'a Mutex<VecDeque<Pending>>,
}

impl Outbox<'_> {
    /// Publishes staged requests to the receiver, then writes what was
    /// gathered (the order matters: a response may arrive at once).
    fn flush(&mut self) -> io::Result<()> {
        if !self.staged.is_empty() {
            lock(self.pending).extend(self.staged.drain(..));
        }
        self.w.flush()
    }
}

fn send_loop(conn: &PeerConn, i: usize, rx: &Receiver<Msg>, pending: &Mutex<VecDeque<Pending>>) {
    let span = tracing::debug_span!("tcp-tx", peer = %conn.peer, stream = i);
    let _g = span.enter();
    let mut out = Outbox {
        w: FrameWriter::new(&conn.sockets[i]),
        staged: Vec::new(),
        pending,
    };
    let mut tag = 0u64;
    while let Ok(mut msg) = rx.recv() {
        loop {
            let r = match msg {
                Msg::Stop => return,
                Msg::Job(job) => handle(conn, &mut out, &mut tag, job),
                Msg::Jobs(jobs) => jobs
                    .into_iter()
                    .try_for_each(|job| handle(conn, &mut out, &mut tag, job)),
            };
            if let Err(e) = r {
                return conn.lost(i, e);
            }
            match rx.try_recv() {
                Ok(m) => msg = m,
                Err(_) => break,
            }
        }
        if let Err(e) = out.flush() {
            return conn.lost(i, e);
        }
    }
}

/// Stages one job, writing out the buffer when it is full.
fn handle(conn: &PeerConn, out: &mut Outbox<'_>, tag: &mut u64, job: Job) -> io::Result<()> {
    if job.xfer.is_done() {
        // Timed out or failed: nothing left to send for it.
        conn.release(&job.xfer, job.kind == RequestKind::Notify);
        return Ok(());
    }
    *tag = tag.wrapping_add(1);
    stage(out, *tag, job)?;
    if out.w.is_full() {
        out.flush()?;
    }
    Ok(())
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
    out.w.put(&header);
    match job.kind {
        RequestKind::Read => out.staged.push(Pending { tag, job }),
        RequestKind::Notify => {
            if let Some(n) = &job.xfer.notify {
                out.w.put(n);
            }
            out.staged.push(Pending { tag, job });
        }
        RequestKind::Write => {
            let Some(region) = &job.local else {
                return Err(io::Error::other("WRITE without local memory"));
            };
            out.w.region(region, job.local_offset, job.len)?;
            out.staged.push(Pending { tag, job });
        }
    }
    Ok(())
}

fn receive_loop(conn: &PeerConn, i: usize, pending: &Mutex<VecDeque<Pending>>) {
    let span = tracing::debug_span!("tcp-rx", peer = %conn.peer, stream = i);
    let _g = span.enter();
    let mut rd = FrameReader::new(&conn.sockets[i]);
    let protocol = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    loop {
        let mut h = [0u8; RESPONSE_LEN];
        if let Err(e) = rd.header(&mut h) {
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
        if let Some(e) = conn.refusal(&job, resp.status) {
            lock(&job.xfer.error).get_or_insert(e);
        } else if job.kind == RequestKind::Read {
            if let Err(e) = land(&mut rd, &job) {
                return conn.lost(i, e);
            }
        }
        conn.release(&job.xfer, job.kind == RequestKind::Notify);
    }
}

/// Reads a READ's payload into local memory, one socket read at a time,
/// each under the transfer's landing lock and only while the transfer is
/// not finished: the payload of a READ that already timed out (or failed)
/// is read and discarded, never written.
fn land(rd: &mut FrameReader<'_>, job: &Job) -> io::Result<()> {
    let Some(region) = &job.local else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "READ without local memory",
        ));
    };
    let total = job.len;
    region
        .check_range(job.local_offset, total)
        .map_err(io::Error::other)?;
    if region.device().is_some() {
        // GPU memory: the answer is read into a buffer, then staged onto
        // the device under the landing lock (never after the transfer
        // ended).
        let mut buf = vec![0u8; total as usize];
        rd.payload(&mut buf)?;
        let _landing = lock(&job.xfer.landing);
        if job.xfer.is_done() {
            return Ok(());
        }
        return region
            .copy_in(job.local_offset, &buf)
            .map_err(io::Error::other);
    }
    let mut done = 0u64;
    while done < total {
        // Wait for bytes without the lock, so a finisher never waits on
        // the network.
        rd.wait_readable()?;
        let landing = lock(&job.xfer.landing);
        if job.xfer.is_done() {
            drop(landing);
            return rd.skip(total - done);
        }
        let n = rd.payload_part_into(region, job.local_offset + done, total - done, total)?;
        drop(landing);
        done += n as u64;
    }
    Ok(())
}
