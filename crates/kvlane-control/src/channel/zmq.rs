//! ZeroMQ channel (pure-Rust `zeromq` 0.7): one ROUTER listener, one DEALER
//! per outgoing connection with a routing id unique per connection.
//!
//! The driver does the socket work itself, with no task between it and the
//! sockets on the common path: [`Channel::send`] hands a frame straight to
//! the socket's send half (see the `lane` module for the rare send that
//! would wait), and [`Channel::recv`] polls the ROUTER's and every DEALER's
//! receive half in the driver's own `select!`. Only dialing (connect and
//! ZMTP handshake) runs in a task per attempt.
//!
//! Designed around zeromq 0.7 behaviour: it has no ZMTP heartbeats and a
//! DEALER never reconnects by itself (keep-alive and reconnect belong to the
//! peer machine, which asks for a fresh DEALER each attempt); disconnects are
//! only observed while a receive is pending (each DEALER's receive is a
//! stream held by the channel, so a receive stays in flight between polls,
//! and the driver polls [`Channel::recv`] whenever it waits); frames sent just
//! before a socket is dropped can be lost, so the ROUTER is released with
//! `close().await` (after the frames queued behind a waiting send were sent)
//! and a DEALER, which has no binds to close, only once its spill is drained.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::channel::mpsc as fmpsc;
use futures::stream::{self, BoxStream, StreamExt};
use futures::FutureExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerRecvHalf, DealerSocket, Endpoint, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket,
    SocketEvent, SocketOptions, SocketRecv, ZmqMessage, ZmqResult, MESSAGE_PART_OVERHEAD,
};

use super::inbound::Inbound;
use super::lane::{DealerTx, Lane, Report, QUEUE, SEND_TIMEOUT};
use super::{Channel, ChannelEvent};
use crate::config::Config;
use crate::error::ControlError;
use crate::eviction::{Eviction, Unproven};
use crate::hedge::{HEDGE_AFTER, HEDGE_ATTEMPTS};
use crate::ids::ConnectionId;
use crate::registry::Link;

/// Bound on releasing one socket or task.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a dial task or a spill reports to the driver.
enum Side {
    /// An event and the DEALER generation (open counter) that produced it.
    Event(u64, ChannelEvent),
    /// A DEALER finished its connect and handshake.
    Connected {
        epoch: u64,
        id: ConnectionId,
        sock: DealerSocket,
        /// The DEALER's monitor, opened before its connect.
        monitor: fmpsc::Receiver<SocketEvent>,
    },
}

/// A frame (or the receive error that ended it) from a DEALER generation.
type Received = (ConnectionId, u64, Result<Bytes, String>);

enum DialState {
    /// Connect in progress; frames wait here (at most `QUEUE`).
    Connecting {
        task: JoinHandle<()>,
        queued: Vec<Bytes>,
    },
    /// Connected; its receive half is in `ZmqChannel::inbound` under the epoch.
    Open(Lane<DealerTx>),
}

struct Dial {
    rid: Bytes,
    epoch: u64,
    addr: String,
    state: DialState,
}

struct Router {
    /// Frames to the listener; keeps its receive in flight between polls.
    rx: BoxStream<'static, ZmqResult<ZmqMessage>>,
    tx: Lane<RouterSendHalf>,
    /// Holds the listener's accept task (moved here before the split, which
    /// has no `close`), so `close().await` still waits until the port is free.
    binds: RouterSocket,
    /// Accepted / disconnected connections, for [`Channel::peer_ip`] and
    /// the silence sweep.
    monitor: fmpsc::Receiver<SocketEvent>,
    /// Open accepted connections by routing id; at most one entry per
    /// open connection (the accept cap bounds it).
    accepted: HashMap<Bytes, AcceptedConn>,
    /// An accepted connection that sends no frame for this long after its
    /// accept is closed ([`Config::handshake_timeout`]).
    silence: Duration,
    /// When the silence sweep runs next.
    sweep_at: Instant,
}

