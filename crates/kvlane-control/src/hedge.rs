//! Fresh connect attempts beside one that goes unanswered.
//!
//! A listener whose accept queue is full (a flood of connections) drops a
//! new SYN, and the kernel resends it only after its initial retransmission
//! timeout, 1 s on Linux. A fresh connect (a new socket, a new SYN) gets in
//! as soon as the queue has room. So a connect that has not finished
//! [`HEDGE_AFTER`] after its start gets a second one beside it, and so on
//! up to [`HEDGE_ATTEMPTS`]; the first to finish wins and the others are
//! dropped. The control dial does this inside zeromq
//! (`SocketOptions::hedged_connect`, connect and ZMTP greeting together);
//! the preflight probe with [`first_of`].

use std::future::Future;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};

/// How long a connect runs alone before a fresh one joins it; each later
/// gap doubles. Well above a connect (and ZMTP greeting) on the networks
/// kvlane runs on (loopback, a datacenter: under 10 ms even loaded), well
/// below the kernel's 1 s SYN resend.
pub(crate) const HEDGE_AFTER: Duration = Duration::from_millis(200);

/// Attempts one connect starts at most (the first included): at 0, 200
/// and 600 ms. Bounded so that a listener that is down or overloaded
/// sees at most this many from one connect; an attempt that fails (refused,
/// reset) starts none.
pub(crate) const HEDGE_ATTEMPTS: usize = 3;

/// Runs `attempt`, and runs it again beside the ones in flight when none
/// has finished [`HEDGE_AFTER`] later (then twice that gap after the last
/// start), [`HEDGE_ATTEMPTS`] times at most. Returns the first success
/// (the other attempts are dropped), or the last error once every attempt
/// started has failed: a failure starts no new attempt, so a refused
/// connect fails as fast as a single one.
pub(crate) async fn first_of<T, E, F, Fut>(mut attempt: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut running = FuturesUnordered::new();
    running.push(attempt());
    let mut started = 1;
    let mut gap = HEDGE_AFTER;
    let mut next_at = tokio::time::Instant::now() + gap;
    loop {
        let more = started < HEDGE_ATTEMPTS;
        let hedge_due = async {
            if more {
                tokio::time::sleep_until(next_at).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            Some(done) = running.next() => match done {
                Ok(v) => return Ok(v),
                Err(e) if running.is_empty() => return Err(e),
                Err(_) => {}
            },
            () = hedge_due => {
                running.push(attempt());
                started += 1;
                gap *= 2;
                next_at = tokio::time::Instant::now() + gap;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Attempts that never finish: a fresh one at 200 and 600 ms, no more.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_attempt_gets_two_fresh_ones_and_no_more() {
        let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t0 = tokio::time::Instant::now();
        let run = first_of(|| {
            starts.lock().unwrap().push(t0.elapsed());
            std::future::pending::<Result<(), ()>>()
        });
        assert!(tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .is_err());
        let starts = starts.lock().unwrap().clone();
        assert_eq!(
            starts,
            [0, 200, 600].map(Duration::from_millis).to_vec(),
            "attempts started at {starts:?}"
        );
    }

    /// The first attempt to succeed wins, even if it started later.
    #[tokio::test(start_paused = true)]
    async fn the_first_to_finish_wins() {
        let n = AtomicUsize::new(0);
        let r: Result<usize, ()> = first_of(|| {
            let i = n.fetch_add(1, Ordering::Relaxed);
            async move {
                if i == 0 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok(i)
            }
        })
        .await;
        assert_eq!(r, Ok(1));
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    /// A failure (a refused connect) starts no new attempt: one attempt,
    /// its error.
    #[tokio::test(start_paused = true)]
    async fn a_refused_attempt_fails_at_once() {
        let n = AtomicUsize::new(0);
        let t0 = tokio::time::Instant::now();
        let r: Result<(), &str> = first_of(|| {
            n.fetch_add(1, Ordering::Relaxed);
            async { Err("refused") }
        })
        .await;
        assert_eq!(r, Err("refused"));
        assert_eq!(n.load(Ordering::Relaxed), 1);
        assert_eq!(t0.elapsed(), Duration::ZERO);
    }

    /// An attempt that fails while another is in flight leaves the other
    /// to finish; the error comes only when all have failed.
    #[tokio::test(start_paused = true)]
    async fn the_error_comes_when_every_attempt_failed() {
        let n = AtomicUsize::new(0);
        let r: Result<(), usize> = first_of(|| {
            let i = n.fetch_add(1, Ordering::Relaxed);
            async move {
                // Each fails 1 s after its start (a reset, say).
                tokio::time::sleep(Duration::from_secs(1)).await;
                Err(i)
            }
        })
        .await;
        assert_eq!(r, Err(2), "the last attempt's error");
        assert_eq!(n.load(Ordering::Relaxed), HEDGE_ATTEMPTS);
    }
}
