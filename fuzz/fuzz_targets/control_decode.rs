//! Fuzz the control-plane decoder and the node's inbound routing.
#![no_main]

use std::sync::Arc;
use std::time::Instant;

use kvlane_control::wire::Message;
use kvlane_control::{Config, Link, LocalInfo, Ranks, Registry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Message::decode(data, 1 << 20);
    let local = LocalInfo::new("fuzz", Ranks { dp_rank: 0, tp_rank: 0, tp_size: 1 }, "fp");
    let mut reg = Registry::new(Arc::new(Config { rng_seed: 1, ..Config::default() }), Arc::new(local));
    let now = Instant::now();
    for chunk in data.split(|b| *b == 0xc1) {
        reg.handle_frame(now, Link::Accepted(bytes::Bytes::from_static(b"f")), chunk);
    }
    while reg.poll_transmit().is_some() {}
    while reg.poll_event().is_some() {}
});
