//! Who a notification comes from is never taken on the sender's word: an
//! engine id that cannot name an engine (empty, longer than 256 bytes,
//! control characters) is refused at the handshake, locally and from a
//! peer, and a data-plane notification whose sender maps to no
//! connection is refused and counted, never delivered under the name its
//! frame claims.

use kvlane::control::{
    Config, ControlError, ControlNode, LocalInfo, PeerError, Ranks, Refusal, ZmqChannel,
};
use kvlane::data::intercept::Intercept;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, PeerId, Region, TcpBackend, TcpConfig};
use kvlane::{Agent, BackendChoice, ErrorKind, PeerEventKind};

mod common;
use common::metric;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn layout() -> KvLayout {
    KvLayout::new(2, 8, 4096, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

fn kv() -> Region {
    Region::alloc(layout().required_len().unwrap() as usize, Access::ALL).unwrap()
}

/// Engine ids no engine can have, with a word of the error that names
/// the problem.
fn bad_ids() -> Vec<(String, &'static str)> {
    vec![
        (String::new(), "empty"),
        ("e".repeat(257), "257 bytes"),
        ("prefill\n0".into(), "control character"),
        ("decode\u{0}".into(), "control character"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_a_malformed_engine_id_is_not_built() {
    for (id, problem) in bad_ids() {
        let built = Agent::builder()
            .engine_id(id.clone())
            .backend(BackendChoice::Loopback)
            .build()
            .await;
        match built {
            Ok(a) => {
                a.close().await;
                panic!("built an agent with engine id {id:?}");
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::InvalidInput, "{id:?}: {e}");
                let msg = e.to_string();
                assert!(msg.contains("engine id"), "{id:?}: {msg}");
                assert!(msg.contains(problem), "{id:?}: {msg}");
            }
        }
    }
    // The longest id allowed, and any other printable text, still build.
    for id in ["e".repeat(256), "prefill-0 (dp 1, tp 2/8)".into()] {
        let a = Agent::builder()
            .engine_id(id)
            .backend(BackendChoice::Loopback)
            .build()
            .await
            .unwrap();
        a.close().await;
    }
}

/// A bare control node that claims `engine_id`, on a ZeroMQ channel of its
/// own: what a peer that does not run kvlane's checks looks like.
async fn claimant(engine_id: &str) -> ControlNode {
    let config = Config::default();
    let chan = ZmqChannel::bind("127.0.0.1:0", &config).await.unwrap();
    ControlNode::with_channel(
        config,
        LocalInfo::new(engine_id, Ranks::default(), "kvlane"),
        chan,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_claiming_a_malformed_engine_id_is_refused_at_the_handshake() {
    let b = Agent::builder()
        .engine_id("b")
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), kv())
        .build()
        .await
        .unwrap();
    let mut events = b.events();
    let mut refused_so_far = refused_inbound(&b);
    for (id, problem) in bad_ids() {
        // It dials the agent: the agent refuses it, and says why.
        let node = claimant(&id).await;
        match node.connect(b.local_addr()).await {
            Ok((conn, info)) => panic!(
                "a peer claiming engine id {id:?} handshook ({conn}, agent {:?})",
                info.identity.engine_id
            ),
            Err(ControlError::Connect {
                last_error: PeerError::Refused(Refusal::Remote { code, reason }),
                ..
            }) => {
                assert_eq!(code, "bad_engine_id", "{id:?}: {reason}");
                assert!(reason.contains(problem), "{id:?}: {reason}");
            }
            Err(e) => panic!("{id:?}: refused for another reason: {e}"),
        }
        // ...and counts it (an unproven peer's refusal is counted, not sent
        // as an event that could compete with real peers' lifecycle).
        let deadline = Instant::now() + Duration::from_secs(5);
        while refused_inbound(&b) < refused_so_far + 1 {
            assert!(
                Instant::now() < deadline,
                "{id:?}: the agent counted no refusal within 5 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        refused_so_far = refused_inbound(&b);
        while let Ok(ev) = events.try_recv() {
            assert!(
                !matches!(ev.kind, PeerEventKind::Up { .. }),
                "{id:?}: the agent took the peer up"
            );
        }
        node.close().await;

        // The agent dials it: the agent refuses the id in its answer.
        let node = claimant(&id).await;
        let a = Agent::builder()
            .engine_id("a")
            .backend(BackendChoice::Tcp)
            .build()
            .await
            .unwrap();
        match a.connect(node.local_addr()).await {
            Ok(_) => panic!("connected to a peer claiming engine id {id:?}"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Refused, "{id:?}: {e}");
                let msg = format!("{e} {:?}", std::error::Error::source(&e));
                assert!(msg.contains(problem), "{id:?}: {msg}");
            }
        }
        a.close().await;
        node.close().await;
    }
    b.close().await;
}

/// A tcp backend whose arriving notifications (while `stray` is set) come
/// from a data-plane peer that maps to no connection: a credential whose
/// connection is gone, or a sender the agent never paired.
fn stray_sender(stray: Arc<AtomicBool>) -> Intercept {
    Intercept::new(TcpBackend::new(TcpConfig::default()).unwrap()).on_notifications(move |notes| {
        if !stray.load(Ordering::Relaxed) {
            return;
        }
        for n in notes {
            n.from = Some(PeerId(u64::MAX - 7));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_notification_from_a_sender_without_a_connection_is_refused() {
    let stray = Arc::new(AtomicBool::new(false));
    let b = Agent::builder()
        .engine_id("b")
        .backend_instance(stray_sender(stray.clone()))
        .register_kv(layout(), kv())
        .build()
        .await
        .unwrap();
    let mut notes = b.notifications().unwrap();
    let a = Agent::builder()
        .engine_id("a")
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), kv())
        .build()
        .await
        .unwrap();
    let pa = a.connect(b.local_addr()).await.unwrap();
    pa.write_blocks(0..2, &[1], &[1], Some(b"real"))
        .unwrap()
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((n.from.as_str(), &n.payload[..]), ("a", &b"real"[..]));
    assert_eq!(b.notifications_refused(), 0);
    // The same frame (naming "a", as `a` sends it), now from a sender the
    // agent cannot map to a connection: nobody vouches for the name.
    stray.store(true, Ordering::Relaxed);
    pa.write_blocks(0..2, &[2], &[2], Some(b"claimed"))
        .unwrap()
        .await
        .unwrap();
    let start = Instant::now();
    while b.notifications_refused() < 1 && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.notifications_refused(), 1);
    assert!(b
        .metrics()
        .lines()
        .any(|l| l == "kvlane_notifications_refused_total 1"));
    assert!(
        notes.try_recv().is_err(),
        "a notification from an unmapped sender was delivered under the name it claims"
    );
    // The sender maps again: delivered.
    stray.store(false, Ordering::Relaxed);
    pa.write_blocks(0..2, &[3], &[3], Some(b"after"))
        .unwrap()
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((n.from.as_str(), &n.payload[..]), ("a", &b"after"[..]));
    a.close().await;
    b.close().await;
}

/// The agent's count of inbound peers refused before they proved
/// themselves (`kvlane_control_refused_total{reason="unauthenticated"}`).
fn refused_inbound(agent: &Agent) -> u64 {
    metric(
        agent,
        "kvlane_control_refused_total{reason=\"unauthenticated\"}",
    )
    .unwrap_or(0)
}
