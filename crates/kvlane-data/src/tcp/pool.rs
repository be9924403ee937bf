//! Initiator side: the event-driven I/O threads every stream of every
//! peer runs on, shared by the tcp backends of a process.
//!
//! [`IoPool`] starts [`TcpConfig::io_threads`](super::TcpConfig::io_threads)
//! threads (O(cores), not O(peers)), each an epoll loop (`mio`) over its
//! share of the streams; a new stream goes to the threads round-robin.
//! Backends with the same `io_threads` share one pool
//! ([`IoPool::for_process`]): a process that runs many agents (a bench,
//! a test, an engine with an agent per GPU) gets that many threads, not
//! that many per agent. Measured: 1,000 agents in two processes held
//! 2,000 initiator I/O threads, and each woke for its own few streams.
//! The pool stops when the last backend using it is dropped.
//! A thread learns of work through its [`Inbox`]: streams to adopt, and
//! the tokens of streams that have requests queued (a stream is put there
//! once until it is driven, so a burst of submissions costs one wake-up).
//! Readiness is edge-triggered: a drive reads and writes until the socket
//! would block, or yields after a read budget so that streams sharing a
//! thread take turns.
//!
//! A panic while driving a stream fails that stream's peer (its transfers
//! complete with [`PeerLost`](crate::DataError::PeerLost)) and drops the
//! stream; a panic of the loop itself fails every peer with a stream on
//! that thread. Nothing waits for a deadline because of a panic.

use super::initiator::{Aftermath, PeerConn};
use super::serve::Drove;
use super::shared::lock;
use crate::error::DataError;
use crate::ids::FastMap;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::{self, JoinHandle};

/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 1024;

const WAKE: Token = Token(0);

/// How other threads reach one I/O thread.
pub(crate) struct Inbox {
    waker: Waker,
    /// Streams to adopt: a connection and its stream index.
    adopt: Mutex<Vec<(Arc<PeerConn>, usize)>>,
    /// Streams with requests queued (see [`Inbox::ready`]).
    ready: Mutex<Vec<usize>>,
    /// The thread is about to wait, or waits, in `epoll_wait`: only then
    /// does [`Inbox::ready`] wake it (see [`Worker::park`]).
    parked: AtomicBool,
    next_token: AtomicUsize,
    stop: AtomicBool,
    index: usize,
}

impl Inbox {
    /// A token for a stream this thread will adopt.
    pub(crate) fn token(&self) -> usize {
        self.next_token.fetch_add(1, Ordering::Relaxed)
    }

    /// Asks the thread to drive the stream `token` (requests are queued
    /// for it, or its connection failed). Wakes the thread only when it is
    /// parked: a thread at work drives the list at the end of its turn and
    /// looks at it again before it waits. Measured: the `eventfd` write of
    /// a wake-up was ~12% of a Python thread posting 64 KiB WRITEs, with
    /// the I/O thread busy, not waiting, most of the time.
    pub(crate) fn ready(&self, token: usize) {
        lock(&self.ready).push(token);
        // SeqCst, with the thread's store in `park`: either the thread sees
        // the token under the lock before it waits, or this sees it parked.
        if self.parked.swap(false, Ordering::SeqCst) {
            self.wake();
        }
    }

    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!(thread = self.index, error = %e, "could not wake a tcp initiator I/O thread");
        }
    }
}

/// The initiator I/O threads of the backends of a process; stopped and
/// joined when the last of them drops it (their streams' connections are
/// failed by then: a backend fails its peers as it drops, and a failed
/// connection's streams are dropped at their thread's next turn).
pub(crate) struct IoPool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

/// What connecting needs of the pool (off the backend lock).
pub(crate) struct PoolShared {
    inboxes: Vec<Arc<Inbox>>,
    next: AtomicUsize,
    /// Streams of the pool's live connections (see [`StreamLease`]).
    open: Arc<AtomicUsize>,
}

/// The streams one connection counts in its pool's total, given back when
/// the connection is dropped.
pub(crate) struct StreamLease {
    open: Arc<AtomicUsize>,
    n: usize,
}

