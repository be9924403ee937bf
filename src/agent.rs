//! [`Agent`]: one engine's endpoint — its registered KV cache, its control
//! node and its data-plane backend.

use crate::error::{Error, ErrorKind};
use crate::peer::{Peer, PeerEntry};
use bytes::Bytes;
use kvlane_control::{Config, ConnectionId, ControlNode, Event, LocalInfo, Ranks, RemoteInfo};
use kvlane_data::{Backend, Endpoint, KvLayout, Region, RemoteRegion, Transport};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// Which data-plane backend an agent uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BackendChoice {
    /// The best this machine has: verbs when built with the `verbs`
    /// feature and a device is usable, else tcp (the reason is logged).
    #[default]
    Auto,
    /// Software one-sided RDMA over TCP.
    Tcp,
    /// In-process only (both agents in one process).
    Loopback,
    /// libibverbs (feature `verbs`).
    Verbs,
}

/// One KV cache as advertised in the handshake.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct KvAdvert {
    pub(crate) region: RemoteRegion,
    pub(crate) layout: KvLayout,
}

/// The data-plane blob this agent puts in its handshake.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct DataPlaneInfo {
    /// `None` when the backend needs an endpoint per peer.
    pub(crate) endpoint: Option<Endpoint>,
    pub(crate) kv: Vec<KvAdvert>,
}

/// A notification delivered to this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Engine id of the sender.
    pub from: String,
    /// What the sender attached.
    pub payload: Bytes,
}

/// Notification framing on the data plane: who sent it, then the payload.
#[derive(Serialize, Deserialize)]
pub(crate) struct NotifyFrame {
    pub(crate) from: String,
    #[serde(with = "serde_bytes_vec")]
    pub(crate) payload: Vec<u8>,
}

mod serde_bytes_vec {
    use serde::{Deserializer, Serializer};
    pub(crate) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
        }
        d.deserialize_bytes(V)
    }
}

/// What happened to a peer, as seen by the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEventKind {
    /// Handshake done; the peer's KV cache is reachable.
    Up {
        /// Its engine id.
        engine_id: String,
        /// Its incarnation.
        incarnation: u64,
    },
    /// Keep-alives went unanswered.
    Suspect,
    /// It answered again.
    Recovered,
    /// It is dead; its in-flight transfers failed with `PeerLost`.
    Dead {
        /// Attempts or unanswered pings.
        attempts: u32,
        /// Last error.
        last_error: String,
    },
    /// It restarted; transfers prepared against `old` fail as stale.
    Restarted {
        /// Old incarnation.
        old: u64,
        /// New incarnation.
        new: u64,
    },
    /// The handshake was refused.
    Refused {
        /// Why.
        reason: String,
    },
    /// Connection released.
    Closed,
}

/// A peer event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerEvent {
    /// The connection.
    pub peer: ConnectionId,
    /// Its address.
    pub addr: String,
    /// What happened.
    pub kind: PeerEventKind,
}

/// Builds an [`Agent`].
pub struct AgentBuilder {
    engine_id: String,
    ranks: Ranks,
    listen: String,
    data_listen: Option<String>,
    advertise: Option<String>,
    backend: BackendChoice,
    control: Config,
    fingerprint: String,
    kv: Vec<(KvLayout, Region)>,
    custom: Option<Box<dyn Backend>>,
}

impl std::fmt::Debug for AgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBuilder")
            .field("engine_id", &self.engine_id)
            .field("listen", &self.listen)
            .field("backend", &self.backend)
            .field("custom_backend", &self.custom.as_ref().map(|b| b.kind()))
            .finish_non_exhaustive()
    }
}

impl Default for AgentBuilder {
    fn default() -> Self {
        Self {
            engine_id: format!("kvlane-{}", std::process::id()),
            ranks: Ranks {
                dp_rank: 0,
                tp_rank: 0,
                tp_size: 1,
            },
            listen: "127.0.0.1:0".into(),
            data_listen: None,
            advertise: None,
            backend: BackendChoice::Auto,
            control: Config::default(),
            fingerprint: "kvlane".into(),
            kv: Vec::new(),
            custom: None,
        }
    }
}

impl AgentBuilder {
    /// This engine's id (shown to peers, carried in notifications).
    pub fn engine_id(mut self, id: impl Into<String>) -> Self {
        self.engine_id = id.into();
        self
    }

    /// This engine's ranks.
    pub fn ranks(mut self, dp_rank: u32, tp_rank: u32, tp_size: u32) -> Self {
        self.ranks = Ranks {
            dp_rank,
            tp_rank,
            tp_size,
        };
        self
    }

    /// Control-plane listen address (`host:port`, port 0 = any).
    pub fn listen(mut self, addr: impl Into<String>) -> Self {
        self.listen = addr.into();
        self
    }

