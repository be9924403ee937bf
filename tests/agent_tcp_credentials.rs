//! tcp agents exchange data-plane endpoints per connection: every peer is
//! issued a credential of its own, and detaching the peer revokes it (its
//! connections to this agent are closed) without touching other peers.
//! What the tcp target refuses shows in the agent's metrics, and a
//! notification must name the peer whose connection it came on.

use kvlane::data::intercept::Intercept;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region, TcpBackend, TcpConfig};
use kvlane::{Agent, BackendChoice};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn layout() -> KvLayout {
    KvLayout::new(2, 8, 4096, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str, data_listen: Option<&str>) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let kv = Region::from_vec(
        (0..len)
            .map(|i| (i % 251) as u8 ^ name.len() as u8)
            .collect(),
        Access::ALL,
    )
    .unwrap();
    let mut b = Agent::builder()
        .engine_id(name)
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), kv.clone());
    if let Some(d) = data_listen {
        b = b.data_listen(d);
    }
    (b.build().await.unwrap(), kv)
}

/// The value of the sample named exactly `series` (name and labels).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        (name == series).then(|| v.parse().unwrap())
    })
}

/// Polls `agent`'s metrics until `series` reaches at least `min`; returns
/// the last value seen (after 10 s at the latest).
async fn wait_for(agent: &Agent, series: &str, min: f64) -> f64 {
    let start = Instant::now();
    loop {
        let v = sample(&agent.metrics(), series).unwrap_or(-1.0);
        if v >= min || start.elapsed() > Duration::from_secs(10) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn block(r: &Region, id: u32) -> Vec<u8> {
    let l = layout();
    let mut b = vec![0u8; l.block_bytes as usize];
    r.read(l.offset(0, 0, id).unwrap(), &mut b).unwrap();
    b
}

const REVOKED: &str = r#"kvlane_data_connections_refused_total{reason="revoked"}"#;
const AUTH_FAILED: &str = r#"kvlane_data_connections_refused_total{reason="auth_failed"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_a_peer_revokes_its_credential_and_spares_the_others() {
    let (b, b_kv) = agent("b", None).await;
    let (a, a_kv) = agent("a", None).await;
    let (c, c_kv) = agent("cc", None).await;
    let pa = a.connect(b.local_addr()).await.unwrap();
    let pc = c.connect(b.local_addr()).await.unwrap();
    pa.write_blocks(0..2, &[1], &[1], None)
        .unwrap()
        .await
        .unwrap();
    pc.write_blocks(0..2, &[2], &[2], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&b_kv, 1), block(&a_kv, 1));
    assert_eq!(block(&b_kv, 2), block(&c_kv, 2));
    assert_eq!(sample(&a.metrics(), REVOKED), Some(0.0));

    // `a` detaches `b` before it says bye: the credential `a` issued to
    // `b` is revoked, and `b`'s open connections into `a` (its dial-back
    // streams) are closed by `a` for it.
    pa.disconnect().await.unwrap();
    let revoked = wait_for(&a, REVOKED, 1.0).await;
    assert!(
        revoked >= 1.0,
        "no connection of b into a was closed by the revocation:\n{}",
        a.metrics()
    );

    // `c`'s credential at `b` is its own: `c` goes on, and `a` comes
    // back with a new one.
    pc.write_blocks(0..2, &[3], &[3], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&b_kv, 3), block(&c_kv, 3));
    let pa = a.connect(b.local_addr()).await.unwrap();
    pa.write_blocks(0..2, &[4], &[4], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&b_kv, 4), block(&a_kv, 4));
    // `b` served four WRITEs of one block id over 2 layers x K/V.
    let served = r#"kvlane_data_served_bytes_total{op="write"}"#;
    assert_eq!(
        sample(&b.metrics(), served),
        Some((4 * 2 * 2 * layout().block_bytes) as f64),
        "{}",
        b.metrics()
    );
    // Nobody ever presented a wrong or revoked credential to `b`.
    assert_eq!(
        sample(&b.metrics(), AUTH_FAILED),
        Some(0.0),
        "{}",
        b.metrics()
    );
    a.close().await;
    b.close().await;
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_data_connection_is_counted_as_an_auth_failure() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let data = format!("127.0.0.1:{port}");
    let (b, _) = agent("b", Some(&data)).await;
    let data2 = data.clone();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(&data2).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The challenge every connection is sent first.
        let mut challenge = [0u8; kvlane::data::tcp::wire::CHALLENGE_LEN];
        s.read_exact(&mut challenge).unwrap();
        // A hello's length of garbage: no credential matches.
        let _ = s.write_all(&[0x5a; 64]);
        let mut buf = [0u8; 16];
        // The target closes the connection instead of answering.
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
    })
    .await
    .unwrap();
    let v = wait_for(&b, AUTH_FAILED, 1.0).await;
    assert_eq!(v, 1.0, "{}", b.metrics());
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_the_wrong_key_is_counted_as_refused() {
    let len = layout().required_len().unwrap() as usize;
    let keyed = |name: &str, key: &[u8]| {
        Agent::builder()
            .engine_id(name)
            .backend(BackendChoice::Tcp)
            .psk(key.to_vec())
            .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
    };
    let b = keyed("b", b"the right key").build().await.unwrap();
    let m = keyed("mallory", b"a wrong key").build().await.unwrap();
    assert!(m.connect(b.local_addr()).await.is_err());
    let series = r#"kvlane_control_refused_total{reason="unauthenticated"}"#;
    let v = wait_for(&b, series, 1.0).await;
    assert!(v >= 1.0, "{}", b.metrics());
    m.close().await;
    b.close().await;
}

