//! [`VerbsBackend`]: the [`Backend`] trait on RC queue pairs.
//!
//! Per peer: `qps_per_peer` connected QPs sharing one completion queue, a
//! notification *mailbox* (registered slots the peer writes into with
//! WRITE_WITH_IMM) and a *staging* buffer for our own notification payloads.
//! The posting engine lives in `engine.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::device::DeviceConfig;
use super::engine::{Inflight, NotifyState, Peer, QpState};
use super::error::VerbsError;
use super::qp::{QpBuilder, QpEndpoint, QpOptions};
use super::resources::WorkCompletion;
use super::resources::{CompletionQueue, Context, MemoryRegistration, MrAccess, ProtectionDomain};
use crate::backend::Backend;
use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId, RemoteKey, TransferId};
use crate::memory::{Access, MemoryKind, Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Transfer};

/// Configuration of a [`VerbsBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device, port and GID selection.
    pub device: DeviceConfig,
    /// Queue pairs per peer; transfers are striped over them.
    pub qps_per_peer: usize,
    /// Queue-pair options (send queue depth, timeouts).
    pub qp: QpOptions,
    /// Largest piece a descriptor is split into before striping (further
    /// capped by the port's max message size). 1 MiB: not tuned on
    /// hardware; big enough that per-WR overhead is negligible, small enough
    /// that large descriptors spread over every QP.
    pub stripe_chunk: u64,
    /// Request a completion every this many work requests of one chain
    /// (selective signaling). 16: not measured; frees send-queue slots well
    /// before a 512-deep queue fills.
    pub signal_every: u32,
    /// Notification slots per peer (= receives kept posted for WRITE_WITH_IMM).
    pub notify_slots: u32,
    /// Transfers accepted but not yet returned by `poll` before `submit`
    /// answers [`SubmitError::QueueFull`].
    pub max_in_flight: usize,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            device: DeviceConfig::default(),
            qps_per_peer: 2,
            qp: QpOptions::default(),
            stripe_chunk: 1 << 20,
            signal_every: 16,
            notify_slots: 64,
            max_in_flight: 4096,
        }
    }
}

/// What a verbs peer needs to reach us (msgpack in [`Endpoint::data`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireEndpoint {
    /// Format version.
    pub(crate) v: u8,
    /// One endpoint per queue pair, paired by index.
    pub(crate) qps: Vec<QpEndpoint>,
    /// Address of our notification mailbox.
    pub(crate) mailbox_addr: u64,
    /// Its remote key.
    pub(crate) mailbox_rkey: u32,
    /// Number of slots.
    pub(crate) mailbox_slots: u32,
    /// Bytes per slot.
    pub(crate) slot_size: u32,
}

/// Counters of one queue pair, for tests and diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpStats {
    /// Local queue pair number.
    pub qpn: u32,
    /// Data work requests (READ/WRITE) posted so far.
    pub data_wrs_posted: u64,
    /// The queue pair failed and waits for a new handshake.
    pub failed: bool,
}

/// A local registration: the region (kept alive) and its MR.
#[derive(Clone)]
pub(crate) struct Local {
    pub(crate) region: Region,
    pub(crate) mr: Arc<MemoryRegistration>,
}

/// Bytes per notification slot; payloads are further limited to the path MTU
/// so each notification is a single-packet message (see `engine.rs`).
pub(crate) const SLOT_SIZE: u32 = 4096;

/// The libibverbs backend. Create with [`VerbsBackend::new`]; connect peers
/// through [`Backend::prepare_peer`] / [`Backend::connect_peer`].
///
/// Completions only appear while [`Backend::poll`] is called (CQ polling):
/// [`Backend::needs_busy_poll`] is `true`. A target must also call `poll`
/// (or `poll_notifications`) so notification receives are re-posted.
pub struct VerbsBackend {
    // Field order is drop order: queue pairs go before the memory they access.
    pub(crate) peers: HashMap<PeerId, Peer>,
    pub(crate) inflight: HashMap<TransferId, Inflight>,
    pub(crate) regions: HashMap<RegionId, Local>,
    pub(crate) done: Vec<Completion>,
    pub(crate) notes: VecDeque<Notification>,
    pub(crate) tokens: HashMap<u32, (PeerId, usize)>,
    pub(crate) next_token: u32,
    pub(crate) next_peer: u64,
    pub(crate) wcs: Vec<WorkCompletion>,
    pub(crate) earliest_deadline: Option<Instant>,
    pub(crate) cq_reserved: u32,
    pub(crate) chunk: u64,
    pub(crate) config: VerbsConfig,
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) ctx: Arc<Context>,
}

