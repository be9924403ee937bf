//! Notifications and peer events as iterators: `recv(timeout)`,
//! `try_recv()`, `drain()`, blocking `for x in it` (GIL released, Ctrl-C
//! interrupts) and `async for x in it` (receives on an executor thread,
//! `kvlane._aio`). Iteration ends when the agent closes.

use crate::agent::Shared;
use crate::runtime::SLICE;
use kvlane::PeerEventKind;
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, Mutex};

/// A notification: who sent it and what it carries.
#[pyclass(module = "kvlane", frozen, get_all, name = "Notification")]
pub(crate) struct Notification {
    /// Engine id of the sender.
    sender: String,
    /// The payload.
    payload: Py<pyo3::types::PyBytes>,
}

#[pymethods]
impl Notification {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Notification(sender={:?}, payload={})",
            self.sender,
            self.payload.bind(py)
        )
    }
}

fn note(py: Python<'_>, n: kvlane::Notification) -> Notification {
    Notification {
        sender: n.from,
        payload: pyo3::types::PyBytes::new(py, &n.payload).unbind(),
    }
}

/// When a wait of `timeout` seconds from now ends: `None` (no end) for
/// `None`, and for a timeout past what the clock can hold (`inf`, `1e300`);
/// a negative or NaN timeout ends at once.
pub(crate) fn wait_end(timeout: Option<f64>) -> Option<Instant> {
    let t = timeout?;
    let d = Duration::try_from_secs_f64(t.max(0.0)).ok()?;
    Instant::now().checked_add(d)
}

/// Waits up to `timeout` (forever with `None`) in slices, for `poll`.
fn wait_for<T: Send, F>(py: Python<'_>, timeout: Option<f64>, mut poll: F) -> PyResult<Option<T>>
where
    F: FnMut(Duration) -> Option<Option<T>> + Send,
{
    let end = wait_end(timeout);
    loop {
        let slice = end.map_or(SLICE, |e| {
            e.saturating_duration_since(Instant::now()).min(SLICE)
        });
        match py.detach(|| poll(slice)) {
            // Ready or closed.
            Some(v) => return Ok(v),
            None if end.is_some_and(|e| Instant::now() >= e) => return Ok(None),
            None => py.check_signals()?,
        }
    }
}

/// The agent's notifications (one stream per agent; every call of
/// `Agent.notifications()` returns a view of it).
#[pyclass(module = "kvlane", name = "Notifications")]
pub(crate) struct Notifications {
    rx: Arc<Mutex<mpsc::Receiver<kvlane::Notification>>>,
    agent: Shared,
}

fn is_closed(agent: &Shared) -> bool {
    agent.lock().map(|a| a.is_none()).unwrap_or(true)
}

/// `__next__`: receives in slices until an item arrives or the agent closed.
fn until_closed<T>(
    agent: &Shared,
    mut recv: impl FnMut() -> PyResult<Option<T>>,
) -> PyResult<Option<T>> {
    loop {
        if let Some(x) = recv()? {
            return Ok(Some(x));
        }
        if is_closed(agent) {
            return Ok(None);
        }
    }
}

fn anext<'py>(slf: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    slf.py()
        .import("kvlane._aio")?
        .call_method1("anext_stream", (slf,))
}

impl Notifications {
    pub(crate) fn new(rx: Arc<Mutex<mpsc::Receiver<kvlane::Notification>>>, agent: Shared) -> Self {
        Self { rx, agent }
    }

    /// The next notification; `None` on timeout or when the stream closed.
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<kvlane::Notification>> {
        let rx = self.rx.clone();
        wait_for(py, timeout, move |slice| {
            crate::runtime::runtime().block_on(async {
                let mut rx = rx.lock().await;
                tokio::time::timeout(slice, rx.recv()).await.ok()
            })
        })
    }
}

#[pymethods]
impl Notifications {
    /// The next notification, waiting up to `timeout` seconds (`None`:
    /// until one arrives); `None` on timeout or when the agent closed.
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Notification>> {
        Ok(self.poll(py, timeout)?.map(|n| note(py, n)))
    }

    /// The next notification if one is waiting.
    fn try_recv(&self, py: Python<'_>) -> Option<Notification> {
        let mut rx = self.rx.try_lock().ok()?;
        rx.try_recv().ok().map(|n| note(py, n))
    }

