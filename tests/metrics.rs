//! `Agent::metrics` and its HTTP exposition, scraped from live agents over
//! tcp: counts follow the transfers that ran, failures are counted by
//! kind, peer states follow the connection.

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// The value of the sample named exactly `series` (name and labels).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        (name == series).then(|| v.parse().unwrap())
    })
}

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_agent_counts_its_transfers_and_serves_them_over_http() {
    let prefill = agent("prefill").await;
    let decode = agent("decode").await;
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    for i in 0..5u32 {
        peer.write_blocks(0..2, &[i], &[i], None)
            .unwrap()
            .await
            .unwrap();
    }
    // Three more WRITEs posted as one batch (`Peer::post_batch`).
    let prepared = (5..8u32)
        .map(|i| {
            peer.prepare(kvlane::data::Op::Write, 0..2, &[i], &[i], None)
                .unwrap()
        })
        .collect();
    for h in peer.post_batch(prepared) {
        h.unwrap().await.unwrap();
    }
    peer.read_blocks(0..1, &[0, 1], &[2, 3], None)
        .unwrap()
        .await
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scraped = prefill.clone();
    let server = tokio::spawn(kvlane::metrics::serve_http(listener, move || {
        scraped.metrics()
    }));
    let reply = get(addr, "/metrics").await;
    let (head, text) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");

    let w = r#"{peer="decode",op="write",rail="tcp"#;
    let r = r#"{peer="decode",op="read",rail="tcp"#;
    assert_eq!(
        sample(
            text,
            &format!("kvlane_transfers_total{w}\",outcome=\"ok\"}}")
        ),
        Some(8.0),
        "{text}"
    );
    assert_eq!(
        sample(
            text,
            &format!("kvlane_transfers_total{r}\",outcome=\"ok\"}}")
        ),
        Some(1.0),
        "{text}"
    );
    // 8 WRITEs of 2 layers x K and V x one 4 KiB block; a READ of 2 blocks
    // of one layer, K and V.
    assert_eq!(
        sample(text, &format!("kvlane_transfer_bytes_total{w}\"}}")),
        Some(8.0 * 4.0 * 4096.0),
        "{text}"
    );
    assert_eq!(
        sample(text, &format!("kvlane_transfer_bytes_total{r}\"}}")),
        Some(4.0 * 4096.0),
        "{text}"
    );
    assert_eq!(
        sample(
            text,
            r#"kvlane_transfer_duration_seconds_count{op="write"}"#
        ),
        Some(8.0),
        "{text}"
    );
    assert!(sample(text, r#"kvlane_transfer_duration_seconds_sum{op="write"}"#).unwrap() > 0.0);
    assert_eq!(
        sample(text, r#"kvlane_peers{state="up"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(text, "kvlane_transfers_in_flight"),
        Some(0.0),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    // The peer goes away: posting fails, counted by kind; the peer is down.
    decode.close().await;
    let mut failed = false;
    for _ in 0..200 {
        if peer.write_blocks(0..1, &[0], &[0], None).is_err() {
            failed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(failed, "posting to a closed peer kept succeeding");
    let text = prefill.metrics();
    let errors = sample(&text, r#"kvlane_transfer_errors_total{kind="peer_lost"}"#);
    assert!(errors >= Some(1.0), "{text}");
    assert_eq!(
        sample(&text, r#"kvlane_peers{state="up"}"#),
        Some(0.0),
        "{text}"
    );

    // Anything but GET /metrics is a 404.
    let reply = get(addr, "/").await;
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    server.abort();
    prefill.close().await;
}

/// Idle connections (opened, nothing sent) cannot hold the endpoint: a
/// real scrape that comes after 32 of them is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_do_not_lock_scrapes_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(kvlane::metrics::serve_http(listener, || {
        "kvlane_up 1\n".to_string()
    }));
    let mut idle = Vec::new();
    for _ in 0..32 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // Let the server take them all up before the real scrape comes.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let start = std::time::Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    // A reset (the old endpoint dropped the scrape) reads as an error.
    let read = s.read_to_string(&mut out).await;
    println!(
        "scrape after 32 idle sockets: {read:?} in {:?}",
        start.elapsed()
    );
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{read:?}: {out:?}");
    assert!(out.ends_with("kvlane_up 1\n"), "{out}");
    server.abort();
    drop(idle);
}
