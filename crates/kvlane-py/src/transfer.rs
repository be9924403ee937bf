//! [`Transfer`]: a posted transfer's handle — `wait(timeout)`, `done()`,
//! `status`, `await` — and its telemetry.

use crate::errors::{error_of, invalid};
use crate::runtime::{runtime, SLICE};
use kvlane::ErrorKind;
use pyo3::prelude::*;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Outcome = Result<(), (ErrorKind, String)>;

/// A transfer's state. The facade handle is polled in place (no task per
/// transfer): `wait` blocks on it with the GIL released, `done`/`status`
/// poll it once. Only a transfer someone awaits under asyncio (a done
/// callback) gets a task that drives it to its end.
#[derive(Default)]
struct State {
    /// `None` once it ended, or while a waiter or the watcher task holds it.
    handle: Option<kvlane::TransferHandle>,
    outcome: Option<Outcome>,
    xfer: Option<Duration>,
    callbacks: Vec<Py<PyAny>>,
    /// Threads blocked on `Shared::done`: it is signalled only for them
    /// (a signal is a system call even when nobody waits, and most
    /// transfers end unwatched, found done by a poll).
    waiting: usize,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    done: Condvar,
    posted: OnceInstant,
}

/// When the transfer was posted (set once, at creation).
#[derive(Default)]
struct OnceInstant(std::sync::OnceLock<Instant>);

impl Shared {
    /// Records the outcome; returns the callbacks to call (with the GIL).
    fn finish(&self, st: &mut State, r: Result<(), kvlane::Error>) -> Vec<Py<PyAny>> {
        st.outcome = Some(r.map_err(|e| (e.kind(), e.to_string())));
        st.xfer = self.posted.0.get().map(Instant::elapsed);
        if st.waiting > 0 {
            self.done.notify_all();
        }
        std::mem::take(&mut st.callbacks)
    }

    /// Polls the handle once (it is not waited on elsewhere).
    fn poll_now(&self) -> (Option<Outcome>, Vec<Py<PyAny>>) {
        let mut st = lock(&self.state);
        if st.outcome.is_none() {
            if let Some(h) = st.handle.as_mut() {
                let mut cx = Context::from_waker(Waker::noop());
                if let Poll::Ready(r) = Pin::new(h).poll(&mut cx) {
                    st.handle = None;
                    let cbs = self.finish(&mut st, r);
                    return (st.outcome.clone(), cbs);
                }
            }
        }
        (st.outcome.clone(), Vec::new())
    }

    /// Waits up to `slice` for the end (GIL released by the caller).
    fn wait_slice(&self, slice: Duration) -> (Option<Outcome>, Vec<Py<PyAny>>) {
        let mut st = lock(&self.state);
        if st.outcome.is_some() {
            return (st.outcome.clone(), Vec::new());
        }
        let Some(mut h) = st.handle.take() else {
            // Another waiter or the watcher drives it: wait for its word.
            st.waiting += 1;
            let (mut st, _) = self
                .done
                .wait_timeout_while(st, slice, |s| s.outcome.is_none())
                .unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
            return (st.outcome.clone(), Vec::new());
        };
        drop(st);
        let r = h.wait_timeout(slice);
        let mut st = lock(&self.state);
        match r {
            Some(r) => {
                let cbs = self.finish(&mut st, r);
                (st.outcome.clone(), cbs)
            }
            None => {
                st.handle = Some(h);
                (None, Vec::new())
            }
        }
    }
}

/// Drives the handle to its end in a task when callbacks wait for it and
/// nobody else holds it.
fn watch_if_needed(shared: &Arc<Shared>) {
    let h = {
        let mut st = lock(&shared.state);
        if st.callbacks.is_empty() {
            return;
        }
        match st.handle.take() {
            Some(h) => h,
            None => return,
        }
    };
    let s = shared.clone();
    runtime().spawn(async move {
        let r = h.await;
        let cbs = s.finish(&mut lock(&s.state), r);
        call(cbs);
    });
}