impl StreamLease {
    /// Streams the connection opens.
    pub(crate) fn streams(&self) -> usize {
        self.n
    }
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        self.open.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Streams for a new connection that wants `wanted` when `open` streams
/// are open already: as many as fit under `budget`, and at least one.
fn streams_within(wanted: usize, budget: usize, open: usize) -> usize {
    wanted.min(budget.saturating_sub(open)).max(1)
}

impl PoolShared {
    /// Counts the streams of a new connection that wants `wanted` of
    /// them: `wanted` while the pool's streams stay within `budget`, one
    /// past it ([`streams_within`]). Counted at once, so connections made
    /// at the same time see each other.
    pub(crate) fn lease_streams(&self, wanted: usize, budget: usize) -> StreamLease {
        let mut open = self.open.load(Ordering::Acquire);
        loop {
            let n = streams_within(wanted, budget, open);
            match self.open.compare_exchange_weak(
                open,
                open + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return StreamLease {
                        open: self.open.clone(),
                        n,
                    }
                }
                Err(now) => open = now,
            }
        }
    }

    /// Streams of the pool's live connections.
    pub(crate) fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// The thread the next stream goes to (round-robin).
    pub(crate) fn pick(&self) -> Arc<Inbox> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.inboxes.len();
        self.inboxes[i].clone()
    }

    /// Hands stream `i` of `conn` to its thread (picked for it when the
    /// connection was made). Fails once the pool stopped (the backend is
    /// being dropped).
    pub(crate) fn adopt(conn: &Arc<PeerConn>, i: usize, inbox: &Inbox) -> Result<(), DataError> {
        let mut a = lock(&inbox.adopt);
        if inbox.stop.load(Ordering::Acquire) {
            return Err(DataError::PeerLost {
                peer: conn.peer(),
                reason: "backend dropped while connecting",
                source: None,
            });
        }
        a.push((conn.clone(), i));
        drop(a);
        inbox.wake();
        Ok(())
    }
}

/// The pools of this process, by thread count; a pool lives while a
/// backend holds it.
static POOLS: Mutex<Vec<(usize, Weak<IoPool>)>> = Mutex::new(Vec::new());

impl IoPool {
    /// The process's pool of `threads` threads, started if no live backend
    /// holds one.
    pub(crate) fn for_process(threads: usize) -> Result<Arc<Self>, DataError> {
        crate::progress::process_pool(&POOLS, threads, Self::start)
    }

    /// Starts `threads` I/O threads.
    fn start(threads: usize) -> Result<Self, DataError> {
        let io_err = |op: String| move |source| DataError::Io { op, source };
        let mut polls = Vec::new();
        let mut inboxes = Vec::new();
        for index in 0..threads.max(1) {
            let poll =
                Poll::new().map_err(io_err(format!("create tcp initiator poller {index}")))?;
            let waker = Waker::new(poll.registry(), WAKE)
                .map_err(io_err(format!("create tcp initiator waker {index}")))?;
            polls.push(poll);
            inboxes.push(Arc::new(Inbox {
                waker,
                adopt: Mutex::new(Vec::new()),
                ready: Mutex::new(Vec::new()),
                parked: AtomicBool::new(false),
                next_token: AtomicUsize::new(1),
                stop: AtomicBool::new(false),
                index,
            }));
        }
        let mut pool = Self {
            shared: Arc::new(PoolShared {
                inboxes: inboxes.clone(),
                next: AtomicUsize::new(0),
                open: Arc::new(AtomicUsize::new(0)),
            }),
            threads: Vec::new(),
        };
        for (index, (poll, inbox)) in polls.into_iter().zip(inboxes).enumerate() {
            let worker = Worker {
                poll,
                inbox,
                streams: FastMap::default(),
                scratch: vec![0u8; super::io::IO_BUF].into_boxed_slice(),
                again: Vec::new(),
            };
            let handle = crate::placement::spawn(
                thread::Builder::new().name(format!("kvlane-tcp-init-{index}")),
                move || worker.run(),
            )
            .map_err(io_err(format!("spawn tcp initiator I/O thread {index}")))?;
            // On an error `pool` drops here, which stops the threads
            // already started.
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// The part connecting needs.
    pub(crate) fn shared(&self) -> Arc<PoolShared> {
        self.shared.clone()
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        for inbox in &self.shared.inboxes {
            // Under the adopt lock: a connect that finishes now either
            // handed its streams over already or sees the stop.
            let _a = lock(&inbox.adopt);
            inbox.stop.store(true, Ordering::Release);
            drop(_a);
            inbox.wake();
        }
        for h in self.threads.drain(..) {
            if h.join().is_err() {
                tracing::error!("a tcp initiator I/O thread panicked");
            }
        }
    }
}

/// One I/O thread.
struct Worker {
    poll: Poll,
    inbox: Arc<Inbox>,
    /// Its streams by token: the connection and the stream's index.
    streams: FastMap<usize, (Arc<PeerConn>, usize)>,
    scratch: Box<[u8]>,
    /// Streams that yielded (read budget used): driven again after this
    /// turn's events, before the thread waits.
    again: Vec<usize>,
}

impl Worker {
    fn run(mut self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.event_loop()));
        if r.is_err() {
            tracing::error!(
                thread = self.inbox.index,
                "a tcp initiator I/O thread panicked; its peers are failed"
            );
            for (conn, _) in self.streams.values() {
                conn.fail(
                    "an I/O thread of the connection panicked",
                    None,
                    Aftermath::Reconnect,
                );
            }
        }
        // Whatever was handed over and not adopted is let go (no cycle
        // through the inbox keeps a connection alive).
        lock(&self.inbox.adopt).clear();
        lock(&self.inbox.ready).clear();
        for (_, (conn, i)) in self.streams.drain() {
            let fd = conn.socket(i).as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        }
    }

