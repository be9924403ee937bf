//! Thin tokio driver: owns a [`Registry`] and a [`Channel`], reads the clock
//! in one place (`now()`) and never blocks on I/O.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{error, info_span, Instrument};

use crate::channel::{Channel, ZmqChannel};
use crate::config::{check_engine_id, Config, LocalInfo, PortPlan, RemoteInfo, Route};
use crate::error::{ControlError, GroupError};
use crate::group::{GroupHandshake, GroupMember};
use crate::ids::ConnectionId;
use crate::ids::Ranks;
use crate::peer::{Event, Role, State, Stats};
use crate::registry::{PeerEvent, Registry};

/// Extra time granted on top of the handshake deadline before a caller gives
/// up on the driver itself (the machine already bounds the handshake).
mod event_loop;
mod events;

use event_loop::run;
use events::EventQueue;
pub use events::EventStream;

const DRIVER_GRACE: Duration = Duration::from_secs(1);

/// The one place the driver reads the clock (tokio's clock, so paused-time
/// tests control it).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Resolves `addr` (`host:port`) and asks the kernel which local address
/// it would send to it from (a connected UDP socket sends nothing). Runs in
/// the caller's task, bounded by `bound`, never in the driver loop; a name
/// that does not resolve gives an empty route (the dial reports the error).
async fn route_to(addr: &str, bound: Duration) -> Route {
    let Ok(Ok(mut addrs)) = tokio::time::timeout(bound, tokio::net::lookup_host(addr)).await else {
        return Route::default();
    };
    let Some(peer) = addrs.next() else {
        return Route::default();
    };
    let unspecified: std::net::SocketAddr = if peer.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let source = std::net::UdpSocket::bind(unspecified)
        .and_then(|s| s.connect(peer).and_then(|()| s.local_addr()))
        .ok()
        .map(|a| a.ip());
    Route {
        peer: Some(peer.ip()),
        source,
    }
}

/// A peer as seen by [`ControlNode::peers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSnapshot {
    /// Connection id.
    pub id: ConnectionId,
    /// Peer address.
    pub addr: String,
    /// State.
    pub state: State,
    /// What it told us in its last handshake.
    pub remote: Option<RemoteInfo>,
}

type ConnectReply = oneshot::Sender<Result<(ConnectionId, RemoteInfo), ControlError>>;

enum Command {
    Connect {
        addr: String,
        route: Route,
        reply: ConnectReply,
    },
    Notify {
        id: ConnectionId,
        transfer_id: u64,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<(), ControlError>>,
    },
    Disconnect {
        id: ConnectionId,
        reply: oneshot::Sender<()>,
    },
    Ping {
        id: ConnectionId,
        reply: oneshot::Sender<Result<Duration, ControlError>>,
    },
    Check {
        id: ConnectionId,
        incarnation: u64,
        reply: oneshot::Sender<Result<(), ControlError>>,
    },
    Snapshot {
        reply: oneshot::Sender<Vec<PeerSnapshot>>,
    },
    SetDataPlane {
        blob: Vec<u8>,
        reply: oneshot::Sender<()>,
    },
    /// The counters alone (an agent reads them every second: no copy of
    /// every peer for that).
    Stats {
        reply: oneshot::Sender<Stats>,
    },
    Close {
        reply: oneshot::Sender<()>,
    },
}

/// A control-plane node driven by tokio.
///
/// Cleanup: [`close`](Self::close) says `bye` to every peer, waits (bounded by
/// `close_linger`) for the acknowledgements, then releases every socket and
/// task; it is idempotent. Dropping the node closes it in the background.
#[derive(Debug)]
pub struct ControlNode {
    config: Arc<Config>,
    local_addr: String,
    cmds: mpsc::Sender<Command>,
    events: broadcast::Sender<PeerEvent>,
    first_events: Mutex<Option<broadcast::Receiver<PeerEvent>>>,
    owner_events: Mutex<Option<EventStream>>,
    /// Async lock: a concurrent `close` waits for the first one to finish.
    task: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

impl ControlNode {
    /// Binds a ZeroMQ ROUTER on `listen_addr` (`host:port`; port 0 binds any
    /// port and [`local_addr`](Self::local_addr) tells the real one).
    pub async fn bind(
        config: Config,
        local: LocalInfo,
        listen_addr: &str,
    ) -> Result<Self, ControlError> {
        config.validate()?;
        check_engine_id(&local.identity.engine_id)?;
        let chan = ZmqChannel::bind(listen_addr, &config).await?;
        Ok(Self::with_channel(config, local, chan))
    }

