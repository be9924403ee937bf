//! [`Transfer`]: a posted transfer's handle — `wait(timeout)`, `done()`,
//! `status`, `await` — and its telemetry.

use crate::errors::{error_of, invalid};
use crate::runtime::{runtime, SLICE};
use kvlane::ErrorKind;
use pyo3::prelude::*;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Outcome = Result<(), (ErrorKind, String)>;

#[derive(Default)]
struct State {
    outcome: Option<Outcome>,
    xfer: Option<Duration>,
    callbacks: Vec<Py<PyAny>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    done: Condvar,
}

/// What one transfer cost (what vLLM's connector reports per transfer).
#[pyclass(module = "kvlane", frozen, get_all, name = "Telemetry")]
#[derive(Clone)]
pub(crate) struct Telemetry {
    /// When it was posted, microseconds since the Unix epoch.
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

/// A posted transfer. `wait(timeout)` blocks (GIL released, Ctrl-C
/// interrupts) and returns `True` when it finished, `False` if it is still
/// running after `timeout` seconds, raising the transfer's error if it
/// failed; `await handle` works under asyncio. Every transfer ends by its
/// deadline. `release()` drops the handle (a running transfer still runs
/// to its end); any later call raises `InvalidInputError`.
#[pyclass(module = "kvlane", name = "Transfer")]
pub(crate) struct Transfer {
    shared: Option<Arc<Shared>>,
    telemetry: Telemetry,
}

impl Transfer {
    /// Watches `handle`, posted at `started` after `post` of preparing and
    /// posting.
    pub(crate) fn watch(
        handle: kvlane::TransferHandle,
        started: (SystemTime, Instant),
        post: Duration,
        bytes: u64,
        descriptors: usize,
    ) -> Self {
        let shared = Arc::new(Shared::default());
        let posted = started.1 + post;
        let s = shared.clone();
        runtime().spawn(async move {
            let r = handle.await.map_err(|e| (e.kind(), e.to_string()));
            let callbacks = {
                let mut st = lock(&s.state);
                st.outcome = Some(r);
                st.xfer = Some(posted.elapsed());
                std::mem::take(&mut st.callbacks)
            };
            s.done.notify_all();
            if !callbacks.is_empty() {
                Python::attach(|py| {
                    for cb in callbacks {
                        if let Err(e) = cb.call0(py) {
                            e.write_unraisable(py, None);
                        }
                    }
                });
            }
        });
        let start_time_us = started
            .0
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        Self {
            shared: Some(shared),
            telemetry: Telemetry {
                start_time_us,
                post_us: post.as_micros() as u64,
                xfer_us: 0,
                bytes,
                descriptors: descriptors as u64,
            },
        }
    }

    fn shared(&self) -> PyResult<&Arc<Shared>> {
        self.shared
            .as_ref()
            .ok_or_else(|| invalid("this transfer handle was released"))
    }

    fn outcome(&self) -> PyResult<Option<Outcome>> {
        Ok(lock(&self.shared()?.state).outcome.clone())
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
        let shared = self.shared()?.clone();
        let end = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            let slice = match end {
                Some(end) => end.saturating_duration_since(Instant::now()).min(SLICE),
                None => SLICE,
            };
            let outcome = py.detach(|| {
                let st = lock(&shared.state);
                let (st, _) = shared
                    .done
                    .wait_timeout_while(st, slice, |s| s.outcome.is_none())
                    .unwrap_or_else(|e| e.into_inner());
                st.outcome.clone()
            });
            if let Some(o) = outcome {
                return check(o);
            }
            if end.is_some_and(|e| Instant::now() >= e) {
                return Ok(false);
            }
            py.check_signals()?;
        }
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
        let xfer = lock(&self.shared()?.state).xfer;
        Ok(Telemetry {
            xfer_us: xfer.map_or(0, |d| d.as_micros() as u64),
            ..self.telemetry.clone()
        })
    }

    /// Calls `callback()` (from a kvlane thread, or now if it ended).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let shared = self.shared()?;
        {
            let mut st = lock(&shared.state);
            if st.outcome.is_none() {
                st.callbacks.push(callback);
                return Ok(());
            }
        }
        callback.call0(py).map(drop)
    }

    /// Drops the handle. Idempotent.
    fn release(&mut self) {
        self.shared = None;
    }

    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("kvlane._aio")?
            .call_method1("await_transfer", (slf,))
    }

    fn __repr__(&self) -> String {
        let status = match &self.shared {
            None => "released",
            Some(s) => match &lock(&s.state).outcome {
                None => "pending",
                Some(Ok(())) => "done",
                Some(Err(_)) => "failed",
            },
        };
        format!(
            "Transfer(status={status}, bytes={}, descriptors={})",
            self.telemetry.bytes, self.telemetry.descriptors
        )
    }
}
