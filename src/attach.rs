//! Attaching the data plane to a peer whose control handshake completed.
//!
//! Attaching starts in one place, [`Inner::on_ready`], which the agent's
//! event task calls for every `Ready` and which returns at once: the slow
//! work (dials, authentication, the endpoint exchange) runs in a task of its
//! own per connection, and the backend is held only for its short steps
//! ([`Transport::connect_peer`](kvlane_data::Transport::connect_peer)), so a
//! peer whose data endpoint hangs delays nobody's transfers or events but
//! its own. [`Agent::connect`](crate::Agent::connect) waits for the outcome
//! ([`Inner::await_attach`]).
//!
//! Backends that issue an endpoint per peer (tcp: a credential per peer,
//! revoked when the peer is detached; verbs: a queue pair per peer)
//! exchange endpoints over the control connection once it is ready: the
//! side that dialed sends an offer (`DP_OFFER`), the other side connects to
//! it and answers with its own endpoint (`DP_ANSWER`), and the dialer
//! connects to that. On a keyed connection the endpoints (which hold the
//! tcp credential) cross only sealed under the control session's secret
//! ([`DpFrame`]), so an observer of the control connection learns none.
//! Both steps are bounded by the handshake deadline. A
//! side that cannot reach the offered endpoint still answers, so the dialer
//! can initiate. Backends with one endpoint for all peers (loopback)
//! advertise it in the handshake instead, and each side connects on
//! `Ready`. Either way an endpoint on a wildcard address is dialed at the
//! host the control connection is with ([`Endpoint::reached_at`]), and only
//! there unless `dial_any_data_host` ([`crate::dial`]).
//!
//! Every attachment is tied to a generation of its connection: a `Dead`,
//! `Restarted` or `Closed` event bumps it, and an attachment that finishes
//! after that is dropped instead of installed, so no transfer goes out on a
//! data-plane peer of an older life of the connection.

use crate::error::{Error, ErrorKind};
use crate::events::PeerEventKind;
use crate::frames::{self, DataPlaneInfo, DpFrame, Exchange, KvAdvert, DP_ANSWER, DP_OFFER};
use crate::state::{lock, Attach, Inner, PeerEntry};
use kvlane_control::{ConnectionId, RemoteInfo, Role};
use kvlane_data::{DataError, Endpoint, PeerId, RemoteRegion, Transport};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tracing::{debug, info, warn};

fn refused(msg: String) -> Error {
    Error::msg(ErrorKind::Refused, msg)
}

/// `e`'s message followed by those of its causes that it does not already
/// contain (an attach's outcome is kept as text: `connect` gets the whole
/// story, the OS error included).
fn with_causes(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let m = s.to_string();
        if !msg.contains(&m) {
            msg.push_str(": ");
            msg.push_str(&m);
        }
        source = s.source();
    }
    msg
}

/// What an attach task needs of the handshake.
struct Target {
    id: ConnectionId,
    addr: String,
    generation: u64,
    incarnation: u64,
    engine_id: String,
    kv: Vec<KvAdvert>,
    regions: Vec<RemoteRegion>,
    peer_host: Option<std::net::IpAddr>,
    /// The control session's secret (keyed connections): the endpoints
    /// exchanged are sealed under it.
    session: Option<kvlane_control::SessionKey>,
}

impl Target {
    /// What `entry` (of connection `id` at `addr`) holds of the handshake.
    fn of(id: ConnectionId, addr: String, entry: &PeerEntry) -> Self {
        Self {
            id,
            addr,
            generation: entry.generation,
            incarnation: entry.incarnation,
            engine_id: entry.engine_id.clone(),
            kv: entry.kv.clone(),
            regions: entry.regions.clone(),
            peer_host: entry.peer_host,
            session: entry.session.clone(),
        }
    }

    fn regions(&self) -> Vec<RemoteRegion> {
        self.kv
            .iter()
            .map(|k| k.region)
            .chain(self.regions.iter().copied())
            .collect()
    }
}