    /// A node over any channel (e.g. [`crate::channel::MemChannel`]). The
    /// config is [normalized](Config::normalized) rather than refused, and
    /// the engine id is not checked here (peers refuse a malformed one at
    /// the handshake; [`bind`](Self::bind) refuses it up front).
    pub fn with_channel<C: Channel>(config: Config, local: LocalInfo, channel: C) -> Self {
        let config = Arc::new(config.normalized());
        let local_addr = channel.local_addr();
        let registry = Registry::new(Arc::clone(&config), Arc::new(local));
        let (cmds, cmd_rx) = mpsc::channel(1024);
        let (events, first) = broadcast::channel(config.event_capacity);
        let (queue, owner_events) = EventQueue::new(config.event_capacity);
        let last_word = queue.last_word();
        let span = info_span!("control_node", addr = %local_addr);
        let driver =
            tokio::spawn(run(registry, channel, cmd_rx, events.clone(), queue).instrument(span));
        let watch_events = events.clone();
        let watch_addr = local_addr.clone();
        // Supervisor: a driver that dies is logged and reported, never silent.
        let task = tokio::spawn(async move {
            if let Err(e) = driver.await {
                error!(addr = %watch_addr, error = %e, "control driver task died");
                let closed = PeerEvent {
                    id: ConnectionId(0),
                    addr: watch_addr,
                    role: Role::Acceptor,
                    event: Event::Closed,
                };
                let _ = last_word.send(closed.clone());
                let _ = watch_events.send(closed);
            }
        });
        Self {
            config,
            local_addr,
            cmds,
            events,
            first_events: Mutex::new(Some(first)),
            owner_events: Mutex::new(Some(owner_events)),
            task: tokio::sync::Mutex::new(Some(task)),
        }
    }

    /// The address peers dial (real port when bound to port 0).
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// The owner's event stream, once (`None` afterwards): every lifecycle
    /// event since the node was created, never dropped, however far the
    /// reader falls behind (`Ready`, `Suspect`, `Recovered`, `Dead`,
    /// `Restarted`, `Closed` of the connections we dialed and of those that
    /// reached `Ready`; at most a few per such connection, and those are
    /// capped by [`Config::peer_cap`]). Notifications share it but are
    /// bounded: past [`Config::event_capacity`] unread ones, more are
    /// dropped and counted ([`Stats::events_dropped`]). Accepted
    /// connections that never reached `Ready` (refused, evicted, timed-out
    /// handshakes, which anybody can cause) report nothing here, so no
    /// flood of them can push a peer's state change out. Until it is
    /// taken, at most `event_capacity` events of any kind are kept.
    ///
    /// Taking it also drops the receiver [`events`](Self::events) keeps
    /// for its first caller, so an owner that reads only this stream does
    /// not make the node hold a second copy of every event.
    pub fn take_events(&self) -> Option<EventStream> {
        let stream = self
            .owner_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        EventQueue::mark_taken(&stream);
        self.first_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Some(stream)
    }

    /// Event stream for observers (tests, tools): a bounded broadcast that
    /// drops the oldest events for a reader that falls behind
    /// ([`broadcast::error::RecvError::Lagged`]); an owner that must see
    /// every state change reads [`take_events`](Self::take_events). The
    /// first call gets every event since the node was created (unless the
    /// owner stream was taken first); later calls see events from the call
    /// on.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        let first = self
            .first_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        first.unwrap_or_else(|| self.events.subscribe())
    }

