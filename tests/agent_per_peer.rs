//! Agents whose backend needs an endpoint per peer (as verbs does), with a
//! loopback backend in that mode: the endpoints are exchanged over the
//! control connection after the handshake.

use kvlane::data::{
    Access, KvLayout, KvParts, LayoutOrder, LoopbackBackend, LoopbackConfig, Region,
};
use kvlane::{Agent, PeerEventKind};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout::new(2, 16, 2048, KvParts::Separate, LayoutOrder::BlockMajor).unwrap()
}

async fn agent(name: &str, listen: &str, seed: u8) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region =
        Region::from_vec((0..len).map(|i| (i as u8) ^ seed).collect(), Access::ALL).unwrap();
    let backend = LoopbackBackend::new(LoopbackConfig {
        endpoint_per_peer: true,
        ..LoopbackConfig::default()
    });
    let a = Agent::builder()
        .engine_id(name)
        .listen(listen)
        .backend_instance(backend)
        .register_kv(layout(), region.clone())
        .build()
        .await
        .unwrap();
    (a, region)
}

fn blocks(r: &Region, ids: &[u32]) -> Vec<u8> {
    let l = layout();
    let mut out = Vec::new();
    for &id in ids {
        let mut b = vec![0u8; (l.block_bytes * 4) as usize]; // 2 layers x 2 parts, contiguous
        r.read(l.offset(0, 0, id).unwrap(), &mut b).unwrap();
        out.extend(b);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_are_exchanged_and_transfers_work_both_ways() {
    let (a, a_kv) = agent("a", "127.0.0.1:0", 1).await;
    let (b, b_kv) = agent("b", "127.0.0.1:0", 2).await;
    let mut b_events = b.events();
    let mut notes = b.notifications().unwrap();
    let peer = a.connect(b.local_addr()).await.unwrap();
    peer.write_blocks(0..2, &[1, 2, 3], &[7, 8, 9], Some(b"w"))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(blocks(&a_kv, &[1, 2, 3]), blocks(&b_kv, &[7, 8, 9]));
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&n.payload[..], b"w");
    // The accepting side attached too: it reports the peer up and can
    // transfer back over the same connection's pairing.
    let up = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let PeerEventKind::Up { engine_id, .. } = b_events.recv().await.unwrap().kind {
                break engine_id;
            }
        }
    })
    .await
    .expect("the accepting agent never reported the peer up");
    assert_eq!(up, "a");
    // A second connect reuses the live connection and its pairing.
    let again = a.connect(b.local_addr()).await.unwrap();
    again
        .read_blocks(0..2, &[12], &[9], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(blocks(&a_kv, &[12]), blocks(&b_kv, &[9]));
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_rexchanges_endpoints_and_old_transfers_are_stale() {
    let (a, _) = agent("a", "127.0.0.1:0", 1).await;
    let (b, _) = agent("b", "127.0.0.1:0", 2).await;
    let addr = b.local_addr().to_owned();
    let peer = a.connect(&addr).await.unwrap();
    let prepared = peer
        .prepare(kvlane::data::Op::Write, 0..2, &[1], &[1], None)
        .unwrap();
    b.close().await;
    drop(b);
    let (b2, b2_kv) = agent("b", &addr, 5).await;
    tokio::time::timeout(Duration::from_secs(20), async {
        while peer.incarnation() != Some(b2.incarnation())
            || peer
                .prepare(kvlane::data::Op::Write, 0..1, &[0], &[0], None)
                .is_err()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the peer never came back with new endpoints");
    let e = peer.post(prepared).unwrap_err();
    assert!(e.is_stale(), "{e}");
    let before = b2_kv.to_vec().unwrap();
    peer.write_blocks(0..2, &[4], &[4], None)
        .unwrap()
        .await
        .unwrap();
    assert_ne!(
        b2_kv.to_vec().unwrap(),
        before,
        "the new pairing moved nothing"
    );
    a.close().await;
    b2.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_endpoint_agent_cannot_reach_a_per_peer_agent() {
    let (b, _) = agent("b", "127.0.0.1:0", 2).await;
    let len = layout().required_len().unwrap() as usize;
    // Loopback's default: one endpoint for every peer.
    let a = Agent::builder()
        .engine_id("shared-agent")
        .backend_instance(LoopbackBackend::new(LoopbackConfig::default()))
        .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
        .build()
        .await
        .unwrap();
    let e = a.connect(b.local_addr()).await.unwrap_err();
    assert!(
        e.is_refused() && e.to_string().contains("per-peer endpoints"),
        "{e}"
    );
    a.close().await;
    b.close().await;
}
