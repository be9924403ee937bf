//! Several backends of one kind used as rails of one: every NIC of a node.
//!
//! [`Rails`] is a [`Backend`] over a list of backends of the same kind,
//! one per device (an RDMA device each, or a tcp backend per network).
//!
//! - **Endpoints.** A peer gets one endpoint that carries every rail's
//!   endpoint and, for each rail past the first, the keys that rail serves
//!   each region under. The first rail's endpoint stays readable alone, so a
//!   single-rail peer ([`Endpoint::primary`]) pairs rail 0 only; two
//!   multi-rail peers pair as many rails as both have.
//! - **Striping.** A transfer smaller than [`RailsConfig::stripe_min`], or
//!   with a notification, goes whole on one rail, rotating; a larger one is
//!   cut into one contiguous byte range per usable rail. Its completion is
//!   reported once every part landed.
//! - **Failure.** A part that fails on a rail with the peer lost, an I/O
//!   error, an RDMA work completion error (its queue pair is in ERROR) or
//!   a part timeout is posted again on another rail of that peer
//!   (READ and WRITE of the same bytes are idempotent), until its deadline.
//!   The rail's connection to that peer is dropped at once, so that bytes
//!   it still holds never land after the part was posted elsewhere. With
//!   no rail left the transfer fails with the last error.
//! - **Notifications, at most once.** A part with a notification moves
//!   whole, and its NOTIFY may have reached the peer over the rail that
//!   failed: between two rails endpoints every notification carries a tag
//!   per transfer, and the receiver hands each tag to the application once
//!   (`rails/notes.rs` describes the tag and the receiver's bounded
//!   memory). To a peer that cannot de-duplicate (an older version) a
//!   part with a notification is never posted twice.
//! - **Link state.** Each rail's [`Backend::link_up`] (verbs: the port is
//!   ACTIVE) is read about every [`LINK_POLL`]. A rail whose link goes down
//!   gets no new work and drops its connections at once (their parts move
//!   to the other rails); it is paired again only once its link is up.
//! - **Recovery.** After [`RailsConfig::retry_after`] a lost rail is paired
//!   again. A rail whose endpoint is reusable (tcp) dials the peer's
//!   endpoint again; a rail whose endpoints are per peer (verbs: a queue
//!   pair in error needs a new queue pair, and the peer a new one too)
//!   exchanges new endpoints with the peer over another rail that still
//!   works, without the control plane (`rails/rejoin.rs` describes the
//!   protocol and what it checks). Either way a rail is back in use
//!   once it is connected again ([`RailStats::rejoins`] counts the
//!   exchanges). An exchange needs another rail to that peer that works
//!   and a peer of this version (its endpoint carries a token): a verbs
//!   rail to a peer reached over that rail alone, or to an older peer,
//!   stays set aside until the peer is connected again through the
//!   control plane.
//!
//! - **Nearest rails.** A region can be given the rails nearest to its
//!   memory ([`Rails::prefer`]; the agent does it for GPU regions from the
//!   PCIe topology, [`Topology::nearest_rails`](crate::topology::Topology::nearest_rails)).
//!   A transfer whose local regions all have preferred rails rotates or is
//!   split over those only, while one of them is usable; otherwise over
//!   every usable rail.
//!
//! Per-rail counters: [`Backend::rail_stats`].

use crate::backend::{Backend, Connected, Connecting};
use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId, RemoteKey, TransferId};
use crate::memory::{Region, RemoteRegion};
use crate::transfer::{
    BackendKind, Completion, Descriptor, Descriptors, Endpoint, Notification, RemoteDescriptor,
    RemoteDescriptors, Transfer,
};

mod notes;
mod rejoin;
use rejoin::{Rejoin, Token};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Waker;
use std::time::{Duration, Instant};

/// How [`Rails`] spreads and recovers transfers.
#[derive(Clone, Debug)]
pub struct RailsConfig {
    /// Transfers of at least this many bytes are split over the rails.
    pub stripe_min: u64,
    /// Parts are cut at multiples of this (the last one takes the rest).
    pub stripe_align: u64,
    /// A rail set aside after a failure is tried again after this long.
    pub retry_after: Duration,
    /// A part not done on its rail within `part_timeout` plus its bytes at
    /// `part_min_rate` (bytes per second) is taken as failed there and
    /// posted again on another rail (a link that went silent fails no
    /// socket for minutes). Never past the transfer's own deadline.
    pub part_timeout: Duration,
    /// See `part_timeout`.
    pub part_min_rate: u64,
    /// A re-pairing of a verbs rail by endpoint exchange (module docs)
    /// that is not done within this long is given up and started again
    /// after `retry_after`.
    pub rejoin_timeout: Duration,
}

impl Default for RailsConfig {
    fn default() -> Self {
        Self {
            stripe_min: 256 << 10,
            stripe_align: 4096,
            retry_after: Duration::from_secs(1),
            part_timeout: Duration::from_secs(2),
            part_min_rate: 256 << 20,
            rejoin_timeout: Duration::from_secs(3),
        }
    }
}

/// What one rail carried (from this side's transfers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RailStats {
    /// The rail's name (device or address).
    pub name: String,
    /// Bytes of parts that completed on it.
    pub bytes: u64,
    /// Parts that completed on it.
    pub parts: u64,
    /// Parts that failed on it.
    pub failures: u64,
    /// Parts moved from it to another rail after a failure.
    pub reposts: u64,
    /// Peers for which it is set aside now.
    pub down_peers: u64,
    /// Times it was paired again with a peer by an endpoint exchange over
    /// another rail (verbs; see the module docs), on either side.
    pub rejoins: u64,
    /// Rails messages that arrived on it and were dropped: malformed, from
    /// no known peer, or not matching where that rail's re-pairing stands;
    /// and notifications dropped as duplicates of one already delivered
    /// (or too late to tell, see `rails/notes.rs`).
    pub dropped: u64,
}

/// The endpoint of a multi-rail backend: rail 0's bytes first, so a
/// single-rail peer reads it as its own (see [`Endpoint::primary`]).
#[derive(Serialize, Deserialize)]
struct RailsWire {
    /// `"kvlane-rails"`: tells a rails endpoint from a plain one.
    magic: String,
    rails: Vec<RailWire>,
    /// What the peer names us by in a rejoin message: random, per peer
    /// (absent: an older peer, or rails whose endpoints are reusable).
    #[serde(default)]
    token: Option<Token>,
    /// What this side's notifications to the peer are tagged with as
    /// their sender, random, per peer; it also says that this side takes
    /// tagged notifications (`rails/notes.rs`). Absent: an older peer.
    #[serde(default)]
    note: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct RailWire {
    name: String,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
    /// (rail 0 key, this rail's key) of each region registered so far.
    keys: Vec<(RemoteKey, RemoteKey)>,
}

const MAGIC: &str = "kvlane-rails";

impl Endpoint {
    /// The first rail of a multi-rail endpoint, or this endpoint itself:
    /// what a single-rail backend connects to.
    pub fn primary(&self) -> Self {
        let mut rails = self.rails();
        // `rails` is never empty.
        rails.swap_remove(0)
    }

