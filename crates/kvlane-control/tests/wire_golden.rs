//! Golden bytes of the handshake: what a node with a fixed identity puts on
//! the wire, and the identity transcript the handshake MAC covers. Python
//! peers (`tests/py/peer.py`) build and check the same bytes, so any change
//! here is a protocol change, not a refactoring.
//!
//! Version 2 (`version` byte `02` below): the frames are laid out as in
//! version 1, but the MACs also cover `auth.source` and a keyed session
//! derives a secret, so a version-1 peer is refused by version.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvlane_control::wire::{Identity, Message};
use kvlane_control::{Config, Link, LocalInfo, Psk, Ranks, Registry, Route, Transmit};

/// The identity of `engine` at ranks 1/2 of 4, with a fixed incarnation and
/// one capability.
fn local(engine: &str, incarnation: u64) -> LocalInfo {
    let mut l = LocalInfo::new(
        engine,
        Ranks {
            dp_rank: 1,
            tp_rank: 2,
            tp_size: 4,
        },
        "fp-1",
    )
    .with_data_plane(format!("blob-{engine}").into_bytes());
    l.identity.incarnation = incarnation;
    l.identity.capabilities = vec!["cap".into()];
    l
}

fn registry(l: LocalInfo, psk: Option<&[u8]>) -> Registry {
    let config = Config {
        rng_seed: 1,
        psk: psk.map(Psk::new),
        ..Config::default()
    };
    Registry::new(Arc::new(config), Arc::new(l))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The frames `from` sends, in order.
fn frames(from: &mut Registry) -> Vec<Vec<u8>> {
    std::iter::from_fn(|| from.poll_transmit())
        .filter_map(|(_, _, t)| match t {
            Transmit::Frame(f) => Some(f.to_vec()),
            _ => None,
        })
        .collect()
}

fn route() -> Route {
    Route {
        peer: Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))),
        source: Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
    }
}

/// `Identity::transcript_bytes`: a msgpack array in field order.
const TRANSCRIPT: &str = "97a161cf0102030405060708010204a466702d3191a3636170";

/// The unkeyed `hello` of `a` (incarnation 0x0102030405060708), dialed via
/// [`route`].
const HELLO: &str = "8da474797065a568656c6c6fa776657273696f6e02a9656e67696e655f6964a161ab696e6361726e6174696f6ecf0102030405060708a764705f72616e6b01a774705f72616e6b02a774705f73697a6504ab66696e6765727072696e74a466702d31ac6361706162696c697469657391a3636170a461757468c2a56e6f6e6365c400aa646174615f706c616e65c406626c6f622d61a6736f75726365a831302e302e302e31";

/// The unkeyed `hello_ack` of `b` (incarnation 0x1112131415161718).
const HELLO_ACK: &str = "8ca474797065a968656c6c6f5f61636ba776657273696f6e02a9656e67696e655f6964a162ab696e6361726e6174696f6ecf1112131415161718a764705f72616e6b01a774705f72616e6b02a774705f73697a6504ab66696e6765727072696e74a466702d31ac6361706162696c697469657391a3636170a56e6f6e6365c400a36d6163c400aa646174615f706c616e65c406626c6f622d62";

/// The keyed `auth` of `a` with its MAC zeroed (the nonces are random).
const AUTH_ZEROED_MAC: &str = "86a474797065a461757468a776657273696f6e02a36d6163c4200000000000000000000000000000000000000000000000000000000000000000aa646174615f706c616e65c406626c6f622d61a86964656e7469747987a9656e67696e655f6964a161ab696e6361726e6174696f6ecf0102030405060708a764705f72616e6b01a774705f72616e6b02a774705f73697a6504ab66696e6765727072696e74a466702d31ac6361706162696c697469657391a3636170a6736f75726365a831302e302e302e31";

/// The keyed `auth_ack` of `b` with its MAC zeroed.
const AUTH_ACK_ZEROED_MAC: &str = "85a474797065a8617574685f61636ba776657273696f6e02a36d6163c4200000000000000000000000000000000000000000000000000000000000000000aa646174615f706c616e65c406626c6f622d62a86964656e7469747987a9656e67696e655f6964a162ab696e6361726e6174696f6ecf1112131415161718a764705f72616e6b01a774705f72616e6b02a774705f73697a6504ab66696e6765727072696e74a466702d31ac6361706162696c697469657391a3636170";

#[test]
fn identity_transcript_is_a_msgpack_array_in_field_order() {
    let identity = Identity {
        engine_id: "a".into(),
        incarnation: 0x0102_0304_0506_0708,
        dp_rank: 1,
        tp_rank: 2,
        tp_size: 4,
        fingerprint: "fp-1".into(),
        capabilities: vec!["cap".into()],
    };
    assert_eq!(hex(&identity.transcript_bytes()), TRANSCRIPT);
}

#[test]
fn unkeyed_hello_and_hello_ack_bytes_are_pinned() {
    let now = Instant::now();
    let mut a = registry(local("a", 0x0102_0304_0506_0708), None);
    let mut b = registry(local("b", 0x1112_1314_1516_1718), None);
    a.connect_via(now, "b:1", route()).expect("connect");
    let hello = frames(&mut a);
    assert_eq!(hello.len(), 1);
    assert_eq!(hex(&hello[0]), HELLO);

    b.handle_frame(now, Link::Accepted(Bytes::from_static(b"rid")), &hello[0]);
    let ack = frames(&mut b);
    assert_eq!(ack.len(), 1);
    assert_eq!(hex(&ack[0]), HELLO_ACK);
}

#[test]
fn keyed_auth_and_auth_ack_carry_the_pinned_identities() {
    let now = Instant::now();
    let key: &[u8] = b"key";
    let mut a = registry(local("a", 0x0102_0304_0506_0708), Some(key));
    let mut b = registry(local("b", 0x1112_1314_1516_1718), Some(key));
    let id = a.connect_via(now, "b:1", route()).expect("connect");
    let hello = frames(&mut a);
    b.handle_frame(now, Link::Accepted(Bytes::from_static(b"rid")), &hello[0]);
    let ack = frames(&mut b);
    a.handle_frame(now, Link::Dial(id), &ack[0]);
    let auth = frames(&mut a);
    assert_eq!(auth.len(), 1);
    b.handle_frame(now, Link::Accepted(Bytes::from_static(b"rid")), &auth[0]);
    let auth_ack = frames(&mut b);
    assert_eq!(auth_ack.len(), 1);

    let Ok(Message::Auth(mut auth)) = Message::decode(&auth[0], 1 << 20) else {
        panic!("expected auth")
    };
    assert_eq!(hex(&auth.identity.transcript_bytes()), TRANSCRIPT);
    assert_eq!(auth.mac.len(), 32);
    auth.mac = vec![0; 32];
    let zeroed = Message::Auth(auth).encode().expect("encode");
    assert_eq!(hex(&zeroed), AUTH_ZEROED_MAC);

    let Ok(Message::AuthAck(mut ack)) = Message::decode(&auth_ack[0], 1 << 20) else {
        panic!("expected auth_ack")
    };
    assert_eq!(ack.mac.len(), 32);
    ack.mac = vec![0; 32];
    let zeroed = Message::AuthAck(ack).encode().expect("encode");
    assert_eq!(hex(&zeroed), AUTH_ACK_ZEROED_MAC);
}
