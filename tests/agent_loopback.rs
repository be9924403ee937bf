//! Two agents in one process over the loopback backend and real ZMQ.

mod common;

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, ErrorKind, PeerEventKind};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout::new(4, 32, 1024, KvParts::Separate, LayoutOrder::LayerMajor).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn agent(name: &str, listen: &str, seed: u8) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region = Region::from_vec(pattern(seed, len), Access::ALL).unwrap();
    let a = Agent::builder()
        .engine_id(name)
        .listen(listen)
        .backend(BackendChoice::Loopback)
        .register_kv(layout(), region.clone())
        .build()
        .await
        .unwrap();
    (a, region)
}

fn block_bytes(r: &Region, l: &KvLayout, layer: u32, part: u64, block: u32) -> Vec<u8> {
    let mut out = vec![0u8; l.block_bytes as usize];
    r.read(l.offset(layer, part, block).unwrap(), &mut out)
        .unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_with_notification_then_read_back() {
    let (prefill, pre_kv) = agent("prefill", "127.0.0.1:0", 1).await;
    let (decode, dec_kv) = agent("decode", "127.0.0.1:0", 2).await;
    let mut notes = decode.notifications().unwrap();
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    assert_eq!(peer.engine_id(), "decode");

    let (src, dst) = ([3u32, 4, 5, 20], [10u32, 11, 12, 0]);
    peer.write_blocks(1..3, &src, &dst, Some(b"req-7"))
        .unwrap()
        .await
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (note.from.as_str(), &note.payload[..]),
        ("prefill", &b"req-7"[..])
    );
    let l = layout();
    for (&s, &d) in src.iter().zip(&dst) {
        for layer in 0..4 {
            for part in 0..2 {
                let moved = (1..3).contains(&layer);
                let want = if moved {
                    block_bytes(&pre_kv, &l, layer, part, s)
                } else {
                    pattern(2, dec_kv.len() as usize)[l.offset(layer, part, d).unwrap() as usize..]
                        [..1024]
                        .to_vec()
                };
                assert_eq!(
                    block_bytes(&dec_kv, &l, layer, part, d),
                    want,
                    "layer {layer} part {part} block {d}"
                );
            }
        }
    }

    // READ decode's blocks back into other prefill blocks; the READ
    // notification travels over the control plane.
    let h = peer
        .read_blocks(0..4, &[30, 31], &[10, 11], Some(b"read-done"))
        .unwrap();
    tokio::task::spawn_blocking(move || h.wait())
        .await
        .unwrap()
        .unwrap();
    for (&local, &remote) in [30u32, 31].iter().zip(&[10u32, 11]) {
        for layer in 0..4 {
            assert_eq!(
                block_bytes(&pre_kv, &l, layer, 0, local),
                block_bytes(&dec_kv, &l, layer, 0, remote)
            );
        }
    }
    let note = tokio::time::timeout(Duration::from_secs(5), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&note.payload[..], b"read-done");

    // Bad input is a typed error naming what is wrong.
    let e = peer.write_blocks(0..4, &[1, 2], &[1], None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let e = peer.write_blocks(0..4, &[99], &[1], None).unwrap_err();
    assert!(e.to_string().contains("block id 99"), "{e}");
    prefill.close().await;
    prefill.close().await; // idempotent
    decode.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_peer_makes_prepared_transfers_stale() {
    let (prefill, _pre_kv) = agent("prefill", "127.0.0.1:0", 1).await;
    let (decode, _) = agent("decode", "127.0.0.1:0", 2).await;
    let addr = decode.local_addr().to_owned();
    let mut events = prefill.events();
    let peer = prefill.connect(&addr).await.unwrap();
    let old_incarnation = peer.incarnation().unwrap();
    let prepared = peer
        .prepare(kvlane::data::Op::Write, 0..4, &[1], &[1], None)
        .unwrap();
    // One plan posts as often as needed, each post a transfer of its own.
    let (a, b) = (prepared.again(), prepared.again());
    let (ha, hb) = (peer.post(a).unwrap(), peer.post(b).unwrap());
    ha.await.unwrap();
    hb.await.unwrap();

    // Decode restarts on the same address: new process start, new keys.
    decode.close().await;
    drop(decode);
    let (decode2, dec2_kv) = agent("decode", &addr, 9).await;
    let restarted = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let ev = events.recv().await.unwrap();
            if let PeerEventKind::Restarted { old, new } = ev.kind {
                break (old, new);
            }
        }
    })
    .await
    .expect("no Restarted event");
    assert_eq!(restarted.0, old_incarnation);
    assert_eq!(restarted.1, decode2.incarnation());
    // Wait until the data plane is attached to the new incarnation.
    tokio::time::timeout(Duration::from_secs(20), async {
        while peer.incarnation() != Some(decode2.incarnation())
            || peer
                .prepare(kvlane::data::Op::Write, 0..1, &[0], &[0], None)
                .is_err()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("peer never re-attached");

    let before = dec2_kv.to_vec().unwrap();
    let e = peer.post(prepared.again()).unwrap_err();
    assert!(e.is_stale() && e.is_peer_lost(), "{e}");
    let e = peer.post(prepared).unwrap_err();
    assert!(e.is_stale() && e.is_peer_lost(), "{e}");
    assert_eq!(
        dec2_kv.to_vec().unwrap(),
        before,
        "a stale transfer touched memory"
    );
    // New transfers use the new incarnation.
    peer.write_blocks(0..4, &[1], &[1], None)
        .unwrap()
        .await
        .unwrap();
    assert_ne!(dec2_kv.to_vec().unwrap(), before);
    prefill.close().await;
    decode2.close().await;
}

/// `connect` and the agent's event task both attach the data plane of a new
/// connection; a transfer posted right after `connect` must never see its
/// data-plane peer replaced underneath it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_then_write_immediately_never_races_the_event_task() {
    for round in 0..20u8 {
        let (a, _) = agent("a", "127.0.0.1:0", round).await;
        let (b, _) = agent("b", "127.0.0.1:0", round).await;
        let peer = a.connect(b.local_addr()).await.unwrap();
        peer.write_blocks(0..4, &[1, 2], &[3, 4], None)
            .unwrap()
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        a.close().await;
        b.close().await;
    }
}