    /// Every rail of a multi-rail endpoint, in order, or this endpoint
    /// itself: what a backend of as many rails connects to.
    pub fn rails(&self) -> Vec<Self> {
        // A same-host endpoint: the part a peer without shm dials.
        #[cfg(target_os = "linux")]
        if let Some(other) = crate::samehost::other_part(self) {
            return other.rails();
        }
        match decode_rails(self) {
            Some(w) if !w.rails.is_empty() => w
                .rails
                .into_iter()
                .map(|r| Self {
                    backend: self.backend,
                    data: r.data,
                })
                .collect(),
            _ => vec![self.clone()],
        }
    }
}

/// Applies `f` to every rail of a multi-rail endpoint; `None` for a plain
/// endpoint.
pub(crate) fn map_rails(
    e: &Endpoint,
    f: impl Fn(&Endpoint) -> Result<Endpoint, DataError>,
) -> Option<Result<Endpoint, DataError>> {
    let mut w = decode_rails(e)?;
    Some((|| {
        for r in &mut w.rails {
            let one = Endpoint {
                backend: e.backend,
                data: std::mem::take(&mut r.data),
            };
            r.data = f(&one)?.data;
        }
        let data = rmp_serde::to_vec_named(&w).map_err(|err| DataError::BadEndpoint {
            backend: "rails",
            reason: err.to_string(),
        })?;
        Ok(Endpoint {
            backend: e.backend,
            data,
        })
    })())
}

fn decode_rails(e: &Endpoint) -> Option<RailsWire> {
    let w: RailsWire = rmp_serde::from_slice(&e.data).ok()?;
    (w.magic == MAGIC).then_some(w)
}

struct Rail {
    name: String,
    backend: Box<dyn Backend>,
    /// Its link, as last read (see [`LINK_POLL`]).
    up: bool,
    stats: RailStats,
    /// Rail 0 key -> this rail's key, for this side's registrations.
    local_keys: HashMap<RemoteKey, RemoteKey>,
}

struct RailPeer {
    /// This rail's peer id, when the rail is paired with the remote.
    id: Option<PeerId>,
    /// The peer's rail 0 key -> its key on this rail.
    keys: HashMap<RemoteKey, RemoteKey>,
    /// Set aside since, after a failure.
    down_since: Option<Instant>,
    /// The rail's connection to the peer is gone (lost, not just slow):
    /// it is dialed again, not probed with a part.
    lost: bool,
    /// A re-dial is running.
    redialing: bool,
    /// What this rail was connected with, to dial it again.
    remote: Option<(Endpoint, Vec<RemoteRegion>)>,
    /// Where its re-pairing by endpoint exchange stands.
    rejoin: Rejoin,
    /// The epoch of our last offer that was answered and connected (a
    /// repeated answer to it gets Ready again, nothing else).
    joined: Option<u64>,
}

impl RailPeer {
    fn new(id: PeerId) -> Self {
        Self {
            id: Some(id),
            keys: HashMap::new(),
            down_since: None,
            lost: false,
            redialing: false,
            remote: None,
            rejoin: Rejoin::Idle,
            joined: None,
        }
    }
}

impl Rails {
    /// Tells each rail of `peer` the other rails' endpoints of that peer:
    /// a failed connection whose own target address cannot be reached is
    /// fenced through one of them ([`Backend::set_fence_routes`]).
    fn route_fences(&mut self, peer: PeerId) {
        let Some(state) = self.peers.get(&peer) else {
            return;
        };
        let eps: Vec<Option<Endpoint>> = state
            .rails
            .iter()
            .map(|rp| rp.remote.as_ref().map(|(ep, _)| ep.clone()))
            .collect();
        for (i, rp) in state.rails.iter().enumerate() {
            let Some(id) = rp.id else { continue };
            let others: Vec<Endpoint> = eps
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .filter_map(|(_, ep)| ep.clone())
                .collect();
            self.rails[i].backend.set_fence_routes(id, &others);
        }
    }
}

/// A re-dial's outcome: (peer, rail, the new rail peer and its connect).
type Redialed = (PeerId, usize, PeerId, Result<Connected, DataError>);

struct PeerState {
    rails: Vec<RailPeer>,
    /// Our token for this peer (what its rejoin messages name), and its
    /// token for us; both set when the rails' endpoints are per peer.
    token: Option<Token>,
    their_token: Option<Token>,
    /// Our notifications to this peer are tagged, as from `note` (it
    /// de-duplicates them, and more than one rail is paired with it).
    tag_notes: bool,
    /// What we tag our notifications to this peer with as their sender.
    note: u64,
    /// What it tags its notifications to us with.
    their_note: Option<u64>,
    /// The tag of our next notified transfer to it.
    next_tag: u64,
    /// The tags of the notes taken from it.
    seen: notes::Seen,
}

struct Parent {
    peer: PeerId,
    remaining: usize,
    error: Option<DataError>,
}

struct Part {
    parent: TransferId,
    /// Rail-0 form of the part (remote keys of rail 0), for re-posting.
    transfer: Transfer,
    bytes: u64,
    /// Rails this part already failed on.
    tried: u64,
    /// The tag its notification travels with on every rail (see
    /// `rails/notes.rs`); `None` without a notification, or to a peer that
    /// takes plain ones (then the part is never posted twice).
    tag: Option<u64>,
}

/// One rail's share of a batch: per transfer its result slot, its part and
/// the rails it may use; and the rail's transfers, in the same order.
type Share = (Vec<(usize, Part, Vec<usize>)>, Vec<Transfer>);

/// A part no rail took.
struct Unposted {
    part: Box<Part>,
    why: Why,
}

enum Why {
    /// Every usable rail's queue is full.
    Full { in_flight: usize },
    /// Refused (no rail usable, or the rail's own typed refusal).
    Refused(DataError),
}

static NEXT_PEER: AtomicU64 = AtomicU64::new(1 << 62);

/// Several backends of one kind as one (see the module docs).
pub struct Rails {
    rails: Vec<Rail>,
    cfg: RailsConfig,
    peers: HashMap<PeerId, PeerState>,
    parents: HashMap<TransferId, Parent>,
    /// (rail, part id) -> the part.
    parts: HashMap<(usize, TransferId), Part>,
    /// Parts waiting for room on a rail.
    pending: VecDeque<Part>,
    done: Vec<Completion>,
    next: usize,
    scratch: Vec<Completion>,
    redials: (
        std::sync::mpsc::Sender<Redialed>,
        std::sync::mpsc::Receiver<Redialed>,
    ),
    waker: Option<Waker>,
    /// Local region -> the rails preferred for it (bit i: rail i).
    prefer: HashMap<RegionId, u64>,
    /// Our tokens -> the peer each was issued to.
    by_token: HashMap<Token, PeerId>,
    /// The peers' sender ids of their tagged notifications -> the peer.
    by_note: HashMap<u64, PeerId>,
    /// Application notifications taken from the rails, in arrival order.
    notes: VecDeque<Notification>,
    /// Scratch for draining the rails' notifications.
    inbox: Vec<Notification>,
    /// When the links were read last.
    links_read: Option<Instant>,
    /// Epoch of our next rejoin offer.
    epoch: u64,
}

/// How often [`Rails`] reads its rails' link state (one `ibv_query_port`
/// per verbs rail): a link that goes down moves work within about this
/// long, rather than after a part timeout.
pub const LINK_POLL: Duration = Duration::from_millis(100);

impl std::fmt::Debug for Rails {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rails")
            .field(
                "rails",
                &self.rails.iter().map(|r| &r.name).collect::<Vec<_>>(),
            )
            .field("in_flight", &self.parents.len())
            .finish()
    }
}

