//! The agent's shared state. `agent` (the builder and the event task),
//! `attach` (each connection's data plane) and `peer` (transfers) all work
//! on it, so it lives here rather than in one of them.

use crate::error::{Error, ErrorKind};
use crate::events::{Notification, PeerEvent, PeerEventKind};
use crate::frames::{DataPlaneInfo, DpFrame, KvAdvert};
use crate::metrics::PeerMetrics;
use crate::spans::MemSpan;
use kvlane_control::{ConnectionId, ControlNode};
use kvlane_data::{Descriptor, FastMap, KvLayout, Op, PeerId, Region, RemoteRegion, Transport};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// Who sent a notification, as the transport (never the payload) tells.
pub(crate) enum Sender {
    /// The engine id of the connection it came on.
    Engine(String),
    /// A sender that maps to no connection (named for the log).
    Unknown(String),
    /// The backend cannot tell its senders apart (loopback).
    Untold,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An endpoint offer waiting for its connection's earlier one to be
/// accepted: the peer's address and the offer's payload.
pub(crate) type WaitingOffer = (String, Vec<u8>);

/// A KV cache this agent registered.
pub(crate) struct LocalKv {
    pub(crate) layout: KvLayout,
    pub(crate) region: Region,
}

/// Where a connection's data plane stands. `connect` waits on it; the
/// Ready path (the one place an attach starts) moves it on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Attach {
    /// No handshake has finished.
    Idle,
    /// The handshake with `incarnation` finished; the data plane is being
    /// connected.
    Pending {
        /// The incarnation being attached.
        incarnation: u64,
    },
    /// Attaching to `incarnation` ended with `result`.
    Done {
        /// The incarnation attached.
        incarnation: u64,
        /// Its outcome (an [`Error`] is not `Clone`: kind and message).
        result: Result<(), (ErrorKind, String)>,
    },
}

/// What the agent knows of one connection.
pub(crate) struct PeerEntry {
    pub(crate) engine_id: String,
    pub(crate) incarnation: u64,
    /// Data-plane peer of the current incarnation; `None` while dead,
    /// attaching, or when the peer's data plane cannot be reached from here.
    pub(crate) data_peer: Option<PeerId>,
    /// Per-peer endpoints (tcp, verbs): the data-plane peer prepared for a
    /// peer whose endpoint this side could not reach. It holds what the
    /// peer presents to reach us (its tcp credential), so the peer can
    /// still initiate; dropped (revoked) with the generation.
    pub(crate) served_peer: Option<PeerId>,
    /// The host the control connection is with (the address dialed, or
    /// an inbound connection's source): data endpoints are dialed there.
    pub(crate) peer_host: Option<std::net::IpAddr>,
    /// The control session's secret (keyed handshakes only): per-peer
    /// endpoints are sealed under it.
    pub(crate) session: Option<kvlane_control::SessionKey>,
    pub(crate) kv: Vec<KvAdvert>,
    /// Plain regions the peer advertised (span transfers).
    pub(crate) regions: Vec<RemoteRegion>,
    /// Bumped whenever the data-plane peer is dropped (dead, restarted,
    /// closed); attachments begun in an older generation are discarded.
    pub(crate) generation: u64,
    pub(crate) attach: watch::Sender<Attach>,
    /// Records this peer's ended transfers; made when its engine id is
    /// learnt (`None` before).
    pub(crate) metrics: Option<Arc<PeerMetrics>>,
}

impl PeerEntry {
    pub(crate) fn new() -> Self {
        Self {
            engine_id: String::new(),
            incarnation: 0,
            data_peer: None,
            served_peer: None,
            peer_host: None,
            session: None,
            kv: Vec::new(),
            regions: Vec::new(),
            generation: 0,
            attach: watch::Sender::new(Attach::Idle),
            metrics: None,
        }
    }

    /// Why there is no data-plane peer, when attaching it failed.
    pub(crate) fn attach_error(&self) -> Option<Error> {
        match &*self.attach.borrow() {
            Attach::Done {
                incarnation,
                result: Err((kind, msg)),
            } if *incarnation == self.incarnation => Some(Error::msg(*kind, msg.clone())),
            _ => None,
        }
    }
}

