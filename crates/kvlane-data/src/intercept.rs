//! Fault injection for tests: [`Intercept`] is a [`Backend`] that forwards
//! every call to an inner backend and lets hooks rewrite what comes back
//! (completions, notifications, link state, the endpoints it issues), so a
//! test can make a rail fail, a link read down, a peer send what it should
//! not or its peers dial through a proxy, on top of a real backend.

use crate::backend::{Backend, Connected, Connecting};
use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId};
use crate::memory::{Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Transfer};
use std::task::Waker;

type Hook<T> = Box<dyn FnMut(&mut [T]) + Send>;
type EndpointHook = Box<dyn FnMut(&mut Endpoint) + Send>;

/// `inner` with hooks on what it returns. Every other call is forwarded.
pub struct Intercept {
    inner: Box<dyn Backend>,
    completions: Option<Hook<Completion>>,
    notifications: Option<Hook<Notification>>,
    link: Option<Box<dyn Fn() -> bool + Send>>,
    batches: Option<Box<dyn FnMut(usize) + Send>>,
    endpoints: Option<EndpointHook>,
}

impl Intercept {
    /// Forwards everything to `inner`.
    pub fn new(inner: impl Backend) -> Self {
        Self {
            inner: Box::new(inner),
            completions: None,
            notifications: None,
            link: None,
            batches: None,
            endpoints: None,
        }
    }

    /// Calls `f` on the completions each `poll` returns.
    pub fn on_completions(mut self, f: impl FnMut(&mut [Completion]) + Send + 'static) -> Self {
        self.completions = Some(Box::new(f));
        self
    }

    /// Calls `f` on the notifications each `poll_notifications` returns.
    pub fn on_notifications(mut self, f: impl FnMut(&mut [Notification]) + Send + 'static) -> Self {
        self.notifications = Some(Box::new(f));
        self
    }

    /// Calls `f` with the length of each batch `submit_batch` is given
    /// (before the inner backend takes it).
    pub fn on_submit_batch(mut self, f: impl FnMut(usize) + Send + 'static) -> Self {
        self.batches = Some(Box::new(f));
        self
    }

    /// Calls `f` on the endpoint each `prepare_peer` issues (to have the
    /// peer dial a proxy, say).
    pub fn on_endpoint(mut self, f: impl FnMut(&mut Endpoint) + Send + 'static) -> Self {
        self.endpoints = Some(Box::new(f));
        self
    }

    /// `link_up` is false while `down` says so (and the inner link is up).
    pub fn link_down_when(mut self, down: impl Fn() -> bool + Send + 'static) -> Self {
        self.link = Some(Box::new(down));
        self
    }
}

impl Backend for Intercept {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn peer_kind(&self, p: PeerId) -> BackendKind {
        self.inner.peer_kind(p)
    }
    fn register(&mut self, r: &Region) -> Result<RemoteRegion, DataError> {
        self.inner.register(r)
    }
    fn deregister(&mut self, r: RegionId) -> Result<(), DataError> {
        self.inner.deregister(r)
    }
    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let (id, mut ep) = self.inner.prepare_peer()?;
        if let Some(f) = &mut self.endpoints {
            f(&mut ep);
        }
        Ok((id, ep))
    }
    fn connect_peer(
        &mut self,
        p: PeerId,
        e: &Endpoint,
        r: &[RemoteRegion],
    ) -> Result<(), DataError> {
        self.inner.connect_peer(p, e, r)
    }
    fn start_connect(
        &mut self,
        p: PeerId,
        e: &Endpoint,
        r: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        self.inner.start_connect(p, e, r)
    }
    fn finish_connect(&mut self, p: PeerId, c: Connected) -> Result<(), DataError> {
        self.inner.finish_connect(p, c)
    }
    fn remove_peer(&mut self, p: PeerId) {
        self.inner.remove_peer(p)
    }
    fn disconnect_peer(&mut self, p: PeerId) -> bool {
        self.inner.disconnect_peer(p)
    }
    fn submit(&mut self, t: Transfer) -> Result<(), SubmitError> {
        self.inner.submit(t)
    }
    fn submit_at(&mut self, t: Transfer, now: std::time::Instant) -> Result<(), SubmitError> {
        self.inner.submit_at(t, now)
    }
    // `submit_now` and `submit_batch_now` keep their defaults (queued,
    // through `submit_at` and `submit_batch`): every completion then comes
    // from `poll`, where the hook sees it.
    fn submit_batch(
        &mut self,
        ts: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        if let Some(f) = &mut self.batches {
            f(ts.len());
        }
        self.inner.submit_batch(ts, results)
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let start = out.len();
        let n = self.inner.poll(out);
        if let Some(f) = &mut self.completions {
            f(&mut out[start..]);
        }
        n
    }
    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        let start = out.len();
        let n = self.inner.poll_notifications(out);
        if let Some(f) = &mut self.notifications {
            f(&mut out[start..]);
        }
        n
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn set_waker(&mut self, w: Waker) {
        self.inner.set_waker(w)
    }
    fn endpoint_per_peer(&self) -> bool {
        self.inner.endpoint_per_peer()
    }
    fn needs_busy_poll(&self) -> bool {
        self.inner.needs_busy_poll()
    }
    fn announces_arrivals(&self) -> bool {
        self.inner.announces_arrivals()
    }
    fn poll_by(&self) -> Option<std::time::Instant> {
        self.inner.poll_by()
    }
    fn poll_after_submit(&self) -> bool {
        self.inner.poll_after_submit()
    }

    fn completes_inline(&self) -> bool {
        self.inner.completes_inline()
    }
    fn link_up(&self) -> bool {
        self.inner.link_up() && !self.link.as_ref().is_some_and(|down| down())
    }
    fn set_fence_routes(&mut self, peer: PeerId, routes: &[Endpoint]) {
        self.inner.set_fence_routes(peer, routes)
    }
    fn tcp_counters(&self) -> Option<crate::TcpCounters> {
        self.inner.tcp_counters()
    }
    fn rail_stats(&self) -> Vec<crate::RailStats> {
        self.inner.rail_stats()
    }
}
