//! [`Agent`] and [`Peer`]: the facade's agent and peers, converted.

use crate::errors::{invalid, to_py, ClosedError};
use crate::events::{Notifications, PeerEvents};
use crate::memory::{spans, KvLayout, Memory};
use crate::runtime::{block_on, runtime};
use crate::transfer::Transfer;
use kvlane::control::Config;
use kvlane::data::Op;
use kvlane::{BackendChoice, MemSpan, PreparedTransfer as RsPrepared};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Mutex as AsyncMutex;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Span lists longer than this are planned with the GIL released.
const DETACH_SPANS: usize = 256;

/// Runs `f` on `n` spans, with the GIL released when the list is long.
fn detach_if_long<T: Send>(py: Python<'_>, n: usize, f: impl FnOnce() -> T + Send) -> T {
    if n > DETACH_SPANS {
        py.detach(f)
    } else {
        f()
    }
}

/// A positive, finite number of seconds (`name` for the error).
fn seconds(name: &str, s: f64) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(invalid(format!(
            "{name} is a positive number of seconds, not {s}"
        ))),
    }
}

fn closed() -> PyErr {
    ClosedError::new_err("the agent is closed")
}

pub(crate) fn op_of(op: &str) -> PyResult<Op> {
    match op {
        "READ" | "read" => Ok(Op::Read),
        "WRITE" | "write" => Ok(Op::Write),
        o => Err(invalid(format!(
            "operation is \"READ\" or \"WRITE\", not {o:?}"
        ))),
    }
}

/// The agent, `None` once closed (shared with its peers and streams).
pub(crate) type Shared = Arc<Mutex<Option<kvlane::Agent>>>;

fn agent_of(shared: &Shared) -> PyResult<kvlane::Agent> {
    lock(shared).clone().ok_or_else(closed)
}

