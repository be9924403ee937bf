//! ZeroMQ channel (pure-Rust `zeromq` 0.7): one ROUTER listener, one DEALER
//! per outgoing connection with a routing id unique per connection.
//!
//! Designed around zeromq 0.7 behaviour: it has no ZMTP heartbeats and a
//! DEALER never reconnects by itself (keep-alive and reconnect belong to the
//! peer machine, which asks for a fresh DEALER each attempt); disconnects are
//! only observed while a receive is pending (every socket task always has a
//! receive in flight); frames sent just before a socket is dropped can be
//! lost (every socket is released with `close().await`, after its queued
//! frames were sent).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, error, warn};
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerSocket, Endpoint, RouterSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage,
};

use super::{Channel, ChannelEvent};
use crate::error::ControlError;
use crate::registry::Link;
use crate::ConnectionId;

/// Bound on one socket send; a send that cannot enter the socket queue in
/// this time fails the connection instead of blocking its task.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on releasing one socket.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Queue depth per connection (frames), and of the event queue.
const QUEUE: usize = 4096;

#[derive(Debug)]
struct Dial {
    out: mpsc::Sender<Bytes>,
    task: JoinHandle<()>,
    rid: Bytes,
    epoch: u64,
}

/// An event and the DEALER generation (open counter) that produced it; 0 for
/// the listener. Events of a DEALER that was replaced are dropped, so a late
/// failure or frame of an old attempt never lands on the new one.
type Tagged = (u64, ChannelEvent);

/// ZeroMQ ROUTER/DEALER channel.
#[derive(Debug)]
pub struct ZmqChannel {
    local_addr: String,
    nonce: u64,
    connect_timeout: Duration,
    events_tx: mpsc::Sender<Tagged>,
    events_rx: mpsc::Receiver<Tagged>,
    router_out: Option<mpsc::Sender<(Bytes, Bytes)>>,
    router_task: Option<JoinHandle<()>>,
    dials: HashMap<ConnectionId, Dial>,
    retired: Vec<JoinHandle<()>>,
    /// Counts every DEALER opened, so even a reconnect of the same
    /// connection id gets a fresh routing id.
    opened: u64,
}

