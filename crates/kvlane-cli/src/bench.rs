//! `kvlane bench`: throughput and latency of batched one-sided transfers,
//! with same-run baselines (`memcpy`, `raw-tcp`).
//!
//! Each point posts `batch` transfers of one block each, then polls until
//! all completed, and repeats for `--duration`. The points of one block size
//! (baselines included) take turns in slices of at most 200 ms, so that a
//! baseline and the backend it bounds see the same machine. Reported per
//! point: payload
//! GB/s (10^9 bytes/s), average and p99 latency of a transfer from post to
//! completion, and the average cost of preparing (building descriptors) and
//! posting (`submit`) one transfer.

use crate::units::fmt_size;
use kvlane_data::{
    connect_pair, smallvec, Access, Backend, BackendKind, Completion, Descriptor, Op, Region,
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

/// Longest stretch one point is measured without a break (one batch at
/// least). The points of one block size (baselines and backends) take
/// turns in slices this long until each has had `--duration` and
/// `MIN_BATCHES` batches, so a drift in the machine's speed (cache and
/// memory bandwidth shared with other tenants, clock frequency) reaches
/// every row of a comparison alike instead of whichever ran during it.
/// With 200 ms slices, the 64 KiB loopback/memcpy ratio of one run still
/// ranged 0.82-0.95 between runs; with 20 ms, 0.91-0.93.
const SLICE: Duration = Duration::from_millis(20);

/// Payload a slice moves at least, so that it moves many times the
/// last-level cache (32 MiB here). Past the caches, what one slice leaves
/// behind (dirty lines, most likely) costs the next slice, of another
/// point: with 20 ms slices alone (~240 MB at 1 MiB blocks) loopback WRITE
/// at 1 MiB read 0.90-1.00x memcpy over three runs, with this floor
/// 1.01-1.07x.
const SLICE_BYTES: u64 = 1 << 30;

/// Longest slice when `SLICE_BYTES` takes long (slow points, such as tcp
/// at small blocks).
const SLICE_MAX: Duration = Duration::from_millis(200);

/// One point of a block size, measured slice by slice.
enum Contender {
    Memcpy(MemcpyPoint),
    RawTcp(RawTcpPoint),
    Backend(BackendPoint),
}

/// `pairs[index]` measured with `op` and `batch`.
struct BackendPoint {
    index: usize,
    op: Op,
    batch: usize,
    sample: Sample,
}

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
        let mut pairs: Vec<Vec<Pair>> = Vec::new();
        for &kind in &plan.backends {
            pairs.push(
                (0..plan.threads.max(1))
                    .map(|_| Pair::new(factory, kind, block, pool))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        let mut contenders = Vec::new();
        if plan.baselines {
            // The baseline copies between the very buffers the first
            // backend's first pair moves (its remote into its local region,
            // as a READ does): the same pages, so the same physical
            // placement, cache and TLB behaviour on both sides of the
            // comparison.
            let buffers = pairs
                .first()
                .and_then(|p| p.first())
                .map(|p| (p.remote.clone(), p.local.clone()));
            for &batch in &plan.batches {
                contenders.push(Contender::Memcpy(MemcpyPoint::new(
                    block,
                    batch,
                    pool,
                    buffers.clone(),
                )?));
            }
        }
        if plan.baselines && plan.backends.contains(&BackendKind::Tcp) {
            for &batch in &plan.batches {
                contenders.push(Contender::RawTcp(RawTcpPoint::new(block, batch)?));
            }
        }
        for (index, _) in plan.backends.iter().enumerate() {
            for &op in &plan.ops {
                for &batch in &plan.batches {
                    contenders.push(Contender::Backend(BackendPoint {
                        index,
                        op,
                        batch,
                        sample: Sample::default(),
                    }));
                }
            }
        }
        for round in 1.. {
            let mut owed = false;
            for c in &mut contenders {
                let Some(slice) = c.owed(plan.duration, block) else {
                    continue;
                };
                owed = true;
                let first = round == 1;
                match c {
                    Contender::Memcpy(m) => m.slice(slice, first),
                    Contender::RawTcp(r) => r.slice(slice, first)?,
                    Contender::Backend(b) => {
                        let s = point(&mut pairs[b.index], b.op, b.batch, slice)?;
                        b.sample.merge(s);
                    }
                }
            }
            if !owed {
                break;
            }
            progress(&format!(
                "{} blocks, round {round}: {} points",
                fmt_size(block),
                contenders.len()
            ));
        }
        for c in contenders {
            emit(&match c {
                Contender::Memcpy(m) => m.row(),
                Contender::RawTcp(r) => r.row()?,
                Contender::Backend(b) => {
                    let kind = pairs[b.index][0].kind;
                    b.sample.row(kind.as_str(), op_name(b.op), block, b.batch)
                }
            });
        }
    }
    Ok(())
}

/// A stretch of measuring one point: one batch and `time` at least, then
/// on until `batches` or `limit`, whichever comes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slice {
    time: Duration,
    batches: u64,
    limit: Duration,
}