impl Rails {
    /// Rails over `backends` (named, all of one kind; at least one).
    pub fn new(
        backends: Vec<(String, Box<dyn Backend>)>,
        cfg: RailsConfig,
    ) -> Result<Self, DataError> {
        let Some(kind) = backends.first().map(|(_, b)| b.kind()) else {
            return Err(DataError::Unsupported {
                backend: "rails",
                what: "no rail: give at least one backend",
            });
        };
        if backends.len() > 64 {
            return Err(DataError::Unsupported {
                backend: "rails",
                what: "more than 64 rails",
            });
        }
        if backends.iter().any(|(_, b)| b.kind() != kind) {
            return Err(DataError::Unsupported {
                backend: "rails",
                what: "rails of different backend kinds",
            });
        }
        Ok(Self {
            rails: backends
                .into_iter()
                .map(|(name, backend)| Rail {
                    stats: RailStats {
                        name: name.clone(),
                        ..RailStats::default()
                    },
                    name,
                    backend,
                    up: true,
                    local_keys: HashMap::new(),
                })
                .collect(),
            cfg,
            peers: HashMap::new(),
            parents: HashMap::new(),
            parts: HashMap::new(),
            pending: VecDeque::new(),
            done: Vec::new(),
            next: 0,
            scratch: Vec::new(),
            redials: std::sync::mpsc::channel(),
            waker: None,
            prefer: HashMap::new(),
            by_token: HashMap::new(),
            by_note: HashMap::new(),
            notes: VecDeque::new(),
            inbox: Vec::new(),
            links_read: None,
            epoch: 1,
        })
    }

    /// Prefers `rails` (indices into the rails, as given to
    /// [`new`](Self::new)) for transfers from or to local `region`: the
    /// rails nearest to its memory. Indices past the last rail are
    /// ignored; an empty list (or none in range) removes the preference.
    pub fn prefer(&mut self, region: RegionId, rails: &[usize]) {
        let mask = rails
            .iter()
            .filter(|&&i| i < self.rails.len() && i < 64)
            .fold(0u64, |m, &i| m | 1 << i);
        if mask == 0 {
            self.prefer.remove(&region);
        } else {
            self.prefer.insert(region, mask);
        }
    }

    /// `rails` narrowed to those preferred for every local region of `t`,
    /// when each has a preference and one of them is in `rails`.
    fn preferred(&self, t: &Transfer, rails: Vec<usize>) -> Vec<usize> {
        if self.prefer.is_empty() {
            return rails;
        }
        let mut mask = u64::MAX;
        for d in &t.local {
            match self.prefer.get(&d.region) {
                Some(m) => mask &= m,
                None => return rails,
            }
        }
        let near: Vec<usize> = rails
            .iter()
            .copied()
            .filter(|&i| i < 64 && mask & (1 << i) != 0)
            .collect();
        if near.is_empty() {
            rails
        } else {
            near
        }
    }

