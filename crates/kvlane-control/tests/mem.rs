//! The tokio driver over the in-memory channel, in paused (virtual) time.

mod common;

use std::time::Duration;

use common::{fast_config, is_ready, local, wait_for};
use kvlane_control::{ControlNode, Event, MemNetwork, State};

#[tokio::test(start_paused = true)]
async fn mem_driver_connect_keepalive_notify_close() {
    let net = MemNetwork::new();
    let a = ControlNode::with_channel(fast_config(), local("a"), net.bind("a:1"));
    let b = ControlNode::with_channel(fast_config(), local("b"), net.bind("b:1"));
    let mut b_events = b.events();
    let (id, info) = a.connect("b:1").await.expect("connect");
    assert_eq!(info.identity.engine_id, "b");
    wait_for(&mut b_events, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Ready(_))
    })
    .await;
    // 20 death bounds of virtual time: keep-alive holds.
    tokio::time::sleep(fast_config().death_bound() * 20).await;
    assert_eq!(a.peers().await.expect("peers")[0].state, State::Ready);
    a.notify(id, 5, b"x".to_vec()).await.expect("notify");
    let ev = wait_for(&mut b_events, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Notification { .. })
    })
    .await;
    assert_eq!(
        ev.event,
        Event::Notification {
            transfer_id: 5,
            payload: b"x".to_vec()
        }
    );
    a.close().await;
    a.close().await;
    assert!(matches!(
        a.connect("b:1").await,
        Err(kvlane_control::ControlError::Closed)
    ));
    let ev = wait_for(&mut b_events, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Dead { .. })
    })
    .await;
    assert!(matches!(ev.event, Event::Dead { .. }));
    b.close().await;
}

#[tokio::test(start_paused = true)]
async fn mem_driver_peer_dropped_is_dead_within_bound_and_notify_refused() {
    let net = MemNetwork::new();
    let cfg = fast_config();
    let a = ControlNode::with_channel(cfg.clone(), local("a"), net.bind("a:1"));
    let b = ControlNode::with_channel(cfg.clone(), local("b"), net.bind("b:1"));
    let mut events = a.events();
    let (id, _) = a.connect("b:1").await.expect("connect");
    // b is dropped: it says bye in the background.
    drop(b);
    let start = tokio::time::Instant::now();
    wait_for(&mut events, cfg.death_bound() * 2, |e| {
        matches!(e.event, Event::Dead { .. })
    })
    .await;
    assert!(start.elapsed() <= cfg.death_bound());
    let err = a.notify(id, 1, vec![]).await.expect_err("dead peer");
    assert!(err.to_string().contains("b:1"), "{err}");
    a.close().await;
}

#[tokio::test(start_paused = true)]
async fn invariant_2_restarted_peer_makes_old_incarnation_stale() {
    let net = MemNetwork::new();
    let cfg = fast_config();
    let a = ControlNode::with_channel(cfg.clone(), local("a"), net.bind("a:1"));
    let b = ControlNode::with_channel(cfg.clone(), local("b"), net.bind("b:1"));
    let mut events = a.events();
    let (id, info) = a.connect("b:1").await.expect("connect");
    a.ensure_incarnation(id, info.identity.incarnation)
        .await
        .expect("current");
    // b restarts at the same address with a new incarnation.
    b.close().await;
    let b2 = ControlNode::with_channel(cfg.clone(), local("b"), net.bind("b:1"));
    let ev = wait_for(&mut events, Duration::from_secs(10), |e| {
        matches!(e.event, Event::Restarted { .. })
    })
    .await;
    assert_eq!(ev.id, id);
    wait_for(&mut events, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Ready(_))
    })
    .await;
    let err = a
        .ensure_incarnation(id, info.identity.incarnation)
        .await
        .expect_err("stale");
    assert!(
        matches!(err, kvlane_control::ControlError::StaleIncarnation { expected, current, .. } if expected == info.identity.incarnation && current != expected),
        "{err}"
    );
    a.close().await;
    b2.close().await;
}

#[tokio::test(start_paused = true)]
async fn invariant_4_concurrent_close_calls_all_wait_and_release() {
    let net = MemNetwork::new();
    let a = ControlNode::with_channel(fast_config(), local("a"), net.bind("a:1"));
    let b = ControlNode::with_channel(fast_config(), local("b"), net.bind("b:1"));
    a.connect("b:1").await.expect("connect");
    tokio::join!(a.close(), a.close(), a.close());
    assert!(matches!(
        a.peers().await,
        Err(kvlane_control::ControlError::Closed)
    ));
    b.close().await;
}

#[tokio::test(start_paused = true)]
async fn notify_over_cap_is_a_typed_error() {
    let net = MemNetwork::new();
    let a = ControlNode::with_channel(fast_config(), local("a"), net.bind("a:1"));
    let b = ControlNode::with_channel(fast_config(), local("b"), net.bind("b:1"));
    let (id, _) = a.connect("b:1").await.expect("connect");
    let err = a
        .notify(id, 1, vec![0; (64 << 10) + 1])
        .await
        .expect_err("over cap");
    assert!(matches!(
        err,
        kvlane_control::ControlError::PayloadTooLarge { cap: 65536, .. }
    ));
    a.close().await;
    b.close().await;
}

