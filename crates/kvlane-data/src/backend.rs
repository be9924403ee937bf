//! The [`Backend`] trait: submit/poll one-sided transfers.

use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId};
use crate::memory::{Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Transfer};
use std::any::Any;
use std::task::Waker;
use std::time::Instant;

/// What became of a transfer handed to [`Backend::submit_now`] or
/// [`Backend::submit_batch_now`].
#[derive(Debug)]
pub enum Submitted {
    /// Queued: its completion comes from [`poll`](Backend::poll).
    Queued,
    /// Finished inside the call with this result (the backend did all of
    /// its work there: shm's copy, with no notification to wait for);
    /// `poll` never reports it.
    Done(Result<(), DataError>),
}

/// The part of connecting a peer that may wait on the network (dialing,
/// authenticating), returned by [`Backend::start_connect`] and run by the
/// caller **without** holding the backend, so that polling and posting for
/// other peers go on meanwhile. Its result goes back to
/// [`Backend::finish_connect`].
#[must_use = "a started connect does nothing until it is run and finished"]
pub struct Connecting {
    work: Option<Box<dyn FnOnce() -> Result<Connected, DataError> + Send>>,
}

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connecting")
            .field("pending", &self.work.is_some())
            .finish()
    }
}

impl Connecting {
    /// Nothing is left to do (the backend connected in `start_connect`).
    pub fn done() -> Self {
        Self { work: None }
    }

    /// `work` runs without the backend; what it returns is handed to
    /// [`Backend::finish_connect`].
    pub fn new(
        work: impl FnOnce() -> Result<Box<dyn Any + Send>, DataError> + Send + 'static,
    ) -> Self {
        Self {
            work: Some(Box::new(move || work().map(|v| Connected(Some(v))))),
        }
    }

    /// Does the slow part. Blocks for as long as the backend's connect
    /// timeout allows.
    pub fn run(self) -> Result<Connected, DataError> {
        match self.work {
            Some(work) => work(),
            None => Ok(Connected(None)),
        }
    }
}

/// What [`Connecting::run`] produced, for [`Backend::finish_connect`].
pub struct Connected(Option<Box<dyn Any + Send>>);

impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connected")
    }
}

impl Connected {
    /// The value the backend's work returned, if it is a `T`.
    pub fn take<T: Any>(self) -> Option<Box<T>> {
        self.0.and_then(|v| v.downcast::<T>().ok())
    }
}

