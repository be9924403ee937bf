//! `kvlane bench --role target|initiator`: the benchmark across two
//! processes or hosts, through the `Agent` API (control handshake, then the
//! data plane).
//!
//! Both sides register a flat cache of 4 KiB pages; a block of `B` bytes is
//! `B / 4 KiB` consecutive page ids, which the planner merges into one
//! descriptor, so "prepare" measures real planning work.

use crate::bench::{op_name, pool_blocks, BenchPlan, Row, Sample};
use crate::units::fmt_size;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, Error, Peer};

type BoxError = Box<dyn std::error::Error>;
use std::time::{Duration, Instant};

/// Planning granularity of the two-process benchmark.
pub(crate) const PAGE: u64 = 4096;

fn flat_layout(bytes: u64) -> Result<KvLayout, BoxError> {
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
}

fn builder(opts: &RemoteOpts) -> kvlane::AgentBuilder {
    let mut b = Agent::builder().backend(opts.backend);
    if let Some(k) = &opts.psk {
        b = b.psk(k.as_bytes().to_vec());
    }
    if let Some(a) = &opts.advertise {
        b = b.advertise(a);
    }
    b
}

/// Serves `pool` bytes until Ctrl-C.
pub(crate) async fn target(listen: &str, pool: u64, opts: &RemoteOpts) -> Result<(), BoxError> {
    let layout = flat_layout(pool)?;
    let region = Region::alloc(layout.required_len().unwrap_or(pool) as usize, Access::ALL)?;
    let agent = builder(opts)
        .engine_id("kvlane-bench-target")
        .listen(listen)
        .register_kv(layout, region)
        .build()
        .await?;
    println!(
        "listening {} backend={} pool={}",
        agent.local_addr(),
        agent.backend_kind(),
        fmt_size(pool)
    );
    eprintln!(
        "kvlane bench: target ready; run `kvlane bench --role initiator --connect {}`",
        agent.local_addr()
    );
    let _ = tokio::signal::ctrl_c().await;
    agent.close().await;
    Ok(())
}

/// Runs the plan against a target agent at `addr`.
pub(crate) async fn initiator(
    addr: &str,
    plan: &BenchPlan,
    opts: &RemoteOpts,
    mut progress: impl FnMut(&str),
    mut emit: impl FnMut(&Row),
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
        .map(|&b| b * pool_blocks(b, max_batch))
        .max()
        .unwrap_or(PAGE);
    let layout = flat_layout(pool_bytes)?;
    let region = Region::alloc(
        layout.required_len().unwrap_or(pool_bytes) as usize,
        Access::ALL,
    )?;
    region.fill(0, region.len(), 0xa5)?;
    let agent = builder(opts)
        .engine_id("kvlane-bench-initiator")
        .register_kv(layout, region)
        .build()
        .await?;
    let peer = agent.connect(addr).await?;
    let remote_pages = peer_pages(&peer)?;
    let backend = agent.backend_kind().to_string();
    for &block in &plan.block_sizes {
        let pages = (block / PAGE) as u32;
        let slots =
            (u64::from(layout.num_blocks) / u64::from(pages)).min(remote_pages / u64::from(pages));
        if slots == 0 {
            return Err(format!(
                "the target at {addr} serves {} bytes, less than one {block}-byte block",
                remote_pages * PAGE
            )
            .into());
        }
        for &op in &plan.ops {
            for &batch in &plan.batches {
                progress(&format!(
                    "{backend} {op} {} x{batch} -> {addr}",
                    fmt_size(block)
                ));
                let sample = measure(&peer, op, pages, slots, batch, plan.duration).await?;
                emit(&sample.row(&backend, op_name(op), block, batch));
            }
        }
    }
    agent.close().await;
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

async fn measure(
    peer: &Peer,
    op: kvlane::data::Op,
    pages: u32,
    slots: u64,
    batch: usize,
    duration: Duration,
) -> Result<Sample, Error> {
    let mut s = Sample::default();
    let mut ids: Vec<u32> = Vec::with_capacity(pages as usize);
    let mut run_batch = |s: &mut Sample, record: bool| {
        let mut posted = Vec::with_capacity(batch);
        for i in 0..batch {
            let first = (i as u64 % slots) as u32 * pages;
            ids.clear();
            ids.extend(first..first + pages);
            let t0 = Instant::now();
            let prepared = peer.prepare(op, 0..1, &ids, &ids, None)?;
            let t1 = Instant::now();
            let handle = peer.post(prepared)?;
            let t2 = Instant::now();
            if record {
                s.prepare += t1 - t0;
                s.post += t2 - t1;
            }
            posted.push((t2, handle));
        }
        Ok::<_, Error>(posted)
    };
    for (_, h) in run_batch(&mut s, false)? {
        h.await?;
    }
    let start = Instant::now();
    let mut batches = 0;
    while batches < 3 || start.elapsed() < duration {
        for (t, h) in run_batch(&mut s, true)? {
            h.await?;
            s.lat.push(t.elapsed());
        }
        batches += 1;
    }
    s.secs = start.elapsed().as_secs_f64();
    Ok(s)
}
