//! Agents whose KV cache is GPU memory, against a MOCK CUDA driver and a
//! MOCK HIP runtime (`crates/kvlane-data/testdata/mock_cuda.c` and
//! `mock_hip.c`, host memory behind the driver APIs; not a GPU):
//! `BackendChoice::Auto` falls back to tcp in a build without verbs, and
//! the cache is staged through pinned buffers.

use kvlane::data::conformance::{contents, region_in, use_mock_cuda, use_mock_hip};
use kvlane::data::{Access, GpuDevice, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout::new(2, 16, 256 << 10, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str, dev: GpuDevice, seed: u8) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region = region_in(Some(dev), len, Access::ALL, &[seed, seed ^ 0x5a, 7]);
    let a = Agent::builder()
        .engine_id(name)
        .listen("127.0.0.1:0")
        .backend(BackendChoice::Auto)
        .register_kv(layout(), region.clone())
        .build()
        .await
        .unwrap_or_else(|e| panic!("{name}: agent with a GPU cache: {e}"));
    (a, region)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_caches_over_auto_backend() {
    gpu_caches_over_auto_backend(use_mock_cuda()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocm_caches_over_auto_backend() {
    gpu_caches_over_auto_backend(use_mock_hip(60_200_000)).await;
}

/// Prefill WRITEs blocks of its GPU cache into decode's, with a
/// notification, then READs one back; every block byte-checked.
async fn gpu_caches_over_auto_backend(dev: GpuDevice) {
    let (prefill, pre_kv) = agent("prefill", dev, 1).await;
    let (decode, dec_kv) = agent("decode", dev, 2).await;
    let mut notes = decode.notifications().unwrap();
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    let (src, dst) = ([3u32, 4, 5, 9], [10u32, 11, 12, 0]);
    peer.write_blocks(0..2, &src, &dst, Some(b"req-1"))
        .unwrap()
        .await
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&note.payload[..], b"req-1");
    let (pre, dec) = (contents(&pre_kv), contents(&dec_kv));
    let l = layout();
    let bb = l.block_bytes as usize;
    for (&s, &d) in src.iter().zip(&dst) {
        for layer in 0..2 {
            for part in 0..2 {
                let so = l.offset(layer, part, s).unwrap() as usize;
                let d_o = l.offset(layer, part, d).unwrap() as usize;
                assert!(
                    pre[so..so + bb] == dec[d_o..d_o + bb],
                    "layer {layer} part {part} block {s} -> {d}"
                );
            }
        }
    }
    // READ back into other blocks of the prefill cache.
    peer.read_blocks(0..2, &[1], &[10], None)
        .unwrap()
        .await
        .unwrap();
    let pre2 = contents(&pre_kv);
    let (a, b) = (
        l.offset(0, 0, 1).unwrap() as usize,
        l.offset(0, 0, 10).unwrap() as usize,
    );
    assert!(pre2[a..a + bb] == dec[b..b + bb]);
}
