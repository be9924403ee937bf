//! Pairing a rail again when its endpoints are per peer (verbs), without
//! the control plane: an endpoint exchange over another rail.
//!
//! A verbs rail whose queue pair failed cannot be dialed again with the
//! endpoint of the handshake: the peer's queue pair on that rail was paired
//! with ours, which is gone, and a new queue pair of ours needs a new one of
//! the peer's. So [`Rails`] exchanges the two new endpoints itself, as
//! notifications over another rail to the same peer that still works:
//!
//! 1. **Offer.** The side that found the rail lost (a part failed there
//!    with the peer lost, an I/O error or a part timeout, or its link went
//!    down) waits [`RailsConfig::retry_after`](super::RailsConfig) and for
//!    its link to be up, prepares a new rail peer and sends
//!    `Offer { rail, epoch, endpoint }`.
//! 2. **Answer.** The other side drops its rail peer on that rail (its
//!    parts there move to other rails), prepares a new one, connects it to
//!    the offered endpoint and sends `Answer { epoch, endpoint }`. It puts
//!    no work on the rail yet. A side whose own link of that rail is down
//!    ignores the offer (the peer offers again later).
//! 3. **Ready.** The offering side connects its prepared rail peer to the
//!    answered endpoint, takes the rail into use and sends
//!    `Ready { epoch }`; the answering side takes the rail into use.
//!
//! Connecting a rail peer whose endpoints are per peer is local work (queue
//! pair state changes), so steps 2 and 3 run inside `poll`.
//!
//! **Both at once.** Both sides may offer for the same rail at the same
//! time. The side whose token (below) is larger leads: it keeps its offer,
//! sends it again (in case the first was ignored) and ignores the other's;
//! the other side drops its own offer and answers. A repeated offer gets
//! the answer it got before, a repeated answer the Ready it got before, so
//! duplicates never make a second rail peer. An offer or an answer that is
//! not taken further within [`RailsConfig::rejoin_timeout`](super::RailsConfig)
//! is given up (its rail peer removed) and the rail is offered again after
//! `retry_after`. Each side holds at most one rail peer per peer and rail
//! (connected, or prepared for its offer).
//!
//! **Trust.** The messages are notifications that begin with a reserved
//! prefix ([`PREFIX`]; `0xc1` is no msgpack byte): `Rails` consumes them
//! and never hands them to the application, and refuses to send an
//! application notification that begins with it. Each side's rails
//! endpoint carries a random 128-bit token per peer, so it travels only in
//! that peer's (authenticated) handshake; a message names the receiver's
//! token for its sender and is taken as coming from the peer that token was
//! issued to, nobody else. A message is at most [`MAX_MESSAGE`] bytes and
//! is taken only for a known token, a rail index in range whose endpoints
//! are per peer and that was paired with that peer before, and an epoch
//! that matches where that rail's re-pairing stands; anything else is
//! dropped and counted in [`RailStats::dropped`](super::RailStats) of the
//! rail it arrived on. A peer whose endpoint has no token (an older
//! version) is never re-paired this way: its lost verbs rail stays set
//! aside, as before.

use super::{Rail, Rails};
use crate::backend::Backend;
use crate::error::DataError;
use crate::ids::PeerId;
use crate::memory::RemoteRegion;
use crate::transfer::{Endpoint, Op, Transfer};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// What a peer names us by (random, per peer).
pub(super) type Token = [u64; 2];

/// The first bytes of every rails message (`0xc1` never starts msgpack).
pub(crate) const PREFIX: &[u8] = b"\xc1kvlane-rails\x00";

/// Largest rails message taken, prefix included. A verbs endpoint of two
/// queue pairs is about 200 bytes; a verbs notification is at most the
/// path MTU (1024 bytes at a 1500-byte Ethernet MTU).
pub(crate) const MAX_MESSAGE: usize = 1024;

