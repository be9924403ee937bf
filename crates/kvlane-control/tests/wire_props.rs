//! Property tests: the decoder and the node never panic on arbitrary input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvlane_control::wire::{Message, Notify, Ping, PROTOCOL_VERSION};
use kvlane_control::{Config, Link, LocalInfo, Ranks, Registry};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes, 16 << 20);
    }

    #[test]
    fn decoder_never_panics_on_mutated_valid_frames(
        seq in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut frames = vec![
            Message::Ping(Ping { version: PROTOCOL_VERSION, seq, incarnation: seq ^ 1 }).encode().expect("encode"),
            Message::Notify(Notify { version: PROTOCOL_VERSION, transfer_id: seq, payload }).encode().expect("encode"),
        ];
        for f in &mut frames {
            for (i, b) in &flips {
                let n = f.len();
                f[i % n] ^= b;
            }
            let _ = Message::decode(f, 1 << 20);
            let n = f.len();
            let _ = Message::decode(&f[..cut % (n + 1)], 1 << 20);
        }
    }

    #[test]
    fn roundtrip_notify(transfer_id in any::<u64>(), payload in proptest::collection::vec(any::<u8>(), 0..256)) {
        let m = Message::Notify(Notify { version: PROTOCOL_VERSION, transfer_id, payload });
        let bytes = m.encode().expect("encode");
        prop_assert_eq!(Message::decode(&bytes, 1 << 20).expect("decode"), m);
    }

    #[test]
    fn registry_never_panics_on_arbitrary_inbound_frames(
        frames in proptest::collection::vec((0u8..4, proptest::collection::vec(any::<u8>(), 0..128)), 1..32),
    ) {
        let local = LocalInfo::new("t", Ranks { dp_rank: 0, tp_rank: 0, tp_size: 1 }, "fp");
        let mut reg = Registry::new(Arc::new(Config { rng_seed: 1, ..Config::default() }), Arc::new(local));
        let mut now = Instant::now();
        for (link, bytes) in frames {
            reg.handle_frame(now, Link::Accepted(Bytes::from(vec![link])), &bytes);
            now += Duration::from_millis(300);
            reg.handle_timeout(now);
            while reg.poll_transmit().is_some() {}
            while reg.poll_event().is_some() {}
        }
    }
}