impl std::fmt::Debug for VerbsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsBackend")
            .field("device", &self.ctx.name())
            .field("peers", &self.peers.len())
            .field("in_flight", &self.inflight.len())
            .finish_non_exhaustive()
    }
}

impl VerbsBackend {
    /// Opens the device, allocates a PD and one completion queue. Fails with
    /// [`VerbsError::Unsupported`] on hosts without RDMA.
    pub fn new(config: VerbsConfig) -> Result<Self, VerbsError> {
        let ctx = Context::open(&config.device)?;
        let pd = ctx.alloc_pd()?;
        // One CQ for every QP's sends and receives; peers reserve their share
        // (64 Ki entries: ~56 peers at the default depths, 28 on rxe whose
        // max_cqe is 32767).
        let cq = ctx.create_cq(ctx.limits().max_cqe.min(1 << 16))?;
        let max_msg = u64::from(ctx.port().max_msg_size.max(4096));
        let chunk = config.stripe_chunk.clamp(4096, max_msg);
        Ok(Self {
            peers: HashMap::new(),
            inflight: HashMap::new(),
            regions: HashMap::new(),
            done: Vec::new(),
            notes: VecDeque::new(),
            tokens: HashMap::new(),
            next_token: 1,
            next_peer: 1,
            wcs: Vec::with_capacity(64),
            earliest_deadline: None,
            cq_reserved: 0,
            chunk,
            config,
            cq,
            pd,
            ctx,
        })
    }

    /// The opened device context (device name, port, GID, limits).
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Number of queue pairs of `peer` that are connected and not failed.
    pub fn healthy_qps(&self, peer: PeerId) -> usize {
        self.peers
            .get(&peer)
            .map_or(0, |p| p.qps.iter().filter(|q| !q.broken).count())
    }

    /// Per-QP statistics of `peer` (empty for an unknown peer).
    pub fn qp_stats(&self, peer: PeerId) -> Vec<QpStats> {
        self.peers.get(&peer).map_or(Vec::new(), |p| {
            p.qps
                .iter()
                .map(|q| QpStats {
                    qpn: q.qpn(),
                    data_wrs_posted: q.posted,
                    failed: q.broken,
                })
                .collect()
        })
    }

    /// Registers a scratch region owned by the backend (mailbox, staging).
    fn scratch(&self, len: usize, access: Access) -> Result<Local, DataError> {
        let region = Region::alloc(len, access)?;
        let mr = self.register_mr(&region)?;
        Ok(Local { region, mr })
    }

    fn register_mr(&self, region: &Region) -> Result<Arc<MemoryRegistration>, DataError> {
        let a = region.access();
        let access = MrAccess {
            local_write: a.contains(Access::LOCAL_WRITE),
            remote_read: a.contains(Access::REMOTE_READ),
            remote_write: a.contains(Access::REMOTE_WRITE),
        };
        let len =
            usize::try_from(region.len()).map_err(|_| DataError::Alloc { len: usize::MAX })?;
        let mr = match region.kind() {
            // SAFETY: `Region` guarantees `addr..addr+len` is valid memory for
            // as long as a clone of it lives; the backend keeps a clone next to
            // the registration (`Local`) and in every in-flight transfer, and
            // queue pairs are dropped before regions (field order).
            MemoryKind::Host => unsafe {
                self.pd.register_host(region.addr() as usize, len, access)
            },
            // SAFETY: `Region::from_raw`'s contract makes the dma-buf range
            // outlive the region; clones are kept as for host memory.
            MemoryKind::Device {
                dmabuf_fd, offset, ..
            } => unsafe {
                self.pd
                    .register_dmabuf(dmabuf_fd, offset, len, region.addr(), access)
            },
            MemoryKind::Gpu { device } => return self.register_gpu(region, device, len, access),
        }?;
        Ok(mr)
    }

    /// GPU memory: dma-buf first, then the device address (peer memory),
    /// else one error naming both failures. Never as host memory.
    fn register_gpu(
        &self,
        region: &Region,
        gpu: crate::gpu::GpuDevice,
        len: usize,
        access: MrAccess,
    ) -> Result<Arc<MemoryRegistration>, DataError> {
        use std::os::fd::AsRawFd;
        let by_dmabuf = region.export_dmabuf().and_then(|buf| {
            // SAFETY: the dma-buf covers the region's device memory, which
            // (by `Region::from_device_ptr`'s contract, or owned by the
            // region) outlives the region; clones are kept as for host
            // memory. The registration holds its own dma-buf reference, so
            // `buf.fd` may close after this call.
            unsafe {
                self.pd
                    .register_dmabuf(buf.fd.as_raw_fd(), buf.offset, len, region.addr(), access)
            }
            .map_err(DataError::from)
        });
        let dmabuf = match by_dmabuf {
            Ok(mr) => return Ok(mr),
            Err(e) => e,
        };
        // SAFETY: as above, the device range outlives the registration.
        match unsafe { self.pd.register_device_address(region.addr(), len, access) } {
            Ok(mr) => {
                tracing::info!(%gpu, "registered by device address (dma-buf failed: {dmabuf})");
                Ok(mr)
            }
            Err(address) => Err(VerbsError::RegisterGpu {
                device: self.pd.device_name().to_owned(),
                gpu,
                len,
                dmabuf: Box::new(dmabuf),
                address: Box::new(address),
            }
            .into()),
        }
    }