/// An engine's kvlane endpoint: registered memory, a control listener and
/// a data-plane backend. Memory is registered when the agent is built
/// (`kv=[(layout, memory)]`, `regions=[memory]`; any buffer-protocol
/// object or `Memory`), because it is advertised in the handshake.
#[pyclass(module = "kvlane", name = "Agent")]
pub(crate) struct Agent {
    inner: Shared,
    notifications: Arc<AsyncMutex<tokio::sync::mpsc::Receiver<kvlane::Notification>>>,
    engine_id: String,
    addr: String,
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (engine_id = None, listen = "127.0.0.1:0", backend = "auto", psk = None,
        advertise = None, kv = None, regions = None, keepalive_interval = None, liveness_budget = None,
        transfer_deadline = None, handshake_timeout = None, cpus = None,
        shm_cross_memory_attach = false))]
    #[allow(clippy::too_many_arguments)] // the keyword arguments of the Python constructor
    fn py_new(
        py: Python<'_>,
        engine_id: Option<String>,
        listen: &str,
        backend: &str,
        psk: Option<Vec<u8>>,
        advertise: Option<String>,
        kv: Option<Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>>,
        regions: Option<Vec<Bound<'_, PyAny>>>,
        keepalive_interval: Option<f64>,
        liveness_budget: Option<u32>,
        transfer_deadline: Option<f64>,
        handshake_timeout: Option<f64>,
        cpus: Option<String>,
        shm_cross_memory_attach: bool,
    ) -> PyResult<Self> {
        // Parsed first: a bad value is refused before anything starts.
        let cpus = cpus
            .map(|s| s.parse::<kvlane::CpuPlacement>())
            .transpose()
            .map_err(|e| to_py(e.into()))?;
        let cpus = kvlane::CpuPlacement::resolve(cpus.as_ref()).map_err(|e| to_py(e.into()))?;
        // The module's runtime, if this is the first agent, places its
        // workers the same way.
        crate::runtime::place(&cpus);
        let choice = match backend {
            "auto" => BackendChoice::Auto,
            "tcp" => BackendChoice::Tcp,
            "verbs" => BackendChoice::Verbs,
            "loopback" => BackendChoice::Loopback,
            "shm" => BackendChoice::Shm,
            "same-host" => BackendChoice::SameHost,
            b => {
                return Err(invalid(format!(
                    "backend is \"auto\", \"same-host\", \"tcp\", \"verbs\", \"shm\" or \"loopback\", not {b:?}"
                )))
            }
        };
        let mut b = kvlane::Agent::builder()
            .listen(listen)
            .backend(choice)
            .shm_cross_memory_attach(shm_cross_memory_attach)
            .cpus(cpus);
        if let Some(id) = engine_id {
            b = b.engine_id(id);
        }
        if let Some(a) = advertise {
            b = b.advertise(a);
        }
        if keepalive_interval.is_some() || liveness_budget.is_some() || handshake_timeout.is_some()
        {
            let mut c = Config::default();
            if let Some(k) = keepalive_interval {
                c.keepalive_interval = seconds("keepalive_interval", k)?;
            }
            if let Some(n) = liveness_budget {
                c.liveness_budget = n;
            }
            if let Some(h) = handshake_timeout {
                c.handshake_timeout = seconds("handshake_timeout", h)?;
            }
            b = b.control_config(c);
        }
        if let Some(d) = transfer_deadline {
            b = b.transfer_deadline(seconds("transfer_deadline", d)?);
        }
        if let Some(k) = psk {
            b = b.psk(k);
        }
        for (layout, mem) in kv.unwrap_or_default() {
            let layout = layout
                .cast::<KvLayout>()
                .map_err(|_| invalid("kv entries are (KvLayout, memory) pairs"))?
                .get()
                .inner;
            b = b.register_kv(layout, Memory::coerce(&mem)?);
        }
        for mem in regions.unwrap_or_default() {
            b = b.register_region(Memory::coerce(&mem)?);
        }
        let agent = block_on(py, async move {
            // The facade's tasks run on the module's runtime.
            runtime().spawn(b.build()).await
        })?
        .map_err(|e| invalid(format!("agent build task: {e}")))?
        .map_err(to_py)?;
        let notes = agent
            .notifications()
            .ok_or_else(|| invalid("notifications already taken"))?;
        Ok(Self {
            engine_id: agent.engine_id().to_owned(),
            addr: agent.local_addr().to_owned(),
            inner: Arc::new(Mutex::new(Some(agent))),
            notifications: Arc::new(AsyncMutex::new(notes)),
        })
    }

    /// This engine's id.
    #[getter]
    fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The control address peers connect to (`host:port`).
    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// The agent's backend (`"tcp"`, `"verbs"`, `"loopback"`, `"shm"`);
    /// with `backend="auto"` its network backend: `Peer.backend` says
    /// what each peer got (`"shm"` for a peer on this host).
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(agent_of(&self.inner)?.backend_kind().as_str())
    }

    /// This process start's incarnation.
    #[getter]
    fn incarnation(&self) -> PyResult<u64> {
        Ok(agent_of(&self.inner)?.incarnation())
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// Connects to the agent at `addr`: handshake, then the data plane.
    fn connect(&self, py: Python<'_>, addr: String) -> PyResult<Peer> {
        let agent = agent_of(&self.inner)?;
        let peer = block_on(py, async move { agent.connect(&addr).await })?.map_err(to_py)?;
        Ok(Peer {
            agent: self.inner.clone(),
            peer,
        })
    }

    /// Registers `memory` (any buffer-protocol object or `Memory`) as a
    /// plain region after the agent was built: local transfers may use it
    /// once this returns, and every handshake from now on advertises it.
    /// Peers connected before learn it only by connecting again.
    fn register(&self, py: Python<'_>, memory: &Bound<'_, PyAny>) -> PyResult<()> {
        let region = Memory::coerce(memory)?;
        let agent = agent_of(&self.inner)?;
        block_on(py, async move { agent.register_region(region).await })?.map_err(to_py)
    }

    /// Checks that local spans (`[(addr, len), ...]` or an `(N, 2|3)`
    /// array) lie inside this agent's registrations with the rights `op`
    /// (`"READ"`/`"WRITE"`) needs locally.
    fn check_spans(&self, py: Python<'_>, op: &str, spans_: &Bound<'_, PyAny>) -> PyResult<()> {
        let (spans, op, agent) = (spans(spans_)?, op_of(op)?, agent_of(&self.inner)?);
        detach_if_long(py, spans.len(), || agent.check_spans(op, &spans)).map_err(to_py)
    }

    /// This agent's notifications (WRITE notifications after their data
    /// landed, READ notifications after the initiator has the data, and
    /// `Peer.notify` messages).
    fn notifications(&self) -> Notifications {
        Notifications::new(self.notifications.clone(), self.inner.clone())
    }

    /// Peer events from now on.
    fn events(&self) -> PyResult<PeerEvents> {
        Ok(PeerEvents::new(
            agent_of(&self.inner)?.events(),
            self.inner.clone(),
        ))
    }

    /// Says `bye` to every peer, stops the data plane (in-flight transfers
    /// fail with `ClosedError`) and releases the registrations. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(agent) = lock(&self.inner).take() else {
            return Ok(());
        };
        block_on(py, async move { agent.close().await })
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Agent(engine_id={:?}, addr={:?})",
            self.engine_id, self.addr
        )
    }
}

