//! What an idle agent costs the engine (issue 40, item 2): two agents on
//! the tcp backend, connected, with nothing in flight for `--secs` seconds
//! (default 10). Prints the CPU time the process took meanwhile
//! (`/proc/self/stat` utime + stime) and the wake-ups of its threads
//! (voluntary + involuntary context switches of every thread).
//!
//! ```sh
//! cargo run --release --example idle_cost -- 10
//! ```

use kvlane::data::{Access, Region};
use kvlane::{Agent, BackendChoice};
use std::time::Duration;

/// (utime + stime in clock ticks, context switches of all threads).
fn cost() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let mut switches = 0;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            let s = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            for l in s.lines() {
                if let Some(v) = l
                    .strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                {
                    switches += v.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
    }
    (ticks, switches)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), kvlane::Error> {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let agent = |name: &'static str| async move {
        Agent::builder()
            .engine_id(name)
            .backend(BackendChoice::Tcp)
            .register_region(Region::from_vec(vec![0u8; 1 << 20], Access::ALL)?)
            .build()
            .await
    };
    let a = agent("idle-a").await?;
    let b = agent("idle-b").await?;
    let peer = a.connect(b.local_addr()).await?;
    // One transfer first, so every thread a transfer uses has started.
    let region = &a.regions()[0];
    let remote = &b.regions()[0];
    let spans = [kvlane::MemSpan::new(region.addr(), 4096)];
    let rspans = [kvlane::MemSpan::new(remote.addr(), 4096)];
    peer.post(peer.prepare_spans(kvlane::data::Op::Read, &spans, &rspans, None)?)?
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (t0, s0) = cost();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (t1, s1) = cost();
    let hz = 100.0; // USER_HZ on Linux
    println!(
        "idle {secs} s, two connected agents: cpu {:.3} s ({:.2}% of one core), {} context switches ({:.1}/s)",
        (t1 - t0) as f64 / hz,
        (t1 - t0) as f64 / hz / secs as f64 * 100.0,
        s1 - s0,
        (s1 - s0) as f64 / secs as f64
    );
    a.close().await;
    b.close().await;
    Ok(())
}