    /// Sends a command and awaits its answer; both bounded by `bound`.
    async fn call<T>(
        &self,
        op: &'static str,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
        bound: Duration,
    ) -> Result<T, ControlError> {
        let deadline = tokio::time::Instant::now() + bound;
        let (tx, rx) = oneshot::channel();
        // The queue is almost never full: enqueue without arming a timer.
        match self.cmds.try_send(make(tx)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(ControlError::Closed),
            Err(mpsc::error::TrySendError::Full(cmd)) => {
                match tokio::time::timeout_at(deadline, self.cmds.send(cmd)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return Err(ControlError::Closed),
                    Err(_) => return Err(ControlError::Timeout { op, after: bound }),
                }
            }
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(ControlError::Closed),
            Err(_) => Err(ControlError::Timeout { op, after: bound }),
        }
    }

    /// Dials `addr` and awaits the handshake (bounded by the handshake
    /// deadline). A live connection to `addr` is returned as is.
    pub async fn connect(&self, addr: &str) -> Result<(ConnectionId, RemoteInfo), ControlError> {
        let bound = self.config.handshake_timeout + DRIVER_GRACE;
        let route = route_to(addr, self.config.handshake_timeout).await;
        let make = |reply| Command::Connect {
            addr: addr.to_owned(),
            route,
            reply,
        };
        match self.call("connect", make, bound).await {
            Ok(r) => r,
            Err(ControlError::Timeout { after, .. }) => Err(ControlError::ConnectTimeout {
                addr: addr.to_owned(),
                after,
            }),
            Err(e) => Err(e),
        }
    }

    /// Connects to every tensor-parallel rank of data-parallel rank `dp_rank`
    /// of a remote engine at once (ports `base + dp_rank * tp_size + tp_rank`).
    /// All ranks ready, or an error naming every failing rank with its own
    /// cause, within one handshake deadline after the host is resolved; on
    /// failure no rank stays connected.
    pub async fn connect_group(
        &self,
        host: &str,
        base_port: u16,
        dp_rank: u32,
        tp_size: u32,
    ) -> Result<Vec<GroupMember>, GroupError> {
        let plan = PortPlan::new(base_port, &[dp_rank], tp_size)?;
        // One host: resolved once (ports do not change the route).
        let route = route_to(
            &format!("{host}:{base_port}"),
            self.config.handshake_timeout,
        )
        .await;
        // After the resolution (as in `connect`): the driver gives each rank
        // the handshake deadline from when it dials, so ours ends after it.
        // A rank that turns ready after ours anyway is closed by the driver
        // (its reply finds nobody waiting), so a failed group keeps none.
        let deadline = now() + self.config.handshake_timeout + DRIVER_GRACE;
        let mut pending = Vec::new();
        for ranks in plan.ranks() {
            let addr = format!("{host}:{}", plan.port(ranks)?);
            let (tx, rx) = oneshot::channel();
            let cmd = Command::Connect {
                addr: addr.clone(),
                route,
                reply: tx,
            };
            let sent = matches!(
                tokio::time::timeout_at(deadline.into(), self.cmds.send(cmd)).await,
                Ok(Ok(()))
            );
            pending.push((ranks, addr, sent.then_some(rx)));
        }
        let mut group = GroupHandshake::new(host, deadline);
        for (ranks, addr, rx) in pending {
            let result = match rx {
                None => Err(ControlError::Closed),
                Some(rx) => match tokio::time::timeout_at(deadline.into(), rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => Err(ControlError::Closed),
                    Err(_) => Err(ControlError::ConnectTimeout {
                        addr: addr.clone(),
                        after: self.config.handshake_timeout + DRIVER_GRACE,
                    }),
                },
            };
            record(&mut group, ranks, addr, result);
        }
        group.handle_timeout(now().max(deadline));
        let outcome = group
            .poll_outcome()
            .unwrap_or_else(|| unreachable_outcome(host));
        if outcome.is_err() {
            for id in group.ids() {
                let _ = self.disconnect(id).await;
            }
        }
        outcome
    }

