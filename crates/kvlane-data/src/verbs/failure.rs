//! Failure handling: a failed work completion retires its queue pair, fails
//! the culprit transfer and re-plans the transfers that were only flushed;
//! deadlines fail transfers and retire the queue pairs carrying them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::DRAIN_GRACE;
use super::state::{seq_le, Local, NotifyState, VerbsBackend};
use crate::error::DataError;
use crate::ids::{PeerId, RegionId, TransferId};

/// Human name of an `enum ibv_wc_status`.
fn wc_status(status: u32) -> &'static str {
    match status {
        0 => "success",
        1 => "local length error",
        2 => "local queue pair operation error",
        4 => "local protection error",
        5 => "flushed by a queue pair error",
        7 => "bad response",
        8 => "local access error",
        9 => "remote invalid request",
        10 => crate::error::REMOTE_ACCESS_ERROR,
        11 => "remote operation error",
        12 => "transport retry counter exceeded",
        13 => "rnr retry counter exceeded",
        15 => "remote aborted",
        19 => "fatal error",
        20 => "response timeout",
        21 => "general error",
        _ => "unknown completion error",
    }
}

impl VerbsBackend {
    /// Moves QP `qi` of `peer` to ERROR, fails the transfer whose request
    /// `culprit` failed and re-plans the ones that were only flushed.
    pub(crate) fn break_qp(
        &mut self,
        peer: PeerId,
        qi: usize,
        culprit: Option<u32>,
        status: u32,
        vendor_err: u32,
    ) {
        let device = self.ctx.name().to_owned();
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let q = &mut p.qps[qi];
        if q.broken {
            return;
        }
        q.broken = true;
        // Its batches stay: they are released as their flush completions
        // arrive (engine `retire`), or when the QP is destroyed because the
        // flush did not drain in time; until then their transfers keep the
        // memory the NIC may still touch.
        let drain_by = Instant::now() + DRAIN_GRACE;
        q.drain_by = Some(drain_by);
        self.earliest_drain = Some(self.earliest_drain.map_or(drain_by, |d| d.min(drain_by)));
        if let Some(qp) = q.qp.as_mut() {
            if let Err(e) = qp.fail() {
                tracing::warn!(%peer, error = %e, "moving a failed queue pair to ERROR failed");
            }
        }
        let qpn = q.qpn;
        tracing::warn!(%peer, qpn, status = wc_status(status), "rdma queue pair failed");
        let culprit_id = culprit.and_then(|s| {
            q.batches
                .iter()
                .find(|b| seq_le(s, b.last))
                .map(|b| b.transfer)
        });
        let mut affected = HashSet::new();
        for b in &q.batches {
            let Some(t) = self.inflight.get_mut(&b.transfer) else {
                continue;
            };
            if Some(b.transfer) == culprit_id {
                t.error.get_or_insert(DataError::Rdma {
                    peer,
                    op: t.t.op,
                    device: device.clone(),
                    qpn,
                    status: wc_status(status),
                    vendor_err,
                });
            } else if b.notify {
                // The notification may or may not have landed: never send it twice.
                t.error.get_or_insert(DataError::PeerLost {
                    peer,
                    reason: "the notification queue pair failed before the notification was acknowledged",
                    source: None,
                });
            }
            affected.insert(b.transfer);
        }
        if q.batches.is_empty() {
            // Nothing outstanding: nothing to flush.
            self.tokens.remove(&q.token);
            q.qp = None;
            q.drain_by = None;
        }
        // Transfers still planning onto the broken QP need a new plan too.
        for id in &p.backlog {
            if let Some(t) = self.inflight.get(id) {
                if t.plan[t.next..].iter().any(|w| w.qp == qi) {
                    affected.insert(*id);
                }
            }
        }
        for id in affected {
            self.replan(id);
            self.try_finish(id);
        }
    }