impl Contender {
    /// See [`Sample::owed`].
    fn owed(&self, duration: Duration, block: u64) -> Option<Slice> {
        let (sample, batch) = match self {
            Self::Memcpy(m) => (&m.sample, m.batch),
            Self::RawTcp(r) => (&r.sample, r.batch),
            Self::Backend(b) => (&b.sample, b.batch),
        };
        sample.owed(duration, block, batch)
    }
}

/// Runs `batch` for `slice` (its time and its batches); the seconds it
/// took.
fn run_for<E>(slice: Slice, mut batch: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
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
    /// The target's memory (kept alive; also the memcpy baseline's source).
    remote: Region,
    /// Batches run with `(op, batch)` so far; the first is a warm-up.
    warmed: Vec<(Op, usize)>,
    /// Buffers of a batch, reused: a fresh allocation of this size per
    /// batch made the allocator consolidate its free lists every time
    /// (2% of a 64K loopback run).
    transfers: Vec<Transfer>,
    posted: Vec<Option<Instant>>,
    done: Vec<Completion>,
}

/// Two regions of `len` bytes, every page touched (so first-use faults stay
/// out of the timings) with different contents.
fn buffers(len: u64) -> Result<(Region, Region), kvlane_data::DataError> {
    let a = Region::alloc(len as usize, Access::ALL)?;
    let b = Region::alloc(len as usize, Access::ALL)?;
    a.fill(0, len, 0xa5)?;
    b.fill(0, len, 0x5a)?;
    Ok((a, b))
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
        let (local, remote) = buffers(block * pool).map_err(data)?;
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
            warmed: Vec::new(),
            transfers: Vec::new(),
            posted: Vec::new(),
            done: Vec::new(),
            remote,
        })
    }

    /// Runs batches for `slice`, after one unmeasured warm-up batch the
    /// first time `(op, batch)` runs.
    fn measure(&mut self, op: Op, batch: usize, slice: Slice) -> Result<Sample, BenchError> {
        // Completions from the backend's own threads wake this one.
        self.init
            .set_waker(Waker::from(Arc::new(Unpark(std::thread::current()))));
        self.busy = self.init.needs_busy_poll();
        let mut s = Sample::default();
        if !self.warmed.contains(&(op, batch)) {
            let (mut p0, mut p1) = (Duration::ZERO, Duration::ZERO);
            self.batch(op, batch, &mut Vec::new(), &mut p0, &mut p1)?;
            self.warmed.push((op, batch));
        }
        s.secs = run_for(slice, || {
            self.batch(op, batch, &mut s.lat, &mut s.prepare, &mut s.post)
        })?;
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
        let mut posted = std::mem::take(&mut self.posted);
        posted.clear();
        posted.resize(batch, None);
        let mut done = std::mem::take(&mut self.done);
        let mut transfers = std::mem::take(&mut self.transfers);
        let mut finished = 0;
        // Prepare the whole batch, then post it: two clock reads for the
        // batch's preparation and one per post (its timestamp), so the
        // measurement itself stays out of the per-transfer cost.
        let t0 = Instant::now();
        // One deadline for the batch (one clock read, not one per transfer).
        let deadline = t0 + kvlane_data::DEFAULT_DEADLINE;
        transfers.extend((0..batch).map(|i| {
            let off = (i as u64 % self.pool) * self.block;
            Transfer {
                id: TransferId(base + i as u64),
                peer: self.peer,
                op,
                local: smallvec![Descriptor {
                    region: self.local.id(),
                    offset: off,
                    len: self.block,
                }],
                remote: smallvec![RemoteDescriptor {
                    key: self.key,
                    offset: off,
                    len: self.block,
                }],
                notify: None,
                deadline,
            }
        }));
        let mut last = Instant::now();
        *prepare += last - t0;
        for mut t in transfers.drain(..) {
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
        (self.transfers, self.posted, self.done) = (transfers, posted, done);
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
    /// Adds a later slice of the same point (its wall time adds up).
    fn merge(&mut self, mut later: Self) {
        self.lat.append(&mut later.lat);
        self.prepare += later.prepare;
        self.post += later.post;
        self.secs += later.secs;
    }

    /// The next slice a point with this sample (of `batch`es of `block`s)
    /// is owed: `SLICE` or what is left of `duration`, whichever is
    /// shorter, then on until it has moved `SLICE_BYTES`, or for `SLICE_MAX`
    /// or what is left; `None` once it has had `duration` and `MIN_BATCHES`
    /// batches.
    fn owed(&self, duration: Duration, block: u64, batch: usize) -> Option<Slice> {
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

/// Measures one slice of a point on every pair at once, one thread each;
/// the threads' samples as one (their wall time is the longest thread's).
/// A single pair is measured on this thread, where the memcpy baseline
/// runs too. With a new thread per slice, the loopback point that followed
/// the other loopback point lost to the one that followed memcpy (64 KiB,
/// six runs: READ 0.96-0.99x memcpy, WRITE 0.90-0.96x); on this thread
/// both read 0.94-0.95x in all six.
fn point(pairs: &mut [Pair], op: Op, batch: usize, slice: Slice) -> Result<Sample, BenchError> {
    if let [pair] = pairs {
        return pair.measure(op, batch, slice);
    }
    let kind = pairs[0].kind;
    let samples = std::thread::scope(|scope| {
        let handles: Vec<_> = pairs
            .iter_mut()
            .map(|p| scope.spawn(move || p.measure(op, batch, slice)))
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
    let mut all = Sample::default();
    let secs = samples.iter().map(|s| s.secs).fold(0.0, f64::max);
    for s in samples {
        all.merge(s);
    }
    all.secs = secs;
    Ok(all)
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
struct MemcpyPoint {
    src: Region,
    dst: Region,
    block: u64,
    batch: usize,
    pool: u64,
    sample: Sample,
}

impl MemcpyPoint {
    /// Copies from the first of `buffers` into the second, or between two
    /// new regions allocated like a backend pair's; one `memcpy` per block.
    fn new(
        block: u64,
        batch: usize,
        pool: u64,
        buffers: Option<(Region, Region)>,
    ) -> Result<Self, BenchError> {
        let data = |source| BenchError::Data {
            backend: "memcpy".into(),
            source,
        };
        let (src, dst) = match buffers {
            Some(b) => b,
            None => self::buffers(block * pool).map_err(data)?,
        };
        Ok(Self {
            src,
            dst,
            block,
            batch,
            pool,
            sample: Sample::default(),
        })
    }

    fn copy_batch(&self, lat: &mut Vec<Duration>) {
        let t0 = Instant::now();
        for i in 0..self.batch as u64 {
            let off = (i % self.pool) * self.block;
            self.src
                .with_slice(off, self.block, |s| {
                    self.dst
                        .with_slice_mut(off, self.block, |d| d.copy_from_slice(s))
                })
                .ok();
            lat.push(t0.elapsed());
        }
    }

    fn slice(&mut self, slice: Slice, first: bool) {
        if first {
            self.copy_batch(&mut Vec::new());
        }
        let mut lat = std::mem::take(&mut self.sample.lat);
        let Ok(secs) = run_for(slice, || {
            self.copy_batch(&mut lat);
            Ok::<_, std::convert::Infallible>(())
        });
        self.sample.secs += secs;
        self.sample.lat = lat;
    }

    fn row(self) -> Row {
        self.sample.row("memcpy", "copy", self.block, self.batch)
    }
}

/// Writes of the raw TCP baseline: large enough that syscalls do not
/// matter (1 MiB), whatever the block size.
const RAW_CHUNK: usize = 1 << 20;

/// One plain TCP stream on 127.0.0.1 between two threads pushing large
/// buffers (`RAW_CHUNK` writes), `batch x block` bytes per batch: the
/// ceiling the tcp backend is measured against. Its latency columns are the
/// time to push one batch, attributed to each block of it.
struct RawTcpPoint {
    stream: TcpStream,
    receiver: std::thread::JoinHandle<std::io::Result<u64>>,
    buf: Vec<u8>,
    block: u64,
    batch: usize,
    /// Batches written, the warm-up included.
    batches: u64,
    sample: Sample,
}

impl RawTcpPoint {
    fn new(block: u64, batch: usize) -> Result<Self, BenchError> {
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
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            receiver,
            buf: vec![0xa5u8; RAW_CHUNK],
            block,
            batch,
            batches: 0,
            sample: Sample::default(),
        })
    }

    fn send_batch(&mut self, record: bool) -> std::io::Result<()> {
        let t0 = Instant::now();
        let mut left = self.block * self.batch as u64;
        while left > 0 {
            let n = left.min(RAW_CHUNK as u64) as usize;
            self.stream.write_all(&self.buf[..n])?;
            left -= n as u64;
        }
        let took = t0.elapsed();
        if record {
            self.sample
                .lat
                .extend(std::iter::repeat_n(took, self.batch));
        }
        self.batches += 1;
        Ok(())
    }

    fn slice(&mut self, slice: Slice, first: bool) -> Result<(), BenchError> {
        if first {
            self.send_batch(false)?;
        }
        self.sample.secs += run_for(slice, || self.send_batch(true))?;
        Ok(())
    }

    fn row(mut self) -> Result<Row, BenchError> {
        // Time until the receiver has everything, not just until the last
        // write.
        let drain = Instant::now();
        self.stream.shutdown(std::net::Shutdown::Write)?;
        let received = self
            .receiver
            .join()
            .map_err(|_| std::io::Error::other("receiver panicked"))??;
        self.sample.secs += drain.elapsed().as_secs_f64();
        let sent = self.batches * self.batch as u64 * self.block;
        if received < sent {
            return Err(BenchError::Io(std::io::Error::other(format!(
                "raw-tcp receiver got {received} bytes of {sent}"
            ))));
        }
        Ok(self.sample.row("raw-tcp", "write", self.block, self.batch))
    }
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
        let mut p = RawTcpPoint::new(65536, 8).unwrap();
        let slice = Slice {
            time: Duration::from_millis(5),
            batches: 2,
            limit: Duration::from_secs(5),
        };
        p.slice(slice, true).unwrap();
        p.slice(slice, false).unwrap();
        let r = p.row().unwrap();
        assert_eq!((r.backend.as_str(), r.op.as_str()), ("raw-tcp", "write"));
        // Two slices of at least two batches of 8, the warm-up not counted.
        assert!(
            r.gbps > 0.0 && r.transfers >= 32 && r.transfers.is_multiple_of(8),
            "{r:?}"
        );
    }

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
        let mut m = MemcpyPoint::new(block, batch, 4, None).unwrap();
        m.sample = s;
        m.slice(slice(0, 0), false);
        assert_eq!(m.sample.lat.len(), batch * MIN_BATCHES as usize);
        assert_eq!(Contender::Memcpy(m).owed(duration, block), None);
    }

    #[test]
    fn latency_percentiles() {
        let mut lat: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let r = latency(&mut lat);
        assert!((r.lat_avg_us - 50.5).abs() < 1e-6);
        assert!((r.lat_p99_us - 100.0).abs() < 1e-6);
    }
}
