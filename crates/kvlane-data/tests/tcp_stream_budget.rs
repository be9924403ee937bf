//! `TcpConfig::stream_budget`: once the process's initiator streams reach
//! the budget, a newly connected peer gets fewer streams (one past it),
//! its transfers still land byte for byte, and a dropped peer's streams
//! leave the count. In its own test binary: the count is per process (per
//! pool of I/O threads), so no other test may connect meanwhile.

use kvlane_data::conformance::{one_span, run_one, Rng};
use kvlane_data::{connect_pair, Access, Backend, Op, Region, TcpBackend, TcpConfig};
use std::time::{Duration, Instant};

fn config() -> TcpConfig {
    TcpConfig {
        streams: 4,
        stream_budget: 6,
        // Small chunks: a 256 KiB transfer is 16 of them, striped over
        // every stream the peer has.
        chunk_bytes: 16 << 10,
        io_threads: 1,
        ..TcpConfig::default()
    }
}

const LEN: u64 = 256 << 10;

#[test]
fn peers_past_the_stream_budget_get_one_stream_and_still_move_every_byte() {
    let mut a = TcpBackend::new(config()).unwrap();
    let mut b = TcpBackend::new(config()).unwrap();
    let mut data = vec![0u8; LEN as usize];
    Rng::new(29).fill(&mut data);
    let src = Region::from_vec(data.clone(), Access::ALL).unwrap();
    let back = Region::alloc(LEN as usize, Access::ALL).unwrap();
    let remote = Region::alloc(LEN as usize, Access::ALL).unwrap();
    let src_ad = a.register(&src).unwrap();
    a.register(&back).unwrap();
    let remote_ad = b.register(&remote).unwrap();

    // `connect_pair` dials a -> b, then b -> a; both count in the one
    // pool of this process. A connect returns once every stream was
    // admitted, so the target's count is exact.
    let accepted = |x: &TcpBackend| x.counters().connections_accepted;
    let mut pairs = Vec::new();
    // Wanted 4 each: 4 (0 open), 2 (4 open, 6 fit), then 1 each.
    for (i, (to_b, to_a)) in [(4, 2), (1, 1), (1, 1)].into_iter().enumerate() {
        let (before_b, before_a) = (accepted(&b), accepted(&a));
        let (pa, pb) = connect_pair(&mut a, &[src_ad], &mut b, &[remote_ad]).unwrap();
        assert_eq!(
            (accepted(&b) - before_b, accepted(&a) - before_a),
            (to_b, to_a),
            "streams of pair {i} (a to b, b to a)"
        );
        pairs.push((pa, pb));
    }
    assert_eq!(a.initiator_streams(), 10);

    // The last peer has one stream: its 16 chunks all go over it.
    let (pa, _) = *pairs.last().unwrap();
    run_one(
        &mut a,
        &mut b,
        one_span(pa, Op::Write, (&src, 0), (remote_ad.key, 0), LEN),
    )
    .unwrap();
    assert!(remote.to_vec().unwrap() == data, "a WRITE landed wrong");
    run_one(
        &mut a,
        &mut b,
        one_span(pa, Op::Read, (&back, 0), (remote_ad.key, 0), LEN),
    )
    .unwrap();
    assert!(back.to_vec().unwrap() == data, "a READ landed wrong");

    // Removed peers give their streams back once their I/O thread let
    // them go; then a new peer gets all 4 again.
    for (pa, pb) in pairs {
        a.remove_peer(pa);
        b.remove_peer(pb);
    }
    let end = Instant::now() + Duration::from_secs(10);
    while a.initiator_streams() > 0 {
        assert!(
            Instant::now() < end,
            "{} streams still counted 10 s after every peer was removed",
            a.initiator_streams()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let before_b = accepted(&b);
    connect_pair(&mut a, &[src_ad], &mut b, &[remote_ad]).unwrap();
    assert_eq!(accepted(&b) - before_b, 4, "streams after the others left");
}