    /// Starts a transfer over on the healthy QPs (or fails it).
    pub(super) fn replan(&mut self, id: TransferId) {
        let Some(t) = self.inflight.get(&id) else {
            return;
        };
        if t.error.is_some() || t.notify == NotifyState::Done {
            return;
        }
        let peer = t.t.peer;
        match self.plan(&t.t) {
            Ok((plan, _)) => {
                let Some(t) = self.inflight.get_mut(&id) else {
                    return;
                };
                let unposted = (t.plan.len() - t.next) as u64;
                let new_len = plan.len() as u64;
                t.plan = plan;
                t.next = 0;
                t.notify = match t.notify {
                    NotifyState::None => NotifyState::None,
                    _ => NotifyState::Pending,
                };
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.notify_queue.retain(|x| *x != id);
                    if p.backlog.contains(&id) {
                        p.backlog_wrs -= unposted;
                    } else {
                        p.backlog.push_front(id);
                    }
                    p.backlog_wrs += new_len;
                }
            }
            Err(e) => {
                if let Some(t) = self.inflight.get_mut(&id) {
                    t.error = Some(e);
                }
            }
        }
    }

    /// Fails transfers past their deadline. Work already on the NIC cannot be
    /// recalled: the QPs carrying it are failed (their other transfers are
    /// re-planned) and the transfer completes once the flush drained.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        match self.earliest_deadline {
            Some(d) if now >= d => {}
            _ => return,
        }
        let mut earliest: Option<Instant> = None;
        let mut expired = Vec::new();
        for (id, t) in &self.inflight {
            if t.error.is_none() && now > t.t.deadline {
                expired.push(*id);
            } else if t.error.is_none() {
                earliest = Some(earliest.map_or(t.t.deadline, |e| e.min(t.t.deadline)));
            }
        }
        self.earliest_deadline = earliest;
        for id in expired {
            let Some(t) = self.inflight.get(&id) else {
                continue;
            };
            let error = DataError::Timeout {
                id,
                peer: t.t.peer,
                overdue: now - t.t.deadline,
            };
            self.stop(id, error);
        }
    }

    /// Fails transfer `id` with `error`: the QPs carrying its work are
    /// failed (their other transfers re-planned), and it completes once
    /// their flush drained (or they were destroyed).
    fn stop(&mut self, id: TransferId, error: DataError) {
        let Some(t) = self.inflight.get_mut(&id) else {
            return;
        };
        let peer = t.t.peer;
        t.error = Some(error);
        let carrying: Vec<usize> = self.peers.get(&peer).map_or(Vec::new(), |p| {
            (0..p.qps.len())
                .filter(|&i| p.qps[i].batches.iter().any(|b| b.transfer == id))
                .collect()
        });
        for qi in carrying {
            self.break_qp(peer, qi, None, 0, 0);
        }
        self.try_finish(id);
    }

    /// Ends a deregistered region's registration and returns once its
    /// memory registration is gone (its rkey dead on every queue pair, so
    /// no peer reaches the memory any more). This backend's own transfers
    /// that use the region as their local side hold the registration: they
    /// get [`VerbsConfig::deregister_grace`](super::VerbsConfig) to finish,
    /// then are stopped with [`DataError::LocalRegionDeregistered`], and
    /// the registration goes once their queue pairs drained.
    pub(super) fn retire_registration(
        &mut self,
        region: RegionId,
        local: Local,
    ) -> Result<(), DataError> {
        let start = Instant::now();
        let held = |mr: &Arc<_>| Arc::strong_count(mr) > 1;
        while held(&local.mr) && start.elapsed() < self.config.deregister_grace {
            self.progress();
            std::thread::yield_now();
        }
        if held(&local.mr) {
            let users: Vec<TransferId> = self
                .inflight
                .iter()
                .filter(|(_, t)| t.error.is_none() && t.keeps(&local.mr))
                .map(|(id, _)| *id)
                .collect();
            for id in users {
                self.stop(id, DataError::LocalRegionDeregistered { id, region });
            }
            // A flush that does not drain is destroyed at its `drain_by`.
            let bound = self.config.deregister_grace + DRAIN_GRACE + Duration::from_secs(1);
            while held(&local.mr) {
                if start.elapsed() > bound {
                    let in_flight = self
                        .inflight
                        .values()
                        .filter(|t| t.keeps(&local.mr))
                        .count();
                    // Keep the registration (and its memory) alive: the
                    // NIC may still reach it.
                    std::mem::forget(local);
                    return Err(DataError::DeregisterStuck {
                        region,
                        in_flight,
                        waited: start.elapsed(),
                    });
                }
                self.progress();
                std::thread::yield_now();
            }
        }
        drop(local);
        Ok(())
    }
}