    /// The rails a transfer to `peer` with these remote keys can use now:
    /// paired, not set aside (or due for a retry), serving every key.
    fn usable(&self, peer: &PeerState, keys: &[RemoteKey], tried: u64, now: Instant) -> Vec<usize> {
        peer.rails
            .iter()
            .enumerate()
            .filter(|(i, rp)| {
                rp.id.is_some()
                    && !rp.lost
                    && self.rails[*i].up
                    && tried & (1 << i) == 0
                    && rp
                        .down_since
                        .is_none_or(|t| now.duration_since(t) >= self.cfg.retry_after)
                    && (*i == 0 || keys.iter().all(|k| rp.keys.contains_key(k)))
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Posts `part` (rail-0 form) on one of `rails`, rotating; on a full
    /// queue tries the next. Returns the part back when no rail took it.
    fn post_part(&mut self, mut part: Part, rails: &[usize]) -> Result<(), Unposted> {
        let mut last = None;
        for k in 0..rails.len() {
            let i = rails[(self.next + k) % rails.len()];
            if !self.peers.contains_key(&part.transfer.peer) {
                break;
            }
            let Some(t) = self.on_rail(&part, i) else {
                continue;
            };
            let id = t.id;
            match self.rails[i].backend.submit(t) {
                Ok(()) => {
                    self.next = self.next.wrapping_add(1);
                    // A rail that was set aside is on probation: this part
                    // decides whether it is back.
                    self.parts.insert((i, id), part);
                    return Ok(());
                }
                Err(e) => last = Some(self.refused_on(&mut part, i, e)),
            }
        }
        let why = last.unwrap_or(Why::Refused(DataError::PeerLost {
            peer: part.transfer.peer,
            reason: "no rail of the peer is usable",
            source: None,
        }));
        Err(Unposted {
            part: Box::new(part),
            why,
        })
    }

    /// `part` as rail `i` takes it: a transfer id of its own, the rail's
    /// peer and keys, and the part's deadline. `None` when the peer has
    /// no connection on that rail or the rail does not serve every key.
    fn on_rail(&self, part: &Part, i: usize) -> Option<Transfer> {
        let rp = self.peers.get(&part.transfer.peer)?.rails.get(i)?;
        let mut t = part.transfer.clone();
        t.id = TransferId::next();
        t.peer = rp.id?;
        let allowance = self.cfg.part_timeout
            + Duration::from_secs_f64(part.bytes as f64 / self.cfg.part_min_rate.max(1) as f64);
        t.deadline = t.deadline.min(Instant::now() + allowance);
        if let (Some(tag), Some(n)) = (part.tag, &t.notify) {
            let sender = self.peers.get(&part.transfer.peer)?.note;
            t.notify = Some(notes::tag(sender, tag, n));
        }
        if i > 0 {
            // `usable` only offers rails that serve every key.
            for d in t.remote.iter_mut() {
                d.key = *rp.keys.get(&d.key)?;
            }
        }
        Some(t)
    }

    /// Why rail `i` did not take `part` (its refusal in the caller's
    /// terms); a rail that refused it outright is marked tried.
    fn refused_on(&self, part: &mut Part, i: usize, e: SubmitError) -> Why {
        match e {
            SubmitError::QueueFull { .. } => Why::Full {
                in_flight: self.rails[i].backend.in_flight(),
            },
            SubmitError::Rejected(e) => {
                part.tried |= 1 << i;
                let keys = self
                    .peers
                    .get(&part.transfer.peer)
                    .and_then(|p| p.rails.get(i))
                    .filter(|_| i > 0)
                    .map(|rp| &rp.keys);
                Why::Refused(in_caller_terms(e, part.transfer.peer, part.parent, keys))
            }
        }
    }

    /// Checks `submit` makes before planning a transfer; the rails it may
    /// use, and whether it goes whole on one of them.
    fn admit(&self, transfer: &Transfer, now: Instant) -> Result<(Vec<usize>, bool), SubmitError> {
        let Some(state) = self.peers.get(&transfer.peer) else {
            return Err(SubmitError::Rejected(DataError::UnknownPeer(transfer.peer)));
        };
        if self.parents.contains_key(&transfer.id) {
            return Err(SubmitError::Rejected(DataError::DuplicateTransfer(
                transfer.id,
            )));
        }
        if rejoin::is_reserved(transfer.notify.as_deref()) {
            return Err(SubmitError::Rejected(DataError::Unsupported {
                backend: "rails",
                what: "a notification that begins with a reserved rails prefix (0xc1 \"kvlane-rails\" 0x00 or 0xc1 \"kvlane-note\" 0x00)",
            }));
        }
        let keys: Vec<RemoteKey> = transfer.remote.iter().map(|d| d.key).collect();
        let rails = self.usable(state, &keys, 0, now);
        let rails = self.preferred(transfer, rails);
        let bytes: u64 = transfer.local.iter().map(|d| d.len).sum();
        let remote_bytes: u64 = transfer.remote.iter().map(|d| d.len).sum();
        let whole = rails.len() <= 1
            || bytes < self.cfg.stripe_min
            || transfer.notify.is_some()
            || bytes != remote_bytes;
        Ok((rails, whole))
    }

    /// Posts a transfer cut into one part per rail of `rails` (two or
    /// more), part `k` preferring rail `k`.
    fn submit_split(&mut self, transfer: Transfer, rails: Vec<usize>) -> Result<(), SubmitError> {
        let parent = transfer.id;
        let pieces = split(
            &transfer.local,
            &transfer.remote,
            rails.len(),
            self.cfg.stripe_align,
        );
        self.parents.insert(
            parent,
            Parent {
                peer: transfer.peer,
                remaining: pieces.len(),
                error: None,
            },
        );
        for (k, (local, remote, len)) in pieces.into_iter().enumerate() {
            let mut t = transfer.clone();
            t.local = local;
            t.remote = remote;
            let part = Part {
                parent,
                transfer: t,
                bytes: len,
                tried: 0,
                tag: None,
            };
            // Part k prefers rail k; a full rail passes it on.
            let mut order = rails.clone();
            order.rotate_left(k % rails.len());
            let saved = self.next;
            self.next = 0;
            let r = self.post_part(part, &order);
            self.next = saved;
            match r {
                Ok(()) => {}
                Err(Unposted {
                    why: Why::Full { in_flight },
                    ..
                }) if k == 0 => {
                    self.parents.remove(&parent);
                    return Err(SubmitError::QueueFull {
                        transfer: Box::new(transfer),
                        in_flight,
                    });
                }
                // Some parts are on the wire: this one waits for room (or
                // fails the transfer).
                Err(u) => self.park_or_fail(u),
            }
        }
        Ok(())
    }

    /// Posts a whole transfer as one part on one of `rails` (rail 0 when
    /// none is usable, for its own typed refusal).
    fn submit_whole(&mut self, transfer: Transfer, rails: Vec<usize>) -> Result<(), SubmitError> {
        let parent = transfer.id;
        let part = self.whole_part(transfer);
        let rails = if rails.is_empty() { vec![0] } else { rails };
        self.post_part(part, &rails)
            .map_err(|u| self.unposted(parent, u))
    }

    /// The one part of a whole transfer, its parent entry made.
    fn whole_part(&mut self, transfer: Transfer) -> Part {
        let bytes: u64 = transfer.local.iter().map(|d| d.len).sum();
        let tag = match self.peers.get_mut(&transfer.peer) {
            Some(p) if p.tag_notes && transfer.notify.is_some() => {
                p.next_tag += 1;
                Some(p.next_tag - 1)
            }
            _ => None,
        };
        self.parents.insert(
            transfer.id,
            Parent {
                peer: transfer.peer,
                remaining: 1,
                error: None,
            },
        );
        Part {
            parent: transfer.id,
            transfer,
            bytes,
            tried: 0,
            tag,
        }
    }

    /// The caller's refusal of a whole transfer no rail took (its parent
    /// entry dropped).
    fn unposted(&mut self, parent: TransferId, u: Unposted) -> SubmitError {
        self.parents.remove(&parent);
        match u.why {
            Why::Full { in_flight } => SubmitError::QueueFull {
                transfer: Box::new(u.part.transfer),
                in_flight,
            },
            Why::Refused(e) => SubmitError::Rejected(e),
        }
    }

    /// A part that could not be re-posted: it waits for room, or its
    /// transfer fails.
    fn park_or_fail(&mut self, u: Unposted) {
        match u.why {
            Why::Full { .. } => self.pending.push_back(*u.part),
            Why::Refused(e) => self.finish_part(u.part.parent, Err(e)),
        }
    }

    fn finish_part(&mut self, parent: TransferId, result: Result<(), DataError>) {
        let Some(p) = self.parents.get_mut(&parent) else {
            return;
        };
        p.remaining -= 1;
        if let Err(e) = result {
            p.error.get_or_insert(e);
        }
        if p.remaining == 0 {
            let p = self.parents.remove(&parent).expect("present");
            self.done.push(Completion {
                id: parent,
                peer: p.peer,
                result: p.error.map_or(Ok(()), Err),
            });
        }
    }

    fn on_part_done(&mut self, rail: usize, c: Completion, now: Instant) {
        let Some(mut part) = self.parts.remove(&(rail, c.id)) else {
            return;
        };
        let peer = part.transfer.peer;
        match c.result {
            Ok(()) => {
                let s = &mut self.rails[rail].stats;
                s.bytes += part.bytes;
                s.parts += 1;
                // A part that had landed before its rail peer was dropped
                // says nothing of the rail now.
                if let Some(rp) = self
                    .peers
                    .get_mut(&peer)
                    .and_then(|p| p.rails.get_mut(rail))
                    .filter(|rp| rail_peer_is(rp, c.peer))
                {
                    rp.down_since = None;
                }
                self.finish_part(part.parent, Ok(()));
            }
            Err(e) => {
                let keys = (rail > 0)
                    .then(|| self.peers.get(&peer).and_then(|p| p.rails.get(rail)))
                    .flatten()
                    .map(|rp| &rp.keys);
                let e = in_caller_terms(e, peer, part.parent, keys);
                self.rails[rail].stats.failures += 1;
                // A part timeout before the transfer's deadline is the rail
                // going silent, not the transfer running out of time. A
                // work completion error leaves the rail's queue pair in
                // ERROR (a port that just went down fails the send queue
                // with "local queue pair operation error" before its state
                // is read): the rail is broken, the part moves.
                let broken = matches!(
                    e,
                    DataError::PeerLost { .. }
                        | DataError::Io { .. }
                        | DataError::Timeout { .. }
                        | DataError::Rdma { .. }
                );
                // A notification the peer cannot de-duplicate may have
                // arrived: it is never sent twice.
                let once = part.transfer.notify.is_some() && part.tag.is_none();
                let moves = broken && now < part.transfer.deadline && !once;
                if let Some(rp) = self
                    .peers
                    .get_mut(&peer)
                    .and_then(|p| p.rails.get_mut(rail))
                {
                    // A part of a rail peer that was replaced since (dropped,
                    // dialed or paired again) says nothing of the current one.
                    if broken && rail_peer_is(rp, c.peer) {
                        // The rail's connection is dropped at once: bytes it
                        // still holds (a WRITE queued behind a silent link)
                        // must never land after the part was posted again
                        // elsewhere, or after newer data. It is paired again
                        // after `retry_after`.
                        // A backend that can keeps the rail peer (and what
                        // it issued: the remote's way in to us) to dial it
                        // again in place.
                        if !self.rails[rail].backend.disconnect_peer(c.peer) {
                            self.rails[rail].backend.remove_peer(c.peer);
                            rp.id = None;
                        }
                        rp.lost = true;
                        rp.down_since = Some(now);
                    }
                }
                part.tried |= 1 << rail;
                let others = match self.peers.get(&peer) {
                    Some(p) if moves => {
                        let keys: Vec<RemoteKey> =
                            part.transfer.remote.iter().map(|d| d.key).collect();
                        self.usable(p, &keys, part.tried, now)
                    }
                    _ => Vec::new(),
                };
                if others.is_empty() {
                    tracing::debug!(rail = %self.rails[rail].name, error = %e, "rails: part failed, no rail left");
                    self.finish_part(part.parent, Err(e));
                    return;
                }
                self.rails[rail].stats.reposts += 1;
                tracing::debug!(from = %self.rails[rail].name, error = %e, "rails: part moved to another rail");
                if let Err(u) = self.post_part(part, &others) {
                    self.park_or_fail(u);
                }
            }
        }
    }

    fn retry_pending(&mut self, now: Instant) {
        for _ in 0..self.pending.len() {
            let Some(part) = self.pending.pop_front() else {
                break;
            };
            if now >= part.transfer.deadline {
                let e = DataError::Timeout {
                    id: part.parent,
                    peer: part.transfer.peer,
                    overdue: now.duration_since(part.transfer.deadline),
                };
                self.finish_part(part.parent, Err(e));
                continue;
            }
            let rails = match self.peers.get(&part.transfer.peer) {
                Some(p) => {
                    let keys: Vec<RemoteKey> = part.transfer.remote.iter().map(|d| d.key).collect();
                    self.usable(p, &keys, part.tried, now)
                }
                None => Vec::new(),
            };
            if let Err(u) = self.post_part(part, &rails) {
                self.park_or_fail(u);
            }
        }
    }
}

impl Rails {
    /// Whether any rail of any peer is lost, being dialed again or
    /// re-paired.
    fn recovering(&self) -> bool {
        self.peers.values().any(|p| {
            p.rails
                .iter()
                .any(|rp| rp.lost || rp.redialing || !matches!(rp.rejoin, Rejoin::Idle))
        })
    }

    /// Dials lost rails again once they are due, and installs the dials
    /// that finished. The dial itself runs on a thread of its own.
    fn redial(&mut self, now: Instant) {
        let mut rerouted = Vec::new();
        while let Ok((peer, i, new, result)) = self.redials.1.try_recv() {
            let Rail { backend, name, .. } = &mut self.rails[i];
            let Some(rp) = self.peers.get_mut(&peer).and_then(|p| p.rails.get_mut(i)) else {
                backend.remove_peer(new);
                continue;
            };
            rp.redialing = false;
            let in_place = rp.id == Some(new);
            match result.and_then(|c| backend.finish_connect(new, c)) {
                Ok(()) => {
                    tracing::info!(rail = %name, "rails: rail dialed again, back in use");
                    rp.id = Some(new);
                    rp.lost = false;
                    rp.down_since = None;
                    if !in_place {
                        rerouted.push(peer);
                    }
                }
                Err(e) => {
                    tracing::debug!(rail = %name, error = %e, "rails: re-dial failed");
                    if !in_place {
                        backend.remove_peer(new);
                    }
                    rp.down_since = Some(now);
                }
            }
        }
        for peer in rerouted {
            self.route_fences(peer);
        }
        let retry = self.cfg.retry_after;
        for (peer, state) in &mut self.peers {
            for (i, rp) in state.rails.iter_mut().enumerate() {
                // A rail peer kept in place (`disconnect_peer`) is dialed
                // again on its endpoint; a removed one with per-peer
                // endpoints cannot be: `rejoin` pairs it anew.
                let reusable = (rp.id.is_some() || !self.rails[i].backend.endpoint_per_peer())
                    && matches!(rp.rejoin, Rejoin::Idle)
                    && self.rails[i].up;
                let due = reusable
                    && rp.lost
                    && !rp.redialing
                    && rp.down_since.is_none_or(|t| now.duration_since(t) >= retry);
                let Some((ep, regs)) = rp.remote.as_ref().filter(|_| due) else {
                    continue;
                };
                let Rail { backend, name, .. } = &mut self.rails[i];
                // A rail peer still here was disconnected in place
                // (`disconnect_peer`): it is connected again as it is.
                // Otherwise a new one is prepared.
                let in_place = rp.id.is_some();
                let started = match rp.id {
                    Some(id) => Ok(id),
                    None => backend.prepare_peer().map(|(new, _)| new),
                }
                .and_then(|new| Ok((new, backend.start_connect(new, ep, regs)?)));
                let (new, connecting) = match started {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::debug!(rail = %name, error = %e, "rails: re-dial failed");
                        rp.down_since = Some(now);
                        continue;
                    }
                };
                rp.redialing = true;
                let (tx, waker, peer) = (self.redials.0.clone(), self.waker.clone(), *peer);
                let spawned = crate::placement::spawn(
                    std::thread::Builder::new().name("kvlane-rail-dial".into()),
                    move || {
                        let _ = tx.send((peer, i, new, connecting.run()));
                        if let Some(w) = waker {
                            w.wake();
                        }
                    },
                );
                if spawned.is_err() {
                    rp.redialing = false;
                    rp.down_since = Some(now);
                    if !in_place {
                        backend.remove_peer(new);
                    }
                }
            }
        }
    }
}

/// Appends to `out` the spans of `list` that cover the next `need` bytes
/// from the cursor (`at`, `off`: span index and offset into it), moving
/// the cursor past them. `cut(span, offset, len)` makes a piece of a span.
fn take<T, A: smallvec::Array<Item = T>>(
    list: &[T],
    at: &mut usize,
    off: &mut u64,
    mut need: u64,
    out: &mut smallvec::SmallVec<A>,
    len_of: impl Fn(&T) -> u64,
    cut: impl Fn(&T, u64, u64) -> T,
) {
    while need > 0 {
        let d = &list[*at];
        let n = (len_of(d) - *off).min(need);
        out.push(cut(d, *off, n));
        *off += n;
        need -= n;
        if *off == len_of(d) {
            *at += 1;
            *off = 0;
        }
    }
}

/// Cuts a transfer's byte stream into `n` contiguous ranges of about equal
/// size (multiples of `align`), each with its local and remote spans.
pub(crate) fn split(
    local: &[Descriptor],
    remote: &[RemoteDescriptor],
    n: usize,
    align: u64,
) -> Vec<(Descriptors, RemoteDescriptors, u64)> {
    let total: u64 = local.iter().map(|d| d.len).sum();
    let n = n.max(1) as u64;
    let share = (total / n).div_ceil(align.max(1)) * align.max(1);
    let (mut li, mut loff, mut ri, mut roff) = (0usize, 0u64, 0usize, 0u64);
    let mut out = Vec::new();
    let mut left = total;
    while left > 0 {
        let want = if out.len() as u64 + 1 == n {
            left
        } else {
            share.min(left)
        };
        let mut l = Descriptors::new();
        take(
            local,
            &mut li,
            &mut loff,
            want,
            &mut l,
            |d| d.len,
            |d, off, len| Descriptor {
                region: d.region,
                offset: d.offset + off,
                len,
            },
        );
        let mut r = RemoteDescriptors::new();
        take(
            remote,
            &mut ri,
            &mut roff,
            want,
            &mut r,
            |d| d.len,
            |d, off, len| RemoteDescriptor {
                key: d.key,
                offset: d.offset + off,
                len,
            },
        );
        out.push((l, r, want));
        left -= want;
    }
    out
}

/// Whether a completion's peer is the rail's current peer (not one that
/// was replaced by a re-dial since).
fn rail_peer_is(rp: &RailPeer, id: PeerId) -> bool {
    rp.id == Some(id)
}

/// A rail's error in the caller's terms: the rails peer, the transfer's
/// id and the rail-0 key (the one the caller used), not the rail's own.
fn in_caller_terms(
    e: DataError,
    peer: PeerId,
    parent: TransferId,
    keys: Option<&HashMap<RemoteKey, RemoteKey>>,
) -> DataError {
    let back = |k: RemoteKey| {
        keys.and_then(|m| m.iter().find(|(_, v)| **v == k).map(|(a, _)| *a))
            .unwrap_or(k)
    };
    match e {
        DataError::UnknownKey { key, .. } => DataError::UnknownKey {
            peer,
            key: back(key),
        },
        DataError::RemoteOutOfBounds {
            key,
            offset,
            len,
            region_len,
            ..
        } => DataError::RemoteOutOfBounds {
            peer,
            key: back(key),
            offset,
            len,
            region_len,
        },
        DataError::Timeout { overdue, .. } => DataError::Timeout {
            id: parent,
            peer,
            overdue,
        },
        DataError::PeerLost { reason, source, .. } => DataError::PeerLost {
            peer,
            reason,
            source,
        },
        DataError::UnknownPeer(_) => DataError::UnknownPeer(peer),
        DataError::NotificationQueueFull { addr, .. } => {
            DataError::NotificationQueueFull { peer, addr }
        }
        other => other,
    }
}

fn remap(regions: &[RemoteRegion], keys: &HashMap<RemoteKey, RemoteKey>) -> Vec<RemoteRegion> {
    regions
        .iter()
        .filter_map(|r| keys.get(&r.key).map(|k| RemoteRegion { key: *k, ..*r }))
        .collect()
}

/// What each rail's `Connecting::run` produced.
struct RailsConnected(Vec<(usize, Result<Connected, DataError>)>);

impl Backend for Rails {
    fn kind(&self) -> BackendKind {
        self.rails[0].backend.kind()
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        let first = self.rails[0].backend.register(region)?;
        for i in 1..self.rails.len() {
            match self.rails[i].backend.register(region) {
                Ok(r) => {
                    self.rails[i].local_keys.insert(first.key, r.key);
                }
                Err(e) => {
                    for rail in &mut self.rails[..i] {
                        let _ = rail.backend.deregister(region.id());
                        rail.local_keys.remove(&first.key);
                    }
                    return Err(e);
                }
            }
        }
        Ok(first)
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        self.prefer.remove(&region);
        let mut first = Ok(());
        for rail in &mut self.rails {
            if let Err(e) = rail.backend.deregister(region) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let mut rails = Vec::with_capacity(self.rails.len());
        let mut wires = Vec::with_capacity(self.rails.len());
        for i in 0..self.rails.len() {
            match self.rails[i].backend.prepare_peer() {
                Ok((id, ep)) => {
                    rails.push(RailPeer::new(id));
                    wires.push(RailWire {
                        name: self.rails[i].name.clone(),
                        data: ep.data,
                        keys: self.rails[i]
                            .local_keys
                            .iter()
                            .map(|(a, b)| (*a, *b))
                            .collect(),
                    });
                }
                Err(e) => {
                    for (j, rp) in rails.iter().enumerate() {
                        if let Some(id) = rp.id {
                            self.rails[j].backend.remove_peer(id);
                        }
                    }
                    return Err(e);
                }
            }
        }
        // A token only where a lost rail is paired again by exchange.
        let token = (self.rails.len() > 1 && self.endpoint_per_peer()).then(rand::random::<Token>);
        let note = rand::random::<u64>();
        let data = rmp_serde::to_vec_named(&RailsWire {
            magic: MAGIC.into(),
            rails: wires,
            token,
            note: Some(note),
        })
        .map_err(|e| DataError::BadEndpoint {
            backend: "rails",
            reason: e.to_string(),
        })?;
        let id = PeerId(NEXT_PEER.fetch_add(1, Ordering::Relaxed));
        if let Some(t) = token {
            self.by_token.insert(t, id);
        }
        self.peers.insert(
            id,
            PeerState {
                rails,
                token,
                their_token: None,
                tag_notes: false,
                note,
                their_note: None,
                next_tag: 0,
                seen: notes::Seen::default(),
            },
        );
        Ok((
            id,
            Endpoint {
                backend: self.kind(),
                data,
            },
        ))
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let c = self.start_connect(peer, remote, regions)?;
        let done = c.run()?;
        self.finish_connect(peer, done)
    }

    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        let kind = self.kind();
        let wire = decode_rails(remote);
        let their_token = wire.as_ref().and_then(|w| w.token);
        let their_note = wire.as_ref().and_then(|w| w.note);
        let many = wire.as_ref().is_some_and(|w| w.rails.len() > 1);
        let theirs: Vec<(Endpoint, HashMap<RemoteKey, RemoteKey>)> = match wire {
            Some(w) => w
                .rails
                .into_iter()
                .map(|r| {
                    (
                        Endpoint {
                            backend: remote.backend,
                            data: r.data,
                        },
                        r.keys.into_iter().collect(),
                    )
                })
                .collect(),
            None => vec![(remote.clone(), HashMap::new())],
        };
        let state = self
            .peers
            .get_mut(&peer)
            .ok_or(DataError::UnknownPeer(peer))?;
        state.their_token = their_token.filter(|_| state.token.is_some());
        state.tag_notes = their_note.is_some() && many && state.rails.len() > 1;
        if let Some(old) = std::mem::replace(&mut state.their_note, their_note) {
            self.by_note.remove(&old);
        }
        if let Some(n) = their_note {
            self.by_note.insert(n, peer);
        }
        let mut work = Vec::new();
        for (i, rp) in state.rails.iter_mut().enumerate() {
            let Some(id) = rp.id else { continue };
            let Some((ep, keys)) = theirs.get(i) else {
                // The peer has fewer rails: this one stays unpaired.
                self.rails[i].backend.remove_peer(id);
                rp.id = None;
                continue;
            };
            let ep = Endpoint {
                backend: kind,
                data: ep.data.clone(),
            };
            let regs = if i == 0 {
                regions.to_vec()
            } else {
                rp.keys = keys.clone();
                remap(regions, keys)
            };
            rp.remote = Some((ep.clone(), regs.clone()));
            match self.rails[i].backend.start_connect(id, &ep, &regs) {
                Ok(c) => work.push((i, c)),
                Err(e) if i == 0 => {
                    for (j, _) in &work {
                        if let Some(id) = state.rails[*j].id {
                            self.rails[*j].backend.remove_peer(id);
                        }
                    }
                    return Err(e);
                }
                Err(e) => {
                    tracing::warn!(rail = %self.rails[i].name, error = %e, "rails: rail not paired");
                    self.rails[i].backend.remove_peer(id);
                    rp.id = None;
                }
            }
        }
        self.route_fences(peer);
        Ok(Connecting::new(move || {
            // The rails dial in parallel: a slow one does not delay the rest.
            let handles: Vec<_> = work
                .into_iter()
                .map(|(i, c)| {
                    let b = std::thread::Builder::new().name("kvlane-rail-connect".into());
                    (i, crate::placement::spawn(b, move || c.run()))
                })
                .collect();
            let out = handles
                .into_iter()
                .map(|(i, h)| {
                    let r = match h {
                        Ok(h) => h.join().unwrap_or_else(|_| {
                            Err(DataError::Unsupported {
                                backend: "rails",
                                what: "a rail's connect panicked",
                            })
                        }),
                        Err(source) => Err(DataError::Io {
                            op: "spawn a rail's connect thread".into(),
                            source,
                        }),
                    };
                    (i, r)
                })
                .collect();
            Ok(Box::new(RailsConnected(out)) as Box<dyn std::any::Any + Send>)
        }))
    }

    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        let results = connected
            .take::<RailsConnected>()
            .ok_or(DataError::BadEndpoint {
                backend: "rails",
                reason: "connect result of another backend".into(),
            })?
            .0;
        let Some(state) = self.peers.get_mut(&peer) else {
            return Err(DataError::UnknownPeer(peer));
        };
        let mut first_err = None;
        for (i, r) in results {
            let Some(id) = state.rails[i].id else {
                continue;
            };
            let r = r.and_then(|c| self.rails[i].backend.finish_connect(id, c));
            if let Err(e) = r {
                if i == 0 {
                    first_err = Some(e);
                } else {
                    tracing::warn!(rail = %self.rails[i].name, error = %e, "rails: rail not paired");
                }
                self.rails[i].backend.remove_peer(id);
                state.rails[i].id = None;
            }
        }
        match first_err {
            Some(e) => {
                self.remove_peer(peer);
                Err(e)
            }
            None => Ok(()),
        }
    }

    fn remove_peer(&mut self, peer: PeerId) {
        if let Some(state) = self.peers.remove(&peer) {
            for (i, rp) in state.rails.iter().enumerate() {
                if let Some(id) = rp.id {
                    self.rails[i].backend.remove_peer(id);
                }
                if let Rejoin::Offered { id, .. } = rp.rejoin {
                    self.rails[i].backend.remove_peer(id);
                }
            }
            if let Some(t) = state.token {
                self.by_token.remove(&t);
            }
            if let Some(n) = state.their_note {
                self.by_note.remove(&n);
            }
        }
        // Parts still queued here fail now; parts on the rails fail through
        // their backends' completions (PeerLost) and find no rail left.
        let pending: Vec<Part> = self.pending.drain(..).collect();
        for part in pending {
            if part.transfer.peer == peer {
                let e = DataError::PeerLost {
                    peer,
                    reason: "peer removed",
                    source: None,
                };
                self.finish_part(part.parent, Err(e));
            } else {
                self.pending.push_back(part);
            }
        }
    }

    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        self.submit_at(transfer, Instant::now())
    }

