//! The posting engine of [`VerbsBackend`]: work-request chains and
//! completion handling (planning is in `plan.rs`, queue-pair failure and
//! deadlines in `failure.rs`).
//!
//! Accounting. Work request ids are `token << 32 | seq`: `token` names the
//! queue pair (never reused, so completions of a destroyed or failed QP are
//! recognised and dropped), `seq` counts that QP's send requests (31 bits;
//! bit 31 marks receives). A transfer's requests on one QP form *batches*
//! (cut every `signal_every` requests). Only every `signal_every`-th request
//! of a QP and the last one of each chain are signaled: RC completes in
//! order, so one completion retires every batch up to it and frees their
//! send-queue slots. A transfer completes when all of its work is posted,
//! none of its batches is outstanding and its notification (if any) landed.
//!
//! Failure. A failed completion moves the QP to ERROR (flushing the rest).
//! The transfer whose request failed gets [`DataError::Rdma`]; transfers
//! that were only flushed are re-planned from scratch on the peer's healthy
//! QPs (READ and WRITE are idempotent) — so one bad request fails only its
//! own transfer. A transfer with an error completes only after its other
//! batches drained: the NIC never touches memory of a finished transfer.
//!
//! Notifications. After all data of a transfer completed, one
//! WRITE_WITH_IMM on QP 0 writes the payload into mailbox slot `k % slots`
//! at the target; `imm = slot << 16 | len`. Payloads are at most one path
//! MTU, so the message is a single packet and the responder checks for a
//! posted receive before placing data: the target re-posts receive `k` only
//! after copying slot `k % slots` out, so a slot is never overwritten early
//! (the sender waits on RNR meanwhile).

use std::collections::VecDeque;

use super::backend::{Local, VerbsBackend, SLOT_SIZE};
use super::qp::{ConnectedQp, PreparedQp, SendWr, WrOp};
use super::VerbsError;
use crate::error::DataError;
use crate::ids::{PeerId, RemoteKey, TransferId};
use crate::memory::RemoteRegion;
use crate::transfer::{Completion, Notification, Op, Transfer};

const RECV_BIT: u32 = 1 << 31;
const SEQ_MASK: u32 = RECV_BIT - 1;
/// `IBV_WC_WR_FLUSH_ERR`.
const WC_FLUSH: u32 = 5;

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
    pub(super) plan: Vec<PlannedWr>,
    pub(super) next: usize,
    pub(super) batches: u32,
    pub(super) notify: NotifyState,
    pub(super) error: Option<DataError>,
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
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Batch {
    pub(super) last: u32,
    pub(super) wrs: u32,
    pub(super) reads: u32,
    pub(super) transfer: TransferId,
    pub(super) notify: bool,
}

/// A connected queue pair and its send-queue accounting.
pub(crate) struct QpState {
    pub(super) qp: ConnectedQp,
    pub(crate) token: u32,
    pub(crate) broken: bool,
    pub(super) seq: u32,
    pub(crate) posted: u64,
    pub(super) sq_used: u32,
    pub(super) rd_used: u32,
    pub(super) batches: VecDeque<Batch>,
}

impl QpState {
    pub(crate) fn new(qp: ConnectedQp, token: u32) -> Self {
        Self {
            qp,
            token,
            broken: false,
            seq: 0,
            posted: 0,
            sq_used: 0,
            rd_used: 0,
            batches: VecDeque::new(),
        }
    }

    pub(super) fn sq_free(&self) -> u32 {
        self.qp.sq_depth().saturating_sub(self.sq_used)
    }

    pub(super) fn rd_free(&self) -> u32 {
        u32::from(self.qp.max_rd_atomic()).saturating_sub(self.rd_used)
    }

    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    fn wr_id(&self, seq: u32) -> u64 {
        (u64::from(self.token) << 32) | u64::from(seq)
    }
}