    fn peer_mut(&mut self, peer: PeerId) -> Result<&mut Peer, DataError> {
        self.peers
            .get_mut(&peer)
            .ok_or(DataError::UnknownPeer(peer))
    }
}

impl Backend for VerbsBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Verbs
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        let mr = self.register_mr(region)?;
        let ad = RemoteRegion {
            key: RemoteKey(mr.rkey()),
            addr: region.addr(),
            len: region.len(),
            access: region.access(),
        };
        self.regions.insert(
            region.id(),
            Local {
                region: region.clone(),
                mr,
            },
        );
        Ok(ad)
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        // In-flight transfers keep their own clone of the registration.
        self.regions
            .remove(&region)
            .map(drop)
            .ok_or(DataError::UnknownRegion(region))
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let n = self.config.qps_per_peer.max(1);
        let slots = self.config.notify_slots.max(1);
        let mut opts = self.config.qp;
        let need = (opts.max_send_wr + opts.max_recv_wr.max(slots)) * n as u32;
        if self.cq_reserved + need > self.cq.entries() {
            return Err(DataError::Unsupported {
                backend: "verbs",
                what: "completion queue budget exhausted: too many peers for this device's max_cqe",
            });
        }
        let mut prepared = Vec::with_capacity(n);
        for i in 0..n {
            // Only QP 0 receives notifications.
            opts.max_recv_wr = if i == 0 { slots } else { 1 };
            prepared.push(
                QpBuilder::new(&self.pd, &self.cq, &self.cq)
                    .options(opts)
                    .build()?,
            );
        }
        let mailbox = self.scratch(
            (slots * SLOT_SIZE) as usize,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )?;
        let staging = self.scratch((slots * SLOT_SIZE) as usize, Access::LOCAL_WRITE)?;
        let wire = WireEndpoint {
            v: 1,
            qps: prepared.iter().map(|q| q.endpoint()).collect(),
            mailbox_addr: mailbox.mr.addr(),
            mailbox_rkey: mailbox.mr.rkey(),
            mailbox_slots: slots,
            slot_size: SLOT_SIZE,
        };
        let data = rmp_serde::to_vec_named(&wire).map_err(|e| DataError::BadEndpoint {
            backend: "verbs",
            reason: format!("encoding our endpoint failed: {e}"),
        })?;
        let id = PeerId(self.next_peer);
        self.next_peer += 1;
        self.cq_reserved += need;
        self.peers
            .insert(id, Peer::new(prepared, mailbox, staging, need));
        Ok((
            id,
            Endpoint {
                backend: BackendKind::Verbs,
                data,
            },
        ))
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let bad = |reason: String| DataError::BadEndpoint {
            backend: "verbs",
            reason,
        };
        if remote.backend != BackendKind::Verbs {
            return Err(bad(format!(
                "endpoint is for the {} backend",
                remote.backend
            )));
        }
        let wire: WireEndpoint =
            rmp_serde::from_slice(&remote.data).map_err(|e| bad(e.to_string()))?;
        if wire.v != 1 {
            return Err(bad(format!("unknown endpoint version {}", wire.v)));
        }
        let p = self.peer_mut(peer)?;
        if wire.qps.len() != p.prepared.len() {
            return Err(bad(format!(
                "{} has {} queue pairs, we prepared {}",
                peer,
                wire.qps.len(),
                p.prepared.len()
            )));
        }
        let mut qps = Vec::with_capacity(wire.qps.len());
        for (prep, ep) in std::mem::take(&mut p.prepared).into_iter().zip(&wire.qps) {
            qps.push(prep.connect(ep)?);
        }
        p.remote = regions.iter().map(|r| (r.key, *r)).collect();
        p.remote_mailbox = Some((wire.mailbox_addr, wire.mailbox_rkey, wire.mailbox_slots));
        p.notify_max = qps[0].mtu().min(wire.slot_size);
        let slots = p.mailbox.region.len() as u32 / SLOT_SIZE;
        let mut states = Vec::with_capacity(qps.len());
        for qp in qps {
            let token = self.next_token;
            self.next_token = self.next_token.wrapping_add(1).max(1);
            self.tokens.insert(token, (peer, states.len()));
            states.push(QpState::new(qp, token));
        }
        let p = self
            .peers
            .get_mut(&peer)
            .ok_or(DataError::UnknownPeer(peer))?;
        p.qps = states;
        // Arm the notification receives on QP 0.
        p.post_recvs(slots)?;
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerId) {
        let Some(p) = self.peers.remove(&peer) else {
            return;
        };
        for q in &p.qps {
            self.tokens.remove(&q.token);
        }
        self.cq_reserved = self.cq_reserved.saturating_sub(p.cq_share);
        // Destroying the QPs stops the NIC; nothing of theirs can complete now.
        drop(p);
        let ids: Vec<_> = self
            .inflight
            .iter()
            .filter(|(_, t)| t.t.peer == peer)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(t) = self.inflight.remove(&id) {
                self.done.push(Completion {
                    id,
                    peer,
                    result: Err(DataError::PeerLost {
                        peer,
                        reason: "peer removed",
                        source: None,
                    }),
                });
                drop(t);
            }
        }
    }

    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        let reject = SubmitError::Rejected;
        let Some(p) = self.peers.get(&transfer.peer) else {
            return Err(reject(DataError::UnknownPeer(transfer.peer)));
        };
        if p.qps.is_empty() {
            return Err(reject(DataError::UnknownPeer(transfer.peer)));
        }
        transfer.check_lengths().map_err(reject)?;
        if self.inflight.contains_key(&transfer.id) {
            return Err(reject(DataError::DuplicateTransfer(transfer.id)));
        }
        if let Some(n) = &transfer.notify {
            if n.len() > p.notify_max as usize {
                return Err(reject(DataError::NotificationTooLarge {
                    len: n.len(),
                    max: p.notify_max as usize,
                }));
            }
        }
        if self.inflight.len() + self.done.len() >= self.config.max_in_flight {
            let in_flight = self.inflight.len();
            return Err(SubmitError::QueueFull {
                transfer: Box::new(transfer),
                in_flight,
            });
        }
        let (id, peer) = (transfer.id, transfer.peer);
        let now = Instant::now();
        if now > transfer.deadline {
            let overdue = now - transfer.deadline;
            self.done.push(Completion {
                id,
                peer,
                result: Err(DataError::Timeout { id, peer, overdue }),
            });
            return Ok(());
        }
        let (plan, keep) = match self.plan(&transfer) {
            Ok(v) => v,
            Err(e) => {
                // Refused before any byte moved: report like a NIC would, as a completion.
                self.done.push(Completion {
                    id,
                    peer,
                    result: Err(e),
                });
                return Ok(());
            }
        };
        // Room check: everything must fit the send queues (with what the
        // backlog already claims), unless the peer is idle: then a transfer
        // bigger than the queues is accepted and posted piecewise.
        let p = self
            .peers
            .get(&peer)
            .ok_or(SubmitError::Rejected(DataError::UnknownPeer(peer)))?;
        let notify_room = transfer.notify.is_none() || p.notify_inflight < p.notify_slots();
        if !notify_room || !(p.fits(plan.len(), transfer.op) || p.idle()) {
            let in_flight = self.inflight.len();
            return Err(SubmitError::QueueFull {
                transfer: Box::new(transfer),
                in_flight,
            });
        }
        let notify = if transfer.notify.is_some() {
            NotifyState::Pending
        } else {
            NotifyState::None
        };
        let deadline = transfer.deadline;
        let wrs = plan.len() as u64;
        self.inflight
            .insert(id, Inflight::new(transfer, plan, keep, notify));
        self.earliest_deadline = Some(self.earliest_deadline.map_or(deadline, |d| d.min(deadline)));
        if let Some(p) = self.peers.get_mut(&peer) {
            p.backlog.push_back(id);
            p.backlog_wrs += wrs;
        }
        // Posting happens in `poll`: everything submitted in between goes
        // out as one chain (one doorbell) per queue pair.
        self.try_finish(id);
        Ok(())
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        self.progress();
        let n = self.done.len();
        completions.append(&mut self.done);
        n
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        self.progress();
        let n = self.notes.len();
        out.extend(self.notes.drain(..));
        n
    }

    fn in_flight(&self) -> usize {
        self.inflight.len() + self.done.len()
    }

    fn needs_busy_poll(&self) -> bool {
        true
    }

    /// A queue pair pairs with exactly one remote queue pair.
    fn endpoint_per_peer(&self) -> bool {
        true
    }
}

/// Everything `submit` resolved: the work requests and the registrations
/// they use (kept alive until the transfer completes).
pub(crate) type Planned = (Vec<super::engine::PlannedWr>, Vec<Local>);
