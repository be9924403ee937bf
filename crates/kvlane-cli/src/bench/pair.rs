//! A backend pair in this process: an initiator and a target backend of
//! one kind, connected to each other, and the batches measured on it.

use super::schedule::{on_lanes, run_for, Slice};
use super::stats::Sample;
use super::{BenchError, Factory};
use kvlane_data::{
    connect_pair, smallvec, Access, Backend, BackendKind, Completion, Descriptor, GpuDevice, Op,
    PeerId, Region, RemoteDescriptor, RemoteKey, SubmitError, Transfer, TransferId,
};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

/// Upper bound of the memory one side of a point uses; larger batches
/// reuse blocks cyclically (16 MiB x 128 would otherwise need 2 GiB a side).
const POOL_CAP: u64 = 512 << 20;

/// Blocks a side of a point holds: `batch`, or fewer when they would pass
/// `POOL_CAP`.
pub(crate) fn pool_blocks(block: u64, batch: usize) -> u64 {
    (POOL_CAP / block).clamp(1, batch as u64)
}

/// Two regions of `len` bytes, every page touched (so first-use faults stay
/// out of the timings) with different contents.
pub(crate) fn buffers(len: u64) -> Result<(Region, Region), kvlane_data::DataError> {
    buffers_in(len, None)
}

/// [`buffers`] in host memory (`None`) or on a GPU.
pub(crate) fn buffers_in(
    len: u64,
    memory: Option<GpuDevice>,
) -> Result<(Region, Region), kvlane_data::DataError> {
    Ok((filled(len, memory, 0xa5)?, filled(len, memory, 0x5a)?))
}

/// A region of `len` bytes of host or GPU memory, every byte set to `byte`.
pub(crate) fn filled(
    len: u64,
    memory: Option<GpuDevice>,
    byte: u8,
) -> Result<Region, kvlane_data::DataError> {
    filled_as(len, memory, byte, false)
}

/// [`filled`], in shareable host memory ([`Region::alloc_shared`], what
/// the shm backend serves) when `shared` and `memory` is host memory.
pub(crate) fn filled_as(
    len: u64,
    memory: Option<GpuDevice>,
    byte: u8,
    shared: bool,
) -> Result<Region, kvlane_data::DataError> {
    let r = match memory {
        None if shared => Region::alloc_shared(len as usize, Access::ALL)?,
        None => Region::alloc(len as usize, Access::ALL)?,
        Some(d) => Region::alloc_device(d, len as usize, Access::ALL)?,
    };
    let Ok(()) = r.write_chunks(0, len, |c| {
        c.fill(byte);
        Ok::<_, std::convert::Infallible>(())
    })?;
    Ok(r)
}

pub(crate) struct Pair {
    pub(crate) kind: BackendKind,
    init: Box<dyn Backend>,
    target: Box<dyn Backend>,
    /// The target as the initiator knows it.
    peer: PeerId,
    /// The initiator as the target knows it (`connect_pair` connects both
    /// ways).
    target_peer: PeerId,
    /// The initiator's memory (also the memcpy baseline's destination).
    pub(crate) local: Region,
    key: RemoteKey,
    block: u64,
    pool: u64,
    next_id: u64,
    busy: bool,
    /// The target's memory (kept alive; also the memcpy baseline's source).
    pub(crate) remote: Region,
    /// Batches run with `(op, batch)` so far; the first is a warm-up.
    warmed: Vec<(Op, usize)>,
    /// Buffers of a batch, reused: a fresh allocation of this size per
    /// batch made the allocator consolidate its free lists every time
    /// (2% of a 64K loopback run).
    transfers: Vec<Transfer>,
    posted: Vec<Option<Instant>>,
    done: Vec<Completion>,
}

/// Wakes the benchmark thread when the backend announces completions.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Measures one slice of a point on every pair at once, one thread each
/// (see [`on_lanes`]).
pub(crate) fn point(
    pairs: &mut [Pair],
    op: Op,
    batch: usize,
    slice: Slice,
) -> Result<Sample, BenchError> {
    let kind = pairs.first().map_or("backend", |p| p.kind.as_str());
    on_lanes(pairs, kind, |p| p.measure(op, batch, slice))
}

impl Pair {
    pub(crate) fn new(
        factory: &Factory,
        kind: BackendKind,
        block: u64,
        pool: u64,
        memory: Option<GpuDevice>,
    ) -> Result<Self, BenchError> {
        let data = |source| BenchError::Data {
            backend: kind.to_string(),
            source,
        };
        let mut init = factory(kind)?;
        let mut target = factory(kind)?;
        // The shm backend serves shareable memory only.
        let shared = kind == BackendKind::Shm;
        let (local, remote) = (
            filled_as(block * pool, memory, 0xa5, shared).map_err(data)?,
            filled_as(block * pool, memory, 0x5a, shared).map_err(data)?,
        );
        let l = init.register(&local).map_err(data)?;
        let r = target.register(&remote).map_err(data)?;
        let (peer, target_peer) =
            connect_pair(&mut *init, &[l], &mut *target, &[r]).map_err(data)?;
        Ok(Self {
            kind,
            init,
            target,
            peer,
            target_peer,
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
                        // Latency counts from before the post (which may
                        // write a lone transfer to the socket).
                        posted[(id.0 - base) as usize] = Some(last);
                        last = now;
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

impl Drop for Pair {
    /// An orderly teardown: both sides forget each other before either
    /// backend goes. `connect_pair` connects both ways, so dropping the
    /// initiator first closed, under the target backend's own connection
    /// to it, the initiator's listener: the tcp backend took that for a
    /// peer gone mid-run and warned "the target closed the connection"
    /// at the end of every run. A removed peer's streams close as ours.
    fn drop(&mut self) {
        self.target.remove_peer(self.target_peer);
        self.init.remove_peer(self.peer);
    }
}
