//! [`Agent`]: one engine's endpoint — its registered KV cache, its control
//! node and its data-plane backend — and the task that turns control-plane
//! events into peer events, attachments and notifications.

use crate::error::{Error, ErrorKind};
use crate::events::{Notification, PeerEvent, PeerEventKind};
use crate::frames::{self, DataPlaneInfo, KvAdvert, DP_ANSWER, DP_OFFER};
use crate::peer::Peer;
use crate::spans::MemSpan;
use crate::state::{lock, Inner, LocalKv, Sender};
use kvlane_control::{Config, ControlNode, Event, LocalInfo, Ranks};
use kvlane_data::{Backend, CpuPlacement, FastMap, KvLayout, Op, Region, Transport};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tracing::info;

/// How long a backend's connect may take on top of the handshake, as far
/// as `connect` waiting for the data plane is concerned: the tcp backend
/// dials 4 streams, each bounded by its 5 s connect timeout.
const CONNECT_BOUND: Duration = Duration::from_secs(25);

/// Which data-plane backend an agent uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BackendChoice {
    /// The best path to each peer. Beside the best network backend this
    /// machine has (verbs when built with the `verbs` feature and a device
    /// is usable, else tcp), shared memory ([`BackendChoice::Shm`]'s
    /// mechanism, through [`kvlane_data::SameHost`]) to each peer that is
    /// on this host (same kernel and same network namespace: hosts
    /// simulated by namespaces keep the network) when the shm connect
    /// works and every region both sides serve is memory shm serves:
    /// [`Region::alloc_shared`] (what kvlane allocates for you, e.g.
    /// Python's `kvlane.host_buffer`), GPU memory by IPC handle, or any
    /// host memory with [`AgentBuilder::shm_cross_memory_attach`]. Memory
    /// the engine allocated (a torch tensor, a numpy array,
    /// [`Region::alloc`]) turns shm off unless that opt-in is given: such
    /// an agent uses the network backend for every peer. Every choice
    /// against shm is logged at `info` with its reason;
    /// [`Peer::backend_kind`](crate::Peer::backend_kind) says what a peer
    /// got. [`AgentBuilder::same_host_shm`] (or `KVLANE_SAME_HOST_SHM=0`)
    /// turns shm off; [`BackendChoice::Tcp`] is plain tcp.
    #[default]
    Auto,
    /// Software one-sided RDMA over TCP.
    Tcp,
    /// In-process only (both agents in one process).
    Loopback,
    /// libibverbs (feature `verbs`).
    Verbs,
    /// Shared memory between processes of one host (Linux): one-sided
    /// copies between the two processes' registered memory. Regions with
    /// remote rights must be allocated with [`Region::alloc_shared`] or be
    /// GPU memory registered through its runtime (served by CUDA/HIP IPC
    /// handle, which exposes the whole allocation holding the region),
    /// unless [`AgentBuilder::shm_cross_memory_attach`] opts in to serving
    /// other host memory; peers on another host are refused (see
    /// [`kvlane_data::shm`]).
    Shm,
    /// The same as [`Auto`](BackendChoice::Auto) (kept for code written
    /// when shm to peers on this host was opt-in), except that it ignores
    /// [`AgentBuilder::same_host_shm`]`(false)` and
    /// `KVLANE_SAME_HOST_SHM=0`: naming it asks for shm.
    SameHost,
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
    regions: Vec<Region>,
    custom: Option<Box<dyn Backend>>,
    rails: crate::backend::RailChoice,
    notification_capacity: usize,
    dial_any_data_host: bool,
    transfer_deadline: Duration,
    cpus: Option<CpuPlacement>,
    shm_cross_memory_attach: bool,
    same_host_shm: Option<bool>,
}

/// Default of [`AgentBuilder::notification_capacity`]: with the default
/// 64 KiB notification cap, at most 256 MiB of unread payloads.
pub const DEFAULT_NOTIFICATION_CAPACITY: usize = 4096;

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
            regions: Vec::new(),
            custom: None,
            rails: crate::backend::RailChoice::default(),
            notification_capacity: DEFAULT_NOTIFICATION_CAPACITY,
            dial_any_data_host: false,
            transfer_deadline: crate::DEFAULT_TRANSFER_DEADLINE,
            cpus: None,
            shm_cross_memory_attach: false,
            same_host_shm: None,
        }
    }
}

