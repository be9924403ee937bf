//! A standalone control-plane peer for tests and manual checks.
//!
//! Usage: `kvlane-control-peer <listen host:port> [engine-id] [fingerprint]`.
//! Prints `LISTENING <host:port>` on stdout once bound, logs peer events on
//! stderr, and exits when stdin closes.

use kvlane_control::{Config, ControlNode, LocalInfo, Ranks};
use tokio::io::AsyncReadExt;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:0".into());
    let engine = args.next().unwrap_or_else(|| "peer".into());
    let fingerprint = args.next().unwrap_or_else(|| "fp".into());
    let mut config = Config::default();
    if let Ok(ms) = std::env::var("KVLANE_KEEPALIVE_MS").map(|v| v.parse::<u64>()) {
        config.keepalive_interval = std::time::Duration::from_millis(ms.unwrap_or(1000));
    }
    let local = LocalInfo::new(
        engine,
        Ranks {
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
        },
        fingerprint,
    )
    .with_data_plane(b"peer-data-plane".to_vec());
    let node = match ControlNode::bind(config, local, &listen).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("kvlane-control-peer: {e}");
            std::process::exit(2);
        }
    };
    println!("LISTENING {}", node.local_addr());
    let mut events = node.events();
    let log = tokio::spawn(async move {
        while let Ok(ev) = events.recv().await {
            eprintln!("event {} {}: {:?}", ev.id, ev.addr, ev.event);
        }
    });
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    node.close().await;
    log.abort();
}
