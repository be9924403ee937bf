//! Initiator side: one [`PeerConn`] per connected peer, with several TCP
//! streams. Connecting and authenticating a stream blocks (inside
//! [`Connecting::run`](crate::Connecting), off the backend lock); then its
//! socket turns non-blocking and goes to an I/O thread of the backend's
//! [pool](super::pool), which drives it as a [`Stream`](super::stream::Stream)
//! state machine: requests and WRITE payloads out (coalesced), responses
//! and READ payloads in (straight into region memory).
//!
//! The stream's state machine sits behind a lock in the connection. A
//! lone small transfer (its stream idle: nothing in flight, nothing
//! unwritten) is written by the thread that submits it, without waking the
//! I/O thread; bursts and large payloads go through the I/O thread, which
//! writes what queued up in one go ([`PeerConn::send_jobs`]). Answers are
//! always read by the I/O thread.
//!
//! A transfer is split into chunks striped over the streams. Its
//! [`XferState`] counts outstanding chunks; when the last one is answered
//! the notification (if any) is sent, so the target sees it only after
//! every byte has landed on every stream, and the transfer completes when
//! the notification is acknowledged.

use super::io::{tune_socket, SocketOptions};
use super::pool::{Inbox, PoolShared, StreamLease};
use super::serve::Drove;
use super::shared::{lock, IdMap, Shared};
use super::stream::Stream;
use super::wire::{self, RequestKind, Status};
use super::TcpEndpoint;
use crate::error::DataError;
use crate::ids::{PeerId, RemoteKey, TransferId};
use crate::memory::{Access, Region};
use crate::transfer::{Completion, Op};
use bytes::Bytes;
use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// Most WRITE payload a submitter writes to an idle stream itself (see
/// [`PeerConn::send_direct`]); more goes through the I/O thread. Measured
/// (128-transfer batches, loopback): 1 MiB WRITEs posted 4.3 µs a
/// transfer through the I/O thread and 20 µs writing directly, at 0.92x
/// the throughput; 64 KiB ones 1.2 against 2.4 µs.
const DIRECT_PAYLOAD: u64 = 16 << 10;

/// Progress of one submitted transfer, shared by the streams.
pub(crate) struct XferState {
    pub(crate) id: TransferId,
    pub(crate) peer: PeerId,
    pub(crate) deadline: Instant,
    /// Chunks not yet answered, plus one while the transfer is being
    /// submitted (so it cannot finish half-submitted).
    remaining: AtomicUsize,
    pub(crate) error: Mutex<Option<DataError>>,
    pub(crate) notify: Option<Bytes>,
    done: AtomicBool,
    /// Held while READ bytes of this transfer are copied into local
    /// memory (one socket read's worth at a time), and while a WRITE
    /// chunk of it is staged (see `unsent`): whoever finishes the
    /// transfer otherwise (deadline, lost peer) takes it first, so once a
    /// failure is reported no late reply lands in the caller's buffer.
    pub(crate) landing: Mutex<()>,
    /// WRITE chunks staged for a socket (counted under `landing`) whose
    /// payload is not all written to it yet: a large payload is read from
    /// the caller's memory only as it is written. A deadline that passes
    /// while any is left aborts the connection before the timeout is
    /// reported (see `TcpBackend::expire`), so no byte of it is read or
    /// sent after the caller was told the transfer failed.
    pub(crate) unsent: AtomicUsize,
    /// Bytes of it reach the target's memory or application (a WRITE, or
    /// a notification): if it fails, the connection it used is fenced at
    /// the target before the failure is reported (see [`PeerConn::fail`]).
    pub(crate) fences: bool,
}