    /// Data-plane (tcp backend) listen address; default: the control
    /// host with port 0.
    pub fn data_listen(mut self, addr: impl Into<String>) -> Self {
        self.data_listen = Some(addr.into());
        self
    }

    /// The host (IP address or name) peers are told to reach this agent's
    /// data plane at, when it listens on a wildcard address (`0.0.0.0`,
    /// `::`). Without it, each peer is given the address its own control
    /// connection reached this agent at.
    pub fn advertise(mut self, host: impl Into<String>) -> Self {
        self.advertise = Some(host.into());
        self
    }

    /// The data-plane backend.
    pub fn backend(mut self, backend: BackendChoice) -> Self {
        self.backend = backend;
        self
    }

    /// Uses this backend instance (a configured `TcpBackend`, a verbs
    /// backend on a chosen device, your own) instead of [`backend`](Self::backend).
    pub fn backend_instance(mut self, backend: impl Backend) -> Self {
        self.custom = Some(Box::new(backend));
        self
    }

    /// A pre-shared key: the handshake is authenticated and no peer learns
    /// a key or address of this agent's memory without it.
    pub fn psk(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.control.psk = Some(kvlane_control::Psk::new(key));
        self
    }

    /// Control-plane settings (keep-alive, liveness budget, deadlines).
    pub fn control_config(mut self, config: Config) -> Self {
        let psk = self.control.psk.take();
        self.control = config;
        if self.control.psk.is_none() {
            self.control.psk = psk;
        }
        self
    }

    /// Configuration fingerprint; peers with a different one are refused.
    pub fn fingerprint(mut self, fp: impl Into<String>) -> Self {
        self.fingerprint = fp.into();
        self
    }

    /// Registers a KV cache (`region` laid out as `layout`). Caches are
    /// advertised in the handshake, so they are registered before the agent
    /// starts listening; transfers use the first one.
    pub fn register_kv(mut self, layout: KvLayout, region: Region) -> Self {
        self.kv.push((layout, region));
        self
    }

    /// Creates the backend, registers memory, binds the control node and
    /// starts the agent's event task. Needs a tokio runtime.
    pub async fn build(self) -> Result<Agent, Error> {
        let data_listen = match &self.data_listen {
            Some(a) => a.clone(),
            None => format!("{}:0", host_of(&self.listen)),
        };
        let mut backend = match self.custom {
            Some(b) => b,
            None => crate::backend::create(self.backend, &data_listen, self.advertise.as_deref())?,
        };
        let mut kv = Vec::new();
        let mut adverts = Vec::new();
        for (layout, region) in self.kv {
            let need = layout.required_len().unwrap_or(u64::MAX);
            if need > region.len() {
                return Err(Error::msg(
                    ErrorKind::InvalidInput,
                    format!(
                        "KV layout needs {need} bytes but {} has {} bytes",
                        region.id(),
                        region.len()
                    ),
                ));
            }
            let ad = backend.register(&region)?;
            adverts.push(KvAdvert { region: ad, layout });
            kv.push(LocalKv { layout, region });
        }
        let per_peer = backend.endpoint_per_peer();
        let endpoint = if per_peer {
            None
        } else {
            let (probe_peer, endpoint) = backend.prepare_peer()?;
            backend.remove_peer(probe_peer);
            Some(endpoint)
        };
        let exchange_timeout = self.control.handshake_timeout + std::time::Duration::from_secs(1);
        let blob = DataPlaneInfo {
            endpoint,
            kv: adverts,
        };
        let blob = rmp_serde::to_vec_named(&blob)
            .map_err(|e| Error::msg(ErrorKind::InvalidInput, format!("encode handshake: {e}")))?;
        let mut local = LocalInfo::new(self.engine_id.clone(), self.ranks, self.fingerprint);
        local = local.with_data_plane(blob);
        let incarnation = local.incarnation;
        let transport = Transport::new(backend)?;
        let control = ControlNode::bind(self.control, local, &self.listen).await?;
        let (events, _) = broadcast::channel(1024);
        let (note_tx, note_rx) = mpsc::unbounded_channel();
        let data_notes = transport.take_notifications();
        let inner = Arc::new(Inner {
            engine_id: self.engine_id,
            incarnation,
            control,
            transport,
            kv,
            peers: Mutex::new(HashMap::new()),
            events,
            notifications: Mutex::new(Some(note_rx)),
            note_tx,
            tasks: Mutex::new(Vec::new()),
            runtime: tokio::runtime::Handle::current(),
            conn_locks: Mutex::new(HashMap::new()),
            per_peer,
            offers: Mutex::new(HashMap::new()),
            exchange_timeout,
        });
        let mut control_events = inner.control.events();
        let weak = Arc::downgrade(&inner);
        let control_task = tokio::spawn(async move {
            loop {
                let ev = match control_events.recv().await {
                    Ok(ev) => ev,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        warn!(missed = n, "agent lagged behind control events");
                        continue;
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                };
                let Some(inner) = weak.upgrade() else { break };
                inner.on_control_event(ev).await;
            }
        });
        let weak = Arc::downgrade(&inner);
        let note_task = tokio::spawn(async move {
            let Some(mut rx) = data_notes else { return };
            while let Some(n) = rx.recv().await {
                let Some(inner) = weak.upgrade() else { break };
                match rmp_serde::from_slice::<NotifyFrame>(&n.payload) {
                    Ok(f) => {
                        let _ = inner.note_tx.send(Notification {
                            from: f.from,
                            payload: Bytes::from(f.payload),
                        });
                    }
                    Err(e) => warn!(error = %e, "dropping a malformed data-plane notification"),
                }
            }
        });
        lock(&inner.tasks).extend([control_task, note_task]);
        info!(engine = %inner.engine_id, addr = inner.control.local_addr(), "agent up");
        Ok(Agent { inner })
    }
}

