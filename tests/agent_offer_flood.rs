//! One authenticated peer that floods endpoint offers (each makes the
//! agent dial the offered endpoint on a blocking thread, up to the tcp
//! connect timeout) does not starve other peers' attaches: at most one
//! offer per connection is worked on at a time, and what the flood sends
//! meanwhile is dropped and counted.

use kvlane::control::{Config, ControlNode, LocalInfo, Ranks, ZmqChannel};
use kvlane::data::{Access, Endpoint, KvLayout, KvParts, LayoutOrder, Region, TcpEndpoint};
use kvlane::{Agent, BackendChoice};

mod common;
use common::metric;
use serde::Serialize;
use std::time::{Duration, Instant};

/// The control-plane notification id of an endpoint offer
/// (`frames::DP_OFFER`).
const DP_OFFER: u64 = u64::MAX - 1;
const OFFERS: usize = 2_000;

fn layout() -> KvLayout {
    KvLayout::new(2, 8, 4096, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

fn kv() -> Region {
    Region::alloc(layout().required_len().unwrap() as usize, Access::ALL).unwrap()
}

/// The handshake's data-plane blob of an agent with a per-peer backend
/// and nothing registered (`frames::DataPlaneInfo`).
#[derive(Serialize)]
struct DataPlaneInfo {
    endpoint: Option<Endpoint>,
    kv: Vec<()>,
    regions: Vec<()>,
}

/// An endpoint offer (`frames::DpFrame`).
#[derive(Serialize)]
struct Offer {
    incarnation: u64,
    endpoint: Option<Endpoint>,
    error: Option<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_flood_from_one_peer_does_not_starve_another_peers_attach() {
    let b = Agent::builder()
        .engine_id("b")
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), kv())
        .build()
        .await
        .unwrap();

    // Where the offers point: a listener on the flooder's host that never
    // accepts, so that every dial to it waits out the connect timeout.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = blackhole.local_addr().unwrap();
    let offered = TcpEndpoint {
        addr: at,
        listen: at,
        token: [7; 16],
    }
    .to_endpoint();

    // The flooder: a peer that handshakes like an agent (it proves what an
    // agent proves), then sends offers as fast as it can.
    let local = LocalInfo::new("flood", Ranks::default(), "kvlane").with_data_plane(
        rmp_serde::to_vec_named(&DataPlaneInfo {
            endpoint: None,
            kv: Vec::new(),
            regions: Vec::new(),
        })
        .unwrap(),
    );
    let incarnation = local.identity.incarnation;
    let config = Config::default();
    let chan = ZmqChannel::bind("127.0.0.1:0", &config).await.unwrap();
    let flooder = ControlNode::with_channel(config, local, chan);
    let (conn, _) = flooder.connect(b.local_addr()).await.unwrap();
    let offer = rmp_serde::to_vec_named(&Offer {
        incarnation,
        endpoint: Some(offered),
        error: None,
    })
    .unwrap();
    let start = Instant::now();
    for _ in 0..OFFERS {
        flooder.notify(conn, DP_OFFER, offer.clone()).await.unwrap();
    }
    println!("sent {OFFERS} offers in {:?}", start.elapsed());

    // Another peer attaches meanwhile.
    let c = Agent::builder()
        .engine_id("c")
        .backend(BackendChoice::Tcp)
        .register_kv(layout(), kv())
        .build()
        .await
        .unwrap();
    let start = Instant::now();
    let peer = c.connect(b.local_addr()).await;
    let took = start.elapsed();
    println!("the other peer's connect returned after {took:?} during the flood");
    let peer = peer.expect("another peer could not attach during an offer flood");
    peer.write_blocks(0..2, &[1], &[1], Some(b"through"))
        .unwrap()
        .await
        .unwrap();

    // The flood's offers were dropped and counted, not queued.
    let deadline = Instant::now() + Duration::from_secs(10);
    let dropped = loop {
        let d = metric(&b, "kvlane_offers_dropped_total").unwrap_or(0);
        if d > 0 || Instant::now() > deadline {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("offers dropped: {dropped} of {OFFERS}");
    assert!(
        dropped > 0,
        "no dropped offer was counted:\n{}",
        b.metrics()
    );
    assert_eq!(b.offers_dropped(), dropped);
    flooder.close().await;
    c.close().await;
    b.close().await;
    drop(blackhole);
}
