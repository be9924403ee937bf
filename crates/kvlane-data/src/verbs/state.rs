//! State shared by the verbs backend's files: the backend itself, its
//! peers, queue pairs, in-flight transfers and the completion queues they
//! share. `backend.rs` (the `Backend` impl), `engine.rs` (posting and
//! completions), `plan.rs` and `failure.rs` all work on it and import it
//! from here; none of them imports another.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::config::VerbsConfig;
use super::qp::{ConnectedQp, PreparedQp};
use super::resources::{
    CompletionQueue, Context, MemoryRegistration, ProtectionDomain, WorkCompletion,
};
use super::VerbsError;
use crate::error::DataError;
use crate::ids::{PeerId, RegionId, RemoteKey, TransferId};
use crate::memory::{Region, RemoteRegion};
use crate::transfer::{Completion, Notification, Op, Transfer};

/// A local registration: the region (kept alive) and its MR.
pub(crate) type Local = Registered<Region, Arc<MemoryRegistration>>;

/// Memory and its registration, dropped registration first: the MR is
/// deregistered (its rkey dead on every queue pair) before the memory can
/// go back to the allocator. Fields drop in declaration order, so `mr`
/// comes first; generic only so that a test can watch that order.
#[derive(Clone)]
pub(crate) struct Registered<R, M> {
    pub(crate) mr: M,
    pub(crate) region: R,
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
    /// Earliest `drain_by` of a broken QP still draining.
    pub(crate) earliest_drain: Option<Instant>,
    pub(crate) chunk: u64,
    pub(crate) config: VerbsConfig,
    pub(crate) cqs: Vec<SharedCq>,
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

/// A completion queue shared by the queue pairs of several peers.
///
/// A CQ that overflows fails every QP on it, so each peer reserves its
/// worst case: every send-queue slot and every posted receive completing
/// at once (which is what a flush does). A backend opens another CQ when
/// the open ones are full, so the number of peers is bounded by
/// [`VerbsConfig::max_peers`], not by one CQ's `max_cqe`.
pub(crate) struct SharedCq {
    pub(crate) cq: Arc<CompletionQueue>,
    /// Entries the peers on this CQ reserved.
    pub(crate) reserved: u32,
    /// Peers on this CQ.
    pub(crate) peers: u32,
}

/// The peer's notification mailbox, as it advertised it: checked when the
/// peer connects, so that every slot's address is in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteMailbox {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    /// `1..=MAX_REMOTE_SLOTS`.
    pub(crate) slots: u32,
    /// At least one byte; `addr + slots * slot_size` does not overflow.
    pub(crate) slot_size: u32,
}

/// Most mailbox slots a peer may advertise: the slot index travels in the
/// upper 16 bits of the immediate value.
pub(crate) const MAX_REMOTE_SLOTS: u32 = 1 << 16;

impl RemoteMailbox {
    /// Address of `slot` (reduced modulo the slot count).
    pub(crate) fn slot_addr(&self, slot: u32) -> u64 {
        self.addr + u64::from(slot % self.slots) * u64::from(self.slot_size)
    }
}

/// Everything `submit` resolved: the work requests and the registrations
/// they use (kept alive until the transfer completes).
pub(crate) type Planned = (Vec<PlannedWr>, Vec<Local>);

pub(crate) const RECV_BIT: u32 = 1 << 31;
pub(crate) const SEQ_MASK: u32 = RECV_BIT - 1;
/// `IBV_WC_WR_FLUSH_ERR`.
pub(crate) const WC_FLUSH: u32 = 5;

/// One planned work request (without id and signaling).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedWr {
    pub(crate) qp: usize,
    pub(crate) local_addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
}

/// Notification progress of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotifyState {
    None,
    Pending,
    Queued,
    Posted,
    Done,
}

/// A submitted transfer.
pub(crate) struct Inflight {
    pub(crate) t: Transfer,
    pub(crate) plan: Vec<PlannedWr>,
    pub(crate) next: usize,
    pub(crate) batches: u32,
    pub(crate) notify: NotifyState,
    pub(crate) error: Option<DataError>,
    _keep: Vec<Local>,
}

impl Inflight {
    pub(crate) fn new(
        t: Transfer,
        plan: Vec<PlannedWr>,
        keep: Vec<Local>,
        notify: NotifyState,
    ) -> Self {
        Self {
            t,
            plan,
            next: 0,
            batches: 0,
            notify,
            error: None,
            _keep: keep,
        }
    }

