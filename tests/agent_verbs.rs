//! Two agents over the verbs backend on a real (or Soft-RoCE) device: the
//! control handshake, the per-peer queue-pair exchange, WRITE with a
//! notification and READ, every byte checked.
//!
//! Needs an RDMA device: `#[ignore]`d, and the device comes from
//! `KVLANE_TEST_VERBS_DEVICE`; run without it, the test panics. CI runs it
//! in the Soft-RoCE VM (`ci/verbs.sh`).
#![cfg(feature = "verbs")]

use kvlane::data::verbs::{DeviceConfig, VerbsBackend, VerbsConfig};
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, PeerEventKind};
use std::time::Duration;

fn device() -> String {
    std::env::var("KVLANE_TEST_VERBS_DEVICE").unwrap_or_else(|_| {
        panic!(
            "KVLANE_TEST_VERBS_DEVICE is not set: this test needs an RDMA device \
             (e.g. KVLANE_TEST_VERBS_DEVICE=rxe0 inside ci/softroce.sh)"
        )
    })
}

fn layout() -> KvLayout {
    KvLayout::new(4, 64, 8192, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str, seed: u8) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region = Region::from_vec(
        (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect(),
        Access::ALL,
    )
    .unwrap();
    let backend = VerbsBackend::new(VerbsConfig {
        device: DeviceConfig::device(device()),
        ..VerbsConfig::default()
    })
    .unwrap_or_else(|e| panic!("open verbs device {}: {e}", device()));
    let a = Agent::builder()
        .engine_id(name)
        .backend_instance(backend)
        .register_kv(layout(), region.clone())
        .build()
        .await
        .unwrap();
    (a, region)
}

fn block(r: &Region, layer: u32, part: u64, id: u32) -> Vec<u8> {
    let mut b = vec![0u8; 8192];
    r.read(layout().offset(layer, part, id).unwrap(), &mut b)
        .unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
async fn agents_over_verbs_write_notify_and_read() {
    let (a, a_kv) = agent("prefill", 3).await;
    let (b, b_kv) = agent("decode", 7).await;
    let mut b_events = b.events();
    let mut notes = b.notifications().unwrap();
    let peer = a.connect(b.local_addr()).await.expect("connect over verbs");
    let src: Vec<u32> = (0..16).collect();
    let dst: Vec<u32> = (32..48).collect();
    peer.write_blocks(0..4, &src, &dst, Some(b"kv ready"))
        .unwrap()
        .await
        .expect("WRITE over verbs");
    let n = tokio::time::timeout(Duration::from_secs(30), notes.recv())
        .await
        .expect("no notification")
        .unwrap();
    assert_eq!(
        (n.from.as_str(), &n.payload[..]),
        ("prefill", &b"kv ready"[..])
    );
    for (&s, &d) in src.iter().zip(&dst) {
        for layer in 0..4 {
            for part in 0..2 {
                assert!(
                    block(&a_kv, layer, part, s) == block(&b_kv, layer, part, d),
                    "WRITE block {s}->{d} layer {layer}"
                );
            }
        }
    }
    peer.read_blocks(0..4, &[60, 61], &[40, 41], None)
        .unwrap()
        .await
        .expect("READ over verbs");
    for layer in 0..4 {
        assert!(
            block(&a_kv, layer, 1, 60) == block(&b_kv, layer, 1, 40),
            "READ layer {layer}"
        );
    }
    // The accepting agent attached its side of the queue pairs.
    let up = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let PeerEventKind::Up { engine_id, .. } = b_events.recv().await.unwrap().kind {
                break engine_id;
            }
        }
    })
    .await
    .expect("the decode agent never reported the peer up");
    assert_eq!(up, "prefill");
    a.close().await;
    b.close().await;
}