/// What the channel knows of an accepted connection.
struct AcceptedConn {
    /// Where it comes from (`None` for a non-IP endpoint).
    ip: Option<std::net::IpAddr>,
    /// When the channel learnt of it.
    at: Instant,
    /// Whether a connection of the registry started on it.
    adopted: bool,
}

impl Router {
    fn on_monitor(&mut self, ev: SocketEvent) {
        match ev {
            SocketEvent::Accepted(endpoint, rid) => {
                let ip = match endpoint {
                    Endpoint::Tcp(zeromq::Host::Ipv4(ip), _) => Some(std::net::IpAddr::V4(ip)),
                    Endpoint::Tcp(zeromq::Host::Ipv6(ip), _) => Some(std::net::IpAddr::V6(ip)),
                    _ => None,
                };
                // Its first frames may have been read before this report.
                self.accepted
                    .entry(Bytes::from(rid))
                    .or_insert_with(|| AcceptedConn {
                        ip: None,
                        at: Instant::now(),
                        adopted: false,
                    })
                    .ip = ip;
            }
            SocketEvent::Disconnected(rid) => {
                self.accepted.remove(&Bytes::from(rid));
            }
            _ => {}
        }
    }

    /// A connection of the registry started on accepted link `rid`. (Its
    /// hello may have been read before the monitor reported the accept: an
    /// entry made here is removed when the registry releases the link.)
    fn adopt(&mut self, rid: &Bytes) {
        self.accepted
            .entry(rid.clone())
            .or_insert_with(|| AcceptedConn {
                ip: None,
                at: Instant::now(),
                adopted: true,
            })
            .adopted = true;
    }

    /// Closes accepted connection `rid` once the frames queued for it are
    /// in the socket (a task waits, bounded, while a spill holds some).
    fn close(&mut self, rid: &Bytes, retired: &mut Vec<JoinHandle<()>>) {
        let known = self.accepted.remove(rid).is_some();
        let half = self.tx.handle().clone();
        match self.tx.spilled() {
            // (One waiting task per connection, not per frame of a flood.)
            Some(pending) if known => {
                let rid = rid.clone();
                retired.push(tokio::spawn(async move {
                    let give_up = Instant::now() + SEND_TIMEOUT;
                    while pending.load(Ordering::Acquire) > 0 && Instant::now() < give_up {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    half.disconnect_peer(rid);
                }));
            }
            _ => half.disconnect_peer(rid.clone()),
        }
    }

    /// Closes the accepted connections that no registry connection
    /// adopted within `silence` of their accept (completing the ZMTP
    /// handshake and then keeping quiet, or sending only garbage, held a
    /// slot under the accept cap for good); sets the next sweep.
    fn sweep(&mut self, retired: &mut Vec<JoinHandle<()>>) {
        let now = Instant::now();
        let silent: Vec<Bytes> = self
            .accepted
            .iter()
            .filter(|(_, a)| !a.adopted && now.duration_since(a.at) >= self.silence)
            .map(|(rid, _)| rid.clone())
            .collect();
        if !silent.is_empty() {
            debug!(
                closed = silent.len(),
                "closed accepted connections that started no handshake within the handshake timeout"
            );
        }
        for rid in &silent {
            self.close(rid, retired);
        }
        self.sweep_at = now + (self.silence / 2).max(Duration::from_millis(50));
    }
}

/// ZeroMQ ROUTER/DEALER channel.
pub struct ZmqChannel {
    local_addr: String,
    nonce: u64,
    connect_timeout: Duration,
    max_message: usize,
    side_tx: mpsc::UnboundedSender<Side>,
    side_rx: mpsc::UnboundedReceiver<Side>,
    /// `None` once closed.
    router: Option<Router>,
    dials: HashMap<ConnectionId, Dial>,
    /// Receive streams of the open DEALERs by epoch; each keeps its receive
    /// in flight.
    inbound: Inbound<BoxStream<'static, Received>>,
    retired: Vec<JoinHandle<()>>,
    /// Counts every DEALER opened, so even a reconnect of the same
    /// connection id gets a fresh routing id; events of a DEALER that was
    /// replaced are dropped, so a late failure or frame of an old attempt
    /// never lands on the new one.
    opened: u64,
}

impl fmt::Debug for ZmqChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZmqChannel")
            .field("local_addr", &self.local_addr)
            .field("dials", &self.dials.len())
            .field("closed", &self.router.is_none())
            .finish_non_exhaustive()
    }
}