    fn event_loop(&mut self) {
        let mut events = Events::with_capacity(EVENTS);
        let mut ready = Vec::new();
        loop {
            let timeout = if self.again.is_empty() && self.park() {
                None
            } else {
                Some(std::time::Duration::ZERO)
            };
            let polled = self.poll.poll(&mut events, timeout);
            self.inbox.parked.store(false, Ordering::SeqCst);
            if let Err(e) = polled {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(thread = self.inbox.index, error = %e, "tcp initiator poll failed; the I/O thread stops");
                    for (conn, _) in self.streams.values() {
                        conn.fail(
                            "the I/O thread's poll failed",
                            Some(e.kind().into()),
                            Aftermath::Reconnect,
                        );
                    }
                    return;
                }
            }
            if self.inbox.stop.load(Ordering::Acquire) {
                return;
            }
            // The transfers this turn finished are resolved at its end.
            let _wakes = crate::progress::WakeBatch::begin();
            let again = std::mem::take(&mut self.again);
            for ev in &events {
                match ev.token() {
                    WAKE => {}
                    Token(t) if !again.contains(&t) => self.drive(t),
                    Token(_) => {}
                }
            }
            for t in again {
                self.drive(t);
            }
            let adopted = std::mem::take(&mut *lock(&self.inbox.adopt));
            for (conn, i) in adopted {
                self.adopt(conn, i);
            }
            std::mem::swap(&mut ready, &mut *lock(&self.inbox.ready));
            for t in ready.drain(..) {
                self.drive(t);
            }
        }
    }

    /// Marks the thread parked unless streams are ready already; whether
    /// it may wait. A submitter that queued a stream after the look sees
    /// the mark and wakes the thread (see [`Inbox::ready`]).
    fn park(&self) -> bool {
        self.inbox.parked.store(true, Ordering::SeqCst);
        if lock(&self.inbox.ready).is_empty() {
            return true;
        }
        self.inbox.parked.store(false, Ordering::SeqCst);
        false
    }

    fn adopt(&mut self, conn: Arc<PeerConn>, i: usize) {
        let token = conn.stream_token(i);
        let fd = conn.socket(i).as_raw_fd();
        if let Err(e) = self.poll.registry().register(
            &mut SourceFd(&fd),
            Token(token),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            conn.fail(
                "could not register a tcp stream for I/O",
                Some(e),
                Aftermath::Reconnect,
            );
            return;
        }
        self.streams.insert(token, (conn, i));
        // Bytes and requests may have arrived before the registration.
        self.drive(token);
    }

    fn drive(&mut self, token: usize) {
        let Some((conn, i)) = self.streams.get(&token) else {
            return;
        };
        let (conn, i) = (&**conn, *i);
        let scratch = &mut self.scratch;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.drive(i, scratch)));
        match r {
            Ok(Ok(Drove::Blocked)) => return,
            Ok(Ok(Drove::Yielded)) => {
                self.again.push(token);
                return;
            }
            Ok(Err(e)) => conn.lost(i, e),
            Err(_) => {
                tracing::error!(peer = %conn.peer(), addr = %conn.addr(), "driving a tcp stream panicked");
                conn.fail(
                    "an I/O thread of the connection panicked",
                    None,
                    Aftermath::Reconnect,
                );
            }
        }
        self.close(token);
    }

    fn close(&mut self, token: usize) {
        if let Some((conn, i)) = self.streams.remove(&token) {
            let fd = conn.socket(i).as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        }
    }
}
