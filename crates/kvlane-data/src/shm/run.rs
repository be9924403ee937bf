//! Running transfers: from the queue in [`poll`](crate::Backend::poll),
//! or inside the submission when nothing is queued
//! ([`submit_now`](crate::Backend::submit_now)): the copies are the
//! initiator's own either way, and a transfer with nothing outside the
//! process to answer (no notification) is finished there, its result
//! handed back with no queue, completion or wake-up in between.

use super::{clone_lost, copy, sys, wire, ShmBackend, Slot, Waiting};
use crate::backend::Submitted;
use crate::error::{DataError, SubmitError};
use crate::ids::PeerId;
use crate::transfer::{Completion, Transfer};
use std::time::Instant;
use wire::ToTarget;

impl ShmBackend {
    /// What [`submit`](crate::Backend::submit) refuses before queueing.
    pub(super) fn admit(&self, t: &Transfer) -> Result<(), DataError> {
        if !self.peers.contains_key(&t.peer) {
            return Err(DataError::UnknownPeer(t.peer));
        }
        t.check_lengths()?;
        match &t.notify {
            Some(n) if n.len() > wire::MAX_NOTIFY => Err(DataError::NotificationTooLarge {
                len: n.len(),
                max: wire::MAX_NOTIFY,
            }),
            _ => Ok(()),
        }
    }

    /// Queues `t` for `poll` unless the queue is full (then it is handed
    /// back).
    pub(super) fn enqueue(&mut self, t: Transfer) -> Result<(), SubmitError> {
        let in_flight = crate::Backend::in_flight(self);
        if in_flight >= self.config.queue_depth {
            return Err(SubmitError::QueueFull {
                transfer: Box::new(t),
                in_flight,
            });
        }
        self.queue.push_back(t);
        self.due = true;
        Ok(())
    }

    /// Submits `t`, finishing it here when nothing is queued before it
    /// and `budget` (bytes, as one poll's) lasts: the transfer's result,
    /// or queued (its completion comes from `poll`). `drained` is the
    /// peer whose connection this submission read last: read once per
    /// peer and call, as `poll` reads it once before its copies.
    pub(super) fn submit_inline(
        &mut self,
        t: Transfer,
        now: Instant,
        budget: &mut u64,
        drained: &mut Option<PeerId>,
    ) -> Result<Submitted, SubmitError> {
        if let Err(e) = self.admit(&t) {
            return Err(SubmitError::Rejected(e));
        }
        // After earlier transfers, in order; past the budget, by `poll`.
        if !self.queue.is_empty() || *budget == 0 {
            return self.enqueue(t).map(|()| Submitted::Queued);
        }
        // One that waits for the target's answer counts as in flight.
        let in_flight = crate::Backend::in_flight(self);
        if t.notify.is_some() && in_flight >= self.config.queue_depth {
            return Err(SubmitError::QueueFull {
                transfer: Box::new(t),
                in_flight,
            });
        }
        let peer = t.peer;
        if *drained != Some(peer) {
            // Reading first notices a target that is gone (and regions it
            // revoked) before copying; answers it holds complete other
            // transfers, reported by the next poll.
            let mut answers = std::mem::take(&mut self.answers);
            self.drain(peer, now, &mut answers);
            if !answers.is_empty() {
                self.failed.extend(answers.drain(..));
                self.due = true;
            }
            self.answers = answers;
            *drained = Some(peer);
        }
        if let Some(err) = self.lost(peer) {
            *budget = budget.saturating_sub(1);
            return Ok(Submitted::Done(Err(err)));
        }
        let len = t.total_len();
        Ok(match self.run_one(t, now) {
            Some(c) => {
                *budget = budget.saturating_sub(if c.result.is_ok() { len.max(1) } else { 1 });
                Submitted::Done(c.result)
            }
            None => {
                *budget = budget.saturating_sub(len.max(1));
                self.due = true;
                Submitted::Queued
            }
        })
    }

    /// Why `peer`'s transfers cannot run: it is unknown or its connection
    /// ended; `None` while it is connected.
    fn lost(&self, peer: PeerId) -> Option<DataError> {
        match self.peers.get(&peer) {
            None => Some(DataError::UnknownPeer(peer)),
            Some(Slot { conn: Some(_), .. }) => None,
            Some(Slot { lost, .. }) => Some(DataError::PeerLost {
                peer,
                reason: lost.unwrap_or("not connected"),
                source: None,
            }),
        }
    }

    /// Copies `t` (to a peer that was connected when last read) and sends
    /// its notification, if it has one: its completion, or `None` while
    /// the target's answer is awaited (or, when sending failed, the
    /// connection is lost and its failure waits in `failed`).
    fn run_one(&mut self, t: Transfer, now: Instant) -> Option<Completion> {
        let peer = t.peer;
        let Some(conn) = self.peers.get_mut(&peer).and_then(|s| s.conn.as_mut()) else {
            let err = self.lost(peer).unwrap_or(DataError::UnknownPeer(peer));
            return Some(Completion {
                id: t.id,
                peer,
                result: Err(err),
            });
        };
        let result = copy::execute(&t, now, &self.registry, conn, &mut self.scratch);
        let payload = match (result, t.notify) {
            (Ok(()), Some(payload)) => payload,
            (result, _) => {
                return Some(Completion {
                    id: t.id,
                    peer,
                    result,
                })
            }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let left = t.deadline.saturating_duration_since(now);
        let msg = wire::encode(&ToTarget::Notify {
            seq,
            deadline_ns: sys::monotonic_ns()
                .saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX)),
            payload: payload.to_vec(),
        });
        self.waiting.insert(
            seq,
            Waiting {
                id: t.id,
                peer,
                deadline: t.deadline,
            },
        );
        if let Err(e) = conn.notify(msg) {
            self.lose(peer, "sending a notification to the target failed", Some(e));
        }
        None
    }

    /// Runs queued transfers to the peer at the queue's head, while
    /// `budget` lasts.
    pub(super) fn run_peer(
        &mut self,
        now: Instant,
        budget: &mut u64,
        completions: &mut Vec<Completion>,
    ) {
        let Some(peer) = self.queue.front().map(|t| t.peer) else {
            return;
        };
        // Reading first notices a target that is gone before copying.
        self.drain(peer, now, completions);
        if let Some(err) = self.lost(peer) {
            while self.queue.front().is_some_and(|t| t.peer == peer) {
                let t = self.queue.pop_front().expect("front was just read");
                completions.push(Completion {
                    id: t.id,
                    peer,
                    result: Err(clone_lost(&err)),
                });
                *budget = budget.saturating_sub(1);
            }
            return;
        }
        while *budget > 0 && self.queue.front().is_some_and(|t| t.peer == peer) {
            let t = self.queue.pop_front().expect("front was just read");
            let len = t.total_len();
            match self.run_one(t, now) {
                Some(c) => {
                    *budget = budget.saturating_sub(if c.result.is_ok() { len.max(1) } else { 1 });
                    completions.push(c);
                }
                None => *budget = budget.saturating_sub(len.max(1)),
            }
        }
    }
}
