//! The tokio runtime every agent of the process runs on, and blocking on
//! futures from Python: the GIL is released and signals are checked every
//! [`SLICE`], so Ctrl-C interrupts any wait.

use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// How often a blocked call wakes to check for signals (Ctrl-C).
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// Where the runtime's threads run: set by the first `Agent` (its `cpus=`
/// or `KVLANE_CPUS`) before the runtime starts; later agents share the
/// runtime as it was placed.
static PLACEMENT: OnceLock<kvlane::CpuPlacement> = OnceLock::new();

/// Places the runtime's threads, if it has not started yet (see
/// [`PLACEMENT`]).
pub(crate) fn place(cpus: &kvlane::CpuPlacement) {
    let _ = PLACEMENT.get_or_init(|| cpus.clone());
}

/// The process's runtime: two workers (the agents' event tasks and
/// attaches; transfers run on each agent's progress thread). Its threads,
/// workers and blocking ones, apply the first agent's placement as they
/// start.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let cpus = PLACEMENT
            .get_or_init(|| {
                kvlane::CpuPlacement::from_env()
                    .ok()
                    .flatten()
                    .unwrap_or_default()
            })
            .clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvlane-py")
            .on_thread_start(move || cpus.clone().enter())
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
