//! Raw ZMTP bytes for tests that talk to a node below the zeromq library
//! (floods, hostile peers). Included with `#[path]` by the tests that use it;
//! each uses a part, hence the `allow`.
#![allow(dead_code)]

use kvlane_control::wire::{Hello, Identity, Message};
use std::io::{ErrorKind, Read};
use std::net::TcpStream;

/// A ZMTP 3.0 greeting (NULL mechanism, client) and a READY command for a
/// DEALER, as a peer sends them before its first message.
pub(crate) fn zmtp_dealer_preamble() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // major
    g[11] = 0; // minor
    g[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    g.push(0x04); // short command
    g.push(body.len() as u8);
    g.extend_from_slice(&body);
    g
}

/// A long-frame header (8-byte length), with or without MORE.
pub(crate) fn long_frame_header(len: u64, more: bool) -> Vec<u8> {
    let mut h = vec![0x02 | u8::from(more)];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

/// One ZMTP data frame (short or long) carrying `body`.
pub(crate) fn zmtp_frame(body: &[u8]) -> Vec<u8> {
    let mut f = if body.len() < 256 {
        vec![0x00, body.len() as u8]
    } else {
        long_frame_header(body.len() as u64, false)
    };
    f.extend_from_slice(body);
    f
}

/// An encoded hello whose fingerprint no node accepts (engine "mallory").
pub(crate) fn wrong_fingerprint_hello() -> Vec<u8> {
    Message::Hello(Hello::new(
        Identity {
            engine_id: "mallory".into(),
            fingerprint: "not-fp".into(),
            tp_size: 1,
            ..Default::default()
        },
        None,
        Vec::new(),
        None,
    ))
    .encode()
    .expect("encode")
}

/// What a flooding peer sends on a new connection: the DEALER preamble and
/// one frame with [`wrong_fingerprint_hello`].
pub(crate) fn preamble_and_wrong_hello() -> Vec<u8> {
    let mut bytes = zmtp_dealer_preamble();
    bytes.extend(zmtp_frame(&wrong_fingerprint_hello()));
    bytes
}

/// Whether the other side closed `s`, a non-blocking stream (whatever it
/// sent is read and dropped; never blocks).
pub(crate) fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}