/// Whether a control address names a peer that dialed us.
pub(crate) fn is_inbound(addr: &str) -> bool {
    addr.starts_with("inbound:")
}

fn host_of(addr: &str) -> &str {
    match addr.rsplit_once(':') {
        Some((host, _)) => host,
        None => addr,
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) struct LocalKv {
    pub(crate) layout: KvLayout,
    pub(crate) region: Region,
}

pub(crate) struct Inner {
    pub(crate) engine_id: String,
    pub(crate) incarnation: u64,
    pub(crate) control: ControlNode,
    pub(crate) transport: Transport,
    pub(crate) kv: Vec<LocalKv>,
    pub(crate) peers: Mutex<HashMap<ConnectionId, PeerEntry>>,
    events: broadcast::Sender<PeerEvent>,
    notifications: Mutex<Option<mpsc::UnboundedReceiver<Notification>>>,
    pub(crate) note_tx: mpsc::UnboundedSender<Notification>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The runtime the agent was built on (posts from plain threads use it).
    pub(crate) runtime: tokio::runtime::Handle,
    /// Per-connection locks: `connect` and the event task may both attach
    /// the same connection.
    pub(crate) conn_locks: Mutex<HashMap<ConnectionId, Arc<tokio::sync::Mutex<()>>>>,
    /// The backend needs an endpoint per peer (verbs): exchanged over the
    /// control connection after the handshake.
    pub(crate) per_peer: bool,
    /// Endpoint offers waiting for their answer.
    pub(crate) offers:
        Mutex<HashMap<ConnectionId, tokio::sync::oneshot::Sender<crate::attach::DpFrame>>>,
    /// Bound of one endpoint exchange.
    pub(crate) exchange_timeout: std::time::Duration,
}

impl Inner {
    async fn on_control_event(self: &Arc<Self>, ev: kvlane_control::PeerEvent) {
        let (id, addr) = (ev.id, ev.addr.clone());
        let kind = match ev.event {
            Event::Ready(info) => {
                if self.per_peer {
                    // Endpoints are exchanged over the control connection;
                    // `Up` follows once the exchange completed.
                    if let Err(e) = self.record_remote(id, &addr, &info) {
                        PeerEventKind::Refused {
                            reason: e.to_string(),
                        }
                    } else if is_inbound(&addr) {
                        return;
                    } else {
                        let this = self.clone();
                        self.runtime.spawn(async move {
                            let r = this.dial_exchange(id, &addr).await;
                            this.report_attach(id, addr, &info, r);
                        });
                        return;
                    }
                } else {
                    let r = self.attach_shared(id, &addr, &info).await;
                    self.report_attach(id, addr, &info, r);
                    return;
                }
            }
            Event::Suspect => PeerEventKind::Suspect,
            Event::Recovered => PeerEventKind::Recovered,
            Event::Dead {
                attempts,
                last_error,
                ..
            } => {
                self.detach(id, "peer dead");
                PeerEventKind::Dead {
                    attempts,
                    last_error: last_error.to_string(),
                }
            }
            Event::Restarted { old, new } => {
                self.detach(id, "peer restarted");
                PeerEventKind::Restarted { old, new }
            }
            Event::Refused { refusal, .. } => PeerEventKind::Refused {
                reason: refusal.to_string(),
            },
            Event::Closed => {
                self.detach(id, "connection closed");
                lock(&self.peers).remove(&id);
                // Connection ids are never reused: its attach lock goes too.
                lock(&self.conn_locks).remove(&id);
                PeerEventKind::Closed
            }
            Event::Notification {
                transfer_id: crate::attach::DP_OFFER,
                payload,
            } => {
                let this = self.clone();
                self.runtime
                    .spawn(async move { this.accept_offer(id, addr, payload).await });
                return;
            }
            Event::Notification {
                transfer_id: crate::attach::DP_ANSWER,
                payload,
            } => {
                self.on_answer(id, &payload);
                return;
            }
            Event::Notification { payload, .. } => {
                let note = match rmp_serde::from_slice::<NotifyFrame>(&payload) {
                    Ok(f) => Notification {
                        from: f.from,
                        payload: Bytes::from(f.payload),
                    },
                    Err(_) => Notification {
                        from: addr.clone(),
                        payload: Bytes::from(payload),
                    },
                };
                let _ = self.note_tx.send(note);
                return;
            }
            _ => return,
        };
        self.emit(id, addr, kind);
    }

    pub(crate) fn emit(&self, peer: ConnectionId, addr: String, kind: PeerEventKind) {
        debug!(%peer, %addr, ?kind, "peer event");
        let _ = self.events.send(PeerEvent { peer, addr, kind });
    }

    fn report_attach(
        &self,
        id: ConnectionId,
        addr: String,
        info: &RemoteInfo,
        r: Result<(), Error>,
    ) {
        let kind = match r {
            Ok(()) => PeerEventKind::Up {
                engine_id: info.engine_id.clone(),
                incarnation: info.incarnation,
            },
            Err(e) => {
                warn!(peer = %id, %addr, error = %e, "peer is up but its data plane is not");
                PeerEventKind::Refused {
                    reason: e.to_string(),
                }
            }
        };
        self.emit(id, addr, kind);
    }
}

/// An engine's kvlane endpoint. See the [crate docs](crate) for a tour.
///
/// Cloning is cheap (a reference count). [`close`](Self::close) releases
/// sockets, tasks and registrations; dropping the last clone without
/// closing releases them in the background.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("engine_id", &self.inner.engine_id)
            .field("addr", &self.inner.control.local_addr())
            .finish()
    }
}

