//! The tokio runtime every agent of the process runs on, and blocking on
//! futures from Python: the GIL is released and signals are checked every
//! [`SLICE`], so Ctrl-C interrupts any wait.

use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// How often a blocked call wakes to check for signals (Ctrl-C).
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// The process's runtime: two workers (the agents' event tasks and
/// attaches; transfers run on each agent's progress thread).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvlane-py")
            .enable_all()
            .build()
            .expect("start the kvlane tokio runtime")
    })
}

/// Runs `fut` to completion with the GIL released, checking signals
/// between slices (a `KeyboardInterrupt` drops the future).
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut fut = Box::pin(fut);
    loop {
        let out = py.detach(|| {
            runtime().block_on(async { tokio::time::timeout(SLICE, &mut fut).await.ok() })
        });
        if let Some(v) = out {
            return Ok(v);
        }
        py.check_signals()?;
    }
}
