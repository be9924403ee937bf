//! Who runs when: the points of one block size (baselines and backends)
//! take turns in slices until each has had `--duration` and
//! [`MIN_BATCHES`] batches; a point measured on several threads runs them
//! at once.

use super::stats::Sample;
use super::BenchError;
use kvlane_data::Op;
use std::time::{Duration, Instant};

/// Every point runs at least this many batches, however short `--duration`.
pub(crate) const MIN_BATCHES: u32 = 3;

/// Longest stretch one point is measured without a break (one batch at
/// least). The points of one block size (baselines and backends) take
/// turns in slices this long until each has had `--duration` and
/// `MIN_BATCHES` batches, so a drift in the machine's speed (cache and
/// memory bandwidth shared with other tenants, clock frequency) reaches
/// every row of a comparison alike instead of whichever ran during it.
/// With 200 ms slices, the 64 KiB loopback/memcpy ratio of one run still
/// ranged 0.82-0.95 between runs; with 20 ms, 0.91-0.93.
pub(crate) const SLICE: Duration = Duration::from_millis(20);

/// Payload a slice moves at least, so that it moves many times the
/// last-level cache (32 MiB here). Past the caches, what one slice leaves
/// behind (dirty lines, most likely) costs the next slice, of another
/// point: with 20 ms slices alone (~240 MB at 1 MiB blocks) loopback WRITE
/// at 1 MiB read 0.90-1.00x memcpy over three runs, with this floor
/// 1.01-1.07x.
pub(crate) const SLICE_BYTES: u64 = 1 << 30;

/// Longest slice when `SLICE_BYTES` takes long (slow points, such as tcp
/// at small blocks).
pub(crate) const SLICE_MAX: Duration = Duration::from_millis(200);

/// A stretch of measuring one point: one batch and `time` at least, then
/// on until `batches` or `limit`, whichever comes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slice {
    pub(crate) time: Duration,
    pub(crate) batches: u64,
    pub(crate) limit: Duration,
}

/// A point measured through a shared transport (backend pairs, a peer,
/// raw-tcp streams): which operation, how many transfers a batch, and
/// what it measured so far.
pub(crate) struct Point {
    pub(crate) op: Op,
    pub(crate) batch: usize,
    pub(crate) sample: Sample,
}

impl Point {
    pub(crate) fn new(op: Op, batch: usize) -> Self {
        Self {
            op,
            batch,
            sample: Sample::default(),
        }
    }
}

impl Sample {
    /// The next slice a point with this sample (of `batch`es of `block`s)
    /// is owed: `SLICE` or what is left of `duration`, whichever is
    /// shorter, then on until it has moved `SLICE_BYTES`, or for `SLICE_MAX`
    /// or what is left; `None` once it has had `duration` and `MIN_BATCHES`
    /// batches.
    pub(crate) fn owed(&self, duration: Duration, block: u64, batch: usize) -> Option<Slice> {
        let had = Duration::from_secs_f64(self.secs);
        let batches = self.lat.len() / batch.max(1);
        if had >= duration && batches >= MIN_BATCHES as usize {
            return None;
        }
        let left = duration.saturating_sub(had);
        Some(Slice {
            time: left.min(SLICE),
            batches: SLICE_BYTES.div_ceil(block * batch as u64).max(1),
            limit: left.min(SLICE_MAX),
        })
    }
}

/// Gives the `contenders` of one block size slices, round after round,
/// until none is owed one. `sample` says what a contender measured so far
/// and its batch; `measure(c, slice, first)` measures one slice of `c`
/// (`first` in round 1, which warms a point up); `progress(round)` follows
/// every round.
pub(crate) fn rounds<C, E>(
    contenders: &mut [C],
    duration: Duration,
    block: u64,
    sample: impl Fn(&C) -> (&Sample, usize),
    mut measure: impl FnMut(&mut C, Slice, bool) -> Result<(), E>,
    mut progress: impl FnMut(u32),
) -> Result<(), E> {
    for round in 1.. {
        let mut owed = false;
        for c in contenders.iter_mut() {
            let (s, batch) = sample(c);
            let Some(slice) = s.owed(duration, block, batch) else {
                continue;
            };
            owed = true;
            measure(c, slice, round == 1)?;
        }
        if !owed {
            break;
        }
        progress(round);
    }
    Ok(())
}