/// One connected (or prepared) peer.
pub(crate) struct Peer {
    // Queue pairs first: dropped before the mailbox and staging they access.
    pub(crate) qps: Vec<QpState>,
    pub(crate) prepared: Vec<PreparedQp>,
    pub(crate) remote: std::collections::HashMap<RemoteKey, RemoteRegion>,
    pub(crate) remote_mailbox: Option<(u64, u32, u32)>,
    pub(crate) notify_max: u32,
    pub(crate) notify_inflight: u32,
    notify_next: u32,
    recv_next: u32,
    pub(crate) backlog: VecDeque<TransferId>,
    /// Work requests of backlog transfers not posted yet.
    pub(crate) backlog_wrs: u64,
    pub(super) notify_queue: VecDeque<TransferId>,
    pub(crate) cq_share: u32,
    pub(crate) mailbox: Local,
    staging: Local,
}

impl Peer {
    pub(crate) fn new(
        prepared: Vec<PreparedQp>,
        mailbox: Local,
        staging: Local,
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
            cq_share,
            mailbox,
            staging,
        }
    }

    /// Notifications that may be unacknowledged at once.
    pub(crate) fn notify_slots(&self) -> u32 {
        self.remote_mailbox
            .map_or(0, |m| m.2)
            .min(self.staging_slots())
    }

    fn staging_slots(&self) -> u32 {
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
        let start = self.recv_next;
        self.recv_next = self.recv_next.wrapping_add(n);
        q.qp.post_recv(
            (0..n).map(|i| token | u64::from(RECV_BIT | (start.wrapping_add(i) & SEQ_MASK))),
        )
    }
}

/// `a` is at or before `b` in 31-bit sequence space.
pub(super) fn seq_le(a: u32, b: u32) -> bool {
    b.wrapping_sub(a) & SEQ_MASK < (1 << 30)
}