/// Calls done callbacks (taking the GIL).
fn call(callbacks: Vec<Py<PyAny>>) {
    if callbacks.is_empty() {
        return;
    }
    // After interpreter shutdown there is nobody left to call back.
    let _ = Python::try_attach(|py| {
        for cb in callbacks {
            if let Err(e) = cb.call0(py) {
                e.write_unraisable(py, None);
            }
        }
    });
}

/// Microseconds since the Unix epoch at `at`: the wall clock read once per
/// process, plus monotonic time since. A post reads the clock once for
/// its telemetry this way, not twice (on this project's 2-core VM a
/// clock read is 30-40 ns, and a Python post made ten of them); the
/// price is that a wall-clock step after the first post is not seen.
fn unix_us(at: Instant) -> u64 {
    static ANCHOR: std::sync::OnceLock<(SystemTime, Instant)> = std::sync::OnceLock::new();
    let (wall, mono) = *ANCHOR.get_or_init(|| (SystemTime::now(), Instant::now()));
    let t = match at.checked_duration_since(mono) {
        Some(after) => wall + after,
        None => wall - mono.duration_since(at),
    };
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

/// What one transfer cost (what vLLM's connector reports per transfer).
#[pyclass(module = "kvlane", frozen, get_all, name = "Telemetry")]
#[derive(Clone)]
pub(crate) struct Telemetry {
    /// When its prepare (its post, for a prepared transfer posted again)
    /// began, microseconds since the Unix epoch.
    start_time_us: u64,
    /// Time to prepare and post it, microseconds.
    post_us: u64,
    /// Time from post to completion, microseconds (0 while running).
    xfer_us: u64,
    /// Payload bytes.
    bytes: u64,
    /// Descriptors after merging contiguous runs.
    descriptors: u64,
}

impl Telemetry {
    /// A transfer whose prepare (or post) began at `started` and whose
    /// post returned at `posted`; its transfer time comes at its end.
    fn posted(started: Instant, posted: Instant, bytes: u64, descriptors: usize) -> Self {
        Self {
            start_time_us: unix_us(started),
            post_us: posted.saturating_duration_since(started).as_micros() as u64,
            xfer_us: 0,
            bytes,
            descriptors: descriptors as u64,
        }
    }
}

/// A posted transfer. `wait(timeout)` blocks (GIL released, Ctrl-C
/// interrupts) and returns `True` when it finished, `False` if it is still
/// running after `timeout` seconds, raising the transfer's error if it
/// failed; `await handle` works under asyncio. Every transfer ends by its
/// deadline. `release()` drops the handle (a running transfer still runs
/// to its end); any later call raises `InvalidInputError`.
#[pyclass(module = "kvlane", name = "Transfer")]
pub(crate) struct Transfer {
    shared: Arc<Shared>,
    /// Set by `release` (which takes `&self`: a release while another
    /// thread waits on the handle must not be a borrow error).
    released: AtomicBool,
    telemetry: Telemetry,
}

impl Transfer {
    /// Watches `handle`, whose prepare (or post) began at `started` and
    /// whose post returned at `posted`.
    pub(crate) fn watch(
        handle: kvlane::TransferHandle,
        started: Instant,
        posted: Instant,
        bytes: u64,
        descriptors: usize,
    ) -> Self {
        let shared = Arc::new(Shared::default());
        let _ = shared.posted.0.set(posted);
        lock(&shared.state).handle = Some(handle);
        Self {
            shared,
            released: AtomicBool::new(false),
            telemetry: Telemetry::posted(started, posted, bytes, descriptors),
        }
    }

    /// A transfer refused at its post (by a batch post, which answers
    /// every item): already ended with `error`.
    pub(crate) fn failed(
        error: kvlane::Error,
        started: Instant,
        bytes: u64,
        descriptors: usize,
    ) -> Self {
        let now = Instant::now();
        let shared = Arc::new(Shared::default());
        let _ = shared.posted.0.set(now);
        shared.finish(&mut lock(&shared.state), Err(error));
        Self {
            shared,
            released: AtomicBool::new(false),
            telemetry: Telemetry::posted(started, now, bytes, descriptors),
        }
    }

    fn shared(&self) -> PyResult<&Arc<Shared>> {
        if self.released.load(Ordering::Acquire) {
            return Err(invalid("this transfer handle was released"));
        }
        Ok(&self.shared)
    }

    fn outcome(&self) -> PyResult<Option<Outcome>> {
        let (outcome, callbacks) = self.shared()?.poll_now();
        call(callbacks);
        Ok(outcome)
    }
}

fn check(outcome: Outcome) -> PyResult<bool> {
    outcome.map(|()| true).map_err(|(k, m)| error_of(k, m))
}

#[pymethods]
impl Transfer {
    /// Waits up to `timeout` seconds (`None`: until it ends).
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        // Fast path, GIL held: a transfer that already ended (the common
        // case when a batch is waited on in order) costs one poll.
        if let Some(o) = self.outcome()? {
            return check(o);
        }
        let shared = self.shared()?.clone();
        let end = crate::events::wait_end(timeout);
        loop {
            let slice = match end {
                Some(end) => end.saturating_duration_since(Instant::now()).min(SLICE),
                None => SLICE,
            };
            let (outcome, callbacks) = py.detach(|| shared.wait_slice(slice));
            call(callbacks);
            watch_if_needed(&shared);
            if let Some(o) = outcome {
                return check(o);
            }
            if end.is_some_and(|e| Instant::now() >= e) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }

    /// NIXL's state word: `"DONE"`, `"ERR"`, or `"PROC"` while running.
    /// While running it also gives the CPU away once (`sched_yield`), the
    /// GIL kept: a caller that polls in a loop (what NIXL's API asks of
    /// engines) then leaves the core to the native threads that move the
    /// bytes (on 2 cores a spinning poller otherwise held one of them),
    /// and no other Python thread takes the GIL in between (a released
    /// GIL cost a poller 100 µs a call next to a busy Python thread).
    /// Never blocks, never sleeps.
    fn _poll_state(&self) -> PyResult<&'static str> {
        let state = |o: &Outcome| if o.is_ok() { "DONE" } else { "ERR" };
        if let Some(o) = self.outcome()? {
            return Ok(state(&o));
        }
        std::thread::yield_now();
        Ok(self.outcome()?.as_ref().map_or("PROC", state))
    }

    /// Whether the transfer ended (successfully or not).
    fn done(&self) -> PyResult<bool> {
        Ok(self.outcome()?.is_some())
    }

    /// `"pending"`, `"done"` or `"failed"`.
    #[getter]
    fn status(&self) -> PyResult<&'static str> {
        Ok(match self.outcome()? {
            None => "pending",
            Some(Ok(())) => "done",
            Some(Err(_)) => "failed",
        })
    }

    /// The transfer's error, if it failed (`None` while running or after
    /// success).
    fn error(&self) -> PyResult<Option<PyErr>> {
        Ok(match self.outcome()? {
            Some(Err((k, m))) => Some(error_of(k, m)),
            _ => None,
        })
    }

    /// Post time, transfer time, bytes and descriptor count.
    #[getter]
    fn telemetry(&self) -> PyResult<Telemetry> {
        self.outcome()?;
        let xfer = lock(&self.shared()?.state).xfer;
        Ok(Telemetry {
            xfer_us: xfer.map_or(0, |d| d.as_micros() as u64),
            ..self.telemetry.clone()
        })
    }

    /// Calls `callback()` (from a kvlane thread, or now if it ended).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let shared = self.shared()?.clone();
        if self.outcome()?.is_some() {
            return callback.call0(py).map(drop);
        }
        {
            let mut st = lock(&shared.state);
            if st.outcome.is_none() {
                st.callbacks.push(callback);
                drop(st);
                watch_if_needed(&shared);
                return Ok(());
            }
        }
        callback.call0(py).map(drop)
    }

    /// Drops the handle. Idempotent.
    fn release(&self) {
        self.released.store(true, Ordering::Release);
    }

    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("kvlane._aio")?
            .call_method1("await_transfer", (slf,))
    }

    fn __repr__(&self) -> String {
        let status = match self.outcome() {
            Err(_) => "released",
            Ok(None) => "pending",
            Ok(Some(Ok(()))) => "done",
            Ok(Some(Err(_))) => "failed",
        };
        format!(
            "Transfer(status={status}, bytes={}, descriptors={})",
            self.telemetry.bytes, self.telemetry.descriptors
        )
    }
}
