//! Tests of the verbs backend against a real RDMA device (Soft-RoCE in CI:
//! `ci/softroce.sh -c 'KVLANE_TEST_VERBS_DEVICE=rxe0 <test binary> --ignored --test-threads=1'`).
//!
//! Every test is `#[ignore]`d and selects its device from
//! `KVLANE_TEST_VERBS_DEVICE`; run without it, a test panics with a clear
//! message instead of passing over zero devices.
#![cfg(feature = "verbs")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlane_data::conformance::{self, Fixture};
use kvlane_data::verbs::{
    CompletionQueue, ConnectedQp, Context, DeviceConfig, MrAccess, ProtectionDomain, QpBuilder,
    QpOptions, SendWr, Unsupported, VerbsBackend, VerbsConfig, VerbsError, WorkCompletion, WrOp,
};
use kvlane_data::{
    connect_pair, Access, Backend, Completion, DataError, Descriptor, MemoryKind, Op, PeerId,
    Region, RemoteDescriptor, RemoteRegion, SubmitError, Transfer, TransferId,
};

/// The device under test; panics loudly when unset.
fn device() -> String {
    match std::env::var("KVLANE_TEST_VERBS_DEVICE") {
        Ok(d) if !d.trim().is_empty() => d.trim().to_owned(),
        _ => panic!(
            "KVLANE_TEST_VERBS_DEVICE is not set: these tests need an RDMA device \
             (e.g. KVLANE_TEST_VERBS_DEVICE=rxe0 inside ci/softroce.sh)"
        ),
    }
}

fn open() -> Arc<Context> {
    let name = device();
    Context::open(&DeviceConfig::device(&name))
        .unwrap_or_else(|e| panic!("cannot open rdma device {name}: {e} ({e:?})"))
}

/// Two connected QPs on one device, sharing one CQ.
fn pair(
    ctx: &Arc<Context>,
) -> (
    Arc<ProtectionDomain>,
    ConnectedQp,
    ConnectedQp,
    Arc<CompletionQueue>,
) {
    let pd = ctx.alloc_pd().expect("alloc pd");
    let cq = ctx.create_cq(1024).expect("create cq");
    let a = QpBuilder::new(&pd, &cq, &cq).build().expect("build qp a");
    let b = QpBuilder::new(&pd, &cq, &cq).build().expect("build qp b");
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let a = a.connect(&eb).expect("connect a");
    let b = b.connect(&ea).expect("connect b");
    (pd, a, b, cq)
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.len() < n {
        cq.poll(&mut out).expect("poll cq");
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {n} completions, got {out:?}"
        );
    }
    out
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn raw_qp_write_read_and_imm() {
    let ctx = open();
    let info = ctx.info().clone();
    eprintln!("{info}");
    assert!(ctx.limits().max_qp_wr > 0, "device reports max_qp_wr=0");
    let len = 1 << 16;
    let mut src = vec![0u8; len];
    let mut dst = vec![0u8; len];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let (pd, mut qa, mut qb, cq2) = pair(&ctx);
    assert_eq!(qa.mtu(), qb.mtu());

    // SAFETY: src/dst live until the end of the test, after all completions.
    let msrc = unsafe { pd.register_host(src.as_ptr() as usize, len, MrAccess::ALL) }.expect("reg");
    // SAFETY: as above.
    let mdst =
        unsafe { pd.register_host(dst.as_mut_ptr() as usize, len, MrAccess::ALL) }.expect("reg");

    qb.post_recv([77]).expect("post recv");
    let wr = SendWr {
        wr_id: 1,
        op: WrOp::Write(Some(0xabcd)),
        local_addr: msrc.addr(),
        len: len as u32,
        lkey: msrc.lkey(),
        remote_addr: mdst.addr(),
        rkey: mdst.rkey(),
        signaled: true,
    };
    // SAFETY: both buffers are registered and outlive the completions awaited below.
    unsafe { qa.post_send(&[wr]) }.expect("post write");
    let wcs = wait(&cq2, 2);
    assert!(wcs.iter().all(|w| w.status == 0), "{wcs:?}");
    let recv = wcs.iter().find(|w| w.wr_id == 77).expect("recv completion");
    assert_eq!(recv.imm, 0xabcd);
    assert_eq!(src, dst);

    let mut back = vec![0u8; len];
    // SAFETY: lives until after the completion below.
    let mback =
        unsafe { pd.register_host(back.as_mut_ptr() as usize, len, MrAccess::ALL) }.expect("reg");
    let rd = SendWr {
        wr_id: 2,
        op: WrOp::Read,
        local_addr: mback.addr(),
        len: len as u32,
        lkey: mback.lkey(),
        remote_addr: mdst.addr(),
        rkey: mdst.rkey(),
        signaled: true,
    };
    // SAFETY: as above.
    unsafe { qb.post_send(&[rd]) }.expect("post read");
    let wcs = wait(&cq2, 1);
    assert_eq!(wcs[0].status, 0, "{wcs:?}");
    assert_eq!(back, src);
}