impl AgentBuilder {
    /// This engine's id (shown to peers, carried in notifications): not
    /// empty, at most [`MAX_ENGINE_ID_LEN`](kvlane_control::MAX_ENGINE_ID_LEN)
    /// bytes, no control characters. [`build`](Self::build) refuses another
    /// ([`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput)), as
    /// peers refuse one at the handshake.
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
    /// host with port 0. A comma-separated list (`10.0.0.1:0,10.0.1.1:0`)
    /// gives one tcp rail per address (see [`kvlane_data::Rails`]); give
    /// each its own network's address, not a wildcard, so each rail is
    /// dialed on its own network.
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

    /// The RDMA devices to use as rails (verbs), overriding
    /// `KVLANE_IB_DEVICES`; by default every device with an ACTIVE port.
    pub fn verbs_devices<S: Into<String>>(mut self, devices: impl IntoIterator<Item = S>) -> Self {
        self.rails.devices = Some(devices.into_iter().map(Into::into).collect());
        self
    }

    /// Uses at most `n` rails (devices or tcp addresses), the first ones.
    pub fn max_rails(mut self, n: usize) -> Self {
        self.rails.max = Some(n);
        self
    }

    /// The data-plane backend.
    pub fn backend(mut self, backend: BackendChoice) -> Self {
        self.backend = backend;
        self
    }

    /// With [`BackendChoice::Auto`] or [`BackendChoice::Shm`]: serve
    /// regions that are not shareable memory (memory the engine allocated:
    /// a tensor, a numpy array, [`Region::alloc`], [`Region::from_raw`]) to
    /// peers on this host by cross-memory attach
    /// ([`ShmConfig::cross_memory_attach`](kvlane_data::ShmConfig::cross_memory_attach)).
    /// Default off: `Shm` then refuses such regions, and `Auto` serves
    /// every peer over its network backend once one is registered.
    ///
    /// **Exposes this whole process**, not only its registered regions, to
    /// every process the kernel lets attach to it (the same user while the
    /// process is dumpable, or `CAP_SYS_PTRACE`): kvlane's checks keep a
    /// well-behaved peer inside the registered regions and their rights,
    /// nothing holds a hostile one. Such processes could already ptrace
    /// this one; the opt-in hands them the addresses. See
    /// [`kvlane_data::shm`] (*Cross-memory attach*).
    pub fn shm_cross_memory_attach(mut self, on: bool) -> Self {
        self.shm_cross_memory_attach = on;
        self
    }

