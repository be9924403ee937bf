//! `Agent::close` releases sockets, tasks and registrations.

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, MemoryKind, Region};
use kvlane::{Agent, BackendChoice};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn tracked_region(len: usize, tracker: &Arc<()>) -> Region {
    let buf: &'static mut [u8] = Box::leak(vec![3u8; len].into_boxed_slice());
    // SAFETY: the buffer is leaked, so it outlives every clone of the region.
    unsafe {
        Region::from_raw(
            buf.as_mut_ptr(),
            len,
            MemoryKind::Host,
            Access::ALL,
            Some(Box::new(tracker.clone())),
        )
    }
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_releases_registrations_and_the_data_port() {
    let layout = KvLayout::new(1, 8, 4096, KvParts::Fused, LayoutOrder::LayerMajor).unwrap();
    let len = layout.required_len().unwrap() as usize;
    let (ta, tb) = (Arc::new(()), Arc::new(()));
    let build = |name: &'static str, r: Region| {
        Agent::builder()
            .engine_id(name)
            .backend(BackendChoice::Tcp)
            .register_kv(layout, r)
            .build()
    };
    let a = build("a", tracked_region(len, &ta)).await.unwrap();
    let b = build("b", tracked_region(len, &tb)).await.unwrap();
    let peer = a.connect(b.local_addr()).await.unwrap();
    peer.write_blocks(0..1, &[1], &[2], None)
        .unwrap()
        .await
        .unwrap();
    let control_addr = b.local_addr().to_owned();
    a.close().await;
    b.close().await;
    b.close().await; // idempotent
                     // After close, posting fails with a typed error instead of hanging.
    let e = peer
        .write_blocks(0..1, &[1], &[2], None)
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.is_peer_lost() || e.kind() == kvlane::ErrorKind::Closed,
        "{e}"
    );
    drop(peer);
    drop(a);
    drop(b);
    let end = Instant::now() + Duration::from_secs(10);
    while (Arc::strong_count(&ta), Arc::strong_count(&tb)) != (1, 1) {
        assert!(
            Instant::now() < end,
            "registrations still held: {} {}",
            Arc::strong_count(&ta),
            Arc::strong_count(&tb)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The control port is released: something else can bind it.
    let rebound = tokio::net::TcpListener::bind(&control_addr).await;
    assert!(
        rebound.is_ok(),
        "control port {control_addr} still bound: {:?}",
        rebound.err()
    );
}

/// A `connect` in flight when the agent closes fails at once with
/// `Closed`: it neither waits out its connect attempts nor the data-plane
/// attach timeout. Here the address refuses connections (a port just
/// freed), so the connect is retrying when `close` runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_in_flight_fails_at_once_when_the_agent_closes() {
    let a = Arc::new(
        Agent::builder()
            .engine_id("a")
            .backend(BackendChoice::Tcp)
            .build()
            .await
            .unwrap(),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dialer = a.clone();
    let connect = tokio::spawn(async move { dialer.connect(&addr).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!connect.is_finished(), "the connect must still be retrying");
    let closed_at = Instant::now();
    a.close().await;
    let r = tokio::time::timeout(Duration::from_secs(60), connect)
        .await
        .expect("connect still waiting 60 s after close")
        .unwrap();
    let Err(e) = r else {
        panic!("a connect to a refusing port cannot succeed")
    };
    assert_eq!(e.kind(), kvlane::ErrorKind::Closed, "{e}");
    eprintln!("connect failed {:?} after close: {e}", closed_at.elapsed());
}