fn config(qps: usize) -> VerbsConfig {
    VerbsConfig {
        device: DeviceConfig::device(device()),
        qps_per_peer: qps,
        ..VerbsConfig::default()
    }
}

fn backend(config: VerbsConfig) -> VerbsBackend {
    let name = config.device.device.clone().unwrap_or_default();
    VerbsBackend::new(config)
        .unwrap_or_else(|e| panic!("cannot open verbs backend on {name}: {e} ({e:?})"))
}

/// Two backends on the same device, in this process; every region in the
/// memory the function names (`None`: host).
struct Verbs(fn() -> Option<kvlane_data::GpuDevice>);

impl Fixture for Verbs {
    type Backend = VerbsBackend;
    fn backends(&self) -> (VerbsBackend, VerbsBackend) {
        (backend(config(2)), backend(config(2)))
    }
    fn memory(&self) -> Option<kvlane_data::GpuDevice> {
        (self.0)()
    }
}

macro_rules! verbs_conformance {
    ($module:ident, $fixture:expr; $($case:ident),* $(,)?) => {
        mod $module {
            $(
                #[test]
                #[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
                fn $case() {
                    kvlane_data::conformance::$case(&$fixture);
                }
            )*
        }
    };
    ($module:ident, $fixture:expr) => {
        verbs_conformance!($module, $fixture;
            write_read_roundtrip,
            large_transfer,
            many_in_flight,
            notification_after_data,
            bad_requests_refused,
            missing_permission_refused,
            deadline_expired,
            empty_and_zero_length,
            length_mismatch_rejected,
            queue_full_hands_back,
            removed_peer_fails_in_flight,
            batch_submission,
            deregister_stops_target_access,
        );
    };
}

verbs_conformance!(conformance_suite, super::Verbs(|| None));

// Regions of kind GPU from the MOCK CUDA driver and the MOCK HIP runtime
// (host memory behind their APIs; not a GPU). On rxe dma-buf registration
// fails (the CUDA mock exports none; the HIP mock exports a memfd, which
// is no dma-buf, and rxe has no dma-buf MRs), so they register by device
// address, the peer-memory path: the whole suite runs through that
// fallback, and the CPU reaches the regions only through the runtimes'
// staged copies.
verbs_conformance!(
    mock_cuda_suite,
    super::Verbs(|| Some(kvlane_data::conformance::use_mock_cuda()))
);
verbs_conformance!(
    mock_rocm_suite,
    super::Verbs(|| Some(kvlane_data::conformance::use_mock_hip(60_200_000)))
);

struct Pair {
    init: VerbsBackend,
    target: VerbsBackend,
    peer: PeerId,
    src: Region,
    dst: Region,
    dst_ad: RemoteRegion,
}

fn pair_with(init_cfg: VerbsConfig, len: usize) -> Pair {
    let mut init = backend(init_cfg.clone());
    let mut target = backend(init_cfg);
    let mut rng = conformance::Rng::new(99);
    let mut data = vec![0u8; len];
    rng.fill(&mut data);
    let src = Region::from_vec(data, Access::ALL).expect("src");
    let dst = Region::alloc(len, Access::ALL).expect("dst");
    let src_ad = init.register(&src).expect("register src");
    let dst_ad = target.register(&dst).expect("register dst");
    let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad]).expect("connect");
    Pair {
        init,
        target,
        peer,
        src,
        dst,
        dst_ad,
    }
}