impl ZmqChannel {
    /// Binds a ROUTER on `addr` (`host:port`, port 0 = any) with the limits
    /// of `config`: dials and the ZMTP handshake of accepted connections time
    /// out after [`Config::handshake_timeout`]; a ZeroMQ message (every
    /// frame, a multipart message summed) announcing more than
    /// [`Config::frame_cap`] ends its connection before anything is reserved
    /// for it; at most [`Config::peer_cap`] + [`Config::handshake_cap`]
    /// accepted connections are open at once: past that a new connection
    /// evicts one that has not proven itself (see
    /// [`Channel::protect_accepted`]): the one that has waited on its peer
    /// the longest (silent, slow or stuck), never one this side has not
    /// served yet, while one whose first message arrived (a hello, being
    /// judged or in a keyed handshake) is spared, within bounds (the
    /// `eviction` module). While none may go, the new connection waits
    /// and no other is accepted; it is closed on accept only when every
    /// open one has proven itself.
    pub async fn bind(addr: &str, config: &Config) -> Result<Self, ControlError> {
        let max_message = zmq_message_cap(config.frame_cap);
        let mut opts = SocketOptions::default();
        opts.max_message_size(max_message)
            .handshake_timeout(config.handshake_timeout)
            .max_connections(config.peer_cap.saturating_add(config.handshake_cap))
            .eviction_policy(eviction_policy(config));
        let mut router = RouterSocket::with_options(opts);
        let endpoint =
            router
                .bind(&format!("tcp://{addr}"))
                .await
                .map_err(|e| ControlError::Bind {
                    addr: addr.to_owned(),
                    reason: e.to_string(),
                })?;
        let local_addr = match endpoint {
            // `host:port` as peers dial it: an IPv6 host in brackets.
            Endpoint::Tcp(zeromq::Host::Ipv6(ip), port) => format!("[{ip}]:{port}"),
            Endpoint::Tcp(host, port) => format!("{host}:{port}"),
            other => other.to_string(),
        };
        let monitor = router.monitor();
        let mut binds = RouterSocket::new();
        binds.binds().extend(router.binds().drain());
        let (tx, rx) = router.split();
        let report: Report =
            Arc::new(|reason| debug!(%reason, "router send failed; frame dropped"));
        let (side_tx, side_rx) = mpsc::unbounded_channel();
        Ok(Self {
            local_addr,
            nonce: rand::random(),
            connect_timeout: config.handshake_timeout,
            max_message,
            side_tx,
            side_rx,
            router: Some(Router {
                rx: listen(rx),
                tx: Lane::new(tx, report),
                binds,
                monitor,
                accepted: HashMap::new(),
                silence: config.handshake_timeout,
                sweep_at: Instant::now() + config.handshake_timeout,
            }),
            dials: HashMap::new(),
            inbound: Inbound::new(),
            retired: Vec::new(),
            opened: 0,
        })
    }

    /// The routing id of the current DEALER of connection `id`. Unique per
    /// DEALER (node nonce + connection id + open counter), never derived
    /// from the peer address.
    pub fn routing_id(&self, id: ConnectionId) -> Option<Bytes> {
        self.dials.get(&id).map(|d| d.rid.clone())
    }

    fn reap_retired(&mut self) {
        self.retired.retain(|t| !t.is_finished());
    }

    /// Reports a failure of DEALER generation `epoch` through `recv`.
    fn fail(&self, epoch: u64, id: ConnectionId, reason: String) {
        let _ = self
            .side_tx
            .send(Side::Event(epoch, ChannelEvent::Failed { id, reason }));
    }

    fn is_current(&self, id: ConnectionId, epoch: u64) -> bool {
        self.dials.get(&id).is_some_and(|d| d.epoch == epoch)
    }