impl XferState {
    pub(crate) fn new(
        id: TransferId,
        peer: PeerId,
        deadline: Instant,
        notify: Option<Bytes>,
        writes: bool,
    ) -> Self {
        Self {
            fences: writes || notify.is_some(),
            id,
            peer,
            deadline,
            remaining: AtomicUsize::new(1),
            error: Mutex::new(None),
            notify,
            done: AtomicBool::new(false),
            landing: Mutex::new(()),
            unsent: AtomicUsize::new(0),
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
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(self.take_done())
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Whether a WRITE chunk of it is staged and not all written (see
    /// `unsent`); read after [`try_take_done_unlanded`](Self::try_take_done_unlanded)
    /// succeeded, no chunk is staged any more, so this can only fall.
    pub(crate) fn has_unsent(&self) -> bool {
        self.unsent.load(Ordering::Acquire) > 0
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

/// Requests waiting for a stream, and what submitters need to know of it
/// to pick who writes them (under the lock submitters take anyway).
#[derive(Default)]
struct Queued {
    jobs: Vec<Job>,
    /// The stream's driver left it idle (see [`Stream::is_idle`]); set
    /// by the driver only when it changes.
    idle: bool,
    /// A submission found the stream busy since the last one that found
    /// it idle: requests come in bursts here, and the burst's first goes
    /// through the I/O thread too (see [`PeerConn::send_direct`]).
    bursty: bool,
}

/// One stream: where its requests wait, and its state machine.
struct StreamQueue {
    jobs: Mutex<Queued>,
    /// Set while the stream is on its thread's ready list (one wake-up
    /// per burst of submissions); cleared by the thread when it takes the
    /// jobs.
    flagged: AtomicBool,
    inbox: Arc<Inbox>,
    token: usize,
    /// Driven by the I/O thread, or by a submitter that finds the stream
    /// idle ([`PeerConn::send_jobs`]); whoever does holds this lock.
    io: Mutex<Box<Stream>>,
    /// The I/O thread came to drive the stream (a readiness event) while
    /// a submitter held `io`: that submitter hands the stream back to it
    /// when it lets go (see [`PeerConn::drive`]).
    missed: AtomicBool,
    /// A transfer finished otherwise (deadline) since the stream was last
    /// swept: its requests are let go at the next drive (see
    /// [`Stream::sweep`](super::stream::Stream)).
    sweep: AtomicBool,
}

impl StreamQueue {
    /// Lets go of the stream, telling submitters whether it is idle when
    /// that changed (a hint: [`PeerConn::send_direct`] checks again).
    fn release_stream(&self, mut stream: MutexGuard<'_, Box<Stream>>) {
        let idle = stream.is_idle();
        if stream.noted_idle != idle {
            stream.noted_idle = idle;
            lock(&self.jobs).idle = idle;
        }
    }
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
    /// Its generation (see [`wire`]).
    pub(crate) gen: u64,
    /// What connecting again needs (a fence, a replacement).
    ep: TcpEndpoint,
    cfg: ConnectConfig,
    pool: Arc<PoolShared>,
    shared: Arc<Shared>,
    /// Non-blocking once connected; driven by the I/O threads through
    /// shared references, aborted by [`fail`](Self::fail).
    sockets: Vec<TcpStream>,
    queues: Vec<StreamQueue>,
    transfers: Mutex<Transfers>,
    /// Mirrors `transfers.dead.is_some()` for the I/O threads' checks.
    dead: AtomicBool,
    /// Bytes queued so far; picks the stream (see `add_chunk`).
    striped: AtomicU64,
    /// Its streams, counted in the pool's total while it lives.
    _lease: StreamLease,
    /// Tests: driving a stream of this connection panics.
    #[cfg(test)]
    pub(crate) panic_in_io: AtomicBool,
    /// Tests: every request goes through the I/O thread.
    #[cfg(test)]
    pub(crate) no_direct: AtomicBool,
}

#[derive(Clone)]
pub(crate) struct ConnectConfig {
    pub(crate) streams: usize,
    /// See [`TcpConfig::stream_budget`](super::TcpConfig::stream_budget).
    pub(crate) stream_budget: usize,
    pub(crate) timeout: Duration,
    pub(crate) socket: SocketOptions,
    /// The backend's connection generations (see [`wire`]): each
    /// connection set takes the next.
    pub(crate) gens: Arc<AtomicU64>,
    /// See [`TcpConfig::fence_timeout`](super::TcpConfig::fence_timeout).
    pub(crate) fence_timeout: Duration,
    /// Other addresses of the peer's process to fence through when its
    /// own cannot be reached (see
    /// [`TcpBackend::fence_through_each_other`](super::TcpBackend::fence_through_each_other)).
    pub(crate) routes: Arc<Mutex<Vec<SocketAddr>>>,
}

/// What a failed connection does before its failed transfers are
/// reported (see [`PeerConn::fail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Aftermath {
    /// Report at once: the peer is being removed, or a newer connection
    /// already fenced this one.
    Report,
    /// Fence the target first (one connection of a newer generation).
    Fence,
    /// Fence the target with a whole new connection of the peer, which
    /// takes this one's place if the backend still holds this one.
    Reconnect,
}

/// Ends the `op` of a stream whose target did not accept its hello.
const AUTHENTICATION: &str = " (authentication)";

fn io_err(op: String, source: io::Error) -> DataError {
    DataError::Io { op, source }
}

fn open_stream(
    peer: PeerId,
    ep: &TcpEndpoint,
    i: usize,
    cfg: &ConnectConfig,
    gen: u64,
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
    // Challenge, proof, ack (see `wire`): one HMAC per connection, none
    // per transfer.
    s.set_read_timeout(Some(cfg.timeout))
        .and_then(|()| wire::authenticate(&s, token))
        .map_err(|e| io_err(format!("{}{AUTHENTICATION}", what()), e))?;
    // This connection's generation: the target's older connections of
    // this peer write no more once it is answered.
    wire::fence(&s, gen)
        .and_then(|()| s.set_read_timeout(None))
        .map_err(|e| io_err(format!("{} (fence, generation {gen})", what()), e))?;
    Ok(s)
}

impl PeerConn {
    /// Opens `cfg.streams` authenticated connections (blocking, up to
    /// `cfg.timeout` per stream), then hands them to the I/O threads of
    /// `pool`.
    pub(crate) fn connect(
        peer: PeerId,
        ep: &TcpEndpoint,
        cfg: &ConnectConfig,
        shared: Arc<Shared>,
        pool: &Arc<PoolShared>,
    ) -> Result<Arc<Self>, DataError> {
        let addr = ep.addr;
        let gen = cfg.gens.fetch_add(1, Ordering::Relaxed);
        let lease = pool.lease_streams(cfg.streams, cfg.stream_budget);
        let mut sockets = Vec::new();
        for i in 0..lease.streams() {
            let s = open_stream(peer, ep, i, cfg, gen)?;
            s.set_nonblocking(true).map_err(|e| {
                io_err(
                    format!("make tcp stream {i} to {peer} at {addr} non-blocking"),
                    e,
                )
            })?;
            sockets.push(s);
        }
        let queues = (0..sockets.len())
            .map(|i| {
                let inbox = pool.pick();
                StreamQueue {
                    jobs: Mutex::new(Queued {
                        idle: true,
                        ..Queued::default()
                    }),
                    flagged: AtomicBool::new(false),
                    token: inbox.token(),
                    inbox,
                    io: Mutex::new(Box::new(Stream::new(i))),
                    missed: AtomicBool::new(false),
                    sweep: AtomicBool::new(false),
                }
            })
            .collect();
        let conn = Arc::new(Self {
            peer,
            addr,
            gen,
            ep: *ep,
            cfg: cfg.clone(),
            pool: pool.clone(),
            shared,
            sockets,
            queues,
            transfers: Mutex::new(Transfers::default()),
            dead: AtomicBool::new(false),
            striped: AtomicU64::new(0),
            _lease: lease,
            #[cfg(test)]
            panic_in_io: AtomicBool::new(false),
            #[cfg(test)]
            no_direct: AtomicBool::new(false),
        });
        for (i, q) in conn.queues.iter().enumerate() {
            if let Err(e) = PoolShared::adopt(&conn, i, &q.inbox) {
                conn.fail("could not start stream I/O", None, Aftermath::Report);
                return Err(e);
            }
        }
        Ok(conn)
    }

    /// The peer.
    pub(crate) fn peer(&self) -> PeerId {
        self.peer
    }

    /// The target's `host:port`.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stream `i`'s socket.
    pub(crate) fn socket(&self, i: usize) -> &TcpStream {
        &self.sockets[i]
    }

    /// Stream `i`'s token on its I/O thread.
    pub(crate) fn stream_token(&self, i: usize) -> usize {
        self.queues[i].token
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
        self.queues.len()
    }

    /// Counts one more chunk of `x` and picks its stream. Streams take
    /// turns every `stripe` bytes: a chunk of `stripe` bytes gets a stream
    /// to itself, while a run of small requests stays on one stream (fewer
    /// wake-ups and larger coalesced writes than spreading them thinly).
    pub(crate) fn add_chunk(&self, x: &XferState, len: u64, stripe: u64) -> usize {
        x.remaining.fetch_add(1, Ordering::AcqRel);
        let at = self.striped.fetch_add(len.max(1), Ordering::Relaxed);
        ((at / stripe.max(1)) % self.queues.len() as u64) as usize
    }

    /// Moves chunks (counted by [`add_chunk`](Self::add_chunk)) from
    /// `jobs` to stream `i`'s queue and has its I/O thread drive it. Both
    /// vectors keep their room: a steady run of submissions allocates
    /// nothing here.
    pub(crate) fn send_jobs(&self, i: usize, jobs: &mut Vec<Job>) {
        let q = &self.queues[i];
        // Payload the submitter would copy into the socket itself: small,
        // or the I/O thread does it (pipelined with more submissions).
        let payload: u64 = jobs
            .iter()
            .filter(|j| j.kind == RequestKind::Write)
            .map(|j| j.len)
            .sum();
        let direct = {
            let mut queued = lock(&q.jobs);
            if self.is_dead() {
                // The connection failed, which already failed the
                // transfers.
                jobs.clear();
                return;
            }
            // Idle: its driver left it so and nothing waits for the I/O
            // thread (the hint is stale until the thread takes the queue).
            // The first of a burst goes through the I/O thread too, and
            // the next lone one directly again.
            let idle = queued.idle && queued.jobs.is_empty();
            queued.jobs.append(jobs);
            let direct = idle && !queued.bursty && payload <= DIRECT_PAYLOAD;
            queued.bursty = !idle;
            #[cfg(test)]
            let direct = direct && !self.no_direct.load(Ordering::Relaxed);
            direct
        };
        if !(direct && self.send_direct(i)) {
            self.ready(i);
        }
    }

    /// Writes stream `i`'s queued requests from this thread when the
    /// stream is idle (nothing in flight, nothing unwritten) and nobody
    /// drives it; false otherwise, and the caller hands the stream to its
    /// I/O thread.
    ///
    /// A request to an idle stream then leaves without waking the I/O
    /// thread (an `eventfd` write and a context switch on the way out of
    /// every lone transfer). Measured, batch-1 4 KiB READ on loopback
    /// (2-vCPU VM), from before the post to the result: about 44 µs
    /// before, 41 µs with this alone, 25-28 µs with the waiter's spin
    /// too ([`crate::TransferHandle::wait`]), against a 19-24 µs TCP
    /// round trip. The submitting thread's write takes 8-10 µs here: on
    /// loopback it runs the target's receive path too. The answer
    /// wakes the I/O thread through the socket, as every answer does. A
    /// busy stream is left to its thread, which writes what queued up
    /// meanwhile in one go. What does not fit in the socket stays staged
    /// for the thread: the writable edge resumes it there.
    fn send_direct(&self, i: usize) -> bool {
        let q = &self.queues[i];
        let Ok(mut stream) = q.io.try_lock() else {
            // Driven right now (it takes the queued jobs before it lets
            // go), or poisoned: the I/O thread sees to it.
            return false;
        };
        let sent = stream.is_idle().then(|| stream.send(self));
        q.release_stream(stream);
        let handed_back = self.hand_back(i);
        let direct = sent.is_some();
        if direct {
            self.shared.direct_sends.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(Err(e)) = sent {
            self.lost(i, e);
        }
        // Handed back: the I/O thread takes whatever is still queued.
        direct || handed_back
    }

    /// After a submitter let go of stream `i`: if the I/O thread came to
    /// drive it meanwhile and left it (`missed`), puts it back on the
    /// thread's ready list, even if it looks listed (the turn that
    /// skipped it took it off), and consumes the flag, so that the next
    /// direct send wakes nobody. True when it did.
    fn hand_back(&self, i: usize) -> bool {
        let q = &self.queues[i];
        // Pairs with the fence in `drive`: either the thread's second
        // try_lock found the lock free, or this sees `missed`.
        fence(Ordering::SeqCst);
        if !q.missed.swap(false, Ordering::SeqCst) {
            return false;
        }
        q.flagged.store(true, Ordering::Release);
        q.inbox.ready(q.token);
        true
    }

    /// Drives stream `i` on its I/O thread (see [`Stream::drive`]). A
    /// stream a submitter is writing to right now is left to it: it hands
    /// the stream back when done (`missed`), so no readiness edge is lost.
    pub(crate) fn drive(&self, i: usize, scratch: &mut [u8]) -> io::Result<Drove> {
        let q = &self.queues[i];
        let poisoned = || io::Error::other("a thread panicked while writing to the stream");
        let mut stream = match q.io.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
            Err(TryLockError::WouldBlock) => {
                // A submitter writes to it: say so, then look again.
                // Pairs with the fence in `send_direct`: either this
                // finds the lock free, or the submitter sees `missed`
                // and hands the stream back.
                q.missed.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                match q.io.try_lock() {
                    Ok(s) => {
                        q.missed.store(false, Ordering::Relaxed);
                        s
                    }
                    Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
                    Err(TryLockError::WouldBlock) => return Ok(Drove::Blocked),
                }
            }
        };
        let r = stream.drive(self, scratch);
        q.release_stream(stream);
        r
    }

    /// Tests: holds stream `i` as a submitter writing to it does.
    #[cfg(test)]
    pub(crate) fn hold_stream(&self, i: usize) -> MutexGuard<'_, Box<Stream>> {
        lock(&self.queues[i].io)
    }

    /// Tests: [`hand_back`](Self::hand_back), as a submitter that held
    /// stream `i` calls it.
    #[cfg(test)]
    pub(crate) fn test_hand_back(&self, i: usize) -> bool {
        self.hand_back(i)
    }

    /// Tests: whether the I/O thread came to stream `i` while it was
    /// held and left it to the holder.
    #[cfg(test)]
    pub(crate) fn missed(&self, i: usize) -> bool {
        self.queues[i].missed.load(Ordering::SeqCst)
    }

    /// Tests: every stream idle, known to be (the hint submitters read),
    /// not on its thread's ready list and not being driven: the next lone
    /// request leaves directly.
    #[cfg(test)]
    pub(crate) fn settled(&self) -> bool {
        self.queues.iter().all(|q| {
            if q.flagged.load(Ordering::Acquire) {
                return false;
            }
            let Ok(stream) = q.io.try_lock() else {
                return false;
            };
            let queued = lock(&q.jobs);
            stream.is_idle() && queued.idle && queued.jobs.is_empty()
        })
    }

    /// Tests: has stream `i`'s I/O thread drive it.
    #[cfg(test)]
    pub(crate) fn test_ready(&self, i: usize) {
        self.ready(i);
    }

    /// Puts stream `i` on its thread's ready list unless it is there.
    fn ready(&self, i: usize) {
        let q = &self.queues[i];
        if !q.flagged.swap(true, Ordering::AcqRel) {
            q.inbox.ready(q.token);
        }
    }

    /// Moves stream `i`'s queued jobs to `into`; false when there were
    /// none. Called by the stream's I/O thread.
    pub(crate) fn take_jobs(&self, i: usize, into: &mut VecDeque<Job>) -> bool {
        let q = &self.queues[i];
        // Cleared first: jobs queued from now on put the stream on the
        // ready list again.
        q.flagged.store(false, Ordering::Release);
        let mut queued = lock(&q.jobs);
        if queued.jobs.is_empty() {
            return false;
        }
        into.extend(queued.jobs.drain(..));
        true
    }

    /// Forgets a transfer that finished elsewhere (deadline), and has
    /// every stream let go of its requests soon (their local regions, or
    /// state), whether or not the target ever answers them.
    pub(crate) fn forget(&self, id: TransferId) {
        lock(&self.transfers).map.remove(&id);
        for q in &self.queues {
            if !q.sweep.swap(true, Ordering::AcqRel) {
                // Straight onto the thread's ready list, whatever
                // `flagged` says: it tracks queued jobs, and a stream
                // taken off the list with a backlog keeps it set.
                q.inbox.ready(q.token);
            }
        }
    }

    /// Whether stream `i` is to be swept (see [`forget`](Self::forget));
    /// clears the flag.
    pub(crate) fn take_sweep(&self, i: usize) -> bool {
        self.queues[i].sweep.swap(false, Ordering::AcqRel)
    }

    /// Moves stream `i`'s queued jobs of finished transfers to `into`.
    pub(crate) fn take_finished(&self, i: usize, into: &mut Vec<Job>) {
        let mut queued = lock(&self.queues[i].jobs);
        if !queued.jobs.iter().any(|j| j.xfer.is_done()) {
            return;
        }
        // In order: the others keep theirs.
        let (done, keep): (Vec<Job>, Vec<Job>) =
            queued.jobs.drain(..).partition(|j| j.xfer.is_done());
        queued.jobs = keep;
        into.extend(done);
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
            self.send_jobs(
                0,
                &mut vec![Job {
                    kind: RequestKind::Notify,
                    key: RemoteKey(0),
                    remote_offset: 0,
                    len: x.notify.as_ref().map_or(0, |n| n.len() as u64),
                    local: None,
                    local_offset: 0,
                    xfer: x.clone(),
                }],
            );
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
    /// streams (their I/O threads drop them). Idempotent.
    ///
    /// When a failed transfer had bytes bound for the target's memory or
    /// application (a WRITE, a notification), `after` says how the
    /// failures wait, off the caller's thread, until the target has fenced
    /// this connection's generation (see [`wire`]): from then on no byte
    /// of them still in the network (a proxy, the target's socket buffer)
    /// lands, so none lands after the caller was told the transfer failed
    /// and wrote newer data. A target that cannot be reached within
    /// [`TcpConfig::fence_timeout`](super::TcpConfig::fence_timeout) is
    /// logged and counted (`unfenced`), and the failures are reported
    /// anyway; the peer's next connection fences it before it writes.
    pub(crate) fn fail(&self, reason: &'static str, source: Option<io::Error>, after: Aftermath) {
        self.fail_at(reason, source, None, after, Vec::new());
    }

    /// [`fail`](Self::fail), for transfers that timed out with a WRITE
    /// chunk or notification not answered (see `TcpBackend::expire`):
    /// transfers whose deadline passed by `now` fail with `Timeout`, the
    /// others with `PeerLost`; `timed_out` (taken off this connection
    /// already) are reported with them, after the fence. The connection
    /// is replaced by a new one when the target answers.
    pub(crate) fn abort_after_timeout(
        &self,
        reason: &'static str,
        now: Instant,
        timed_out: Vec<Completion>,
    ) {
        tracing::warn!(peer = %self.peer, addr = %self.addr, "{reason}: aborting the connection");
        self.fail_at(reason, None, Some(now), Aftermath::Reconnect, timed_out);
    }

    fn fail_at(
        &self,
        reason: &'static str,
        source: Option<io::Error>,
        now: Option<Instant>,
        after: Aftermath,
        mut report: Vec<Completion>,
    ) {
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
                drop(t);
                self.report(report);
                return;
            }
            t.dead = Some((reason, source.clone()));
            self.dead.store(true, Ordering::Release);
            std::mem::take(&mut t.map)
        };
        let mut fence = !report.is_empty();
        for x in lost.values() {
            // After a READ's in-progress copy, never during it.
            let landed = lock(&x.landing);
            let first = x.take_done();
            drop(landed);
            if first {
                fence |= x.fences;
                let error = match now {
                    Some(now) if x.deadline <= now => DataError::Timeout {
                        id: x.id,
                        peer: self.peer,
                        overdue: now - x.deadline,
                    },
                    _ => DataError::PeerLost {
                        peer: self.peer,
                        reason,
                        source: source.clone(),
                    },
                };
                report.push(Completion {
                    id: x.id,
                    peer: self.peer,
                    result: Err(error),
                });
            }
        }
        for s in &self.sockets {
            // Abort, do not close gracefully: bytes still queued in the
            // kernel belong to transfers about to be reported as failed,
            // and must not reach the target later (after a link comes
            // back, say) on top of newer writes. Linger 0 discards them
            // and resets once the last handle of the socket closes; a 1 ms
            // user timeout aborts it at the next retransmission meanwhile.
            // (Bytes past this host are the fence's business.)
            let sock = socket2::SockRef::from(s);
            let _ = sock.set_linger(Some(Duration::ZERO));
            #[cfg(target_os = "linux")]
            let _ = sock.set_tcp_user_timeout(Some(Duration::from_millis(1)));
            let _ = s.shutdown(Shutdown::Both);
        }
        for (i, q) in self.queues.iter().enumerate() {
            // Queued jobs belong to the failed transfers; the thread
            // drops the stream when it drives it next.
            lock(&q.jobs).jobs.clear();
            self.ready(i);
        }
        if !fence || after == Aftermath::Report {
            self.report(report);
            return;
        }
        let (peer, ep, gen) = (self.peer, self.ep, self.gen);
        let mut cfg = self.cfg.clone();
        cfg.timeout = cfg.timeout.min(cfg.fence_timeout);
        if after == Aftermath::Fence {
            cfg.streams = 1;
        }
        let (shared, pool) = (self.shared.clone(), self.pool.clone());
        // Taken by the job, or here if it cannot start: never lost.
        let pending = Arc::new(Mutex::new(Some(report)));
        let theirs = pending.clone();
        let job = move || {
            match Self::connect(peer, &ep, &cfg, shared.clone(), &pool) {
                Ok(new) => {
                    tracing::debug!(%peer, addr = %ep.addr, gen, fenced_by = new.gen, "failed connection fenced");
                    if after == Aftermath::Reconnect {
                        let mut r = lock(&shared.replacements);
                        if shared.closed.load(Ordering::Acquire) {
                            drop(r);
                            new.fail("backend dropped", None, Aftermath::Report);
                        } else {
                            r.push((peer, gen, new));
                        }
                    } else {
                        new.fail("fence done", None, Aftermath::Report);
                    }
                }
                // A target that closes the connection on the hello refuses
                // the credential: it revoked it (the peer was removed
                // there, and its connections closed) or is a new process.
                // Either way nothing of the old connection lands.
                Err(DataError::Io { op, source })
                    if op.ends_with(AUTHENTICATION)
                        && source.kind() == io::ErrorKind::UnexpectedEof =>
                {
                    tracing::debug!(%peer, addr = %ep.addr, gen,
                        "the target no longer accepts this peer's credential: nothing to fence");
                }
                Err(e) => {
                    if let Some(via) = Self::fence_through_routes(peer, &ep, &cfg) {
                        tracing::info!(%peer, addr = %ep.addr, %via, gen, error = %e,
                            "failed connection fenced through another address of its target (its own cannot be reached)");
                    } else {
                        shared.unfenced.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%peer, addr = %ep.addr, gen, error = %e,
                            "could not fence a failed connection at its target: bytes of its failed transfers still in the network may land later");
                    }
                }
            }
            for c in lock(&theirs).take().into_iter().flatten() {
                shared.complete(c);
            }
        };
        let spawned = std::thread::Builder::new()
            .name("kvlane-tcp-fence".into())
            .spawn(job);
        if let Err(e) = spawned {
            tracing::error!(peer = %self.peer, error = %e, "could not start a fence thread; failures reported unfenced");
            self.shared.unfenced.fetch_add(1, Ordering::Relaxed);
            let report = lock(&pending).take().unwrap_or_default();
            self.report(report);
        }
    }

    /// Fences `peer`'s older connections through another address of its
    /// target's process (`cfg.routes`: its other rails), when its own
    /// address cannot be reached: one stream that proves this peer's
    /// credential there and sends a FENCE of a new generation, then
    /// closes. The address it went through, or `None`.
    fn fence_through_routes(
        peer: PeerId,
        ep: &TcpEndpoint,
        cfg: &ConnectConfig,
    ) -> Option<SocketAddr> {
        let routes = lock(&cfg.routes).clone();
        for addr in routes {
            let via = TcpEndpoint {
                addr,
                listen: addr,
                ..*ep
            };
            let gen = cfg.gens.fetch_add(1, Ordering::Relaxed);
            match open_stream(peer, &via, 0, cfg, gen) {
                Ok(s) => {
                    let _ = s.shutdown(Shutdown::Both);
                    return Some(addr);
                }
                Err(e) => {
                    tracing::debug!(%peer, %addr, error = %e, "fencing through another address failed");
                }
            }
        }
        None
    }

    /// Queues failure completions and wakes the poller.
    fn report(&self, report: Vec<Completion>) {
        if report.is_empty() {
            return;
        }
        lock(&self.shared.completions).extend(report);
        self.shared.wake();
    }

    /// Whether the connection failed (or was closed).
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// A stream broke: log it (unless we closed it) and fail the peer.
    pub(crate) fn lost(&self, stream: usize, e: io::Error) {
        if self.is_dead() {
            return;
        }
        let reason = match e.kind() {
            io::ErrorKind::UnexpectedEof => "the target closed the connection",
            io::ErrorKind::InvalidData => "the target broke the protocol",
            _ => "the connection to the target failed",
        };
        // A target that closes an idle connection is detaching us (its
        // side of a disconnect, or our credential revoked): said at info.
        // Transfers in flight failing is worth a warning.
        let idle = lock(&self.transfers).map.is_empty();
        if idle && e.kind() == io::ErrorKind::UnexpectedEof {
            tracing::info!(peer = %self.peer, addr = %self.addr, stream, "{reason} (nothing in flight)");
        } else {
            tracing::warn!(peer = %self.peer, addr = %self.addr, stream, error = %e, "{reason}");
        }
        self.fail(reason, Some(e), Aftermath::Reconnect);
    }

    /// The error for a refused request; `None` when it succeeded.
    pub(crate) fn refusal(&self, job: &Job, status: Status) -> Option<DataError> {
        let (peer, key) = (self.peer, job.key);
        Some(match status {
            Status::Ok => return None,
            Status::UnknownKey => DataError::UnknownKey { peer, key },
            Status::Revoked => DataError::RemoteRegionRevoked {
                peer,
                key,
                addr: self.addr,
            },
            Status::NotifyQueueFull => DataError::NotificationQueueFull {
                peer,
                addr: self.addr,
            },
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
