//! Attaching the data plane to a peer whose control handshake completed.
//!
//! Backends with one endpoint for all peers (tcp, loopback) advertise it in
//! the handshake, and each side connects on `Ready`. Backends that need an
//! endpoint per peer (verbs: a queue pair per peer) exchange endpoints over
//! the control connection once it is ready: the side that dialed sends an
//! offer (`DP_OFFER`), the other side connects to it and answers with its
//! own endpoint (`DP_ANSWER`), and the dialer connects to that. Both steps
//! are bounded by the handshake deadline.
//!
//! Every attachment is tied to a generation of its connection: a `Dead`,
//! `Restarted` or `Closed` event bumps it, and an attachment that finishes
//! after that is dropped instead of installed, so no transfer goes out on a
//! data-plane peer of an older life of the connection.

use crate::agent::{lock, DataPlaneInfo, Inner, KvAdvert, PeerEventKind};
use crate::error::{Error, ErrorKind};
use crate::peer::PeerEntry;
use kvlane_control::{ConnectionId, RemoteInfo};
use kvlane_data::{DataError, Endpoint, PeerId, RemoteRegion};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tracing::{debug, warn};

/// Control-plane notification id of an endpoint offer.
pub(crate) const DP_OFFER: u64 = u64::MAX - 1;
/// Control-plane notification id of the answer to an offer.
pub(crate) const DP_ANSWER: u64 = u64::MAX - 2;

/// Offer or answer of a per-peer endpoint exchange.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct DpFrame {
    /// Incarnation of the sender.
    pub(crate) incarnation: u64,
    /// The sender's endpoint for this connection.
    pub(crate) endpoint: Option<Endpoint>,
    /// Why the sender could not connect (answers only).
    pub(crate) error: Option<String>,
}

fn refused(msg: String) -> Error {
    Error::msg(ErrorKind::Refused, msg)
}

