//! Two agents whose tcp data planes have two rails each (two listen
//! addresses): block transfers are striped over both, byte-checked, and
//! the per-rail counters show in `Agent::rail_stats` and the metrics.

mod common;

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};

fn layout() -> KvLayout {
    // 2 layers x 16 blocks x 256 KiB, K and V.
    KvLayout::new(2, 16, 256 << 10, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

async fn agent(name: &str, data_listen: &str, seed: u8) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect();
    let region = Region::from_vec(data, Access::ALL).unwrap();
    let a = Agent::builder()
        .engine_id(name)
        .backend(BackendChoice::Tcp)
        .data_listen(data_listen)
        .register_kv(layout(), region.clone())
        .build()
        .await
        .unwrap();
    (a, region)
}

fn block(r: &Region, layer: u32, part: u64, id: u32) -> Vec<u8> {
    let l = layout();
    let mut out = vec![0u8; l.block_bytes as usize];
    r.read(l.offset(layer, part, id).unwrap(), &mut out)
        .unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_are_striped_over_two_tcp_rails_and_counted_per_rail() {
    let (prefill, pre) = agent("prefill", "127.0.0.1:0,127.0.0.2:0", 1).await;
    let (decode, dec) = agent("decode", "127.0.0.1:0,127.0.0.2:0", 2).await;
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    // 8 blocks x 2 layers x K/V x 256 KiB = 8 MiB in one transfer.
    let src: Vec<u32> = (0..8).collect();
    let dst: Vec<u32> = (8..16).collect();
    peer.write_blocks(0..2, &src, &dst, None)
        .unwrap()
        .await
        .unwrap();
    for layer in 0..2 {
        for part in 0..2 {
            for (s, d) in src.iter().zip(&dst) {
                assert!(block(&pre, layer, part, *s) == block(&dec, layer, part, *d));
            }
        }
    }
    let rails = prefill.rail_stats();
    assert_eq!(rails.len(), 2, "{rails:?}");
    assert_eq!(
        rails.iter().map(|r| r.bytes).sum::<u64>(),
        8 << 20,
        "{rails:?}"
    );
    assert!(
        rails.iter().all(|r| r.bytes > 0),
        "one rail idle: {rails:?}"
    );
    let text = prefill.metrics();
    for r in &rails {
        let line = format!("kvlane_rail_bytes_total{{rail=\"{}\"}} {}", r.name, r.bytes);
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from\n{text}"
        );
    }
    // One rail asked for: no rails layer at all.
    let one = Agent::builder()
        .engine_id("one")
        .backend(BackendChoice::Tcp)
        .data_listen("127.0.0.1:0,127.0.0.2:0")
        .max_rails(1)
        .build()
        .await
        .unwrap();
    assert!(one.rail_stats().is_empty());
    one.close().await;
    prefill.close().await;
    decode.close().await;
}

/// Every rail an agent pairs is held to the host of the control
/// connection, not only the first: a peer whose second rail is on
/// another host is refused, naming that rail and its address, unless
/// `dial_any_data_host` allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_rail_off_the_control_host_is_dialed_only_when_allowed() {
    let other = common::routable_local_ip().to_string();
    let (decode, _) = agent("decode", &format!("127.0.0.1:0,{other}:0"), 2).await;
    let (prefill, _) = agent("prefill", "127.0.0.1:0,127.0.0.2:0", 1).await;
    let e = prefill.connect(decode.local_addr()).await.unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.kind(), kvlane::ErrorKind::Refused, "{msg}");
    assert!(
        msg.contains("rail 1") && msg.contains(&other) && msg.contains("127.0.0.1"),
        "names the rail, its address and the control host: {msg}"
    );
    prefill.close().await;

    // One rail: only the first of the peer's rails is paired, and it is on
    // the control host.
    let (single, _) = agent("single", "127.0.0.1:0", 3).await;
    let peer = single.connect(decode.local_addr()).await.unwrap();
    peer.read_blocks(0..1, &[0], &[1], None)
        .unwrap()
        .await
        .unwrap();
    single.close().await;

    let len = layout().required_len().unwrap() as usize;
    let allowed = Agent::builder()
        .engine_id("prefill-2")
        .backend(BackendChoice::Tcp)
        .data_listen("127.0.0.1:0,127.0.0.2:0")
        .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
        .dial_any_data_host(true)
        .build()
        .await
        .unwrap();
    let peer = allowed
        .connect(decode.local_addr())
        .await
        .expect("allowed: rail 1 dialed at {other}");
    // 8 MiB: striped, so both rails carry bytes.
    let ids: Vec<u32> = (0..8).collect();
    peer.read_blocks(0..2, &ids, &ids, None)
        .unwrap()
        .await
        .unwrap();
    let rails = allowed.rail_stats();
    assert!(rails.iter().all(|r| r.bytes > 0), "{rails:?}");
    allowed.close().await;
    decode.close().await;
}