    /// Sends a notification to a ready peer.
    pub async fn notify(
        &self,
        peer: ConnectionId,
        transfer_id: u64,
        payload: Vec<u8>,
    ) -> Result<(), ControlError> {
        if payload.len() > self.config.notify_cap {
            return Err(ControlError::PayloadTooLarge {
                len: payload.len(),
                cap: self.config.notify_cap,
            });
        }
        self.call(
            "notify",
            |reply| Command::Notify {
                id: peer,
                transfer_id,
                payload,
                reply,
            },
            DRIVER_GRACE,
        )
        .await?
    }

    /// Measures one control-plane round trip (ping → pong) to a ready peer,
    /// bounded by the liveness bound.
    pub async fn ping(&self, peer: ConnectionId) -> Result<Duration, ControlError> {
        self.call(
            "ping",
            |reply| Command::Ping { id: peer, reply },
            self.config.death_bound() + DRIVER_GRACE,
        )
        .await?
    }

    /// Checks that `peer` is ready and still the incarnation a transfer was
    /// prepared against; a restarted peer gives
    /// [`ControlError::StaleIncarnation`], so nothing writes through stale rkeys.
    pub async fn ensure_incarnation(
        &self,
        peer: ConnectionId,
        incarnation: u64,
    ) -> Result<(), ControlError> {
        self.call(
            "ensure_incarnation",
            |reply| Command::Check {
                id: peer,
                incarnation,
                reply,
            },
            DRIVER_GRACE,
        )
        .await?
    }

    /// Closes one connection (`bye`, then release). Idempotent.
    pub async fn disconnect(&self, peer: ConnectionId) -> Result<(), ControlError> {
        self.call(
            "disconnect",
            |reply| Command::Disconnect { id: peer, reply },
            DRIVER_GRACE,
        )
        .await
    }

    /// Replaces the data-plane blob of this node's handshakes
    /// ([`LocalInfo::data_plane`]): every handshake that starts after this
    /// returns carries `blob` (new connections, and re-handshakes of
    /// existing ones after a peer restarted). Handshakes already done are
    /// not redone, and one under way finishes with the blob it began with.
    pub async fn set_data_plane(&self, blob: Vec<u8>) -> Result<(), ControlError> {
        self.call(
            "set_data_plane",
            |reply| Command::SetDataPlane { blob, reply },
            DRIVER_GRACE,
        )
        .await
    }

    /// Current peers.
    pub async fn peers(&self) -> Result<Vec<PeerSnapshot>, ControlError> {
        self.call(
            "snapshot",
            |reply| Command::Snapshot { reply },
            DRIVER_GRACE,
        )
        .await
    }

    /// Counters of dropped frames (malformed, oversized, unknown type) and
    /// of refused or dropped inbound peers (`refused_inbound`,
    /// `handshakes_evicted`, `incarnations_evicted`).
    pub async fn stats(&self) -> Result<Stats, ControlError> {
        self.call("stats", |reply| Command::Stats { reply }, DRIVER_GRACE)
            .await
    }

    /// Closes every connection, flushing pending frames (bounded by
    /// `close_linger`), then releases every socket and task. Idempotent.
    pub async fn close(&self) {
        let mut guard = self.task.lock().await;
        let Some(task) = guard.as_mut() else { return };
        let bound = self.config.close_linger + Duration::from_secs(5);
        let _ = self
            .call("close", |reply| Command::Close { reply }, bound)
            .await;
        if tokio::time::timeout(bound, &mut *task).await.is_err() {
            error!(addr = %self.local_addr, "control driver did not stop in time; aborting it");
            task.abort();
        }
        *guard = None;
    }
}

fn record(
    group: &mut GroupHandshake,
    ranks: Ranks,
    addr: String,
    result: Result<(ConnectionId, RemoteInfo), ControlError>,
) {
    match result {
        Ok((id, info)) => {
            group.expect(ranks, addr, Ok(id));
            group.handle_event(id, &Event::Ready(info));
        }
        Err(e) => group.expect(ranks, addr, Err(e.to_string())),
    }
}

fn unreachable_outcome(host: &str) -> Result<Vec<GroupMember>, GroupError> {
    Err(GroupError::RanksFailed {
        host: host.to_owned(),
        total: 0,
        failures: Vec::new(),
    })
}
