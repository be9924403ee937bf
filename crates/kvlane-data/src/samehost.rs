//! [`SameHost`]: shared memory to peers on this host, another backend to
//! the rest; what the facade's `BackendChoice::Auto` runs (and its alias
//! `BackendChoice::SameHost`).
//!
//! - **Endpoints.** A peer gets one endpoint: the other backend's, and
//!   beside it a [`ShmEndpoint`] issued for that peer under the same
//!   [`PeerId`], and this side's network namespace. [`Endpoint::primary`]
//!   and [`Endpoint::rails`] read the other backend's part, so a peer
//!   without shm (another host's, or a plain tcp or verbs agent) connects
//!   to it as it always did.
//! - **Choosing, per peer.** "On this host" means the same kernel **and**
//!   the same network namespace: the shm socket is an abstract Unix socket,
//!   which exists only in the namespace that bound it, and hosts simulated
//!   by namespaces on one kernel (CI's) must keep using the network.
//!   Connecting tries shm when the peer offers an shm endpoint, this side
//!   serves shm, the endpoint's boot id is this host's, and its network
//!   namespace (`net:[inode]` of `/proc/thread-self/ns/net` when the backend
//!   was made) is this side's; the connect itself (the target's socket,
//!   its credential, mapping its memory) is the proof that the path works.
//!   Anything else falls back to the other backend, and the reason is
//!   logged at `info` (`shm: peer via <kind>` with `reason`). Each side
//!   chooses for the transfers it initiates; its target serves both paths.
//! - **Keys.** A region is registered with both backends under the key the
//!   other backend chose, so one advertisement serves both paths.
//! - **Which memory.** shm serves memory allocated with
//!   [`Region::alloc_shared`], GPU memory registered through its runtime
//!   (by CUDA/HIP IPC handle; a driver that cannot export it turns shm off
//!   as below), and, when its backend was configured with
//!   [`cross_memory_attach`](crate::ShmConfig::cross_memory_attach), any
//!   host memory. Once a region with remote rights that it cannot serve is
//!   registered, shm is off for peers prepared from then on (they use the
//!   other backend both ways; the reason is logged, see [`unserved`]);
//!   peers already on shm keep it for the regions they were offered. Put
//!   every served region in shared memory (or opt in to cross-memory
//!   attach) to get shm. A peer whose kernel refuses the attach (another
//!   user: `EPERM`) fails the shm connect and falls back to the other
//!   backend, as any shm failure.
//!
//! [`ShmEndpoint`]: crate::ShmEndpoint

use crate::backend::{self, Backend, Connected, Connecting, Submitted};
use crate::error::{DataError, SubmitError};
use crate::ids::{FastMap, PeerId, RegionId};
use crate::memory::{MemoryKind, Region, RemoteRegion};
use crate::shm::{self, ShmBackend};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Transfer};
use serde::{Deserialize, Serialize};
use std::task::Waker;
use std::time::Instant;

/// `"kvlane-samehost"`: tells a same-host endpoint from a plain one.
const MAGIC: &str = "kvlane-samehost";

/// A [`SameHost`] endpoint inside [`Endpoint::data`] (msgpack).
#[derive(Serialize, Deserialize)]
struct Wire {
    magic: String,
    /// The other backend's endpoint: what a peer without shm dials.
    other: Endpoint,
    /// The shm endpoint issued for the peer.
    shm: Endpoint,
    /// The target's network namespace (`net:[inode]`): its shm socket is
    /// reachable only from the same one. Absent from older peers (their
    /// connect is tried; from another namespace it is refused at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    netns: Option<String>,
}

fn decode(e: &Endpoint) -> Option<Wire> {
    let w: Wire = rmp_serde::from_slice(&e.data).ok()?;
    (w.magic == MAGIC).then_some(w)
}

/// The other backend's part of a same-host endpoint; `None` for any other
/// endpoint.
pub(crate) fn other_part(e: &Endpoint) -> Option<Endpoint> {
    decode(e).map(|w| w.other)
}

/// The shm part of a same-host endpoint, or a plain shm endpoint; `None`
/// for any other endpoint.
pub(crate) fn shm_part(e: &Endpoint) -> Option<Endpoint> {
    match decode(e) {
        Some(w) => Some(w.shm),
        None => (e.backend == BackendKind::Shm).then(|| e.clone()),
    }
}