pub(crate) struct Inner {
    pub(crate) engine_id: String,
    pub(crate) incarnation: u64,
    pub(crate) control: ControlNode,
    pub(crate) transport: Transport,
    pub(crate) kv: Vec<LocalKv>,
    /// Plain regions registered for span transfers (at build, then by
    /// [`Agent::register_region`](crate::Agent::register_region)).
    pub(crate) regions: RwLock<Vec<Region>>,
    /// What the handshake advertises; [`Agent::register_region`](crate::Agent::register_region)
    /// adds to it. An async lock: registrations install their blob in
    /// the control node in the order they took it.
    pub(crate) advert: tokio::sync::Mutex<DataPlaneInfo>,
    pub(crate) peers: Mutex<FastMap<ConnectionId, PeerEntry>>,
    /// Data-plane peer -> the connection whose `data_peer` or
    /// `served_peer` it is (what a data-plane notification's sender is
    /// looked up by). Written under the `peers` lock, with the entry.
    pub(crate) by_data_peer: Mutex<FastMap<PeerId, ConnectionId>>,
    pub(crate) events: broadcast::Sender<PeerEvent>,
    pub(crate) notifications: Mutex<Option<mpsc::Receiver<Notification>>>,
    /// Bounded ([`AgentBuilder::notification_capacity`](crate::AgentBuilder::notification_capacity)):
    /// a notification that finds the queue full is dropped and counted.
    pub(crate) note_tx: mpsc::Sender<Notification>,
    pub(crate) notes_dropped: AtomicU64,
    /// Notifications refused because their frame named another sender
    /// than the peer they came from, or their sender maps to no connection.
    pub(crate) notes_refused: AtomicU64,
    /// Dial data endpoints on any host, not only on the host of the
    /// control connection (see the `dial` module).
    pub(crate) dial_any_data_host: bool,
    /// Each transfer's deadline, from its post.
    pub(crate) transfer_deadline: Duration,
    /// The largest control-plane notification (`Config::notify_cap`): what
    /// a READ's notification, sent there after the data, may be.
    pub(crate) notify_cap: usize,
    /// Rails of this agent's data plane (1 for one device): how many of a
    /// peer's rails it pairs.
    pub(crate) data_rails: usize,
    pub(crate) tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The runtime the agent was built on (posts from plain threads use it).
    pub(crate) runtime: tokio::runtime::Handle,
    /// The backend needs an endpoint per peer (verbs): exchanged over the
    /// control connection after the handshake.
    pub(crate) per_peer: bool,
    /// Endpoint offers waiting for their answer.
    pub(crate) offers: Mutex<HashMap<ConnectionId, oneshot::Sender<DpFrame>>>,
    /// Connections whose endpoint offer is being accepted (one at a time
    /// per connection: each holds a blocking thread while it dials), with
    /// the newest offer that arrived meanwhile, taken up next.
    pub(crate) accepting: Mutex<FastMap<ConnectionId, Option<WaitingOffer>>>,
    /// Endpoint offers dropped because a newer one from the same
    /// connection arrived while an earlier one was being accepted.
    pub(crate) offers_dropped: AtomicU64,
    /// Bound of one endpoint exchange.
    pub(crate) exchange_timeout: Duration,
    /// Bound of `connect` waiting for the data plane after the handshake
    /// (every attach step is bounded on its own; this one is the net
    /// under them).
    pub(crate) attach_timeout: Duration,
    /// What the agent moved and how it went (`Agent::metrics`).
    pub(crate) metrics: crate::metrics::Metrics,
    /// The `rail` label of this agent's transfers (its backend; one rail
    /// per agent until multi-rail).
    pub(crate) rail: &'static str,
    /// The control driver's counters, refreshed about once a second for
    /// `Agent::metrics` (which cannot wait on the driver).
    pub(crate) control_stats: Mutex<kvlane_control::Stats>,
    /// Set when [`Agent::close`](crate::Agent::close) starts: a `connect`
    /// in flight then fails at once with `Closed` instead of waiting out
    /// its attempts or the attach timeout.
    pub(crate) closing: watch::Sender<bool>,
}