fn write(p: &Pair, lo: u64, ro: u64, len: u64) -> Transfer {
    Transfer::new(
        p.peer,
        Op::Write,
        vec![Descriptor {
            region: p.src.id(),
            offset: lo,
            len,
        }],
        vec![RemoteDescriptor {
            key: p.dst_ad.key,
            offset: ro,
            len,
        }],
    )
}

/// Polls both sides until every id in `ids` completed.
fn drain(
    init: &mut VerbsBackend,
    others: &mut [&mut VerbsBackend],
    ids: &[TransferId],
) -> Vec<Completion> {
    let mut done = Vec::new();
    let end = Instant::now() + Duration::from_secs(60);
    while !ids
        .iter()
        .all(|id| done.iter().any(|c: &Completion| c.id == *id))
    {
        init.poll(&mut done);
        for o in others.iter_mut() {
            o.poll(&mut Vec::new());
        }
        assert!(Instant::now() < end, "transfers hung: {done:?}");
    }
    done
}

/// Deregistering a region that this side's own WRITEs are still reading
/// (32 x 1 MiB in flight, more than rxe moves in the grace) returns only
/// once the NIC reads it no more: a pattern written into it afterwards
/// never reaches the target, and every transfer ends, done or stopped
/// with `LocalRegionDeregistered` naming the region. (Before, the
/// in-flight transfers kept the memory registration alive and the NIC
/// went on reading the memory the application had taken back.)
#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn deregistering_a_region_in_local_use_stops_its_transfers() {
    const PIECE: u64 = 1 << 20;
    const N: u64 = 32;
    let mut p = pair_with(config(2), (N * PIECE) as usize);
    let ids: Vec<TransferId> = (0..N)
        .map(|i| {
            let t = write(&p, i * PIECE, i * PIECE, PIECE);
            let id = t.id;
            p.init.submit(t).expect("submit");
            id
        })
        .collect();
    p.init.poll(&mut Vec::new());
    p.init.deregister(p.src.id()).expect("deregister");
    // What an application does with memory it got back: no byte of it
    // may reach the target from now on.
    p.src
        .copy_in(0, &vec![0x5a; (N * PIECE) as usize])
        .expect("fill");
    let done = drain(&mut p.init, &mut [&mut p.target], &ids);
    let mut stopped = 0;
    for c in &done {
        match &c.result {
            Ok(()) => {}
            Err(DataError::LocalRegionDeregistered { id, region }) => {
                assert_eq!((*id, *region), (c.id, p.src.id()));
                stopped += 1;
            }
            Err(e) => panic!("{}: {e} ({e:?})", c.id),
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    p.target.poll(&mut Vec::new());
    let landed = conformance::contents(&p.dst);
    let late = landed.iter().filter(|b| **b == 0x5a).count();
    // Random source bytes are 0x5a about once in 256: a late read of the
    // pattern would show as a whole run of them.
    let run = landed
        .windows(64)
        .filter(|w| w.iter().all(|b| *b == 0x5a))
        .count();
    println!("{stopped} of {N} transfers stopped; {late} bytes 0x5a at the target");
    assert_eq!(
        run, 0,
        "bytes written into the region after deregister returned reached the target"
    );
}

/// A verbs endpoint as it travels (msgpack, named fields), for forging
/// hostile ones.
#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct WireEndpoint {
    v: u8,
    qps: Vec<kvlane_data::verbs::QpEndpoint>,
    mailbox_addr: u64,
    mailbox_rkey: u32,
    mailbox_slots: u32,
    slot_size: u32,
}