impl Inner {
    fn conn_lock(&self, id: ConnectionId) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.conn_locks).entry(id).or_default().clone()
    }

    /// Attaches the data plane for `connect`/`connect_group`.
    pub(crate) async fn attach(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: &str,
        info: &RemoteInfo,
    ) -> Result<(), Error> {
        if self.per_peer {
            self.record_remote(id, addr, info)?;
            self.dial_exchange(id, addr).await
        } else {
            self.attach_shared(id, addr, info).await
        }
    }

    /// Records what the handshake told us (per-peer mode, before the
    /// endpoint exchange).
    pub(crate) fn record_remote(
        &self,
        id: ConnectionId,
        addr: &str,
        info: &RemoteInfo,
    ) -> Result<(), Error> {
        let dp = decode_blob(addr, info)?;
        let mut peers = lock(&self.peers);
        let entry = peers.entry(id).or_insert_with(PeerEntry::new);
        entry.engine_id.clone_from(&info.engine_id);
        entry.incarnation = info.incarnation;
        entry.kv = dp.kv;
        Ok(())
    }

    /// Connects to the endpoint the peer advertised in its handshake.
    /// Idempotent per (connection, incarnation).
    pub(crate) async fn attach_shared(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: &str,
        info: &RemoteInfo,
    ) -> Result<(), Error> {
        let conn = self.conn_lock(id);
        let _serial = conn.lock().await;
        let generation = {
            let peers = lock(&self.peers);
            match peers.get(&id) {
                Some(e) if e.incarnation == info.incarnation && e.data_peer.is_some() => {
                    return Ok(())
                }
                Some(e) => e.generation,
                None => 0,
            }
        };
        let dp = decode_blob(addr, info)?;
        let endpoint = dp.endpoint.clone().ok_or_else(|| {
            refused(format!(
                "{addr} uses a backend with per-peer endpoints (verbs); this agent's backend \
                 cannot reach it"
            ))
        })?;
        let regions: Vec<RemoteRegion> = dp.kv.iter().map(|k| k.region).collect();
        let (data_peer, _) = self
            .blocking(move |b| prepare_and_connect(b, &endpoint, &regions))
            .await?;
        self.install(
            id,
            generation,
            info.incarnation,
            &info.engine_id,
            dp.kv,
            data_peer,
        )
    }

    /// Per-peer mode, dialing side: offer an endpoint, connect to the answer.
    pub(crate) async fn dial_exchange(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: &str,
    ) -> Result<(), Error> {
        let conn = self.conn_lock(id);
        let _serial = conn.lock().await;
        let (generation, incarnation, engine_id, kv) = {
            let peers = lock(&self.peers);
            let e = peers
                .get(&id)
                .ok_or_else(|| refused(format!("{addr}: no handshake recorded")))?;
            if e.data_peer.is_some() {
                return Ok(());
            }
            (
                e.generation,
                e.incarnation,
                e.engine_id.clone(),
                e.kv.clone(),
            )
        };
        let (peer, endpoint) = self.blocking(|b| b.prepare_peer()).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.offers).insert(id, tx);
        let result = async {
            let offer = DpFrame {
                incarnation: self.incarnation,
                endpoint: Some(endpoint),
                error: None,
            };
            self.control.notify(id, DP_OFFER, encode(&offer)?).await?;
            let answer = tokio::time::timeout(self.exchange_timeout, rx)
                .await
                .map_err(|_| {
                    Error::msg(
                        ErrorKind::Timeout,
                        format!(
                            "{addr} did not answer the endpoint offer within {:?}",
                            self.exchange_timeout
                        ),
                    )
                })?
                .map_err(|_| {
                    Error::msg(
                        ErrorKind::PeerLost,
                        format!("{addr}: connection ended during the endpoint exchange"),
                    )
                })?;
            let remote = match (answer.endpoint, answer.error) {
                (Some(ep), _) => ep,
                (None, e) => {
                    return Err(refused(format!(
                        "{addr} could not connect to our endpoint: {}",
                        e.unwrap_or_else(|| "no reason given".into())
                    )))
                }
            };
            let regions: Vec<RemoteRegion> = kv.iter().map(|k| k.region).collect();
            self.blocking(move |b| b.connect_peer(peer, &remote, &regions))
                .await
        }
        .await;
        lock(&self.offers).remove(&id);
        match result {
            Ok(()) => self.install(id, generation, incarnation, &engine_id, kv, peer),
            Err(e) => {
                self.transport.with_backend(|b| b.remove_peer(peer));
                Err(e)
            }
        }
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
            Ok((_, endpoint)) => DpFrame {
                incarnation: self.incarnation,
                endpoint: Some(endpoint.clone()),
                error: None,
            },
            Err(e) => DpFrame {
                incarnation: self.incarnation,
                endpoint: None,
                error: Some(e.to_string()),
            },
        };
        let sent = match encode(&answer) {
            Ok(frame) => self
                .control
                .notify(id, DP_ANSWER, frame)
                .await
                .map_err(Error::from),
            Err(e) => Err(e),
        };
        match (result, sent) {
            (Ok((kind, _)), Ok(())) => self.emit(id, addr, kind),
            (Ok(_), Err(e)) => {
                warn!(peer = %id, %addr, error = %e, "could not answer an endpoint offer");
                self.detach(id, "answer not delivered");
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

    async fn accept(
        self: &Arc<Self>,
        id: ConnectionId,
        addr: &str,
        payload: &[u8],
    ) -> Result<(PeerEventKind, Endpoint), Error> {
        let offer: DpFrame = rmp_serde::from_slice(payload).map_err(|e| {
            refused(format!(
                "{addr} sent an endpoint offer that does not decode: {e}"
            ))
        })?;
        let remote = offer
            .endpoint
            .ok_or_else(|| refused(format!("{addr} offered no endpoint")))?;
        let conn = self.conn_lock(id);
        let _serial = conn.lock().await;
        let (generation, incarnation, engine_id, kv) = {
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
            (
                e.generation,
                e.incarnation,
                e.engine_id.clone(),
                e.kv.clone(),
            )
        };
        let regions: Vec<RemoteRegion> = kv.iter().map(|k| k.region).collect();
        let (peer, endpoint) = self
            .blocking(move |b| prepare_and_connect(b, &remote, &regions))
            .await?;
        self.install(id, generation, incarnation, &engine_id, kv, peer)?;
        Ok((
            PeerEventKind::Up {
                engine_id,
                incarnation,
            },
            endpoint,
        ))
    }

    /// Routes an answer to the offer waiting for it.
    pub(crate) fn on_answer(&self, id: ConnectionId, payload: &[u8]) {
        match rmp_serde::from_slice::<DpFrame>(payload) {
            Ok(answer) => match lock(&self.offers).remove(&id) {
                Some(tx) => {
                    let _ = tx.send(answer);
                }
                None => debug!(peer = %id, "endpoint answer without a pending offer"),
            },
            Err(e) => {
                warn!(peer = %id, error = %e, "dropping an endpoint answer that does not decode")
            }
        }
    }

    /// Installs a connected data-plane peer unless the connection changed
    /// (died, restarted, closed) since `generation`.
    fn install(
        &self,
        id: ConnectionId,
        generation: u64,
        incarnation: u64,
        engine_id: &str,
        kv: Vec<KvAdvert>,
        data_peer: PeerId,
    ) -> Result<(), Error> {
        let mut peers = lock(&self.peers);
        let entry = peers.entry(id).or_insert_with(PeerEntry::new);
        if entry.generation != generation {
            drop(peers);
            self.transport.with_backend(|b| b.remove_peer(data_peer));
            return Err(Error::msg(
                ErrorKind::PeerLost,
                format!("{id} died or restarted while its data plane was being connected"),
            ));
        }
        let old = entry.data_peer.replace(data_peer);
        entry.incarnation = incarnation;
        entry.engine_id = engine_id.to_owned();
        entry.kv = kv;
        drop(peers);
        if let Some(old) = old {
            self.transport.with_backend(|b| b.remove_peer(old));
        }
        Ok(())
    }

    /// Drops a peer's data-plane connection (its in-flight transfers fail
    /// with `PeerLost`) and ends the connection's current generation.
    pub(crate) fn detach(&self, id: ConnectionId, why: &str) {
        let old = {
            let mut peers = lock(&self.peers);
            peers.get_mut(&id).and_then(|e| {
                e.generation += 1;
                e.data_peer.take()
            })
        };
        lock(&self.offers).remove(&id);
        if let Some(old) = old {
            debug!(peer = %id, why, "detaching data plane");
            self.transport.with_backend(|b| b.remove_peer(old));
        }
    }

    /// Runs `f` on the backend off the async threads (connecting may open
    /// sockets or create queue pairs).
    async fn blocking<R: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut dyn kvlane_data::Backend) -> Result<R, DataError> + Send + 'static,
    ) -> Result<R, Error> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.transport.with_backend(f))
            .await
            .map_err(|e| Error::msg(ErrorKind::Io, format!("data-plane task: {e}")))?
            .map_err(Error::from)
    }
}

/// A new data-plane peer connected to `remote`; returns it with this side's
/// endpoint for it. Nothing is left behind when connecting fails.
fn prepare_and_connect(
    b: &mut dyn kvlane_data::Backend,
    remote: &Endpoint,
    regions: &[RemoteRegion],
) -> Result<(PeerId, Endpoint), DataError> {
    let (peer, endpoint) = b.prepare_peer()?;
    if let Err(e) = b.connect_peer(peer, remote, regions) {
        b.remove_peer(peer);
        return Err(e);
    }
    Ok((peer, endpoint))
}

fn decode_blob(addr: &str, info: &RemoteInfo) -> Result<DataPlaneInfo, Error> {
    rmp_serde::from_slice(&info.data_plane).map_err(|e| {
        refused(format!(
            "{addr} sent a data-plane description that does not decode: {e}"
        ))
    })
}

fn encode(frame: &DpFrame) -> Result<Vec<u8>, Error> {
    rmp_serde::to_vec_named(frame).map_err(|e| {
        Error::msg(
            ErrorKind::InvalidInput,
            format!("encode endpoint frame: {e}"),
        )
    })
}