/// A connect whose caller gave up (timed out, or a group past its
/// deadline) before the peer became ready leaves no connection behind:
/// nobody holds its id, so nobody would ever close it (invariant 7: a
/// failed group keeps no rank that turned ready after its deadline).
#[tokio::test(start_paused = true)]
async fn a_connect_given_up_before_ready_leaves_no_connection() {
    let net = MemNetwork::new();
    let a = ControlNode::with_channel(fast_config(), local("a"), net.bind("a:1"));
    let mut events = a.events();
    // b is not there yet: a redials with backoff, within its handshake deadline.
    let gave_up = tokio::time::timeout(Duration::from_millis(300), a.connect("b:1")).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    let b = ControlNode::with_channel(fast_config(), local("b"), net.bind("b:1"));
    let ready = wait_for(&mut events, Duration::from_secs(1), is_ready(None)).await;
    wait_for(&mut events, Duration::from_secs(1), |e| {
        e.id == ready.id && matches!(e.event, Event::Closed)
    })
    .await;
    assert_eq!(a.peers().await.expect("peers"), Vec::new());
    // A later connect dials afresh and keeps its connection.
    let (id, _) = a.connect("b:1").await.expect("connect");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(a.peers().await.expect("peers")[0].id, id);
    a.close().await;
    b.close().await;
}

/// Node `b`'s channel, less the pongs of explicit pings: `b` answers
/// keep-alive (it stays up) but never answers [`ControlNode::ping`].
struct NoProbePongs(kvlane_control::MemChannel);

impl kvlane_control::Channel for NoProbePongs {
    fn local_addr(&self) -> String {
        self.0.local_addr()
    }
    fn open(&mut self, id: kvlane_control::ConnectionId, addr: &str) {
        self.0.open(id, addr);
    }
    fn send(&mut self, link: &kvlane_control::Link, frame: bytes::Bytes) {
        use kvlane_control::wire::Message;
        // Probe pings carry the top bit in their sequence number.
        if let Ok(Message::Pong(p)) = Message::decode(&frame, 1 << 20) {
            if p.seq >> 63 == 1 {
                return;
            }
        }
        self.0.send(link, frame);
    }
    fn disconnect(&mut self, id: kvlane_control::ConnectionId) {
        self.0.disconnect(id);
    }
    fn adopt_accepted(&mut self, rid: &bytes::Bytes) {
        self.0.adopt_accepted(rid);
    }
    fn protect_accepted(&mut self, rid: &bytes::Bytes) {
        self.0.protect_accepted(rid);
    }
    fn close_accepted(&mut self, rid: &bytes::Bytes) {
        self.0.close_accepted(rid);
    }
    async fn recv(&mut self) -> Option<kvlane_control::ChannelEvent> {
        self.0.recv().await
    }
    async fn close(&mut self) {
        self.0.close().await;
    }
}

/// A peer that stays up (answers keep-alive) but never answers explicit
/// pings, pinged every 10 ms for over 12 death bounds by callers that give
/// up: the driver does not keep one ping per ping ever sent (500 before,
/// until the peer's death); and of 65 callers that all wait, the first
/// learns that its ping was dropped for the 64 newer ones (the peer
/// machine no longer recognizes its pong).
#[tokio::test(start_paused = true)]
async fn pings_a_live_peer_never_answers_stay_bounded() {
    use kvlane_control::ControlError;
    let net = MemNetwork::new();
    let cfg = fast_config();
    let a = std::sync::Arc::new(ControlNode::with_channel(
        cfg.clone(),
        local("a"),
        net.bind("a:1"),
    ));
    let b = ControlNode::with_channel(cfg.clone(), local("b"), NoProbePongs(net.bind("b:1")));
    let (id, _) = a.connect("b:1").await.expect("connect");
    let rounds = 500;
    for _ in 0..rounds {
        let r = tokio::time::timeout(Duration::from_millis(5), a.ping(id)).await;
        assert!(r.is_err(), "{r:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        cfg.death_bound() * 12 < Duration::from_millis(10) * rounds,
        "the peer was pinged for a dozen death bounds"
    );
    let peers = a.peers().await.expect("peers");
    assert!(
        matches!(peers[0].state, State::Ready | State::Suspect),
        "{peers:?}"
    );
    let waiting = a.stats().await.expect("stats").pings_waiting;
    assert!(waiting <= 64, "{waiting} pings waiting for one peer");
    // 65 callers that wait: the oldest ping makes room for the newest.
    let callers: Vec<_> = (0..65)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move { a.ping(id).await })
        })
        .collect();
    let mut results = Vec::new();
    for c in callers {
        results.push(c.await.expect("join"));
    }
    assert!(
        matches!(results[0], Err(ControlError::PingDropped { peer, waiting: 64, .. }) if peer == id),
        "{:?}",
        results[0]
    );
    let dropped = results
        .iter()
        .filter(|r| matches!(r, Err(ControlError::PingDropped { .. })))
        .count();
    assert_eq!(dropped, 1, "{results:?}");
    let err = results[0].as_ref().expect_err("dropped").to_string();
    assert!(err.contains("b:1"), "{err}");
    assert!(a.stats().await.expect("stats").pings_waiting <= 64);
    a.close().await;
    b.close().await;
}