    fn submit_at(&mut self, transfer: Transfer, now: Instant) -> Result<(), SubmitError> {
        let (rails, whole) = self.admit(&transfer, now)?;
        if whole {
            self.submit_whole(transfer, rails)
        } else {
            self.submit_split(transfer, rails)
        }
    }

    /// Whole transfers are dealt to their rails (rotating, as `submit`
    /// does) and each rail takes its share in one `submit_batch`; a part a
    /// rail refuses there tries the batch's other rails one by one, as in
    /// `submit`. Transfers split over the rails take `submit`'s path, and so
    /// do whole ones no rail is usable for (rail 0 gives its refusal).
    fn submit_batch(
        &mut self,
        transfers: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        let now = Instant::now();
        let mut due = false;
        let mut dealt: Vec<Share> = (0..self.rails.len()).map(|_| Default::default()).collect();
        for t in transfers {
            let at = results.len();
            let (rails, whole) = match self.admit(&t, now) {
                Ok(x) => x,
                Err(e) => {
                    results.push(Err(e));
                    continue;
                }
            };
            if !whole {
                results.push(self.submit_split(t, rails));
                due |= self.poll_after_submit();
                continue;
            }
            if rails.is_empty() {
                results.push(self.submit_whole(t, rails));
                due |= self.poll_after_submit();
                continue;
            }
            let i = rails[self.next % rails.len()];
            let part = self.whole_part(t);
            match self.on_rail(&part, i) {
                Some(rt) => {
                    self.next = self.next.wrapping_add(1);
                    dealt[i].0.push((at, part, rails));
                    dealt[i].1.push(rt);
                    results.push(Ok(()));
                }
                None => {
                    let parent = part.parent;
                    let r = self
                        .post_part(part, &rails)
                        .map_err(|u| self.unposted(parent, u));
                    results.push(r);
                }
            }
        }
        let mut taken = Vec::new();
        for (i, (parts, ts)) in dealt.into_iter().enumerate() {
            if ts.is_empty() {
                continue;
            }
            let ids: Vec<TransferId> = ts.iter().map(|t| t.id).collect();
            taken.clear();
            due |= self.rails[i].backend.submit_batch(ts, &mut taken);
            for (((at, mut part, rails), id), r) in parts.into_iter().zip(ids).zip(taken.drain(..))
            {
                let e = match r {
                    Ok(()) => {
                        self.parts.insert((i, id), part);
                        continue;
                    }
                    Err(e) => e,
                };
                // Refused on rail `i`: the other rails, as `post_part`
                // would have tried them.
                let parent = part.parent;
                let others: Vec<usize> = rails.iter().copied().filter(|&r| r != i).collect();
                let why = self.refused_on(&mut part, i, e);
                let r = if others.is_empty() {
                    Err(Unposted {
                        part: Box::new(part),
                        why,
                    })
                } else {
                    self.post_part(part, &others)
                };
                results[at] = r.map_err(|u| self.unposted(parent, u));
            }
        }
        due || self.poll_after_submit()
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        let now = Instant::now();
        self.read_links(now);
        for i in 0..self.rails.len() {
            let mut got = std::mem::take(&mut self.scratch);
            self.rails[i].backend.poll(&mut got);
            for c in got.drain(..) {
                self.on_part_done(i, c, now);
            }
            self.scratch = got;
        }
        self.take_notes(now);
        if !self.pending.is_empty() {
            self.retry_pending(now);
        }
        self.redial(now);
        self.rejoin_tick(now);
        let n = self.done.len();
        completions.append(&mut self.done);
        n
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        self.take_notes(Instant::now());
        let n = self.notes.len();
        out.extend(self.notes.drain(..));
        n
    }

