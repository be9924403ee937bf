//! The loopback backend: one-sided transfers between backends of the same
//! process, executed as `memcpy` with the checks a NIC makes. GPU memory
//! on either side moves through pinned staging buffers (`gpu/staging.rs`).
//!
//! Every loopback backend is a node of a process-wide fabric. A peer is
//! another node; its regions are looked up by key at execution time, and
//! every check (key known, range inside the region, remote right present,
//! local range and right) passes before the first byte moves.

use crate::backend::Backend;
use crate::error::{DataError, SubmitError};
use crate::gpu::staging::copy_between;
use crate::host_registry::HostRegistry;
use crate::ids::FastMap;
use crate::ids::{PeerId, RegionId, RemoteKey};
use crate::memory::{Access, Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Op, Segment, Transfer};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

/// Settings of a [`LoopbackBackend`].
#[derive(Clone, Debug)]
pub struct LoopbackConfig {
    /// Transfers that may be queued before `submit` hands them back.
    /// Default 4096.
    pub queue_depth: usize,
    /// Bytes copied per `poll` call before it returns (at least one
    /// transfer is always finished). Default 8 MiB; bounds how long `poll`
    /// holds the caller.
    pub poll_budget: u64,
    /// Behave like verbs: every `prepare_peer` issues a distinct endpoint
    /// that exactly one remote `connect_peer` may use (as a queue pair
    /// pairs with one remote queue pair). Exercises per-peer endpoint
    /// exchange without RDMA hardware. Default false.
    pub endpoint_per_peer: bool,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        Self {
            queue_depth: 4096,
            poll_budget: 8 << 20,
            endpoint_per_peer: false,
        }
    }
}

#[derive(Default)]
struct Node {
    regions: Mutex<FastMap<RemoteKey, Region>>,
    notifications: Mutex<VecDeque<Bytes>>,
    /// Per-peer endpoints issued and not yet used (`endpoint_per_peer`).
    open_slots: Mutex<std::collections::HashSet<u64>>,
}

fn fabric() -> &'static Mutex<HashMap<u64, Weak<Node>>> {
    static FABRIC: OnceLock<Mutex<HashMap<u64, Weak<Node>>>> = OnceLock::new();
    FABRIC.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain tables behind,
    // which stay consistent: keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct PeerState {
    node: Option<Weak<Node>>,
}

/// In-process backend (see the [module docs](self)).
pub struct LoopbackBackend {
    config: LoopbackConfig,
    node_id: u64,
    node: Arc<Node>,
    next_peer: u64,
    registry: HostRegistry,
    peers: FastMap<PeerId, PeerState>,
    queue: VecDeque<Transfer>,
    failed: VecDeque<Completion>,
    /// Checked segments of the transfer being executed (reused).
    scratch: Vec<Segment>,
}

impl std::fmt::Debug for LoopbackBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackBackend")
            .field("node", &self.node_id)
            .field("regions", &self.registry.len())
            .field("peers", &self.peers.len())
            .field("queued", &self.queue.len())
            .finish()
    }
}

impl Default for LoopbackBackend {
    fn default() -> Self {
        Self::new(LoopbackConfig::default())
    }
}

impl LoopbackBackend {
    /// A new node on the process-wide loopback fabric.
    pub fn new(config: LoopbackConfig) -> Self {
        let node = Arc::new(Node::default());
        let node_id = {
            let mut fabric = lock(fabric());
            fabric.retain(|_, n| n.strong_count() > 0);
            let id = fabric.keys().max().map_or(1, |m| m + 1);
            fabric.insert(id, Arc::downgrade(&node));
            id
        };
        Self {
            config,
            node_id,
            node,
            next_peer: 1,
            registry: HostRegistry::default(),
            peers: FastMap::default(),
            queue: VecDeque::new(),
            failed: VecDeque::new(),
            scratch: Vec::new(),
        }
    }

    fn target(&self, peer: PeerId) -> Result<Arc<Node>, DataError> {
        let state = self.peers.get(&peer).ok_or(DataError::UnknownPeer(peer))?;
        state
            .node
            .as_ref()
            .and_then(Weak::upgrade)
            .ok_or(DataError::PeerLost {
                peer,
                reason: "the peer's loopback backend was dropped or never connected",
                source: None,
            })
    }
}

