//! `kvlane bench --role target|initiator`: the benchmark across two
//! processes or hosts, through the `Agent` API (control handshake, then the
//! data plane), with the link's raw-tcp ceiling measured in the same run.
//!
//! Both sides register a flat cache of 4 KiB pages; a block of `B` bytes is
//! `B / 4 KiB` consecutive page ids, which the planner merges into one
//! descriptor, so "prepare" measures real planning work.
//!
//! The ceiling: the target also serves its pool over raw tcp
//! ([`RawServer`]) on the host it listens on, at any free port, and names
//! that port in its engine id (`kvlane-bench-target raw-tcp=PORT`): the
//! handshake is the one channel the initiator already has (and, with
//! `--psk`, authenticates), so nothing else must be opened, agreed on or
//! passed by hand. The initiator dials that port at the host it dialed for
//! control, which also holds when the target listens on `0.0.0.0`, opens as
//! many streams as the tcp backend does, and gives READ- and WRITE-shaped
//! raw-tcp points slices between the agent's points, as the local bench
//! does.

use super::announce::{announced_raw_port, host_of, raw_addr, target_engine_id};
use super::raw::{RawClient, RawServer};
use super::schedule::{rounds, run_for, Point, Slice};
use super::stats::Sample;
use super::{op_name, BenchError, BenchPlan, PostMode, Row};
use crate::units::fmt_size;
use kvlane::data::{KvLayout, KvParts, LayoutOrder, Op};
use kvlane::{Agent, BackendChoice, BlockingAgent, Error, Peer, TransferHandle};
use std::time::Instant;

type BoxError = Box<dyn std::error::Error>;

/// Planning granularity of the two-process benchmark.
pub(crate) const PAGE: u64 = 4096;

pub(crate) fn flat_layout(bytes: u64) -> Result<KvLayout, BoxError> {
    let pages =
        u32::try_from(bytes / PAGE).map_err(|_| format!("{bytes} bytes is too large a pool"))?;
    Ok(KvLayout::new(
        1,
        pages.max(1),
        PAGE,
        KvParts::Fused,
        LayoutOrder::LayerMajor,
    )?)
}

/// Agent settings both roles take from the command line.
#[derive(Debug, Clone, Default)]
pub(crate) struct RemoteOpts {
    /// The data-plane backend.
    pub(crate) backend: BackendChoice,
    /// Pre-shared key of the handshake.
    pub(crate) psk: Option<String>,
    /// Host the target tells peers to reach its data plane at.
    pub(crate) advertise: Option<String>,
    /// Dial data endpoints on any host (not only the control host).
    pub(crate) dial_any_data_host: bool,
    /// shm: serve plain host memory by cross-memory attach (opt-in).
    pub(crate) shm_cross_memory_attach: bool,
    /// Where the served (target) or moved (initiator) memory lives.
    pub(crate) memory: Option<kvlane_data::GpuDevice>,
    /// Use at most this many rails.
    pub(crate) rails: usize,
    /// Target role: serve the agent's metrics at this address.
    pub(crate) metrics: Option<String>,
}

impl RemoteOpts {
    /// Whether the host memory is shareable (`Region::alloc_shared`): the
    /// shm backend serves only that unless cross-memory attach is on (then
    /// plain memory, as an engine's, is the point); `Auto` gets shm to a
    /// target on this host with it, as with any memory kvlane allocates,
    /// and the network otherwise.
    pub(crate) fn shared(&self) -> bool {
        matches!(
            self.backend,
            BackendChoice::Shm | BackendChoice::Auto | BackendChoice::SameHost
        ) && !self.shm_cross_memory_attach
    }
}

pub(crate) fn builder(opts: &RemoteOpts) -> kvlane::AgentBuilder {
    let mut b = Agent::builder()
        .backend(opts.backend)
        .shm_cross_memory_attach(opts.shm_cross_memory_attach)
        .dial_any_data_host(opts.dial_any_data_host)
        .max_rails(opts.rails);
    if let Some(k) = &opts.psk {
        b = b.psk(k.as_bytes().to_vec());
    }
    if let Some(a) = &opts.advertise {
        b = b.advertise(a);
    }
    b
}

