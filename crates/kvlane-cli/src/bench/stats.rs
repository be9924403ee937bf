//! Raw measurements of a point and the row they make: GB/s, latency
//! average and p99, preparation and posting cost per transfer.

use super::Row;
use std::time::Duration;

/// Raw measurements of one point (one thread, or several merged).
#[derive(Default)]
pub(crate) struct Sample {
    /// Post-to-completion time of every measured transfer.
    pub(crate) lat: Vec<Duration>,
    pub(crate) prepare: Duration,
    pub(crate) post: Duration,
    /// Wall time measured.
    pub(crate) secs: f64,
}

impl Sample {
    /// Adds a later slice of the same point (its wall time adds up).
    pub(crate) fn merge(&mut self, mut later: Self) {
        self.lat.append(&mut later.lat);
        self.prepare += later.prepare;
        self.post += later.post;
        self.secs += later.secs;
    }

    /// Samples of threads that ran at once, as one: their transfers add
    /// up, their wall time is the longest thread's.
    pub(crate) fn concurrent(samples: Vec<Self>) -> Self {
        let secs = samples.iter().map(|s| s.secs).fold(0.0, f64::max);
        let mut all = Self::default();
        for s in samples {
            all.merge(s);
        }
        all.secs = secs;
        all
    }

    /// The row of this sample (`op` as printed: `read`, `write`, `copy`).
    pub(crate) fn row(mut self, backend: &str, op: &str, block: u64, batch: usize) -> Row {
        let n = self.lat.len() as u64;
        let per = |d: Duration| {
            if n == 0 {
                0.0
            } else {
                d.as_secs_f64() * 1e6 / n as f64
            }
        };
        Row {
            backend: backend.into(),
            op: op.into(),
            block_size: block,
            batch,
            gbps: (n * block) as f64 / self.secs / 1e9,
            prepare_avg_us: per(self.prepare),
            post_avg_us: per(self.post),
            transfers: n,
            seconds: self.secs,
            ..latency(&mut self.lat)
        }
    }
}

/// Average and p99 of `lat`, as the latency fields of a row.
pub(crate) fn latency(lat: &mut [Duration]) -> Row {
    lat.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let avg = if lat.is_empty() {
        0.0
    } else {
        lat.iter().map(|&d| us(d)).sum::<f64>() / lat.len() as f64
    };
    let p99 = lat
        .get((lat.len() * 99 / 100).min(lat.len().saturating_sub(1)))
        .map_or(0.0, |&d| us(d));
    Row {
        backend: String::new(),
        memory: "host".into(),
        rails: 1,
        op: String::new(),
        block_size: 0,
        batch: 0,
        post: "each",
        gbps: 0.0,
        lat_avg_us: avg,
        lat_p99_us: p99,
        prepare_avg_us: 0.0,
        post_avg_us: 0.0,
        transfers: 0,
        seconds: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles() {
        let mut lat: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let r = latency(&mut lat);
        assert!((r.lat_avg_us - 50.5).abs() < 1e-6);
        assert!((r.lat_p99_us - 100.0).abs() < 1e-6);
    }

    #[test]
    fn concurrent_samples_add_transfers_and_take_the_longest_time() {
        let one = |n, secs| Sample {
            lat: vec![Duration::from_micros(10); n],
            secs,
            ..Sample::default()
        };
        let all = Sample::concurrent(vec![one(4, 0.5), one(6, 0.25)]);
        assert_eq!((all.lat.len(), all.secs), (10, 0.5));
        let r = all.row("x", "copy", 1000, 2);
        assert!((r.gbps - 10.0 * 1000.0 / 0.5 / 1e9).abs() < 1e-12, "{r:?}");
    }
}
