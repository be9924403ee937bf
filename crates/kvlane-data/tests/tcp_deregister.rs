//! Deregistration on the tcp target: once `deregister` returns, no byte of
//! the region is read or written (the application may free it), also for
//! requests the target accepted before. The raw tests speak the wire
//! protocol by hand, so a request can be held half-way on purpose.

use kvlane_data::conformance::{deregister_stops_target_access, LoopbackFixture, TcpFixture};
use kvlane_data::tcp::wire::{authenticate, Request, RequestKind, Response, Status, RESPONSE_LEN};
use kvlane_data::{Access, Backend, Region, RemoteRegion, TcpBackend, TcpConfig, TcpEndpoint};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const GRACE: Duration = Duration::from_millis(50);

/// A target serving one region of `len` bytes of 0x11, and a credential.
fn target(
    config: TcpConfig,
    len: usize,
    access: Access,
) -> (TcpBackend, TcpEndpoint, Region, RemoteRegion) {
    let mut backend = TcpBackend::new(config).unwrap();
    let region = Region::from_vec(vec![0x11; len], access).unwrap();
    let ad = backend.register(&region).unwrap();
    let (_, endpoint) = backend.prepare_peer().unwrap();
    let ep = TcpEndpoint::from_endpoint(&endpoint).unwrap();
    (backend, ep, region, ad)
}

fn authed(ep: &TcpEndpoint) -> TcpStream {
    let mut s = TcpStream::connect(ep.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    authenticate(&mut s, &ep.token).unwrap();
    s
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A WRITE whose payload stops half-way is in progress when the region is
/// deregistered: deregister returns after the grace, the rest of the
/// payload (sent afterwards) does not reach the memory, the WRITE is
/// answered with a refusal, and later requests for the key are refused.
/// (Before, the target kept a clone of the region and stored the rest of
/// the payload into memory the application had taken back.)
#[test]
fn a_write_in_progress_is_cut_and_leaves_the_memory_alone() {
    const LEN: u64 = 1 << 20;
    let config = TcpConfig {
        deregister_grace: GRACE,
        ..TcpConfig::default()
    };
    let (mut backend, ep, region, ad) = target(config, LEN as usize, Access::ALL);
    let mut s = authed(&ep);
    let req = Request {
        kind: RequestKind::Write,
        key: ad.key,
        tag: 7,
        offset: 0,
        len: LEN,
    };
    s.write_all(&req.encode()).unwrap();
    s.write_all(&vec![0xab; (LEN / 4) as usize]).unwrap();
    wait_for("the first quarter to land", || {
        region.to_vec().unwrap()[..(LEN / 4) as usize]
            .iter()
            .all(|&b| b == 0xab)
    });
    let started = Instant::now();
    backend.deregister(region.id()).expect("deregister");
    let waited = started.elapsed();
    // The application reuses its memory.
    region.write(0, &vec![0x5a; LEN as usize]).unwrap();
    // The rest of the payload arrives now.
    s.write_all(&vec![0xcd; (LEN - LEN / 4) as usize]).unwrap();
    let mut h = [0u8; RESPONSE_LEN];
    s.read_exact(&mut h).unwrap();
    let resp = Response::decode(&h).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mem = region.to_vec().unwrap();
    let changed = mem.iter().filter(|&&b| b != 0x5a).count();
    assert_eq!(
        changed, 0,
        "{changed} bytes written after deregister returned"
    );
    assert_eq!((resp.tag, resp.status), (7, Status::Revoked));
    assert!(waited >= GRACE, "cut after {waited:?}, before the grace");
    assert_eq!(backend.counters().requests_cut, 1);
    // The connection goes on; the key is gone.
    let later = Request {
        tag: 8,
        len: 16,
        ..req
    };
    s.write_all(&later.encode()).unwrap();
    s.write_all(&[0xef; 16]).unwrap();
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        Response::decode(&h).unwrap(),
        Response {
            status: Status::UnknownKey,
            tag: 8
        }
    );
    assert!(region.to_vec().unwrap().iter().all(|&b| b == 0x5a));
}

/// A READ answer the peer does not take (small socket buffers) is still
/// being sent from the region when it is deregistered: deregister cuts
/// it and closes the connection, and nothing written into the memory
/// afterwards is ever sent. (Before, the answer went on streaming from the
/// region's memory as the peer read it.)
#[test]
fn a_read_being_answered_is_cut_and_sends_nothing_read_afterwards() {
    const LEN: u64 = 8 << 20;
    let config = TcpConfig {
        socket_buffer: Some(64 << 10),
        deregister_grace: GRACE,
        ..TcpConfig::default()
    };
    let (mut backend, ep, region, ad) = target(config, LEN as usize, Access::ALL);
    let s = authed(&ep);
    // Small receive buffer on our side too: most of the answer waits.
    socket2::SockRef::from(&s)
        .set_recv_buffer_size(64 << 10)
        .unwrap();
    let mut s = s;
    let req = Request {
        kind: RequestKind::Read,
        key: ad.key,
        tag: 9,
        offset: 0,
        len: LEN,
    };
    s.write_all(&req.encode()).unwrap();
    wait_for("the READ to be accepted", || {
        backend.counters().reads_served == 1
    });
    backend.deregister(region.id()).expect("deregister");
    region.write(0, &vec![0x5a; LEN as usize]).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.len() >= RESPONSE_LEN, "no answer header");
    let mut h = [0u8; RESPONSE_LEN];
    h.copy_from_slice(&got[..RESPONSE_LEN]);
    assert_eq!(Response::decode(&h).unwrap().status, Status::Ok);
    let payload = &got[RESPONSE_LEN..];
    let late = payload.iter().filter(|&&b| b == 0x5a).count();
    assert_eq!(late, 0, "{late} bytes were read after deregister returned");
    assert!(
        (payload.len() as u64) < LEN,
        "the whole answer was sent: nothing was cut"
    );
    assert!(payload.iter().all(|&b| b == 0x11));
    assert_eq!(backend.counters().requests_cut, 1);
}

/// Deregistering a region with nothing in flight returns at once.
#[test]
fn an_idle_region_is_deregistered_without_waiting() {
    let (mut backend, _ep, region, _ad) = target(
        TcpConfig {
            deregister_grace: Duration::from_secs(60),
            ..TcpConfig::default()
        },
        4096,
        Access::ALL,
    );
    let started = Instant::now();
    backend.deregister(region.id()).expect("deregister");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(matches!(
        backend.deregister(region.id()),
        Err(kvlane_data::DataError::UnknownRegion(_))
    ));
}

#[test]
fn tcp_deregister_stops_target_access() {
    deregister_stops_target_access(&TcpFixture(|| None));
}

/// The loopback backend copies with the target's region table locked, so
/// a deregistration waits for the copy in progress and later ones find
/// no key.
#[test]
fn loopback_deregister_stops_target_access() {
    deregister_stops_target_access(&LoopbackFixture(|| None));
}
