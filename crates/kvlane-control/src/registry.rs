//! The sans-IO node: owns every peer machine, routes frames, enforces the
//! peer cap and the one-live-connection-per-peer rule.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{debug, info_span, warn};

/// At most one summary line of refused inbound peers per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Incarnations remembered per peer slot (engines that left and may return).
const INCARNATIONS_PER_SLOT: usize = 4;

use crate::config::{Config, LocalInfo, Route};
use crate::error::{Refusal, WireError};
use crate::ids::ConnectionId;
use crate::ids::Ranks;
use crate::peer::{Event, Peer, Role, State, Stats, Transmit};
use crate::wire::Message;

/// How a frame reaches a connection on the channel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Link {
    /// A connection we dialed (the channel keyed it by its id).
    Dial(ConnectionId),
    /// A connection the peer dialed; the channel's routing id for it.
    Accepted(Bytes),
}

/// An event of one peer, tagged with its id and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEvent {
    /// Connection id.
    pub id: ConnectionId,
    /// Peer address (`host:port` for peers we dialed, `inbound:<routing id>` otherwise).
    pub addr: String,
    /// Whether this side dialed the connection (`Initiator`) or accepted it.
    pub role: Role,
    /// What happened.
    pub event: Event,
}

/// Why [`Registry::connect`] did not create a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectRefused {
    /// A live connection to this address exists; here is its id.
    #[error("a live connection {existing} to {addr} exists")]
    Duplicate {
        /// The existing live connection.
        existing: ConnectionId,
        /// The address.
        addr: String,
    },
    /// The peer cap is reached.
    #[error("peer cap of {cap} reached; refusing {addr}")]
    PeerCap {
        /// The cap.
        cap: usize,
        /// The refused address.
        addr: String,
    },
    /// The registry was closed.
    #[error("node is closed; refusing {addr}")]
    Closed {
        /// The refused address.
        addr: String,
    },
}

#[derive(Debug)]
struct Entry {
    peer: Peer,
    link: Link,
    span: tracing::Span,
}

/// Owns all peers of a node. Same calling order as [`Peer`]: inputs, then
/// drain [`poll_transmit`](Self::poll_transmit), [`poll_event`](Self::poll_event),
/// then sleep until [`poll_timeout`](Self::poll_timeout).
#[derive(Debug)]
pub struct Registry {
    config: Arc<Config>,
    local: Arc<LocalInfo>,
    next_id: u64,
    peers: HashMap<ConnectionId, Entry>,
    by_addr: HashMap<String, ConnectionId>,
    by_link: HashMap<Bytes, ConnectionId>,
    by_engine: HashMap<(String, Ranks), ConnectionId>,
    incarnations: HashMap<(String, Ranks), u64>,
    transmits: VecDeque<(ConnectionId, Link, Transmit)>,
    events: VecDeque<PeerEvent>,
    stats: Stats,
    refused_at_cap: u64,
    /// Accepted connections still handshaking (unauthenticated), oldest first.
    pending: BTreeSet<ConnectionId>,
    /// Each peer's next deadline, also in `timers`; an entry of `timers`
    /// that no longer matches is stale and skipped. Keeps `poll_timeout`
    /// and `handle_timeout` O(log n) instead of a scan of every peer per
    /// input (measured: keep-alive of 1,000 peers cost 7.3% of a core with
    /// the scans).
    deadlines: HashMap<ConnectionId, Instant>,
    timers: BinaryHeap<Reverse<(Instant, ConnectionId)>>,
    /// Refused inbound peers not yet in a summary line, and when the last
    /// line was written.
    unlogged_refusals: u64,
    last_refusal_log: Option<Instant>,
    closed: bool,
    /// Accepted connections that died; released before the next routing.
    dead_accepted: Vec<ConnectionId>,
    /// Routing ids of accepted links whose last connection was released
    /// ([`poll_released_link`](Self::poll_released_link)).
    released_links: VecDeque<Bytes>,
    /// Routing ids of accepted links a connection started on
    /// ([`poll_adopted_link`](Self::poll_adopted_link)).
    adopted_links: VecDeque<Bytes>,
    /// Routing ids of accepted links whose connection reached `Ready`
    /// ([`poll_proven_link`](Self::poll_proven_link)).
    proven_links: VecDeque<Bytes>,
}

