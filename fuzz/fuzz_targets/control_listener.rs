//! Fuzz the control listener through its real socket path: bytes go over
//! TCP to a bound `ControlNode` (ZeroMQ ROUTER: accept, ZMTP greeting and
//! READY, the patched codec with kvlane's limits, the channel, the registry,
//! the peer machines). After each input the node must still answer (its
//! driver did not die) and must not hold more than its caps.
//!
//! Input: the first byte picks how the rest is sent after a valid ZMTP
//! preamble (DEALER greeting + READY): even = raw bytes (arbitrary frame
//! headers, announced lengths, commands, multipart runs), odd = split at
//! 0xc1 bytes into single-frame ZMTP messages (control messages decoded by
//! the wire layer and routed by the registry).
#![no_main]

use std::io::Write;
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::Duration;

use kvlane_control::{Config, ControlNode, LocalInfo, Psk, Ranks};
use libfuzzer_sys::fuzz_target;

struct Target {
    rt: tokio::runtime::Runtime,
    node: ControlNode,
    addr: String,
}

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let config = Config {
            handshake_timeout: Duration::from_millis(200),
            frame_cap: 64 << 10,
            peer_cap: 16,
            handshake_cap: 16,
            psk: Some(Psk::new(b"fuzz-key".to_vec())),
            rng_seed: 1,
            ..Config::default()
        };
        let ranks = Ranks { dp_rank: 0, tp_rank: 0, tp_size: 1 };
        let local = LocalInfo::new("fuzz", ranks, "fp").with_data_plane(b"blob".to_vec());
        let node = rt
            .block_on(ControlNode::bind(config, local, "127.0.0.1:0"))
            .expect("bind");
        let addr = node.local_addr().to_owned();
        Target { rt, node, addr }
    })
}

// The raw ZMTP bytes kvlane-control's flood tests send.
#[path = "../../crates/kvlane-control/tests/common/zmtp.rs"]
mod zmtp;
use zmtp::{long_frame_header, zmtp_dealer_preamble};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let t = target();
    let mut bytes = zmtp_dealer_preamble();
    if mode % 2 == 0 {
        bytes.extend_from_slice(rest);
    } else {
        for msg in rest.split(|b| *b == 0xc1) {
            bytes.extend(long_frame_header(msg.len() as u64, false));
            bytes.extend_from_slice(msg);
        }
    }
    if let Ok(mut s) = TcpStream::connect(&t.addr) {
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = s.write_all(&bytes);
    }
    // The listener still answers, and holds no more than its caps.
    let peers = t
        .rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), t.node.peers()).await })
        .expect("the control node stopped answering")
        .expect("the control driver ended");
    assert!(peers.len() <= 16 + 16, "{} connections tracked", peers.len());
});