/// Applies `f` to the other backend's part of a same-host endpoint; `None`
/// for any other endpoint.
pub(crate) fn map_other(
    e: &Endpoint,
    f: impl FnOnce(&Endpoint) -> Result<Endpoint, DataError>,
) -> Option<Result<Endpoint, DataError>> {
    let mut w = decode(e)?;
    Some(f(&w.other).and_then(|other| {
        w.other = other;
        encode(&w, e.backend)
    }))
}

fn encode(w: &Wire, backend: BackendKind) -> Result<Endpoint, DataError> {
    let data = rmp_serde::to_vec_named(w).map_err(|e| DataError::BadEndpoint {
        backend: "shm",
        reason: e.to_string(),
    })?;
    Ok(Endpoint { backend, data })
}

/// This thread's network namespace, as `net:[inode]`; `None` where the
/// kernel does not say (no `/proc`).
pub fn netns() -> Option<String> {
    let link = std::fs::read_link("/proc/thread-self/ns/net")
        .or_else(|_| std::fs::read_link("/proc/self/ns/net"))
        .ok()?;
    Some(link.to_string_lossy().into_owned())
}

/// Why the shm backend cannot serve `region` to a peer (it has remote
/// rights, and is neither [`Region::alloc_shared`] memory, nor GPU memory
/// registered through its runtime, nor host memory with
/// `cross_memory_attach` on); `None` when it can, or when the region
/// grants no remote right. The reason names the way to shm.
pub fn unserved(region: &Region, cross_memory_attach: bool) -> Option<String> {
    if !shm::remote_rights(region.access()) || shm::serves(region, cross_memory_attach) {
        return None;
    }
    Some(match region.kind() {
        MemoryKind::Host => format!(
            "{} has remote rights and is memory the application allocated (a torch tensor, \
             a numpy array, Region::alloc), which shm serves only with cross-memory attach \
             (opt-in: AgentBuilder::shm_cross_memory_attach, shm_cross_memory_attach=True in \
             Python); kvlane's shared allocations (Region::alloc_shared, kvlane.host_buffer) \
             are served without it",
            region.id()
        ),
        _ => format!(
            "{} is device memory not registered through its runtime (Region::alloc_device, \
             Region::from_device_ptr), which shm cannot share",
            region.id()
        ),
    })
}

/// Per prepared peer.
#[derive(Clone, Copy, Debug, Default)]
struct Route {
    /// Prepared on shm too (an shm endpoint was issued for it).
    shm_prepared: bool,
    /// Its transfers go over shm.
    via_shm: bool,
}

/// What a started connect produced.
enum Made {
    Shm(Connected),
    /// Over the other backend, and why not over shm.
    Other(Connected, String),
}

/// Shared memory to peers on this host, `other` to the rest (see the
/// [module docs](self)).
pub struct SameHost {
    shm: ShmBackend,
    other: Box<dyn Backend>,
    /// Why peers prepared from now on get no shm endpoint.
    shm_off: Option<String>,
    /// This host's boot id and this side's network namespace: a peer's
    /// shm endpoint is tried only when both match.
    boot_id: Option<String>,
    netns: Option<String>,
    routes: FastMap<PeerId, Route>,
    /// Whether the last submit went to shm (for `poll_after_submit`).
    last_shm: bool,
}

impl std::fmt::Debug for SameHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SameHost")
            .field("shm", &self.shm)
            .field("other", &self.other.kind())
            .field("shm_off", &self.shm_off)
            .field("peers", &self.routes.len())
            .finish()
    }
}

impl SameHost {
    /// Serves shm through `shm` and everything else through `other`.
    /// Call it on the thread that made `shm`: the network namespace its
    /// socket lives in is read from the calling thread.
    pub fn new(shm: ShmBackend, other: Box<dyn Backend>) -> Self {
        Self {
            shm,
            other,
            shm_off: None,
            boot_id: shm::boot_id().ok(),
            netns: netns(),
            routes: FastMap::default(),
            last_shm: false,
        }
    }

    /// Why shm is off for peers prepared from now on; `None` while on.
    pub fn shm_off(&self) -> Option<&str> {
        self.shm_off.as_deref()
    }

    fn turn_off(&mut self, why: String) {
        if self.shm_off.is_none() {
            tracing::info!(reason = %why, other = %self.other.kind(),
                "shm: off for peers prepared from now on");
            self.shm_off = Some(why);
        }
    }

