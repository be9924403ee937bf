//! Keep-alive bookkeeping and the jittered exponential reconnect backoff.

use std::time::{Duration, Instant};

/// Liveness of a ready connection: counts unanswered pings.
#[derive(Debug, Clone)]
pub(crate) struct KeepAlive {
    /// Last time any frame arrived.
    pub(crate) last_heard: Instant,
    /// Pings sent since the last frame arrived.
    pub(crate) unanswered: u32,
    /// Next ping sequence number.
    pub(crate) next_seq: u64,
}

impl KeepAlive {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            last_heard: now,
            unanswered: 0,
            next_seq: 0,
        }
    }

    /// A frame arrived; returns whether the peer had been unanswered.
    pub(crate) fn heard(&mut self, now: Instant) -> bool {
        self.last_heard = now;
        let was = self.unanswered > 0;
        self.unanswered = 0;
        was
    }

    /// A ping goes out; returns its sequence number.
    pub(crate) fn ping(&mut self) -> u64 {
        self.unanswered += 1;
        self.next_seq += 1;
        self.next_seq
    }
}

/// Exponential backoff with full-range jitter in `[d/2, d]`, capped, driven
/// by a seeded SplitMix64 generator so simulations are deterministic.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    /// A backoff from `min` to `max` with jitter seeded by `seed`.
    pub fn new(min: Duration, max: Duration, seed: u64) -> Self {
        Self {
            min,
            max: max.max(min),
            attempt: 0,
            rng: seed,
        }
    }

    /// Resets to the first step.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Next delay: `min * 2^attempt`, capped at `max`, jittered into `[d/2, d]`.
    pub fn next_delay(&mut self) -> Duration {
        let exp = self.min.saturating_mul(1u32 << self.attempt.min(20));
        let capped = exp.min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = capped / 2;
        let span = u64::try_from((capped - half).as_nanos()).unwrap_or(u64::MAX);
        let jitter = if span == 0 {
            0
        } else {
            self.next_u64() % (span + 1)
        };
        half + Duration::from_nanos(jitter)
    }

    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered_deterministically() {
        let mut a = Backoff::new(Duration::from_millis(100), Duration::from_secs(5), 42);
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5), 42);
        let da: Vec<_> = (0..12).map(|_| a.next_delay()).collect();
        let db: Vec<_> = (0..12).map(|_| b.next_delay()).collect();
        assert_eq!(da, db);
        assert!(da[0] >= Duration::from_millis(50) && da[0] <= Duration::from_millis(100));
        assert!(da.iter().all(|d| *d <= Duration::from_secs(5)));
        assert!(da[11] >= Duration::from_millis(2500));
    }
}