    /// A dial finished connecting: split the DEALER, start receiving, send
    /// what was queued meanwhile.
    fn connected(
        &mut self,
        epoch: u64,
        id: ConnectionId,
        sock: DealerSocket,
        monitor: fmpsc::Receiver<SocketEvent>,
    ) {
        let Some(dial) = self.dials.get_mut(&id).filter(|d| d.epoch == epoch) else {
            debug!(%id, epoch, "dropped a DEALER that connected after it was replaced");
            return;
        };
        let DialState::Connecting { queued, .. } = &mut dial.state else {
            return;
        };
        let queued = std::mem::take(queued);
        let (tx, rx) = sock.split();
        self.inbound
            .insert(epoch, receive(id, epoch, dial.addr.clone(), rx, monitor));
        let side = self.side_tx.clone();
        let addr = dial.addr.clone();
        let report: Report = Arc::new(move |reason| {
            let _ = side.send(Side::Event(
                epoch,
                ChannelEvent::Failed {
                    id,
                    reason: format!("{addr}: {reason}"),
                },
            ));
        });
        let mut lane = Lane::new(DealerTx::new(tx), report);
        for frame in queued {
            lane.send(ZmqMessage::from(frame), &mut self.retired);
        }
        dial.state = DialState::Open(lane);
    }
}

impl Channel for ZmqChannel {
    fn local_addr(&self) -> String {
        self.local_addr.clone()
    }

    fn open(&mut self, id: ConnectionId, addr: &str) {
        self.disconnect(id);
        self.reap_retired();
        self.opened += 1;
        let rid = Bytes::from(format!("kvl-{:016x}-{}-{}", self.nonce, id.0, self.opened));
        let epoch = self.opened;
        let task = tokio::spawn(dial(
            epoch,
            id,
            addr.to_owned(),
            rid.clone(),
            self.connect_timeout,
            self.max_message,
            self.side_tx.clone(),
        ));
        self.dials.insert(
            id,
            Dial {
                rid,
                epoch,
                addr: addr.to_owned(),
                state: DialState::Connecting {
                    task,
                    queued: Vec::new(),
                },
            },
        );
    }

    fn peer_ip(&mut self, link: &Link) -> Option<std::net::IpAddr> {
        let Link::Accepted(rid) = link else {
            return None;
        };
        let router = self.router.as_mut()?;
        // The accept task reports a connection right after registering it,
        // so its first frames can be read before the report: take what is
        // queued now.
        while let Some(Some(ev)) = router.monitor.next().now_or_never() {
            router.on_monitor(ev);
        }
        router.accepted.get(rid).and_then(|a| a.ip)
    }

    fn send(&mut self, link: &Link, frame: Bytes) {
        match link {
            Link::Dial(id) => {
                let Some(d) = self.dials.get_mut(id) else {
                    return;
                };
                match &mut d.state {
                    DialState::Open(tx) => tx.send(ZmqMessage::from(frame), &mut self.retired),
                    DialState::Connecting { queued, .. } if queued.len() < QUEUE => {
                        queued.push(frame)
                    }
                    DialState::Connecting { .. } => {
                        let epoch = d.epoch;
                        self.fail(epoch, *id, "send queue full".into());
                    }
                }
            }
            Link::Accepted(rid) => {
                let Some(router) = &mut self.router else {
                    return;
                };
                if let Ok(msg) = ZmqMessage::try_from(vec![rid.clone(), frame]) {
                    router.tx.send(msg, &mut self.retired);
                }
            }
        }
    }

    fn adopt_accepted(&mut self, rid: &Bytes) {
        if let Some(router) = self.router.as_mut() {
            router.adopt(rid);
        }
    }

    fn protect_accepted(&mut self, rid: &Bytes) {
        if let Some(router) = self.router.as_ref() {
            router.tx.handle().protect_peer(rid.clone());
        }
    }

    fn close_accepted(&mut self, rid: &Bytes) {
        if let Some(router) = self.router.as_mut() {
            router.close(rid, &mut self.retired);
        }
    }