    /// Why the target of `remote` (whose shm part is `shm`) is not on
    /// this host as shm needs it: another kernel (boot id), or another
    /// network namespace, whose abstract socket this side cannot reach.
    fn elsewhere(&self, remote: &Endpoint, shm: &Endpoint) -> Option<String> {
        let theirs = crate::ShmEndpoint::from_endpoint(shm).ok()?;
        if let Some(ours) = &self.boot_id {
            if theirs.boot_id != *ours {
                return Some(format!(
                    "the peer runs on another host (boot id {}, this host {ours})",
                    theirs.boot_id
                ));
            }
        }
        let their_ns = decode(remote).and_then(|w| w.netns)?;
        let ours = self.netns.as_deref()?;
        (their_ns != ours).then(|| {
            format!(
                "the peer is in another network namespace ({their_ns}, this side {ours}): \
                 its shm socket cannot be reached from here"
            )
        })
    }

    fn via_shm(&self, peer: PeerId) -> bool {
        self.routes.get(&peer).is_some_and(|r| r.via_shm)
    }

    /// Which backend takes all of a batch: `Some(true)` shm, `Some(false)`
    /// the other (and it is then the last one used), `Some(None)` both
    /// (each transfer goes its own way), `None` for an empty batch.
    fn one_side(&mut self, transfers: &[Transfer]) -> Option<Option<bool>> {
        let shm = self.via_shm(transfers.first()?.peer);
        if transfers.iter().all(|t| self.via_shm(t.peer) == shm) {
            self.last_shm = shm;
            return Some(Some(shm));
        }
        Some(None)
    }
}

impl Backend for SameHost {
    fn kind(&self) -> BackendKind {
        self.other.kind()
    }

