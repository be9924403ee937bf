//! The queue of unread notifications is bounded: past its capacity a
//! notification is dropped and counted, the agent keeps working.

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout::new(1, 8, 1024, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str, capacity: usize) -> Agent {
    let len = layout().required_len().unwrap() as usize;
    Agent::builder()
        .engine_id(name)
        .listen("127.0.0.1:0")
        .backend(BackendChoice::Loopback)
        .notification_capacity(capacity)
        .register_kv(
            layout(),
            Region::from_vec(vec![0; len], Access::ALL).unwrap(),
        )
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_notifications_are_bounded_and_drops_counted() {
    let prefill = agent("prefill", 16).await;
    let decode = agent("decode", 4).await;
    // Taken but not read until the end.
    let mut notes = decode.notifications().unwrap();
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    for i in 0..20u32 {
        peer.write_blocks(0..1, &[i % 8], &[i % 8], Some(format!("n{i}").as_bytes()))
            .unwrap()
            .await
            .unwrap();
    }
    // Every WRITE completed; wait (bounded) until all 20 notifications
    // were either queued or dropped.
    let mut waited = Duration::ZERO;
    while decode.notifications_dropped() < 16 && waited < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += Duration::from_millis(10);
    }
    assert_eq!(decode.notifications_dropped(), 16);
    // The metrics say the same: 4 waiting, 16 dropped.
    let m = decode.metrics();
    assert!(
        m.lines().any(|l| l == "kvlane_notifications_queued 4"),
        "{m}"
    );
    assert!(
        m.lines()
            .any(|l| l == "kvlane_notifications_dropped_total 16"),
        "{m}"
    );
    let mut got = Vec::new();
    while let Ok(n) = notes.try_recv() {
        got.push(n.payload.to_vec());
    }
    assert_eq!(
        got,
        (0..4)
            .map(|i| format!("n{i}").into_bytes())
            .collect::<Vec<_>>()
    );
    // Read again, the queue takes new ones.
    peer.write_blocks(0..1, &[0], &[0], Some(b"after"))
        .unwrap()
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .expect("a notification after draining")
        .unwrap();
    assert_eq!(&n.payload[..], b"after");
    let m = decode.metrics();
    assert!(
        m.lines().any(|l| l == "kvlane_notifications_queued 0"),
        "{m}"
    );
    prefill.close().await;
    decode.close().await;
}