/// Whether an application notification would be taken for a rails message.
pub(super) fn is_reserved(payload: Option<&[u8]>) -> bool {
    payload.is_some_and(|p| p.starts_with(PREFIX) || p.starts_with(super::notes::TAG_PREFIX))
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(super) enum Kind {
    Offer,
    Answer,
    Ready,
}

/// One rails message (msgpack, named fields, after [`PREFIX`]).
#[derive(Serialize, Deserialize, Debug)]
pub(super) struct Msg {
    /// The receiver's token for the sender.
    pub(super) to: Token,
    pub(super) rail: u32,
    pub(super) kind: Kind,
    pub(super) epoch: u64,
    /// The sender's new endpoint on `rail` (empty for `Ready`).
    #[serde(with = "serde_bytes", default)]
    pub(super) ep: Vec<u8>,
}

impl Msg {
    pub(super) fn encode(&self) -> Result<Vec<u8>, DataError> {
        let mut out = PREFIX.to_vec();
        rmp_serde::encode::write_named(&mut out, self).map_err(|e| DataError::BadEndpoint {
            backend: "rails",
            reason: e.to_string(),
        })?;
        Ok(out)
    }

    /// `None` for anything that is not a well-formed rails message.
    pub(super) fn decode(payload: &[u8]) -> Option<Self> {
        if payload.len() > MAX_MESSAGE {
            return None;
        }
        rmp_serde::from_slice(payload.strip_prefix(PREFIX)?).ok()
    }
}

/// Where the re-pairing of one rail with one peer stands.
#[derive(Debug, Default)]
pub(super) enum Rejoin {
    #[default]
    Idle,
    /// We offered `epoch` with the prepared (not connected) rail peer `id`,
    /// whose endpoint is `ep`.
    Offered {
        epoch: u64,
        id: PeerId,
        ep: Vec<u8>,
        since: Instant,
    },
    /// We answered the peer's offer `epoch` with our rail peer (the rail's
    /// `id`, connected), endpoint `ep`, and wait for its Ready.
    Answered {
        epoch: u64,
        ep: Vec<u8>,
        since: Instant,
    },
}

/// Prepares a rail peer on `rail` and connects it to `remote`; returns it
/// and its endpoint's bytes. Local work for a per-peer-endpoint backend.
fn pair(
    rail: &mut Rail,
    remote: &Endpoint,
    regions: &[RemoteRegion],
) -> Result<(PeerId, Vec<u8>), DataError> {
    let (id, ep) = rail.backend.prepare_peer()?;
    connect(rail, id, remote, regions)?;
    Ok((id, ep.data))
}

/// Connects the prepared rail peer `id` to `remote` (removed on failure).
fn connect(
    rail: &mut Rail,
    id: PeerId,
    remote: &Endpoint,
    regions: &[RemoteRegion],
) -> Result<(), DataError> {
    let r = rail
        .backend
        .start_connect(id, remote, regions)
        .and_then(|c| c.run())
        .and_then(|c| rail.backend.finish_connect(id, c));
    if r.is_err() {
        rail.backend.remove_peer(id);
    }
    r
}

impl Rails {
    /// Reads every rail's link state, at most every [`super::LINK_POLL`].
    /// A rail whose link went down drops its connections at once: their
    /// parts fail and move to the other rails.
    pub(super) fn read_links(&mut self, now: Instant) {
        if self
            .links_read
            .is_some_and(|t| now.duration_since(t) < super::LINK_POLL)
        {
            return;
        }
        self.links_read = Some(now);
        for (i, rail) in self.rails.iter_mut().enumerate() {
            let up = rail.backend.link_up();
            let was = std::mem::replace(&mut rail.up, up);
            if was == up {
                continue;
            }
            if up {
                tracing::info!(rail = %rail.name, "rails: link up, the rail is paired again");
                continue;
            }
            tracing::warn!(rail = %rail.name, "rails: link down, its work moves to the other rails");
            for state in self.peers.values_mut() {
                let rp = &mut state.rails[i];
                if rp.remote.is_none() {
                    continue; // never paired with this peer
                }
                if let Some(id) = rp.id.take() {
                    rail.backend.remove_peer(id);
                }
                if let Rejoin::Offered { id, .. } = std::mem::take(&mut rp.rejoin) {
                    rail.backend.remove_peer(id);
                }
                rp.lost = true;
                rp.down_since = Some(now);
            }
        }
    }

    /// Drains every rail's notifications: rails messages are handled here,
    /// the others queue for `poll_notifications`, in arrival order.
    pub(super) fn take_notes(&mut self, now: Instant) {
        let mut got = std::mem::take(&mut self.inbox);
        for i in 0..self.rails.len() {
            self.rails[i].backend.poll_notifications(&mut got);
            for mut n in got.drain(..) {
                if let Some(tagged) = super::notes::untag(&n.payload) {
                    // Tagged: once per tag from its sender (`notes.rs`),
                    // who must be the rail peer's, where the rail can tell.
                    let fresh = tagged.and_then(|(sender, tag, at)| {
                        let p = *self.by_note.get(&sender)?;
                        if n.from.is_some_and(|sub| self.parent_of(i, sub) != Some(p)) {
                            return None;
                        }
                        let s = self.peers.get_mut(&p)?;
                        s.seen.take(tag).then_some((p, at))
                    });
                    if let Some((p, at)) = fresh {
                        n.payload = n.payload.slice(at..);
                        n.from = n.from.map(|_| p);
                        self.notes.push_back(n);
                    } else {
                        self.rails[i].stats.dropped += 1;
                        tracing::debug!(rail = %self.rails[i].name, "rails: notification dropped (a duplicate, or from no known peer)");
                    }
                } else if !n.payload.starts_with(PREFIX) {
                    // The rail's peer id means nothing above: name the
                    // peer it is a rail of (or none).
                    n.from = n.from.and_then(|sub| self.parent_of(i, sub));
                    self.notes.push_back(n);
                } else if !self.on_message(&n.payload, now) {
                    self.rails[i].stats.dropped += 1;
                    tracing::debug!(rail = %self.rails[i].name, len = n.payload.len(), "rails: message dropped");
                }
            }
        }
        self.inbox = got;
    }

    /// The peer whose rail `rail` is the rail peer `sub`.
    fn parent_of(&self, rail: usize, sub: PeerId) -> Option<PeerId> {
        self.peers
            .iter()
            .find(|(_, s)| s.rails.get(rail).is_some_and(|rp| rp.id == Some(sub)))
            .map(|(&p, _)| p)
    }

    /// Gives up re-pairings past `rejoin_timeout` and offers the lost
    /// per-peer-endpoint rails that are due.
    pub(super) fn rejoin_tick(&mut self, now: Instant) {
        let (timeout, retry) = (self.cfg.rejoin_timeout, self.cfg.retry_after);
        let mut out = Vec::new();
        for (&peer, state) in &mut self.peers {
            let Some(theirs) = state.their_token else {
                continue;
            };
            for (i, rp) in state.rails.iter_mut().enumerate() {
                let rail = &mut self.rails[i];
                if !rail.backend.endpoint_per_peer() || rp.remote.is_none() {
                    continue;
                }
                match &rp.rejoin {
                    Rejoin::Offered { id, since, .. } if now.duration_since(*since) >= timeout => {
                        tracing::debug!(rail = %rail.name, %peer, "rails: offer not answered, given up");
                        rail.backend.remove_peer(*id);
                        rp.rejoin = Rejoin::Idle;
                        rp.down_since = Some(now);
                    }
                    Rejoin::Answered { since, .. } if now.duration_since(*since) >= timeout => {
                        tracing::debug!(rail = %rail.name, %peer, "rails: answer not confirmed, given up");
                        if let Some(id) = rp.id.take() {
                            rail.backend.remove_peer(id);
                        }
                        rp.rejoin = Rejoin::Idle;
                        rp.down_since = Some(now);
                    }
                    // A rail peer kept in place (`disconnect_peer`, tcp)
                    // is dialed again instead (`redial`).
                    Rejoin::Idle
                        if rp.lost
                            && rp.id.is_none()
                            && rail.up
                            && rp.down_since.is_none_or(|t| now.duration_since(t) >= retry) =>
                    {
                        match rail.backend.prepare_peer() {
                            Ok((id, ep)) => {
                                let epoch = self.epoch;
                                self.epoch += 1;
                                out.push((
                                    peer,
                                    Msg {
                                        to: theirs,
                                        rail: i as u32,
                                        kind: Kind::Offer,
                                        epoch,
                                        ep: ep.data.clone(),
                                    },
                                ));
                                rp.rejoin = Rejoin::Offered {
                                    epoch,
                                    id,
                                    ep: ep.data,
                                    since: now,
                                };
                            }
                            Err(e) => {
                                tracing::debug!(rail = %rail.name, error = %e, "rails: preparing an offer failed");
                                rp.down_since = Some(now);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        for (peer, m) in out {
            self.send(peer, &m, now);
        }
    }

    /// Sends `m` to `peer` on a working rail other than the one it is
    /// about. A message that finds no rail, or is lost, is repeated by the
    /// timeouts.
    fn send(&mut self, peer: PeerId, m: &Msg, now: Instant) {
        let Some(state) = self.peers.get(&peer) else {
            return;
        };
        let carrier = state.rails.iter().enumerate().find_map(|(j, rp)| {
            let ok = j != m.rail as usize && !rp.lost && self.rails[j].up;
            rp.id.filter(|_| ok).map(|id| (j, id))
        });
        let Some((j, id)) = carrier else {
            tracing::debug!(%peer, rail = m.rail, "rails: no rail to carry a rejoin message");
            return;
        };
        let payload = match m.encode() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "rails: encoding a rejoin message failed");
                return;
            }
        };
        let t = Transfer::new(id, Op::Write, vec![], vec![])
            .with_notify(payload)
            .with_deadline(now + self.cfg.rejoin_timeout);
        if let Err(e) = self.rails[j].backend.submit(t) {
            tracing::debug!(rail = %self.rails[j].name, error = %e, "rails: sending a rejoin message failed");
        }
    }

    /// Handles one rails message; `false` when it is dropped.
    fn on_message(&mut self, payload: &[u8], now: Instant) -> bool {
        let Some(m) = Msg::decode(payload) else {
            return false;
        };
        let Some(&peer) = self.by_token.get(&m.to) else {
            return false;
        };
        let i = m.rail as usize;
        let known = self.peers.get(&peer).is_some_and(|s| {
            s.their_token.is_some() && s.rails.get(i).is_some_and(|rp| rp.remote.is_some())
        });
        if !known || !self.rails[i].backend.endpoint_per_peer() {
            return false;
        }
        match m.kind {
            Kind::Offer => self.on_offer(peer, m, now),
            Kind::Answer => self.on_answer(peer, m, now),
            Kind::Ready => self.on_ready(peer, &m),
        }
    }

    fn on_offer(&mut self, peer: PeerId, m: Msg, now: Instant) -> bool {
        let kind = self.kind();
        let i = m.rail as usize;
        let Some(state) = self.peers.get_mut(&peer) else {
            return false;
        };
        let (Some(ours), Some(theirs)) = (state.token, state.their_token) else {
            return false;
        };
        let rail = &mut self.rails[i];
        let rp = &mut state.rails[i];
        let reply = |kind, epoch, ep: &[u8]| Msg {
            to: theirs,
            rail: m.rail,
            kind,
            epoch,
            ep: ep.to_vec(),
        };
        if !rail.up {
            // Our side of the rail is down: the peer offers again later.
            return true;
        }
        let out = match &rp.rejoin {
            // A repeated offer: the same answer again.
            Rejoin::Answered { epoch, ep, .. } if *epoch == m.epoch => {
                reply(Kind::Answer, *epoch, ep)
            }
            // Both offered: the larger token leads and keeps its offer.
            Rejoin::Offered { epoch, ep, .. } if ours > theirs => reply(Kind::Offer, *epoch, ep),
            _ => {
                if let Rejoin::Offered { id, .. } = std::mem::take(&mut rp.rejoin) {
                    rail.backend.remove_peer(id);
                }
                // The old rail peer goes now: its parts move to other rails.
                if let Some(old) = rp.id.take() {
                    rail.backend.remove_peer(old);
                }
                rp.lost = true;
                rp.down_since = Some(now);
                let regions = rp.remote.as_ref().map_or(Vec::new(), |(_, r)| r.clone());
                let remote = Endpoint {
                    backend: kind,
                    data: m.ep,
                };
                match pair(rail, &remote, &regions) {
                    Ok((id, ep)) => {
                        rp.id = Some(id);
                        rp.remote = Some((remote, regions));
                        let out = reply(Kind::Answer, m.epoch, &ep);
                        rp.rejoin = Rejoin::Answered {
                            epoch: m.epoch,
                            ep,
                            since: now,
                        };
                        out
                    }
                    Err(e) => {
                        tracing::debug!(rail = %rail.name, error = %e, "rails: answering an offer failed");
                        return true;
                    }
                }
            }
        };
        self.send(peer, &out, now);
        self.route_fences(peer);
        true
    }

    fn on_answer(&mut self, peer: PeerId, m: Msg, now: Instant) -> bool {
        let kind = self.kind();
        let i = m.rail as usize;
        let Some(state) = self.peers.get_mut(&peer) else {
            return false;
        };
        let Some(theirs) = state.their_token else {
            return false;
        };
        let rail = &mut self.rails[i];
        let rp = &mut state.rails[i];
        let ready = Msg {
            to: theirs,
            rail: m.rail,
            kind: Kind::Ready,
            epoch: m.epoch,
            ep: Vec::new(),
        };
        match rp.rejoin {
            Rejoin::Offered { epoch, id, .. } if epoch == m.epoch => {
                rp.rejoin = Rejoin::Idle;
                let regions = rp.remote.as_ref().map_or(Vec::new(), |(_, r)| r.clone());
                let remote = Endpoint {
                    backend: kind,
                    data: m.ep,
                };
                if let Err(e) = connect(rail, id, &remote, &regions) {
                    tracing::debug!(rail = %rail.name, error = %e, "rails: connecting to an answer failed");
                    rp.down_since = Some(now);
                    return true;
                }
                tracing::info!(rail = %rail.name, %peer, "rails: rail paired again over another rail, back in use");
                rp.id = Some(id);
                rp.remote = Some((remote, regions));
                rp.lost = false;
                rp.down_since = None;
                rp.joined = Some(epoch);
                rail.stats.rejoins += 1;
            }
            // A repeated answer to an offer already connected.
            Rejoin::Idle if rp.joined == Some(m.epoch) => {}
            _ => return false,
        }
        self.send(peer, &ready, now);
        self.route_fences(peer);
        true
    }

    fn on_ready(&mut self, peer: PeerId, m: &Msg) -> bool {
        let Some(state) = self.peers.get_mut(&peer) else {
            return false;
        };
        let rail = &mut self.rails[m.rail as usize];
        let rp = &mut state.rails[m.rail as usize];
        match rp.rejoin {
            Rejoin::Answered { epoch, .. } if epoch == m.epoch => {
                tracing::info!(rail = %rail.name, %peer, "rails: rail paired again by the peer's offer, back in use");
                rp.rejoin = Rejoin::Idle;
                rp.lost = false;
                rp.down_since = None;
                rp.joined = Some(epoch);
                rail.stats.rejoins += 1;
                true
            }
            // A repeated Ready.
            Rejoin::Idle => rp.joined == Some(m.epoch),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::connect_pair;
    use crate::error::SubmitError;
    use crate::loopback::{LoopbackBackend, LoopbackConfig};
    use crate::memory::{Access, Region};
    use crate::transfer::{Completion, Descriptor, Notification, RemoteDescriptor};
    use crate::{RailsConfig, RemoteKey, TransferId};
    use std::time::Duration;

    /// A loopback backend that behaves like verbs: one endpoint per peer.
    fn lo() -> Box<dyn Backend> {
        Box::new(LoopbackBackend::new(LoopbackConfig {
            endpoint_per_peer: true,
            ..LoopbackConfig::default()
        }))
    }

    fn two(cfg: &RailsConfig) -> Rails {
        Rails::new(vec![("r0".into(), lo()), ("r1".into(), lo())], cfg.clone()).unwrap()
    }

    struct Side {
        rails: Rails,
        src: Region,
        dst: Region,
        peer: PeerId,
        their_dst: RemoteKey,
    }

    const LEN: usize = 1 << 20;

    fn pair(cfg: &RailsConfig) -> (Side, Side) {
        let (mut a, mut b) = (two(cfg), two(cfg));
        let mk = |seed: usize| {
            Region::from_vec(
                (0..LEN).map(|i| (i * seed % 251) as u8).collect(),
                Access::ALL,
            )
            .unwrap()
        };
        let (a_src, b_src) = (mk(7), mk(13));
        let (a_dst, b_dst) = (
            Region::alloc(LEN, Access::ALL).unwrap(),
            Region::alloc(LEN, Access::ALL).unwrap(),
        );
        let ra = [a.register(&a_src).unwrap(), a.register(&a_dst).unwrap()];
        let rb = [b.register(&b_src).unwrap(), b.register(&b_dst).unwrap()];
        let (ap, bp) = connect_pair(&mut a, &ra, &mut b, &rb).unwrap();
        (
            Side {
                rails: a,
                src: a_src,
                dst: a_dst,
                peer: ap,
                their_dst: rb[1].key,
            },
            Side {
                rails: b,
                src: b_src,
                dst: b_dst,
                peer: bp,
                their_dst: ra[1].key,
            },
        )
    }

    fn drive(a: &mut Side, b: &mut Side, rounds: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        for _ in 0..rounds {
            a.rails.poll(&mut out);
            b.rails.poll(&mut Vec::new());
        }
        out
    }

    /// A striped WRITE of all of `from`'s source into `to`'s destination.
    fn write(from: &mut Side, to: &mut Side) {
        let t = Transfer::new(
            from.peer,
            Op::Write,
            vec![Descriptor {
                region: from.src.id(),
                offset: 0,
                len: LEN as u64,
            }],
            vec![RemoteDescriptor {
                key: from.their_dst,
                offset: 0,
                len: LEN as u64,
            }],
        );
        let id = t.id;
        from.rails.submit(t).unwrap();
        let done = drive(from, to, 8);
        let c = done.iter().find(|c| c.id == id).expect("completed");
        assert!(c.result.is_ok(), "{:?}", c.result);
        let (mut x, mut y) = (vec![0u8; LEN], vec![0u8; LEN]);
        from.src.read(0, &mut x).unwrap();
        to.dst.read(0, &mut y).unwrap();
        assert!(x == y, "bytes differ");
    }

    /// Drops rail 1 of `s` to its peer as a failed part does, due at once.
    fn lose_rail1(s: &mut Side) {
        let rp = &mut s.rails.peers.get_mut(&s.peer).unwrap().rails[1];
        let id = rp.id.take().unwrap();
        s.rails.rails[1].backend.remove_peer(id);
        rp.lost = true;
        rp.down_since = None;
    }

    fn rail1(s: &Side) -> &super::super::RailPeer {
        &s.rails.peers[&s.peer].rails[1]
    }

    #[test]
    fn an_offer_is_answered_and_the_rail_carries_bytes_again() {
        let cfg = RailsConfig {
            stripe_min: 64 << 10,
            ..RailsConfig::default()
        };
        let (mut a, mut b) = pair(&cfg);
        write(&mut a, &mut b);
        assert_eq!(a.rails.rail_stats()[1].bytes, LEN as u64 / 2);
        lose_rail1(&mut a);
        // Old behaviour for comparison: the handshake's endpoint is spent.
        let (ep, regs) = rail1(&a).remote.clone().unwrap();
        let (id, _) = a.rails.rails[1].backend.prepare_peer().unwrap();
        assert!(a.rails.rails[1]
            .backend
            .connect_peer(id, &ep, &regs)
            .is_err());
        a.rails.rails[1].backend.remove_peer(id);
        let before = b.rails.peers[&b.peer].rails[1].id;
        drive(&mut a, &mut b, 6);
        for s in [&a, &b] {
            let rp = rail1(s);
            assert!(matches!(rp.rejoin, Rejoin::Idle) && !rp.lost && rp.id.is_some());
            assert_eq!(s.rails.rail_stats()[1].rejoins, 1);
            assert_eq!(s.rails.rail_stats()[1].dropped, 0);
        }
        // The answering side paired a new rail peer, dropping its old one.
        assert_ne!(rail1(&b).id, before);
        write(&mut a, &mut b);
        write(&mut b, &mut a);
        assert_eq!(a.rails.rail_stats()[1].bytes, LEN as u64);
        assert_eq!(b.rails.rail_stats()[1].bytes, LEN as u64 / 2);
    }

    #[test]
    fn both_sides_offering_at_once_converge_on_one_pairing() {
        // The tokens are random: 8 pairs give each side the lead almost surely.
        for _ in 0..8 {
            both_offer_once();
        }
    }

    fn both_offer_once() {
        let cfg = RailsConfig {
            stripe_min: 64 << 10,
            ..RailsConfig::default()
        };
        let (mut a, mut b) = pair(&cfg);
        lose_rail1(&mut a);
        lose_rail1(&mut b);
        let now = Instant::now();
        a.rails.rejoin_tick(now);
        b.rails.rejoin_tick(now);
        assert!(matches!(rail1(&a).rejoin, Rejoin::Offered { .. }));
        assert!(matches!(rail1(&b).rejoin, Rejoin::Offered { .. }));
        drive(&mut a, &mut b, 8);
        for s in [&a, &b] {
            let rp = rail1(s);
            assert!(
                matches!(rp.rejoin, Rejoin::Idle) && !rp.lost && rp.id.is_some(),
                "{:?}",
                rp.rejoin
            );
            assert_eq!(s.rails.rail_stats()[1].rejoins, 1);
        }
        // One side's offer won; the loser's prepared rail peer is gone, so
        // each side holds exactly one rail peer on rail 1, and they pair.
        write(&mut a, &mut b);
        write(&mut b, &mut a);
        assert_eq!(a.rails.rail_stats()[1].bytes, LEN as u64 / 2);
        assert_eq!(b.rails.rail_stats()[1].bytes, LEN as u64 / 2);
    }

    #[test]
    fn a_part_that_landed_before_its_rail_was_dropped_does_not_take_it_back() {
        let (mut a, _b) = pair(&RailsConfig::default());
        let old = rail1(&a).id.unwrap();
        lose_rail1(&mut a);
        let now = Instant::now();
        a.rails.peers.get_mut(&a.peer).unwrap().rails[1].down_since = Some(now);
        // Its completion comes out of the rail after the drop.
        let id = TransferId::next();
        let t = Transfer::new(a.peer, Op::Write, vec![], vec![]);
        let part = super::super::Part {
            parent: t.id,
            transfer: t,
            bytes: 4096,
            tried: 0,
            tag: None,
        };
        a.rails.parts.insert((1, id), part);
        let done = Completion {
            id,
            peer: old,
            result: Ok(()),
        };
        a.rails.on_part_done(1, done, now);
        assert_eq!(a.rails.rail_stats()[1].bytes, 4096);
        assert_eq!(rail1(&a).down_since, Some(now));
        assert_eq!(a.rails.rail_stats()[1].down_peers, 1);
    }

    #[test]
    fn an_unanswered_offer_is_given_up_and_made_again() {
        let cfg = RailsConfig {
            rejoin_timeout: Duration::from_millis(50),
            retry_after: Duration::from_millis(10),
            ..RailsConfig::default()
        };
        let (mut a, mut b) = pair(&cfg);
        lose_rail1(&mut a);
        a.rails.rejoin_tick(Instant::now());
        let Rejoin::Offered { epoch: first, .. } = rail1(&a).rejoin else {
            panic!()
        };
        // The offer is lost (b never polls); a gives up and offers anew.
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            a.rails.poll(&mut Vec::new());
            if matches!(rail1(&a).rejoin, Rejoin::Offered { epoch, .. } if epoch > first) {
                break;
            }
            assert!(Instant::now() < end, "no second offer");
            std::thread::sleep(Duration::from_millis(5));
        }
        // b sees both offers (it answers the first, then the second, whose
        // answer a takes); the first answer is stale, dropped where it arrived
        // (rail 0, the carrier).
        drive(&mut a, &mut b, 6);
        assert!(!rail1(&a).lost && !rail1(&b).lost);
        assert_eq!(
            a.rails.rail_stats()[0].dropped,
            1,
            "{:?}",
            a.rails.rail_stats()
        );
        write(&mut a, &mut b);
    }

    #[test]
    fn forged_malformed_and_stale_messages_are_dropped_and_counted() {
        let (mut a, mut b) = pair(&RailsConfig::default());
        let token = a.rails.peers[&a.peer].token.unwrap();
        let now = Instant::now();
        let msg = |to, rail, kind, epoch| {
            Msg {
                to,
                rail,
                kind,
                epoch,
                ep: vec![1, 2, 3],
            }
            .encode()
            .unwrap()
        };
        let bad: Vec<Vec<u8>> = vec![
            // A token nobody was given.
            msg([token[0] ^ 1, token[1]], 1, Kind::Offer, 1),
            // A rail that does not exist.
            msg(token, 7, Kind::Offer, 1),
            // An answer and a Ready to nothing we offered or answered.
            msg(token, 1, Kind::Answer, 5),
            msg(token, 1, Kind::Ready, 5),
            // Not msgpack, and too long.
            [PREFIX, b"garbage"].concat(),
            [PREFIX, &[0u8; MAX_MESSAGE][..]].concat(),
        ];
        for m in &bad {
            assert!(!a.rails.on_message(m, now), "{m:?}");
        }
        // Nothing changed: rail 1 is still paired and in use.
        assert!(!rail1(&a).lost && matches!(rail1(&a).rejoin, Rejoin::Idle));
        // Sent by the peer, they are counted and never reach the application.
        let rail0 = b.rails.peers[&b.peer].rails[0].id.unwrap();
        for m in bad.into_iter().chain([b"app".to_vec()]) {
            let t = Transfer::new(rail0, Op::Write, vec![], vec![]).with_notify(m);
            b.rails.rails[0].backend.submit(t).unwrap();
        }
        drive(&mut b, &mut a, 2);
        let mut notes: Vec<Notification> = Vec::new();
        a.rails.poll_notifications(&mut notes);
        assert_eq!(notes.len(), 1);
        assert_eq!(&notes[0].payload[..], b"app");
        assert_eq!(a.rails.rail_stats()[0].dropped, 6);
        // The application cannot send one.
        let t =
            Transfer::new(b.peer, Op::Write, vec![], vec![]).with_notify([PREFIX, b"x"].concat());
        assert!(matches!(
            b.rails.submit(t),
            Err(SubmitError::Rejected(DataError::Unsupported { .. }))
        ));
    }
}