    /// Every notification waiting now.
    fn drain(&self, py: Python<'_>) -> Vec<Notification> {
        let Ok(mut rx) = self.rx.try_lock() else {
            return Vec::new();
        };
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|n| note(py, n))
            .collect()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Notification>> {
        let n = until_closed(&self.agent, || self.poll(py, Some(SLICE.as_secs_f64())))?;
        Ok(n.map(|n| note(py, n)))
    }

    /// Whether the agent closed (the stream ends once drained).
    #[getter]
    fn closed(&self) -> bool {
        is_closed(&self.agent)
    }

    fn __aiter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __anext__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        anext(slf.into_any())
    }
}

/// What happened to a peer.
#[pyclass(module = "kvlane", frozen, get_all, name = "PeerEvent")]
pub(crate) struct PeerEvent {
    /// Connection id.
    peer: u64,
    /// The peer's address.
    addr: String,
    /// `"up"`, `"suspect"`, `"recovered"`, `"dead"`, `"restarted"`,
    /// `"refused"` or `"closed"`.
    kind: &'static str,
    /// Engine id (`up`), last error (`dead`), reason (`refused`), else `""`.
    detail: String,
}

#[pymethods]
impl PeerEvent {
    fn __repr__(&self) -> String {
        format!(
            "PeerEvent(peer={}, addr={:?}, kind={:?}, detail={:?})",
            self.peer, self.addr, self.kind, self.detail
        )
    }
}

fn event(e: kvlane::PeerEvent) -> PeerEvent {
    let (kind, detail) = match e.kind {
        PeerEventKind::Up { engine_id, .. } => ("up", engine_id),
        PeerEventKind::Suspect => ("suspect", String::new()),
        PeerEventKind::Recovered => ("recovered", String::new()),
        PeerEventKind::Dead {
            last_error,
            attempts,
        } => ("dead", format!("{last_error} (after {attempts} attempts)")),
        PeerEventKind::Restarted { old, new } => ("restarted", format!("{old:#x} -> {new:#x}")),
        PeerEventKind::Refused { reason } => ("refused", reason),
        PeerEventKind::Closed => ("closed", String::new()),
        _ => ("other", String::new()),
    };
    PeerEvent {
        peer: e.peer.0,
        addr: e.addr,
        kind,
        detail,
    }
}

/// Peer events from the moment `Agent.events()` was called.
#[pyclass(module = "kvlane", name = "PeerEvents")]
pub(crate) struct PeerEvents {
    rx: Arc<Mutex<broadcast::Receiver<kvlane::PeerEvent>>>,
    agent: Shared,
}

impl PeerEvents {
    pub(crate) fn new(rx: broadcast::Receiver<kvlane::PeerEvent>, agent: Shared) -> Self {
        Self {
            rx: Arc::new(Mutex::new(rx)),
            agent,
        }
    }
}

#[pymethods]
impl PeerEvents {
    /// The next event, waiting up to `timeout` seconds (`None`: until one
    /// arrives); `None` on timeout or when the agent closed. Events missed
    /// because this reader lagged are skipped.
    #[pyo3(signature = (timeout = None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PeerEvent>> {
        let rx = self.rx.clone();
        let got = wait_for(py, timeout, move |slice| {
            crate::runtime::runtime().block_on(async {
                let mut rx = rx.lock().await;
                loop {
                    match tokio::time::timeout(slice, rx.recv()).await {
                        Ok(Ok(e)) => return Some(Some(e)),
                        Ok(Err(broadcast::error::RecvError::Lagged(_))) => continue,
                        Ok(Err(broadcast::error::RecvError::Closed)) => return Some(None),
                        Err(_) => return None,
                    }
                }
            })
        })?;
        Ok(got.map(event))
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PeerEvent>> {
        until_closed(&self.agent, || self.recv(py, Some(SLICE.as_secs_f64())))
    }

    /// Whether the agent closed (the stream ends once drained).
    #[getter]
    fn closed(&self) -> bool {
        is_closed(&self.agent)
    }

    fn __aiter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __anext__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        anext(slf.into_any())
    }
}