    fn peer_kind(&self, peer: PeerId) -> BackendKind {
        if self.via_shm(peer) {
            BackendKind::Shm
        } else {
            self.other.peer_kind(peer)
        }
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        let ad = self.other.register(region)?;
        if let Some(why) = unserved(region, self.shm.attaches()) {
            self.turn_off(why);
        } else if let Err(e) = self.shm.register_as(region, Some(ad.key)) {
            self.turn_off(format!("registering {} with shm: {e}", region.id()));
        }
        Ok(ad)
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        // Not registered with shm when shm refused it.
        let _ = self.shm.deregister(region);
        self.other.deregister(region)
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let (peer, other) = self.other.prepare_peer()?;
        let mut route = Route::default();
        let endpoint = if self.shm_off.is_some() {
            other
        } else {
            match self.shm.prepare_peer_as(Some(peer)) {
                Ok((_, shm)) => {
                    route.shm_prepared = true;
                    encode(
                        &Wire {
                            magic: MAGIC.into(),
                            other: other.clone(),
                            shm,
                            netns: self.netns.clone(),
                        },
                        other.backend,
                    )?
                }
                Err(e) => {
                    tracing::info!(%peer, error = %e, "shm: no shm endpoint for this peer");
                    other
                }
            }
        };
        self.routes.insert(peer, route);
        Ok((peer, endpoint))
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let connected = self.start_connect(peer, remote, regions)?.run()?;
        self.finish_connect(peer, connected)
    }

    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        let route = *self.routes.get(&peer).ok_or(DataError::UnknownPeer(peer))?;
        let other_remote = other_part(remote).unwrap_or_else(|| remote.clone());
        let shm = match (&self.shm_off, shm_part(remote), route.shm_prepared) {
            (Some(why), _, _) => Err(format!("shm is off here: {why}")),
            (None, _, false) => Err("no shm endpoint was issued for this peer".to_owned()),
            (None, None, true) => {
                Err("the peer offers no shm endpoint (it runs shm off, or serves memory shm cannot serve)".to_owned())
            }
            (None, Some(ep), true) => match self.elsewhere(remote, &ep) {
                Some(why) => Err(why),
                None => self
                    .shm
                    .start_connect(peer, &ep, regions)
                    .map_err(|e| e.to_string()),
            },
        };
        let other = self.other.start_connect(peer, &other_remote, regions);
        let kind = self.other.kind();
        Ok(match shm {
            Ok(shm) => Connecting::new(move || {
                let why = match shm.run() {
                    Ok(c) => return Ok(Box::new(Made::Shm(c)) as Box<dyn std::any::Any + Send>),
                    Err(e) => format!("connecting over shm failed: {e}"),
                };
                tracing::info!(%peer, reason = %why, "shm: falling back to {kind}");
                let c = other?.run()?;
                Ok(Box::new(Made::Other(c, why)))
            }),
            Err(why) => {
                let other = other?;
                Connecting::new(move || {
                    let c = other.run()?;
                    Ok(Box::new(Made::Other(c, why)))
                })
            }
        })
    }

    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        let made = connected.take::<Made>().ok_or(DataError::BadEndpoint {
            backend: "shm",
            reason: "connect produced no connection".into(),
        })?;
        let Some(route) = self.routes.get_mut(&peer) else {
            return Err(DataError::UnknownPeer(peer));
        };
        match *made {
            Made::Shm(c) => {
                self.shm.finish_connect(peer, c)?;
                route.via_shm = true;
                tracing::info!(%peer, "shm: peer via shm (same host)");
            }
            Made::Other(c, why) => {
                self.other.finish_connect(peer, c)?;
                route.via_shm = false;
                tracing::info!(%peer, reason = %why, "shm: peer via {}", self.other.kind());
            }
        }
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerId) {
        if let Some(r) = self.routes.remove(&peer) {
            if r.shm_prepared {
                self.shm.remove_peer(peer);
            }
        }
        self.other.remove_peer(peer);
    }

    fn disconnect_peer(&mut self, peer: PeerId) -> bool {
        // An shm connection is not kept prepared across a disconnect: the
        // caller removes the peer instead.
        if self.routes.get(&peer).is_some_and(|r| r.shm_prepared) {
            return false;
        }
        self.other.disconnect_peer(peer)
    }

    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        self.last_shm = self.via_shm(transfer.peer);
        if self.last_shm {
            self.shm.submit(transfer)
        } else {
            self.other.submit(transfer)
        }
    }

    fn submit_at(&mut self, transfer: Transfer, now: Instant) -> Result<(), SubmitError> {
        self.last_shm = self.via_shm(transfer.peer);
        if self.last_shm {
            self.shm.submit_at(transfer, now)
        } else {
            self.other.submit_at(transfer, now)
        }
    }

    fn submit_batch(
        &mut self,
        transfers: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        match self.one_side(&transfers) {
            None => false,
            Some(Some(true)) => self.shm.submit_batch(transfers, results),
            Some(Some(false)) => self.other.submit_batch(transfers, results),
            Some(None) => backend::submit_each(self, transfers, results),
        }
    }

    fn submit_now(&mut self, transfer: Transfer, now: Instant) -> Result<Submitted, SubmitError> {
        self.last_shm = self.via_shm(transfer.peer);
        if self.last_shm {
            self.shm.submit_now(transfer, now)
        } else {
            self.other.submit_now(transfer, now)
        }
    }

    fn submit_batch_now(
        &mut self,
        transfers: Vec<Transfer>,
        now: Instant,
        results: &mut Vec<Result<Submitted, SubmitError>>,
    ) -> bool {
        match self.one_side(&transfers) {
            None => false,
            Some(Some(true)) => self.shm.submit_batch_now(transfers, now, results),
            Some(Some(false)) => self.other.submit_batch_now(transfers, now, results),
            Some(None) => backend::submit_each_now(self, transfers, now, results),
        }
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        let mut n = 0;
        if self.shm.in_flight() > 0 {
            n += self.shm.poll(completions);
        }
        n + self.other.poll(completions)
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        self.shm.poll_notifications(out) + self.other.poll_notifications(out)
    }

    fn in_flight(&self) -> usize {
        self.shm.in_flight() + self.other.in_flight()
    }

    fn set_waker(&mut self, waker: Waker) {
        self.shm.set_waker(waker.clone());
        self.other.set_waker(waker);
    }

    fn endpoint_per_peer(&self) -> bool {
        true
    }

    fn needs_busy_poll(&self) -> bool {
        self.other.needs_busy_poll()
    }

    fn poll_by(&self) -> Option<Instant> {
        // `None` from a backend with work in flight means "unknown": so is
        // the sum.
        let busy = |b: &dyn Backend| (b.in_flight() > 0).then(|| b.poll_by());
        match (busy(&self.shm), busy(self.other.as_ref())) {
            (Some(None), _) | (_, Some(None)) => None,
            (Some(Some(a)), Some(Some(b))) => Some(a.min(b)),
            (Some(Some(a)), None) | (None, Some(Some(a))) => Some(a),
            (None, None) => self.other.poll_by(),
        }
    }

    /// After a submission to a peer on shm: its copies are the poll's.
    fn completes_inline(&self) -> bool {
        self.last_shm
    }

    fn poll_after_submit(&self) -> bool {
        if self.last_shm {
            self.shm.poll_after_submit()
        } else {
            self.other.poll_after_submit()
        }
    }

    fn tcp_counters(&self) -> Option<crate::TcpCounters> {
        self.other.tcp_counters()
    }

    fn rail_stats(&self) -> Vec<crate::RailStats> {
        self.other.rail_stats()
    }

    fn link_up(&self) -> bool {
        self.other.link_up()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::{TcpBackend, TcpConfig};
    use crate::{Access, ShmConfig, ShmEndpoint};

    fn same_host() -> SameHost {
        SameHost::new(
            ShmBackend::new(ShmConfig::default()).unwrap(),
            Box::new(TcpBackend::new(TcpConfig::default()).unwrap()),
        )
    }

    #[test]
    fn unserved_names_memory_shm_cannot_serve_and_the_opt_in() {
        let shared = Region::alloc_shared(4096, Access::ALL).unwrap();
        let plain = Region::alloc(4096, Access::ALL).unwrap();
        let local = Region::alloc(4096, Access::LOCAL_WRITE).unwrap();
        assert_eq!(unserved(&shared, false), None);
        assert_eq!(
            unserved(&local, false),
            None,
            "no remote right: nothing to serve"
        );
        assert_eq!(
            unserved(&plain, true),
            None,
            "cross-memory attach serves it"
        );
        let why = unserved(&plain, false).expect("plain memory is not served");
        assert!(why.contains(&plain.id().to_string()), "{why}");
        assert!(why.contains("cross-memory attach"), "{why}");
        assert!(netns().is_some_and(|n| n.starts_with("net:[")));
    }

    /// `b` serves a shared region; `a` connects to the endpoint `b`
    /// prepared for it, as `edit` changes it, and the peer's kind is
    /// returned.
    fn connect_with(edit: impl FnOnce(&mut Wire)) -> BackendKind {
        let (mut a, mut b) = (same_host(), same_host());
        let r = Region::alloc_shared(4096, Access::ALL).unwrap();
        let ad = b.register(&r).unwrap();
        let (_, ep) = b.prepare_peer().unwrap();
        let mut w = decode(&ep).expect("a same-host endpoint");
        assert_eq!(w.netns, netns(), "the endpoint carries this namespace");
        edit(&mut w);
        let ep = encode(&w, ep.backend).unwrap();
        let (peer, _) = a.prepare_peer().unwrap();
        a.connect_peer(peer, &ep, &[ad]).unwrap();
        a.peer_kind(peer)
    }

    #[test]
    fn a_peer_in_another_network_namespace_or_host_gets_the_other_backend() {
        assert_eq!(connect_with(|_| {}), BackendKind::Shm);
        assert_eq!(
            connect_with(|w| w.netns = Some("net:[1]".into())),
            BackendKind::Tcp
        );
        let mut a = same_host();
        let (_, shm) = a.shm.prepare_peer().unwrap();
        let mut w = Wire {
            magic: MAGIC.into(),
            other: Endpoint {
                backend: BackendKind::Tcp,
                data: Vec::new(),
            },
            shm,
            netns: Some("net:[1]".into()),
        };
        let why = a.elsewhere(&encode(&w, BackendKind::Tcp).unwrap(), &w.shm);
        assert!(
            why.as_deref()
                .is_some_and(|w| w.contains("another network namespace")),
            "{why:?}"
        );
        // Another kernel is named as such, whatever the namespace says.
        let mut theirs = ShmEndpoint::from_endpoint(&w.shm).unwrap();
        theirs.boot_id = "another-boot".into();
        w.shm = theirs.to_endpoint();
        w.netns = a.netns.clone();
        let why = a.elsewhere(&encode(&w, BackendKind::Tcp).unwrap(), &w.shm);
        assert!(
            why.as_deref().is_some_and(|w| w.contains("another host")),
            "{why:?}"
        );
        // An endpoint without a namespace (an older peer) is tried.
        w.shm = ShmEndpoint::from_endpoint(&w.shm)
            .map(|mut e| {
                e.boot_id = a.boot_id.clone().unwrap();
                e.to_endpoint()
            })
            .unwrap();
        w.netns = None;
        assert_eq!(
            a.elsewhere(&encode(&w, BackendKind::Tcp).unwrap(), &w.shm),
            None
        );
    }
}
