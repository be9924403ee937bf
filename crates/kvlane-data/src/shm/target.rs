//! The target side of the shm backend: one I/O thread per backend that
//! accepts peers on the abstract Unix socket, checks their credential,
//! passes them the descriptors of the registered regions (or, for regions
//! served by cross-memory attach, their addresses), and takes their
//! notifications. It never copies region bytes: peers do, in their own
//! threads.
//!
//! The same thread watches this backend's own connections to its targets
//! (as an initiator) for readability and wakes the driver, so answers to
//! notifications and a target's death are noticed without a timer.

use super::sys::{recv_msg, send_msg, MAX_FDS};
use super::wire::{self, GpuGrant, Granted, NotifyStatus, ToInitiator, ToTarget, MAX_MESSAGE};
use crate::ids::{FastMap, PeerId, RemoteKey};
use crate::memory::Region;
use crate::transfer::Notification;
use bytes::Bytes;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use socket2::Socket;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const WAKE: Token = Token(1);
/// Tokens of this backend's own connections to targets (watched only).
const WATCH_BIT: usize = 1 << 62;

/// Answers queued for a peer that does not read them, before its
/// connection is closed.
const MAX_QUEUED_ANSWERS: usize = 4096;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain tables: a panic while holding one leaves them consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the backend asks of its I/O thread.
pub(crate) enum Cmd {
    /// Pass the region under this key to every authenticated peer.
    Grant(RemoteKey),
    /// Tell every authenticated peer that this key is gone.
    Revoke(RemoteKey),
    /// Close the connections that presented this peer's credential.
    Close(PeerId),
    /// Wake the driver when this connection (to a target) is readable.
    Watch(PeerId, Arc<OwnedFd>),
    /// Stop watching it.
    Unwatch(PeerId),
    /// End the thread.
    Stop,
}

/// A region served to peers.
#[derive(Clone)]
pub(crate) struct Served {
    /// The region.
    pub(crate) region: Region,
    /// For GPU memory: its IPC handle, made when it was registered.
    pub(crate) gpu: Option<GpuGrant>,
}

/// State shared by the backend and its I/O thread.
pub(crate) struct Shared {
    /// Regions served to peers, by key (those with remote rights).
    pub(crate) regions: Mutex<FastMap<RemoteKey, Served>>,
    /// Credentials issued, and the peer each was issued for.
    pub(crate) creds: Mutex<HashMap<[u8; wire::TOKEN_LEN], PeerId>>,
    /// Notifications not yet taken by `poll_notifications`.
    pub(crate) notes: Mutex<VecDeque<Notification>>,
    /// Capacity of `notes`.
    pub(crate) note_cap: usize,
    /// The driver's waker.
    pub(crate) waker: Mutex<Option<Waker>>,
    cmds: Mutex<Vec<Cmd>>,
    /// Refusals: connections dropped for a bad credential or message.
    pub(crate) refused: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn wake(&self) {
        if let Some(w) = lock(&self.waker).as_ref() {
            w.wake_by_ref();
        }
    }
}

