//! [`VerbsBackend`]: the [`Backend`] trait on RC queue pairs.
//!
//! Per peer: `qps_per_peer` connected QPs on a completion queue shared with
//! other peers (see [`SharedCq`]), a notification *mailbox* (registered
//! slots the peer writes into with WRITE_WITH_IMM) and a *staging* buffer
//! for our own notification payloads. The state is in `state.rs`, the
//! posting engine in `engine.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::config::VerbsConfig;
use super::device::PortStatus;
use super::error::VerbsError;
use super::qp::{QpBuilder, QpEndpoint};
use super::resources::{Context, MemoryRegistration, MrAccess};
use super::state::{
    Inflight, Local, NotifyState, Peer, QpState, RemoteMailbox, SharedCq, VerbsBackend,
    MAX_REMOTE_SLOTS, SLOT_SIZE,
};
use crate::backend::Backend;
use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId, RemoteKey};
use crate::memory::{Access, MemoryKind, Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Transfer};

/// Entries of each shared completion queue (or the device's `max_cqe`, if
/// smaller: 32767 on rxe). 64 Ki entries of 64 bytes are 4 MiB; with the
/// default depths (2 QPs x 512 sends + 64 + 1 receives = 1089 entries a
/// peer) one CQ serves 60 peers (30 on rxe), so 1,000 peers use 17 CQs (34
/// on rxe). Not measured: large enough that few CQs are polled per
/// `progress`, small enough not to pin much memory.
const CQ_ENTRIES: u32 = 1 << 16;

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

impl VerbsBackend {
    /// Opens the device, allocates a PD and the first completion queue
    /// (more are opened as peers arrive). Fails with
    /// [`VerbsError::Unsupported`] on hosts without RDMA.
    pub fn new(config: VerbsConfig) -> Result<Self, VerbsError> {
        let ctx = Context::open(&config.device)?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(ctx.limits().max_cqe.min(CQ_ENTRIES))?;
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
            earliest_drain: None,
            chunk,
            config,
            cqs: vec![SharedCq {
                cq,
                reserved: 0,
                peers: 0,
            }],
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
                    qpn: q.qpn,
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

    /// Completion queues open now (tests and diagnostics).
    pub fn completion_queues(&self) -> usize {
        self.cqs.len()
    }

    /// A shared CQ with `need` free entries: the first open one with room,
    /// else a new one.
    fn cq_with_room(&mut self, need: u32) -> Result<usize, DataError> {
        if let Some(i) = self
            .cqs
            .iter()
            .position(|c| c.cq.entries().saturating_sub(c.reserved) >= need)
        {
            return Ok(i);
        }
        let entries = self.ctx.limits().max_cqe.min(CQ_ENTRIES);
        if need > entries {
            return Err(DataError::Unsupported {
                backend: "verbs",
                what: "one peer's queue pairs need more completion-queue entries than the device's max_cqe: lower qps_per_peer, qp.max_send_wr or notify_slots",
            });
        }
        let cq = self.ctx.create_cq(entries)?;
        self.cqs.push(SharedCq {
            cq,
            reserved: 0,
            peers: 0,
        });
        Ok(self.cqs.len() - 1)
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

    /// Returns once the region's memory registration is deregistered: no
    /// peer reaches the memory any more, and neither does this backend
    /// (its own transfers that use the region get
    /// [`VerbsConfig::deregister_grace`] to finish, then are stopped with
    /// [`DataError::LocalRegionDeregistered`]).
    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        let local = self
            .regions
            .remove(&region)
            .ok_or(DataError::UnknownRegion(region))?;
        self.retire_registration(region, local)
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        if self.peers.len() >= self.config.max_peers {
            return Err(DataError::Unsupported {
                backend: "verbs",
                what: "peer cap reached (VerbsConfig::max_peers): remove a peer first",
            });
        }
        let n = self.config.qps_per_peer.max(1);
        let slots = self.config.notify_slots.clamp(1, MAX_REMOTE_SLOTS);
        let mut opts = self.config.qp;
        let max_wr = self.ctx.limits().max_qp_wr.max(1);
        // Worst case on the CQ: every send slot of every QP, the
        // notification receives of QP 0 and one receive of each other QP.
        let sends = u64::from(opts.max_send_wr.clamp(1, max_wr)) * n as u64;
        let need = u32::try_from(sends + u64::from(slots.min(max_wr)) + (n as u64 - 1))
            .unwrap_or(u32::MAX);
        let cqi = self.cq_with_room(need)?;
        let cq = Arc::clone(&self.cqs[cqi].cq);
        let mut prepared = Vec::with_capacity(n);
        for i in 0..n {
            // Only QP 0 receives notifications.
            opts.max_recv_wr = if i == 0 { slots } else { 1 };
            prepared.push(QpBuilder::new(&self.pd, &cq, &cq).options(opts).build()?);
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
        self.cqs[cqi].reserved += need;
        self.cqs[cqi].peers += 1;
        self.peers
            .insert(id, Peer::new(prepared, mailbox, staging, cqi, need));
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
        // A multi-rail peer's endpoint: this backend pairs its first rail.
        let remote = &remote.primary();
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
        // Everything below comes from the peer: check it before any of it
        // reaches address arithmetic.
        if !(1..=MAX_REMOTE_SLOTS).contains(&wire.mailbox_slots) || wire.slot_size == 0 {
            return Err(bad(format!(
                "{peer} advertised a mailbox of {} slots of {} bytes (1..={MAX_REMOTE_SLOTS} slots of at least 1 byte)",
                wire.mailbox_slots, wire.slot_size
            )));
        }
        let mailbox_len = u64::from(wire.mailbox_slots) * u64::from(wire.slot_size);
        if wire.mailbox_addr.checked_add(mailbox_len).is_none() {
            return Err(bad(format!(
                "{peer} advertised a mailbox at {:#x} of {mailbox_len} bytes, past the end of the address space",
                wire.mailbox_addr
            )));
        }
        if let Some(r) = regions.iter().find(|r| r.addr.checked_add(r.len).is_none()) {
            return Err(bad(format!(
                "{peer} advertised region {} at {:#x} of {} bytes, past the end of the address space",
                r.key, r.addr, r.len
            )));
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
        p.remote_mailbox = Some(RemoteMailbox {
            addr: wire.mailbox_addr,
            rkey: wire.mailbox_rkey,
            slots: wire.mailbox_slots,
            slot_size: wire.slot_size,
        });
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
        if let Some(c) = self.cqs.get_mut(p.cq) {
            c.reserved = c.reserved.saturating_sub(p.cq_share);
            c.peers = c.peers.saturating_sub(1);
        }
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

    /// The port is ACTIVE (a port that cannot be queried counts as down).
    fn link_up(&self) -> bool {
        matches!(
            self.ctx.port_state(),
            Ok(PortStatus::Active | PortStatus::ActiveDefer)
        )
    }
}
