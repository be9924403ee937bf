//! [`Peer`]: a connected remote agent, and the transfers to it.

use crate::error::{Error, ErrorKind};
use crate::frames;
use crate::metrics::PeerMetrics;
use crate::spans::{self, MemSpan};
use crate::state::{lock, Inner, PeerEntry};
use kvlane_control::ConnectionId;
use kvlane_data::{
    plan_into, Descriptor, Descriptors, FastMap, Op, PeerId, PlannedCopy, RemoteDescriptor,
    RemoteDescriptors, RemoteRegion, Then, Transfer, TransferId,
};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Most planned copies whose room [`PLAN`] keeps between calls.
const PLAN_KEEP: usize = 1024;

thread_local! {
    /// The planner's output, reused by the thread's next `prepare`: one
    /// allocation and free per prepared transfer less (a Vec grown from
    /// empty by `plan`).
    static PLAN: std::cell::RefCell<Vec<PlannedCopy>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A block transfer planned against one incarnation of a peer, ready to
/// [`post`](Peer::post). Posting it after the peer restarted fails with
/// [`ErrorKind::Stale`]: it never writes through the old keys.
#[derive(Debug)]
pub struct PreparedTransfer {
    conn: ConnectionId,
    incarnation: u64,
    data_peer: PeerId,
    transfer: Transfer,
    notify_after_read: Option<Vec<u8>>,
}

impl PreparedTransfer {
    /// Number of descriptors after merging contiguous runs.
    pub fn descriptors(&self) -> usize {
        self.transfer.local.len()
    }

    /// Payload bytes.
    pub fn bytes(&self) -> u64 {
        self.transfer.total_len()
    }

    /// The peer incarnation it was planned against.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The same plan for one more post, with a transfer id of its own (a
    /// plan posts once; this posts it again without planning again; the
    /// deadline, as every post's, runs from the post). Still for the
    /// incarnation it was planned against: after the peer restarted,
    /// posting it fails with [`ErrorKind::Stale`] as the original would.
    pub fn again(&self) -> Self {
        let mut transfer = self.transfer.clone();
        transfer.id = TransferId::next();
        Self {
            conn: self.conn,
            incarnation: self.incarnation,
            data_peer: self.data_peer,
            transfer,
            notify_after_read: self.notify_after_read.clone(),
        }
    }
}

/// A connected remote agent. Cheap to clone; follows the peer across
/// restarts (new transfers use the new incarnation's keys).
#[derive(Clone)]
pub struct Peer {
    inner: Arc<Inner>,
    conn: ConnectionId,
    addr: String,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("conn", &self.conn)
            .field("addr", &self.addr)
            .finish()
    }
}

/// Stands for a prepared transfer's deadline until its post stamps it.
fn unposted() -> Instant {
    static AT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *AT.get_or_init(Instant::now)
}

/// Default deadline of transfers, from their post
/// ([`AgentBuilder::transfer_deadline`](crate::AgentBuilder::transfer_deadline)).
pub const DEFAULT_TRANSFER_DEADLINE: Duration = Duration::from_secs(30);

/// The longest transfer deadline
/// ([`AgentBuilder::transfer_deadline`](crate::AgentBuilder::transfer_deadline)
/// clamps to it): a day. Every transfer ends, and a deadline stays far
/// from the clock's range.
pub const MAX_TRANSFER_DEADLINE: Duration = Duration::from_secs(24 * 3600);

impl Peer {
    pub(crate) fn new(inner: Arc<Inner>, conn: ConnectionId, addr: String) -> Self {
        Self { inner, conn, addr }
    }

    /// The control connection id.
    pub fn id(&self) -> ConnectionId {
        self.conn
    }

    /// The address dialed.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The peer's engine id (empty until the first handshake completed).
    pub fn engine_id(&self) -> String {
        lock(&self.inner.peers)
            .get(&self.conn)
            .map(|e| e.engine_id.clone())
            .unwrap_or_default()
    }

    /// The peer's current incarnation.
    pub fn incarnation(&self) -> Option<u64> {
        lock(&self.inner.peers)
            .get(&self.conn)
            .map(|e| e.incarnation)
    }

    /// Whether the connection is up with its data plane attached, so that
    /// transfers can be posted to it. False while the peer is dead, after
    /// it restarted until its new incarnation is attached, and once the
    /// connection closed.
    pub fn is_attached(&self) -> bool {
        lock(&self.inner.peers)
            .get(&self.conn)
            .is_some_and(|e| e.data_peer.is_some())
    }

