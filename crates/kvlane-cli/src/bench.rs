//! `kvlane bench`: throughput and latency of batched one-sided transfers,
//! with same-run baselines (`memcpy`, `raw-tcp`).
//!
//! Each point posts `batch` transfers of one block each, then polls until
//! all completed, and repeats for `--duration`. Reported per point: payload
//! GB/s (10^9 bytes/s), average and p99 latency of a transfer from post to
//! completion, and the average cost of preparing (building descriptors) and
//! posting (`submit`) one transfer.

use crate::units::fmt_size;
use kvlane_data::{
    connect_pair, Access, Backend, BackendKind, Completion, Descriptor, Op, Region,
    RemoteDescriptor, SubmitError, Transfer, TransferId,
};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

/// Upper bound of the memory one side of a point uses; larger batches
/// reuse blocks cyclically (16 MiB x 128 would otherwise need 2 GiB a side).
const POOL_CAP: u64 = 512 << 20;
/// Every point runs at least this many batches, however short `--duration`.
const MIN_BATCHES: u32 = 3;

/// What to measure.
#[derive(Clone, Debug)]
pub(crate) struct BenchPlan {
    pub(crate) backends: Vec<BackendKind>,
    pub(crate) ops: Vec<Op>,
    pub(crate) block_sizes: Vec<u64>,
    pub(crate) batches: Vec<usize>,
    pub(crate) duration: Duration,
    pub(crate) baselines: bool,
    /// Initiator threads, each with its own backend pair (in-process runs).
    pub(crate) threads: usize,
}

/// One measured point; also the JSON schema of `--json` (one per line).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) backend: String,
    pub(crate) op: String,
    pub(crate) block_size: u64,
    pub(crate) batch: usize,
    pub(crate) gbps: f64,
    pub(crate) lat_avg_us: f64,
    pub(crate) lat_p99_us: f64,
    pub(crate) prepare_avg_us: f64,
    pub(crate) post_avg_us: f64,
    pub(crate) transfers: u64,
    pub(crate) seconds: f64,
}

/// Why a point could not be measured.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    #[error("{backend} backend: {source}")]
    Data {
        backend: String,
        #[source]
        source: kvlane_data::DataError,
    },
    #[error("{backend}: {what}")]
    Failed { backend: String, what: String },
    #[error("raw-tcp baseline: {0}")]
    Io(#[from] std::io::Error),
}

/// Creates one backend of `kind`.
pub(crate) type Factory = dyn Fn(BackendKind) -> Result<Box<dyn Backend>, BenchError>;