impl VerbsBackend {
    /// Posts what fits: pending notifications first, then the backlog in
    /// order. Everything posted in one call goes out as one chain per QP: one
    /// `ibv_post_send`, one doorbell.
    pub(crate) fn pump(&mut self, peer: PeerId) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.qps.is_empty() {
            return;
        }
        let mut chains: Vec<Vec<SendWr>> = vec![Vec::new(); p.qps.len()];
        let mut reads_in_chain = vec![0u32; p.qps.len()];
        // Notifications (QP 0).
        while let Some(&id) = p.notify_queue.front() {
            let Some(t) = self.inflight.get_mut(&id) else {
                p.notify_queue.pop_front();
                continue;
            };
            let (Some((addr, rkey, remote_slots)), Some(payload)) =
                (p.remote_mailbox, t.t.notify.clone())
            else {
                p.notify_queue.pop_front();
                continue;
            };
            let slots = p.notify_slots();
            let q0 = &p.qps[0];
            if q0.broken || chains[0].len() as u32 >= q0.sq_free() || p.notify_inflight >= slots {
                break;
            }
            // The remote slot follows the receiver's slot count (its receive
            // k frees slot k % remote_slots); the staging slot our own count
            // (at most `slots` notifications are unacknowledged).
            let slot = p.notify_next % remote_slots.max(1);
            let off = u64::from(slot * SLOT_SIZE);
            let staging_off = u64::from((p.notify_next % p.staging_slots()) * SLOT_SIZE);
            if p.staging.region.write(staging_off, &payload).is_err() {
                break;
            }
            let q = &mut p.qps[0];
            let seq = q.seq;
            chains[0].push(SendWr {
                wr_id: q.wr_id(seq),
                op: WrOp::Write(Some((slot << 16) | payload.len() as u32)),
                local_addr: p.staging.mr.addr() + staging_off,
                len: payload.len() as u32,
                lkey: p.staging.mr.lkey(),
                remote_addr: addr + off,
                rkey,
                signaled: true,
            });
            q.seq = (seq + 1) & SEQ_MASK;
            q.batches.push_back(Batch {
                last: seq,
                wrs: 1,
                reads: 0,
                transfer: id,
                notify: true,
            });
            t.batches += 1;
            t.notify = NotifyState::Posted;
            p.notify_next = p.notify_next.wrapping_add(1);
            p.notify_inflight += 1;
            p.notify_queue.pop_front();
        }
        // Data.
        let signal_every = self.config.signal_every.max(1);
        // Unsignaled requests per QP since the last signaled one in this call.
        let mut since = vec![0u32; p.qps.len()];
        while let Some(&id) = p.backlog.front() {
            let Some(t) = self.inflight.get_mut(&id) else {
                p.backlog.pop_front();
                continue;
            };
            if t.error.is_some() {
                p.backlog_wrs -= (t.plan.len() - t.next) as u64;
                t.next = t.plan.len();
                p.backlog.pop_front();
                continue;
            }
            let reads = t.t.op == Op::Read;
            let mut pending = vec![0u32; p.qps.len()];
            while let Some(w) = t.plan.get(t.next) {
                let q = &p.qps[w.qp];
                let n = chains[w.qp].len() as u32;
                if q.broken || n >= q.sq_free() || (reads && reads_in_chain[w.qp] >= q.rd_free()) {
                    break;
                }
                let q = &mut p.qps[w.qp];
                let interval = if reads {
                    signal_every.min((u32::from(q.qp.max_rd_atomic()) / 2).max(1))
                } else {
                    signal_every
                };
                let seq = q.seq;
                q.seq = (seq + 1) & SEQ_MASK;
                pending[w.qp] += 1;
                since[w.qp] += 1;
                // Selective signaling across transfers: RC completes in order,
                // so one completion retires every batch up to it.
                let signaled = since[w.qp] >= interval;
                if signaled {
                    since[w.qp] = 0;
                }
                chains[w.qp].push(SendWr {
                    wr_id: q.wr_id(seq),
                    op: if reads { WrOp::Read } else { WrOp::Write(None) },
                    local_addr: w.local_addr,
                    len: w.len,
                    lkey: w.lkey,
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                    signaled,
                });
                if reads {
                    reads_in_chain[w.qp] += 1;
                }
                if signaled {
                    let n = pending[w.qp];
                    q.batches.push_back(Batch {
                        last: seq,
                        wrs: n,
                        reads: if reads { n } else { 0 },
                        transfer: id,
                        notify: false,
                    });
                    t.batches += 1;
                    pending[w.qp] = 0;
                }
                t.next += 1;
                p.backlog_wrs -= 1;
            }
            // Close this transfer's batches at its last request on each QP
            // (signaled below if it ends the chain, else a later one covers it).
            for (qi, &n) in pending.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let Some(last) = chains[qi].last() else {
                    continue;
                };
                p.qps[qi].batches.push_back(Batch {
                    last: (last.wr_id as u32) & SEQ_MASK,
                    wrs: n,
                    reads: if reads { n } else { 0 },
                    transfer: id,
                    notify: false,
                });
                t.batches += 1;
            }
            if t.next < t.plan.len() {
                break; // queues full: continue on a later poll
            }
            p.backlog.pop_front();
        }
        let mut broke = Vec::new();
        for (qi, chain) in chains.iter_mut().enumerate() {
            let Some(last) = chain.last_mut() else {
                continue;
            };
            // Every chain ends signaled: nothing waits for a later post.
            last.signaled = true;
            let q = &mut p.qps[qi];
            q.sq_used += chain.len() as u32;
            q.rd_used += reads_in_chain[qi];
            q.posted += chain
                .iter()
                .filter(|w| !matches!(w.op, WrOp::Write(Some(_))))
                .count() as u64;
            // SAFETY: every local range was checked against a live registration
            // in `plan` (or is the peer's staging buffer), and the transfer keeps
            // clones of those regions and registrations until it completes,
            // which is after all of its batches completed or were flushed; the
            // staging buffer lives in the peer, which drops its QPs first.
            if let Err(e) = unsafe { q.qp.post_send(chain) } {
                tracing::error!(%peer, error = %e, "posting a work-request chain failed");
                broke.push(qi);
            }
        }
        for qi in broke {
            self.break_qp(peer, qi, None, 0, 0);
        }
    }

    /// Polls the CQ, handles completions, deadlines, and posts more.
    pub(crate) fn progress(&mut self) {
        let mut wcs = std::mem::take(&mut self.wcs);
        if let Err(e) = self.cq.poll(&mut wcs) {
            tracing::error!(device = self.ctx.name(), error = %e, "polling the completion queue failed");
        }
        for wc in wcs.drain(..) {
            let token = (wc.wr_id >> 32) as u32;
            let seq = wc.wr_id as u32;
            let Some(&(peer, qi)) = self.tokens.get(&token) else {
                continue;
            };
            if seq & RECV_BIT != 0 {
                self.on_recv(peer, qi, wc.status, wc.imm);
            } else if wc.status == 0 {
                self.on_send_ok(peer, qi, seq);
            } else {
                let culprit = (wc.status != WC_FLUSH).then_some(seq);
                self.break_qp(peer, qi, culprit, wc.status, wc.vendor_err);
            }
        }
        self.wcs = wcs;
        self.expire();
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for p in peers {
            self.pump(p);
        }
    }

    fn on_send_ok(&mut self, peer: PeerId, qi: usize, seq: u32) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let mut finished = Vec::new();
        let q = &mut p.qps[qi];
        while let Some(b) = q.batches.front().copied() {
            if !seq_le(b.last, seq) {
                break;
            }
            q.batches.pop_front();
            q.sq_used = q.sq_used.saturating_sub(b.wrs);
            q.rd_used = q.rd_used.saturating_sub(b.reads);
            if b.notify {
                p.notify_inflight = p.notify_inflight.saturating_sub(1);
            }
            if let Some(t) = self.inflight.get_mut(&b.transfer) {
                t.batches = t.batches.saturating_sub(1);
                if b.notify {
                    t.notify = NotifyState::Done;
                }
                finished.push(b.transfer);
            }
        }
        for id in finished {
            self.try_finish(id);
        }
    }

    fn on_recv(&mut self, peer: PeerId, qi: usize, status: u32, imm: u32) {
        if status != 0 {
            self.break_qp(peer, qi, None, status, 0);
            return;
        }
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let (slot, len) = (imm >> 16, imm & 0xffff);
        let slots = p.mailbox.region.len() as u32 / SLOT_SIZE;
        if slot < slots && len <= SLOT_SIZE {
            let mut buf = vec![0u8; len as usize];
            if p.mailbox
                .region
                .read(u64::from(slot * SLOT_SIZE), &mut buf)
                .is_ok()
            {
                self.notes.push_back(Notification {
                    payload: buf.into(),
                });
            }
        } else {
            tracing::warn!(%peer, imm, "dropped a malformed rdma notification");
        }
        // The slot is copied out: only now may the peer reuse it.
        if let Err(e) = p.post_recvs(1) {
            tracing::error!(%peer, error = %e, "re-posting a notification receive failed");
            self.break_qp(peer, 0, None, 0, 0);
        }
    }

    /// Completes a transfer if nothing of it is on the NIC and nothing is
    /// left to do; queues its notification once its data landed.
    pub(crate) fn try_finish(&mut self, id: TransferId) {
        let Some(t) = self.inflight.get_mut(&id) else {
            return;
        };
        if t.batches > 0 {
            return;
        }
        if t.error.is_none() {
            if t.next < t.plan.len() {
                return;
            }
            if t.notify == NotifyState::Pending {
                t.notify = NotifyState::Queued;
                if let Some(p) = self.peers.get_mut(&t.t.peer) {
                    p.notify_queue.push_back(id);
                }
                return;
            }
            if matches!(t.notify, NotifyState::Queued | NotifyState::Posted) {
                return;
            }
        }
        let Some(t) = self.inflight.remove(&id) else {
            return;
        };
        if t.next < t.plan.len() {
            // Failed with work never posted: release the backlog's claim.
            if let Some(p) = self.peers.get_mut(&t.t.peer) {
                p.backlog_wrs -= (t.plan.len() - t.next) as u64;
            }
        }
        let result = t.error.map_or(Ok(()), Err);
        self.done.push(Completion {
            id,
            peer: t.t.peer,
            result,
        });
    }
}