    /// The backend that carries this side's transfers to the peer, while
    /// its data plane is attached: with [`BackendChoice::Auto`](crate::BackendChoice::Auto),
    /// `Shm` for a peer on this host that shm reached, else the backend
    /// `auto` fell back to (the reason is logged at `info`).
    pub fn backend_kind(&self) -> Option<kvlane_data::BackendKind> {
        let data_peer = lock(&self.inner.peers).get(&self.conn)?.data_peer?;
        Some(
            self.inner
                .transport
                .with_backend(|b| b.peer_kind(data_peer)),
        )
    }

    /// The layout of the peer's first KV cache, as it advertised it.
    pub fn remote_layout(&self) -> Option<kvlane_data::KvLayout> {
        lock(&self.inner.peers)
            .get(&self.conn)
            .and_then(|e| e.kv.first())
            .map(|k| k.layout)
    }

    /// Plans a transfer of `layers` of the blocks `local_ids[i]` ↔
    /// `remote_ids[i]` against the peer's current incarnation.
    pub fn prepare(
        &self,
        op: Op,
        layers: Range<u32>,
        local_ids: &[u32],
        remote_ids: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<PreparedTransfer, Error> {
        let local = self.inner.kv.first().ok_or_else(|| {
            Error::msg(ErrorKind::InvalidInput, "this agent registered no KV cache")
        })?;
        let peers = lock(&self.inner.peers);
        let (entry, data_peer) = self.ready(&peers)?;
        let remote = entry.kv.first().ok_or_else(|| {
            Error::msg(
                ErrorKind::InvalidInput,
                format!(
                    "peer {} at {} advertised no KV cache",
                    entry.engine_id, self.addr
                ),
            )
        })?;
        let (l, r): (Descriptors, RemoteDescriptors) = PLAN.with_borrow_mut(|copies| {
            let planned = plan_into(
                &local.layout,
                local_ids,
                &remote.layout,
                remote_ids,
                layers,
                copies,
            );
            let descriptors = planned.map(|()| {
                copies
                    .iter()
                    .map(|c| {
                        (
                            Descriptor {
                                region: local.region.id(),
                                offset: c.local,
                                len: c.len,
                            },
                            RemoteDescriptor {
                                key: remote.region.key,
                                offset: c.remote,
                                len: c.len,
                            },
                        )
                    })
                    .unzip()
            });
            if copies.capacity() > PLAN_KEEP {
                *copies = Vec::new();
            }
            descriptors
        })?;
        let incarnation = entry.incarnation;
        drop(peers);
        self.planned(op, data_peer, incarnation, l, r, notify)
    }

    /// The plain regions the peer advertised (see
    /// [`AgentBuilder::register_region`](crate::AgentBuilder::register_region)):
    /// their addresses and lengths in the peer's address space and the
    /// rights it grants.
    pub fn remote_regions(&self) -> Vec<RemoteRegion> {
        lock(&self.inner.peers)
            .get(&self.conn)
            .map(|e| e.regions.clone())
            .unwrap_or_default()
    }

    /// Checks that every span lies inside one region the peer advertised
    /// (KV caches and plain regions) granting `op`, as
    /// [`prepare_spans`](Self::prepare_spans) will.
    pub fn check_remote_spans(&self, op: Op, spans: &[MemSpan]) -> Result<(), Error> {
        let peers = lock(&self.inner.peers);
        let entry = peers.get(&self.conn).ok_or_else(|| self.lost("closed"))?;
        self.resolve_remote(entry, spans, op).map(drop)
    }

    /// Plans a transfer of arbitrary spans: `local[i]` (an address range
    /// inside this agent's registrations) ↔ `remote[i]` (inside a region
    /// the peer advertised), pair by pair of equal length, against the
    /// peer's current incarnation. Runs contiguous on both sides merge into
    /// one descriptor. Spans outside a registration, without the rights
    /// `op` needs (a READ into read-only memory), or of mismatched lengths
    /// fail here with an error naming the span; nothing is posted.
    pub fn prepare_spans(
        &self,
        op: Op,
        local: &[MemSpan],
        remote: &[MemSpan],
        notify: Option<&[u8]>,
    ) -> Result<PreparedTransfer, Error> {
        let l = self.inner.resolve_local(local, op)?;
        let (data_peer, incarnation, r) = {
            let peers = lock(&self.inner.peers);
            let (entry, data_peer) = self.ready(&peers)?;
            let r = self.resolve_remote(entry, remote, op)?;
            (data_peer, entry.incarnation, r)
        };
        let (l, r) = spans::pair(l, r)?;
        self.planned(op, data_peer, incarnation, l, r, notify)
    }

    /// This connection's entry and its data-plane peer, or why there is none.
    fn ready<'a>(
        &self,
        peers: &'a FastMap<ConnectionId, PeerEntry>,
    ) -> Result<(&'a PeerEntry, PeerId), Error> {
        let r = match peers.get(&self.conn) {
            None => Err(self.lost("closed")),
            Some(entry) => match entry.data_peer {
                Some(data_peer) => Ok((entry, data_peer)),
                None => Err(entry
                    .attach_error()
                    .unwrap_or_else(|| self.lost("dead or restarting"))),
            },
        };
        if let Err(e) = &r {
            // A transfer asked of a peer that cannot take it.
            self.inner.metrics.refused(e.kind());
        }
        r
    }