/// Binds `n` decode ranks on consecutive ports.
async fn rank_agents(n: u16) -> (u16, Vec<Agent>) {
    common::rank_agents(n, |rank, port| {
        let len = layout().required_len().unwrap() as usize;
        Agent::builder()
            .engine_id("decode")
            .ranks(0, u32::from(rank), u32::from(n))
            .listen(format!("127.0.0.1:{port}"))
            .backend(BackendChoice::Loopback)
            .register_kv(layout(), Region::alloc(len, Access::ALL).unwrap())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_connect_reaches_every_rank_or_names_the_failing_one() {
    let (base, ranks) = rank_agents(2).await;
    let (prefill, _) = agent("prefill", "127.0.0.1:0", 1).await;
    let peers = prefill
        .connect_group("127.0.0.1", base, 0, 2)
        .await
        .unwrap();
    assert_eq!(peers.len(), 2);
    for p in &peers {
        p.write_blocks(0..4, &[1], &[2], None)
            .unwrap()
            .await
            .unwrap();
    }
    // Rank 1 goes away: the group handshake fails and names it.
    ranks[1].close().await;
    let (other, _) = agent("prefill-2", "127.0.0.1:0", 1).await;
    let e = other
        .connect_group("127.0.0.1", base, 0, 2)
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("tp_rank 1") && !msg.contains("tp_rank 0"),
        "{msg}"
    );
    for a in ranks.iter().chain([&prefill, &other]) {
        a.close().await;
    }
}

/// `prepare` plans into a buffer its thread reuses: a large plan, then a
/// refused one, then a one-block transfer moves exactly that block, with
/// nothing of the earlier plans in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transfer_carries_only_its_own_blocks() {
    let l = layout();
    let (prefill, pre_kv) = agent("prefill", "127.0.0.1:0", 1).await;
    let (decode, dec_kv) = agent("decode", "127.0.0.1:0", 2).await;
    let peer = prefill.connect(decode.local_addr()).await.unwrap();
    let before = dec_kv.to_vec().unwrap();

    // Every block of every layer, scattered: 256 copies planned, not posted.
    let src: Vec<u32> = (0..32).collect();
    let dst: Vec<u32> = (0..32).rev().collect();
    let big = peer
        .prepare(kvlane::data::Op::Write, 0..4, &src, &dst, None)
        .unwrap();
    drop(big);
    // A block id past the cache: refused, naming it.
    let e = peer
        .prepare(kvlane::data::Op::Write, 0..4, &[3, 32], &[3, 4], None)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("32"), "{e}");

    let one = peer
        .prepare(kvlane::data::Op::Write, 1..2, &[7], &[9], None)
        .unwrap();
    peer.post(one).unwrap().await.unwrap();
    let after = dec_kv.to_vec().unwrap();
    for layer in 0..4 {
        for part in 0..2 {
            for block in 0..32 {
                let at = l.offset(layer, part, block).unwrap() as usize;
                let got = &after[at..at + l.block_bytes as usize];
                if (layer, block) == (1, 9) {
                    assert_eq!(got, block_bytes(&pre_kv, &l, 1, part, 7), "part {part}");
                } else {
                    assert_eq!(
                        got,
                        &before[at..at + l.block_bytes as usize],
                        "layer {layer} part {part} block {block} was written"
                    );
                }
            }
        }
    }
    prefill.close().await;
    decode.close().await;
}