    fn disconnect(&mut self, id: ConnectionId) {
        let Some(d) = self.dials.remove(&id) else {
            return;
        };
        match d.state {
            DialState::Connecting { task, .. } => {
                task.abort();
                self.retired.push(task);
            }
            // Frames already handed to the socket are written by zeromq's
            // writer after the halves are dropped; a spill sends its queue first.
            DialState::Open(tx) => {
                self.inbound.remove(d.epoch);
                tx.retire(&mut self.retired);
            }
        }
    }

    async fn recv(&mut self) -> Option<ChannelEvent> {
        loop {
            let router = self.router.as_mut()?;
            tokio::select! {
                side = self.side_rx.recv() => match side {
                    Some(Side::Event(epoch, ev)) => {
                        let ChannelEvent::Failed { id, .. } = &ev else { return Some(ev) };
                        if self.is_current(*id, epoch) {
                            return Some(ev);
                        }
                        debug!(%id, epoch, "dropped a failure of a replaced DEALER");
                    }
                    Some(Side::Connected {
                        epoch,
                        id,
                        sock,
                        monitor,
                    }) => self.connected(epoch, id, sock, monitor),
                    // The channel holds a sender itself.
                    None => return None,
                },
                Some(ev) = router.monitor.next() => router.on_monitor(ev),
                () = tokio::time::sleep_until(router.sweep_at.into()) => {
                    router.sweep(&mut self.retired);
                    self.reap_retired();
                }
                Some(msg) = router.rx.next() => match msg {
                    Ok(msg) => {
                        let mut frames = msg.into_vec();
                        if frames.len() < 2 {
                            continue;
                        }
                        // One control message per ZMQ message: the last frame.
                        let bytes = frames.pop().unwrap_or_default();
                        let rid = frames.swap_remove(0);
                        return Some(ChannelEvent::Frame { link: Link::Accepted(rid), bytes });
                    }
                    Err(e) => debug!(error = %e, "router receive failed"),
                },
                (id, epoch, r) = std::future::poll_fn(|cx| self.inbound.poll_next(cx)) => {
                    if !self.is_current(id, epoch) {
                        debug!(%id, epoch, "dropped a frame of a replaced DEALER");
                        continue;
                    }
                    return Some(match r {
                        Ok(bytes) => ChannelEvent::Frame { link: Link::Dial(id), bytes },
                        Err(reason) => ChannelEvent::Failed { id, reason },
                    });
                }
            }
        }
    }

    async fn close(&mut self) {
        let ids: Vec<_> = self.dials.keys().copied().collect();
        for id in ids {
            self.disconnect(id);
        }
        self.inbound.clear();
        // Spilled frames (of dials and of the router) are sent before the
        // listener and the accepted connections are released.
        let router = self.router.take().map(|Router { rx, tx, binds, .. }| {
            tx.retire(&mut self.retired);
            (rx, binds)
        });
        for mut t in self.retired.drain(..) {
            if tokio::time::timeout(CLOSE_TIMEOUT, &mut t).await.is_err() {
                warn!("socket task did not finish in time; aborting it");
                t.abort();
            }
        }
        if let Some((rx, binds)) = router {
            if tokio::time::timeout(CLOSE_TIMEOUT, binds.close())
                .await
                .is_err()
            {
                warn!(addr = %self.local_addr, "router close timed out");
            }
            drop(rx);
        }
    }
}

/// The ZeroMQ message size limit for a frame cap: one control frame plus
/// room for the per-part accounting of a few (empty) envelope parts.
fn zmq_message_cap(frame_cap: usize) -> usize {
    frame_cap.saturating_add(4 * MESSAGE_PART_OVERHEAD)
}

/// The accept cap's choice of a connection to evict (the `eviction`
/// module), on what the zeromq accept loop knows of each.
fn eviction_policy(config: &Config) -> zeromq::EvictionPolicy {
    let policy = Eviction::from_config(config);
    Arc::new(move |open: &[zeromq::AcceptedSlot], now| {
        let open: Vec<Unproven> = open
            .iter()
            .map(|s| Unproven {
                accepted: s.accepted,
                last_step: s.last_step,
                waiting_since: s.waiting_since,
                first_message: s.first_message,
            })
            .collect();
        policy.choose(&open, now)
    })
}

