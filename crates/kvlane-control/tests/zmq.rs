//! Real ZeroMQ on 127.0.0.1.

mod common;

use std::time::Duration;

use common::{fast_config, local, wait_for};
use kvlane_control::{Config, ControlNode, Event};

#[tokio::test]
async fn zmq_connect_notify_close() {
    let a = ControlNode::bind(fast_config(), local("a"), "127.0.0.1:0")
        .await
        .expect("bind a");
    let b = ControlNode::bind(fast_config(), local("b"), "127.0.0.1:0")
        .await
        .expect("bind b");
    let mut b_events = b.events();
    let (id, info) = a.connect(b.local_addr()).await.expect("connect");
    assert_eq!(info.identity.engine_id, "b");
    assert_eq!(info.data_plane, b"b-blob");
    // The target learns who connected.
    let ev = wait_for(&mut b_events, Duration::from_secs(2), |e| {
        matches!(e.event, Event::Ready(_))
    })
    .await;
    let Event::Ready(remote) = ev.event else {
        unreachable!()
    };
    assert_eq!(remote.identity.engine_id, "a");
    assert_eq!(remote.data_plane, b"a-blob");
    a.notify(id, 42, b"done".to_vec()).await.expect("notify");
    let ev = wait_for(&mut b_events, Duration::from_secs(2), |e| {
        matches!(e.event, Event::Notification { .. })
    })
    .await;
    assert_eq!(
        ev.event,
        Event::Notification {
            transfer_id: 42,
            payload: b"done".to_vec()
        }
    );
    // Keep-alive holds for a while.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let peers = a.peers().await.expect("peers");
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].state, kvlane_control::State::Ready);
    a.close().await;
    a.close().await;
    b.close().await;
}

#[tokio::test]
async fn invariant_5_per_connection_resources_are_unique() {
    use kvlane_control::{Channel, ConnectionId, ZmqChannel};
    let mut a = ZmqChannel::bind("127.0.0.1:0", &Config::default())
        .await
        .expect("bind");
    let mut b = ZmqChannel::bind("127.0.0.1:0", &Config::default())
        .await
        .expect("bind");
    let target = b.local_addr();
    // Every DEALER gets its own routing id: two connections to the same
    // peer, a reopen of the same connection, and another node never
    // collide; ids derive from a per-node nonce, the connection id and an
    // open counter, never from the peer address.
    a.open(ConnectionId(1), &target);
    let first = a.routing_id(ConnectionId(1)).expect("rid");
    a.open(ConnectionId(1), &target);
    let reopened = a.routing_id(ConnectionId(1)).expect("rid");
    a.open(ConnectionId(2), &target);
    let second = a.routing_id(ConnectionId(2)).expect("rid");
    b.open(ConnectionId(1), &target);
    let other_node = b.routing_id(ConnectionId(1)).expect("rid");
    let all = [&first, &reopened, &second, &other_node];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    a.close().await;
    b.close().await;
    // Reconnecting to the same address allocates a fresh connection id.
    let t = ControlNode::bind(fast_config(), local("t"), "127.0.0.1:0")
        .await
        .expect("bind");
    let n = ControlNode::bind(fast_config(), local("n"), "127.0.0.1:0")
        .await
        .expect("bind");
    let (first, _) = n.connect(t.local_addr()).await.expect("connect");
    n.disconnect(first).await.expect("disconnect");
    let (second, _) = n.connect(t.local_addr()).await.expect("reconnect");
    assert_ne!(first, second);
    n.close().await;
    t.close().await;
}

#[tokio::test]
async fn connect_to_closed_port_fails_with_address_and_attempts() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    drop(l);
    let mut cfg = fast_config();
    cfg.handshake_timeout = Duration::from_millis(500);
    let n = ControlNode::bind(cfg, local("n"), "127.0.0.1:0")
        .await
        .expect("bind");
    let err = n.connect(&addr).await.expect_err("nothing listens");
    let msg = err.to_string();
    assert!(msg.contains(&addr) && msg.contains("attempts"), "{msg}");
    n.close().await;
}

#[tokio::test]
async fn psk_over_zmq_right_key_connects_wrong_key_refused_on_both_sides() {
    let keyed = |k: &[u8]| Config {
        psk: Some(kvlane_control::Psk::new(k)),
        ..fast_config()
    };
    let t = ControlNode::bind(keyed(b"secret"), local("t"), "127.0.0.1:0")
        .await
        .expect("bind");
    let mut t_events = t.events();
    let good = ControlNode::bind(keyed(b"secret"), local("good"), "127.0.0.1:0")
        .await
        .expect("bind");
    let (_, info) = good
        .connect(t.local_addr())
        .await
        .expect("same key connects");
    assert_eq!(info.data_plane, b"t-blob");
    let bad = ControlNode::bind(keyed(b"wrong"), local("bad"), "127.0.0.1:0")
        .await
        .expect("bind");
    let err = bad
        .connect(t.local_addr())
        .await
        .expect_err("wrong key refused");
    let msg = err.to_string();
    assert!(
        msg.contains(t.local_addr()) && msg.contains("authentication failed"),
        "{msg}"
    );
    let ev = wait_for(&mut t_events, Duration::from_secs(2), |e| {
        matches!(
            &e.event,
            Event::Refused {
                refusal: kvlane_control::Refusal::Auth { .. }
                    | kvlane_control::Refusal::Remote { .. },
                ..
            }
        )
    })
    .await;
    assert!(matches!(ev.event, Event::Refused { .. }));
    for n in [good, bad, t] {
        n.close().await;
    }
}

#[tokio::test]
async fn connect_to_silent_tcp_listener_ends_at_handshake_deadline() {
    // Accepts TCP but never speaks ZMTP: every await must still be bounded.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr").to_string();
    let mut cfg = fast_config();
    cfg.handshake_timeout = Duration::from_millis(400);
    let n = ControlNode::bind(cfg, local("n"), "127.0.0.1:0")
        .await
        .expect("bind");
    let start = std::time::Instant::now();
    let err = n.connect(&addr).await.expect_err("silent listener");
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(400) + Duration::from_millis(300),
        "{took:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&addr) && msg.contains("handshake timed out"),
        "{msg}"
    );
    n.close().await;
    drop(silent);
}
