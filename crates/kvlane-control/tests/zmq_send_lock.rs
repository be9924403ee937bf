//! The vendored zeromq ROUTER (vendor/zeromq/KVLANE-PATCH.md, point 4): a
//! send that waits on a peer which does not read must not hold the peers
//! map's lock, or the receiving task, removing disconnected peers of the
//! same bucket with a blocking call, stops for good (`kvlane serve` once
//! ignored SIGTERM under a flood because of it).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

#[test]
fn a_send_stuck_on_a_peer_that_does_not_read_leaves_the_receiver_running() {
    // Built by hand: with the bug a worker thread never returns, and a
    // `#[tokio::test]` runtime would hang the test in its shutdown.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (seen_tx, seen) = mpsc::channel::<Bytes>();
    let mut keep = Vec::new();
    let addr = rt.block_on(async {
        let mut router = RouterSocket::new();
        let addr = router
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind")
            .to_string();
        let (mut tx, mut rx) = router.split();
        // A says hello once and never reads; C stays connected (with two
        // peers a send goes through the peers map, not the one-peer cache).
        let mut a = DealerSocket::new();
        a.connect(&addr).await.expect("connect a");
        a.send(ZmqMessage::from("a")).await.expect("a hello");
        let a_id = rx
            .recv()
            .await
            .expect("a's hello")
            .get(0)
            .expect("id")
            .clone();
        let mut c = DealerSocket::new();
        c.connect(&addr).await.expect("connect c");
        c.send(ZmqMessage::from("c")).await.expect("c hello");
        rx.recv().await.expect("c's hello");
        keep.push(a);
        keep.push(c);
        // The receiver: every payload it gets goes to the test thread.
        tokio::spawn(async move {
            while let Ok(m) = rx.recv().await {
                if let Some(p) = m.get(1) {
                    let _ = seen_tx.send(p.clone());
                }
            }
        });
        // 1 MiB messages to A until its socket and queue are full and a
        // send waits for good.
        tokio::spawn(async move {
            let big = Bytes::from(vec![0u8; 1 << 20]);
            loop {
                let mut m = ZmqMessage::from(big.clone());
                m.push_front(a_id.clone());
                if tx.send(m).await.is_err() {
                    return;
                }
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Peers that come and go: the receiver removes each as it reads
        // its end (with the bug, the first in A's bucket blocks it).
        for i in 0..64 {
            let mut d = DealerSocket::new();
            d.connect(&addr).await.expect("connect");
            d.send(ZmqMessage::from(format!("p{i}")))
                .await
                .expect("send");
            drop(d);
        }
        addr
    });
    // Everything is waited for on this thread (a stuck runtime cannot hang
    // it). First the 64 peers' words and a moment for their ends to be
    // read; then B's message must still come through, however long the
    // send to A waits.
    let end = Instant::now() + Duration::from_secs(15);
    let mut heard = 0;
    while heard < 64 {
        let Some(left) = end.checked_duration_since(Instant::now()) else {
            break;
        };
        match seen.recv_timeout(left) {
            Ok(p) if p.starts_with(b"p") => heard += 1,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let b = rt.block_on(async {
        let mut b = DealerSocket::new();
        b.connect(&addr).await.expect("connect b");
        b.send(ZmqMessage::from("b")).await.expect("b says");
        b
    });
    let end = Instant::now() + Duration::from_secs(15);
    let mut got_b = false;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match seen.recv_timeout(left) {
            Ok(p) if p.as_ref() == b"b" => {
                got_b = true;
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    drop((b, keep));
    rt.shutdown_background();
    assert_eq!(
        heard, 64,
        "the ROUTER's receiver stalled for 15 s while a send waited on a peer that does not read"
    );
    assert!(
        got_b,
        "the ROUTER's receiver stopped while a send waited on a peer that does not read"
    );
}
