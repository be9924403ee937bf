//! What an agent listens on and what it advertises: a wildcard listener is
//! dialed at the host each peer reached it at, a wrong `advertise` fails
//! naming both addresses, IPv6 works, and a group whose rank cannot be
//! attached leaves no rank connected. (Across hosts, in network
//! namespaces: crates/kvlane-cli/tests/multihost.rs.)

mod common;

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, AgentBuilder, BackendChoice, ErrorKind, PeerEventKind};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout::new(2, 8, 4096, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

fn builder(name: &str, listen: &str, seed: u8) -> (AgentBuilder, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region =
        Region::from_vec((0..len).map(|i| (i as u8) ^ seed).collect(), Access::ALL).unwrap();
    let b = Agent::builder()
        .engine_id(name)
        .listen(listen)
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), region.clone());
    (b, region)
}

fn block(r: &Region, id: u32) -> Vec<u8> {
    let l = layout();
    let mut b = vec![0u8; l.block_bytes as usize];
    r.read(l.offset(0, 0, id).unwrap(), &mut b).unwrap();
    b
}

fn port_of(addr: &str) -> &str {
    addr.rsplit_once(':').unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_listener_serves_a_peer_on_loopback() {
    // On one host every address reaches the listener; that the host the
    // peer reached is the one dialed is shown across namespaces
    // (multihost tests) and by `TcpEndpoint::reached_at` unit tests.
    let (b, decode_kv) = builder("decode", "0.0.0.0:0", 2);
    let decode = b.build().await.unwrap();
    assert!(decode.local_addr().starts_with("0.0.0.0:"));
    let (b, prefill_kv) = builder("prefill", "127.0.0.1:0", 1);
    let prefill = b.build().await.unwrap();
    let addr = format!("127.0.0.1:{}", port_of(decode.local_addr()));
    let peer = prefill.connect(&addr).await.unwrap();
    peer.write_blocks(0..1, &[1], &[5], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&prefill_kv, 1), block(&decode_kv, 5));
    peer.read_blocks(0..1, &[2], &[6], None)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&prefill_kv, 2), block(&decode_kv, 6));
    prefill.close().await;
    decode.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advertised_address_the_peer_cannot_reach_names_both_addresses() {
    // Listening on IPv4 only and advertising ::1: nothing answers there.
    let (b, _) = builder("decode", "0.0.0.0:0", 2);
    let decode = b.advertise("::1").build().await.unwrap();
    let (b, _) = builder("prefill", "127.0.0.1:0", 1);
    let prefill = b.build().await.unwrap();
    let addr = format!("127.0.0.1:{}", port_of(decode.local_addr()));
    let e = prefill.connect(&addr).await.unwrap_err();
    let msg = format!("{e}: {:?}", std::error::Error::source(&e));
    assert_eq!(e.kind(), ErrorKind::Io, "{msg}");
    assert!(
        msg.contains("[::1]:"),
        "names the advertised address: {msg}"
    );
    assert!(
        msg.contains("listens on 0.0.0.0:"),
        "names the listen address: {msg}"
    );
    prefill.close().await;
    decode.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_talk_over_ipv6() {
    let (b, decode_kv) = builder("decode", "[::1]:0", 2);
    let decode = b.build().await.unwrap();
    assert!(
        decode.local_addr().starts_with("[::1]:"),
        "{}",
        decode.local_addr()
    );
    let (b, prefill_kv) = builder("prefill", "[::]:0", 1);
    let prefill = b.build().await.unwrap();
    let mut decode_events = decode.events();
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    peer.write_blocks(0..2, &[3], &[4], Some(b"v6"))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(block(&prefill_kv, 3), block(&decode_kv, 4));
    // The decode side attached back to prefill's `[::]` listener at the
    // address prefill's hello said it sends from.
    let up = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(ev) = decode_events.recv().await {
                if matches!(ev.kind, PeerEventKind::Up { .. }) {
                    return ev;
                }
            }
        }
    })
    .await
    .expect("decode saw prefill come up");
    assert!(up.addr.starts_with("inbound:"), "{up:?}");
    prefill.close().await;
    decode.close().await;
}

/// Two decode ranks on consecutive ports of a wildcard listener; rank 1
/// advertises `rank1_advertise`.
async fn ranks(rank1_advertise: &'static str) -> (u16, Vec<Agent>) {
    common::rank_agents(2, |rank, port| {
        let (b, _) = builder("decode", &format!("0.0.0.0:{port}"), rank as u8);
        let b = b.ranks(0, u32::from(rank), 2);
        if rank == 1 {
            b.advertise(rank1_advertise)
        } else {
            b
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_a_rank_whose_data_plane_fails_leaves_no_rank_connected() {
    let (base, ranks) = ranks("::1").await;
    let mut rank0_events = ranks[0].events();
    let (b, _) = builder("prefill", "127.0.0.1:0", 9);
    let prefill = b.build().await.unwrap();
    let e = prefill
        .connect_group("127.0.0.1", base, 0, 2)
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("tp rank 1") && !msg.contains("tp rank 0"),
        "{msg}"
    );
    assert!(msg.contains("[::1]:"), "{msg}");
    // Rank 0's data plane was attached (the error names only rank 1), and
    // rank 0 is let go (`bye`). Its own `Up` is not awaited: it comes from
    // rank 0's attach back to the dialer, which may lose the race against
    // the `bye`.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match rank0_events.recv().await.map(|ev| ev.kind) {
                // The dialer said `bye`: on this side the connection ends.
                Ok(PeerEventKind::Dead { last_error, .. }) if last_error.contains("closed") => {
                    return
                }
                Ok(PeerEventKind::Closed) => return,
                Ok(_) => {}
                Err(e) => panic!("rank 0 events: {e}"),
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "rank 0's connection was not closed");
    for a in ranks.iter().chain([&prefill]) {
        a.close().await;
    }
}

/// A target that advertises a data address on another host than the one
/// its control connection is on is not dialed (a peer cannot point the
/// agent at a third host) unless `dial_any_data_host` allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_address_off_the_control_host_is_dialed_only_when_allowed() {
    let other = common::routable_local_ip().to_string();
    let (b, _) = builder("decode", "0.0.0.0:0", 2);
    let decode = b.advertise(other.as_str()).build().await.unwrap();
    let addr = format!("127.0.0.1:{}", port_of(decode.local_addr()));

    let (b, _) = builder("prefill", "127.0.0.1:0", 1);
    let prefill = b.build().await.unwrap();
    let e = prefill.connect(&addr).await.unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.kind(), ErrorKind::Refused, "{msg}");
    assert!(
        msg.contains("not dialing") && msg.contains(&other) && msg.contains("127.0.0.1"),
        "names the data address and the control host: {msg}"
    );
    prefill.close().await;

    let (b, _) = builder("prefill-2", "127.0.0.1:0", 1);
    let prefill = b.dial_any_data_host(true).build().await.unwrap();
    let peer = prefill
        .connect(&addr)
        .await
        .expect("allowed: dialed at {other}");
    peer.read_blocks(0..1, &[0], &[1], None)
        .unwrap()
        .await
        .unwrap();
    prefill.close().await;
    decode.close().await;
}