/// Checks every segment of `t`, then copies them all (nothing moves when
/// any check fails). `now` is read once per `poll`; `regions` resolves
/// against the target's region table, locked by the caller for a run of
/// transfers; `plan` is scratch space.
fn execute(
    t: &Transfer,
    now: Instant,
    regions: &mut Regions<'_>,
    plan: &mut Vec<Segment>,
) -> Result<(), DataError> {
    if now > t.deadline {
        return Err(DataError::Timeout {
            id: t.id,
            peer: t.peer,
            overdue: now - t.deadline,
        });
    }
    plan.clear();
    for seg in t.segments()? {
        let (local, remote) = regions.of(t.peer, &seg)?;
        if t.op == Op::Read && !local.access().contains(Access::LOCAL_WRITE) {
            return Err(DataError::AccessDenied {
                op: t.op,
                target: format!("local {}", seg.region),
                needed: Access::LOCAL_WRITE,
                granted: local.access(),
            });
        }
        local.check_range(seg.local_offset, seg.len)?;
        check_remote(t.peer, seg.key, remote, t.op, seg.remote_offset, seg.len)?;
        plan.push(seg);
    }
    for seg in plan.iter() {
        let (local, remote) = regions.of(t.peer, seg)?;
        match t.op {
            // GPU memory on either side is staged through pinned buffers.
            Op::Write => copy_between(local, seg.local_offset, remote, seg.remote_offset, seg.len)?,
            Op::Read => copy_between(remote, seg.remote_offset, local, seg.local_offset, seg.len)?,
        }
    }
    Ok(())
}

/// Looks up the regions the segments of a run of transfers name, again
/// only when a segment names different ones than the one before.
struct Regions<'a> {
    local: &'a HostRegistry,
    remote: &'a FastMap<RemoteKey, Region>,
    last: Option<(RegionId, RemoteKey, &'a Region, &'a Region)>,
}

impl<'a> Regions<'a> {
    fn of(&mut self, peer: PeerId, seg: &Segment) -> Result<(&'a Region, &'a Region), DataError> {
        if let Some((id, key, local, remote)) = self.last {
            if id == seg.region && key == seg.key {
                return Ok((local, remote));
            }
        }
        let local = self
            .local
            .get(seg.region)
            .ok_or(DataError::UnknownRegion(seg.region))?;
        let remote = self
            .remote
            .get(&seg.key)
            .ok_or(DataError::UnknownKey { peer, key: seg.key })?;
        self.last = Some((seg.region, seg.key, local, remote));
        Ok((local, remote))
    }
}

/// The checks a target NIC makes for one remote span of `region`, served
/// under `key`.
pub(crate) fn check_remote(
    peer: PeerId,
    key: RemoteKey,
    region: &Region,
    op: Op,
    offset: u64,
    len: u64,
) -> Result<(), DataError> {
    region.advert(key).check(peer, op, offset, len)
}