/// A span transfer planned against one incarnation of a peer. Post it with
/// `Peer.post` as often as needed: every post uses the plan while the peer
/// keeps that incarnation; after it restarted, a post plans the same spans
/// again against the new one (checks included) and keeps that plan, so a
/// restarted peer is never written through its old keys.
#[pyclass(module = "kvlane", name = "PreparedTransfer")]
pub(crate) struct PreparedTransfer {
    plan: RsPrepared,
    /// Posted at least once (the prepare time counts towards the first
    /// post's telemetry only).
    posted: bool,
    op: Op,
    local: Vec<MemSpan>,
    remote: Vec<MemSpan>,
    notify: Option<Vec<u8>>,
    descriptors: usize,
    bytes: u64,
    /// When its prepare started.
    prepared_at: Instant,
}

impl PreparedTransfer {
    /// When a post of it started, for telemetry: the first post counts
    /// from before its prepare.
    fn started(&self) -> Instant {
        if self.posted {
            Instant::now()
        } else {
            self.prepared_at
        }
    }
}

#[pymethods]
impl PreparedTransfer {
    /// Descriptors after merging contiguous runs.
    #[getter]
    fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// Payload bytes.
    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A connected remote agent.
#[pyclass(module = "kvlane", name = "Peer")]
pub(crate) struct Peer {
    agent: Shared,
    peer: kvlane::Peer,
}

impl Peer {
    fn live(&self) -> PyResult<()> {
        agent_of(&self.agent).map(drop)
    }

    fn blocks(
        &self,
        op: Op,
        layers: (u32, u32),
        local: Vec<u32>,
        remote: Vec<u32>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        self.live()?;
        let started = Instant::now();
        let p = self
            .peer
            .prepare(op, layers.0..layers.1, &local, &remote, notify.as_deref())
            .map_err(to_py)?;
        self.post_prepared(p, started)
    }

    fn post_prepared(&self, p: RsPrepared, started: Instant) -> PyResult<Transfer> {
        self.try_post(p, started).map_err(to_py)
    }

    /// Posts a transfer just prepared, its plan moved (not copied).
    fn post_once(&self, prepared: PreparedTransfer) -> PyResult<Transfer> {
        let started = prepared.started();
        self.post_prepared(prepared.plan, started)
    }

    fn try_post(&self, p: RsPrepared, started: Instant) -> Result<Transfer, kvlane::Error> {
        let (bytes, descriptors) = (p.bytes(), p.descriptors());
        let handle = self.peer.post(p)?;
        Ok(Transfer::watch(
            handle,
            started,
            Instant::now(),
            bytes,
            descriptors,
        ))
    }

    /// Plans spans: a few microseconds for a handful; long lists (up to
    /// 1e5 descriptors) are planned with the GIL released.
    fn plan(
        &self,
        py: Python<'_>,
        op: Op,
        l: &[MemSpan],
        r: &[MemSpan],
        notify: Option<&[u8]>,
    ) -> Result<RsPrepared, kvlane::Error> {
        detach_if_long(py, l.len(), || self.peer.prepare_spans(op, l, r, notify))
    }

    /// Plans `prepared`'s spans again (planned against an incarnation the
    /// peer no longer has), keeps the new plan and posts it.
    fn post_replanned(
        &self,
        py: Python<'_>,
        prepared: &mut PreparedTransfer,
        started: Instant,
    ) -> Result<Transfer, kvlane::Error> {
        let p = &*prepared;
        let plan = self.plan(py, p.op, &p.local, &p.remote, p.notify.as_deref())?;
        prepared.plan = plan;
        self.try_post(prepared.plan.again(), started)
    }