impl Registry {
    /// An empty registry. The config is [normalized](Config::normalized).
    pub fn new(config: Arc<Config>, local: Arc<LocalInfo>) -> Self {
        Self {
            config: Arc::new(config.normalized()),
            local,
            next_id: 1,
            peers: HashMap::new(),
            by_addr: HashMap::new(),
            by_link: HashMap::new(),
            by_engine: HashMap::new(),
            incarnations: HashMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            released_links: VecDeque::new(),
            adopted_links: VecDeque::new(),
            proven_links: VecDeque::new(),
            stats: Stats::default(),
            refused_at_cap: 0,
            pending: BTreeSet::new(),
            deadlines: HashMap::new(),
            timers: BinaryHeap::new(),
            unlogged_refusals: 0,
            last_refusal_log: None,
            closed: false,
            dead_accepted: Vec::new(),
        }
    }

    /// Number of tracked (not yet released) connections.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether no connection is tracked.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Replaces the data-plane blob of this node's handshakes: new
    /// connections, and every later handshake of existing ones (a peer
    /// that restarted), carry `blob`; a handshake under way finishes with
    /// the blob it began with.
    pub fn set_data_plane(&mut self, blob: Vec<u8>) {
        let local = Arc::new(LocalInfo {
            data_plane: blob,
            ..(*self.local).clone()
        });
        for e in self.peers.values_mut() {
            e.peer.set_local(local.clone());
        }
        self.local = local;
    }