    /// Remote spans resolved against what `entry` advertised (KV caches
    /// and plain regions), under the peer lock: nothing is copied when
    /// the peer advertised plain regions only, and the peer's name is
    /// formatted only for an error.
    fn resolve_remote(
        &self,
        entry: &PeerEntry,
        spans: &[MemSpan],
        op: Op,
    ) -> Result<Vec<RemoteDescriptor>, Error> {
        let advertised: std::borrow::Cow<'_, [RemoteRegion]> = if entry.kv.is_empty() {
            (&entry.regions[..]).into()
        } else {
            entry
                .kv
                .iter()
                .map(|k| k.region)
                .chain(entry.regions.iter().copied())
                .collect::<Vec<_>>()
                .into()
        };
        let name = PeerName {
            engine_id: &entry.engine_id,
            addr: &self.addr,
        };
        spans::resolve_remote(&advertised, spans, op, name)
    }

    /// A planned transfer with its deadline and notification.
    fn planned(
        &self,
        op: Op,
        data_peer: PeerId,
        incarnation: u64,
        l: Descriptors,
        r: RemoteDescriptors,
        notify: Option<&[u8]>,
    ) -> Result<PreparedTransfer, Error> {
        // The deadline is stamped by the post (a plan may be posted long
        // after it was made); until then it holds a placeholder.
        let mut transfer = Transfer::due(data_peer, op, l, r, unposted());
        let frame = notify
            .map(|p| frames::notify_frame(&self.inner.engine_id, p))
            .transpose()?;
        let mut notify_after_read = None;
        match (op, frame) {
            (Op::Write, Some(f)) => transfer = transfer.with_notify(f),
            // Sent over the control plane once the data is here: checked
            // now, not after the bytes moved.
            (Op::Read, Some(f)) if f.len() > self.inner.notify_cap => {
                return Err(Error::msg(
                    ErrorKind::InvalidInput,
                    format!(
                        "a READ's notification to peer {} is {} bytes framed; the control plane carries at most {} (Config::notify_cap)",
                        self.addr,
                        f.len(),
                        self.inner.notify_cap
                    ),
                ));
            }
            (Op::Read, Some(f)) => notify_after_read = Some(f),
            (_, None) => {}
        }
        Ok(PreparedTransfer {
            conn: self.conn,
            incarnation,
            data_peer,
            transfer,
            notify_after_read,
        })
    }

    /// Posts a prepared transfer. Never blocks. Fails with
    /// [`ErrorKind::Stale`] when the peer restarted since it was prepared,
    /// and with [`ErrorKind::Busy`] when the backend's queue is full (await
    /// earlier handles, then post again).
    pub fn post(&self, prepared: PreparedTransfer) -> Result<TransferHandle, Error> {
        let r = self.post_inner(prepared);
        if let Err(e) = &r {
            self.inner.metrics.refused(e.kind());
        }
        r
    }

    fn post_inner(&self, prepared: PreparedTransfer) -> Result<TransferHandle, Error> {
        // The transfer's one clock read on this path, as the post begins:
        // its deadline, its submission time (the handle's `posted_at`)
        // and the backend's.
        let now = Instant::now();
        let recorder = self.posting(&lock(&self.inner.peers), &prepared)?;
        let PreparedTransfer {
            mut transfer,
            notify_after_read,
            ..
        } = prepared;
        transfer.deadline = now + self.inner.transfer_deadline;
        // Never blocks: a full queue is `ErrorKind::Busy` (retry after earlier
        // transfers completed), not a stalled async task. The peer's
        // metrics observe the transfer's end.
        let data = self
            .inner
            .transport
            .submit_observed_at(transfer, recorder, now)?;
        Ok(self.handle(data, notify_after_read))
    }

    /// Posts several prepared transfers in one call: one result per
    /// transfer, in order, each as [`post`](Self::post) gives it. The
    /// backend takes the batch at once (tcp: one hand-over per stream, so
    /// 128 small transfers leave in a few large writes, as one transfer of
    /// 128 blocks does, instead of a write and a thread wake-up each).
    /// Never blocks; a refused transfer does not stop the others.
    pub fn post_batch(
        &self,
        prepared: Vec<PreparedTransfer>,
    ) -> Vec<Result<TransferHandle, Error>> {
        let mut out: Vec<Option<Result<TransferHandle, Error>>> =
            Vec::with_capacity(prepared.len());
        let mut submit = Vec::with_capacity(prepared.len());
        // Where each submitted transfer's result goes, and its READ
        // notification.
        let mut after = Vec::with_capacity(prepared.len());
        let deadline = Instant::now() + self.inner.transfer_deadline;
        {
            let peers = lock(&self.inner.peers);
            for mut p in prepared {
                p.transfer.deadline = deadline;
                match self.posting(&peers, &p) {
                    Ok(recorder) => {
                        after.push((out.len(), p.notify_after_read));
                        submit.push((p.transfer, Some(Then::Observe(recorder))));
                        // The submission's result, below.
                        out.push(None);
                    }
                    Err(e) => {
                        self.inner.metrics.refused(e.kind());
                        out.push(Some(Err(e)));
                    }
                }
            }
        }
        let results = self.inner.transport.submit_batch(submit);
        for ((i, notify_after_read), r) in after.into_iter().zip(results) {
            out[i] = Some(match r {
                Ok(data) => Ok(self.handle(data, notify_after_read)),
                Err(e) => {
                    let e = Error::from(e);
                    self.inner.metrics.refused(e.kind());
                    Err(e)
                }
            });
        }
        // `Transport::submit_batch` answers every transfer it is given.
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(self.lost("not posted"))))
            .collect()
    }

    /// Checks, under the peer lock, that `prepared` is for the peer's
    /// current incarnation; the peer's metrics recorder.
    fn posting(
        &self,
        peers: &FastMap<ConnectionId, PeerEntry>,
        prepared: &PreparedTransfer,
    ) -> Result<Arc<PeerMetrics>, Error> {
        let entry = peers
            .get(&prepared.conn)
            .ok_or_else(|| self.lost("closed"))?;
        if entry.incarnation != prepared.incarnation || entry.data_peer != Some(prepared.data_peer)
        {
            return Err(Error::msg(
                ErrorKind::Stale,
                format!(
                    "transfer was prepared for incarnation {:#x} of {} at {}, which is now \
                     {:#x}{}; prepare it again",
                    prepared.incarnation,
                    entry.engine_id,
                    self.addr,
                    entry.incarnation,
                    if entry.data_peer.is_none() {
                        " (not ready)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(match &entry.metrics {
            Some(m) => m.clone(),
            None => self
                .inner
                .metrics
                .for_peer(&entry.engine_id, self.inner.rail),
        })
    }

    /// The caller's handle of a submitted transfer; a READ's notification
    /// goes through the control plane once its data is here.
    fn handle(
        &self,
        data: kvlane_data::TransferHandle,
        notify_after_read: Option<Vec<u8>>,
    ) -> TransferHandle {
        let posted = data.submitted_at();
        let Some(frame) = notify_after_read else {
            return TransferHandle {
                inner: HandleInner::Data(data),
                posted,
            };
        };
        let (tx, rx) = oneshot::channel();
        let inner = self.inner.clone();
        let conn = self.conn;
        self.inner.runtime.spawn(async move {
            let r = match data.await {
                Ok(()) => inner
                    .control
                    .notify(conn, 0, frame)
                    .await
                    .map_err(Error::from),
                Err(e) => Err(Error::from(e)),
            };
            let _ = tx.send(r);
        });
        TransferHandle {
            inner: HandleInner::Task(rx),
            posted,
        }
    }

    /// Prepares and posts a WRITE of local blocks into remote blocks; the
    /// notification (if any) reaches the peer after every byte landed.
    pub fn write_blocks(
        &self,
        layers: Range<u32>,
        local_ids: &[u32],
        remote_ids: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<TransferHandle, Error> {
        self.post(self.prepare(Op::Write, layers, local_ids, remote_ids, notify)?)
    }

    /// Prepares and posts a READ of remote blocks into local blocks; the
    /// notification (if any) is sent to the peer once the data is here.
    pub fn read_blocks(
        &self,
        layers: Range<u32>,
        local_ids: &[u32],
        remote_ids: &[u32],
        notify: Option<&[u8]>,
    ) -> Result<TransferHandle, Error> {
        self.post(self.prepare(Op::Read, layers, local_ids, remote_ids, notify)?)
    }

    /// Sends a notification through the control plane.
    pub async fn notify(&self, payload: &[u8]) -> Result<(), Error> {
        let frame = frames::notify_frame(&self.inner.engine_id, payload)?;
        Ok(self.inner.control.notify(self.conn, 0, frame).await?)
    }

    /// One control-plane round trip.
    pub async fn ping(&self) -> Result<Duration, Error> {
        Ok(self.inner.control.ping(self.conn).await?)
    }

    /// Closes this connection (`bye`); in-flight transfers fail with
    /// `PeerLost`. Idempotent.
    pub async fn disconnect(&self) -> Result<(), Error> {
        self.inner.detach(self.conn, "disconnected");
        Ok(self.inner.control.disconnect(self.conn).await?)
    }

    fn lost(&self, what: &str) -> Error {
        Error::msg(
            ErrorKind::PeerLost,
            format!("peer {} ({}) is {what}", self.addr, self.conn),
        )
    }
}

enum HandleInner {
    Data(kvlane_data::TransferHandle),
    Task(oneshot::Receiver<Result<(), Error>>),
}

/// The pending result of a block transfer: `.await` it or
/// [`wait`](Self::wait) for it. Every transfer ends by its deadline.
#[must_use = "a transfer's result reports whether its bytes landed"]
pub struct TransferHandle {
    inner: HandleInner,
    /// When the post began (see [`posted_at`](Self::posted_at)).
    posted: Instant,
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferHandle")
    }
}

impl TransferHandle {
    /// When the transfer was posted: the clock read that stamped its
    /// deadline ([`AgentBuilder::transfer_deadline`] from here), taken as
    /// [`Peer::post`] began (one read for all of a
    /// [`Peer::post_batch`]). A caller timing transfers can measure from
    /// here instead of reading the clock again before each post.
    ///
    /// [`AgentBuilder::transfer_deadline`]: crate::AgentBuilder::transfer_deadline
    pub fn posted_at(&self) -> Instant {
        self.posted
    }

    /// Blocks the thread until the transfer ends (not from async code).
    pub fn wait(self) -> Result<(), Error> {
        match self.inner {
            HandleInner::Data(h) => Ok(h.wait()?),
            HandleInner::Task(rx) => rx
                .blocking_recv()
                .unwrap_or_else(|_| Err(Error::msg(ErrorKind::Closed, "agent closed"))),
        }
    }
}

impl TransferHandle {
    /// Blocks the thread for at most `timeout` (not from async code);
    /// `None` while the transfer is still running, and the handle stays
    /// usable. No runtime is entered: a waiter pays one condition-variable
    /// wait, which is what a blocking caller (Python's `wait`) needs per
    /// transfer.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Result<(), Error>> {
        match &mut self.inner {
            HandleInner::Data(h) => h.wait_timeout(timeout).map(|r| r.map_err(Error::from)),
            HandleInner::Task(rx) => {
                // A READ with a notification: its control-plane step runs
                // in a task; poll its answer (rare, and bounded by the
                // transfer's deadline).
                let end = Instant::now() + timeout;
                loop {
                    match rx.try_recv() {
                        Ok(r) => return Some(r),
                        Err(oneshot::error::TryRecvError::Closed) => {
                            return Some(Err(Error::msg(ErrorKind::Closed, "agent closed")))
                        }
                        Err(oneshot::error::TryRecvError::Empty) => {}
                    }
                    let left = end.checked_duration_since(Instant::now())?;
                    std::thread::sleep(left.min(Duration::from_micros(200)));
                }
            }
        }
    }
}

impl Future for TransferHandle {
    type Output = Result<(), Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.inner {
            HandleInner::Data(h) => Pin::new(h).poll(cx).map(|r| r.map_err(Error::from)),
            HandleInner::Task(rx) => Pin::new(rx)
                .poll(cx)
                .map(|r| r.unwrap_or_else(|_| Err(Error::msg(ErrorKind::Closed, "agent closed")))),
        }
    }
}

/// How errors name a peer (`peer ENGINE at HOST:PORT`), formatted only
/// when an error is.
struct PeerName<'a> {
    engine_id: &'a str,
    addr: &'a str,
}

impl std::fmt::Display for PeerName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "peer {} at {}", self.engine_id, self.addr)
    }
}