/// Serves `pool` bytes, and the raw-tcp ceiling unless `ceiling` is
/// false, until Ctrl-C.
pub(crate) async fn target(
    listen: &str,
    pool: u64,
    opts: &RemoteOpts,
    ceiling: bool,
) -> Result<(), BoxError> {
    let layout = flat_layout(pool)?;
    // Every page is touched before the target listens (a first touch in
    // the measured transfers would count the page faults). That can take
    // seconds: 1 GiB took 1-16 s in this project's VM, whose hypervisor
    // backs guest memory on first touch. Said, so a quiet start is not
    // taken for a hang.
    eprintln!(
        "kvlane bench: filling the {} pool; the port opens once every page is touched",
        fmt_size(pool)
    );
    let filling = Instant::now();
    let region = super::pair::filled_as(
        layout.required_len().unwrap_or(pool),
        opts.memory,
        0,
        opts.shared(),
    )?;
    eprintln!(
        "kvlane bench: pool filled in {:.1} s",
        filling.elapsed().as_secs_f64()
    );
    let raw = if ceiling {
        let host = host_of(listen);
        // The ceiling moves the same pool's bytes (a host copy of its size
        // when the pool is GPU memory).
        let memory = match region.device() {
            None => region.clone(),
            Some(_) => super::pair::filled(region.len(), None, 0)?,
        };
        let server =
            RawServer::bind((host, 0), memory).map_err(|source| BenchError::RawListen {
                addr: format!("{host}:0"),
                source,
            })?;
        Some(server)
    } else {
        None
    };
    let raw_port = raw.as_ref().map(|r| r.local_addr().port());
    let agent = builder(opts)
        .engine_id(target_engine_id(raw_port))
        .listen(listen)
        .register_kv(layout, region)
        .build()
        .await?;
    crate::out::outln!(
        "listening {} backend={} pool={}{}",
        agent.local_addr(),
        agent.backend_kind(),
        fmt_size(pool),
        raw_port.map_or(String::new(), |p| format!(" raw-tcp={p}"))
    );
    let metrics = crate::serve::metrics_if(&agent, opts.metrics.as_deref(), |url| {
        eprintln!("kvlane bench: metrics {url}");
    })
    .await?;
    eprintln!(
        "kvlane bench: target ready; run `kvlane bench --role initiator --connect {}`",
        dialable(agent.local_addr())
    );
    let stopped = tokio::signal::ctrl_c().await;
    if let Some(t) = metrics {
        t.abort();
    }
    agent.close().await;
    drop(raw);
    stopped?;
    Ok(())
}

/// Which side of the link a remote point measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Plain TCP streams to the target's raw-tcp port.
    RawTcp,
    /// The agent's peer.
    Agent,
    /// `memcpy` of the same blocks in this process: the ceiling of a peer
    /// on this host (shm).
    Memcpy,
}

/// Runs the plan against a target agent at `addr`.
pub(crate) fn initiator(
    addr: &str,
    plan: &BenchPlan,
    opts: &RemoteOpts,
    mut progress: impl FnMut(&str),
    mut emit: impl FnMut(&Row) -> std::io::Result<()>,
) -> Result<(), BoxError> {
    if let Some(b) = plan.block_sizes.iter().find(|&&b| b % PAGE != 0) {
        return Err(format!(
            "--role initiator needs block sizes that are multiples of 4K, not {b}"
        )
        .into());
    }
    let max_batch = plan.batches.iter().copied().max().unwrap_or(1);
    let pool_bytes = plan
        .block_sizes
        .iter()
        .map(|&b| b * super::pair::pool_blocks(b, max_batch))
        .max()
        .unwrap_or(PAGE);
    let layout = flat_layout(pool_bytes)?;
    let region = super::pair::filled_as(
        layout.required_len().unwrap_or(pool_bytes),
        opts.memory,
        0xa5,
        opts.shared(),
    )?;
    let agent = BlockingAgent::build(
        builder(opts)
            .engine_id("kvlane-bench-initiator")
            .register_kv(layout, region),
        2,
    )?;
    let measured = against(
        &agent,
        addr,
        layout.num_blocks,
        plan,
        &mut progress,
        &mut emit,
    );
    agent.close();
    measured
}

