//! Hostile TCP clients against a real ZeroMQ listener on 127.0.0.1: huge
//! announced frames, silent connections, connection floods. Each bound is
//! enforced by the (vendored, patched) zeromq codec and accept loop.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{fast_config, local};
use kvlane_control::{Config, ControlNode};

#[path = "common/zmtp.rs"]
mod zmtp;
use zmtp::{long_frame_header, zmtp_dealer_preamble, zmtp_frame};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status is needed to measure resident memory");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// Reads until the server closes the connection; `Err` if it is still open
/// after `within` (a hang guard, not a performance bound).
fn closed_by_server(s: &mut TcpStream, within: Duration) -> Result<(), String> {
    s.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(format!("still open after {within:?}"))
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Frame headers announcing 1 GiB and more (single and multipart, up to
/// `u64::MAX`), followed by real bytes: each connection is closed at its
/// header, nothing is buffered for it, resident memory stays within 64 MiB,
/// and the listener keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_huge_frames_are_refused_before_any_buffering() {
    let b = ControlNode::bind(fast_config(), local("b"), "127.0.0.1:0")
        .await
        .expect("bind");
    let addr = b.local_addr().to_owned();
    let before = rss_bytes();
    let outcomes = tokio::task::spawn_blocking(move || {
        let mut outcomes = Vec::new();
        let heads: Vec<Vec<u8>> = vec![
            long_frame_header(1 << 30, false),
            long_frame_header(256 << 20, false),
            long_frame_header(u64::MAX, false),
            long_frame_header(1 << 62, false),
            // Multipart: 12 MiB parts, each under the 16 MiB cap, adding up.
            [
                long_frame_header(12 << 20, true),
                vec![0u8; 12 << 20],
                long_frame_header(12 << 20, false),
            ]
            .concat(),
        ];
        for head in heads {
            let mut s = TcpStream::connect(&addr).expect("connect");
            s.write_all(&zmtp_dealer_preamble()).expect("preamble");
            let _ = s.write_all(&head);
            // Then push real bytes as a flooder would (the write fails once
            // the server has closed the connection).
            let chunk = vec![0xabu8; 1 << 20];
            for _ in 0..64 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
            outcomes.push(closed_by_server(&mut s, Duration::from_secs(10)));
        }
        outcomes
    })
    .await
    .expect("join");
    for (i, o) in outcomes.iter().enumerate() {
        assert!(o.is_ok(), "connection {i}: {o:?}");
    }
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 64 << 20, "resident memory grew by {grown} bytes");
    // The listener still serves a real peer.
    let a = ControlNode::bind(fast_config(), local("a"), "127.0.0.1:0")
        .await
        .expect("bind a");
    a.connect(b.local_addr())
        .await
        .expect("connect after floods");
    a.close().await;
    b.close().await;
}