    /// Whether the transfer holds memory registration `mr`.
    pub(crate) fn keeps(&self, mr: &Arc<MemoryRegistration>) -> bool {
        self._keep.iter().any(|l| Arc::ptr_eq(&l.mr, mr))
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Batch {
    pub(crate) last: u32,
    pub(crate) wrs: u32,
    pub(crate) reads: u32,
    pub(crate) transfer: TransferId,
    pub(crate) notify: bool,
}

/// A connected queue pair and its send-queue accounting.
///
/// A broken queue pair keeps its batches (and so its transfers keep the
/// memory they use) until the NIC has flushed them: every outstanding work
/// request completes, with an error, once the QP is in ERROR. Then, or
/// when the flush has not drained by `drain_by`, the QP is destroyed
/// (`qp = None`); after `ibv_destroy_qp` the NIC touches none of its memory.
pub(crate) struct QpState {
    pub(crate) qp: Option<ConnectedQp>,
    pub(crate) qpn: u32,
    pub(crate) token: u32,
    pub(crate) broken: bool,
    /// Set when the QP broke: the destroy deadline of a flush that does not drain.
    pub(crate) drain_by: Option<Instant>,
    pub(crate) seq: u32,
    pub(crate) posted: u64,
    pub(crate) sq_used: u32,
    pub(crate) rd_used: u32,
    pub(crate) batches: VecDeque<Batch>,
}

impl QpState {
    pub(crate) fn new(qp: ConnectedQp, token: u32) -> Self {
        Self {
            qpn: qp.qpn(),
            qp: Some(qp),
            token,
            broken: false,
            drain_by: None,
            seq: 0,
            posted: 0,
            sq_used: 0,
            rd_used: 0,
            batches: VecDeque::new(),
        }
    }

    pub(crate) fn sq_free(&self) -> u32 {
        match &self.qp {
            Some(qp) if !self.broken => qp.sq_depth().saturating_sub(self.sq_used),
            _ => 0,
        }
    }

    pub(crate) fn rd_free(&self) -> u32 {
        match &self.qp {
            Some(qp) if !self.broken => u32::from(qp.max_rd_atomic()).saturating_sub(self.rd_used),
            _ => 0,
        }
    }

    /// Largest outstanding READs (1 once destroyed).
    pub(crate) fn max_rd_atomic(&self) -> u32 {
        self.qp
            .as_ref()
            .map_or(1, |qp| u32::from(qp.max_rd_atomic()))
    }

    pub(crate) fn wr_id(&self, seq: u32) -> u64 {
        (u64::from(self.token) << 32) | u64::from(seq)
    }
}

/// One connected (or prepared) peer.
pub(crate) struct Peer {
    // Queue pairs first: dropped before the mailbox and staging they access.
    pub(crate) qps: Vec<QpState>,
    pub(crate) prepared: Vec<PreparedQp>,
    pub(crate) remote: HashMap<RemoteKey, RemoteRegion>,
    pub(crate) remote_mailbox: Option<RemoteMailbox>,
    pub(crate) notify_max: u32,
    pub(crate) notify_inflight: u32,
    pub(crate) notify_next: u32,
    recv_next: u32,
    pub(crate) backlog: VecDeque<TransferId>,
    /// Work requests of backlog transfers not posted yet.
    pub(crate) backlog_wrs: u64,
    pub(crate) notify_queue: VecDeque<TransferId>,
    /// Index of the shared CQ its QPs use, and the entries they reserve there.
    pub(crate) cq: usize,
    pub(crate) cq_share: u32,
    pub(crate) mailbox: Local,
    pub(crate) staging: Local,
}

impl Peer {
    pub(crate) fn new(
        prepared: Vec<PreparedQp>,
        mailbox: Local,
        staging: Local,
        cq: usize,
        cq_share: u32,
    ) -> Self {
        Self {
            qps: Vec::new(),
            prepared,
            remote: Default::default(),
            remote_mailbox: None,
            notify_max: 0,
            notify_inflight: 0,
            notify_next: 0,
            recv_next: 0,
            backlog: VecDeque::new(),
            backlog_wrs: 0,
            notify_queue: VecDeque::new(),
            cq,
            cq_share,
            mailbox,
            staging,
        }
    }

    /// Notifications that may be unacknowledged at once.
    pub(crate) fn notify_slots(&self) -> u32 {
        self.remote_mailbox
            .map_or(0, |m| m.slots)
            .min(self.staging_slots())
    }

    pub(crate) fn staging_slots(&self) -> u32 {
        (self.staging.region.len() as u32 / SLOT_SIZE).max(1)
    }

    /// No work of this peer is on the NIC or waiting.
    pub(crate) fn idle(&self) -> bool {
        self.backlog.is_empty()
            && self.notify_queue.is_empty()
            && self.qps.iter().all(|q| q.broken || q.sq_used == 0)
    }

    /// Whether `need` more work requests fit the send queues, counting what
    /// the backlog already claims (summed over healthy QPs: a slight
    /// over-acceptance only leaves work in the backlog a little longer).
    pub(crate) fn fits(&self, need: usize, op: Op) -> bool {
        let free: u64 = self
            .qps
            .iter()
            .filter(|q| !q.broken)
            .map(|q| {
                u64::from(if op == Op::Read {
                    q.sq_free().min(q.rd_free())
                } else {
                    q.sq_free()
                })
            })
            .sum();
        self.backlog_wrs + need as u64 <= free
    }

    /// Posts `n` notification receives on QP 0.
    pub(crate) fn post_recvs(&mut self, n: u32) -> Result<(), VerbsError> {
        let Some(q) = self.qps.first_mut() else {
            return Ok(());
        };
        let token = u64::from(q.token) << 32;
        let Some(qp) = q.qp.as_mut().filter(|_| !q.broken) else {
            return Ok(());
        };
        let start = self.recv_next;
        self.recv_next = self.recv_next.wrapping_add(n);
        qp.post_recv(
            (0..n).map(|i| token | u64::from(RECV_BIT | (start.wrapping_add(i) & SEQ_MASK))),
        )
    }
}

/// `a` is at or before `b` in 31-bit sequence space.
pub(crate) fn seq_le(a: u32, b: u32) -> bool {
    b.wrapping_sub(a) & SEQ_MASK < (1 << 30)
}

#[cfg(test)]
mod tests {
    use super::Registered;
    use std::sync::{Arc, Mutex};

    /// Records its name in a shared log when dropped.
    struct Probe(&'static str, Arc<Mutex<Vec<&'static str>>>);

    impl Drop for Probe {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(self.0);
        }
    }

    #[test]
    fn a_registration_is_dropped_before_its_memory() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let local = Registered {
            region: Probe("region", log.clone()),
            mr: Probe("mr", log.clone()),
        };
        drop(local);
        assert_eq!(*log.lock().unwrap(), ["mr", "region"]);
    }
}