/// The plan's points against the target at `addr`, block size by block
/// size.
fn against(
    agent: &BlockingAgent,
    addr: &str,
    local_pages: u32,
    plan: &BenchPlan,
    progress: &mut impl FnMut(&str),
    emit: &mut impl FnMut(&Row) -> std::io::Result<()>,
) -> Result<(), BoxError> {
    let peer = agent.connect(addr)?;
    let remote_pages = peer_pages(&peer)?;
    let kind = peer
        .backend_kind()
        .unwrap_or_else(|| agent.agent().backend_kind());
    let backend = kind.to_string();
    let rails = agent.agent().rail_stats().len().max(1);
    // A peer on this host over shm: the ceiling is memcpy, not the link.
    let same_host = kind == kvlane::data::BackendKind::Shm;
    let mut raw = match (plan.baselines, announced_raw_port(&peer.engine_id())?) {
        (false, _) => None,
        (true, _) if same_host => None,
        (true, Some(port)) => {
            let at = raw_addr(addr, port)?;
            let client = RawClient::connect(at, 1).map_err(|e| {
                format!(
                    "{e} (the target announced that port; is it reachable from here? \
                     --no-baseline skips the raw-tcp rows)"
                )
            })?;
            eprintln!(
                "kvlane bench: raw-tcp ceiling: {} streams to {at}",
                client.streams()
            );
            Some(client)
        }
        (true, None) => {
            eprintln!(
                "kvlane bench: the target at {addr} serves no raw-tcp ceiling \
                 (started with --no-baseline?); no raw-tcp rows"
            );
            None
        }
    };
    for &block in &plan.block_sizes {
        let pages = (block / PAGE) as u32;
        let slots =
            (u64::from(local_pages) / u64::from(pages)).min(remote_pages / u64::from(pages));
        if slots == 0 {
            return Err(format!(
                "the target at {addr} serves {} bytes, less than one {block}-byte block",
                remote_pages * PAGE
            )
            .into());
        }
        let sides = [Side::RawTcp, Side::Agent];
        let mut points: Vec<(Side, Point)> = sides
            .into_iter()
            .filter(|&s| s == Side::Agent || raw.is_some())
            .flat_map(|s| plan.ops.iter().map(move |&op| (s, op)))
            .flat_map(|(s, op)| plan.batches.iter().map(move |&b| (s, Point::new(op, b))))
            .collect();
        // memcpy rows: one per batch (a copy has no direction), between
        // two buffers of this process as large as a batch's blocks.
        let mut memcpy = Vec::new();
        if same_host && plan.baselines {
            for &b in &plan.batches {
                let pool = super::pair::pool_blocks(block, b);
                memcpy.push(super::memcpy::MemcpyPoint::new(block, b, pool, 1, &[])?);
                points.push((Side::Memcpy, Point::new(Op::Read, b)));
            }
        }
        let n = points.len();
        rounds(
            &mut points,
            plan.duration,
            block,
            |(_, p)| (&p.sample, p.batch),
            |(side, p), slice, first| -> Result<(), BoxError> {
                let s = match (*side, raw.as_mut()) {
                    (Side::RawTcp, Some(c)) => c.measure(p.op, block, p.batch, slice, first)?,
                    (Side::RawTcp, None) => unreachable!("raw-tcp points exist only with streams"),
                    (Side::Memcpy, _) => {
                        let m = memcpy
                            .iter_mut()
                            .find(|m| m.batch() == p.batch)
                            .expect("a memcpy point per batch");
                        m.slice(slice, first)?;
                        std::mem::take(&mut m.sample)
                    }
                    (Side::Agent, _) => {
                        let at = Target {
                            peer: &peer,
                            pages,
                            slots,
                            post: plan.post,
                        };
                        at.measure(p.op, p.batch, slice, first)?
                    }
                };
                p.sample.merge(s);
                Ok(())
            },
            |round| {
                progress(&format!(
                    "{} blocks -> {addr}, round {round}: {n} points",
                    fmt_size(block)
                ))
            },
        )?;
        for (side, p) in points {
            let (name, op) = match side {
                Side::RawTcp => ("raw-tcp", op_name(p.op)),
                Side::Memcpy => ("memcpy", "copy"),
                Side::Agent => (backend.as_str(), op_name(p.op)),
            };
            let mut row = p.sample.row(name, op, block, p.batch);
            row.post = if side == Side::Agent {
                plan.post.name()
            } else {
                "batch"
            };
            if side == Side::Agent {
                row.memory = plan.memory_name();
                row.rails = rails;
            }
            emit(&row).map_err(BenchError::Output)?;
        }
    }
    let carried: Vec<String> = agent
        .agent()
        .rail_stats()
        .iter()
        .map(|r| {
            format!(
                "{} {} B in {} parts ({} moved off)",
                r.name, r.bytes, r.parts, r.reposts
            )
        })
        .collect();
    if !carried.is_empty() {
        eprintln!("kvlane bench: rails carried: {}", carried.join(", "));
    }
    Ok(())
}

fn peer_pages(peer: &Peer) -> Result<u64, BoxError> {
    match peer.remote_layout() {
        Some(l) if l.block_bytes == PAGE && l.num_layers == 1 => Ok(u64::from(l.num_blocks)),
        Some(l) => Err(format!(
            "{} is not a bench target (its cache is {l:?}); start it with --role target",
            peer.addr()
        )
        .into()),
        None => Err(format!("{} serves no KV cache", peer.addr()).into()),
    }
}

/// The target's cache as one block size sees it: `slots` blocks of
/// `pages` pages each.
struct Target<'a> {
    peer: &'a Peer,
    pages: u32,
    slots: u64,
    post: PostMode,
}