/// A data-plane provider: registers memory and moves bytes with one-sided
/// READ and WRITE.
///
/// The trait is not async. [`submit`](Self::submit) never blocks: it
/// validates what it can locally and queues the work; every failure of
/// queued work (remote refusal, missed deadline, lost peer) comes back from
/// [`poll`](Self::poll) as a [`Completion`] with a typed error. A full
/// queue hands the transfer back ([`SubmitError::QueueFull`]). Every
/// submitted transfer completes exactly once, at the latest at its deadline
/// (provided `poll` keeps being called).
///
/// # Connecting two backends
///
/// Each side calls [`prepare_peer`](Self::prepare_peer), sends the
/// resulting [`Endpoint`] and its registered [`RemoteRegion`]s to the other
/// side (the control plane's handshake does this), and then calls
/// [`connect_peer`](Self::connect_peer) with what it received. Verbs needs a
/// queue pair per peer, hence the per-peer endpoint.
///
/// Connecting may wait on the network. A caller that shares the backend
/// with other work (a [`Transport`](crate::Transport)) connects in three
/// steps instead: [`start_connect`](Self::start_connect) (short, with the
/// backend), [`Connecting::run`] (slow, without it) and
/// [`finish_connect`](Self::finish_connect) (short, with it).
pub trait Backend: Send + 'static {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Which backend carries the transfers to `peer`: [`kind`](Self::kind)
    /// except for a backend that chooses per peer
    /// ([`SameHost`](crate::SameHost): shm to peers on this host).
    fn peer_kind(&self, peer: PeerId) -> BackendKind {
        let _ = peer;
        self.kind()
    }

    /// Makes `region` available to local transfers and serves it to peers
    /// with the region's remote rights; returns what to advertise.
    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError>;

    /// Stops serving `region`; later requests for its key are refused.
    ///
    /// The tcp, loopback and verbs backends return only once they no
    /// longer read or write the region's memory for peers' requests, also
    /// for requests accepted before (loopback copies under the region
    /// table's lock; tcp waits a grace period, then cuts what is left: see
    /// [`TcpBackend`](crate::TcpBackend)'s *Deregistration*; verbs
    /// deregisters the memory registration, which kills its rkey, after
    /// stopping its own transfers that still use the region: see
    /// `VerbsConfig::deregister_grace`), so memory registered with
    /// [`Region::from_raw`] may be freed once every clone of the region is
    /// dropped too.
    fn deregister(&mut self, region: RegionId) -> Result<(), DataError>;

    /// Reserves a peer slot and returns this side's endpoint for it.
    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError>;

    /// Connects a prepared peer to the remote endpoint; `regions` are the
    /// regions it advertised (used for initiator-side checks and addresses).
    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError>;

    /// Starts connecting a prepared peer: checks what can be checked at
    /// once and returns the part that may wait on the network. The default
    /// connects right away (backends whose connect does not wait).
    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        self.connect_peer(peer, remote, regions)?;
        Ok(Connecting::done())
    }

    /// Installs what a started connect produced. Fails with
    /// [`DataError::UnknownPeer`] (releasing what was connected) when the
    /// peer was removed meanwhile.
    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        let _ = (peer, connected);
        Ok(())
    }

    /// Drops a peer; its in-flight transfers complete with
    /// [`DataError::PeerLost`].
    fn remove_peer(&mut self, peer: PeerId);

    /// Queues a transfer. Never blocks.
    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError>;

    /// [`submit`](Self::submit) with the time the caller read just before
    /// (the transfer's submission time), for a backend that needs the
    /// time at submission: the posting path then reads the clock once per
    /// transfer, not once per layer. The default ignores `now`.
    fn submit_at(&mut self, transfer: Transfer, now: Instant) -> Result<(), SubmitError> {
        let _ = now;
        self.submit(transfer)
    }

    /// Queues several transfers, appending one result per transfer, in
    /// order, to `results`; returns whether any of them left something
    /// only `poll` moves on (what [`poll_after_submit`](Self::poll_after_submit)
    /// says of one). The same as [`submit`](Self::submit) for each (the
    /// default), except that a backend may hold their work back until the
    /// last one is planned and hand it on together (tcp: one hand-over per
    /// stream for the batch). Never blocks.
    fn submit_batch(
        &mut self,
        transfers: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        submit_each(self, transfers, results)
    }

    /// [`submit_at`](Self::submit_at) by a caller that takes the result at
    /// once when there is one: a backend that can finish the transfer
    /// inside the call (shm, when [`completes_inline`](Self::completes_inline):
    /// the copy, on this thread, with nothing outside the process to
    /// answer) does so, bounded as one `poll`'s work is, and returns
    /// [`Submitted::Done`] with the result; `poll` then never reports the
    /// transfer. Otherwise it is queued as `submit_at` queues it. The
    /// checks, the deadline and the failures are those of the queued way.
    /// Default: `submit_at`, always queued.
    fn submit_now(&mut self, transfer: Transfer, now: Instant) -> Result<Submitted, SubmitError> {
        self.submit_at(transfer, now).map(|()| Submitted::Queued)
    }

    /// [`submit_batch`](Self::submit_batch) as [`submit_now`](Self::submit_now)
    /// submits one transfer: one outcome per transfer, in order, appended
    /// to `results`; returns what `submit_batch` returns (something queued
    /// needs a `poll`). Default: `submit_batch`, every accepted transfer
    /// queued.
    fn submit_batch_now(
        &mut self,
        transfers: Vec<Transfer>,
        now: Instant,
        results: &mut Vec<Result<Submitted, SubmitError>>,
    ) -> bool {
        let _ = now;
        let mut queued = Vec::with_capacity(transfers.len());
        let due = self.submit_batch(transfers, &mut queued);
        results.extend(queued.into_iter().map(|r| r.map(|()| Submitted::Queued)));
        due
    }

    /// Makes progress and appends finished transfers to `completions`;
    /// returns how many were appended.
    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize;

    /// Appends notifications that arrived for this side; returns how many.
    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize;

    /// Transfers submitted and not yet returned by `poll`.
    fn in_flight(&self) -> usize;

    /// Registers a waker that the backend wakes when completions or
    /// notifications become ready from another thread. Backends whose
    /// progress happens only inside `poll` can ignore it.
    fn set_waker(&mut self, waker: Waker) {
        let _ = waker;
    }

    /// Whether each peer needs its own endpoint from
    /// [`prepare_peer`](Self::prepare_peer) (verbs: one queue pair per peer),
    /// so that endpoints must be exchanged per connection rather than
    /// advertised once in the handshake.
    fn endpoint_per_peer(&self) -> bool {
        false
    }

    /// Drops the connection to `peer` (its in-flight transfers complete
    /// with [`DataError::PeerLost`], as with
    /// [`remove_peer`](Self::remove_peer)) but keeps the peer prepared,
    /// with what it issued (tcp: the credential the remote presents to
    /// us), so that [`start_connect`](Self::start_connect) can connect it
    /// again to the same remote endpoint. Returns false, doing nothing,
    /// when the backend cannot (verbs: a queue pair in error needs a new
    /// one and a new endpoint exchange); then remove the peer instead.
    fn disconnect_peer(&mut self, peer: PeerId) -> bool {
        let _ = peer;
        false
    }

    /// Whether completions only appear by calling `poll` repeatedly while
    /// work is in flight (CQ polling), rather than being announced through
    /// the waker.
    fn needs_busy_poll(&self) -> bool {
        false
    }

    /// Whether, now, every completion, every failure and every arriving
    /// notification is announced through the waker (tcp: its I/O threads
    /// wake the driver), and nothing but [`poll_by`](Self::poll_by) needs
    /// a poll; asked after every poll. Then a pooled driver polls the
    /// backend when woken and at [`poll_by`](Self::poll_by) only, with
    /// work in flight or without (with none and no `poll_by`, it sleeps
    /// until woken): an idle agent takes no CPU from the engine. A
    /// deadline that `submit` makes earlier than the last `poll_by` must
    /// be told through [`poll_after_submit`](Self::poll_after_submit).
    /// Default `false`: the driver re-polls every 50 ms at least.
    fn announces_arrivals(&self) -> bool {
        false
    }

    /// For a backend that announces completions through the waker: the
    /// latest instant by which `poll` must run again even if nothing wakes
    /// the caller (its earliest deadline: only `poll` notices a transfer
    /// that timed out). `None` (the default): unknown, so a driver re-polls
    /// about every millisecond while work is in flight.
    fn poll_by(&self) -> Option<Instant> {
        None
    }

    /// Whether the last [`submit`](Self::submit) left something that only
    /// `poll` moves on: work it staged, a completion it queued, or a
    /// deadline earlier than [`poll_by`](Self::poll_by) said before. A
    /// driver is woken after a submission only when this is true (or it
    /// skipped the backend meanwhile). Default `true`: always.
    fn poll_after_submit(&self) -> bool {
        true
    }

    /// Whether the submitting thread should poll right after a
    /// submission, instead of waking the driver: the backend does a
    /// submitted transfer's work in `poll` and nothing outside the process
    /// has to answer (shm: a `memcpy`), so the thread that submitted it can
    /// do that work and resolve the handle without a hand-off to another
    /// thread and back. The driver is still woken when the poll cannot run
    /// there (the backend is held) or leaves work. Default `false`.
    fn completes_inline(&self) -> bool {
        false
    }

    /// Counters of the tcp target side (connections refused, requests
    /// served and refused), summed over the rails of a multi-rail tcp
    /// backend; `None` for other backends.
    fn tcp_counters(&self) -> Option<crate::TcpCounters> {
        None
    }

    /// What each rail carried, for a multi-rail backend
    /// ([`Rails`](crate::Rails)); empty for a single-device backend.
    fn rail_stats(&self) -> Vec<crate::RailStats> {
        Vec::new()
    }

    /// Whether the device's link is up now (verbs: its port is ACTIVE).
    /// [`Rails`](crate::Rails) reads it about every 100 ms: a rail whose
    /// link is down gets no new work, its connections are dropped (work in
    /// flight moves to the other rails) and it is paired again once the
    /// link is up. A wrapper backend must forward it. Default `true`: a
    /// backend with no link state of its own.
    fn link_up(&self) -> bool {
        true
    }

    /// Other addresses of `peer`'s process (the endpoints of its other
    /// rails) through which a failed connection may be fenced when the
    /// peer's own address cannot be reached: [`Rails`](crate::Rails) sets
    /// them on each of its rails. tcp uses them (see
    /// [`TcpBackend::fence_through_each_other`](crate::TcpBackend::fence_through_each_other));
    /// a wrapper backend must forward it. Default: ignored.
    fn set_fence_routes(&mut self, peer: PeerId, routes: &[Endpoint]) {
        let _ = (peer, routes);
    }
}

