//! The `memcpy` baseline: the same blocks copied by the CPU, on as many
//! threads as `--threads`: the loopback ceiling.

use super::pair::buffers;
use super::schedule::{on_lanes, run_for, Slice};
use super::stats::Sample;
use super::{BenchError, Row};
use kvlane_data::Region;
use std::time::{Duration, Instant};

/// One thread's copy: from `src` into `dst`, one `memcpy` per block.
struct Lane {
    src: Region,
    dst: Region,
}

/// `memcpy` of `batch` blocks per thread and batch, all threads at once.
pub(crate) struct MemcpyPoint {
    lanes: Vec<Lane>,
    block: u64,
    batch: usize,
    pool: u64,
    pub(crate) sample: Sample,
}

fn data(source: kvlane_data::DataError) -> BenchError {
    BenchError::Data {
        backend: "memcpy".into(),
        source,
    }
}

impl MemcpyPoint {
    /// `threads` lanes; lane `i` copies from the first of `buffers[i]` into
    /// the second, or between two new regions allocated like a backend
    /// pair's where `buffers` has no entry `i`.
    pub(crate) fn new(
        block: u64,
        batch: usize,
        pool: u64,
        threads: usize,
        buffers: &[(Region, Region)],
    ) -> Result<Self, BenchError> {
        let lanes = (0..threads.max(1))
            .map(|i| {
                let (src, dst) = match buffers.get(i) {
                    Some(b) => b.clone(),
                    None => self::buffers(block * pool).map_err(data)?,
                };
                Ok(Lane { src, dst })
            })
            .collect::<Result<_, BenchError>>()?;
        Ok(Self {
            lanes,
            block,
            batch,
            pool,
            sample: Sample::default(),
        })
    }

    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    /// One slice on every lane, after a warm-up batch in the `first`.
    pub(crate) fn slice(&mut self, slice: Slice, first: bool) -> Result<(), BenchError> {
        let (block, batch, pool) = (self.block, self.batch, self.pool);
        let s = on_lanes(&mut self.lanes, "memcpy", |lane| {
            if first {
                lane.copy_batch(block, batch, pool, &mut Vec::new())?;
            }
            let mut s = Sample::default();
            s.secs = run_for(slice, || lane.copy_batch(block, batch, pool, &mut s.lat))?;
            Ok(s)
        })?;
        self.sample.merge(s);
        Ok(())
    }

    pub(crate) fn row(self) -> Row {
        Row {
            post: "batch",
            ..self.sample.row("memcpy", "copy", self.block, self.batch)
        }
    }
}

impl Lane {
    /// Copies `batch` blocks; each block's latency is the time from the
    /// batch's start to the end of its copy.
    fn copy_batch(
        &self,
        block: u64,
        batch: usize,
        pool: u64,
        lat: &mut Vec<Duration>,
    ) -> Result<(), BenchError> {
        let t0 = Instant::now();
        for i in 0..batch as u64 {
            let off = (i % pool) * block;
            self.src.copy_to(off, &self.dst, off, block).map_err(data)?;
            lat.push(t0.elapsed());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice() -> Slice {
        Slice {
            time: Duration::ZERO,
            batches: 2,
            limit: Duration::from_secs(5),
        }
    }

    #[test]
    fn every_thread_copies_its_batches() {
        let mut m = MemcpyPoint::new(4096, 4, 4, 3, &[]).unwrap();
        m.slice(slice(), true).unwrap();
        // Three threads, two batches of four each (the warm-up not counted).
        assert_eq!(m.sample.lat.len(), 3 * 2 * 4);
        let lanes: Vec<_> = m.lanes.iter().map(|l| (l.src.id(), l.dst.id())).collect();
        assert!(lanes.iter().all(|&(s, d)| s != d));
        let r = m.row();
        assert!(r.gbps > 0.0 && r.transfers == 24, "{r:?}");
    }

    #[test]
    fn copies_the_given_buffers_and_reports_their_errors() {
        let (src, dst) = buffers(4096 * 2).unwrap();
        let mut m = MemcpyPoint::new(4096, 2, 2, 1, &[(src, dst.clone())]).unwrap();
        m.slice(slice(), false).unwrap();
        // The destination now holds the source's bytes.
        assert_eq!(dst.to_vec().unwrap(), vec![0xa5; 8192]);
        // Blocks past the end of the buffers fail the slice, naming memcpy.
        let (small, other) = buffers(4096).unwrap();
        let mut bad = MemcpyPoint::new(4096, 2, 2, 1, &[(small, other)]).unwrap();
        let e = bad.slice(slice(), false).unwrap_err();
        assert!(e.to_string().starts_with("memcpy"), "{e}");
    }
}
