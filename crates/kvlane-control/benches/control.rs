//! Control-plane latency on 127.0.0.1: ping RTT through `ControlNode` vs a
//! raw `zeromq` ROUTER/DEALER echo measured in the same run, and handshake
//! latency (connect → Ready, then disconnect).
//!
//! Prints p50/p99 of each (fixed sample count) before the criterion runs,
//! twice: with the callers on a thread outside the runtime (where both round
//! trips are mostly thread wake-ups) and in a task on a runtime worker.
#![allow(missing_docs)] // criterion macros generate undocumented items

use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use kvlane_control::{Config, ControlNode, LocalInfo, Ranks};
use tokio::runtime::Runtime;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn rt() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn local(e: &str) -> LocalInfo {
    LocalInfo::new(
        e,
        Ranks {
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
        },
        "fp",
    )
    .with_data_plane(vec![7; 256])
}

struct RawEcho {
    dealer: DealerSocket,
}

impl RawEcho {
    async fn new() -> Self {
        let mut router = RouterSocket::new();
        let ep = router.bind("tcp://127.0.0.1:0").await.expect("bind");
        tokio::spawn(async move {
            while let Ok(m) = router.recv().await {
                if router.send(m).await.is_err() {
                    break;
                }
            }
        });
        let mut dealer = DealerSocket::new();
        dealer.connect(&ep.to_string()).await.expect("connect");
        Self { dealer }
    }

    async fn rtt(&mut self) -> Duration {
        let t = Instant::now();
        self.dealer
            .send(ZmqMessage::from(vec![1u8; 32]))
            .await
            .expect("send");
        self.dealer.recv().await.expect("recv");
        t.elapsed()
    }
}

struct Pair {
    a: ControlNode,
    b: ControlNode,
    id: kvlane_control::ConnectionId,
}

impl Pair {
    async fn new() -> Self {
        let a = ControlNode::bind(Config::default(), local("a"), "127.0.0.1:0")
            .await
            .expect("bind");
        let b = ControlNode::bind(Config::default(), local("b"), "127.0.0.1:0")
            .await
            .expect("bind");
        let (id, _) = a.connect(b.local_addr()).await.expect("connect");
        Self { a, b, id }
    }
}

async fn handshake(a: &ControlNode, addr: &str) -> Duration {
    let t = Instant::now();
    let (id, _) = a.connect(addr).await.expect("connect");
    let took = t.elapsed();
    a.disconnect(id).await.expect("disconnect");
    took
}

fn pct(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

/// Raw echo RTT, control ping (API round trip) and the ping -> pong time
/// the peer machine measured, `n` of each, interleaved so both see the same
/// machine load.
async fn rtts(raw: &mut RawEcho, pair: &Pair, n: usize) -> [Vec<Duration>; 3] {
    let (mut r, mut c, mut wire) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        r.push(raw.rtt().await);
        let t = Instant::now();
        wire.push(pair.a.ping(pair.id).await.expect("ping"));
        c.push(t.elapsed());
    }
    [r, c, wire]
}

fn print_rtts(caller: &str, [r, c, wire]: [Vec<Duration>; 3]) {
    let (rp50, rp99) = pct(r);
    let (cp50, cp99) = pct(c);
    let (wp50, wp99) = pct(wire);
    eprintln!("callers {caller}:");
    eprintln!("  raw zeromq echo RTT     p50 {rp50:?} p99 {rp99:?}");
    eprintln!(
        "  control ping RTT        p50 {cp50:?} p99 {cp99:?}  (ratio p50 {:.2}x)",
        cp50.as_secs_f64() / rp50.as_secs_f64()
    );
    eprintln!(
        "    of which ping -> pong p50 {wp50:?} p99 {wp99:?}  (ratio p50 {:.2}x; the rest is \
         the caller -> driver -> caller hops)",
        wp50.as_secs_f64() / rp50.as_secs_f64()
    );
}

fn report() {
    let rt = rt();
    rt.block_on(async {
        let n = 3000;
        let mut raw = RawEcho::new().await;
        let pair = Pair::new().await;
        rtts(&mut raw, &pair, 300).await; // warm-up
                                          // Callers on a thread outside the runtime (as `BlockingAgent` and
                                          // criterion's `block_on` below), then in a task on a runtime worker
                                          // (as async engine code).
        print_rtts("outside the runtime", rtts(&mut raw, &pair, n).await);
        let pair = tokio::spawn(async move {
            print_rtts("in a runtime task", rtts(&mut raw, &pair, n).await);
            pair
        })
        .await
        .expect("measuring task");
        let mut h = Vec::new();
        let addr = pair.b.local_addr().to_owned();
        let hs = ControlNode::bind(Config::default(), local("h"), "127.0.0.1:0")
            .await
            .expect("bind");
        for _ in 0..1000 {
            h.push(handshake(&hs, &addr).await);
        }
        let (hp50, hp99) = pct(h);
        eprintln!("handshake (connect)     p50 {hp50:?} p99 {hp99:?}");
        hs.close().await;
        pair.a.close().await;
        pair.b.close().await;
    });
}

fn benches(c: &mut Criterion) {
    let rt = rt();
    let mut raw = rt.block_on(RawEcho::new());
    let pair = rt.block_on(Pair::new());
    let hs = rt
        .block_on(ControlNode::bind(
            Config::default(),
            local("h"),
            "127.0.0.1:0",
        ))
        .expect("bind");
    let addr = pair.b.local_addr().to_owned();
    let mut g = c.benchmark_group("control");
    g.bench_function("raw_zmq_echo_rtt", |b| b.iter(|| rt.block_on(raw.rtt())));
    g.bench_function("control_ping_rtt", |b| {
        b.iter(|| rt.block_on(pair.a.ping(pair.id)).expect("ping"))
    });
    g.bench_function("handshake", |b| {
        b.iter(|| rt.block_on(handshake(&hs, &addr)))
    });
    g.finish();
    rt.block_on(async {
        hs.close().await;
        pair.a.close().await;
        pair.b.close().await;
    });
}

criterion_group!(group, benches);

fn main() {
    report();
    group();
    Criterion::default().configure_from_args().final_summary();
}