impl ZmqChannel {
    /// Binds a ROUTER on `addr` (`host:port`, port 0 = any). Dials time out
    /// after `connect_timeout`.
    pub async fn bind(addr: &str, connect_timeout: Duration) -> Result<Self, ControlError> {
        let mut router = RouterSocket::new();
        let endpoint =
            router
                .bind(&format!("tcp://{addr}"))
                .await
                .map_err(|e| ControlError::Bind {
                    addr: addr.to_owned(),
                    reason: e.to_string(),
                })?;
        let local_addr = match endpoint {
            Endpoint::Tcp(host, port) => format!("{host}:{port}"),
            other => other.to_string(),
        };
        let (events_tx, events_rx) = mpsc::channel(QUEUE);
        let (router_out, out_rx) = mpsc::channel(QUEUE);
        let router_task = tokio::spawn(run_router(router, out_rx, events_tx.clone()));
        Ok(Self {
            local_addr,
            nonce: rand::random(),
            connect_timeout,
            events_tx,
            events_rx,
            router_out: Some(router_out),
            router_task: Some(router_task),
            dials: HashMap::new(),
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
}

impl Channel for ZmqChannel {
    fn local_addr(&self) -> String {
        self.local_addr.clone()
    }

    fn open(&mut self, id: ConnectionId, addr: &str) {
        self.disconnect(id);
        self.reap_retired();
        let (out, out_rx) = mpsc::channel(QUEUE);
        self.opened += 1;
        let rid = Bytes::from(format!("kvl-{:016x}-{}-{}", self.nonce, id.0, self.opened));
        let epoch = self.opened;
        let task = tokio::spawn(run_dealer(
            epoch,
            id,
            addr.to_owned(),
            rid.clone(),
            self.connect_timeout,
            out_rx,
            self.events_tx.clone(),
        ));
        self.dials.insert(
            id,
            Dial {
                out,
                task,
                rid,
                epoch,
            },
        );
    }

    fn send(&mut self, link: &Link, frame: Bytes) {
        match link {
            Link::Dial(id) => {
                let Some(d) = self.dials.get(id) else { return };
                if d.out.try_send(frame).is_err() {
                    let _ = self.events_tx.try_send((
                        d.epoch,
                        ChannelEvent::Failed {
                            id: *id,
                            reason: "send queue full".into(),
                        },
                    ));
                }
            }
            Link::Accepted(rid) => {
                if let Some(out) = &self.router_out {
                    if out.try_send((rid.clone(), frame)).is_err() {
                        warn!("router send queue full; frame dropped");
                    }
                }
            }
        }
    }

    fn disconnect(&mut self, id: ConnectionId) {
        if let Some(d) = self.dials.remove(&id) {
            // Dropping the sender ends the task after it sent what was queued.
            drop(d.out);
            self.retired.push(d.task);
        }
    }

    async fn recv(&mut self) -> Option<ChannelEvent> {
        loop {
            let (epoch, ev) = match self.router_task.as_mut() {
                None => self.events_rx.recv().await?,
                Some(router) => {
                    let ended = tokio::select! {
                        ev = self.events_rx.recv() => Ok(ev),
                        r = router => Err(r),
                    };
                    match ended {
                        Ok(ev) => ev?,
                        Err(result) => {
                            // The listener never ends on its own: report it, never silently.
                            error!(addr = %self.local_addr, ?result, "router task ended unexpectedly");
                            self.router_task = None;
                            return None;
                        }
                    }
                }
            };
            let id = match &ev {
                ChannelEvent::Frame {
                    link: Link::Dial(id),
                    ..
                }
                | ChannelEvent::Failed { id, .. } => *id,
                ChannelEvent::Frame {
                    link: Link::Accepted(_),
                    ..
                } => return Some(ev),
            };
            if self.dials.get(&id).is_some_and(|d| d.epoch == epoch) {
                return Some(ev);
            }
            debug!(%id, epoch, "dropped event of a replaced DEALER");
        }
    }

    async fn close(&mut self) {
        let ids: Vec<_> = self.dials.keys().copied().collect();
        for id in ids {
            self.disconnect(id);
        }
        self.router_out = None;
        let mut tasks: Vec<_> = self.retired.drain(..).collect();
        tasks.extend(self.router_task.take());
        for mut t in tasks {
            if tokio::time::timeout(CLOSE_TIMEOUT * 2, &mut t)
                .await
                .is_err()
            {
                warn!("socket task did not finish in time; aborting it");
                t.abort();
            }
        }
    }
}

async fn run_router(
    mut sock: RouterSocket,
    mut out: mpsc::Receiver<(Bytes, Bytes)>,
    events: mpsc::Sender<Tagged>,
) {
    loop {
        tokio::select! {
            m = out.recv() => match m {
                Some((rid, frame)) => {
                    let msg = ZmqMessage::try_from(vec![rid, frame]);
                    if let Ok(msg) = msg {
                        match tokio::time::timeout(SEND_TIMEOUT, sock.send(msg)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => debug!(error = %e, "router send failed"),
                            Err(_) => warn!("router send timed out"),
                        }
                    }
                }
                None => break,
            },
            r = sock.recv() => match r {
                Ok(msg) => {
                    let mut frames = msg.into_vec();
                    if frames.len() < 2 {
                        continue;
                    }
                    let rid = frames.remove(0);
                    // One control message per ZMQ message: the last frame.
                    let bytes = frames.pop().unwrap_or_default();
                    if events.send((0, ChannelEvent::Frame { link: Link::Accepted(rid), bytes })).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    debug!(error = %e, "router receive failed");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            },
        }
    }
    if tokio::time::timeout(CLOSE_TIMEOUT, sock.close())
        .await
        .is_err()
    {
        warn!("router close timed out");
    }
}

async fn run_dealer(
    epoch: u64,
    id: ConnectionId,
    addr: String,
    rid: Bytes,
    connect_timeout: Duration,
    mut out: mpsc::Receiver<Bytes>,
    events: mpsc::Sender<Tagged>,
) {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(connect_timeout);
    if let Ok(pid) = PeerIdentity::try_from(rid) {
        opts.peer_identity(pid);
    }
    let mut sock = DealerSocket::with_options(opts);
    let fail = |reason: String| (epoch, ChannelEvent::Failed { id, reason });
    let endpoint = format!("tcp://{addr}");
    let connect = tokio::select! {
        r = tokio::time::timeout(connect_timeout, sock.connect(&endpoint)) => Some(r),
        // Disconnected before the connect finished.
        () = sender_gone(&out) => None,
    };
    match connect {
        Some(Ok(Ok(()))) => {}
        Some(Ok(Err(e))) => {
            let _ = events
                .send(fail(format!("connect to {addr} failed: {e}")))
                .await;
            return;
        }
        Some(Err(_)) => {
            let os = match tokio::time::timeout(
                Duration::from_millis(200),
                tokio::net::TcpStream::connect(&addr),
            )
            .await
            {
                Ok(Err(e)) => e.to_string(),
                _ => "no ZMTP answer".into(),
            };
            let _ = events
                .send(fail(format!(
                    "connect to {addr} timed out after {connect_timeout:?} ({os})"
                )))
                .await;
            return;
        }
        None => return,
    }
    loop {
        tokio::select! {
            m = out.recv() => match m {
                Some(frame) => match tokio::time::timeout(SEND_TIMEOUT, sock.send(ZmqMessage::from(frame))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        let _ = events.try_send(fail(format!("send to {addr} failed: {e}")));
                    }
                    Err(_) => {
                        let _ = events.try_send(fail(format!("send to {addr} timed out")));
                    }
                },
                None => break,
            },
            r = sock.recv() => match r {
                Ok(msg) => {
                    let bytes = msg.into_vec().pop().unwrap_or_default();
                    if events.send((epoch, ChannelEvent::Frame { link: Link::Dial(id), bytes })).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = events.try_send(fail(format!("receive from {addr} failed: {e}")));
                    break;
                }
            },
        }
    }
    if tokio::time::timeout(CLOSE_TIMEOUT, sock.close())
        .await
        .is_err()
    {
        warn!(%addr, "dealer close timed out");
    }
}

/// Resolves once the connection was disconnected (all senders dropped).
async fn sender_gone(out: &mpsc::Receiver<Bytes>) {
    while !out.is_closed() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
