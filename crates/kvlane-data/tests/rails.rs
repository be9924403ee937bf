//! Rails: several tcp backends used as one. The conformance suite over two
//! rails, then striping, rotation, a rail failing and coming back, and a
//! peer with fewer rails. Then rails whose endpoints are per peer (loopback
//! with `endpoint_per_peer`, standing in for verbs): a link that goes down
//! and up, and a queue-pair-like failure, both repaired by an endpoint
//! exchange over the other rail.

use kvlane_data::conformance::Fixture;
use kvlane_data::intercept::Intercept;
use kvlane_data::rails::LINK_POLL;
use kvlane_data::{
    connect_pair, Access, Backend, Completion, DataError, Descriptor, LoopbackBackend,
    LoopbackConfig, Op, PeerId, RailStats, Rails, RailsConfig, Region, RemoteDescriptor,
    SubmitError, TcpBackend, TcpConfig, Transfer,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn tcp() -> Box<dyn Backend> {
    Box::new(
        TcpBackend::new(TcpConfig {
            queue_depth: 256,
            chunk_bytes: 64 << 10,
            ..TcpConfig::default()
        })
        .expect("start tcp backend"),
    )
}

fn rails(n: usize, cfg: RailsConfig) -> Rails {
    Rails::new((0..n).map(|i| (format!("tcp{i}"), tcp())).collect(), cfg).unwrap()
}

struct TwoRails;

impl Fixture for TwoRails {
    type Backend = Rails;
    fn backends(&self) -> (Rails, Rails) {
        // Striping from 64 KiB on, so the suite's larger transfers split.
        let cfg = RailsConfig {
            stripe_min: 64 << 10,
            ..RailsConfig::default()
        };
        (rails(2, cfg.clone()), rails(2, cfg))
    }
}

kvlane_data::conformance_tests!(TwoRails);

/// A rail whose completions fail with `PeerLost` while `broken` is set:
/// the NIC port going down, as the initiator sees it. With `link_down`
/// set its link reads down as well (a port that left ACTIVE). With `rdma`
/// set they fail as a work completion error instead (a queue pair in
/// ERROR).
struct Flaky {
    inner: Box<dyn Backend>,
    broken: Arc<AtomicBool>,
    link_down: Arc<AtomicBool>,
    rdma: bool,
}

/// `f` as a backend: its hooks on a real one.
fn faulty(f: Flaky) -> Box<dyn Backend> {
    let Flaky {
        inner,
        broken,
        link_down,
        rdma,
    } = f;
    let down = link_down.clone();
    Box::new(
        Intercept::new(inner)
            .on_completions(move |out| {
                if !broken.load(Ordering::Relaxed) && !link_down.load(Ordering::Relaxed) {
                    return;
                }
                for c in out {
                    c.result = Err(if rdma {
                        DataError::Rdma {
                            peer: c.peer,
                            op: Op::Write,
                            device: "rxe1".into(),
                            qpn: 17,
                            status: "local queue pair operation error",
                            vendor_err: 0,
                        }
                    } else {
                        DataError::PeerLost {
                            peer: c.peer,
                            reason: "rail down (test)",
                            source: None,
                        }
                    });
                }
            })
            .link_down_when(move || down.load(Ordering::Relaxed)),
    )
}

struct Pair {
    init: Rails,
    target: Box<dyn Backend>,
    src: Region,
    dst: Region,
    key: kvlane_data::RemoteKey,
    peer: PeerId,
}

const LEN: usize = 8 << 20;

fn pair(init: Rails, mut target: Box<dyn Backend>) -> Pair {
    let mut init = init;
    let src =
        Region::from_vec((0..LEN).map(|i| (i * 7 % 251) as u8).collect(), Access::ALL).unwrap();
    let dst = Region::alloc(LEN, Access::ALL).unwrap();
    let s = init.register(&src).unwrap();
    let d = target.register(&dst).unwrap();
    let (peer, _) = connect_pair(&mut init, &[s], &mut *target, &[d]).unwrap();
    Pair {
        init,
        target,
        src,
        dst,
        key: d.key,
        peer,
    }
}

/// `len` bytes at `offset` of the source, to or from the same offset there.
fn transfer(p: &Pair, op: Op, offset: u64, len: u64) -> Transfer {
    Transfer::new(
        p.peer,
        op,
        vec![Descriptor {
            region: p.src.id(),
            offset,
            len,
        }],
        vec![RemoteDescriptor {
            key: p.key,
            offset,
            len,
        }],
    )
}

fn run(p: &mut Pair, op: Op, offset: u64, len: u64) -> Result<(), DataError> {
    let t = transfer(p, op, offset, len);
    let id = t.id;
    p.init.submit(t).map_err(|e| match e {
        SubmitError::Rejected(e) => e,
        other => panic!("{other:?}"),
    })?;
    let end = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    loop {
        p.init.poll(&mut out);
        let _ = p.target.poll(&mut Vec::new());
        if let Some(c) = out.iter().position(|c| c.id == id) {
            return out.swap_remove(c).result;
        }
        assert!(Instant::now() < end, "transfer {id} never completed");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn same(p: &Pair, offset: u64, len: u64) -> bool {
    let mut a = vec![0u8; len as usize];
    let mut b = vec![0u8; len as usize];
    p.src.read(offset, &mut a).unwrap();
    p.dst.read(offset, &mut b).unwrap();
    a == b
}

fn bytes(s: &[RailStats]) -> Vec<u64> {
    s.iter().map(|r| r.bytes).collect()
}

#[test]
fn a_large_write_is_striped_over_both_rails_and_lands_whole() {
    let mut p = pair(
        rails(2, RailsConfig::default()),
        Box::new(rails(2, RailsConfig::default())),
    );
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert!(same(&p, 0, LEN as u64));
    let s = p.init.rail_stats();
    assert_eq!(bytes(&s), [LEN as u64 / 2, LEN as u64 / 2], "{s:?}");
    assert_eq!(s.iter().map(|r| r.parts).collect::<Vec<_>>(), [1, 1]);
}

#[test]
fn small_transfers_go_whole_and_rotate_over_the_rails() {
    let mut p = pair(
        rails(2, RailsConfig::default()),
        Box::new(rails(2, RailsConfig::default())),
    );
    for i in 0..10 {
        run(&mut p, Op::Write, i * 4096, 4096).unwrap();
    }
    assert!(same(&p, 0, 10 * 4096));
    let s = p.init.rail_stats();
    assert_eq!(
        s.iter().map(|r| r.parts).collect::<Vec<_>>(),
        [5, 5],
        "{s:?}"
    );
}

#[test]
fn a_batch_of_small_transfers_reaches_each_rail_as_one_batch() {
    // Each rail records the batches it is handed.
    let seen = Arc::new(Mutex::new(Vec::<(usize, usize)>::new()));
    let counted = |i: usize| -> (String, Box<dyn Backend>) {
        let seen = seen.clone();
        let rail =
            Intercept::new(tcp()).on_submit_batch(move |n| seen.lock().unwrap().push((i, n)));
        (format!("tcp{i}"), Box::new(rail))
    };
    let init = Rails::new(vec![counted(0), counted(1)], RailsConfig::default()).unwrap();
    let mut p = pair(init, Box::new(rails(2, RailsConfig::default())));
    const N: u64 = 64;
    let mut batch: Vec<Transfer> = (0..N)
        .map(|i| transfer(&p, Op::Write, i * 4096, 4096))
        .collect();
    // One the rails refuse (lengths differ), one to a peer nobody knows.
    let (bad, stranger) = (10, 20);
    batch.insert(bad, {
        let mut t = transfer(&p, Op::Write, 0, 4096);
        t.remote[0].len = 4095;
        t
    });
    batch.insert(stranger, {
        let mut t = transfer(&p, Op::Write, 0, 4096);
        t.peer = PeerId(u64::MAX);
        t
    });
    let ids: Vec<_> = batch.iter().map(|t| t.id).collect();
    let mut results = Vec::new();
    p.init.submit_batch(batch, &mut results);
    assert_eq!(results.len(), ids.len());
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (i, Err(SubmitError::Rejected(DataError::LengthMismatch { .. }))) if i == bad => {}
            (i, Err(SubmitError::Rejected(DataError::UnknownPeer(_)))) if i == stranger => {}
            (i, Ok(())) if i != bad && i != stranger => {}
            other => panic!("transfer {i}: {other:?}"),
        }
    }
    // One batch per rail, sharing the N + 1 transfers dealt (the
    // stranger was refused before any rail saw it).
    let mut batches = seen.lock().unwrap().clone();
    batches.sort();
    assert_eq!(batches.len(), 2, "{batches:?}");
    assert_eq!((batches[0].0, batches[1].0), (0, 1), "{batches:?}");
    assert_eq!(batches[0].1 + batches[1].1, N as usize + 1, "{batches:?}");
    assert!(
        batches.iter().all(|&(_, n)| n >= N as usize / 2),
        "{batches:?}"
    );
    let mut want: Vec<_> = ids
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != bad && i != stranger)
        .map(|(_, id)| *id)
        .collect();
    let end = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while !want.is_empty() {
        p.init.poll(&mut out);
        let _ = p.target.poll(&mut Vec::new());
        for c in out.drain(..) {
            c.result.unwrap();
            want.retain(|id| *id != c.id);
        }
        assert!(
            Instant::now() < end,
            "{} transfers never completed",
            want.len()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(same(&p, 0, N * 4096));
    let s = p.init.rail_stats();
    assert_eq!(s.iter().map(|r| r.parts).sum::<u64>(), N, "{s:?}");
}

#[test]
fn a_region_with_preferred_rails_uses_only_those_while_they_work() {
    let mut p = pair(
        rails(3, RailsConfig::default()),
        Box::new(rails(3, RailsConfig::default())),
    );
    // The region's nearest rails are 1 and 2 (a GPU's two NICs, say).
    p.init.prefer(p.src.id(), &[1, 2, 7]);
    for i in 0..10 {
        run(&mut p, Op::Write, i * 4096, 4096).unwrap();
    }
    let s = p.init.rail_stats();
    assert_eq!(
        s.iter().map(|r| r.parts).collect::<Vec<_>>(),
        [0, 5, 5],
        "{s:?}"
    );
    // A large one is split over the preferred rails only.
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert!(same(&p, 0, LEN as u64));
    let s = p.init.rail_stats();
    assert_eq!(bytes(&s)[0], 0, "{s:?}");
    assert_eq!(bytes(&s)[1], bytes(&s)[2], "{s:?}");
    // Without the preference every rail takes its turn again.
    p.init.prefer(p.src.id(), &[]);
    for i in 0..3 {
        run(&mut p, Op::Write, i * 4096, 4096).unwrap();
    }
    assert_eq!(p.init.rail_stats()[0].parts, 1);
}

/// A driver learns from the rails when to poll them next (not every
/// millisecond) and whether a submission needs a poll at all.
#[test]
fn rails_tell_their_driver_when_they_are_due() {
    let mut p = pair(
        rails(2, RailsConfig::default()),
        Box::new(rails(2, RailsConfig::default())),
    );
    run(&mut p, Op::Write, 0, 4096).unwrap();
    // Idle: due by the next link read at the latest.
    let now = Instant::now();
    let at = p.init.poll_by().expect("idle rails say when they are due");
    assert!(at <= now + LINK_POLL, "due {:?} after now", at - now);
    // A small write staged for a rail's I/O thread, with a deadline
    // sooner than a driver's longest sleep: a poll is due, by then.
    let deadline = Instant::now() + Duration::from_millis(10);
    let t = transfer(&p, Op::Write, 0, 4096).with_deadline(deadline);
    let id = t.id;
    p.init.submit(t).unwrap();
    assert!(p.init.poll_after_submit());
    let at = p
        .init
        .poll_by()
        .expect("a transfer in flight with a deadline");
    assert!(at <= deadline, "due {:?} after its deadline", at - deadline);
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while !out.iter().any(|c: &Completion| c.id == id) {
        assert!(Instant::now() < end, "transfer {id} never completed");
        p.init.poll(&mut out);
        let _ = p.target.poll(&mut Vec::new());
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn a_failing_rail_hands_its_work_to_the_other_and_is_taken_back_after() {
    let broken = Arc::new(AtomicBool::new(false));
    let cfg = RailsConfig {
        retry_after: Duration::from_millis(200),
        ..RailsConfig::default()
    };
    let init = Rails::new(
        vec![
            ("tcp0".into(), tcp()),
            (
                "tcp1".into(),
                faulty(Flaky {
                    inner: tcp(),
                    broken: broken.clone(),
                    link_down: Arc::default(),
                    rdma: false,
                }),
            ),
        ],
        cfg.clone(),
    )
    .unwrap();
    let mut p = pair(init, Box::new(rails(2, cfg)));
    broken.store(true, Ordering::Relaxed);
    // Striped READs and WRITEs while rail 1 is down all complete.
    for round in 0..4u64 {
        let op = if round % 2 == 0 { Op::Write } else { Op::Read };
        run(&mut p, op, 0, LEN as u64).unwrap();
        assert!(same(&p, 0, LEN as u64));
    }
    let s = p.init.rail_stats();
    // Every part it took failed and moved (a lost rail is dialed again
    // after retry_after, and fails again while broken).
    assert!(s[1].failures >= 1 && s[1].reposts == s[1].failures, "{s:?}");
    assert_eq!(s[1].bytes, 0, "{s:?}");
    // The rail comes back: once retry_after has passed, a poll dials it
    // again on a thread of its own, and a later poll takes it into use.
    // How many transfers run before that depends on the machine's load
    // (four were not always enough on a busy 2-core CI machine), so
    // transfers run until it carries parts, within a generous bound.
    broken.store(false, Ordering::Relaxed);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        run(&mut p, Op::Write, 0, LEN as u64).unwrap();
        assert!(same(&p, 0, LEN as u64));
        let s = p.init.rail_stats();
        if s[1].bytes > 0 {
            assert_eq!(s[1].down_peers, 0, "{s:?}");
            break;
        }
        assert!(
            Instant::now() < end,
            "the repaired rail carried nothing for 30 s: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn with_every_rail_failing_the_transfer_fails_typed() {
    let broken = Arc::new(AtomicBool::new(true));
    let flaky = |b: &Arc<AtomicBool>| -> Box<dyn Backend> {
        faulty(Flaky {
            inner: tcp(),
            broken: b.clone(),
            link_down: Arc::default(),
            rdma: false,
        })
    };
    let init = Rails::new(
        vec![("a".into(), flaky(&broken)), ("b".into(), flaky(&broken))],
        RailsConfig::default(),
    )
    .unwrap();
    let mut p = pair(init, Box::new(rails(2, RailsConfig::default())));
    let e = run(&mut p, Op::Write, 0, LEN as u64).unwrap_err();
    assert!(matches!(e, DataError::PeerLost { .. }), "{e}");
}

#[test]
fn a_peer_with_one_rail_pairs_the_first_rail_only() {
    // Two rails here, a plain tcp backend there (and the other way round).
    let mut p = pair(rails(2, RailsConfig::default()), tcp());
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert!(same(&p, 0, LEN as u64));
    assert_eq!(bytes(&p.init.rail_stats()), [LEN as u64, 0]);

    let mut plain = TcpBackend::new(TcpConfig::default()).unwrap();
    let mut two = rails(2, RailsConfig::default());
    let src = Region::alloc(4096, Access::ALL).unwrap();
    src.fill(0, 4096, 9).unwrap();
    let dst = Region::alloc(4096, Access::ALL).unwrap();
    let s = plain.register(&src).unwrap();
    let d = two.register(&dst).unwrap();
    let (peer, _) = connect_pair(&mut plain, &[s], &mut two, &[d]).unwrap();
    let t = Transfer::new(
        peer,
        Op::Write,
        vec![Descriptor {
            region: src.id(),
            offset: 0,
            len: 4096,
        }],
        vec![RemoteDescriptor {
            key: d.key,
            offset: 0,
            len: 4096,
        }],
    );
    let id = t.id;
    plain.submit(t).unwrap();
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while !out.iter().any(|c: &Completion| c.id == id) {
        plain.poll(&mut out);
        two.poll(&mut Vec::new());
        assert!(Instant::now() < end);
    }
    assert!(out.iter().all(|c| c.result.is_ok()));
    let mut got = [0u8; 4096];
    dst.read(0, &mut got).unwrap();
    assert_eq!(got, [9u8; 4096]);
}

/// A loopback backend that pairs like verbs: every endpoint serves one
/// peer once, so a lost rail cannot be dialed again with the handshake's.
fn per_peer() -> Box<dyn Backend> {
    Box::new(LoopbackBackend::new(LoopbackConfig {
        endpoint_per_peer: true,
        ..LoopbackConfig::default()
    }))
}

/// Two verbs-like rails here (the second one switchable, failing its
/// parts as `rdma` says), two there.
fn per_peer_pair(cfg: &RailsConfig, rdma: bool) -> (Pair, Arc<AtomicBool>, Arc<AtomicBool>) {
    let (broken, link_down) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let flaky = Flaky {
        inner: per_peer(),
        broken: broken.clone(),
        link_down: link_down.clone(),
        rdma,
    };
    let init = Rails::new(
        vec![("lo0".into(), per_peer()), ("lo1".into(), faulty(flaky))],
        cfg.clone(),
    )
    .unwrap();
    let target = Rails::new(
        vec![("lo0".into(), per_peer()), ("lo1".into(), per_peer())],
        cfg.clone(),
    )
    .unwrap();
    (pair(init, Box::new(target)), broken, link_down)
}

/// Polls both sides until rail 1 was paired again on both (`n` times).
fn await_rejoin(p: &mut Pair, n: u64) {
    let end = Instant::now() + Duration::from_secs(10);
    while p.init.rail_stats()[1].rejoins < n || p.target.rail_stats()[1].rejoins < n {
        p.init.poll(&mut Vec::new());
        p.target.poll(&mut Vec::new());
        assert!(
            Instant::now() < end,
            "rail 1 not paired again: {:?} / {:?}",
            p.init.rail_stats(),
            p.target.rail_stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Submits a WRITE of the whole source, then the link goes down before it
/// runs; the transfer's outcome.
fn write_as_the_link_goes_down(p: &mut Pair, link_down: &AtomicBool) -> Result<(), DataError> {
    let t = transfer(p, Op::Write, 0, LEN as u64);
    let id = t.id;
    p.init.submit(t).unwrap();
    link_down.store(true, Ordering::Relaxed);
    std::thread::sleep(LINK_POLL);
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        p.init.poll(&mut out);
        p.target.poll(&mut Vec::new());
        if let Some(c) = out.iter().position(|c| c.id == id) {
            return out.swap_remove(c).result;
        }
        assert!(Instant::now() < end, "the transfer never completed");
    }
}

fn cfg_fast() -> RailsConfig {
    RailsConfig {
        retry_after: Duration::from_millis(100),
        ..RailsConfig::default()
    }
}

#[test]
fn a_verbs_like_rail_whose_link_goes_down_hands_its_work_over_and_is_paired_again_when_up() {
    let (mut p, _, link_down) = per_peer_pair(&cfg_fast(), false);
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert_eq!(bytes(&p.init.rail_stats()), [LEN as u64 / 2; 2]);

    // The link goes down with a striped WRITE queued on both rails: the
    // part on rail 1 is posted again on rail 0 and the transfer lands.
    p.src.fill(0, LEN as u64, 0x5a).unwrap();
    write_as_the_link_goes_down(&mut p, &link_down).unwrap();
    assert!(same(&p, 0, LEN as u64));
    let s = p.init.rail_stats();
    assert_eq!(s[1].reposts, 1, "{s:?}");
    assert_eq!(s[1].down_peers, 1, "{s:?}");

    // While it is down, rail 0 carries everything (and nothing is offered).
    for op in [Op::Read, Op::Write, Op::Read] {
        run(&mut p, op, 0, LEN as u64).unwrap();
        assert!(same(&p, 0, LEN as u64));
    }
    std::thread::sleep(cfg_fast().retry_after * 2);
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    let s = p.init.rail_stats();
    assert_eq!(s[1].bytes, LEN as u64 / 2, "{s:?}");
    assert_eq!(s[1].rejoins, 0, "{s:?}");

    // Up again: paired anew over rail 0, both rails carry bytes.
    link_down.store(false, Ordering::Relaxed);
    await_rejoin(&mut p, 1);
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert!(same(&p, 0, LEN as u64));
    let s = p.init.rail_stats();
    assert_eq!(s[1].bytes, LEN as u64, "{s:?}");
    assert_eq!(s[1].down_peers, 0, "{s:?}");
    assert_eq!(p.target.rail_stats()[1].down_peers, 0);
    assert!(s.iter().all(|r| r.dropped == 0), "{s:?}");
}

#[test]
fn a_verbs_like_rail_that_failed_with_its_link_up_is_paired_again() {
    // The peer lost on a rail, then a queue pair in error (a work
    // completion error), the port still ACTIVE: the part moves, the rail
    // is paired again after retry_after, and it is used again.
    for rdma in [false, true] {
        rail_failure_is_repaired(rdma);
    }
}

fn rail_failure_is_repaired(rdma: bool) {
    let (mut p, broken, _) = per_peer_pair(&cfg_fast(), rdma);
    broken.store(true, Ordering::Relaxed);
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert!(same(&p, 0, LEN as u64));
    let s = p.init.rail_stats();
    assert_eq!(
        (s[1].failures, s[1].reposts, s[1].bytes),
        (1, 1, 0),
        "{s:?}"
    );
    broken.store(false, Ordering::Relaxed);
    await_rejoin(&mut p, 1);
    for op in [Op::Write, Op::Read] {
        run(&mut p, op, 0, LEN as u64).unwrap();
        assert!(same(&p, 0, LEN as u64));
    }
    assert_eq!(p.init.rail_stats()[1].bytes, LEN as u64);
    // A second failure is repaired the same way.
    broken.store(true, Ordering::Relaxed);
    run(&mut p, Op::Read, 0, LEN as u64).unwrap();
    broken.store(false, Ordering::Relaxed);
    await_rejoin(&mut p, 2);
    run(&mut p, Op::Write, 0, LEN as u64).unwrap();
    assert_eq!(p.init.rail_stats()[1].bytes, LEN as u64 * 3 / 2);
}

#[test]
fn with_every_verbs_like_rail_down_the_transfer_fails_typed() {
    let link_down = Arc::new(AtomicBool::new(false));
    let flaky = || -> Box<dyn Backend> {
        faulty(Flaky {
            inner: per_peer(),
            broken: Arc::default(),
            link_down: link_down.clone(),
            rdma: false,
        })
    };
    let init = Rails::new(
        vec![("lo0".into(), flaky()), ("lo1".into(), flaky())],
        cfg_fast(),
    )
    .unwrap();
    let target = Rails::new(
        vec![("lo0".into(), per_peer()), ("lo1".into(), per_peer())],
        cfg_fast(),
    )
    .unwrap();
    let mut p = pair(init, Box::new(target));
    // In flight when both links go down: fails PeerLost (no rail left).
    let e = write_as_the_link_goes_down(&mut p, &link_down).unwrap_err();
    assert!(
        matches!(e, DataError::PeerLost { peer, .. } if peer == p.peer),
        "{e}"
    );
    // Submitted while both are down: refused the same way.
    let e = run(&mut p, Op::Read, 0, 4096).unwrap_err();
    assert!(matches!(e, DataError::PeerLost { .. }), "{e}");
}

/// A proxy in front of a tcp listener that forwards both ways until a
/// notification that begins with `marker` has gone through towards the
/// target; then it forwards nothing more back (the target's answer to the
/// NOTIFY is lost), waits a moment for the target to take the NOTIFY in
/// and resets both sides of every connection it holds. Connections made
/// after that are forwarded plainly. `fired` says that it reset.
mod notify_proxy {
    use socket2::SockRef;
    use std::io::{Read, Write};
    use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    pub(crate) struct Proxy {
        pub(crate) addr: SocketAddr,
        pub(crate) fired: Arc<AtomicBool>,
    }

    pub(crate) fn start(to: SocketAddr, marker: &'static [u8]) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fired = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(AtomicBool::new(false));
        let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let f = fired.clone();
        std::thread::spawn(move || {
            for c in listener.incoming() {
                let Ok(client) = c else { return };
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                // Connections after the reset are not cut.
                let cut_here = if f.load(Ordering::SeqCst) {
                    Arc::new(AtomicBool::new(false))
                } else {
                    cut.clone()
                };
                {
                    let mut h = held.lock().unwrap();
                    h.push(client.try_clone().unwrap());
                    h.push(server.try_clone().unwrap());
                }
                // Towards the target: watches for the marker.
                let (mut from, mut to_s) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (cut2, held2, fired2) = (cut_here.clone(), held.clone(), f.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 256 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let hit = !fired2.load(Ordering::SeqCst)
                            && buf[..n].windows(marker.len()).any(|w| w == marker);
                        if hit {
                            cut2.store(true, Ordering::SeqCst);
                        }
                        if to_s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        if hit {
                            // Let the target read the NOTIFY, then reset
                            // everything held so far, both sides.
                            std::thread::sleep(Duration::from_millis(200));
                            for s in held2.lock().unwrap().drain(..) {
                                let _ = SockRef::from(&s).set_linger(Some(Duration::ZERO));
                                let _ = s.shutdown(Shutdown::Both);
                            }
                            fired2.store(true, Ordering::SeqCst);
                            break;
                        }
                    }
                });
                // Back to the initiator: stops once cut.
                let (mut from, mut to_c) = (server, client);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cut_here.load(Ordering::SeqCst) {
                            continue;
                        }
                        if to_c.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Proxy { addr, fired }
    }
}

/// Issue 41, item 3: a transfer whose NOTIFY reached the target over rail
/// 0 just before that rail's connections were reset (both sides, before
/// the target's answer came back) is posted again on rail 1; the target
/// hands its notification to the application once, not twice.
#[test]
fn a_notification_is_delivered_once_when_its_rail_resets_after_the_notify_passed() {
    let proxy: Arc<Mutex<Option<notify_proxy::Proxy>>> = Arc::default();
    let p2 = proxy.clone();
    let rail0 = Intercept::new(tcp()).on_endpoint(move |ep| {
        let mut t = kvlane_data::TcpEndpoint::from_endpoint(ep).unwrap();
        let px = notify_proxy::start(t.addr, b"req-");
        t.addr = px.addr;
        *ep = t.to_endpoint();
        *p2.lock().unwrap() = Some(px);
    });
    let target = Rails::new(
        vec![("tcp0".into(), Box::new(rail0)), ("tcp1".into(), tcp())],
        RailsConfig::default(),
    )
    .unwrap();
    let mut p = pair(rails(2, RailsConfig::default()), Box::new(target));
    let fired = proxy.lock().unwrap().as_ref().unwrap().fired.clone();
    // Whole transfers rotate from rail 0: the first one goes through the
    // proxy.
    let mut want = Vec::new();
    for i in 0..4u64 {
        let t = transfer(&p, Op::Write, i * 4096, 4096).with_notify(format!("req-{i} done"));
        want.push(t.id);
        p.init.submit(t).unwrap();
    }
    let mut notes = Vec::new();
    let mut out = Vec::new();
    let mut results = Vec::new();
    let end = Instant::now() + Duration::from_secs(30);
    while results.len() < want.len() {
        p.init.poll(&mut out);
        p.target.poll(&mut Vec::new());
        p.target.poll_notifications(&mut notes);
        results.extend(out.drain(..).map(|c| (c.id, c.result)));
        assert!(
            Instant::now() < end,
            "transfers never completed: {results:?}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    // Late copies would arrive within this.
    let settle = Instant::now() + Duration::from_secs(3);
    while Instant::now() < settle {
        p.init.poll(&mut out);
        p.target.poll(&mut Vec::new());
        p.target.poll_notifications(&mut notes);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        fired.load(Ordering::SeqCst),
        "no NOTIFY went through rail 0's proxy"
    );
    let s = p.init.rail_stats();
    assert!(s[0].failures >= 1, "rail 0 never failed: {s:?}");
    let got: Vec<String> = notes
        .iter()
        .map(|n| String::from_utf8_lossy(&n.payload).into_owned())
        .collect();
    for (i, id) in want.iter().enumerate() {
        let name = format!("req-{i} done");
        let n = got.iter().filter(|g| **g == name).count();
        assert!(n <= 1, "{name:?} delivered {n} times: {got:?}; rails {s:?}");
        // A transfer reported done had its notification delivered.
        let ok = results.iter().any(|(c, r)| c == id && r.is_ok());
        if ok {
            assert_eq!(
                n, 1,
                "{name:?} done but its notification never came: {got:?}"
            );
        }
    }
}

#[path = "support/holding_proxy.rs"]
mod holding_proxy;

/// A pair whose target has two tcp rails, `t0` behind a holding proxy
/// (made when rail 0's endpoint is handed out), and whose initiator's
/// rails give a part 300 ms before moving it; the proxy.
fn rail0_held(
    t0: Box<dyn Backend>,
    t1: Box<dyn Backend>,
) -> (Pair, Arc<Mutex<Option<holding_proxy::Proxy>>>) {
    use holding_proxy::{proxy, Then};
    let px: Arc<Mutex<Option<holding_proxy::Proxy>>> = Arc::default();
    let p2 = px.clone();
    let rail0 = Intercept::new(t0).on_endpoint(move |ep| {
        let mut t = kvlane_data::TcpEndpoint::from_endpoint(ep).unwrap();
        let p = proxy(t.addr, Then::Hold);
        t.addr = p.addr;
        *ep = t.to_endpoint();
        *p2.lock().unwrap() = Some(p);
    });
    let target = Rails::new(
        vec![("tcp0".into(), Box::new(rail0)), ("tcp1".into(), t1)],
        RailsConfig::default(),
    )
    .unwrap();
    let cfg = RailsConfig {
        part_timeout: Duration::from_millis(300),
        ..RailsConfig::default()
    };
    (pair(rails(2, cfg), Box::new(target)), px)
}

/// As below, but rail 0's target cannot be reached any more when the
/// WRITE fails there (its network refuses new connections while it still
/// holds the first attempt's bytes): rail 0's failed connection is fenced
/// through rail 1's address (the target's tcp rails fence through each
/// other) before the WRITE moves, so the bytes released 3 s later never
/// land, and nothing is counted unfenced. Without the sibling fence this
/// failed: the bytes landed over newer data, counted unfenced.
#[test]
fn a_write_moved_off_an_unreachable_rail_is_fenced_through_another() {
    const SPAN: u64 = 32 << 10;
    let new_tcp = || {
        TcpBackend::new(TcpConfig {
            queue_depth: 256,
            chunk_bytes: 64 << 10,
            ..TcpConfig::default()
        })
        .expect("start tcp backend")
    };
    let (t0, t1) = (new_tcp(), new_tcp());
    TcpBackend::fence_through_each_other(&[&t0, &t1]);
    let (mut p, px) = rail0_held(Box::new(t0), Box::new(t1));
    let guard = px.lock().unwrap();
    let x = guard
        .as_ref()
        .expect("rail 0's endpoint went through the proxy");
    let (release, held, delivered) = (x.release.clone(), x.held.clone(), x.delivered.clone());
    // Rail 0's connections hold what they are sent, and rail 0's target
    // can no longer be reached (its fence cannot go there).
    x.hold.store(true, Ordering::SeqCst);
    x.stop_accepting();
    drop(guard);
    p.src.fill(0, SPAN, 0xee).unwrap();
    run(&mut p, Op::Write, 0, SPAN).expect("the WRITE moves to rail 1 and lands");
    let moved_at = Instant::now();
    assert!(p.init.rail_stats()[0].failures >= 1, "rail 0 never failed");
    assert!(
        held.load(Ordering::SeqCst) >= SPAN as usize,
        "rail 0's network holds the first attempt ({} bytes)",
        held.load(Ordering::SeqCst)
    );
    p.src.fill(0, SPAN, 0x33).unwrap();
    run(&mut p, Op::Write, 0, SPAN).unwrap();
    assert!(p.dst.to_vec().unwrap()[..SPAN as usize]
        .iter()
        .all(|&b| b == 0x33));
    std::thread::sleep(Duration::from_secs(3).saturating_sub(moved_at.elapsed()));
    release.store(true, Ordering::SeqCst);
    let end = Instant::now() + Duration::from_secs(10);
    while delivered.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < end,
            "the proxy never delivered the held bytes"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let now = p.dst.to_vec().unwrap();
    let late = now[..SPAN as usize].iter().filter(|&&b| b != 0x33).count();
    let (ti, tt) = (
        p.init.tcp_counters().unwrap(),
        p.target.tcp_counters().unwrap(),
    );
    assert_eq!(
        late, 0,
        "{late} bytes of the first attempt landed over newer data, 3 s after the WRITE moved \
         (initiator {ti:?}, target {tt:?})"
    );
    assert_eq!(ti.unfenced_failures, 0, "initiator {ti:?}");
    assert!(tt.sibling_fences >= 1, "target {tt:?}");
    assert!(tt.connections_fenced >= 1, "target {tt:?}");
}

/// Issue 41, item 6: a WRITE whose bytes the network still holds on rail
/// 0 times out there and is posted again on rail 1; newer data follows.
/// When rail 0's network delivers the old bytes 3 s later, over the
/// connection rail 0's target still serves, none of them lands: rail 0's
/// connection was fenced before the part was reported failed and moved.
#[test]
fn a_moved_write_never_lands_late_from_its_first_rail() {
    const SPAN: u64 = 32 << 10;
    let (mut p, px) = rail0_held(tcp(), tcp());
    let (hold, release, held, delivered) = {
        let g = px.lock().unwrap();
        let x = g
            .as_ref()
            .expect("rail 0's endpoint went through the proxy");
        (
            x.hold.clone(),
            x.release.clone(),
            x.held.clone(),
            x.delivered.clone(),
        )
    };
    // Rail 0's connections (made) now hold what they are sent. Whole
    // transfers rotate from rail 0: the first one goes there.
    hold.store(true, Ordering::SeqCst);
    p.src.fill(0, SPAN, 0xee).unwrap();
    run(&mut p, Op::Write, 0, SPAN).expect("the WRITE moves to rail 1 and lands");
    let moved_at = Instant::now();
    let s = p.init.rail_stats();
    assert!(s[0].failures >= 1, "rail 0 never failed: {s:?}");
    assert!(
        held.load(Ordering::SeqCst) >= SPAN as usize,
        "rail 0's network holds the first attempt ({} bytes)",
        held.load(Ordering::SeqCst)
    );
    assert!(p.dst.to_vec().unwrap()[..SPAN as usize]
        .iter()
        .all(|&b| b == 0xee));
    // Newer data over the same bytes.
    p.src.fill(0, SPAN, 0x33).unwrap();
    run(&mut p, Op::Write, 0, SPAN).unwrap();
    assert!(p.dst.to_vec().unwrap()[..SPAN as usize]
        .iter()
        .all(|&b| b == 0x33));
    // 3 s after the move, rail 0's network delivers the first attempt.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(moved_at.elapsed()));
    release.store(true, Ordering::SeqCst);
    let end = Instant::now() + Duration::from_secs(10);
    let fenced = || p.target.tcp_counters().unwrap().connections_fenced;
    while delivered.load(Ordering::SeqCst) == 0 || fenced() == 0 {
        assert!(
            Instant::now() < end,
            "the held bytes were not refused by a fence (delivered {}, {:?})",
            delivered.load(Ordering::SeqCst),
            p.target.tcp_counters()
        );
        if p.dst.to_vec().unwrap()[..SPAN as usize].contains(&0xee) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let now = p.dst.to_vec().unwrap();
    let late = now[..SPAN as usize].iter().filter(|&&b| b != 0x33).count();
    assert_eq!(
        late, 0,
        "{late} bytes of the first attempt landed over newer data, 3 s after the WRITE moved"
    );
    assert_eq!(p.init.tcp_counters().unwrap().unfenced_failures, 0);
}
