//! Whole-stack transfers: two agents in one process (control plane over
//! ZeroMQ on 127.0.0.1, data plane over loopback or tcp), moving batches of
//! 64 KiB and 1 MiB blocks with `write_blocks` / `read_blocks` through the
//! facade, each transfer waited for. The far side's block ids run in
//! reverse, so the planner merges nothing: 16 descriptors a transfer.
//! Throughput counts payload bytes.
//!
//! ```sh
//! cargo bench -p kvlane --bench transfer
//! ```
#![allow(missing_docs)] // criterion_group! generates undocumented items

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, Error, Peer, TransferHandle};
use std::ops::Range;
use tokio::runtime::Runtime;

/// Blocks moved per transfer (one layer of a flat cache).
const BATCH: u32 = 16;

/// `Peer::write_blocks` or `Peer::read_blocks`.
type Call = fn(&Peer, Range<u32>, &[u32], &[u32], Option<&[u8]>) -> Result<TransferHandle, Error>;

/// Two agents of `backend` with caches of `BATCH` blocks of `block` bytes,
/// and the first's peer for the second.
fn pair(rt: &Runtime, backend: BackendChoice, block: u64) -> (Agent, Agent, Peer) {
    let layout =
        KvLayout::new(1, BATCH, block, KvParts::Fused, LayoutOrder::LayerMajor).expect("layout");
    let agent = |name: &str, byte: u8| {
        let len = layout.required_len().expect("length") as usize;
        let kv = Region::alloc(len, Access::ALL).expect("alloc");
        kv.fill(0, len as u64, byte).expect("fill");
        rt.block_on(
            Agent::builder()
                .engine_id(name)
                .backend(backend)
                .register_kv(layout, kv)
                .build(),
        )
        .expect("agent")
    };
    let (prefill, decode) = (agent("prefill", 1), agent("decode", 2));
    let peer = rt
        .block_on(prefill.connect(decode.local_addr()))
        .expect("connect");
    (prefill, decode, peer)
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let ids: Vec<u32> = (0..BATCH).collect();
    let far: Vec<u32> = (0..BATCH).rev().collect();
    let mut g = c.benchmark_group("agent_16_blocks");
    // A transfer takes up to milliseconds: flat sampling and 10 samples
    // keep a run short without hiding the spread.
    g.sampling_mode(SamplingMode::Flat).sample_size(10);
    for (name, backend) in [
        ("loopback", BackendChoice::Loopback),
        ("tcp", BackendChoice::Tcp),
    ] {
        for (size, block) in [("64K", 64u64 << 10), ("1M", 1 << 20)] {
            let (prefill, decode, peer) = pair(&rt, backend, block);
            g.throughput(Throughput::Bytes(block * u64::from(BATCH)));
            for (op, call) in [
                ("write_blocks", Peer::write_blocks as Call),
                ("read_blocks", Peer::read_blocks),
            ] {
                g.bench_function(BenchmarkId::new(format!("{name}/{op}"), size), |b| {
                    b.iter(|| {
                        call(&peer, 0..1, &ids, &far, None)
                            .expect("post")
                            .wait()
                            .expect(op)
                    })
                });
            }
            rt.block_on(prefill.close());
            rt.block_on(decode.close());
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
