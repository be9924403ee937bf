//! Span transfers between plain regions (no KV layout): two agents over
//! tcp on 127.0.0.1, and every refusal of `prepare_spans`.

use kvlane::data::{Access, Op, Region};
use kvlane::{Agent, BackendChoice, ErrorKind, MemSpan};
use std::time::Duration;

const LEN: usize = 64 << 10;

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

async fn agent(name: &str, regions: Vec<Region>) -> Agent {
    let mut b = Agent::builder().engine_id(name).backend(BackendChoice::Tcp);
    for r in regions {
        b = b.register_region(r);
    }
    b.build().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_write_and_read_between_plain_regions_with_notifications_after_data() {
    let a_mem = Region::from_vec(pattern(1), Access::ALL).unwrap();
    let b_mem = Region::from_vec(pattern(2), Access::ALL).unwrap();
    let a = agent("a", vec![a_mem.clone()]).await;
    let b = agent("b", vec![b_mem.clone()]).await;
    let mut notes = b.notifications().unwrap();
    let peer = a.connect(b.local_addr()).await.unwrap();
    let remote = peer.remote_regions();
    assert_eq!((remote.len(), remote[0].addr), (1, b_mem.addr()));

    // WRITE a[0..4K] and a[4K..8K] (merged) and a[32K..36K] into b.
    let local = [
        MemSpan::new(a_mem.addr(), 4096),
        MemSpan::new(a_mem.addr() + 4096, 4096),
        MemSpan::new(a_mem.addr() + 32768, 4096),
    ];
    let dst = [
        MemSpan::new(b_mem.addr() + 8192, 4096),
        MemSpan::new(b_mem.addr() + 12288, 4096),
        MemSpan::new(b_mem.addr(), 4096),
    ];
    let prepared = peer
        .prepare_spans(Op::Write, &local, &dst, Some(b"w-1"))
        .unwrap();
    assert_eq!((prepared.descriptors(), prepared.bytes()), (2, 12288));
    peer.post(prepared).unwrap().await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(10), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((note.from.as_str(), &note.payload[..]), ("a", &b"w-1"[..]));
    let (src, got) = (pattern(1), b_mem.to_vec().unwrap());
    assert_eq!(got[8192..16384], src[0..8192]);
    assert_eq!(got[0..4096], src[32768..36864]);

    // READ b[60K..64K] into a[16K..20K]; the notification follows the data.
    peer.prepare_spans(
        Op::Read,
        &[MemSpan::new(a_mem.addr() + 16384, 4096)],
        &[MemSpan::new(b_mem.addr() + 61440, 4096)],
        Some(b"r-1"),
    )
    .and_then(|p| peer.post(p))
    .unwrap()
    .await
    .unwrap();
    assert_eq!(
        a_mem.to_vec().unwrap()[16384..20480],
        pattern(2)[61440..65536]
    );
    let note = tokio::time::timeout(Duration::from_secs(10), notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&note.payload[..], b"r-1");
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_outside_registrations_read_only_destinations_and_length_mismatches_are_refused() {
    let a_mem = Region::from_vec(pattern(1), Access::ALL).unwrap();
    let ro = Region::from_vec(pattern(3), Access::REMOTE_READ).unwrap();
    let b_mem = Region::from_vec(pattern(2), Access::ALL).unwrap();
    let a = agent("a", vec![a_mem.clone(), ro.clone()]).await;
    let b = agent("b", vec![b_mem.clone()]).await;
    let peer = a.connect(b.local_addr()).await.unwrap();
    let (la, rb) = (a_mem.addr(), b_mem.addr());
    let cases: [(Op, MemSpan, MemSpan, ErrorKind, &str); 4] = [
        (
            Op::Write,
            MemSpan::new(la + LEN as u64 - 16, 32),
            MemSpan::new(rb, 32),
            ErrorKind::InvalidInput,
            "outside every local registration",
        ),
        (
            Op::Write,
            MemSpan::new(la, 32),
            MemSpan::new(rb + LEN as u64, 32),
            ErrorKind::InvalidInput,
            "advertised",
        ),
        (
            Op::Write,
            MemSpan::new(la, 32),
            MemSpan::new(rb, 64),
            ErrorKind::InvalidInput,
            "span pair 0",
        ),
        (
            Op::Read,
            MemSpan::new(ro.addr(), 32),
            MemSpan::new(rb, 32),
            ErrorKind::Refused,
            "read-only",
        ),
    ];
    for (op, l, r, kind, what) in cases {
        let e = peer.prepare_spans(op, &[l], &[r], None).unwrap_err();
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().contains(what), "{e}");
    }
    assert!(a
        .check_spans(Op::Read, &[MemSpan::new(ro.addr(), 8)])
        .is_err());
    assert!(a
        .check_spans(Op::Write, &[MemSpan::new(ro.addr(), 8)])
        .is_ok());
    assert!(peer
        .check_remote_spans(Op::Read, &[MemSpan::new(rb + 8, 8)])
        .is_ok());
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_registered_after_build_is_local_at_once_and_advertised_to_later_handshakes() {
    let a_mem = Region::from_vec(vec![0; LEN], Access::ALL).unwrap();
    let b_first = Region::from_vec(pattern(2), Access::ALL).unwrap();
    let b_late = Region::from_vec(pattern(3), Access::ALL).unwrap();
    let a = agent("a", vec![a_mem.clone()]).await;
    let b = agent("b", vec![b_first.clone()]).await;
    let peer = a.connect(b.local_addr()).await.unwrap();
    let late = [MemSpan::new(b_late.addr(), LEN as u64)];
    let mine = [MemSpan::new(a_mem.addr(), LEN as u64)];
    assert_eq!(
        b.check_spans(Op::Write, &late).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );

    b.register_region(b_late.clone()).await.unwrap();
    b.check_spans(Op::Write, &late).unwrap();
    assert_eq!(b.regions().len(), 2);
    // The connection made before keeps what its handshake said.
    let err = peer
        .prepare_spans(Op::Read, &mine, &late, None)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(peer.remote_regions().len(), 1);

    // A new handshake advertises it, and it is served.
    peer.disconnect().await.unwrap();
    let peer = a.connect(b.local_addr()).await.unwrap();
    assert!(peer.is_attached());
    assert_eq!(peer.remote_regions().len(), 2);
    peer.prepare_spans(Op::Read, &mine, &late, None)
        .and_then(|p| peer.post(p))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(a_mem.to_vec().unwrap(), pattern(3));
    peer.disconnect().await.unwrap();
    assert!(!peer.is_attached());
    a.close().await;
    b.close().await;
}
