//! Real ZeroMQ on 127.0.0.1.

mod common;

use std::time::Duration;

use common::{fast_config, local, wait_for};
use kvlane_control::{ControlNode, Event};

#[tokio::test]
async fn zmq_connect_notify_close() {
    let a = ControlNode::bind(fast_config(), local("a"), "127.0.0.1:0").await.expect("bind a");
    let b = ControlNode::bind(fast_config(), local("b"), "127.0.0.1:0").await.expect("bind b");
    let mut b_events = b.events();
    let (id, info) = a.connect(b.local_addr()).await.expect("connect");
    assert_eq!(info.engine_id, "b");
    assert_eq!(info.data_plane, b"b-blob");
    // The target learns who connected.
    let ev = wait_for(&mut b_events, Duration::from_secs(2), |e| matches!(e.event, Event::Ready(_))).await;
    let Event::Ready(remote) = ev.event else { unreachable!() };
    assert_eq!(remote.engine_id, "a");
    assert_eq!(remote.data_plane, b"a-blob");
    a.notify(id, 42, b"done".to_vec()).await.expect("notify");
    let ev = wait_for(&mut b_events, Duration::from_secs(2), |e| matches!(e.event, Event::Notification { .. })).await;
    assert_eq!(ev.event, Event::Notification { transfer_id: 42, payload: b"done".to_vec() });
    // Keep-alive holds for a while.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let peers = a.peers().await.expect("peers");
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].state, kvlane_control::State::Ready);
    a.close().await;
    a.close().await;
    b.close().await;
}