impl Inner {
    /// Resolves local spans against every local registration (KV caches,
    /// then plain regions).
    pub(crate) fn resolve_local(
        &self,
        spans: &[MemSpan],
        op: Op,
    ) -> Result<Vec<Descriptor>, Error> {
        let plain = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let all: Vec<&Region> = self
            .kv
            .iter()
            .map(|k| &k.region)
            .chain(plain.iter())
            .collect();
        crate::spans::resolve_local(&all, spans, op)
    }

    /// A notification that came over the data plane. When the backend
    /// names the data-plane peer it came from, that peer's connection is
    /// the sender: a peer that maps to no connection (detached, closed,
    /// never paired) vouches for no name, so its notification is refused
    /// and counted, and a frame that names another engine than the
    /// connection's is refused too (a peer cannot speak for another
    /// engine). A backend that cannot tell senders apart (loopback: its
    /// peers are in this process) leaves the frame's name as it is.
    pub(crate) fn deliver_data(&self, n: kvlane_data::Notification) {
        let sender = match n.from {
            None => Sender::Untold,
            Some(pid) => {
                let id = lock(&self.by_data_peer).get(&pid).copied();
                let engine = id.and_then(|id| {
                    lock(&self.peers)
                        .get(&id)
                        .filter(|e| e.data_peer == Some(pid) || e.served_peer == Some(pid))
                        .map(|e| e.engine_id.clone())
                });
                match engine {
                    Some(e) => Sender::Engine(e),
                    None => Sender::Unknown(pid.to_string()),
                }
            }
        };
        self.deliver_from(n.payload.to_vec(), sender, "data-plane");
    }

    /// Delivers a notification from `sender`, over the `plane` it came
    /// by, or refuses and counts it
    /// ([`Agent::notifications_refused`](crate::Agent::notifications_refused)):
    /// from a sender that maps to no connection (or to one without an
    /// engine id), or naming another engine than its sender's (one peer
    /// cannot speak for another). Never delivered under a name nobody
    /// vouches for.
    pub(crate) fn deliver_from(&self, payload: Vec<u8>, sender: Sender, plane: &str) {
        let note = match sender {
            Sender::Engine(engine) if !engine.is_empty() => {
                let note = crate::frames::notification(payload, || engine.clone());
                if note.from != engine {
                    return self.refuse_note(plane, &note.from, &engine, "names another sender");
                }
                note
            }
            Sender::Engine(_) => {
                return self.refuse_note(plane, "", "a peer without an engine id", "no sender");
            }
            Sender::Unknown(who) => {
                let note = crate::frames::notification(payload, String::new);
                return self.refuse_note(
                    plane,
                    &note.from,
                    &who,
                    "its sender maps to no connection",
                );
            }
            Sender::Untold => {
                crate::frames::notification(payload, || "a data-plane peer".to_owned())
            }
        };
        self.deliver(note);
    }

    fn refuse_note(&self, plane: &str, claimed: &str, sender: &str, why: &str) {
        let refused = self.notes_refused.fetch_add(1, Ordering::AcqRel) + 1;
        debug!(
            claimed,
            sender, refused, plane, why, "refused a notification"
        );
    }

    /// Queues a notification for the user, or drops and counts it when the
    /// queue is full (the user is not reading): never waits, so neither the
    /// control loop nor the data plane's completion path is held up. The
    /// first drop and every 1,000th after it are logged.
    pub(crate) fn deliver(&self, note: Notification) {
        if let Err(mpsc::error::TrySendError::Full(n)) = self.note_tx.try_send(note) {
            let dropped = self.notes_dropped.fetch_add(1, Ordering::AcqRel) + 1;
            if dropped % 1000 == 1 {
                warn!(
                    dropped,
                    capacity = self.note_tx.max_capacity(),
                    from = %n.from,
                    "notification queue full (notifications are not being read); dropping"
                );
            }
        }
    }

    pub(crate) fn emit(&self, peer: ConnectionId, addr: String, kind: PeerEventKind) {
        debug!(%peer, %addr, ?kind, "peer event");
        let _ = self.events.send(PeerEvent { peer, addr, kind });
    }
}