impl Inner {
    /// The Ready path: records what the handshake said and starts
    /// attaching the data plane in a task of its own. Never waits.
    pub(crate) fn on_ready(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: String,
        role: Role,
        info: RemoteInfo,
    ) {
        let (who, incarnation) = (&info.identity, info.identity.incarnation);
        {
            // The engine this connection handshook as, recorded whether or
            // not its data plane attaches: notifications that arrive on it
            // are checked against it (`Inner::deliver_from`).
            let mut peers = lock(&self.peers);
            let entry = peers.entry(id).or_insert_with(PeerEntry::new);
            if entry.engine_id != who.engine_id {
                entry.metrics = None;
                entry.engine_id.clone_from(&who.engine_id);
            }
        }
        let dp =
            frames::decode::<DataPlaneInfo>("a data-plane description", &addr, &info.data_plane)
                .and_then(|dp| dp.check(&addr).map(|()| dp));
        let dp: DataPlaneInfo = match dp {
            Ok(dp) => dp,
            Err(e) => {
                self.attach_failed(id, &addr, &who.engine_id, incarnation, role, e);
                return;
            }
        };
        let (target, attached) = {
            let mut peers = lock(&self.peers);
            let entry = peers.entry(id).or_insert_with(PeerEntry::new);
            // A repeated `Ready` in one generation (same incarnation):
            // the data peer attached for it stays.
            let attached = entry.data_peer.is_some() && entry.incarnation == incarnation;
            // Metrics were reset above if the engine id changed (a fresh
            // entry, should this one have gone meanwhile, has none either).
            if entry.metrics.is_none() {
                entry.metrics = Some(self.metrics.for_peer(&who.engine_id, self.rail));
            }
            entry.engine_id.clone_from(&who.engine_id);
            entry.incarnation = incarnation;
            entry.kv.clone_from(&dp.kv);
            entry.regions.clone_from(&dp.regions);
            entry.peer_host = info.peer_host;
            entry.session.clone_from(&info.session);
            entry.attach.send_replace(Attach::Pending { incarnation });
            (Target::of(id, addr, entry), attached)
        };
        if self.per_peer {
            if attached {
                return self.report(&target, role, Ok(()));
            }
            // The dialer offers; the acceptor waits for the offer
            // (`accept_offer`), which arrives after this `Ready`.
            if role == Role::Initiator && !lock(&self.offers).contains_key(&id) {
                // (An offer in progress reports for this incarnation too.)
                let this = self.clone();
                self.runtime.spawn(async move {
                    let r = this.dial_exchange(&target).await;
                    this.report(&target, role, r);
                });
            }
            return;
        }
        let this = self.clone();
        self.runtime.spawn(async move {
            let r = this.attach_shared(&target, dp.endpoint).await;
            this.report(&target, role, r);
        });
    }

    /// Waits until the data plane of `id`'s `incarnation` is attached (or
    /// failed to be), for `connect`.
    pub(crate) async fn await_attach(
        &self,
        id: ConnectionId,
        incarnation: u64,
        addr: &str,
    ) -> Result<(), Error> {
        let mut rx = lock(&self.peers)
            .entry(id)
            .or_insert_with(PeerEntry::new)
            .attach
            .subscribe();
        let wait = async {
            loop {
                if let Attach::Done {
                    incarnation: done,
                    result,
                } = &*rx.borrow_and_update()
                {
                    if *done == incarnation {
                        return result.clone().map_err(|(kind, msg)| Error::msg(kind, msg));
                    }
                }
                if rx.changed().await.is_err() {
                    return Err(Error::msg(
                        ErrorKind::PeerLost,
                        format!("{addr} ({id}) closed before its data plane was attached"),
                    ));
                }
            }
        };
        let wait = self.unless_closing(addr, wait);
        tokio::time::timeout(self.attach_timeout, wait)
            .await
            .unwrap_or_else(|_| {
                Err(Error::msg(
                    ErrorKind::Timeout,
                    format!(
                        "{addr} ({id}): the data plane was not attached within {:?} of the handshake",
                        self.attach_timeout
                    ),
                ))
            })
    }