/// Every length and address of a peer's endpoint is checked before it
/// reaches slot arithmetic: a mailbox of 0 or 2^20 slots, of 0-byte slots or
/// ending past the address space, and a region ending past the address
/// space are refused with BadEndpoint naming the field; the peer stays
/// prepared, and the genuine endpoint then connects.
#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn hostile_endpoint_lengths_and_addresses_are_refused() {
    let (mut init, mut target) = (backend(config(2)), backend(config(2)));
    let (peer, _) = init.prepare_peer().expect("prepare");
    let (_, ep) = target.prepare_peer().expect("prepare target");
    let wire: WireEndpoint = rmp_serde::from_slice(&ep.data).expect("decode endpoint");
    let forged = |f: &dyn Fn(&mut WireEndpoint)| {
        let mut w = wire.clone();
        f(&mut w);
        kvlane_data::Endpoint {
            backend: ep.backend,
            data: rmp_serde::to_vec_named(&w).unwrap(),
        }
    };
    let cases: [(&str, kvlane_data::Endpoint); 4] = [
        ("0 slots", forged(&|w| w.mailbox_slots = 0)),
        ("1048576 slots", forged(&|w| w.mailbox_slots = 1 << 20)),
        ("of 0 bytes", forged(&|w| w.slot_size = 0)),
        (
            "past the end",
            forged(&|w| w.mailbox_addr = u64::MAX - 4096),
        ),
    ];
    for (what, bad) in &cases {
        match init.connect_peer(peer, bad, &[]) {
            Err(DataError::BadEndpoint { reason, .. }) => {
                assert!(reason.contains(what), "{what}: {reason}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    let region = RemoteRegion {
        key: kvlane_data::RemoteKey(1),
        addr: u64::MAX - 10,
        len: 4096,
        access: Access::ALL,
    };
    match init.connect_peer(peer, &ep, &[region]) {
        Err(DataError::BadEndpoint { reason, .. }) => {
            assert!(reason.contains("past the end"), "{reason}")
        }
        other => panic!("region past the address space: {other:?}"),
    }
    init.connect_peer(peer, &ep, &[])
        .expect("the genuine endpoint connects");
}

/// Peers of the scale test: `KVLANE_TEST_VERBS_PEERS`, default 1,000.
fn scale_peers() -> usize {
    std::env::var("KVLANE_TEST_VERBS_PEERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// 1,000 peers between two backends (one CQ held about 56 at the default
/// depths, 28 on rxe): every peer WRITEs its own 4 KiB slice and the target
/// sees each slice; the backends opened several shared CQs; one peer past
/// `max_peers` is refused with a clear error. Queues are kept short so the
/// 4,000 QPs fit a small VM.
#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn a_thousand_peers_share_sized_completion_queues() {
    let n = scale_peers();
    let mut cfg = config(2);
    cfg.notify_slots = 2;
    cfg.qp.max_send_wr = 64;
    cfg.max_peers = n;
    let (mut init, mut target) = (backend(cfg.clone()), backend(cfg));
    let block = 4096usize;
    let mut data = vec![0u8; n * block];
    conformance::Rng::new(7).fill(&mut data);
    let src = Region::from_vec(data.clone(), Access::ALL).expect("src");
    let dst = Region::alloc(n * block, Access::ALL).expect("dst");
    let src_ad = init.register(&src).expect("register src");
    let dst_ad = target.register(&dst).expect("register dst");
    let t0 = Instant::now();
    let peers: Vec<PeerId> = (0..n)
        .map(|i| {
            connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad])
                .unwrap_or_else(|e| panic!("connecting peer {i} of {n}: {e}"))
                .0
        })
        .collect();
    eprintln!(
        "{n} peers connected in {:?}: {} CQs on the initiator, {} on the target",
        t0.elapsed(),
        init.completion_queues(),
        target.completion_queues()
    );
    let need_per_peer = 2 * 64 + 2 + 1;
    let max_cqe = init.context().limits().max_cqe.min(1 << 16) as usize;
    assert!(
        init.completion_queues() >= (n * need_per_peer).div_ceil(max_cqe),
        "{} CQs for {n} peers of {need_per_peer} entries (max_cqe {max_cqe})",
        init.completion_queues()
    );
    match init.prepare_peer() {
        Err(DataError::Unsupported { what, .. }) => assert!(what.contains("max_peers"), "{what}"),
        other => panic!("peer {} past max_peers={n}: {other:?}", n + 1),
    }
    let mut ids = Vec::with_capacity(n);
    for (i, &peer) in peers.iter().enumerate() {
        let off = (i * block) as u64;
        let t = Transfer::new(
            peer,
            Op::Write,
            vec![Descriptor {
                region: src.id(),
                offset: off,
                len: block as u64,
            }],
            vec![RemoteDescriptor {
                key: dst_ad.key,
                offset: off,
                len: block as u64,
            }],
        );
        ids.push(t.id);
        init.submit(t)
            .unwrap_or_else(|e| panic!("submit to peer {i}: {e}"));
    }
    let done = drain(&mut init, &mut [&mut target], &ids);
    for c in &done {
        assert!(c.result.is_ok(), "{c:?}");
    }
    assert!(
        dst.to_vec().unwrap() == data,
        "some peer's slice did not land"
    );
    for &peer in &peers {
        init.remove_peer(peer);
    }
    assert!(
        init.prepare_peer().is_ok(),
        "removing peers frees their slots"
    );
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn write_with_imm_notification_follows_striped_data() {
    let mut p = pair_with(config(4), 8 << 20);
    // 8 MiB over 4 QPs: the notification must wait for every stripe.
    let t = write(&p, 0, 0, 8 << 20).with_notify(&b"layer 7 ready"[..]);
    let id = t.id;
    p.init.submit(t).expect("submit");
    let mut done = Vec::new();
    let notes = conformance::wait_notifications(&mut p.init, &mut p.target, 1, &mut done);
    assert_eq!(&notes[0].payload[..], b"layer 7 ready");
    assert!(
        p.dst.to_vec().unwrap() == p.src.to_vec().unwrap(),
        "notification before data"
    );
    let done = drain(&mut p.init, &mut [&mut p.target], &[id]);
    assert!(done[0].result.is_ok(), "{:?}", done[0].result);
    // Many notifications in a row reuse every mailbox slot several times.
    let mut ids = Vec::new();
    for i in 0..200u64 {
        let t = write(&p, i * 64, i * 64, 64).with_notify(format!("n{i}").into_bytes());
        ids.push(t.id);
        let mut t = Some(t);
        while let Some(x) = t.take() {
            if let Err(SubmitError::QueueFull { transfer, .. }) = p.init.submit(x) {
                t = Some(*transfer);
                p.init.poll(&mut Vec::new());
                p.target.poll(&mut Vec::new());
            }
        }
    }
    let mut notes = Vec::new();
    let end = Instant::now() + Duration::from_secs(60);
    while notes.len() < 200 {
        p.init.poll(&mut Vec::new());
        p.target.poll_notifications(&mut notes);
        assert!(
            Instant::now() < end,
            "only {} of 200 notifications",
            notes.len()
        );
    }
    let mut got: Vec<String> = notes
        .iter()
        .map(|n| String::from_utf8(n.payload.to_vec()).unwrap())
        .collect();
    got.sort();
    let mut want: Vec<String> = (0..200).map(|i| format!("n{i}")).collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn multi_qp_striping_rotates_and_covers_every_qp() {
    let mut cfg = config(4);
    cfg.stripe_chunk = 64 << 10;
    let mut p = pair_with(cfg, 4 << 20);
    // One 1 MiB transfer = 16 chunks: 4 per QP.
    let t = write(&p, 0, 0, 1 << 20);
    let id = t.id;
    p.init.submit(t).unwrap();
    drain(&mut p.init, &mut [&mut p.target], &[id]);
    let stats = p.init.qp_stats(p.peer);
    assert_eq!(stats.len(), 4);
    assert!(
        stats.iter().all(|s| s.data_wrs_posted == 4),
        "uneven striping: {stats:?}"
    );
    // Single-chunk transfers: the starting QP rotates with the transfer id.
    let ids: Vec<_> = (0..8u64)
        .map(|i| {
            let t = write(&p, (1 << 20) + i * 4096, (1 << 20) + i * 4096, 4096);
            let id = t.id;
            p.init.submit(t).unwrap();
            id
        })
        .collect();
    drain(&mut p.init, &mut [&mut p.target], &ids);
    let stats = p.init.qp_stats(p.peer);
    assert!(
        stats.iter().all(|s| s.data_wrs_posted == 6),
        "start QP did not rotate: {stats:?}"
    );
    assert!(
        p.dst.to_vec().unwrap()[..(1 << 20) + 8 * 4096]
            == p.src.to_vec().unwrap()[..(1 << 20) + 8 * 4096]
    );
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn send_queue_full_hands_transfer_back() {
    let mut cfg = config(1);
    cfg.qp = QpOptions {
        max_send_wr: 8,
        ..QpOptions::default()
    };
    cfg.signal_every = 4;
    let mut p = pair_with(cfg, 1 << 20);
    let mut accepted = Vec::new();
    let back = loop {
        let i = accepted.len() as u64;
        let t = write(&p, i * 512, i * 512, 512);
        let id = t.id;
        match p.init.submit(t) {
            Ok(()) => accepted.push(id),
            Err(SubmitError::QueueFull { transfer, .. }) => {
                assert_eq!(transfer.id, id, "a different transfer came back");
                break *transfer;
            }
            Err(e) => panic!("unexpected: {e}"),
        }
        assert!(accepted.len() < 1000, "an 8-deep send queue never filled");
    };
    assert!(
        accepted.len() <= 8,
        "{} transfers accepted into an 8-deep queue",
        accepted.len()
    );
    let mut retry = Some(back.clone());
    let mut done = Vec::new();
    let end = Instant::now() + Duration::from_secs(60);
    while done.len() < accepted.len() + 1 {
        p.init.poll(&mut done);
        p.target.poll(&mut Vec::new());
        if let Some(t) = retry.take() {
            if let Err(SubmitError::QueueFull { transfer, .. }) = p.init.submit(t) {
                retry = Some(*transfer);
            }
        }
        assert!(Instant::now() < end, "hung with {done:?}");
    }
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert!(done.iter().any(|c| c.id == back.id));
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn remote_access_error_fails_only_its_transfer() {
    let mut p = pair_with(config(2), 1 << 20);
    // A second target that must not notice anything.
    let mut other = backend(config(2));
    let other_dst = Region::alloc(1 << 20, Access::ALL).unwrap();
    let other_ad = other.register(&other_dst).unwrap();
    let (other_peer, _) = connect_pair(&mut p.init, &[], &mut other, &[other_ad]).unwrap();

    // A region the target advertised and then deregistered: its rkey is dead
    // at the NIC, the initiator does not know.
    let stale = Region::alloc(64 << 10, Access::ALL).unwrap();
    let stale_ad = p.target.register(&stale).unwrap();
    p.target.deregister(stale.id()).unwrap();
    let (peer2, _) = connect_pair(&mut p.init, &[], &mut p.target, &[stale_ad, p.dst_ad]).unwrap();

    let bad = Transfer::new(
        peer2,
        Op::Write,
        vec![Descriptor {
            region: p.src.id(),
            offset: 0,
            len: 4096,
        }],
        vec![RemoteDescriptor {
            key: stale_ad.key,
            offset: 0,
            len: 4096,
        }],
    );
    let bad_id = bad.id;
    // Good transfers on the same peer (both QPs) and on the other peer.
    let mut good = Vec::new();
    for i in 0..8u64 {
        let t = Transfer::new(
            peer2,
            Op::Write,
            vec![Descriptor {
                region: p.src.id(),
                offset: i * 8192,
                len: 8192,
            }],
            vec![RemoteDescriptor {
                key: p.dst_ad.key,
                offset: i * 8192,
                len: 8192,
            }],
        );
        good.push(t);
        good.push(Transfer::new(
            other_peer,
            Op::Write,
            vec![Descriptor {
                region: p.src.id(),
                offset: i * 8192,
                len: 8192,
            }],
            vec![RemoteDescriptor {
                key: other_ad.key,
                offset: i * 8192,
                len: 8192,
            }],
        ));
    }
    p.init.submit(bad).unwrap();
    let mut ids = vec![bad_id];
    for t in good {
        ids.push(t.id);
        p.init.submit(t).unwrap();
    }
    let done = drain(&mut p.init, &mut [&mut p.target, &mut other], &ids);
    for c in &done {
        if c.id == bad_id {
            match &c.result {
                Err(
                    e @ DataError::Rdma {
                        peer, op, status, ..
                    },
                ) => {
                    assert_eq!(*peer, peer2, "{e}");
                    assert_eq!(*op, Op::Write, "{e}");
                    assert_eq!(*status, "remote access error", "{e}");
                    let msg = e.to_string();
                    assert!(
                        msg.contains("WRITE") && msg.contains(&peer2.to_string()),
                        "{msg}"
                    );
                    eprintln!("bad transfer failed as expected: {msg}");
                }
                other => panic!("the bad transfer ended with {other:?}"),
            }
        } else {
            assert!(
                c.result.is_ok(),
                "{} failed although only {bad_id} was bad: {:?}",
                c.id,
                c.result
            );
        }
    }
    assert_eq!(
        p.init.healthy_qps(other_peer),
        2,
        "the other peer was affected"
    );
    assert_eq!(p.init.healthy_qps(peer2), 1, "exactly the failed QP is out");
    let src = p.src.to_vec().unwrap();
    assert!(other_dst.to_vec().unwrap()[..65536] == src[..65536]);
    assert!(p.dst.to_vec().unwrap()[..65536] == src[..65536]);

    // A new handshake rebuilds the queue pairs.
    p.init.remove_peer(peer2);
    let (peer3, _) = connect_pair(&mut p.init, &[], &mut p.target, &[p.dst_ad]).unwrap();
    assert_eq!(p.init.healthy_qps(peer3), 2);
    let t = Transfer::new(
        peer3,
        Op::Write,
        vec![Descriptor {
            region: p.src.id(),
            offset: 0,
            len: 4096,
        }],
        vec![RemoteDescriptor {
            key: p.dst_ad.key,
            offset: 0,
            len: 4096,
        }],
    );
    let id = t.id;
    p.init.submit(t).unwrap();
    let done = drain(&mut p.init, &mut [&mut p.target], &[id]);
    assert!(done[0].result.is_ok(), "{:?}", done[0].result);
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn device_memory_is_registered_as_dmabuf_or_refused_clearly() {
    let mut b = backend(config(1));
    let mut host = vec![0u8; 4096];
    let kind = MemoryKind::Device {
        dmabuf_fd: -1,
        offset: 0,
        device: 0,
    };
    // SAFETY: `host` outlives the region, which is only handed to `register`.
    let region =
        unsafe { Region::from_raw(host.as_mut_ptr(), host.len(), kind, Access::ALL, None) }
            .expect("region");
    match b.register(&region) {
        // Soft-RoCE: no dma-buf support in the provider.
        Err(DataError::Verbs(VerbsError::Unsupported(u @ Unsupported::Operation { .. }))) => {
            let msg = u.to_string();
            assert!(msg.contains("dma-buf") && msg.contains(&device()), "{msg}");
            eprintln!("as expected: {msg}");
        }
        // A NIC with dma-buf support refuses the invalid fd.
        Err(DataError::Verbs(
            e @ VerbsError::RegisterMemory {
                kind: "dma-buf", ..
            },
        )) => {
            eprintln!("as expected: {e}");
        }
        other => panic!("registering a bogus dma-buf: {other:?}"),
    }
}

#[test]
fn probe_reports_a_reason_or_devices() {
    // Runs everywhere: without RDMA this must be a clean Unsupported, never a panic.
    match kvlane_data::verbs::probe() {
        Ok(devs) => assert!(!devs.is_empty()),
        Err(VerbsError::Unsupported(reason)) => eprintln!("no rdma: {reason}"),
        Err(e) => panic!("probe failed with an unexpected error: {e}"),
    }
}