impl Backend for LoopbackBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Loopback
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        let key = self.registry.register("loopback", region)?;
        lock(&self.node.regions).insert(key, region.clone());
        Ok(region.advert(key))
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        let key = self.registry.deregister(region)?;
        lock(&self.node.regions).remove(&key);
        Ok(())
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let peer = PeerId(self.next_peer);
        self.next_peer += 1;
        self.peers.insert(peer, PeerState { node: None });
        let mut data = self.node_id.to_le_bytes().to_vec();
        if self.config.endpoint_per_peer {
            lock(&self.node.open_slots).insert(peer.0);
            data.extend_from_slice(&peer.0.to_le_bytes());
        }
        Ok((
            peer,
            Endpoint {
                backend: BackendKind::Loopback,
                data,
            },
        ))
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        _regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        // A multi-rail peer's endpoint: this backend pairs its first rail.
        let remote = &remote.primary();
        let bad = |reason: &str| DataError::BadEndpoint {
            backend: "loopback",
            reason: reason.to_owned(),
        };
        if remote.backend != BackendKind::Loopback {
            return Err(bad(&format!(
                "endpoint is for the {} backend",
                remote.backend
            )));
        }
        let (want, what) = if self.config.endpoint_per_peer {
            (16, "a 16-byte node id and slot (per-peer endpoints)")
        } else {
            (8, "an 8-byte node id")
        };
        if remote.data.len() != want {
            return Err(bad(&format!(
                "expected {what}, got {} bytes",
                remote.data.len()
            )));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&remote.data[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        let id = word(0);
        let node = lock(fabric())
            .get(&id)
            .cloned()
            .filter(|n| n.strong_count() > 0)
            .ok_or_else(|| bad(&format!("no loopback node {id} in this process")))?;
        if self.config.endpoint_per_peer {
            let slot = word(1);
            let live = node
                .upgrade()
                .ok_or_else(|| bad("the remote node is gone"))?;
            if !lock(&live.open_slots).remove(&slot) {
                return Err(bad(&format!(
                    "endpoint slot {slot} of node {id} is unknown or already connected"
                )));
            }
        }
        let state = self
            .peers
            .get_mut(&peer)
            .ok_or(DataError::UnknownPeer(peer))?;
        state.node = Some(node);
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerId) {
        if self.peers.remove(&peer).is_none() {
            return;
        }
        Completion::fail_removed(&mut self.queue, &mut self.failed, peer);
    }

    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        if !self.peers.contains_key(&transfer.peer) {
            return Err(SubmitError::Rejected(DataError::UnknownPeer(transfer.peer)));
        }
        if let Err(e) = transfer.check_lengths() {
            return Err(SubmitError::Rejected(e));
        }
        if self.queue.len() >= self.config.queue_depth {
            return Err(SubmitError::QueueFull {
                transfer: Box::new(transfer),
                in_flight: self.queue.len(),
            });
        }
        self.queue.push_back(transfer);
        Ok(())
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        let before = completions.len();
        completions.extend(self.failed.drain(..));
        // One transfer at least per `poll`, even with a budget of zero.
        let mut budget = self.config.poll_budget.max(1);
        let now = Instant::now();
        // Runs of queued transfers to one peer: the peer's node is looked up
        // and its region table locked once per run, not per transfer, and
        // consecutive segments naming the same regions share one lookup.
        // The table stays locked while the bytes move, so a concurrent
        // deregistration waits instead of racing the copy; `poll_budget`
        // bounds that wait.
        while budget > 0 {
            let Some(peer) = self.queue.front().map(|t| t.peer) else {
                break;
            };
            let node = match self.target(peer) {
                Ok(node) => node,
                Err(e) => {
                    let t = self.queue.pop_front().expect("front was just read");
                    completions.push(Completion {
                        id: t.id,
                        peer,
                        result: Err(e),
                    });
                    budget -= 1;
                    continue;
                }
            };
            let table = lock(&node.regions);
            let mut regions = Regions {
                local: &self.registry,
                remote: &table,
                last: None,
            };
            while self.queue.front().is_some_and(|t| t.peer == peer) && budget > 0 {
                let t = self.queue.pop_front().expect("front was just read");
                let result = execute(&t, now, &mut regions, &mut self.scratch);
                let moved = match (&result, &t.notify) {
                    (Ok(()), Some(payload)) => {
                        lock(&node.notifications).push_back(payload.clone());
                        t.total_len()
                    }
                    (Ok(()), None) => t.total_len(),
                    (Err(_), _) => 0,
                };
                completions.push(Completion {
                    id: t.id,
                    peer,
                    result,
                });
                budget = budget.saturating_sub(moved.max(1));
            }
        }
        completions.len() - before
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        let mut q = lock(&self.node.notifications);
        let n = q.len();
        out.extend(q.drain(..).map(|payload| Notification {
            payload,
            from: None,
        }));
        n
    }

    fn in_flight(&self) -> usize {
        self.queue.len() + self.failed.len()
    }

    fn endpoint_per_peer(&self) -> bool {
        self.config.endpoint_per_peer
    }
}

impl Drop for LoopbackBackend {
    fn drop(&mut self) {
        lock(fabric()).remove(&self.node_id);
    }
}