/// Runs the whole plan, calling `emit` for each row as soon as it is measured.
pub(crate) fn run(
    plan: &BenchPlan,
    factory: &Factory,
    mut progress: impl FnMut(&str),
    mut emit: impl FnMut(&Row),
) -> Result<(), BenchError> {
    let max_batch = plan.batches.iter().copied().max().unwrap_or(1);
    for &block in &plan.block_sizes {
        let pool = pool_blocks(block, max_batch);
        if plan.baselines {
            for &batch in &plan.batches {
                progress(&format!("memcpy {} x{batch}", fmt_size(block)));
                emit(&memcpy_point(block, batch, pool, plan.duration));
            }
        }
        if plan.baselines && plan.backends.contains(&BackendKind::Tcp) {
            for &batch in &plan.batches {
                progress(&format!("raw-tcp {} x{batch}", fmt_size(block)));
                emit(&raw_tcp_point(block, batch, plan.duration)?);
            }
        }
        for &kind in &plan.backends {
            let mut pairs = (0..plan.threads.max(1))
                .map(|_| Pair::new(factory, kind, block, pool))
                .collect::<Result<Vec<_>, _>>()?;
            for &op in &plan.ops {
                for &batch in &plan.batches {
                    progress(&format!("{kind} {op} {} x{batch}", fmt_size(block)));
                    emit(&point(&mut pairs, op, batch, plan.duration)?);
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn pool_blocks(block: u64, batch: usize) -> u64 {
    (POOL_CAP / block).clamp(1, batch as u64)
}

struct Pair {
    kind: BackendKind,
    init: Box<dyn Backend>,
    target: Box<dyn Backend>,
    peer: kvlane_data::PeerId,
    local: Region,
    key: kvlane_data::RemoteKey,
    block: u64,
    pool: u64,
    next_id: u64,
    busy: bool,
    _remote: Region,
}

/// Wakes the benchmark thread when the backend announces completions.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

impl Pair {
    fn new(
        factory: &Factory,
        kind: BackendKind,
        block: u64,
        pool: u64,
    ) -> Result<Self, BenchError> {
        let data = |source| BenchError::Data {
            backend: kind.to_string(),
            source,
        };
        let mut init = factory(kind)?;
        let mut target = factory(kind)?;
        let len = (block * pool) as usize;
        let local = Region::alloc(len, Access::ALL).map_err(data)?;
        let remote = Region::alloc(len, Access::ALL).map_err(data)?;
        // Touch every page so first-use faults stay out of the timings.
        local.fill(0, len as u64, 0xa5).map_err(data)?;
        remote.fill(0, len as u64, 0x5a).map_err(data)?;
        let l = init.register(&local).map_err(data)?;
        let r = target.register(&remote).map_err(data)?;
        let (peer, _) = connect_pair(&mut *init, &[l], &mut *target, &[r]).map_err(data)?;
        Ok(Self {
            kind,
            init,
            target,
            peer,
            local,
            key: r.key,
            block,
            pool,
            next_id: 1,
            busy: false,
            _remote: remote,
        })
    }

    fn measure(&mut self, op: Op, batch: usize, duration: Duration) -> Result<Sample, BenchError> {
        // Completions from the backend's own threads wake this one.
        self.init
            .set_waker(Waker::from(Arc::new(Unpark(std::thread::current()))));
        self.busy = self.init.needs_busy_poll();
        let mut s = Sample::default();
        let (mut p0, mut p1) = (Duration::ZERO, Duration::ZERO);
        self.batch(op, batch, &mut Vec::new(), &mut p0, &mut p1)?; // warm-up
        let start = Instant::now();
        let mut batches = 0;
        while batches < MIN_BATCHES || start.elapsed() < duration {
            self.batch(op, batch, &mut s.lat, &mut s.prepare, &mut s.post)?;
            batches += 1;
        }
        s.secs = start.elapsed().as_secs_f64();
        Ok(s)
    }

    /// Posts one batch and polls until every transfer completed.
    fn batch(
        &mut self,
        op: Op,
        batch: usize,
        lat: &mut Vec<Duration>,
        prepare: &mut Duration,
        post: &mut Duration,
    ) -> Result<(), BenchError> {
        // Ids are `base + i`, so the post time of a completion is an index.
        let base = self.next_id;
        self.next_id += batch as u64;
        let mut posted: Vec<Option<Instant>> = vec![None; batch];
        let mut done: Vec<Completion> = Vec::with_capacity(batch);
        let mut finished = 0;
        // Prepare the whole batch, then post it: two clock reads for the
        // batch's preparation and one per post (its timestamp), so the
        // measurement itself stays out of the per-transfer cost.
        let t0 = Instant::now();
        // One deadline for the batch (one clock read, not one per transfer).
        let deadline = t0 + kvlane_data::DEFAULT_DEADLINE;
        let transfers: Vec<Transfer> = (0..batch)
            .map(|i| {
                let off = (i as u64 % self.pool) * self.block;
                Transfer {
                    id: TransferId(base + i as u64),
                    peer: self.peer,
                    op,
                    local: vec![Descriptor {
                        region: self.local.id(),
                        offset: off,
                        len: self.block,
                    }],
                    remote: vec![RemoteDescriptor {
                        key: self.key,
                        offset: off,
                        len: self.block,
                    }],
                    notify: None,
                    deadline,
                }
            })
            .collect();
        let mut last = Instant::now();
        *prepare += last - t0;
        for mut t in transfers {
            loop {
                let id = t.id;
                match self.init.submit(t) {
                    Ok(()) => {
                        let now = Instant::now();
                        *post += now - last;
                        last = now;
                        posted[(id.0 - base) as usize] = Some(now);
                        break;
                    }
                    Err(SubmitError::QueueFull { transfer, .. }) => {
                        t = *transfer;
                        finished += self.collect(&mut done, base, &mut posted, lat)?;
                        last = Instant::now();
                    }
                    Err(e) => return Err(self.failed(format!("submit: {e}"))),
                }
            }
        }
        let end = Instant::now() + Duration::from_secs(120);
        while finished < batch {
            finished += self.collect(&mut done, base, &mut posted, lat)?;
            if Instant::now() > end {
                return Err(self.failed(format!("{} transfers did not complete", batch - finished)));
            }
        }
        Ok(())
    }

    fn collect(
        &mut self,
        done: &mut Vec<Completion>,
        base: u64,
        posted: &mut [Option<Instant>],
        lat: &mut Vec<Duration>,
    ) -> Result<usize, BenchError> {
        done.clear();
        let n = self.init.poll(done);
        self.target.poll(&mut Vec::new());
        let now = Instant::now();
        for c in done.drain(..) {
            if let Err(e) = c.result {
                return Err(self.failed(format!("{}: {e}", c.id)));
            }
            let slot =
                c.id.0
                    .checked_sub(base)
                    .and_then(|i| posted.get_mut(i as usize));
            if let Some(t) = slot.and_then(Option::take) {
                lat.push(now - t);
            }
        }
        if n == 0 {
            if self.busy {
                // Completion-queue polling: keep asking, but let other
                // threads run on this 2-core-sized world.
                std::thread::yield_now();
            } else {
                // Spinning here would steal the CPU the backend's I/O
                // threads need; they wake us when something completes.
                std::thread::park_timeout(Duration::from_micros(500));
            }
        }
        Ok(n)
    }

    fn failed(&self, what: String) -> BenchError {
        BenchError::Failed {
            backend: self.kind.to_string(),
            what,
        }
    }
}

/// Raw measurements of one point on one thread.
#[derive(Default)]
pub(crate) struct Sample {
    pub(crate) lat: Vec<Duration>,
    pub(crate) prepare: Duration,
    pub(crate) post: Duration,
    pub(crate) secs: f64,
}

impl Sample {
    /// The row for samples taken concurrently (bytes add up; the wall
    /// time is the longest thread's).
    pub(crate) fn row(
        mut samples: Vec<Self>,
        backend: &str,
        op: Op,
        block: u64,
        batch: usize,
    ) -> Row {
        let secs = samples.iter().map(|s| s.secs).fold(0.0, f64::max);
        let mut lat: Vec<Duration> = samples.iter_mut().flat_map(|s| s.lat.drain(..)).collect();
        let prepare: Duration = samples.iter().map(|s| s.prepare).sum();
        let post: Duration = samples.iter().map(|s| s.post).sum();
        let n = lat.len() as u64;
        let per = |d: Duration| {
            if n == 0 {
                0.0
            } else {
                d.as_secs_f64() * 1e6 / n as f64
            }
        };
        Row {
            backend: backend.into(),
            op: op_name(op).into(),
            block_size: block,
            batch,
            gbps: (n * block) as f64 / secs / 1e9,
            prepare_avg_us: per(prepare),
            post_avg_us: per(post),
            transfers: n,
            seconds: secs,
            ..latency(&mut lat)
        }
    }
}

/// Measures one point on every pair at once, one thread each.
fn point(pairs: &mut [Pair], op: Op, batch: usize, duration: Duration) -> Result<Row, BenchError> {
    let (kind, block) = (pairs[0].kind, pairs[0].block);
    let samples = std::thread::scope(|scope| {
        let handles: Vec<_> = pairs
            .iter_mut()
            .map(|p| scope.spawn(move || p.measure(op, batch, duration)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BenchError::Failed {
                        backend: kind.to_string(),
                        what: "bench thread panicked".into(),
                    })
                })
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(Sample::row(samples, kind.as_str(), op, block, batch))
}

pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
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
        op: String::new(),
        block_size: 0,
        batch: 0,
        gbps: 0.0,
        lat_avg_us: avg,
        lat_p99_us: p99,
        prepare_avg_us: 0.0,
        post_avg_us: 0.0,
        transfers: 0,
        seconds: 0.0,
    }
}

/// Single-thread `memcpy` of the same blocks: the loopback ceiling.
pub(crate) fn memcpy_point(block: u64, batch: usize, pool: u64, duration: Duration) -> Row {
    // Buffers allocated like the backends' (page-aligned `Region`s), so
    // the baseline and the backend rows copy between the same kind of
    // memory; the copy itself is one `memcpy` per block.
    let len = (block * pool) as usize;
    let src = Region::alloc(len, Access::ALL).expect("allocate memcpy baseline source");
    let dst = Region::alloc(len, Access::ALL).expect("allocate memcpy baseline destination");
    let _ = (src.fill(0, len as u64, 0xa5), dst.fill(0, len as u64, 0x5a));
    let b = block as usize;
    let mut lat = Vec::new();
    let copy_batch = |lat: &mut Vec<Duration>| {
        let t0 = Instant::now();
        for i in 0..batch {
            let off = (i % pool as usize) * b;
            src.with_slice(off as u64, block, |s| {
                dst.with_slice_mut(off as u64, block, |d| d.copy_from_slice(s))
            })
            .ok();
            lat.push(t0.elapsed());
        }
    };
    copy_batch(&mut Vec::new());
    let start = Instant::now();
    let mut batches = 0;
    while batches < MIN_BATCHES || start.elapsed() < duration {
        copy_batch(&mut lat);
        batches += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = lat.len() as u64;
    Row {
        backend: "memcpy".into(),
        op: "copy".into(),
        block_size: block,
        batch,
        gbps: (n * block) as f64 / secs / 1e9,
        transfers: n,
        seconds: secs,
        ..latency(&mut lat)
    }
}

/// Writes of the raw TCP baseline: large enough that syscalls do not
/// matter (1 MiB), whatever the block size.
const RAW_CHUNK: usize = 1 << 20;

/// One plain TCP stream on 127.0.0.1 between two threads pushing large
/// buffers (`RAW_CHUNK` writes), `batch x block` bytes per batch: the
/// ceiling the tcp backend is measured against. Its latency columns are the
/// time to push one batch, attributed to each block of it.
fn raw_tcp_point(block: u64, batch: usize, duration: Duration) -> Result<Row, BenchError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; RAW_CHUNK];
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![0xa5u8; RAW_CHUNK];
    let per_batch = block * batch as u64;
    let mut lat = Vec::new();
    let send_batch = |s: &mut TcpStream, lat: &mut Vec<Duration>| -> std::io::Result<()> {
        let t0 = Instant::now();
        let mut left = per_batch;
        while left > 0 {
            let n = left.min(RAW_CHUNK as u64) as usize;
            s.write_all(&buf[..n])?;
            left -= n as u64;
        }
        let took = t0.elapsed();
        lat.extend(std::iter::repeat_n(took, batch));
        Ok(())
    };
    send_batch(&mut s, &mut Vec::new())?;
    let start = Instant::now();
    let mut batches = 0;
    while batches < MIN_BATCHES || start.elapsed() < duration {
        send_batch(&mut s, &mut lat)?;
        batches += 1;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let received = receiver
        .join()
        .map_err(|_| std::io::Error::other("receiver panicked"))??;
    // Time until the receiver has everything, not just until the last write.
    let secs = start.elapsed().as_secs_f64();
    let n = lat.len() as u64;
    if received < (n + batch as u64) * block {
        return Err(BenchError::Io(std::io::Error::other(format!(
            "raw-tcp receiver got {received} bytes of {}",
            (n + batch as u64) * block
        ))));
    }
    Ok(Row {
        backend: "raw-tcp".into(),
        op: "write".into(),
        block_size: block,
        batch,
        gbps: (n * block) as f64 / secs / 1e9,
        transfers: n,
        seconds: secs,
        ..latency(&mut lat)
    })
}

/// Prints rows as an aligned table.
pub(crate) fn table_header() -> String {
    format!(
        "{:<9} {:<5} {:>6} {:>5} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "backend", "op", "block", "batch", "GB/s", "lat avg us", "lat p99 us", "prep us", "post us"
    )
}

/// One table line.
pub(crate) fn table_line(r: &Row) -> String {
    format!(
        "{:<9} {:<5} {:>6} {:>5} {:>8.2} {:>10.1} {:>10.1} {:>10.3} {:>10.3}",
        r.backend,
        r.op,
        fmt_size(r.block_size),
        r.batch,
        r.gbps,
        r.lat_avg_us,
        r.lat_p99_us,
        r.prepare_avg_us,
        r.post_avg_us
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlane_data::LoopbackBackend;

    fn loopback(kind: BackendKind) -> Result<Box<dyn Backend>, BenchError> {
        assert_eq!(kind, BackendKind::Loopback);
        Ok(Box::new(LoopbackBackend::default()))
    }

    #[test]
    fn a_tiny_plan_measures_every_point() {
        let plan = BenchPlan {
            backends: vec![BackendKind::Loopback],
            ops: vec![Op::Read, Op::Write],
            block_sizes: vec![4096, 65536],
            batches: vec![4],
            duration: Duration::from_millis(5),
            baselines: true,
            threads: 2,
        };
        let mut rows = Vec::new();
        run(&plan, &loopback, |_| {}, |r| rows.push(r.clone())).unwrap();
        let keys: Vec<_> = rows
            .iter()
            .map(|r| (r.backend.as_str(), r.op.as_str(), r.block_size))
            .collect();
        assert_eq!(
            keys,
            vec![
                ("memcpy", "copy", 4096),
                ("loopback", "read", 4096),
                ("loopback", "write", 4096),
                ("memcpy", "copy", 65536),
                ("loopback", "read", 65536),
                ("loopback", "write", 65536),
            ]
        );
        for r in &rows {
            let min = if r.backend == "memcpy" { 12 } else { 24 }; // 2 threads x 3 batches x 4
            assert!(r.gbps > 0.0 && r.transfers >= min, "{r:?}");
            assert!(r.lat_p99_us > 0.0 && r.lat_avg_us > 0.0, "{r:?}");
        }
    }

    #[test]
    fn raw_tcp_baseline_moves_bytes() {
        let r = raw_tcp_point(65536, 8, Duration::from_millis(5)).unwrap();
        assert_eq!((r.backend.as_str(), r.op.as_str()), ("raw-tcp", "write"));
        assert!(r.gbps > 0.0 && r.transfers >= 24);
    }

    #[test]
    fn latency_percentiles() {
        let mut lat: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let r = latency(&mut lat);
        assert!((r.lat_avg_us - 50.5).abs() < 1e-6);
        assert!((r.lat_p99_us - 100.0).abs() < 1e-6);
    }
}
