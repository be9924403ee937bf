//! 10,000 connect/disconnect cycles against the same peer: no panic, no
//! leaked file descriptor (its own test binary so no other test opens fds
//! meanwhile).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fast_config, local};
use kvlane_control::ControlNode;

/// Open file descriptors of this process. Without `/proc` the leak check
/// cannot run, so the test fails rather than compare zero with zero.
fn open_fds() -> usize {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => d.count(),
        Err(e) => {
            panic!("cannot count open fds: /proc/self/fd: {e} (the fd-leak check needs /proc)")
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariant_3_4_5_churn_10000_cycles_no_fd_leak() {
    let cycles: usize = std::env::var("KVLANE_CHURN_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlane-control-peer"))
        .args(["127.0.0.1:0", "churn-peer", "fp"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("line");
    let addr = line
        .trim()
        .strip_prefix("LISTENING ")
        .expect("LISTENING")
        .to_owned();

    let a = ControlNode::bind(fast_config(), local("a"), "127.0.0.1:0")
        .await
        .expect("bind");
    // Warm up once so lazily created runtime resources exist before the baseline.
    let (id, _) = a.connect(&addr).await.expect("warm-up connect");
    a.disconnect(id).await.expect("disconnect");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = open_fds();

    let start = Instant::now();
    let mut last = None;
    for i in 0..cycles {
        let (id, _) = a
            .connect(&addr)
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: {e}"));
        assert_ne!(Some(id), last, "every connection gets its own id");
        last = Some(id);
        a.disconnect(id).await.expect("disconnect");
    }
    let took = start.elapsed();
    eprintln!(
        "{cycles} cycles in {took:?} ({:?}/cycle)",
        took / cycles as u32
    );

    // Every lingering close finishes within close_linger; sockets follow.
    let settle = Instant::now();
    let mut now_fds = open_fds();
    while now_fds > baseline && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        now_fds = open_fds();
    }
    eprintln!("fds: baseline {baseline}, after {now_fds}");
    assert!(
        a.peers().await.expect("peers").is_empty(),
        "every connection released"
    );
    assert!(now_fds <= baseline, "fd leak: {baseline} -> {now_fds}");
    a.close().await;
    let _ = child.kill();
    let _ = child.wait();
}
