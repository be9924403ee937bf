//! Lifecycle events are lossless: bursts of refused hellos, far past any
//! event buffer, while the owner of a node's event stream is not reading
//! (its task starved on a busy core), loses no `Ready` and no `Dead` or
//! `Closed` of a real peer.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{fast_config, local};
use kvlane_control::{ControlNode, Event, PeerEvent};

#[path = "common/zmtp.rs"]
mod zmtp;
use zmtp::{wrong_fingerprint_hello, zmtp_dealer_preamble, zmtp_frame};

/// One frame: a hello with a wrong fingerprint.
fn bad_hello() -> Vec<u8> {
    zmtp_frame(&wrong_fingerprint_hello())
}

/// Sends hellos with a wrong fingerprint (each refused) until `node` has
/// refused `count` more inbound peers than before (bounded: 60 s).
async fn refuse(node: &ControlNode, count: u64) {
    let target = node.stats().await.expect("stats").refused_inbound + count;
    let addr = node.local_addr().to_owned();
    let frame = bad_hello();
    let start = Instant::now();
    loop {
        let refused = node.stats().await.expect("stats").refused_inbound;
        if refused >= target {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {refused} of {target} hellos refused"
        );
        // A refused peer's connection is closed at once: one hello per
        // connection, many connections.
        let frame = frame.clone();
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            let mut held = Vec::new();
            let mut bytes = zmtp_dealer_preamble();
            bytes.extend_from_slice(&frame);
            for _ in 0..500 {
                let Ok(mut s) = TcpStream::connect(&addr) else {
                    continue;
                };
                let _ = s.write_all(&bytes);
                held.push(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        })
        .await
        .expect("join");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_hellos_never_push_out_a_peers_lifecycle_events() {
    // A deadlock of the runtime's workers (one was seen here: both parked
    // on one lock of the vendored zeromq's peer map) stops tokio's timers
    // too: a plain thread fails the test instead of letting it hang.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(240));
        eprintln!("zmq_lifecycle: still running after 240 s: the runtime is stuck");
        std::process::exit(1);
    });
    let b = ControlNode::bind(fast_config(), local("b"), "127.0.0.1:0")
        .await
        .expect("bind");
    // The owner's stream, not read during the bursts.
    let mut events = b.take_events().expect("the owner's stream");
    let a = ControlNode::bind(fast_config(), local("a"), "127.0.0.1:0")
        .await
        .expect("bind");
    let (id_at_a, _) = a.connect(b.local_addr()).await.expect("connect");
    refuse(&b, 2_500).await;
    a.disconnect(id_at_a).await.expect("disconnect");
    refuse(&b, 2_500).await;
    // Everything `b` reported, in order.
    let mut seen: Vec<PeerEvent> = Vec::new();
    while let Ok(ev) = tokio::time::timeout(Duration::from_millis(500), events.recv()).await {
        seen.push(ev.expect("the stream ended"));
    }
    // Refused handshakes are not in it (counted instead).
    assert!(seen.len() < 100, "{} events queued", seen.len());
    let ready = seen
        .iter()
        .find(|e| matches!(&e.event, Event::Ready(info) if info.identity.engine_id == "a"));
    let Some(ready) = ready else {
        panic!("b never reported a's Ready: {seen:?}");
    };
    let left = seen
        .iter()
        .any(|e| e.id == ready.id && matches!(e.event, Event::Dead { .. } | Event::Closed));
    assert!(left, "b never reported that a left: {seen:?}");
    assert_eq!(b.stats().await.expect("stats").events_dropped, 0);
    a.close().await;
    b.close().await;
}