impl Target<'_> {
    /// Runs batches for `slice`, after an unmeasured warm-up batch when
    /// `first`. A transfer's latency is from its post until its handle,
    /// waited for in posting order, returned; with `--post single` it is
    /// every block's latency (the sample counts blocks either way).
    fn measure(&self, op: Op, batch: usize, slice: Slice, first: bool) -> Result<Sample, Error> {
        let mut s = Sample::default();
        let mut ids: Vec<u32> = Vec::with_capacity(self.pages as usize);
        let blocks_per_transfer = if self.post == PostMode::Single {
            batch
        } else {
            1
        };
        if first {
            for (_, h) in self.post_batch(op, batch, &mut ids, None)? {
                h.wait()?;
            }
        }
        s.secs = run_for(slice, || {
            for (t, h) in self.post_batch(op, batch, &mut ids, Some(&mut s))? {
                h.wait()?;
                let lat = t.elapsed();
                s.lat.extend(std::iter::repeat_n(lat, blocks_per_transfer));
            }
            Ok::<_, Error>(())
        })?;
        Ok(s)
    }

    /// Appends the page ids of block `i` of a batch: slot `i mod slots`.
    fn push_block(&self, ids: &mut Vec<u32>, i: usize) {
        let first = (i as u64 % self.slots) as u32 * self.pages;
        ids.extend(first..first + self.pages);
    }

    /// Prepares and posts `batch` block transfers, timing both into
    /// `record`; each handle with its post time.
    fn post_batch(
        &self,
        op: Op,
        batch: usize,
        ids: &mut Vec<u32>,
        mut record: Option<&mut Sample>,
    ) -> Result<Vec<(Instant, TransferHandle)>, Error> {
        let mut posted = Vec::with_capacity(batch);
        if self.post == PostMode::Single {
            // Every other slot: no two blocks are adjacent on either side,
            // so none merge into one descriptor and each moves as a
            // request of its own, as the raw-tcp rows' blocks do.
            let t0 = Instant::now();
            ids.clear();
            for i in 0..batch {
                self.push_block(ids, 2 * i);
            }
            let prepared = self.peer.prepare(op, 0..1, ids, ids, None)?;
            let t1 = Instant::now();
            let handle = self.peer.post(prepared)?;
            if let Some(s) = record.as_deref_mut() {
                s.prepare += t1 - t0;
                s.post += t1.elapsed();
            }
            posted.push((t1, handle));
            return Ok(posted);
        }
        if self.post == PostMode::Batch {
            // Prepared one by one, posted in one call; every transfer's
            // latency counts from before that call.
            let t0 = Instant::now();
            let mut prepared = Vec::with_capacity(batch);
            for i in 0..batch {
                ids.clear();
                self.push_block(ids, i);
                prepared.push(self.peer.prepare(op, 0..1, ids, ids, None)?);
            }
            let t1 = Instant::now();
            let handles = self.peer.post_batch(prepared);
            let t2 = Instant::now();
            if let Some(s) = record.as_deref_mut() {
                s.prepare += t1 - t0;
                s.post += t2 - t1;
            }
            for h in handles {
                posted.push((t1, h?));
            }
            return Ok(posted);
        }
        // Each transfer's clock reads end where the next one's start
        // (filling `ids` counts as preparing), and the post's own read
        // (`posted_at`, as it begins) splits prepare from post: one read
        // per transfer here, not three, on the thread that posts, whose
        // every microsecond is on the batch's critical path.
        let mut t0 = Instant::now();
        for i in 0..batch {
            ids.clear();
            self.push_block(ids, i);
            let prepared = self.peer.prepare(op, 0..1, ids, ids, None)?;
            let handle = self.peer.post(prepared)?;
            let t1 = handle.posted_at();
            let t2 = Instant::now();
            if let Some(s) = record.as_deref_mut() {
                s.prepare += t1 - t0;
                s.post += t2 - t1;
            }
            // From before the post: posting a lone transfer may write
            // it to the socket, which is part of its latency.
            posted.push((t1, handle));
            t0 = t2;
        }
        Ok(posted)
    }
}

/// `addr` as another host would dial it: a wildcard host becomes a
/// placeholder (a peer dials one of this host's addresses).
fn dialable(addr: &str) -> String {
    match addr.rsplit_once(':') {
        Some(("0.0.0.0" | "[::]", port)) => format!("THIS-HOST:{port}"),
        _ => addr.to_owned(),
    }
}

#[cfg(test)]
mod dialable_tests {
    use super::dialable;

    #[test]
    fn a_wildcard_listen_is_not_offered_as_an_address_to_dial() {
        assert_eq!(dialable("0.0.0.0:5555"), "THIS-HOST:5555");
        assert_eq!(dialable("[::]:5555"), "THIS-HOST:5555");
        assert_eq!(dialable("10.0.0.1:5555"), "10.0.0.1:5555");
    }
}
