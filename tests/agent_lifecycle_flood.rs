//! Peer lifecycle events are lossless: a burst of refused hellos (far more
//! than any event buffer holds) does not make an agent miss another peer's
//! `Ready` (it attaches) or its `Dead`/`Closed` (it is detached, and the
//! credential it was issued revoked). End to end through the agent; the
//! deterministic form (a reader that does not read during the burst) is
//! `kvlane-control`'s `refused_hellos_never_push_out_a_peers_lifecycle_events`.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};

fn layout() -> KvLayout {
    KvLayout::new(2, 8, 4096, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str) -> Agent {
    let len = layout().required_len().unwrap() as usize;
    Agent::builder()
        .engine_id(name)
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
        .build()
        .await
        .unwrap()
}

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        (name == series).then(|| v.parse().unwrap())
    })
}

/// Connections of `agent` whose data plane is attached: a peer that left
/// and was seen leaving (`Dead` or `Closed`) is detached, and the
/// credential it was issued revoked.
fn attached(agent: &Agent) -> f64 {
    sample(&agent.metrics(), r#"kvlane_peers{state="up"}"#).unwrap_or(0.0)
}

#[path = "../crates/kvlane-control/tests/common/zmtp.rs"]
mod zmtp;
use zmtp::{wrong_fingerprint_hello, zmtp_dealer_preamble, zmtp_frame};

/// `hellos` hellos with a wrong fingerprint, spread over `conns` raw
/// connections (a hello on a link whose connection was refused starts a
/// new one, refused in turn).
fn flood(addr: &str, conns: usize, hellos: usize) -> usize {
    let frame = zmtp_frame(&wrong_fingerprint_hello());
    let per = hellos / conns;
    let mut sent = 0;
    let mut held = Vec::new();
    for _ in 0..conns {
        let Ok(mut s) = TcpStream::connect(addr) else {
            continue;
        };
        let mut bytes = zmtp_dealer_preamble();
        for _ in 0..per {
            bytes.extend_from_slice(&frame);
        }
        if s.write_all(&bytes).is_ok() {
            sent += per;
        }
        held.push(s);
    }
    // Held open a moment, so the burst is read, not cut off by a close.
    std::thread::sleep(Duration::from_millis(500));
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_refused_hellos_loses_no_lifecycle_event() {
    let b = agent("b").await;
    let a = agent("a").await;
    let addr = b.local_addr().to_owned();
    for round in 0..3 {
        let flood_addr = addr.clone();
        let flooder = tokio::task::spawn_blocking(move || flood(&flood_addr, 8, 20_000));
        // While the burst is being read: attach, write, detach.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let start = Instant::now();
        let pa = a
            .connect(&addr)
            .await
            .unwrap_or_else(|e| panic!("round {round}: attach under the burst failed: {e}"));
        println!("round {round}: attached in {:?}", start.elapsed());
        pa.write_blocks(0..2, &[1], &[1], None)
            .unwrap()
            .await
            .unwrap();
        pa.disconnect().await.unwrap();
        let sent = flooder.await.unwrap();
        assert!(sent > 10_000, "the burst sent only {sent} hellos");
        // `b` saw `a` leave: it detached `a` (revoking its credential).
        let start = Instant::now();
        let mut left = attached(&b);
        while left > 0.0 && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            left = attached(&b);
        }
        assert_eq!(
            left,
            0.0,
            "round {round}: b still has a attached after it left (missed its Dead/Closed):\n{}",
            b.metrics()
        );
    }
    a.close().await;
    b.close().await;
}