#[derive(serde::Serialize)]
struct Frame {
    from: String,
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

/// A tcp backend whose arriving notifications are rewritten (while
/// `forge` is set) to name "mallory" as their sender: what a peer holding
/// a valid credential would send to speak for another engine.
fn forger(forge: Arc<AtomicBool>) -> Intercept {
    Intercept::new(TcpBackend::new(TcpConfig::default()).unwrap()).on_notifications(move |notes| {
        if !forge.load(Ordering::Relaxed) {
            return;
        }
        for n in notes {
            n.payload = rmp_serde::to_vec_named(&Frame {
                from: "mallory".into(),
                payload: b"forged".to_vec(),
            })
            .unwrap()
            .into();
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_notification_naming_another_sender_is_refused() {
    let forge = Arc::new(AtomicBool::new(false));
    let len = layout().required_len().unwrap() as usize;
    let b = Agent::builder()
        .engine_id("b")
        .backend_instance(forger(forge.clone()))
        .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
        .build()
        .await
        .unwrap();
    let mut notes = b.notifications().unwrap();
    let (a, _) = agent("a", None).await;
    let pa = a.connect(b.local_addr()).await.unwrap();
    // As sent: the frame names `a`, the connection is `a`'s.
    pa.write_blocks(0..2, &[1], &[1], Some(b"real"))
        .unwrap()
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((n.from.as_str(), &n.payload[..]), ("a", &b"real"[..]));
    // Arriving on `a`'s connection but naming "mallory": refused.
    forge.store(true, Ordering::Relaxed);
    pa.write_blocks(0..2, &[2], &[2], Some(b"second"))
        .unwrap()
        .await
        .unwrap();
    let start = Instant::now();
    while b.notifications_refused() < 1 && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.notifications_refused(), 1);
    assert_eq!(
        sample(&b.metrics(), "kvlane_notifications_refused_total"),
        Some(1.0)
    );
    assert!(
        notes.try_recv().is_err(),
        "the forged notification was delivered"
    );
    a.close().await;
    b.close().await;
}

/// The control plane checks the sender as the data plane does: a peer
/// handshaken as "a" that sends a notification frame naming "mallory"
/// over its control connection is refused and counted, not delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_notification_naming_another_sender_is_refused() {
    use kvlane::control::{Config, ControlNode, LocalInfo, Ranks};
    let (b, _) = agent("b", None).await;
    let mut notes = b.notifications().unwrap();
    // A bare control node: it handshakes as engine "a" (no data plane).
    let a = ControlNode::bind(
        Config::default(),
        LocalInfo::new("a", Ranks::default(), "kvlane"),
        "127.0.0.1:0",
    )
    .await
    .unwrap();
    let (id, _) = a.connect(b.local_addr()).await.unwrap();
    let frame = |from: &str, payload: &[u8]| {
        rmp_serde::to_vec_named(&Frame {
            from: from.into(),
            payload: payload.to_vec(),
        })
        .unwrap()
    };
    a.notify(id, 0, frame("a", b"real")).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((n.from.as_str(), &n.payload[..]), ("a", &b"real"[..]));
    a.notify(id, 0, frame("mallory", b"forged")).await.unwrap();
    // A later honest frame on the same connection: once it is delivered,
    // the forged one (sent before it, in order) was handled.
    a.notify(id, 0, frame("a", b"after")).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (n.from.as_str(), &n.payload[..]),
        ("a", &b"after"[..]),
        "the forged notification was delivered"
    );
    assert_eq!(b.notifications_refused(), 1);
    a.close().await;
    b.close().await;
}

/// A TCP proxy to `target` that records every byte crossing it, both
/// ways, as an observer of the link would see them.
fn recording_proxy(target: String) -> (String, Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(&target) else {
                continue;
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            for (mut from, mut to) in [(client, server), (s2, c2)] {
                let log = log.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        log.lock().unwrap().extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    (addr, seen)
}

/// A tcp backend that records the credential of every endpoint it issues.
fn recording_tokens(tokens: Arc<std::sync::Mutex<Vec<[u8; 16]>>>) -> Intercept {
    Intercept::new(TcpBackend::new(TcpConfig::default()).unwrap()).on_endpoint(move |ep| {
        let tcp = kvlane::data::TcpEndpoint::from_endpoint(ep).unwrap();
        tokens.lock().unwrap().push(tcp.token);
    })
}

/// With a pre-shared key, the endpoint offer and answer that cross the
/// control connection carry no usable credential: an observer who
/// records the whole control link finds neither side's tcp credential in
/// it (raw or hex), while the peers attach and move data as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_the_endpoint_exchange_shows_an_observer_no_credential() {
    let len = layout().required_len().unwrap() as usize;
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let keyed = |name: &str| {
        Agent::builder()
            .engine_id(name)
            .backend_instance(recording_tokens(tokens.clone()))
            .psk(b"the key".to_vec())
            .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
    };
    let b = keyed("b").build().await.unwrap();
    let a = keyed("a").build().await.unwrap();
    let (proxy, seen) = recording_proxy(b.local_addr().to_owned());
    let pa = a.connect(&proxy).await.unwrap();
    pa.write_blocks(0..2, &[1], &[1], None)
        .unwrap()
        .await
        .unwrap();
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 2, "an offer and an answer were issued");
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the control link went through the proxy");
    for token in &tokens {
        let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
        let found_hex = seen.windows(hex.len()).any(|w| w == hex.as_bytes());
        let found_raw = seen.windows(token.len()).any(|w| w == token);
        assert!(
            !found_hex && !found_raw,
            "an observer of the control link reads a tcp credential in the clear"
        );
    }
    a.close().await;
    b.close().await;
}