/// A TCP connection that never completes the ZMTP handshake is closed
/// after the handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_handshake_timeout() {
    let config = Config {
        handshake_timeout: Duration::from_millis(300),
        ..fast_config()
    };
    let b = ControlNode::bind(config, local("b"), "127.0.0.1:0")
        .await
        .expect("bind");
    let addr = b.local_addr().to_owned();
    let outcomes = tokio::task::spawn_blocking(move || {
        let mut silent: Vec<_> = (0..20)
            .map(|_| TcpStream::connect(&addr).expect("connect"))
            .collect();
        // One that sends half a greeting and stalls.
        let mut half = TcpStream::connect(&addr).expect("connect");
        half.write_all(&zmtp_dealer_preamble()[..10])
            .expect("write");
        silent.push(half);
        silent
            .iter_mut()
            .map(|s| closed_by_server(s, Duration::from_secs(10)))
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    b.close().await;
}

/// At most `peer_cap + handshake_cap` accepted connections are open at once;
/// past that a new connection evicts the oldest one that has not proven
/// itself (here: still in its ZMTP greeting), and a peer that reached
/// `Ready` is never evicted, however many connections come after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_connections_are_capped() {
    let config = Config {
        peer_cap: 2,
        handshake_cap: 2,
        handshake_timeout: Duration::from_secs(30),
        ..fast_config()
    };
    let b = ControlNode::bind(config.clone(), local("b"), "127.0.0.1:0")
        .await
        .expect("bind");
    let a = ControlNode::bind(config, local("a"), "127.0.0.1:0")
        .await
        .expect("bind");
    let (id, _) = a.connect(b.local_addr()).await.expect("connect");
    let addr = b.local_addr().to_owned();
    tokio::task::spawn_blocking(move || {
        let greeted = |s: &mut TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let mut g = [0u8; 10];
            s.read_exact(&mut g).map(|()| g[0] == 0xff)
        };
        // `a` holds one slot; three more fill the cap.
        let mut held: Vec<_> = (0..3)
            .map(|_| TcpStream::connect(&addr).expect("connect"))
            .collect();
        for s in &mut held {
            assert!(greeted(s).expect("a connection within the cap is greeted"));
        }
        // Past the cap: the newcomer is served, the oldest unproven
        // connection is closed for it.
        let mut extra = TcpStream::connect(&addr).expect("connect");
        assert!(greeted(&mut extra).expect("a connection past the cap is greeted"));
        closed_by_server(&mut held[0], Duration::from_secs(10))
            .expect("the oldest unproven connection is evicted");
        // Many more: each evicts an unproven one, never `a`.
        for _ in 0..20 {
            let mut s = TcpStream::connect(&addr).expect("connect");
            assert!(greeted(&mut s).unwrap_or(false));
            held.push(s);
        }
    })
    .await
    .expect("join");
    a.ping(id).await.expect("a's proven connection was kept");
    a.close().await;
    b.close().await;
}

/// Connections that pass the ZMTP handshake but never finish a kvlane one
/// are closed and give their slot under the accept cap back: one that
/// sends nothing (closed after the handshake timeout), one whose first
/// message is garbage (closed at once), and one that sends a keyed hello
/// and then nothing (closed when the registry's handshake times out). With
/// every slot once taken by them, a real peer still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_finish_a_kvlane_handshake_are_closed() {
    use kvlane_control::wire::{Hello, Message};
    use kvlane_control::Psk;
    let config = Config {
        peer_cap: 2,
        handshake_cap: 2,
        handshake_timeout: Duration::from_millis(300),
        psk: Some(Psk::new(&b"the key"[..])),
        ..fast_config()
    };
    let b = ControlNode::bind(config.clone(), local("b"), "127.0.0.1:0")
        .await
        .expect("bind");
    let addr = b.local_addr().to_owned();
    let hello = Message::Hello(Hello::new(
        Default::default(),
        Some(vec![7u8; 32]),
        Vec::new(),
        None,
    ))
    .encode()
    .expect("encode");
    let outcomes = tokio::task::spawn_blocking(move || {
        let open = |then: &[u8]| {
            let mut s = TcpStream::connect(&addr).expect("connect");
            let mut first = zmtp_dealer_preamble();
            first.extend_from_slice(then);
            s.write_all(&first).expect("write");
            s
        };
        // Every slot (peer_cap + handshake_cap = 4) taken.
        let mut held = [
            ("silent", open(&[])),
            ("silent", open(&[])),
            ("garbage first message", open(&zmtp_frame(b"not msgpack"))),
            ("keyed hello, then nothing", open(&zmtp_frame(&hello))),
        ];
        held.iter_mut()
            .map(|(what, s)| (*what, closed_by_server(s, Duration::from_secs(10))))
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    for (what, outcome) in &outcomes {
        assert!(outcome.is_ok(), "{what}: {outcome:?}");
    }
    let a = ControlNode::bind(config, local("a"), "127.0.0.1:0")
        .await
        .expect("bind");
    a.connect(b.local_addr())
        .await
        .expect("a real peer connects once the slots are free");
    a.close().await;
    b.close().await;
}