    fn in_flight(&self) -> usize {
        self.parents.len()
    }

    fn set_waker(&mut self, waker: Waker) {
        self.waker = Some(waker.clone());
        for r in &mut self.rails {
            r.backend.set_waker(waker.clone());
        }
    }

    fn endpoint_per_peer(&self) -> bool {
        self.rails.iter().any(|r| r.backend.endpoint_per_peer())
    }

    fn needs_busy_poll(&self) -> bool {
        self.rails.iter().any(|r| r.backend.needs_busy_poll())
    }

    /// When every rail does, and no part waits for room and no rail is
    /// being recovered (those move only by polls); its link reads are in
    /// [`poll_by`](Backend::poll_by).
    fn announces_arrivals(&self) -> bool {
        self.pending.is_empty()
            && !self.recovering()
            && self.rails.iter().all(|r| r.backend.announces_arrivals())
    }

    /// The earliest of the rails' own answers and the next link read;
    /// unknown (a driver re-polls about every millisecond) while a rail
    /// with work in flight says nothing, parts wait for room, or a lost
    /// rail is being recovered: those move on timers of this backend's
    /// own that only `poll` looks at.
    fn poll_by(&self) -> Option<Instant> {
        if !self.done.is_empty() {
            return Some(Instant::now());
        }
        if !self.pending.is_empty() || self.recovering() {
            return None;
        }
        let links = self.links_read.map_or_else(Instant::now, |t| t + LINK_POLL);
        // Every rail's own time, idle ones too: a rail asks for a poll
        // after a submission only for a deadline earlier than the time it
        // last named (`poll_after_submit`), so the driver's timer must not
        // be later than any. A rail with nothing in flight that names
        // none has nothing to be due for; one with work that names none
        // leaves the time unknown.
        self.rails
            .iter()
            .try_fold(links, |at, r| match r.backend.poll_by() {
                Some(t) => Some(at.min(t)),
                None if r.backend.in_flight() == 0 => Some(at),
                None => None,
            })
    }

