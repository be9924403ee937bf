//! Planner throughput: descriptors planned per second for 1024-block
//! requests.
#![allow(missing_docs)] // criterion_group! generates undocumented items

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvlane_data::layout::plan_into;
use kvlane_data::{KvLayout, KvParts, LayoutOrder};
use std::hint::black_box;

fn ids(pattern: &str, n: u32) -> (Vec<u32>, Vec<u32>) {
    match pattern {
        // Every block its own run: the worst case for merging.
        "scattered" => (
            (0..n).map(|i| i * 2).collect(),
            (0..n).map(|i| (n - i) * 3).collect(),
        ),
        // Runs of 16 consecutive blocks.
        _ => (
            (0..n).map(|i| i + (i / 16) * 3).collect(),
            (0..n).map(|i| i + (i / 16) * 5).collect(),
        ),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_1024_blocks");
    let layers = 32;
    for (name, order) in [
        ("layer_major", LayoutOrder::LayerMajor),
        ("block_major", LayoutOrder::BlockMajor),
    ] {
        let layout = KvLayout::new(layers, 8192, 16 << 10, KvParts::Separate, order).unwrap();
        for pattern in ["scattered", "runs16"] {
            let (l, r) = ids(pattern, 1024);
            let mut out = Vec::new();
            plan_into(&layout, &l, &layout, &r, 0..layers, &mut out).unwrap();
            // Throughput counts the (block, layer, part) descriptors a
            // request covers: 1024 x 32 x 2 = 65,536 per plan, whatever the
            // number of merged copies it emits.
            g.throughput(Throughput::Elements(1024 * u64::from(layers) * 2));
            g.bench_with_input(BenchmarkId::new(name, pattern), &(l, r), |b, (l, r)| {
                b.iter(|| {
                    plan_into(
                        &layout,
                        black_box(l),
                        &layout,
                        black_box(r),
                        0..layers,
                        &mut out,
                    )
                    .unwrap();
                    black_box(out.len())
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