    /// Connects to the endpoint the peer advertised in its handshake.
    async fn attach_shared(
        self: &Arc<Self>,
        t: &Target,
        endpoint: Option<Endpoint>,
    ) -> Result<(), Error> {
        let endpoint = endpoint.ok_or_else(|| {
            refused(format!(
                "{} uses a backend with per-peer endpoints (verbs); this agent's backend \
                 cannot reach it",
                t.addr
            ))
        })?;
        let endpoint = self.dialable(t, &endpoint)?;
        let regions = t.regions();
        let (data_peer, _) = self
            .off_thread(move |tr| tr.connect_peer(&endpoint, &regions))
            .await?;
        self.install(t, data_peer, true)
    }

    /// `endpoint` as this side dials it for `t`: a wildcard host filled in
    /// with the host of the control connection, and refused when it is on
    /// another host (unless `dial_any_data_host`).
    fn dialable(&self, t: &Target, endpoint: &Endpoint) -> Result<Endpoint, Error> {
        let endpoint = endpoint.reached_at(t.peer_host)?;
        if !self.dial_any_data_host {
            crate::dial::check(&t.addr, &endpoint, t.peer_host, self.data_rails)?;
        }
        Ok(endpoint)
    }

    /// Per-peer mode, dialing side: offer an endpoint, connect to the answer.
    async fn dial_exchange(self: &Arc<Self>, t: &Target) -> Result<(), Error> {
        let (peer, endpoint) = self
            .off_thread(|tr| tr.with_backend(|b| b.prepare_peer()))
            .await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.offers).insert(t.id, tx);
        let result = async {
            let offer = DpFrame::with_endpoint(
                self.incarnation,
                endpoint,
                t.session.as_ref(),
                Exchange::Offer,
            )?;
            let frame = frames::encode("an endpoint offer", &offer)?;
            self.control.notify(t.id, DP_OFFER, frame).await?;
            let answer = tokio::time::timeout(self.exchange_timeout, rx)
                .await
                .map_err(|_| {
                    Error::msg(
                        ErrorKind::Timeout,
                        format!(
                            "{} did not answer the endpoint offer within {:?}",
                            t.addr, self.exchange_timeout
                        ),
                    )
                })?
                .map_err(|_| {
                    Error::msg(
                        ErrorKind::PeerLost,
                        format!("{}: connection ended during the endpoint exchange", t.addr),
                    )
                })?;
            let endpoint = answer.open(t.session.as_ref(), &t.addr, Exchange::Answer)?;
            let remote = match (endpoint, answer.error) {
                (Some(ep), _) => ep,
                (None, e) => {
                    return Err(refused(format!(
                        "{} could not connect to our endpoint: {}",
                        t.addr,
                        e.unwrap_or_else(|| "no reason given".into())
                    )))
                }
            };
            let remote = self.dialable(t, &remote)?;
            let regions = t.regions();
            self.off_thread(move |tr| tr.connect_prepared(peer, &remote, &regions))
                .await
        }
        .await;
        lock(&self.offers).remove(&t.id);
        match result {
            Ok(()) => self.install(t, peer, true),
            Err(e) => {
                self.transport.with_backend(|b| b.remove_peer(peer));
                Err(e)
            }
        }
    }

    /// An endpoint offer arrived on `id`. Accepting one dials the offered
    /// endpoint on a blocking thread (up to the backend's connect timeout),
    /// so a peer gets one accepted at a time: an offer that arrives
    /// meanwhile waits in a slot of one, and a newer one replaces it (a
    /// restarted peer's fresh offer is still answered); what it replaces
    /// is dropped and counted. A peer that floods offers holds one
    /// blocking thread, never the pool that other peers' attaches need.
    pub(crate) fn on_offer(self: &Arc<Self>, id: ConnectionId, addr: String, payload: Vec<u8>) {
        {
            let mut accepting = lock(&self.accepting);
            if let Some(waiting) = accepting.get_mut(&id) {
                if waiting.replace((addr.clone(), payload)).is_some() {
                    let n = self.offers_dropped.fetch_add(1, Ordering::AcqRel) + 1;
                    debug!(
                        peer = %id, %addr, dropped = n,
                        "dropped an endpoint offer: the peer sent another while one was being accepted"
                    );
                }
                return;
            }
            accepting.insert(id, None);
        }
        let this = self.clone();
        self.runtime.spawn(async move {
            // Frees the connection's slot however the task ends (a panic
            // included), so its next offer is taken up.
            let mut slot = AcceptSlot {
                inner: &this,
                id,
                armed: true,
            };
            let (mut addr, mut payload) = (addr, payload);
            loop {
                this.clone().accept_offer(id, addr, payload).await;
                let mut accepting = lock(&this.accepting);
                match accepting.get_mut(&id).and_then(Option::take) {
                    Some(next) => (addr, payload) = next,
                    None => {
                        // Freed under the lock that `on_offer` checks, so
                        // no offer lands in a slot nobody takes up.
                        accepting.remove(&id);
                        slot.armed = false;
                        return;
                    }
                }
            }
        });
    }

    /// Per-peer mode, accepting side: connect to the offer and answer.
    pub(crate) async fn accept_offer(
        self: Arc<Self>,
        id: ConnectionId,
        addr: String,
        payload: Vec<u8>,
    ) {
        let result = self.accept(id, &addr, &payload).await;
        let answer = match &result {
            Ok((t, ep, _)) => DpFrame::with_endpoint(
                self.incarnation,
                ep.clone(),
                t.session.as_ref(),
                Exchange::Answer,
            ),
            Err(e) => Ok(DpFrame {
                incarnation: self.incarnation,
                error: Some(e.to_string()),
                ..DpFrame::default()
            }),
        };
        let sent = match answer.and_then(|a| frames::encode("an endpoint answer", &a)) {
            Ok(frame) => self
                .control
                .notify(id, DP_ANSWER, frame)
                .await
                .map_err(Error::from),
            Err(e) => Err(e),
        };
        match (result, sent) {
            (Ok((t, _, reached)), Ok(())) => self.report(&t, Role::Acceptor, reached),
            (Ok((t, _, _)), Err(e)) => {
                warn!(peer = %id, %addr, error = %e, "could not answer an endpoint offer");
                self.detach(id, "answer not delivered");
                self.report(&t, Role::Acceptor, Err(e));
            }
            (Err(e), _) => {
                warn!(peer = %id, %addr, error = %e, "refused an endpoint offer");
                self.emit(
                    id,
                    addr,
                    PeerEventKind::Refused {
                        reason: e.to_string(),
                    },
                );
            }
        }
    }

    /// Connects to an offer. Returns the connection, the endpoint to
    /// answer with, and whether this side reached the offered endpoint:
    /// when it did not (the dialer's data plane listens where this host
    /// cannot go, or on another host than its control connection), the
    /// answer still goes out, so that the dialer can initiate, and the
    /// prepared peer is kept as the entry's `served_peer` (`install`).
    async fn accept(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: &str,
        payload: &[u8],
    ) -> Result<(Target, Endpoint, Result<(), Error>), Error> {
        let offer: DpFrame = frames::decode("an endpoint offer", addr, payload)?;
        let t = {
            let peers = lock(&self.peers);
            let e = peers
                .get(&id)
                .ok_or_else(|| refused(format!("{addr}: offer before handshake")))?;
            if e.incarnation != offer.incarnation {
                return Err(refused(format!(
                    "{addr}: offer from incarnation {:#x}, handshake was with {:#x}",
                    offer.incarnation, e.incarnation
                )));
            }
            Target::of(id, addr.to_owned(), e)
        };
        let remote = offer
            .open(t.session.as_ref(), addr, Exchange::Offer)?
            .ok_or_else(|| refused(format!("{addr} offered no endpoint")))?;
        let (peer, endpoint) = self
            .off_thread(|tr| tr.with_backend(|b| b.prepare_peer()))
            .await?;
        let reached = match self.dialable(&t, &remote) {
            Ok(remote) => {
                let regions = t.regions();
                self.off_thread(move |tr| {
                    let connecting =
                        tr.with_backend(|b| b.start_connect(peer, &remote, &regions))?;
                    let connected = connecting.run()?;
                    tr.with_backend(|b| b.finish_connect(peer, connected))
                })
                .await
            }
            Err(e) => Err(e),
        };
        self.install(&t, peer, reached.is_ok())?;
        Ok((t, endpoint, reached))
    }

    /// Routes an answer to the offer waiting for it.
    pub(crate) fn on_answer(&self, id: ConnectionId, addr: &str, payload: &[u8]) {
        match frames::decode::<DpFrame>("an endpoint answer", addr, payload) {
            Ok(answer) => match lock(&self.offers).remove(&id) {
                Some(tx) => {
                    let _ = tx.send(answer);
                }
                None => debug!(peer = %id, "endpoint answer without a pending offer"),
            },
            Err(e) => warn!(peer = %id, error = %e, "dropping an endpoint answer"),
        }
    }

    /// Installs a data-plane peer unless the connection changed (died,
    /// restarted, closed) since the attach began. What the handshake said
    /// is already in the entry (`on_ready` recorded it in the same
    /// generation). A peer that is not `connected` (prepared only, see
    /// `accept`) is kept as the entry's `served_peer`: what it issued lets
    /// the other side reach us.
    fn install(&self, t: &Target, data_peer: PeerId, connected: bool) -> Result<(), Error> {
        // The backend that carries this peer (shm or the network, under
        // `Auto`), for its metrics' `rail` label; read before the peers'
        // lock, never under it.
        let kind = connected.then(|| {
            self.transport
                .with_backend(|b| b.peer_kind(data_peer))
                .as_str()
        });
        let mut peers = lock(&self.peers);
        let Some(entry) = peers
            .get_mut(&t.id)
            .filter(|e| e.generation == t.generation)
        else {
            drop(peers);
            self.transport.with_backend(|b| b.remove_peer(data_peer));
            return Err(Error::msg(
                ErrorKind::PeerLost,
                format!(
                    "{} ({}) died or restarted while its data plane was being connected",
                    t.addr, t.id
                ),
            ));
        };
        // Where the new data peer goes, if anywhere. Unconnected (prepared
        // only): the served peer, unless there is one. A second attach in
        // the same generation (a repeated Ready): the data peer in use
        // stays, with the transfers in flight on it (replacing it would
        // fail them with "peer removed"); with per-peer endpoints the
        // other side may already use what the new one issued (its answer
        // went out), so it is kept as the served peer until the
        // generation ends.
        let repeated = connected && entry.data_peer.is_some();
        let slot = if !connected || repeated {
            let keep = !connected || self.per_peer;
            (keep && entry.served_peer.is_none()).then_some(&mut entry.served_peer)
        } else {
            Some(&mut entry.data_peer)
        };
        match slot {
            Some(slot) => {
                *slot = Some(data_peer);
                lock(&self.by_data_peer).insert(data_peer, t.id);
                if let (Some(kind), false) = (kind, !connected || repeated) {
                    if let Some(m) = entry.metrics.as_mut().filter(|m| m.rail() != kind) {
                        *m = m.on_rail(kind);
                    }
                }
            }
            None => {
                drop(peers);
                if repeated {
                    debug!(peer = %t.id, "second attach in one generation: the first data peer stays");
                }
                self.transport.with_backend(|b| b.remove_peer(data_peer));
            }
        }
        Ok(())
    }

    /// Publishes an attach's outcome to `connect` and as a peer event.
    fn report(&self, t: &Target, role: Role, r: Result<(), Error>) {
        match r {
            Ok(()) => {
                self.set_attach(t.id, t.incarnation, Ok(()));
                self.emit(
                    t.id,
                    t.addr.clone(),
                    PeerEventKind::Up {
                        engine_id: t.engine_id.clone(),
                        incarnation: t.incarnation,
                    },
                );
            }
            Err(e) if !self.is_current(t) => {
                // The connection died, restarted or closed meanwhile, and
                // its own event said so: no second, misleading `Refused`.
                // Only a waiting `connect` still gets the outcome.
                debug!(peer = %t.id, error = %e, "attach of an ended connection dropped");
                self.set_attach(t.id, t.incarnation, Err((e.kind(), with_causes(&e))));
            }
            Err(e) => self.attach_failed(t.id, &t.addr, &t.engine_id, t.incarnation, role, e),
        }
    }

    /// Whether `t`'s connection is still in the generation its attach
    /// began in.
    fn is_current(&self, t: &Target) -> bool {
        lock(&self.peers)
            .get(&t.id)
            .is_some_and(|e| e.generation == t.generation)
    }

    /// An attach that failed.
    ///
    /// A peer that dialed us and whose data plane cannot be reached from
    /// here (it listens on loopback on another host, say) is still up: it
    /// can move bytes to and from our memory, only we cannot initiate.
    /// That is said once at `info`, not as a refusal. Otherwise the peer
    /// is `Refused`; `connect` (which reads this outcome) then closes the
    /// connection, so that the next `connect` dials afresh.
    fn attach_failed(
        &self,
        id: ConnectionId,
        addr: &str,
        engine_id: &str,
        incarnation: u64,
        role: Role,
        e: Error,
    ) {
        let reason = with_causes(&e);
        self.set_attach(id, incarnation, Err((e.kind(), reason.clone())));
        if role == Role::Acceptor && e.kind() == ErrorKind::Io {
            info!(peer = %id, engine = %engine_id, %reason,
                "peer is up; its data plane cannot be reached from here, so transfers go only from it to us");
            let kind = PeerEventKind::Up {
                engine_id: engine_id.to_owned(),
                incarnation,
            };
            return self.emit(id, addr.to_owned(), kind);
        }
        warn!(peer = %id, %addr, ?role, %reason, "peer is up but its data plane is not");
        self.emit(id, addr.to_owned(), PeerEventKind::Refused { reason });
    }

    /// Detaches `id` and closes its control connection. Idempotent.
    pub(crate) async fn release(&self, id: ConnectionId) {
        self.detach(id, "its data plane could not be attached");
        let _ = self.control.disconnect(id).await;
    }

    fn set_attach(
        &self,
        id: ConnectionId,
        incarnation: u64,
        result: Result<(), (ErrorKind, String)>,
    ) {
        if let Some(e) = lock(&self.peers).get(&id) {
            e.attach.send_replace(Attach::Done {
                incarnation,
                result,
            });
        }
    }

    /// Drops a peer's data-plane connection (its in-flight transfers fail
    /// with `PeerLost`) and ends the connection's current generation.
    pub(crate) fn detach(&self, id: ConnectionId, why: &str) {
        let old = {
            let mut peers = lock(&self.peers);
            peers.get_mut(&id).map(|e| {
                e.generation += 1;
                let old = [e.data_peer.take(), e.served_peer.take()];
                let mut index = lock(&self.by_data_peer);
                for pid in old.iter().flatten() {
                    index.remove(pid);
                }
                old
            })
        };
        lock(&self.offers).remove(&id);
        for old in old.into_iter().flatten().flatten() {
            // With per-peer endpoints this also revokes what the peer was
            // issued (its tcp credential): its connections to us close.
            debug!(peer = %id, why, "detaching data plane");
            self.transport.with_backend(|b| b.remove_peer(old));
        }
    }

    /// Runs `f` on a blocking thread (dials wait on the network; the
    /// transport holds its backend only for the short steps).
    async fn off_thread<R: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Transport) -> Result<R, DataError> + Send + 'static,
    ) -> Result<R, Error> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this.transport))
            .await
            .map_err(|e| Error::msg(ErrorKind::Io, format!("data-plane task: {e}")))?
            .map_err(Error::from)
    }
}

/// A connection's place in [`Inner::accepting`], freed when the task that
/// accepts its offers ends without freeing it (it panicked).
struct AcceptSlot<'a> {
    inner: &'a Inner,
    id: ConnectionId,
    armed: bool,
}

impl Drop for AcceptSlot<'_> {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.inner.accepting).remove(&self.id);
        }
    }
}