/// Runs `batch` for `slice` (its time and its batches); the seconds it
/// took.
pub(crate) fn run_for<E>(slice: Slice, mut batch: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let start = Instant::now();
    let mut batches = 0;
    loop {
        batch()?;
        batches += 1;
        let took = start.elapsed();
        if took >= slice.time && (batches >= slice.batches || took >= slice.limit) {
            return Ok(took.as_secs_f64());
        }
    }
}

/// Measures `f` on every lane at once, one thread each, and merges the
/// lanes' samples ([`Sample::concurrent`]). A single lane is measured on
/// this thread, where the memcpy baseline runs too. With a new thread per
/// slice, the loopback point that followed the other loopback point lost
/// to the one that followed memcpy (64 KiB, six runs: READ 0.96-0.99x
/// memcpy, WRITE 0.90-0.96x); on this thread both read 0.94-0.95x in all
/// six. `who` names the lanes in the error of a panicked thread.
pub(crate) fn on_lanes<L: Send>(
    lanes: &mut [L],
    who: &str,
    f: impl Fn(&mut L) -> Result<Sample, BenchError> + Sync,
) -> Result<Sample, BenchError> {
    if let [lane] = lanes {
        return f(lane);
    }
    let f = &f;
    let samples = std::thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .iter_mut()
            .map(|l| scope.spawn(move || f(l)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BenchError::Failed {
                        backend: who.to_owned(),
                        what: "bench thread panicked".into(),
                    })
                })
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(Sample::concurrent(samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_owed_slices_until_they_had_duration_and_min_batches() {
        let duration = Duration::from_millis(50);
        let (block, batch) = (4096, 4);
        let mut s = Sample::default();
        // Long durations: slices stop at SLICE_MAX if the bytes take longer.
        let long = s.owed(Duration::from_secs(10), block, batch).unwrap();
        assert_eq!((long.time, long.limit), (SLICE, SLICE_MAX));
        let floor = SLICE_BYTES / (block * batch as u64);
        let slice = |ms, left| Slice {
            time: Duration::from_millis(ms),
            batches: floor,
            limit: Duration::from_millis(left),
        };
        assert_eq!(s.owed(duration, block, batch), Some(slice(20, 50)));
        // Large blocks: one batch is already past the byte floor.
        assert_eq!(s.owed(duration, 1 << 30, batch).map(|s| s.batches), Some(1));
        // 45 ms measured: only the rest is owed.
        s.secs = 0.045;
        s.lat = vec![Duration::ZERO; batch * MIN_BATCHES as usize];
        assert_eq!(s.owed(duration, block, batch), Some(slice(5, 5)));
        // The whole duration, but one batch short: one more slice.
        s.secs = 0.05;
        s.lat.truncate(batch * (MIN_BATCHES as usize - 1));
        assert_eq!(s.owed(duration, block, batch), Some(slice(0, 0)));
        s.lat.extend([Duration::ZERO; 4]);
        assert_eq!(s.owed(duration, block, batch), None);
    }

    #[test]
    fn rounds_interleave_contenders_until_none_is_owed() {
        // Two points of one batch each; every slice adds one batch and
        // 10 ms of "measured" time, so each is owed three slices.
        let mut points = [Point::new(Op::Read, 1), Point::new(Op::Write, 1)];
        let mut order = Vec::new();
        let mut progressed = Vec::new();
        rounds(
            &mut points,
            Duration::from_millis(30),
            4096,
            |p| (&p.sample, p.batch),
            |p, _slice, first| {
                order.push((p.op, first));
                p.sample.lat.push(Duration::ZERO);
                p.sample.secs += 0.01;
                Ok::<_, BenchError>(())
            },
            |round| progressed.push(round),
        )
        .unwrap();
        let (r, w) = (Op::Read, Op::Write);
        assert_eq!(
            order,
            [
                (r, true),
                (w, true),
                (r, false),
                (w, false),
                (r, false),
                (w, false)
            ]
        );
        assert_eq!(progressed, [1, 2, 3]);
    }
}
