//! What keep-alive costs an agent with many peers: one hub node dials N
//! peer nodes (in a child process, so only the hub is measured) over real
//! ZeroMQ on 127.0.0.1, waits until every peer is ready, then measures the
//! hub's CPU time (user + system, from `/proc/self/stat`) over a window
//! during which nothing but keep-alive happens.
//!
//! ```sh
//! cargo run --release -p kvlane-control --example keepalive_cpu -- 1000 10
//! ```
//!
//! Arguments: peers (default 1000), seconds to measure (default 10). The
//! keep-alive interval is the default ([`Config::default`], 1 s) unless
//! `KVLANE_KEEPALIVE_MS` is set. Prints one line:
//! `keepalive_cpu peers=N interval=1s window=10.0s cpu=0.123s percent_of_one_core=1.23`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvlane_control::{Config, ControlNode, LocalInfo, Ranks};

fn config() -> Config {
    let mut c = Config::default();
    if let Some(ms) = std::env::var("KVLANE_KEEPALIVE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        c.keepalive_interval = Duration::from_millis(ms);
    }
    c.peer_cap = c.peer_cap.max(4096);
    c
}

fn local(engine: String) -> LocalInfo {
    let ranks = Ranks {
        dp_rank: 0,
        tp_rank: 0,
        tp_size: 1,
    };
    LocalInfo::new(engine, ranks, "fp").with_data_plane(b"blob".to_vec())
}

/// User + system CPU time of this process. `/proc/self/stat` counts in
/// clock ticks of `USER_HZ`, which Linux fixes at 100 for user space.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The child: N nodes, their addresses on stdout, until stdin closes.
fn peers(n: usize) {
    runtime().block_on(async {
        let mut nodes = Vec::with_capacity(n);
        let mut out = std::io::stdout().lock();
        for i in 0..n {
            let node = ControlNode::bind(config(), local(format!("peer-{i}")), "127.0.0.1:0")
                .await
                .expect("bind a peer");
            writeln!(out, "{}", node.local_addr()).expect("stdout");
            nodes.push(node);
        }
        out.flush().expect("stdout");
        drop(out);
        tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            let _ = std::io::stdin().read_line(&mut s);
        })
        .await
        .expect("stdin");
        for n in nodes {
            n.close().await;
        }
    });
}

fn main() {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    if first.as_deref() == Some("--peers-child") {
        let n = args.next().and_then(|v| v.parse().ok()).unwrap_or(1000);
        return peers(n);
    }
    let n: usize = first.and_then(|v| v.parse().ok()).unwrap_or(1000);
    let window: u64 = args.next().and_then(|v| v.parse().ok()).unwrap_or(10);
    let mut child = Command::new(std::env::current_exe().expect("current exe"))
        .args(["--peers-child", &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the peers");
    let addrs: Vec<String> = BufReader::new(child.stdout.take().expect("stdout"))
        .lines()
        .take(n)
        .map(|l| l.expect("peer address"))
        .collect();
    assert_eq!(
        addrs.len(),
        n,
        "the peers process printed {} addresses",
        addrs.len()
    );
    let interval = config().keepalive_interval;
    runtime().block_on(async {
        let hub = ControlNode::bind(config(), local("hub".into()), "127.0.0.1:0")
            .await
            .expect("bind the hub");
        for chunk in addrs.chunks(50) {
            let dials = chunk.iter().map(|a| hub.connect(a));
            for r in futures::future::join_all(dials).await {
                r.expect("connect a peer");
            }
        }
        // Let the handshake bursts settle: keep-alive only from here on.
        tokio::time::sleep(interval * 2).await;
        let (t0, c0) = (Instant::now(), cpu_time());
        tokio::time::sleep(Duration::from_secs(window)).await;
        let (wall, cpu) = (t0.elapsed(), cpu_time() - c0);
        let ready = hub
            .peers()
            .await
            .expect("peers")
            .iter()
            .filter(|p| p.state == kvlane_control::State::Ready)
            .count();
        println!(
            "keepalive_cpu peers={n} ready={ready} interval={interval:?} window={:.1}s cpu={:.3}s percent_of_one_core={:.2}",
            wall.as_secs_f64(),
            cpu.as_secs_f64(),
            100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
        );
        hub.close().await;
    });
    drop(child.stdin.take());
    let _ = child.wait();
}
