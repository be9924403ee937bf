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
//! The transfer whose request failed gets [`DataError::Rdma`](crate::DataError);
//! transfers that were only flushed are re-planned from scratch on the
//! peer's healthy QPs (READ and WRITE are idempotent) — so one bad request
//! fails only its own transfer. The broken QP keeps its batches until their
//! flush completions arrive (or it is destroyed after [`DRAIN_GRACE`]), and
//! a transfer completes only when none of its batches is outstanding on any
//! QP, broken or not: no memory is released while the NIC may still touch
//! it, and no late READ lands in a buffer whose transfer already completed.
//!
//! Notifications. After all data of a transfer completed, one
//! WRITE_WITH_IMM on QP 0 writes the payload into mailbox slot `k % slots`
//! at the target; `imm = slot << 16 | len`. Payloads are at most one path
//! MTU, so the message is a single packet and the responder checks for a
//! posted receive before placing data: the target re-posts receive `k` only
//! after copying slot `k % slots` out, so a slot is never overwritten early
//! (the sender waits on RNR meanwhile).

use std::time::{Duration, Instant};

use super::qp::{SendWr, WrOp};
use super::state::{
    seq_le, Batch, NotifyState, VerbsBackend, RECV_BIT, SEQ_MASK, SLOT_SIZE, WC_FLUSH,
};
use crate::ids::{PeerId, TransferId};
use crate::transfer::{Completion, Notification, Op};

/// How long a broken queue pair's flush may take to drain before the QP is
/// destroyed instead (which also stops the NIC touching its memory). Flush
/// completions come within microseconds on hardware and milliseconds on rxe;
/// 2 s is a bound for a stuck device, not a measured figure.
pub(crate) const DRAIN_GRACE: Duration = Duration::from_secs(2);

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
            let (Some(mailbox), Some(payload)) = (p.remote_mailbox, t.t.notify.clone()) else {
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
            let slot = p.notify_next % mailbox.slots;
            let staging_off = u64::from(p.notify_next % p.staging_slots()) * u64::from(SLOT_SIZE);
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
                remote_addr: mailbox.slot_addr(slot),
                rkey: mailbox.rkey,
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
                    signal_every.min((q.max_rd_atomic() / 2).max(1))
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
            // Chains are only built for healthy QPs, which have their QP.
            let Some(qp) = q.qp.as_mut() else {
                broke.push(qi);
                continue;
            };
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
            if let Err(e) = unsafe { qp.post_send(chain) } {
                tracing::error!(%peer, error = %e, "posting a work-request chain failed");
                broke.push(qi);
            }
        }
        for qi in broke {
            self.break_qp(peer, qi, None, 0, 0);
        }
    }

    /// Polls the CQs, handles completions, deadlines, and posts more.
    pub(crate) fn progress(&mut self) {
        let mut wcs = std::mem::take(&mut self.wcs);
        for c in &self.cqs {
            if c.peers == 0 && c.reserved == 0 {
                continue;
            }
            if let Err(e) = c.cq.poll(&mut wcs) {
                tracing::error!(device = self.ctx.name(), error = %e, "polling a completion queue failed");
            }
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
                self.retire(peer, qi, seq, true);
            } else {
                let culprit = (wc.status != WC_FLUSH).then_some(seq);
                self.break_qp(peer, qi, culprit, wc.status, wc.vendor_err);
                self.retire(peer, qi, seq, false);
            }
        }
        self.wcs = wcs;
        self.expire();
        self.destroy_undrained(Instant::now());
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for p in peers {
            self.pump(p);
        }
    }

    /// A completion for send `seq` of QP `qi` (success, error or flush):
    /// RC completes in order, so every batch up to it is off the NIC. Frees
    /// their send-queue slots and lets their transfers finish. A broken QP
    /// whose batches all drained is destroyed.
    fn retire(&mut self, peer: PeerId, qi: usize, seq: u32, ok: bool) {
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
            finished.push(b);
        }
        let drained = q.broken && q.batches.is_empty();
        if drained {
            self.tokens.remove(&q.token);
            // The flush is complete: nothing of this QP is on the NIC.
            q.qp = None;
            q.drain_by = None;
        }
        self.release(finished, ok);
    }

    /// Broken QPs whose flush has not drained by their deadline are
    /// destroyed (`ibv_destroy_qp`: the NIC touches none of their memory
    /// afterwards), then their batches are released.
    pub(crate) fn destroy_undrained(&mut self, now: Instant) {
        if self.earliest_drain.is_none_or(|d| now < d) {
            return;
        }
        let mut released = Vec::new();
        let mut earliest: Option<Instant> = None;
        for (peer, p) in &mut self.peers {
            for q in &mut p.qps {
                match q.drain_by {
                    Some(d) if now >= d => {}
                    Some(d) => {
                        earliest = Some(earliest.map_or(d, |e| e.min(d)));
                        continue;
                    }
                    None => continue,
                }
                tracing::warn!(%peer, qpn = q.qpn, outstanding = q.batches.len(), "a failed queue pair's flush did not drain; destroying it");
                q.qp = None;
                q.drain_by = None;
                self.tokens.remove(&q.token);
                for b in q.batches.drain(..) {
                    if b.notify {
                        p.notify_inflight = p.notify_inflight.saturating_sub(1);
                    }
                    released.push(b);
                }
                q.sq_used = 0;
                q.rd_used = 0;
            }
        }
        self.earliest_drain = earliest;
        self.release(released, false);
    }

    /// Batches that left the NIC: their transfers may finish.
    fn release(&mut self, batches: Vec<Batch>, ok: bool) {
        let mut ids = Vec::with_capacity(batches.len());
        for b in batches {
            if let Some(t) = self.inflight.get_mut(&b.transfer) {
                t.batches = t.batches.saturating_sub(1);
                if b.notify && ok {
                    t.notify = NotifyState::Done;
                }
                ids.push(b.transfer);
            }
        }
        for id in ids {
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
        // `imm` comes from the peer: the slot and length are checked against
        // our mailbox before they address it.
        let (slot, len) = (imm >> 16, imm & 0xffff);
        let slots = p.mailbox.region.len() / u64::from(SLOT_SIZE);
        if u64::from(slot) < slots && len <= SLOT_SIZE {
            let mut buf = vec![0u8; len as usize];
            if p.mailbox
                .region
                .read(u64::from(slot) * u64::from(SLOT_SIZE), &mut buf)
                .is_ok()
            {
                self.notes.push_back(Notification {
                    payload: buf.into(),
                    from: Some(peer),
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