    /// With [`BackendChoice::Auto`]: whether peers on this host may get
    /// shared memory (default on; without this call the environment
    /// variable [`KVLANE_SAME_HOST_SHM`](crate::ENV_SAME_HOST_SHM) decides:
    /// `0`, `off`, `false` or `no` turn it off, another value than those
    /// and `1`, `on`, `true`, `yes` fails [`build`](Self::build)). Off,
    /// `Auto` is verbs or tcp for every peer, as before shm. Ignored by
    /// the other choices ([`BackendChoice::SameHost`] asks for shm).
    pub fn same_host_shm(mut self, on: bool) -> Self {
        self.same_host_shm = Some(on);
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

    /// Notifications kept for [`Agent::notifications`] until read (at least
    /// 1; default [`DEFAULT_NOTIFICATION_CAPACITY`]). When the queue is full
    /// a new notification is dropped and counted
    /// ([`Agent::notifications_dropped`]) instead of growing memory or
    /// holding up the control plane.
    pub fn notification_capacity(mut self, n: usize) -> Self {
        self.notification_capacity = n.max(1);
        self
    }

    /// Dial a peer's data endpoint on whatever host it advertises. Off by
    /// default: the agent dials a data endpoint only on the host of its
    /// control connection to that peer (the address it dialed, or where an
    /// inbound connection says it comes from), loopback counting as one
    /// host, so a peer cannot make it connect to a third host. With
    /// several rails, every rail the agent pairs is held to that host:
    /// peers whose rails listen on other addresses of their host (one per
    /// NIC) need this on, since nothing tells another address of the
    /// peer's host from a third host. Turn it on also for targets that
    /// `advertise` another host on purpose.
    pub fn dial_any_data_host(mut self, yes: bool) -> Self {
        self.dial_any_data_host = yes;
        self
    }

    /// How long after its post a transfer may run before it fails with
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) (clamped to 1 ms
    /// ..= [`MAX_TRANSFER_DEADLINE`](crate::MAX_TRANSFER_DEADLINE), a day:
    /// every transfer ends; default
    /// [`DEFAULT_TRANSFER_DEADLINE`](crate::DEFAULT_TRANSFER_DEADLINE)).
    /// It counts from each post, not from the prepare: a plan made ahead
    /// and posted later gets the whole deadline.
    pub fn transfer_deadline(mut self, d: Duration) -> Self {
        self.transfer_deadline = d.clamp(Duration::from_millis(1), crate::MAX_TRANSFER_DEADLINE);
        self
    }

    /// Where the threads this agent starts run (progress, tcp I/O and
    /// server threads, rails threads): [`CpuPlacement::Inherit`] (each
    /// takes the mask of the thread that starts it, the engine's
    /// placement), [`CpuPlacement::All`] (every CPU the process may use,
    /// even when the building thread was narrowed to one core) or a list.
    /// Without it, the environment variable
    /// [`KVLANE_CPUS`](kvlane_data::ENV_CPUS) decides (`inherit`, `all`,
    /// `0-3,8`), else `Inherit`. Threads are shared by the agents of a
    /// process: a shared pool keeps the placement of the agent whose build
    /// started it. A list none of whose CPUs the process may use fails
    /// [`build`](Self::build). Parse a string with
    /// `"0-3".parse::<CpuPlacement>()`.
    pub fn cpus(mut self, placement: CpuPlacement) -> Self {
        self.cpus = Some(placement);
        self
    }

    /// The placement [`build`](Self::build) applies ([`cpus`](Self::cpus),
    /// else `KVLANE_CPUS`, else inherit).
    pub(crate) fn placement(&self) -> Result<CpuPlacement, Error> {
        Ok(CpuPlacement::resolve(self.cpus.as_ref())?)
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

    /// Registers a plain region for span transfers
    /// ([`Peer::prepare_spans`]): any memory, addressed by address and
    /// length rather than by KV block. Advertised in the handshake next to
    /// the KV caches, with the remote rights of `region`'s [`Access`](kvlane_data::Access);
    /// like them, registered before the agent starts listening.
    pub fn register_region(mut self, region: Region) -> Self {
        self.regions.push(region);
        self
    }

    /// Creates the backend, registers memory, binds the control node and
    /// starts the agent's event task. Needs a tokio runtime.
    pub async fn build(self) -> Result<Agent, Error> {
        // Before anything is allocated or bound: peers would refuse it.
        kvlane_control::check_engine_id(&self.engine_id)
            .map_err(kvlane_control::ControlError::from)?;
        // The threads the backend and the transport start apply it.
        let cpus = self.placement()?;
        cpus.check()?;
        let data_listen = match &self.data_listen {
            Some(a) => a.clone(),
            None => format!("{}:0", host_of(&self.listen)),
        };
        let mut backend = match self.custom {
            Some(b) => b,
            None => {
                let regions: Vec<&Region> = self
                    .kv
                    .iter()
                    .map(|(_, r)| r)
                    .chain(self.regions.iter())
                    .collect();
                let shm = crate::backend::ShmChoice {
                    same_host: self.backend == BackendChoice::SameHost
                        || crate::backend::same_host_shm(self.same_host_shm)?,
                    attach: self.shm_cross_memory_attach,
                };
                cpus.scope(|| {
                    crate::backend::create(
                        self.backend,
                        &data_listen,
                        self.advertise.as_deref(),
                        &self.rails,
                        shm,
                        &regions,
                    )
                })?
            }
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
        let mut region_adverts = Vec::new();
        for region in &self.regions {
            region_adverts.push(backend.register(region)?);
        }
        let per_peer = backend.endpoint_per_peer();
        let endpoint = if per_peer {
            None
        } else {
            // One endpoint for every peer (loopback): its slot stays for
            // the agent's life.
            let (_shared_peer, endpoint) = backend.prepare_peer()?;
            Some(endpoint)
        };
        let exchange_timeout = self.control.handshake_timeout + Duration::from_secs(1);
        let advert = DataPlaneInfo {
            endpoint,
            kv: adverts,
            regions: region_adverts,
        };
        let blob = frames::encode("the handshake's data-plane description", &advert)?;
        let mut local = LocalInfo::new(self.engine_id.clone(), self.ranks, self.fingerprint);
        local = local.with_data_plane(blob);
        let incarnation = local.identity.incarnation;
        let data_rails = backend.rail_stats().len().max(1);
        let transport = cpus.scope(|| Transport::new(backend))?;
        let notify_cap = self.control.notify_cap;
        let control = ControlNode::bind(self.control, local, &self.listen).await?;
        let (events, _) = broadcast::channel(1024);
        let (note_tx, note_rx) = mpsc::channel(self.notification_capacity);
        let data_notes = transport.take_notifications();
        let rail = transport.with_backend(|b| b.kind()).as_str();
        let inner = Arc::new(Inner {
            engine_id: self.engine_id,
            incarnation,
            control,
            transport,
            kv,
            regions: RwLock::new(self.regions),
            advert: tokio::sync::Mutex::new(advert),
            peers: Mutex::new(FastMap::default()),
            by_data_peer: Mutex::new(FastMap::default()),
            events,
            notifications: Mutex::new(Some(note_rx)),
            note_tx,
            notes_dropped: Default::default(),
            notes_refused: Default::default(),
            dial_any_data_host: self.dial_any_data_host,
            transfer_deadline: self.transfer_deadline,
            notify_cap,
            data_rails,
            tasks: Mutex::new(Vec::new()),
            runtime: tokio::runtime::Handle::current(),
            per_peer,
            offers: Mutex::new(HashMap::new()),
            accepting: Mutex::new(FastMap::default()),
            offers_dropped: Default::default(),
            exchange_timeout,
            attach_timeout: exchange_timeout + CONNECT_BOUND,
            metrics: crate::metrics::Metrics::new(),
            rail,
            control_stats: Mutex::new(kvlane_control::Stats::default()),
            closing: tokio::sync::watch::Sender::new(false),
        });
        // The owner's stream: lossless for peer lifecycle (a flood of
        // refused hellos or of notifications never pushes out a peer's
        // Ready or Dead), bounded and counted for notifications.
        let mut control_events = inner
            .control
            .take_events()
            .ok_or_else(|| Error::msg(ErrorKind::Closed, "control events already taken"))?;
        let weak = Arc::downgrade(&inner);
        let control_task = tokio::spawn(async move {
            while let Some(ev) = control_events.recv().await {
                let Some(inner) = weak.upgrade() else { break };
                inner.on_control_event(ev);
            }
        });
        let weak = Arc::downgrade(&inner);
        let note_task = tokio::spawn(async move {
            let Some(mut rx) = data_notes else { return };
            while let Some(n) = rx.recv().await {
                let Some(inner) = weak.upgrade() else { break };
                inner.deliver_data(n);
            }
        });
        let weak = Arc::downgrade(&inner);
        let stats_task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let Ok(stats) = inner.control.stats().await else {
                    break;
                };
                *lock(&inner.control_stats) = stats;
            }
        });
        lock(&inner.tasks).extend([control_task, note_task, stats_task]);
        info!(engine = %inner.engine_id, addr = inner.control.local_addr(), "agent up");
        Ok(Agent { inner })
    }
}