impl Agent {
    /// A builder with defaults (listen on 127.0.0.1, any port, `Auto` backend).
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// The control address peers connect to.
    pub fn local_addr(&self) -> &str {
        self.inner.control.local_addr()
    }

    /// This engine's id.
    pub fn engine_id(&self) -> &str {
        &self.inner.engine_id
    }

    /// This process start's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// The backend in use.
    pub fn backend_kind(&self) -> kvlane_data::BackendKind {
        self.inner.transport.with_backend(|b| b.kind())
    }

    /// The first registered KV cache (region and layout).
    pub fn kv(&self) -> Option<(&Region, &KvLayout)> {
        self.inner.kv.first().map(|k| (&k.region, &k.layout))
    }

    /// Connects to the agent at `addr` (`host:port`): handshake, then the
    /// data plane. A live connection to `addr` is reused.
    pub async fn connect(&self, addr: &str) -> Result<Peer, Error> {
        let (id, info) = self.inner.control.connect(addr).await?;
        self.inner.attach(id, addr, &info).await?;
        Ok(Peer::new(self.inner.clone(), id, addr.to_owned()))
    }

    /// Connects to every tensor-parallel rank of `dp_rank` of a remote
    /// engine (ports `base + dp_rank * tp_size + tp_rank`). All ranks, or an
    /// error naming every failing rank with its cause.
    pub async fn connect_group(
        &self,
        host: &str,
        base_port: u16,
        dp_rank: u32,
        tp_size: u32,
    ) -> Result<Vec<Peer>, Error> {
        let members = self
            .inner
            .control
            .connect_group(host, base_port, dp_rank, tp_size)
            .await?;
        let mut peers = Vec::new();
        for m in members {
            self.inner.attach(m.id, &m.addr, &m.remote).await?;
            peers.push(Peer::new(self.inner.clone(), m.id, m.addr.clone()));
        }
        Ok(peers)
    }

    /// Peer events (up, suspect, recovered, dead, restarted, refused,
    /// closed) from now on.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.inner.events.subscribe()
    }

    /// Notifications for this agent (WRITE notifications after their data
    /// landed, and control-plane notifications). One receiver: `None`
    /// after the first call.
    pub fn notifications(&self) -> Option<mpsc::UnboundedReceiver<Notification>> {
        lock(&self.inner.notifications).take()
    }

    /// Closes the control node (saying `bye` to peers and flushing pending
    /// messages), stops the data plane (in-flight transfers fail with
    /// `Closed`) and the agent's tasks. Idempotent.
    pub async fn close(&self) {
        self.inner.control.close().await;
        self.inner.transport.shutdown();
        let tasks: Vec<_> = lock(&self.inner.tasks).drain(..).collect();
        for t in tasks {
            t.abort();
        }
    }
}