    fn span_lists(
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<MemSpan>, Vec<MemSpan>)> {
        Ok((spans(local)?, spans(remote)?))
    }
}

#[pymethods]
impl Peer {
    /// The peer's engine id.
    #[getter]
    fn engine_id(&self) -> String {
        self.peer.engine_id()
    }

    /// The address dialed.
    #[getter]
    fn addr(&self) -> &str {
        self.peer.addr()
    }

    /// The peer's current incarnation.
    #[getter]
    fn incarnation(&self) -> Option<u64> {
        self.peer.incarnation()
    }

    /// Whether the connection is up with its data plane attached (transfers
    /// can be posted): false while the peer is dead, after it restarted
    /// until its new incarnation is attached, and once disconnected.
    #[getter]
    fn attached(&self) -> bool {
        lock(&self.agent).is_some() && self.peer.is_attached()
    }

    /// The backend that carries this side's transfers to the peer while
    /// its data plane is attached: with `backend="auto"`, `"shm"` for a
    /// peer on this host that shared memory reached, else `"tcp"` or
    /// `"verbs"` (why not shm is logged at `info`: `KVLANE_LOG=info`);
    /// `None` while not attached.
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.peer.backend_kind().map(|k| k.as_str())
    }

    /// The plain regions the peer advertised: `[{"addr", "nbytes",
    /// "readable", "writable"}]`.
    fn remote_regions<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.peer
            .remote_regions()
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("addr", r.addr)?;
                d.set_item("nbytes", r.len)?;
                d.set_item(
                    "readable",
                    r.access.contains(kvlane::data::Access::REMOTE_READ),
                )?;
                d.set_item(
                    "writable",
                    r.access.contains(kvlane::data::Access::REMOTE_WRITE),
                )?;
                Ok(d)
            })
            .collect()
    }

    /// WRITEs `layers` (`(start, stop)`) of local blocks `local_ids[i]`
    /// into remote blocks `remote_ids[i]`; `notify` reaches the peer after
    /// every byte landed.
    #[pyo3(signature = (layers, local_ids, remote_ids, notify = None))]
    fn write_blocks(
        &self,
        layers: (u32, u32),
        local_ids: Vec<u32>,
        remote_ids: Vec<u32>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        self.blocks(Op::Write, layers, local_ids, remote_ids, notify)
    }

    /// READs remote blocks into local blocks; `notify` is sent to the peer
    /// once the data is here.
    #[pyo3(signature = (layers, local_ids, remote_ids, notify = None))]
    fn read_blocks(
        &self,
        layers: (u32, u32),
        local_ids: Vec<u32>,
        remote_ids: Vec<u32>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        self.blocks(Op::Read, layers, local_ids, remote_ids, notify)
    }

    /// Plans a span transfer (`op` `"READ"`/`"WRITE"`): `local[i]` ↔
    /// `remote[i]`, each a list of `(addr, len)` tuples or an `(N, 2|3)`
    /// array of 8-byte integers (read in place). Raises for spans outside a
    /// registration, mismatched lengths, a read-only READ destination.
    #[pyo3(signature = (op, local, remote, notify = None))]
    fn prepare_spans(
        &self,
        py: Python<'_>,
        op: &str,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PreparedTransfer> {
        self.live()?;
        let t = Instant::now();
        let op = op_of(op)?;
        let (l, r) = Self::span_lists(local, remote)?;
        let p = self
            .plan(py, op, &l, &r, notify.as_deref())
            .map_err(to_py)?;
        Ok(PreparedTransfer {
            descriptors: p.descriptors(),
            bytes: p.bytes(),
            plan: p,
            posted: false,
            op,
            local: l,
            remote: r,
            notify,
            prepared_at: t,
        })
    }

    /// Checks remote spans against what the peer advertised.
    fn check_remote_spans(
        &self,
        py: Python<'_>,
        op: &str,
        spans_: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (s, op) = (spans(spans_)?, op_of(op)?);
        detach_if_long(py, s.len(), || self.peer.check_remote_spans(op, &s)).map_err(to_py)
    }

    /// Posts a prepared transfer; never blocks. Posting it again reuses
    /// its plan, or plans it again after the peer restarted (see
    /// `PreparedTransfer`).
    fn post(&self, py: Python<'_>, prepared: &mut PreparedTransfer) -> PyResult<Transfer> {
        self.live()?;
        let started = prepared.started();
        prepared.posted = true;
        match self.try_post(prepared.plan.again(), started) {
            Err(e) if e.kind() == kvlane::ErrorKind::Stale => {}
            r => return r.map_err(to_py),
        }
        self.post_replanned(py, prepared, started).map_err(to_py)
    }

    /// Posts several prepared transfers in one call (`Peer::post_batch`):
    /// the backend takes them at once (tcp: one hand-over per stream, not a
    /// write and a thread wake-up per transfer). Returns one `Transfer` per
    /// item, in order. Never raises for one transfer: a transfer the peer
    /// refused (busy queue, peer gone) comes back already failed, its
    /// `wait()` raising the error, so no posted transfer loses its handle.
    /// A transfer planned against an incarnation the peer no longer has is
    /// planned again and posted, as `post` does.
    fn post_batch(&self, py: Python<'_>, prepared: &Bound<'_, PyAny>) -> PyResult<Vec<Transfer>> {
        self.live()?;
        // Every item checked before any is posted.
        let mut batch = Vec::new();
        for (i, item) in prepared.try_iter()?.enumerate() {
            let item = item?;
            let p = item.cast_into::<PreparedTransfer>().map_err(|e| {
                let ty = e.into_inner().get_type();
                invalid(format!(
                    "item {i} of the batch is a {}, not a PreparedTransfer",
                    ty.name().map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })?;
            batch.push(p);
        }
        // Borrowed one at a time: the same object may appear twice.
        let mut items = Vec::with_capacity(batch.len());
        let mut plans = Vec::with_capacity(batch.len());
        for p in batch {
            let mut m = p.borrow_mut();
            let started = m.started();
            m.posted = true;
            plans.push(m.plan.again());
            drop(m);
            items.push((p, started));
        }
        let peer = self.peer.clone();
        let n = plans.len();
        let results = detach_if_long(py, n, move || peer.post_batch(plans));
        // Every item's post returned together.
        let posted = Instant::now();
        let mut out = Vec::with_capacity(n);
        for ((p, started), r) in items.into_iter().zip(results) {
            let mut m = p.borrow_mut();
            out.push(match r {
                Ok(handle) => Transfer::watch(handle, started, posted, m.bytes, m.descriptors),
                Err(e) if e.kind() == kvlane::ErrorKind::Stale => self
                    .post_replanned(py, &mut m, started)
                    .unwrap_or_else(|e| Transfer::failed(e, started, m.bytes, m.descriptors)),
                Err(e) => Transfer::failed(e, started, m.bytes, m.descriptors),
            });
        }
        Ok(out)
    }

    /// Prepares and posts a span WRITE.
    #[pyo3(signature = (local, remote, notify = None))]
    fn write_spans(
        &self,
        py: Python<'_>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        let p = self.prepare_spans(py, "WRITE", local, remote, notify)?;
        self.post_once(p)
    }

    /// Prepares and posts a span READ.
    #[pyo3(signature = (local, remote, notify = None))]
    fn read_spans(
        &self,
        py: Python<'_>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<Transfer> {
        let p = self.prepare_spans(py, "READ", local, remote, notify)?;
        self.post_once(p)
    }

    /// Sends a notification through the control plane.
    fn notify(&self, py: Python<'_>, payload: Vec<u8>) -> PyResult<()> {
        self.live()?;
        let peer = self.peer.clone();
        block_on(py, async move { peer.notify(&payload).await })?.map_err(to_py)
    }

    /// One control-plane round trip, in seconds.
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        self.live()?;
        let peer = self.peer.clone();
        Ok(block_on(py, async move { peer.ping().await })?
            .map_err(to_py)?
            .as_secs_f64())
    }

    /// Closes this connection; in-flight transfers fail with
    /// `PeerLostError`. Idempotent.
    fn disconnect(&self, py: Python<'_>) -> PyResult<()> {
        if lock(&self.agent).is_none() {
            return Ok(());
        }
        let peer = self.peer.clone();
        block_on(py, async move { peer.disconnect().await })?.map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Peer(engine_id={:?}, addr={:?})",
            self.peer.engine_id(),
            self.peer.addr()
        )
    }
}