    /// Frames dropped at the node level, by released connections and by
    /// current ones: every counter only ever grows.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        for e in self.peers.values() {
            s.add_peer(&e.peer.stats());
        }
        s
    }

    /// Peers refused because of the cap.
    pub fn refused_at_cap(&self) -> u64 {
        self.refused_at_cap
    }

    /// A peer machine by id.
    pub fn peer(&self, id: ConnectionId) -> Option<&Peer> {
        self.peers.get(&id).map(|e| &e.peer)
    }

    /// Ids of all tracked connections.
    pub fn ids(&self) -> Vec<ConnectionId> {
        self.peers.keys().copied().collect()
    }

    /// How connection `id` is reached on the channel.
    pub fn link(&self, id: ConnectionId) -> Option<&Link> {
        self.peers.get(&id).map(|e| &e.link)
    }

    /// The connection currently registered for `addr`, if any.
    pub fn by_addr(&self, addr: &str) -> Option<ConnectionId> {
        self.by_addr.get(addr).copied()
    }

    /// Dials `addr`. A dead connection to the same address is retired first;
    /// a live one is handed back as [`ConnectRefused::Duplicate`].
    pub fn connect(&mut self, now: Instant, addr: &str) -> Result<ConnectionId, ConnectRefused> {
        self.connect_via(now, addr, Route::default())
    }

    /// [`connect`](Self::connect) with the route the driver resolved for
    /// `addr` (see [`Peer::initiator_via`]).
    pub fn connect_via(
        &mut self,
        now: Instant,
        addr: &str,
        route: Route,
    ) -> Result<ConnectionId, ConnectRefused> {
        self.reap_dead();
        if let Some(&existing) = self.by_addr.get(addr) {
            let dead = self
                .peers
                .get(&existing)
                .is_none_or(|e| e.peer.state() == State::Dead);
            if !dead {
                return Err(ConnectRefused::Duplicate {
                    existing,
                    addr: addr.to_owned(),
                });
            }
            self.release(existing);
        }
        if self.closed {
            return Err(ConnectRefused::Closed {
                addr: addr.to_owned(),
            });
        }
        if self.peers.len() >= self.config.peer_cap && !self.free_dead_slot() {
            self.refused_at_cap += 1;
            return Err(ConnectRefused::PeerCap {
                cap: self.config.peer_cap,
                addr: addr.to_owned(),
            });
        }
        let id = self.alloc();
        let span = info_span!("peer", %id, %addr);
        let peer = span.in_scope(|| {
            Peer::initiator_via(
                now,
                addr.to_owned(),
                route,
                Arc::clone(&self.config),
                Arc::clone(&self.local),
            )
        });
        self.by_addr.insert(addr.to_owned(), id);
        self.peers.insert(
            id,
            Entry {
                peer,
                link: Link::Dial(id),
                span,
            },
        );
        self.collect(id);
        Ok(id)
    }

    /// Routes one inbound frame. Dead accepted connections are reaped first,
    /// so a reconnecting peer's first frame always finds a fresh entry.
    ///
    /// A `hello` on an accepted link starts a new connection, except on the
    /// link of a live (ready or suspect) connection: there it is dropped
    /// and counted ([`Stats::hellos_on_live_links`]), and the live
    /// connection keeps the link and its state.
    pub fn handle_frame(&mut self, now: Instant, link: Link, bytes: &[u8]) {
        self.reap_dead();
        let rid = match link {
            Link::Dial(id) => {
                if let Some(e) = self.peers.get_mut(&id) {
                    let _g = e.span.enter();
                    e.peer.handle_frame(now, bytes);
                    drop(_g);
                    self.collect(id);
                } else {
                    self.stats.unexpected += 1;
                }
                return;
            }
            Link::Accepted(rid) => rid,
        };
        let decoded = Message::decode(bytes, self.config.frame_cap);
        let known = self.by_link.get(&rid).copied();
        match (decoded, known) {
            // A hello on the routing id of a live (handshaken, not dead)
            // connection is refused and counted: the live connection keeps
            // its routing id and its state. Routing the link to a new
            // handshake instead would starve the live connection of its
            // peer's frames (it would die by keep-alive, replaced by
            // whatever sent the hello), and a reply would go to the live
            // peer's socket, so nothing is sent. A kvlane dialer never
            // does this (every dial gets a fresh routing id); a peer that
            // reuses its routing id after a restart is accepted once the
            // old connection is dead (keep-alive, within the death bound).
            (Ok(Message::Hello(_)), Some(old))
                if self
                    .peers
                    .get(&old)
                    .is_some_and(|e| e.peer.is_up() && !e.peer.is_closing()) =>
            {
                self.stats.hellos_on_live_links += 1;
                debug!(id = %old, "hello on a live connection's routing id; dropped");
            }
            // A hello on a routing id we know whose connection is still
            // handshaking or dead starts a new connection (a restarted peer
            // reusing its identity; its frames go to the new one) and
            // releases the old one; one that is closing lingers apart.
            (Ok(Message::Hello(hello)), known) => {
                if let Some(old) = known {
                    if !self.peers.get(&old).is_some_and(|e| e.peer.is_up()) {
                        self.release(old);
                    }
                }
                self.accept(now, rid, hello);
                self.log_refusals(now);
            }
            (msg, Some(id)) => {
                if let Some(e) = self.peers.get_mut(&id) {
                    let _g = e.span.enter();
                    match msg {
                        Ok(m) => e.peer.handle_message(now, m),
                        Err(err) => e.peer.handle_decode_error(now, err),
                    }
                    drop(_g);
                    self.collect(id);
                }
            }
            (Ok(_), None) => {
                // Traffic for a connection we already released: drop it.
                self.stats.unexpected += 1;
            }
            (Err(WireError::VersionMismatch { local, remote }), None) => {
                let frame = Peer::refusal_frame(&Refusal::Version { local, remote });
                self.transmits.push_back((
                    ConnectionId(0),
                    Link::Accepted(rid),
                    Transmit::Frame(frame),
                ));
            }
            (Err(e), None) => {
                debug!(error = %e, "dropped inbound frame");
                self.stats.count(&e);
            }
        }
    }

    /// Takes an inbound `hello`. Nothing it claims is trusted yet: it gets a
    /// handshake slot (the oldest handshake is dropped when they are all
    /// taken), never a peer slot, and it replaces no connection; the
    /// one-live-connection-per-peer rule is applied when it becomes ready
    /// (after the key is proven).
    fn accept(&mut self, now: Instant, rid: Bytes, hello: crate::wire::Hello) {
        if self.closed {
            return;
        }
        if self.peers.len() - self.pending.len() >= self.config.peer_cap {
            self.free_dead_slot();
        }
        let authenticated = self.peers.len() - self.pending.len();
        if authenticated >= self.config.peer_cap {
            self.refused_at_cap += 1;
            self.stats.refused_inbound += 1;
            self.unlogged_refusals += 1;
            debug!(
                cap = self.config.peer_cap,
                "peer cap reached; refusing inbound peer"
            );
            let frame = Peer::refusal_frame(&Refusal::PeerCap {
                cap: self.config.peer_cap,
            });
            self.transmits.push_back((
                ConnectionId(0),
                Link::Accepted(rid),
                Transmit::Frame(frame),
            ));
            return;
        }
        while self.pending.len() >= self.config.handshake_cap {
            let Some(oldest) = self.pending.pop_first() else {
                break;
            };
            self.stats.handshakes_evicted += 1;
            self.unlogged_refusals += 1;
            self.release(oldest);
        }
        let id = self.alloc();
        let addr = format!("inbound:{}", hex(&rid));
        let span = info_span!("peer", %id, %addr);
        // The incarnation is looked up when the peer is ready (`collect`),
        // from the identity it proved, not from what the hello claims.
        let peer = span.in_scope(|| {
            Peer::acceptor(
                now,
                addr,
                Arc::clone(&self.config),
                Arc::clone(&self.local),
                hello,
                None,
            )
        });
        self.by_link.insert(rid.clone(), id);
        self.adopted_links.push_back(rid.clone());
        self.pending.insert(id);
        self.peers.insert(
            id,
            Entry {
                peer,
                link: Link::Accepted(rid),
                span,
            },
        );
        self.collect(id);
    }

    /// The channel reported a failure on a dialed connection.
    pub fn handle_channel_error(&mut self, now: Instant, id: ConnectionId, reason: String) {
        if let Some(e) = self.peers.get_mut(&id) {
            let _g = e.span.enter();
            e.peer.handle_channel_error(now, reason);
            drop(_g);
            self.collect(id);
        }
    }

    /// Writes the summary line of refused inbound peers, at most once per
    /// [`REFUSAL_LOG_INTERVAL`] (a flood of refused peers logs one line, not
    /// one per peer).
    fn log_refusals(&mut self, now: Instant) {
        if self.unlogged_refusals == 0
            || self
                .last_refusal_log
                .is_some_and(|t| now.saturating_duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        warn!(
            refused = self.unlogged_refusals,
            refused_total = self.stats.refused_inbound,
            handshakes_evicted_total = self.stats.handshakes_evicted,
            "refused inbound peers (peer cap, handshake slots, failed or incompatible handshakes)"
        );
        self.unlogged_refusals = 0;
        self.last_refusal_log = Some(now);
    }

    /// Fires expired timers of every peer.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut due = Vec::new();
        while let Some(&Reverse((t, id))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            if self.deadlines.get(&id) == Some(&t) {
                self.deadlines.remove(&id);
                due.push(id);
            }
        }
        for id in due {
            if let Some(e) = self.peers.get_mut(&id) {
                let _g = e.span.enter();
                e.peer.handle_timeout(now);
                drop(_g);
                self.collect(id);
            }
        }
        // An accepted connection that died in its handshake is released
        // now, not at the next inbound frame: its link closes and frees its
        // slot under the accept cap. (One that was ready stays Dead, and
        // visible as such, until then.)
        self.reap_dead_handshakes();
        self.log_refusals(now);
    }

    /// Sends a notification; the payload is handed back if the peer is unknown or not up.
    pub fn notify(
        &mut self,
        id: ConnectionId,
        transfer_id: u64,
        payload: Vec<u8>,
    ) -> Result<(), Vec<u8>> {
        let Some(e) = self.peers.get_mut(&id) else {
            return Err(payload);
        };
        e.peer.notify(transfer_id, payload)?;
        self.collect(id);
        Ok(())
    }

    /// Sends an explicit ping probe (see [`Peer::ping`]).
    pub fn ping(&mut self, now: Instant, id: ConnectionId) -> Option<u64> {
        let seq = self.peers.get_mut(&id)?.peer.ping(now)?;
        self.collect(id);
        Some(seq)
    }

    /// Closes one connection (idempotent, also after `Dead`).
    pub fn disconnect(&mut self, now: Instant, id: ConnectionId) {
        if let Some(e) = self.peers.get_mut(&id) {
            // A closing connection is no longer "the" connection to its
            // address: a new connect dials afresh while this one lingers.
            if self.by_addr.get(e.peer.addr()) == Some(&id) {
                self.by_addr.remove(e.peer.addr());
            }
            e.peer.close(now);
            self.collect(id);
        }
    }

    /// Closes every connection; new connections are refused afterwards.
    pub fn close(&mut self, now: Instant) {
        self.closed = true;
        for id in self.ids() {
            self.disconnect(now, id);
        }
    }

    /// Earliest timer of any peer.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((t, _))| *t)
    }

    /// Records `id`'s next deadline after an input changed it.
    fn schedule(&mut self, id: ConnectionId, next: Option<Instant>) {
        match next {
            Some(t) if self.deadlines.get(&id) != Some(&t) => {
                self.deadlines.insert(id, t);
                self.timers.push(Reverse((t, id)));
            }
            Some(_) => {}
            None => {
                self.deadlines.remove(&id);
            }
        }
        // Stale entries are dropped as they reach the top; bound them if
        // deadlines keep moving later faster than they expire.
        if self.timers.len() > 4 * self.deadlines.len() + 64 {
            let live = &self.deadlines;
            self.timers
                .retain(|Reverse((t, id))| live.get(id) == Some(t));
        }
        self.prune();
    }

    /// Drops stale entries off the top, so `poll_timeout` is exact.
    fn prune(&mut self) {
        while let Some(Reverse((t, id))) = self.timers.peek() {
            if self.deadlines.get(id) == Some(t) {
                break;
            }
            self.timers.pop();
        }
    }

    /// Next channel action.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<(ConnectionId, Link, Transmit)> {
        self.transmits.pop_front()
    }

    /// Next peer event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<PeerEvent> {
        self.events.pop_front()
    }

    /// Next accepted link (routing id) that a connection started on (a
    /// hello came in on it). The transport closes an accepted link that no
    /// connection adopts within the handshake timeout (one that stays
    /// silent, or sends only what starts none): drain this before
    /// [`poll_released_link`](Self::poll_released_link).
    #[must_use]
    pub fn poll_adopted_link(&mut self) -> Option<Bytes> {
        self.adopted_links.pop_front()
    }

    /// Next accepted link (routing id) whose connection reached `Ready`
    /// (proved itself): the transport keeps it when it has to make room
    /// for new connections ([`Channel::protect_accepted`](crate::Channel::protect_accepted)).
    #[must_use]
    pub fn poll_proven_link(&mut self) -> Option<Bytes> {
        self.proven_links.pop_front()
    }

    /// Next accepted link (routing id) that no connection uses any more:
    /// its connection was released (closed, refused, evicted, timed out,
    /// reaped). The driver has the transport close it, so that a peer
    /// cannot keep an accepted socket, and its slot under the
    /// transport's accept cap, past its handshake. Drain it with
    /// [`poll_transmit`](Self::poll_transmit), after the transmits (a
    /// refusal is sent before its link closes).
    #[must_use]
    pub fn poll_released_link(&mut self) -> Option<Bytes> {
        // One that a newer connection took since (a hello on the same
        // link) stays open.
        while let Some(rid) = self.released_links.pop_front() {
            if !self.by_link.contains_key(&rid) {
                return Some(rid);
            }
        }
        None
    }

    fn alloc(&mut self) -> ConnectionId {
        let id = ConnectionId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Moves a peer's outputs into the node queues; forgets it once closed.
    fn collect(&mut self, id: ConnectionId) {
        let Some(e) = self.peers.get_mut(&id) else {
            return;
        };
        while let Some(t) = e.peer.poll_transmit() {
            self.transmits.push_back((id, e.link.clone(), t));
        }
        let acceptor = e.peer.role() == Role::Acceptor;
        let addr = e.peer.addr().to_owned();
        let mut ready = None;
        let mut events = Vec::new();
        while let Some(ev) = e.peer.poll_event() {
            match &ev {
                Event::Dead { .. } if acceptor => self.dead_accepted.push(id),
                Event::Refused { .. } if acceptor && self.pending.contains(&id) => {
                    self.stats.refused_inbound += 1;
                    self.unlogged_refusals += 1;
                }
                Event::Ready(info) => {
                    ready = Some((
                        info.identity.engine_id.clone(),
                        info.identity.ranks(),
                        info.identity.incarnation,
                    ))
                }
                _ => {}
            }
            events.push(ev);
        }
        let closed = e.peer.is_closed();
        let failed_handshake = acceptor && e.peer.state() == State::Dead;
        let next = e.peer.poll_timeout();
        if let Some((engine, ranks, incarnation)) = ready {
            self.on_ready(id, acceptor, &addr, (engine, ranks), incarnation);
        }
        let role = if acceptor {
            Role::Acceptor
        } else {
            Role::Initiator
        };
        self.events
            .extend(events.into_iter().map(|event| PeerEvent {
                id,
                addr: addr.clone(),
                role,
                event,
            }));
        if closed {
            self.forget(id);
        } else if failed_handshake && self.pending.contains(&id) {
            // Refused or timed out before it proved itself: released (and
            // its link closed, after the refusal is sent) at once, so it
            // holds no slot while it stays connected.
            self.release(id);
        } else {
            self.schedule(id, next);
        }
    }

    /// A connection finished its handshake (authenticated, with a key): it
    /// leaves the handshake slots; an accepted one becomes *the* connection
    /// of its engine rank, retiring an older one (at most one live
    /// connection per peer), and reports a restart of the peer.
    fn on_ready(
        &mut self,
        id: ConnectionId,
        acceptor: bool,
        addr: &str,
        key: (String, Ranks),
        incarnation: u64,
    ) {
        self.pending.remove(&id);
        let old_incarnation = self.incarnations.get(&key).copied();
        if let Some(Link::Accepted(rid)) = self.peers.get(&id).map(|e| &e.link) {
            self.proven_links.push_back(rid.clone());
        }
        if acceptor {
            if let Some(old) = self.by_engine.get(&key).copied().filter(|&o| o != id) {
                if let Some(e) = self.peers.get_mut(&old) {
                    e.peer.retire();
                }
                self.collect(old);
            }
            self.by_engine.insert(key.clone(), id);
            if let Some(old) = old_incarnation.filter(|&o| o != incarnation) {
                self.events.push_back(PeerEvent {
                    id,
                    addr: addr.to_owned(),
                    role: Role::Acceptor,
                    event: Event::Restarted {
                        old,
                        new: incarnation,
                    },
                });
            }
        }
        let cap = self.config.peer_cap.saturating_mul(INCARNATIONS_PER_SLOT);
        if old_incarnation.is_none() && self.incarnations.len() >= cap {
            // Forget an engine rank that has no connection now.
            let gone = self
                .incarnations
                .keys()
                .find(|k| !self.by_engine.contains_key(*k))
                .cloned();
            if let Some(gone) = gone {
                self.incarnations.remove(&gone);
                self.stats.incarnations_evicted += 1;
            }
        }
        if old_incarnation.is_some() || self.incarnations.len() < cap {
            self.incarnations.insert(key, incarnation);
        }
    }

    /// Closes and forgets at once (a dead connection being replaced).
    fn release(&mut self, id: ConnectionId) {
        if let Some(e) = self.peers.get_mut(&id) {
            e.peer.retire();
        }
        self.collect(id);
        self.forget(id);
    }

    fn forget(&mut self, id: ConnectionId) {
        let Some(e) = self.peers.remove(&id) else {
            return;
        };
        // What it dropped stays counted (invariant 9).
        self.stats.add_peer(&e.peer.stats());
        match &e.link {
            Link::Dial(_) => {
                if self.by_addr.get(e.peer.addr()) == Some(&id) {
                    self.by_addr.remove(e.peer.addr());
                }
            }
            Link::Accepted(rid) => {
                if self.by_link.get(rid) == Some(&id) {
                    // No newer connection came in on this link: the
                    // transport may close it (a hello on a link that a
                    // newer entry took leaves the link to that entry).
                    self.by_link.remove(rid);
                    self.released_links.push_back(rid.clone());
                }
            }
        }
        self.by_engine.retain(|_, v| *v != id);
        self.pending.remove(&id);
        self.deadlines.remove(&id);
        self.prune();
    }

    /// Releases accepted connections that are dead (they never reconnect by
    /// themselves: the remote initiator dials a new one).
    /// Releases the dead accepted connections that died while still
    /// handshaking; the others wait for [`reap_dead`](Self::reap_dead).
    fn reap_dead_handshakes(&mut self) {
        let (handshaking, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.dead_accepted)
            .into_iter()
            .partition(|id| self.pending.contains(id));
        self.dead_accepted = rest;
        self.release_dead(handshaking);
    }

    /// Releases the oldest dead connection that is not a handshake in
    /// progress (a peer this side dialed stays visible as dead until then):
    /// a dead peer never holds a slot under the peer cap that a live one
    /// needs. False when there is none.
    fn free_dead_slot(&mut self) -> bool {
        let oldest = self
            .peers
            .iter()
            .filter(|(id, e)| e.peer.state() == State::Dead && !self.pending.contains(id))
            .map(|(id, _)| *id)
            .min();
        match oldest {
            Some(id) => {
                debug!(%id, "peer cap reached; releasing a dead connection for a new peer");
                self.release(id);
                true
            }
            None => false,
        }
    }

    fn reap_dead(&mut self) {
        let dead = std::mem::take(&mut self.dead_accepted);
        self.release_dead(dead);
    }

    /// Releases those of `ids` that are still dead.
    fn release_dead(&mut self, ids: Vec<ConnectionId>) {
        for id in ids {
            if self
                .peers
                .get(&id)
                .is_some_and(|e| e.peer.state() == State::Dead)
            {
                self.release(id);
            }
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