/// The running I/O thread; stopped and joined on drop.
pub(crate) struct Target {
    pub(crate) shared: Arc<Shared>,
    mio_waker: Arc<mio::Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Target {
    /// Starts serving `listener` (bound, listening, non-blocking).
    pub(crate) fn start(
        listener: Socket,
        note_cap: usize,
        auth_timeout: Duration,
    ) -> io::Result<Self> {
        let poll = Poll::new()?;
        let mio_waker = Arc::new(mio::Waker::new(poll.registry(), WAKE)?);
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        let shared = Arc::new(Shared {
            regions: Mutex::default(),
            creds: Mutex::default(),
            notes: Mutex::default(),
            note_cap,
            waker: Mutex::default(),
            cmds: Mutex::default(),
            refused: Default::default(),
        });
        let mut io = Io {
            poll,
            listener,
            shared: shared.clone(),
            conns: FastMap::default(),
            watched: FastMap::default(),
            next: 2,
            auth_timeout,
            buf: vec![0u8; MAX_MESSAGE],
        };
        let thread = std::thread::Builder::new()
            .name("kvlane-shm".into())
            .spawn(move || io.run())?;
        Ok(Self {
            shared,
            mio_waker,
            thread: Some(thread),
        })
    }

    /// Hands `cmd` to the I/O thread.
    pub(crate) fn send(&self, cmd: Cmd) {
        lock(&self.shared.cmds).push(cmd);
        // A failed wake leaves the command queued for the next event.
        let _ = self.mio_waker.wake();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum State {
    /// Waiting for Hello until this instant.
    Hello(Instant),
    /// Authenticated as this peer.
    Serving(PeerId),
}

struct Conn {
    sock: Socket,
    state: State,
    /// Answers not yet sent (the socket was full).
    out: VecDeque<Vec<u8>>,
}

struct Io {
    poll: Poll,
    listener: Socket,
    shared: Arc<Shared>,
    conns: FastMap<usize, Conn>,
    watched: FastMap<PeerId, (usize, Arc<OwnedFd>)>,
    next: usize,
    auth_timeout: Duration,
    buf: Vec<u8>,
}

impl Io {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            let timeout = self
                .conns
                .values()
                .filter_map(|c| match c.state {
                    State::Hello(until) => Some(until),
                    State::Serving(_) => None,
                })
                .min()
                .map(|t| t.saturating_duration_since(Instant::now()));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "shm: epoll failed; the target stops serving");
                    return;
                }
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKE => {}
                    Token(t) if t & WATCH_BIT != 0 => self.shared.wake(),
                    Token(t) => self.service(t),
                }
            }
            let cmds = std::mem::take(&mut *lock(&self.shared.cmds));
            for cmd in cmds {
                if !self.command(cmd) {
                    return;
                }
            }
            let now = Instant::now();
            let late: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, c)| matches!(c.state, State::Hello(until) if until <= now))
                .map(|(t, _)| *t)
                .collect();
            for t in late {
                self.refuse(t, "no credential within the authentication timeout");
            }
        }
    }

    /// Runs one command; false ends the thread.
    fn command(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Stop => return false,
            Cmd::Grant(key) => {
                let region = lock(&self.shared.regions).get(&key).cloned();
                if let Some(region) = region {
                    let serving: Vec<usize> = self.serving().collect();
                    for t in serving {
                        if let Err(e) = self.grant(t, &[(key, region.clone())], true) {
                            self.close(t, "could not pass a new region", Some(e));
                        }
                    }
                }
            }
            Cmd::Revoke(key) => {
                let msg = wire::encode(&ToInitiator::Revoke { key });
                for t in self.serving().collect::<Vec<_>>() {
                    self.answer(t, msg.clone());
                }
            }
            Cmd::Close(peer) => {
                let gone: Vec<usize> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| matches!(c.state, State::Serving(p) if p == peer))
                    .map(|(t, _)| *t)
                    .collect();
                for t in gone {
                    self.close(t, "peer removed", None);
                }
            }
            Cmd::Watch(peer, fd) => {
                let token = WATCH_BIT | self.next;
                self.next += 1;
                match self.poll.registry().register(
                    &mut SourceFd(&fd.as_raw_fd()),
                    Token(token),
                    Interest::READABLE,
                ) {
                    Ok(()) => {
                        self.watched.insert(peer, (token, fd));
                        // Anything that arrived before registration.
                        self.shared.wake();
                    }
                    Err(e) => tracing::warn!(%peer, error = %e,
                        "shm: cannot watch the connection; answers are noticed by polling"),
                }
            }
            Cmd::Unwatch(peer) => {
                if let Some((_, fd)) = self.watched.remove(&peer) {
                    let _ = self
                        .poll
                        .registry()
                        .deregister(&mut SourceFd(&fd.as_raw_fd()));
                }
            }
        }
        true
    }

    fn serving(&self) -> impl Iterator<Item = usize> + '_ {
        self.conns
            .iter()
            .filter(|(_, c)| matches!(c.state, State::Serving(_)))
            .map(|(t, _)| *t)
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((sock, _)) => {
                    if sock.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let token = self.next;
                    self.next += 1;
                    if self
                        .poll
                        .registry()
                        .register(
                            &mut SourceFd(&sock.as_raw_fd()),
                            Token(token),
                            Interest::READABLE | Interest::WRITABLE,
                        )
                        .is_err()
                    {
                        continue;
                    }
                    self.conns.insert(
                        token,
                        Conn {
                            sock,
                            state: State::Hello(Instant::now() + self.auth_timeout),
                            out: VecDeque::new(),
                        },
                    );
                    // The Hello may already be there.
                    self.service(token);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "shm: accept failed");
                    return;
                }
            }
        }
    }

    /// Sends queued answers, then reads messages until the socket is
    /// empty (or full for answers again).
    fn service(&mut self, t: usize) {
        loop {
            let Some(conn) = self.conns.get_mut(&t) else {
                return;
            };
            while let Some(msg) = conn.out.front() {
                match send_msg(conn.sock.as_fd(), msg, &[]) {
                    Ok(_) => {
                        conn.out.pop_front();
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                    Err(e) => return self.close(t, "send failed", Some(e)),
                }
            }
            let mut fds = Vec::new();
            let n = match recv_msg(conn.sock.as_fd(), &mut self.buf, &mut fds) {
                Ok(0) => return self.close(t, "peer closed the connection", None),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => return self.close(t, "receive failed", Some(e)),
            };
            // A peer sends no descriptors: any it did are closed here.
            drop(fds);
            let Some(msg) = wire::decode::<ToTarget>(&self.buf[..n]) else {
                return self.refuse(t, "malformed message");
            };
            if !self.handle(t, msg) {
                return;
            }
        }
    }

    /// Handles one message; false when the connection was closed.
    fn handle(&mut self, t: usize, msg: ToTarget) -> bool {
        let Some(conn) = self.conns.get_mut(&t) else {
            return false;
        };
        match (&conn.state, msg) {
            (State::Hello(_), ToTarget::Hello { version, token }) => {
                if version != wire::VERSION {
                    self.refuse(t, "unsupported protocol version");
                    return false;
                }
                let peer = <[u8; wire::TOKEN_LEN]>::try_from(token.as_slice())
                    .ok()
                    .and_then(|tok| lock(&self.shared.creds).get(&tok).copied());
                let Some(peer) = peer else {
                    self.refuse(t, "unknown credential");
                    return false;
                };
                conn.state = State::Serving(peer);
                let regions: Vec<(RemoteKey, Served)> = lock(&self.shared.regions)
                    .iter()
                    .map(|(k, r)| (*k, r.clone()))
                    .collect();
                let mut chunks = regions.chunks(MAX_FDS).peekable();
                if chunks.peek().is_none() {
                    if let Err(e) = self.grant(t, &[], true) {
                        self.close(t, "could not answer the hello", Some(e));
                        return false;
                    }
                }
                while let Some(chunk) = chunks.next() {
                    let last = chunks.peek().is_none();
                    if let Err(e) = self.grant(t, chunk, last) {
                        self.close(t, "could not pass the regions", Some(e));
                        return false;
                    }
                }
                tracing::debug!(%peer, regions = regions.len(), "shm: peer authenticated");
                true
            }
            (
                State::Serving(peer),
                ToTarget::Notify {
                    seq,
                    deadline_ns,
                    payload,
                },
            ) => {
                let peer = *peer;
                let status = if super::sys::monotonic_ns() > deadline_ns {
                    NotifyStatus::Expired
                } else {
                    let mut notes = lock(&self.shared.notes);
                    if notes.len() >= self.shared.note_cap {
                        NotifyStatus::QueueFull
                    } else {
                        notes.push_back(Notification {
                            payload: Bytes::from(payload),
                            from: Some(peer),
                        });
                        NotifyStatus::Delivered
                    }
                };
                if status == NotifyStatus::Delivered {
                    self.shared.wake();
                }
                self.answer(t, wire::encode(&ToInitiator::Notified { seq, status }));
                self.conns.contains_key(&t)
            }
            (State::Hello(_), ToTarget::Notify { .. }) => {
                self.refuse(t, "notification before the credential");
                false
            }
            (State::Serving(_), ToTarget::Hello { .. }) => {
                self.refuse(t, "second hello");
                false
            }
        }
    }

    /// Passes `regions` (their descriptors attached) to connection `t`.
    /// A peer that cannot take them at once (its socket is full right
    /// after it connected, or it does not read) is an error.
    fn grant(&mut self, t: usize, regions: &[(RemoteKey, Served)], last: bool) -> io::Result<()> {
        let conn = self.conns.get(&t).ok_or(io::ErrorKind::NotConnected)?;
        let msg = wire::encode(&ToInitiator::Grant {
            regions: regions
                .iter()
                .map(|(key, s)| {
                    let r = &s.region;
                    Granted {
                        key: *key,
                        len: r.len(),
                        access: r.access(),
                        // Host memory that is not a memory file: registered
                        // only because the backend was configured for
                        // cross-memory attach.
                        attach: (r.shared_fd().is_none() && s.gpu.is_none()).then(|| r.addr()),
                        gpu: s.gpu.clone(),
                    }
                })
                .collect(),
            last,
        });
        let fds: Vec<_> = regions
            .iter()
            .filter_map(|(_, s)| s.region.shared_fd())
            .collect();
        send_msg(conn.sock.as_fd(), &msg, &fds).map(|_| ())
    }

    /// Queues (or sends) an answer; closes a connection whose peer lets
    /// too many pile up.
    fn answer(&mut self, t: usize, msg: Vec<u8>) {
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        if conn.out.is_empty() {
            match send_msg(conn.sock.as_fd(), &msg, &[]) {
                Ok(_) => return,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return self.close(t, "send failed", Some(e)),
            }
        }
        if conn.out.len() >= MAX_QUEUED_ANSWERS {
            return self.refuse(t, "peer does not read its answers");
        }
        conn.out.push_back(msg);
    }

    fn refuse(&mut self, t: usize, why: &'static str) {
        self.shared
            .refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.close(t, why, None);
    }

    fn close(&mut self, t: usize, why: &'static str, error: Option<io::Error>) {
        if let Some(conn) = self.conns.remove(&t) {
            let _ = self
                .poll
                .registry()
                .deregister(&mut SourceFd(&conn.sock.as_raw_fd()));
            match conn.state {
                State::Serving(peer) => {
                    tracing::debug!(%peer, why, error = ?error, "shm: connection closed")
                }
                State::Hello(_) => {
                    tracing::debug!(why, error = ?error, "shm: unauthenticated connection closed")
                }
            }
        }
    }
}