/// Submits `transfers` one at a time ([`Backend::submit`]), as the default
/// [`Backend::submit_batch`] does; for backends that deal a batch whole
/// only when it is all theirs, and one at a time otherwise.
pub(crate) fn submit_each<B: Backend + ?Sized>(
    b: &mut B,
    transfers: Vec<Transfer>,
    results: &mut Vec<Result<(), SubmitError>>,
) -> bool {
    let mut due = false;
    for t in transfers {
        results.push(b.submit(t));
        due |= b.poll_after_submit();
    }
    due
}

/// [`submit_each`] by [`Backend::submit_now`].
pub(crate) fn submit_each_now<B: Backend + ?Sized>(
    b: &mut B,
    transfers: Vec<Transfer>,
    now: Instant,
    results: &mut Vec<Result<Submitted, SubmitError>>,
) -> bool {
    let mut due = false;
    for t in transfers {
        results.push(b.submit_now(t, now));
        due |= b.poll_after_submit();
    }
    due
}
impl<B: Backend + ?Sized> Backend for Box<B> {
    fn kind(&self) -> BackendKind {
        (**self).kind()
    }
    fn peer_kind(&self, peer: PeerId) -> BackendKind {
        (**self).peer_kind(peer)
    }
    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        (**self).register(region)
    }
    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        (**self).deregister(region)
    }
    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        (**self).prepare_peer()
    }
    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        (**self).connect_peer(peer, remote, regions)
    }
    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        (**self).start_connect(peer, remote, regions)
    }
    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        (**self).finish_connect(peer, connected)
    }
    fn remove_peer(&mut self, peer: PeerId) {
        (**self).remove_peer(peer)
    }
    fn submit(&mut self, transfer: Transfer) -> Result<(), SubmitError> {
        (**self).submit(transfer)
    }
    fn submit_at(&mut self, transfer: Transfer, now: Instant) -> Result<(), SubmitError> {
        (**self).submit_at(transfer, now)
    }
    fn submit_batch(
        &mut self,
        transfers: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        (**self).submit_batch(transfers, results)
    }
    fn submit_now(&mut self, transfer: Transfer, now: Instant) -> Result<Submitted, SubmitError> {
        (**self).submit_now(transfer, now)
    }
    fn submit_batch_now(
        &mut self,
        transfers: Vec<Transfer>,
        now: Instant,
        results: &mut Vec<Result<Submitted, SubmitError>>,
    ) -> bool {
        (**self).submit_batch_now(transfers, now, results)
    }
    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        (**self).poll(completions)
    }
    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        (**self).poll_notifications(out)
    }
    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }
    fn set_waker(&mut self, waker: Waker) {
        (**self).set_waker(waker)
    }
    fn needs_busy_poll(&self) -> bool {
        (**self).needs_busy_poll()
    }
    fn poll_by(&self) -> Option<Instant> {
        (**self).poll_by()
    }
    fn announces_arrivals(&self) -> bool {
        (**self).announces_arrivals()
    }
    fn poll_after_submit(&self) -> bool {
        (**self).poll_after_submit()
    }
    fn completes_inline(&self) -> bool {
        (**self).completes_inline()
    }
    fn endpoint_per_peer(&self) -> bool {
        (**self).endpoint_per_peer()
    }
    fn disconnect_peer(&mut self, peer: PeerId) -> bool {
        (**self).disconnect_peer(peer)
    }
    fn tcp_counters(&self) -> Option<crate::TcpCounters> {
        (**self).tcp_counters()
    }
    fn rail_stats(&self) -> Vec<crate::RailStats> {
        (**self).rail_stats()
    }
    fn link_up(&self) -> bool {
        (**self).link_up()
    }
    fn set_fence_routes(&mut self, peer: PeerId, routes: &[Endpoint]) {
        (**self).set_fence_routes(peer, routes)
    }
}

/// Connects two backends to each other directly (both in this process):
/// the handshake the control plane does between processes. Returns
/// `(a's id for b, b's id for a)`.
pub fn connect_pair<A: Backend + ?Sized, B: Backend + ?Sized>(
    a: &mut A,
    a_regions: &[RemoteRegion],
    b: &mut B,
    b_regions: &[RemoteRegion],
) -> Result<(PeerId, PeerId), DataError> {
    let (a_peer, a_ep) = a.prepare_peer()?;
    let (b_peer, b_ep) = b.prepare_peer()?;
    a.connect_peer(a_peer, &b_ep, b_regions)?;
    b.connect_peer(b_peer, &a_ep, a_regions)?;
    Ok((a_peer, b_peer))
}