/// What the ROUTER receives. A receive error is not expected (the ROUTER
/// waits while it has no peers); the stream pauses after one so it never spins.
fn listen(half: RouterRecvHalf) -> BoxStream<'static, ZmqResult<ZmqMessage>> {
    stream::unfold(half, |mut half| async move {
        let r = half.recv().await;
        if r.is_err() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Some((r, half))
    })
    .boxed()
}

/// Connects one DEALER (routing id `rid`) and hands it to the channel.
async fn dial(
    epoch: u64,
    id: ConnectionId,
    addr: String,
    rid: Bytes,
    connect_timeout: Duration,
    max_message: usize,
    side: mpsc::UnboundedSender<Side>,
) {
    let mut opts = SocketOptions::default();
    // A connect or greeting unanswered for 200 ms gets a fresh connection
    // beside it (the `hedge` module: a SYN dropped by a full accept queue
    // is resent by the kernel only after 1 s).
    opts.connect_timeout(connect_timeout)
        .max_message_size(max_message)
        .hedged_connect(HEDGE_AFTER, HEDGE_ATTEMPTS);
    if let Ok(pid) = PeerIdentity::try_from(rid) {
        opts.peer_identity(pid);
    }
    let mut sock = DealerSocket::with_options(opts);
    let monitor = sock.monitor();
    let endpoint = format!("tcp://{addr}");
    let reason = match tokio::time::timeout(connect_timeout, sock.connect(&endpoint)).await {
        Ok(Ok(())) => {
            let _ = side.send(Side::Connected {
                epoch,
                id,
                sock,
                monitor,
            });
            return;
        }
        Ok(Err(e)) => format!("connect to {addr} failed: {e}"),
        Err(_) => {
            let os = match tokio::time::timeout(
                Duration::from_millis(200),
                tokio::net::TcpStream::connect(&addr),
            )
            .await
            {
                Ok(Err(e)) => e.to_string(),
                _ => "no ZMTP answer".into(),
            };
            format!("connect to {addr} timed out after {connect_timeout:?} ({os})")
        }
    };
    let _ = side.send(Side::Event(epoch, ChannelEvent::Failed { id, reason }));
}

/// The frames a DEALER receives, ending after the first receive error or
/// the end of its connection. The pending receive lives in the stream, so
/// it stays in flight between polls.
///
/// A connection the listener closed (an EOF, as when its accept cap evicts
/// it) ends without a receive error: zeromq drops the peer and its receive
/// waits for another, reporting the loss only on the monitor. Without
/// watching it, a dial whose connection was closed after the ZMTP
/// handshake waited out the whole handshake timeout instead of failing
/// (and being retried) at once. The monitor reports the loss only after
/// the frames that came before it were received.
fn receive(
    id: ConnectionId,
    epoch: u64,
    addr: String,
    half: DealerRecvHalf,
    monitor: fmpsc::Receiver<SocketEvent>,
) -> BoxStream<'static, Received> {
    let lost_addr = addr.clone();
    let frames = stream::unfold(Some((half, addr)), move |state| async move {
        let (mut half, addr) = state?;
        match half.recv().await {
            Ok(msg) => {
                let bytes = msg.into_vec().pop().unwrap_or_default();
                Some(((id, epoch, Ok(bytes)), Some((half, addr))))
            }
            Err(e) => {
                let reason = format!("receive from {addr} failed: {e}");
                Some(((id, epoch, Err(reason)), None))
            }
        }
    });
    let lost = monitor
        .filter(|ev| std::future::ready(matches!(ev, SocketEvent::Disconnected(_))))
        .map(move |_| {
            let reason = format!("connection to {lost_addr} closed by the peer");
            (id, epoch, Err(reason))
        });
    stream::select(frames, lost)
        .scan(false, |ended, item: Received| {
            if *ended {
                return std::future::ready(None);
            }
            *ended = item.2.is_err();
            std::future::ready(Some(item))
        })
        .boxed()
}