    /// What a rail's last submission left to `poll`, or a part that is
    /// waiting here for room, or a completion `submit` queued.
    fn poll_after_submit(&self) -> bool {
        !self.done.is_empty()
            || !self.pending.is_empty()
            || self.rails.iter().any(|r| r.backend.poll_after_submit())
    }

    fn tcp_counters(&self) -> Option<crate::TcpCounters> {
        self.rails
            .iter()
            .filter_map(|r| r.backend.tcp_counters())
            .reduce(|mut sum, c| {
                sum.merge(&c);
                sum
            })
    }

    fn link_up(&self) -> bool {
        self.rails.iter().any(|r| r.backend.link_up())
    }

    fn rail_stats(&self) -> Vec<RailStats> {
        self.rails
            .iter()
            .enumerate()
            .map(|(i, r)| RailStats {
                down_peers: self
                    .peers
                    .values()
                    .filter(|p| p.rails.get(i).is_some_and(|rp| rp.down_since.is_some()))
                    .count() as u64,
                ..r.stats.clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(region: u64, offset: u64, len: u64) -> Descriptor {
        Descriptor {
            region: RegionId(region),
            offset,
            len,
        }
    }

    fn r(key: u64, offset: u64, len: u64) -> RemoteDescriptor {
        RemoteDescriptor {
            key: RemoteKey(key.try_into().unwrap()),
            offset,
            len,
        }
    }

    proptest! {
        /// Splitting keeps every byte, in order, on both sides.
        #[test]
        fn split_covers_both_lists_exactly(
            lens in proptest::collection::vec(1u64..100_000, 1..8),
            cuts in proptest::collection::vec(1u64..100_000, 0..8),
            n in 1usize..5,
        ) {
            let total: u64 = lens.iter().sum();
            let local: Vec<Descriptor> = lens.iter().scan(0, |o, &l| { let x = d(1, *o, l); *o += l; Some(x) }).collect();
            // Remote spans: the same total cut elsewhere.
            let mut remote = Vec::new();
            let mut at = 0;
            for c in cuts { if at + c < total { remote.push(r(9, 1000 + at, c)); at += c; } }
            remote.push(r(9, 1000 + at, total - at));
            let parts = split(&local, &remote, n, 4096);
            prop_assert!(parts.len() <= n);
            let (mut lo, mut ro) = (0u64, 1000u64);
            for (l, rm, len) in &parts {
                prop_assert_eq!(l.iter().map(|x| x.len).sum::<u64>(), *len);
                prop_assert_eq!(rm.iter().map(|x| x.len).sum::<u64>(), *len);
                for x in l { prop_assert_eq!(x.offset, lo); lo += x.len; }
                for x in rm { prop_assert_eq!(x.offset, ro); ro += x.len; }
            }
            prop_assert_eq!(lo, total);
            prop_assert_eq!(ro, 1000 + total);
        }
    }

    #[test]
    fn a_plain_endpoint_is_its_own_primary() {
        let e = Endpoint {
            backend: BackendKind::Tcp,
            data: vec![1, 2, 3],
        };
        assert_eq!(e.primary(), e);
    }
}