fn host_of(addr: &str) -> &str {
    match addr.rsplit_once(':') {
        Some((host, _)) => host,
        None => addr,
    }
}

impl Inner {
    /// Runs `fut` (a connect to `what`) unless the agent closes first:
    /// then `Closed`, at once. An error after the close started is
    /// `Closed` too (the control node's own failure is its consequence).
    pub(crate) async fn unless_closing<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let mut rx = self.closing.subscribe();
        let r = tokio::select! {
            r = fut => r,
            _ = rx.wait_for(|c| *c) => {
                return Err(Error::msg(
                    ErrorKind::Closed,
                    format!("the agent was closed while connecting to {what}"),
                ))
            }
        };
        match r {
            Err(e) if *self.closing.borrow() => Err(Error::msg(
                ErrorKind::Closed,
                format!("the agent was closed while connecting to {what}: {e}"),
            )),
            r => r,
        }
    }

    /// The event task's step: never waits (attaching runs in tasks of its
    /// own), so one slow peer delays no other peer's events.
    fn on_control_event(self: &Arc<Self>, ev: kvlane_control::PeerEvent) {
        let (id, addr) = (ev.id, ev.addr.clone());
        let kind = match ev.event {
            Event::Ready(info) => return self.on_ready(id, addr, ev.role, info),
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
                PeerEventKind::Closed
            }
            Event::Notification {
                transfer_id: DP_OFFER,
                payload,
            } => return self.on_offer(id, addr, payload),
            Event::Notification {
                transfer_id: DP_ANSWER,
                payload,
            } => {
                self.on_answer(id, &addr, &payload);
                return;
            }
            Event::Notification { payload, .. } => {
                let sender = match lock(&self.peers).get(&id) {
                    Some(e) => Sender::Engine(e.engine_id.clone()),
                    None => Sender::Unknown(addr),
                };
                self.deliver_from(payload, sender, "control");
                return;
            }
            _ => return,
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

    /// The agent's metrics in the Prometheus text exposition format
    /// (OpenMetrics 1.0); the names and labels are listed in
    /// [`metrics`](crate::metrics). Serve them with
    /// [`metrics::serve_http`](crate::metrics::serve_http).
    pub fn metrics(&self) -> String {
        let mut snap = crate::metrics::Snapshot {
            in_flight: i64::try_from(self.inner.transport.in_flight()).unwrap_or(i64::MAX),
            rails: self.inner.transport.with_backend(|b| b.rail_stats()),
            tcp: self.inner.transport.with_backend(|b| b.tcp_counters()),
            control: *lock(&self.inner.control_stats),
            notifications_dropped: self.notifications_dropped(),
            notifications_refused: self.notifications_refused(),
            offers_dropped: self.offers_dropped(),
            notifications_queued: i64::try_from(
                self.inner.note_tx.max_capacity() - self.inner.note_tx.capacity(),
            )
            .unwrap_or(i64::MAX),
            ..Default::default()
        };
        for e in lock(&self.inner.peers).values() {
            if e.data_peer.is_some() {
                snap.up += 1;
            } else if matches!(*e.attach.borrow(), crate::state::Attach::Pending { .. }) {
                snap.attaching += 1;
            } else {
                snap.down += 1;
            }
        }
        self.inner.metrics.encode(snap)
    }

    /// What each rail carried, when the data plane runs over several
    /// ([`kvlane_data::Rails`]); empty for one device.
    pub fn rail_stats(&self) -> Vec<kvlane_data::RailStats> {
        self.inner.transport.with_backend(|b| b.rail_stats())
    }

    /// The backend in use.
    pub fn backend_kind(&self) -> kvlane_data::BackendKind {
        self.inner.transport.with_backend(|b| b.kind())
    }

    /// The first registered KV cache (region and layout).
    pub fn kv(&self) -> Option<(&Region, &KvLayout)> {
        self.inner.kv.first().map(|k| (&k.region, &k.layout))
    }

    /// The plain regions registered with [`AgentBuilder::register_region`]
    /// and [`register_region`](Self::register_region).
    pub fn regions(&self) -> Vec<Region> {
        self.inner
            .regions
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Registers a plain region after the agent was built (what
    /// [`AgentBuilder::register_region`] does before): local transfers
    /// may use it as soon as this returns, the backend serves it with the
    /// region's remote rights, and every handshake from now on advertises
    /// it. Peers connected before learn it only by connecting again (a
    /// new handshake); their connections are otherwise untouched.
    pub async fn register_region(&self, region: Region) -> Result<(), Error> {
        let mut advert = self.inner.advert.lock().await;
        let ad = self.inner.transport.with_backend(|b| b.register(&region))?;
        let mut next = advert.clone();
        next.regions.push(ad);
        let blob = match frames::encode("the handshake's data-plane description", &next) {
            Ok(blob) => blob,
            Err(e) => {
                let _ = self
                    .inner
                    .transport
                    .with_backend(|b| b.deregister(region.id()));
                return Err(e);
            }
        };
        if let Err(e) = self.inner.control.set_data_plane(blob).await {
            let _ = self
                .inner
                .transport
                .with_backend(|b| b.deregister(region.id()));
            return Err(e.into());
        }
        *advert = next;
        self.inner
            .regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(region);
        Ok(())
    }

    /// Checks that every span lies inside one registration of this agent
    /// (KV caches and plain regions) with the rights `op` needs locally,
    /// as [`Peer::prepare_spans`] will.
    pub fn check_spans(&self, op: Op, spans: &[MemSpan]) -> Result<(), Error> {
        self.inner.resolve_local(spans, op).map(drop)
    }

    /// Connects to the agent at `addr` (`host:port`): handshake, then the
    /// data plane. A live connection to `addr` is reused. When the data
    /// plane cannot be attached, the connection is closed and the error
    /// says why (with the OS error); calling again dials afresh.
    pub async fn connect(&self, addr: &str) -> Result<Peer, Error> {
        let (id, info) = self
            .inner
            .unless_closing(addr, async { Ok(self.inner.control.connect(addr).await?) })
            .await?;
        if let Err(e) = self
            .inner
            .await_attach(id, info.identity.incarnation, addr)
            .await
        {
            // No half-attached connection stays behind: the next `connect`
            // dials afresh.
            self.inner.release(id).await;
            return Err(e);
        }
        Ok(Peer::new(self.inner.clone(), id, addr.to_owned()))
    }

    /// Connects to every tensor-parallel rank of `dp_rank` of a remote
    /// engine (ports `base + dp_rank * tp_size + tp_rank`). All ranks with
    /// their data planes attached, or an error naming every failing rank
    /// with its cause, after which no rank stays connected.
    pub async fn connect_group(
        &self,
        host: &str,
        base_port: u16,
        dp_rank: u32,
        tp_size: u32,
    ) -> Result<Vec<Peer>, Error> {
        let group = format!("{host}:{base_port} dp rank {dp_rank}");
        let members = self
            .inner
            .unless_closing(&group, async {
                Ok(self
                    .inner
                    .control
                    .connect_group(host, base_port, dp_rank, tp_size)
                    .await?)
            })
            .await?;
        // Every rank's attach runs in its own task already; collect them all.
        let mut failures = Vec::new();
        for m in &members {
            if let Err(e) = self
                .inner
                .await_attach(m.id, m.remote.identity.incarnation, &m.addr)
                .await
            {
                failures.push((m, e));
            }
        }
        if failures.is_empty() {
            return Ok(members
                .iter()
                .map(|m| Peer::new(self.inner.clone(), m.id, m.addr.clone()))
                .collect());
        }
        for m in &members {
            self.inner.release(m.id).await;
        }
        let kind = failures[0].1.kind();
        let causes: Vec<String> = failures
            .iter()
            .map(|(m, e)| format!("tp rank {} at {}: {e}", m.ranks.tp_rank, m.addr))
            .collect();
        Err(Error::msg(
            kind,
            format!(
                "group {host}:{base_port} dp rank {dp_rank}: {} of {tp_size} ranks have no data \
                 plane ({}); every rank was disconnected",
                failures.len(),
                causes.join("; ")
            ),
        ))
    }

    /// Peer events (up, suspect, recovered, dead, restarted, refused,
    /// closed) from now on.
    pub fn events(&self) -> broadcast::Receiver<PeerEvent> {
        self.inner.events.subscribe()
    }

    /// Notifications for this agent (WRITE notifications after their data
    /// landed, and control-plane notifications). One receiver: `None`
    /// after the first call. Bounded: see
    /// [`AgentBuilder::notification_capacity`].
    pub fn notifications(&self) -> Option<mpsc::Receiver<Notification>> {
        lock(&self.inner.notifications).take()
    }

    /// Notifications refused because they named another sender than the
    /// peer they came from, or came from a sender that maps to no
    /// connection (a data-plane peer detached or never paired), over the
    /// data plane or the control plane (see [`Notification::from`]).
    pub fn notifications_refused(&self) -> u64 {
        self.inner
            .notes_refused
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Notifications dropped because the queue of unread ones was full.
    pub fn notifications_dropped(&self) -> u64 {
        self.inner
            .notes_dropped
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Data-plane endpoint offers dropped: a peer connection sent more
    /// while one of its offers was being accepted (one is accepted at a
    /// time per connection, and only the newest waiting one is kept).
    pub fn offers_dropped(&self) -> u64 {
        self.inner
            .offers_dropped
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Closes the control node (saying `bye` to peers and flushing pending
    /// messages), stops the data plane (in-flight transfers fail with
    /// `Closed`) and the agent's tasks. Idempotent.
    pub async fn close(&self) {
        self.inner.closing.send_replace(true);
        self.inner.control.close().await;
        self.inner.transport.shutdown();
        let tasks: Vec<_> = lock(&self.inner.tasks).drain(..).collect();
        for t in tasks {
            t.abort();
        }
    }
}
