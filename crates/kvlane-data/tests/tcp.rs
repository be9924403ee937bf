//! The conformance suite and tcp-specific tests on the tcp backend.

kvlane_data::conformance_tests!(kvlane_data::conformance::TcpFixture(|| None));

/// Tests that speak the wire protocol by hand, bypassing the initiator.
mod raw {
    use kvlane_data::tcp::wire::{
        authenticate, Challenge, Hello, Request, RequestKind, Response, Status, CHALLENGE_LEN,
        HELLO_ACK, HELLO_LEN, RESPONSE_LEN,
    };
    use kvlane_data::{
        Access, Backend, Region, RemoteKey, RemoteRegion, TcpBackend, TcpConfig, TcpEndpoint,
    };
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    const LEN: u64 = 64 << 10;

    struct Target {
        backend: TcpBackend,
        ep: TcpEndpoint,
        all: (Region, RemoteRegion),
        read_only: (Region, RemoteRegion),
        write_only: (Region, RemoteRegion),
    }

    fn region(b: &mut TcpBackend, access: Access, seed: u8) -> (Region, RemoteRegion) {
        let data: Vec<u8> = (0..LEN)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect();
        let r = Region::from_vec(data, access).unwrap();
        let ad = b.register(&r).unwrap();
        (r, ad)
    }

    fn target() -> Target {
        let mut backend = TcpBackend::new(TcpConfig::default()).unwrap();
        let all = region(&mut backend, Access::ALL, 1);
        let read_only = region(&mut backend, Access::REMOTE_READ, 2);
        let write_only = region(&mut backend, Access::REMOTE_WRITE, 3);
        let (_, endpoint) = backend.prepare_peer().unwrap();
        let ep = TcpEndpoint::from_endpoint(&endpoint).unwrap();
        Target {
            backend,
            ep,
            all,
            read_only,
            write_only,
        }
    }

    fn connect(ep: &TcpEndpoint) -> TcpStream {
        let s = TcpStream::connect(ep.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn authed(ep: &TcpEndpoint) -> TcpStream {
        let s = connect(ep);
        authenticate(&s, &ep.token).unwrap();
        s
    }

    /// The challenge a fresh connection is sent first.
    fn challenge(s: &mut TcpStream) -> Challenge {
        let mut c = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut c).unwrap();
        Challenge::decode(&c).unwrap()
    }

    fn request(
        s: &mut TcpStream,
        kind: RequestKind,
        key: RemoteKey,
        offset: u64,
        len: u64,
    ) -> Response {
        let req = Request {
            kind,
            key,
            tag: offset ^ len,
            offset,
            len,
        };
        s.write_all(&req.encode()).unwrap();
        if kind == RequestKind::Write {
            s.write_all(&vec![0xee; len as usize]).unwrap();
        }
        let mut h = [0u8; RESPONSE_LEN];
        s.read_exact(&mut h).unwrap();
        let resp = Response::decode(&h).unwrap();
        assert_eq!(resp.tag, req.tag);
        resp
    }

    fn snapshot(t: &Target) -> Vec<Vec<u8>> {
        [&t.all.0, &t.read_only.0, &t.write_only.0]
            .iter()
            .map(|r| r.to_vec().unwrap())
            .collect()
    }

    /// Reads until the server closes; returns what it sent.
    fn drain(mut s: TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    }

    /// Sends a 16-byte WRITE at offset 100 on a fenced connection, which
    /// must close it without an answer.
    fn write_unanswered(mut old: TcpStream, key: RemoteKey) {
        let req = Request {
            kind: RequestKind::Write,
            key,
            tag: 1,
            offset: 100,
            len: 16,
        };
        let _ = old.write_all(&req.encode());
        let _ = old.write_all(&[0xee; 16]);
        assert!(drain(old).is_empty(), "a fenced connection answered");
    }

    #[test]
    fn raw_client_bad_requests_refused_and_memory_unchanged() {
        let t = target();
        let before = snapshot(&t);
        let mut s = authed(&t.ep);
        let (all, ro, wo) = (t.all.1.key, t.read_only.1.key, t.write_only.1.key);
        let unknown = RemoteKey(all.0 + 1000);
        use RequestKind::{Read, Write};
        let cases = [
            (Write, unknown, 0, 64, Status::UnknownKey),
            (Read, unknown, 0, 64, Status::UnknownKey),
            (Write, all, LEN - 10, 64, Status::OutOfBounds(LEN)),
            (Read, all, LEN - 10, 64, Status::OutOfBounds(LEN)),
            (Write, all, u64::MAX - 10, 64, Status::OutOfBounds(LEN)),
            (Read, all, u64::MAX, 1, Status::OutOfBounds(LEN)),
            (Write, all, LEN + 1, 0, Status::OutOfBounds(LEN)),
            (
                Write,
                ro,
                0,
                64,
                Status::AccessDenied(Access::REMOTE_READ.bits()),
            ),
            (
                Read,
                wo,
                0,
                64,
                Status::AccessDenied(Access::REMOTE_WRITE.bits()),
            ),
        ];
        for (kind, key, offset, len, want) in cases {
            let resp = request(&mut s, kind, key, offset, len);
            assert_eq!(resp.status, want, "{kind:?} {key} {offset}+{len}");
        }
        assert!(
            snapshot(&t) == before,
            "a refused request changed target memory"
        );
        // The connection survives refusals: a valid WRITE then READ work.
        assert_eq!(request(&mut s, Write, all, 100, 8).status, Status::Ok);
        assert_eq!(t.all.0.to_vec().unwrap()[100..108], [0xee; 8]);
        assert_eq!(request(&mut s, Read, ro, 8, 16).status, Status::Ok);
        let mut data = [0u8; 16];
        s.read_exact(&mut data).unwrap();
        assert_eq!(data[..], before[1][8..24]);
        let c = t.backend.counters();
        assert_eq!(c.refused_unknown_key, 2, "{c:?}");
        assert_eq!(c.refused_out_of_bounds, 5, "{c:?}");
        assert_eq!(c.refused_access, 2, "{c:?}");
        assert_eq!((c.writes_served, c.reads_served), (1, 1), "{c:?}");
    }

    /// A connection's FENCE makes the peer's connections of lower
    /// generations useless: their next request (or the rest of a WRITE's
    /// payload) closes them before anything reaches memory. A FENCE below
    /// the peer's generation closes its own connection; one equal to it
    /// (another stream of the same connection set) is accepted.
    #[test]
    fn a_newer_generation_fences_the_older_connections() {
        use kvlane_data::tcp::wire::fence;
        let t = target();
        let key = t.all.1.key;
        let before = t.all.0.to_vec().unwrap();
        let mut old = authed(&t.ep);
        fence(&old, 5).unwrap();
        assert_eq!(
            request(&mut old, RequestKind::Write, key, 0, 16).status,
            Status::Ok
        );
        let mut new = authed(&t.ep);
        fence(&new, 6).unwrap();
        // The old connection's WRITE is dropped and the connection closed.
        write_unanswered(old, key);
        let now = t.all.0.to_vec().unwrap();
        assert_eq!(now[100..116], before[100..116], "a fenced WRITE landed");
        assert_eq!(now[..16], [0xee; 16], "the WRITE before the fence landed");
        // Below the floor: refused; equal: accepted; the new one serves.
        let late = authed(&t.ep);
        let e = fence(&late, 4).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        assert!(e.to_string().contains("generation 4"), "{e}");
        let same = authed(&t.ep);
        fence(&same, 6).unwrap();
        assert_eq!(
            request(&mut new, RequestKind::Write, key, 200, 16).status,
            Status::Ok
        );
        assert_eq!(t.backend.counters().connections_fenced, 2);
    }

    /// Two tcp backends of one process that fence through each other (the
    /// rails of one agent): a connection to the second that proves the
    /// first's credential may FENCE that peer's connections to the first
    /// (its older connection there is fenced), and nothing else: its READ
    /// closes it. Without the link the credential is refused there.
    #[test]
    fn a_sibling_rail_admits_a_peer_to_fence_only() {
        use kvlane_data::tcp::wire::fence;
        let t = target();
        let key = t.all.1.key;
        let before = t.all.0.to_vec().unwrap();
        let other = TcpBackend::new(TcpConfig::default()).unwrap();
        let via = TcpEndpoint {
            addr: other.local_addr(),
            listen: other.local_addr(),
            ..t.ep
        };
        // Not linked: the first backend's credential means nothing here.
        let s = connect(&via);
        assert!(
            authenticate(&s, &t.ep.token).is_err(),
            "a stranger's credential was admitted"
        );
        TcpBackend::fence_through_each_other(&[&t.backend, &other]);
        let mut old = authed(&t.ep);
        fence(&old, 5).unwrap();
        assert_eq!(
            request(&mut old, RequestKind::Write, key, 0, 16).status,
            Status::Ok
        );
        // Through the sibling: a FENCE of a newer generation.
        let mut sib = authed(&via);
        fence(&sib, 6).unwrap();
        assert_eq!(other.counters().sibling_fences, 1);
        // The old connection to the first backend is fenced...
        write_unanswered(old, key);
        assert_eq!(
            t.all.0.to_vec().unwrap()[100..116],
            before[100..116],
            "a fenced WRITE landed"
        );
        assert_eq!(t.backend.counters().connections_fenced, 1);
        // ...and the sibling connection serves nothing but FENCE.
        let req = Request {
            kind: RequestKind::Read,
            key,
            tag: 2,
            offset: 0,
            len: 16,
        };
        let _ = sib.write_all(&req.encode());
        assert!(
            drain(sib).is_empty(),
            "a fence-only connection served a READ"
        );
    }

    /// A TCP proxy in front of `target` that forwards both ways and
    /// records what each connection's client sent, as an observer on the
    /// link would.
    fn recording_proxy(target: std::net::SocketAddr) -> (std::net::SocketAddr, Recorded) {
        use std::net::{Shutdown, TcpListener};
        use std::sync::{Arc, Mutex};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let recorded: Recorded = Arc::default();
        let rec = recorded.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                let sent = Arc::new(Mutex::new(Vec::new()));
                rec.lock().unwrap().push(sent.clone());
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let pump = move |mut from: TcpStream,
                                 mut to: TcpStream,
                                 log: Option<Arc<Mutex<Vec<u8>>>>| {
                    let mut buf = [0u8; 16 << 10];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if let Some(log) = &log {
                                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                                }
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                };
                std::thread::spawn(move || pump(client, server, Some(sent)));
                std::thread::spawn(move || pump(s2, c2, None));
            }
        });
        (addr, recorded)
    }

    type Recorded =
        std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<std::sync::Mutex<Vec<u8>>>>>>;

    /// An observer that recorded a legitimate peer's data connection (its
    /// hello included) and replays the hello on a connection of its own
    /// gets nothing: every connection proves the credential afresh, and
    /// the replay is refused and counted as a failed authentication.
    #[test]
    fn a_captured_hello_replayed_on_a_new_connection_is_refused() {
        let t = target();
        let (proxy, recorded) = recording_proxy(t.ep.addr);
        let via_proxy = TcpEndpoint {
            addr: proxy,
            ..t.ep
        };
        let mut init = TcpBackend::new(TcpConfig {
            streams: 1,
            ..TcpConfig::default()
        })
        .unwrap();
        let (peer, _) = init.prepare_peer().unwrap();
        // The legitimate peer connects (and so authenticates) through the proxy.
        init.connect_peer(peer, &via_proxy.to_endpoint(), &[t.all.1])
            .unwrap();
        assert_eq!(t.backend.counters().auth_failures, 0);
        let captured: Vec<u8> = {
            let conns = recorded.lock().unwrap();
            assert_eq!(conns.len(), 1, "one stream");
            let sent = conns[0].lock().unwrap();
            assert!(sent.len() >= HELLO_LEN, "the hello went through the proxy");
            sent[..HELLO_LEN].to_vec()
        };
        // The observer takes its own fresh challenge, replays the hello,
        // then asks for memory.
        let before = t.backend.counters();
        let mut s = connect(&t.ep);
        let mut challenge = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut challenge).unwrap();
        assert_eq!(
            challenge[..HELLO_ACK.len()],
            HELLO_ACK,
            "the challenge's header"
        );
        let read = Request {
            kind: RequestKind::Read,
            key: t.all.1.key,
            tag: 9,
            offset: 0,
            len: 4096,
        };
        let _ = s.write_all(&[&captured[..], &read.encode()].concat());
        // After the challenge (whose header is the ack's), nothing: no ack.
        let got = drain(s);
        assert!(
            !got.windows(HELLO_ACK.len()).any(|w| w == HELLO_ACK),
            "the replayed hello was accepted ({} bytes came back after the challenge)",
            got.len()
        );
        assert!(got.len() < RESPONSE_LEN + 4096, "memory was read");
        let c = t.backend.counters();
        assert_eq!(c.auth_failures, before.auth_failures + 1, "{c:?}");
        assert_eq!(c.reads_served, before.reads_served, "{c:?}");
        drop(init);
    }

    #[test]
    fn unauthenticated_connections_get_nothing() {
        let t = target();
        let before = snapshot(&t);
        let key = t.all.1.key;
        let read = Request {
            kind: RequestKind::Read,
            key,
            tag: 1,
            offset: 0,
            len: 4096,
        };
        let write = Request {
            kind: RequestKind::Write,
            key,
            tag: 2,
            offset: 0,
            len: 64,
        };
        // What to send, given the connection's challenge, the endpoint and
        // some requests.
        type Attempt = fn(&Challenge, &TcpEndpoint, &[u8]) -> Vec<u8>;
        let attempts: Vec<Attempt> = vec![
            // Wrong token, then requests.
            |c, ep, reqs| {
                let mut wrong = ep.token;
                wrong[15] ^= 1;
                [&Hello::answer(c, &wrong).encode()[..], reqs].concat()
            },
            // The right token proven for another challenge.
            |_, ep, reqs| {
                let other = Challenge::fresh();
                [&Hello::answer(&other, &ep.token).encode()[..], reqs].concat()
            },
            // No hello at all: requests straight away.
            |_, _, reqs| reqs.to_vec(),
            // Garbage.
            |_, _, _| (0..200u32).map(|i| (i * 7) as u8).collect(),
            // A truncated hello.
            |c, ep, _| Hello::answer(c, &ep.token).encode()[..HELLO_LEN - 1].to_vec(),
        ];
        let reqs = [&read.encode()[..], &write.encode(), &[0xee; 64]].concat();
        for (i, attempt) in attempts.iter().enumerate() {
            let mut s = connect(&t.ep);
            let c = challenge(&mut s);
            let _ = s.write_all(&attempt(&c, &t.ep, &reqs));
            if i == 4 {
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
            let got = drain(s);
            assert!(got.is_empty(), "attempt {i} got {} bytes back", got.len());
        }
        assert!(
            snapshot(&t) == before,
            "an unauthenticated connection changed memory"
        );
        let c = t.backend.counters();
        assert_eq!(c.auth_failures, 5, "{c:?}");
        assert_eq!((c.reads_served, c.writes_served), (0, 0), "{c:?}");
    }

    #[test]
    fn framing_error_closes_only_that_connection() {
        let t = target();
        let mut good = authed(&t.ep);
        let mut bad = authed(&t.ep);
        let mut header = Request {
            kind: RequestKind::Read,
            key: t.all.1.key,
            tag: 1,
            offset: 0,
            len: 8,
        }
        .encode();
        header[0] = 9; // unknown opcode
        bad.write_all(&header).unwrap();
        assert!(drain(bad).is_empty(), "a bad header was answered");
        // Oversized request: also a framing error, nothing read.
        let mut big = authed(&t.ep);
        let huge = Request {
            kind: RequestKind::Write,
            key: t.all.1.key,
            tag: 1,
            offset: 0,
            len: 1 << 40,
        };
        big.write_all(&huge.encode()).unwrap();
        assert!(drain(big).is_empty());
        assert_eq!(
            request(&mut good, RequestKind::Read, t.all.1.key, 0, 8).status,
            Status::Ok
        );
        assert_eq!(t.backend.counters().framing_errors, 2);
    }

    /// A length field of `u64::MAX` behind a request whose answer is still
    /// buffered: the server's flush accounting must not overflow (it used
    /// to add the raw field before decoding it); the header is a framing
    /// error like any other.
    #[test]
    fn a_maximal_length_field_is_a_framing_error_not_an_overflow() {
        let t = target();
        let write = Request {
            kind: RequestKind::Write,
            key: t.all.1.key,
            tag: 7,
            offset: 0,
            len: 8,
        };
        let mut huge = Request {
            kind: RequestKind::Write,
            key: t.all.1.key,
            tag: 8,
            offset: 0,
            len: 0,
        }
        .encode();
        huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut bytes = write.encode().to_vec();
        bytes.extend_from_slice(&[1; 8]);
        bytes.extend_from_slice(&huge);
        let mut s = authed(&t.ep);
        s.write_all(&bytes).unwrap();
        drain(s);
        assert_eq!(t.backend.counters().framing_errors, 1);
        assert_eq!(t.all.0.to_vec().unwrap()[..8], [1; 8]);
    }

    /// Sends `n` NOTIFY frames of `len` bytes back to back (nobody polls
    /// the target meanwhile), then reads their answers.
    fn notify_flood(s: &mut TcpStream, n: u64, len: u64) -> Vec<Status> {
        let payload = vec![0x5a; len as usize];
        let mut w = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            for tag in 0..n {
                let req = Request {
                    kind: RequestKind::Notify,
                    key: RemoteKey(0),
                    tag,
                    offset: 0,
                    len,
                };
                w.write_all(&req.encode()).unwrap();
                w.write_all(&payload).unwrap();
            }
        });
        let statuses = (0..n)
            .map(|tag| {
                let mut h = [0u8; RESPONSE_LEN];
                s.read_exact(&mut h).unwrap();
                let resp = Response::decode(&h).unwrap();
                assert_eq!(resp.tag, tag);
                resp.status
            })
            .collect();
        writer.join().unwrap();
        statuses
    }

    /// A peer flooding 64 KiB notifications at a target whose application
    /// takes none: the target holds at most its byte cap (64 MiB by
    /// default, 1,024 of them) and answers the rest with an error.
    #[test]
    fn a_notification_flood_stops_at_the_queue_cap() {
        let mut t = target();
        let mut s = authed(&t.ep);
        let statuses = notify_flood(&mut s, 1100, 64 << 10);
        let ok = statuses.iter().filter(|&&st| st == Status::Ok).count();
        assert_eq!(ok, 1024, "notifications held past the 64 MiB cap");
        assert!(
            statuses[1024..]
                .iter()
                .all(|&st| st == Status::NotifyQueueFull),
            "{:?}",
            &statuses[1024..1030]
        );
        let c = t.backend.counters();
        assert_eq!((c.notifications, c.refused_notify_queue_full), (1024, 76));
        let mut notes = Vec::new();
        assert_eq!(t.backend.poll_notifications(&mut notes), 1024);
        // Taken: room again, on the same connection.
        let again = notify_flood(&mut s, 1, 64 << 10);
        assert_eq!(again, [Status::Ok]);
    }

    /// The count cap holds for small notifications, and an empty queue
    /// takes a notification larger than the byte cap.
    #[test]
    fn small_notifications_stop_at_the_count_cap() {
        let mut backend = TcpBackend::new(TcpConfig {
            max_notifications: 16,
            max_notification_bytes: 1000,
            ..TcpConfig::default()
        })
        .unwrap();
        let (_, endpoint) = backend.prepare_peer().unwrap();
        let ep = TcpEndpoint::from_endpoint(&endpoint).unwrap();
        let mut s = authed(&ep);
        let statuses = notify_flood(&mut s, 40, 8);
        let ok = statuses.iter().filter(|&&st| st == Status::Ok).count();
        assert_eq!(ok, 16, "{statuses:?}");
        assert!(statuses[16..]
            .iter()
            .all(|&st| st == Status::NotifyQueueFull));
        assert_eq!(backend.counters().refused_notify_queue_full, 24);
        let mut notes = Vec::new();
        assert_eq!(backend.poll_notifications(&mut notes), 16);
        // 64 KiB > 1000 bytes, yet an empty queue takes it; the next not.
        assert_eq!(
            notify_flood(&mut s, 2, 64 << 10),
            [Status::Ok, Status::NotifyQueueFull]
        );
    }

    /// One peer cannot fill the queue for every peer: with two peers each
    /// holds at most its share (half), so the other's notification is
    /// still taken while the flooder's are refused.
    #[test]
    fn a_flooding_peer_holds_only_its_share_of_the_notification_queue() {
        let mut backend = TcpBackend::new(TcpConfig {
            max_notifications: 16,
            ..TcpConfig::default()
        })
        .unwrap();
        let (_, flooder) = backend.prepare_peer().unwrap();
        let (_, other) = backend.prepare_peer().unwrap();
        let mut f = authed(&TcpEndpoint::from_endpoint(&flooder).unwrap());
        let mut o = authed(&TcpEndpoint::from_endpoint(&other).unwrap());
        let statuses = notify_flood(&mut f, 40, 8);
        let ok = statuses.iter().filter(|&&st| st == Status::Ok).count();
        println!("the flooder got {ok} of 40 notifications queued (cap 16, 2 peers)");
        assert_eq!(ok, 8, "{statuses:?}");
        assert_eq!(notify_flood(&mut o, 8, 8), [Status::Ok; 8]);
        // Its share is used up too; the queue is full.
        assert_eq!(notify_flood(&mut o, 1, 8), [Status::NotifyQueueFull]);
        let mut notes = Vec::new();
        assert_eq!(backend.poll_notifications(&mut notes), 16);
        // Taken: each peer has its share again.
        assert_eq!(notify_flood(&mut f, 1, 8), [Status::Ok]);
        assert_eq!(notify_flood(&mut o, 1, 8), [Status::Ok]);
    }
}

/// Stalled and broken targets, faked with plain sockets.
mod faults {
    use kvlane_data::conformance::collect;
    use kvlane_data::tcp::wire::{Challenge, HELLO_ACK, HELLO_LEN};
    use kvlane_data::{
        connect_pair, Access, Backend, Descriptor, Op, Region, RemoteDescriptor, RemoteKey,
        RemoteRegion, TcpBackend, TcpConfig, TcpEndpoint, Transfer,
    };
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    const LEN: u64 = 4 << 20;

    /// A fake target that authenticates every stream, then hands each
    /// accepted socket to `behave`.
    fn fake_target(behave: fn(TcpStream)) -> (TcpEndpoint, RemoteRegion) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let ep = TcpEndpoint {
            addr,
            listen: addr,
            token: [5; 16],
        };
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                let mut hello = [0u8; HELLO_LEN];
                if s.write_all(&Challenge::fresh().encode()).is_ok()
                    && s.read_exact(&mut hello).is_ok()
                    && s.write_all(&HELLO_ACK).is_ok()
                    && kvlane_data::tcp::wire::answer_fence(&mut s).is_ok()
                {
                    std::thread::spawn(move || behave(s));
                }
            }
        });
        let ad = RemoteRegion {
            key: RemoteKey(1),
            addr: 0,
            len: LEN,
            access: Access::ALL,
        };
        (ep, ad)
    }

    fn initiator(ep: &TcpEndpoint, ad: RemoteRegion) -> (TcpBackend, kvlane_data::PeerId, Region) {
        let mut b = TcpBackend::new(TcpConfig::default()).unwrap();
        let local = Region::alloc(LEN as usize, Access::ALL).unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
        (b, peer, local)
    }

    /// The I/O thread that reads a transfer's last answer resolves its
    /// handle (polling the backend itself), not a progress thread it
    /// would wake: one thread hop less between the bytes and the waiter.
    #[test]
    fn an_io_thread_resolves_the_transfers_it_finishes() {
        use kvlane_data::tcp::wire::{Request, Response, Status, REQUEST_LEN};
        use kvlane_data::Transport;
        // Each WRITE answered 20 ms after its bytes: by then `submit` has
        // long let the backend go, so where the answer is handled does not
        // hang on how the submitting thread was scheduled (in CI, a
        // preempted submitter still held the lock as a real target's
        // answer came: all 20 went to the progress thread).
        let (ep, ad) = fake_target(|mut s| {
            let mut h = [0u8; REQUEST_LEN];
            let mut sink = vec![0u8; 1 << 20];
            while s.read_exact(&mut h).is_ok() {
                let Ok(req) = Request::decode(&h) else { return };
                let mut left = req.payload_len() as usize;
                while left > 0 {
                    let n = left.min(sink.len());
                    if s.read_exact(&mut sink[..n]).is_err() {
                        return;
                    }
                    left -= n;
                }
                std::thread::sleep(Duration::from_millis(20));
                let resp = Response {
                    status: Status::Ok,
                    tag: req.tag,
                };
                if s.write_all(&resp.encode()).is_err() {
                    return;
                }
            }
        });
        // I/O threads of its own (pools are keyed by thread count; no
        // other test here asks for 5): the default pool is shared with
        // the tests running beside this one, whose traffic would lengthen
        // the turns of the threads this one's answers arrive on.
        let mut b = TcpBackend::new(TcpConfig {
            io_threads: 5,
            ..TcpConfig::default()
        })
        .unwrap();
        let local = Region::from_vec(vec![7u8; 256 << 10], Access::ALL).unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
        let init = Transport::new(b).unwrap();
        let mut threads = Vec::new();
        for _ in 0..20 {
            // Large enough to be sent from `submit`: no progress thread
            // is woken on the way out either.
            let t = write(peer, &local, ad.key, 0, 256 << 10);
            let (tx, rx) = std::sync::mpsc::channel();
            let mut h = init
                .submit_then(
                    t,
                    Box::new(move |_| {
                        let name = std::thread::current().name().map(str::to_owned);
                        let _ = tx.send(name.unwrap_or_default());
                    }),
                )
                .unwrap();
            h.wait_timeout(Duration::from_secs(10))
                .expect("no result within 10 s")
                .expect("256 KiB write");
            threads.push(rx.recv().unwrap());
        }
        // A progress thread may get to one first now and then (its
        // re-poll); never to all of them.
        assert!(
            threads.iter().any(|n| n.starts_with("kvlane-tcp-init")),
            "every transfer was resolved elsewhere: {threads:?}"
        );
    }

    pub(super) fn write(
        peer: kvlane_data::PeerId,
        local: &Region,
        key: RemoteKey,
        off: u64,
        len: u64,
    ) -> Transfer {
        Transfer::new(
            peer,
            Op::Write,
            vec![Descriptor {
                region: local.id(),
                offset: off,
                len,
            }],
            vec![RemoteDescriptor {
                key,
                offset: off,
                len,
            }],
        )
    }

    /// Marker bytes that reached the fake target of
    /// `a_timed_out_write_sends_nothing_read_after_its_timeout`.
    static MARKERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static STALLED_CONNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A WRITE that times out while its payload is still staged for the
    /// socket (the target stopped reading): the caller reuses its buffer
    /// once told of the timeout, and none of the new bytes may reach the
    /// target. The stream is aborted, so the peer's other transfers fail
    /// at once with `PeerLost` (not at their deadlines), and connecting
    /// again serves later transfers.
    #[test]
    fn a_timed_out_write_sends_nothing_read_after_its_timeout() {
        use kvlane_data::tcp::wire::{Request, RequestKind, Response, Status, REQUEST_LEN};
        use std::sync::atomic::Ordering;
        const BIG: u64 = 16 << 20;
        const MARK: u8 = 0xee;
        // The first connection's streams stall for 1.5 s, then read every
        // request and count marker bytes; later ones answer every request.
        let (ep, ad) = fake_target(|mut s| {
            let stalled = STALLED_CONNS.fetch_add(1, Ordering::SeqCst) < 4;
            if stalled {
                std::thread::sleep(Duration::from_millis(1500));
            }
            let mut h = [0u8; REQUEST_LEN];
            while s.read_exact(&mut h).is_ok() {
                let Ok(req) = Request::decode(&h) else { return };
                let mut payload = vec![0u8; req.payload_len() as usize];
                if s.read_exact(&mut payload).is_err() {
                    return;
                }
                let marks = payload.iter().filter(|&&b| b == MARK).count();
                MARKERS.fetch_add(marks as u64, Ordering::SeqCst);
                if !stalled {
                    let resp = Response {
                        status: Status::Ok,
                        tag: req.tag,
                    };
                    if s.write_all(&resp.encode()).is_err() {
                        return;
                    }
                    if req.kind == RequestKind::Read {
                        let _ = s.write_all(&vec![0; req.len as usize]);
                    }
                }
            }
        });
        let ad = RemoteRegion { len: BIG, ..ad };
        // Small socket buffers: most of the payload stays staged.
        let mut b = TcpBackend::new(TcpConfig {
            socket_buffer: Some(128 << 10),
            ..TcpConfig::default()
        })
        .unwrap();
        let local = Region::from_vec(vec![0x11; BIG as usize], Access::ALL).unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
        let start = Instant::now();
        let big = write(peer, &local, ad.key, 0, BIG - 4096)
            .with_deadline(start + Duration::from_millis(200));
        let other = write(peer, &local, ad.key, BIG - 4096, 4096)
            .with_deadline(start + Duration::from_secs(30));
        let ids = [big.id, other.id];
        b.submit(big).unwrap();
        b.submit(other).unwrap();
        let mut results = HashMap::new();
        let mut done = Vec::new();
        while results.len() < 2 {
            assert!(start.elapsed() < Duration::from_secs(10), "{results:?}");
            b.poll(&mut done);
            for c in done.drain(..) {
                if c.id == ids[0] {
                    assert!(c.result.as_ref().is_err_and(|e| e.is_timeout()), "{c:?}");
                    // Told it failed: the caller reuses its buffer.
                    local.write(0, &vec![MARK; BIG as usize]).unwrap();
                }
                results.insert(c.id, (c.result, start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let (r, at) = &results[&ids[1]];
        let e = r
            .as_ref()
            .expect_err("the other transfer on the aborted stream");
        assert!(e.is_peer_lost(), "{e}");
        assert!(
            *at < Duration::from_secs(2),
            "the other transfer waited {at:?}"
        );
        // The stalled streams read again now; nothing read after the
        // timeout may arrive.
        std::thread::sleep(Duration::from_millis(2000));
        assert_eq!(
            MARKERS.load(Ordering::SeqCst),
            0,
            "a timed-out WRITE sent bytes late"
        );
        // Connecting again: later transfers go through.
        b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
        local.write(0, &[0x22; 4096]).unwrap();
        let again = write(peer, &local, ad.key, 0, 4096);
        let id = again.id;
        b.submit(again).unwrap();
        let r = collect(&mut b, &[id], Duration::from_secs(10));
        assert!(r[&id].0.is_ok(), "{:?}", r[&id].0);
    }

    /// A target that reads requests and never answers: the transfers time
    /// out, and their local regions are let go promptly (nothing of them
    /// waits for answers that will not come), so a region deregistered and
    /// dropped by the caller is released.
    #[test]
    fn timed_out_transfers_release_their_regions_behind_a_silent_target() {
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let mut b = TcpBackend::new(TcpConfig::default()).unwrap();
        let tracker = std::sync::Arc::new(());
        let buf: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
        // SAFETY: the buffer is leaked, so it outlives every clone.
        let local = unsafe {
            Region::from_raw(
                buf.as_mut_ptr(),
                buf.len(),
                kvlane_data::MemoryKind::Host,
                Access::ALL,
                Some(Box::new(tracker.clone())),
            )
        }
        .unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
        for _ in 0..5 {
            let deadline = Instant::now() + Duration::from_millis(1);
            let ids: Vec<_> = (0..400u64)
                .map(|i| {
                    let off = (i % 256) * 4096;
                    let t = Transfer::new(
                        peer,
                        Op::Read,
                        vec![Descriptor {
                            region: local.id(),
                            offset: off,
                            len: 4096,
                        }],
                        vec![RemoteDescriptor {
                            key: ad.key,
                            offset: off,
                            len: 4096,
                        }],
                    )
                    .with_deadline(deadline);
                    let id = t.id;
                    b.submit(t).unwrap();
                    id
                })
                .collect();
            let results = collect(&mut b, &ids, Duration::from_secs(10));
            assert!(results
                .values()
                .all(|(r, _)| r.as_ref().is_err_and(|e| e.is_timeout())));
        }
        b.deregister(local.id()).unwrap();
        drop(local);
        let end = Instant::now() + Duration::from_secs(2);
        while std::sync::Arc::strong_count(&tracker) > 1 {
            assert!(
                Instant::now() < end,
                "timed-out transfers still hold the region ({} references)",
                std::sync::Arc::strong_count(&tracker) - 1
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // The connection was not torn down for it.
        assert!(b.initiator_streams() > 0);
    }

    #[test]
    fn stalled_target_times_out_at_the_deadline() {
        // Reads everything, answers nothing.
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let start = Instant::now();
        let deadline = start + Duration::from_millis(300);
        let ids: Vec<_> = (0..8)
            .map(|i| {
                let t = write(peer, &local, ad.key, i * 4096, 4096).with_deadline(deadline);
                let id = t.id;
                b.submit(t).unwrap();
                id
            })
            .collect();
        let results = collect(&mut b, &ids, Duration::from_secs(10));
        for (id, (r, at)) in &results {
            let e = r
                .as_ref()
                .expect_err("a stalled target completed a transfer");
            assert!(e.is_timeout(), "{id}: {e}");
            assert!(*at >= deadline, "{id} timed out early");
            assert!(
                *at < deadline + Duration::from_secs(1),
                "{id} timed out late"
            );
        }
        assert_eq!(b.in_flight(), 0);
    }

    /// The driver is woken after a submission only for what only `poll`
    /// moves on: a failure queued by `submit`, a deadline sooner than the
    /// driver's longest sleep, or the first deadline of an idle backend
    /// (its driver sleeps until woken). Every chunk, large or small, goes
    /// to its stream from `submit` itself.
    #[test]
    fn poll_after_submit_says_what_only_poll_moves() {
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let far = Instant::now() + Duration::from_secs(30);
        b.submit(write(peer, &local, ad.key, 0, 1 << 20).with_deadline(far))
            .unwrap();
        assert!(
            b.poll_after_submit(),
            "the first deadline of an idle backend asks for no poll"
        );
        b.submit(write(peer, &local, ad.key, 0, 1 << 20).with_deadline(far))
            .unwrap();
        assert!(!b.poll_after_submit(), "a 1 MiB write waits for a poll");
        b.submit(write(peer, &local, ad.key, 0, 4096).with_deadline(far))
            .unwrap();
        assert!(!b.poll_after_submit(), "a 4 KiB write waits for a poll");
        let soon = Instant::now() + Duration::from_millis(10);
        b.submit(write(peer, &local, ad.key, 0, 1 << 20).with_deadline(soon))
            .unwrap();
        assert!(b.poll_after_submit(), "a 10 ms deadline asks for no poll");
        // Past the remote region: failed by `submit`, delivered by `poll`.
        b.submit(write(peer, &local, ad.key, LEN - 4096, 8192).with_deadline(far))
            .unwrap();
        assert!(b.poll_after_submit(), "a queued failure asks for no poll");
    }

    /// `submit_batch` answers for the whole batch what `poll_after_submit`
    /// answers for one submission.
    #[test]
    fn a_batch_asks_for_a_poll_when_any_of_it_needs_one() {
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let far = Instant::now() + Duration::from_secs(30);
        let mut results = Vec::new();
        // The first deadline of an idle backend asks for a poll (its
        // driver sleeps until woken); the batches after it need none.
        let first = vec![write(peer, &local, ad.key, 0, 4096).with_deadline(far)];
        assert!(b.submit_batch(first, &mut results));
        results.clear();
        let quiet = (0..4)
            .map(|k| write(peer, &local, ad.key, k * 4096, 4096).with_deadline(far))
            .collect();
        assert!(
            !b.submit_batch(quiet, &mut results),
            "small writes with far deadlines wait for no poll"
        );
        assert_eq!(results.len(), 4);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        results.clear();
        // A queued failure first, then a write that needs no poll: the
        // batch still asks for one.
        let mixed = vec![
            write(peer, &local, ad.key, LEN - 4096, 8192).with_deadline(far),
            write(peer, &local, ad.key, 0, 4096).with_deadline(far),
        ];
        assert!(
            b.submit_batch(mixed, &mut results),
            "a queued failure in a batch asks for no poll"
        );
        assert_eq!(results.len(), 2);
    }

    /// Small chunks reach the target with no `poll` after their `submit`
    /// (nothing is left staged for a driver that is not woken).
    #[test]
    fn small_writes_reach_the_target_without_a_poll() {
        use kvlane_data::tcp::wire::{Request, REQUEST_LEN};
        use std::sync::mpsc::Sender;
        use std::sync::{Mutex, OnceLock};
        // What the fake target saw (it is a plain `fn`: a static carries
        // the channel).
        static TX: OnceLock<Mutex<Sender<u64>>> = OnceLock::new();
        let (tx, seen) = std::sync::mpsc::channel::<u64>();
        assert!(TX.set(Mutex::new(tx)).is_ok(), "set once");
        let (ep, ad) = fake_target(|mut s| {
            let mut h = [0u8; REQUEST_LEN];
            while s.read_exact(&mut h).is_ok() {
                let Ok(req) = Request::decode(&h) else { return };
                let mut payload = vec![0u8; req.payload_len() as usize];
                if s.read_exact(&mut payload).is_err() {
                    return;
                }
                if let Some(tx) = TX.get() {
                    let _ = tx.lock().unwrap().send(req.len);
                }
            }
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let far = Instant::now() + Duration::from_secs(30);
        for k in 0..3u64 {
            b.submit(write(peer, &local, ad.key, k * 4096, 4096).with_deadline(far))
                .unwrap();
        }
        for _ in 0..3 {
            let len = seen
                .recv_timeout(Duration::from_secs(10))
                .expect("a 4 KiB write never reached the target without a poll");
            assert_eq!(len, 4096);
        }
    }

    /// Through a `Transport`: a large transfer, whose submission wakes
    /// nobody, still times out at its deadline against a stalled target
    /// (the driver's own schedule notices it).
    #[test]
    fn an_unwoken_large_transfer_still_times_out_through_a_transport() {
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let (b, peer, local) = initiator(&ep, ad);
        let t = kvlane_data::Transport::new(b).unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut h = t
            .submit(write(peer, &local, ad.key, 0, 1 << 20).with_deadline(deadline))
            .unwrap();
        let r = h
            .wait_timeout(Duration::from_secs(10))
            .expect("no result 10 s after a 200 ms deadline");
        assert!(r.as_ref().is_err_and(|e| e.is_timeout()), "{r:?}");
        assert!(Instant::now() >= deadline, "timed out early");
    }

    /// A READ answered after its deadline: the timeout is reported at the
    /// deadline and the late payload never reaches local memory (the
    /// caller may already reuse it).
    #[test]
    fn a_read_that_timed_out_does_not_land_late() {
        use kvlane_data::tcp::wire::{Request, Response, Status, REQUEST_LEN};
        let (ep, ad) = fake_target(|mut s| {
            let mut h = [0u8; REQUEST_LEN];
            while s.read_exact(&mut h).is_ok() {
                let Ok(req) = Request::decode(&h) else { return };
                std::thread::sleep(Duration::from_millis(400));
                let resp = Response {
                    status: Status::Ok,
                    tag: req.tag,
                };
                let _ = s.write_all(&resp.encode());
                let _ = s.write_all(&vec![0xab; req.len as usize]);
            }
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let deadline = Instant::now() + Duration::from_millis(100);
        let ids: Vec<_> = [4096u64, 256 << 10]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let off = i as u64 * (1 << 20);
                let t = Transfer::new(
                    peer,
                    Op::Read,
                    vec![Descriptor {
                        region: local.id(),
                        offset: off,
                        len,
                    }],
                    vec![RemoteDescriptor {
                        key: ad.key,
                        offset: off,
                        len,
                    }],
                )
                .with_deadline(deadline);
                let id = t.id;
                b.submit(t).unwrap();
                id
            })
            .collect();
        let results = collect(&mut b, &ids, Duration::from_secs(10));
        for (id, (r, _)) in &results {
            assert!(r.as_ref().is_err_and(|e| e.is_timeout()), "{id}: {r:?}");
        }
        // The answers arrive about 300 ms after the deadline.
        std::thread::sleep(Duration::from_millis(900));
        let mut sink = Vec::new();
        b.poll(&mut sink);
        assert!(
            local.to_vec().unwrap().iter().all(|&x| x == 0),
            "a late READ reply was written into local memory after its timeout"
        );
    }

    #[test]
    fn broken_connection_fails_only_that_peer_promptly() {
        // Closes each stream after reading a little.
        let (ep, ad) = fake_target(|mut s| {
            let mut buf = [0u8; 100];
            let _ = s.read_exact(&mut buf);
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        // A healthy second peer on the same initiator.
        let mut good = TcpBackend::new(TcpConfig::default()).unwrap();
        let remote = Region::alloc(LEN as usize, Access::ALL).unwrap();
        let remote_ad = good.register(&remote).unwrap();
        let (good_peer, _) = connect_pair(&mut b, &[], &mut good, &[remote_ad]).unwrap();

        let start = Instant::now();
        let mut ids = Vec::new();
        for i in 0..32 {
            let t = write(peer, &local, ad.key, i * 65_536, 65_536);
            ids.push(t.id);
            b.submit(t).unwrap();
        }
        let mut good_ids = Vec::new();
        for i in 0..32 {
            let t = write(good_peer, &local, remote_ad.key, i * 65_536, 65_536);
            good_ids.push(t.id);
            b.submit(t).unwrap();
        }
        let all: Vec<_> = ids.iter().chain(&good_ids).copied().collect();
        let results = collect(&mut b, &all, Duration::from_secs(20));
        for id in &ids {
            let (r, at) = &results[id];
            let e = r.as_ref().expect_err("a broken peer completed a transfer");
            assert!(e.is_peer_lost(), "{id}: {e}");
            assert!(
                *at - start < Duration::from_secs(5),
                "PeerLost took {:?} (deadline is 30 s)",
                *at - start
            );
            assert!(e.to_string().contains("peer#"), "{e}");
        }
        for id in &good_ids {
            assert!(results[id].0.is_ok(), "{id}: {:?}", results[id].0);
        }
        assert!(
            remote.to_vec().unwrap()[..(32 * 65_536)] == local.to_vec().unwrap()[..(32 * 65_536)]
        );
        // The failed connection was fenced with a new one that took its
        // place (this target accepts connections): new transfers to the
        // peer go there, and fail promptly as that one breaks too.
        let t = write(peer, &local, ad.key, 0, 65_536);
        let id = t.id;
        b.submit(t).unwrap();
        let r = collect(&mut b, &[id], Duration::from_secs(5));
        assert!(r[&id].0.as_ref().is_err_and(|e| e.is_peer_lost()));
    }

    #[test]
    fn remove_peer_fails_in_flight_transfers_at_once() {
        let (ep, ad) = fake_target(|mut s| {
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let (mut b, peer, local) = initiator(&ep, ad);
        let ids: Vec<_> = (0..16)
            .map(|i| {
                let t = write(peer, &local, ad.key, i * 4096, 4096);
                let id = t.id;
                b.submit(t).unwrap();
                id
            })
            .collect();
        let removed = Instant::now();
        b.remove_peer(peer);
        let results = collect(&mut b, &ids, Duration::from_secs(10));
        for (id, (r, at)) in &results {
            assert!(r.as_ref().is_err_and(|e| e.is_peer_lost()), "{id}: {r:?}");
            assert!(*at - removed < Duration::from_secs(1));
        }
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn peer_lost_error_names_the_address() {
        let (ep, ad) = fake_target(drop);
        let (mut b, peer, local) = initiator(&ep, ad);
        let t = write(peer, &local, ad.key, 0, 4096);
        let id = t.id;
        b.submit(t).unwrap();
        let r = collect(&mut b, &[id], Duration::from_secs(10));
        let e = r[&id]
            .0
            .as_ref()
            .expect_err("closed target completed a transfer");
        assert!(e.is_peer_lost(), "{e}");
        let chain = format!(
            "{e}: {}",
            std::error::Error::source(e)
                .map(|s| s.to_string())
                .unwrap_or_default()
        );
        assert!(chain.contains(&ep.addr.to_string()), "{chain}");
    }
}

/// The waker-driven [`Transport`](kvlane_data::Transport) on tcp.
mod transport {
    use kvlane_data::{
        connect_pair, Access, Backend, Descriptor, Op, Region, RemoteDescriptor, TcpBackend,
        TcpConfig, Transfer, Transport,
    };
    use std::time::Duration;

    #[test]
    fn transport_completes_and_delivers_notifications() {
        let mut init = TcpBackend::new(TcpConfig::default()).unwrap();
        let mut target = TcpBackend::new(TcpConfig::default()).unwrap();
        let src =
            Region::from_vec((0..=255u8).cycle().take(1 << 20).collect(), Access::ALL).unwrap();
        let dst = Region::alloc(1 << 20, Access::ALL).unwrap();
        let src_ad = init.register(&src).unwrap();
        let dst_ad = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad]).unwrap();
        let init = Transport::new(init).unwrap();
        let target = Transport::new(target).unwrap();
        let mut notes = target.take_notifications().unwrap();
        let handles: Vec<_> = (0..16u64)
            .map(|i| {
                let t = Transfer::new(
                    peer,
                    Op::Write,
                    vec![Descriptor {
                        region: src.id(),
                        offset: i << 16,
                        len: 1 << 16,
                    }],
                    vec![RemoteDescriptor {
                        key: dst_ad.key,
                        offset: i << 16,
                        len: 1 << 16,
                    }],
                )
                .with_notify(vec![i as u8]);
                init.submit(t).unwrap()
            })
            .collect();
        for h in handles {
            h.wait().expect("transfer over Transport");
        }
        assert!(dst.to_vec().unwrap() == src.to_vec().unwrap());
        let mut got = Vec::new();
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 16 {
            match notes.try_recv() {
                Ok(n) => got.push(n.payload[0]),
                Err(_) => {
                    assert!(std::time::Instant::now() < end, "notifications missing");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        got.sort_unstable();
        assert_eq!(got, (0..16).collect::<Vec<u8>>());
    }
}

/// A target whose application does not take its notifications: past
/// the caps, the initiator's transfers fail with a typed error (none is
/// lost silently), and once the application drains them notifications
/// flow again.
mod notify_queue {
    use kvlane_data::{
        connect_pair, Access, Backend, DataError, Descriptor, Op, Region, RemoteDescriptor,
        TcpBackend, TcpConfig, Transfer, Transport, NOTIFY_CHANNEL,
    };
    use std::time::{Duration, Instant};

    /// The target backend's queue: large enough that its driver, woken by
    /// the first notification of a burst, moves them on before it fills
    /// (a burst larger than it between two polls would be refused early).
    const CAP: usize = 256;

    #[test]
    fn a_notification_past_the_cap_fails_the_transfer_typed() {
        let mut init = TcpBackend::new(TcpConfig::default()).unwrap();
        let mut target = TcpBackend::new(TcpConfig {
            max_notifications: CAP,
            ..TcpConfig::default()
        })
        .unwrap();
        let src = Region::from_vec(vec![3; 4096], Access::ALL).unwrap();
        let dst = Region::alloc(4096, Access::ALL).unwrap();
        let src_ad = init.register(&src).unwrap();
        let dst_ad = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad]).unwrap();
        let target_addr = target.local_addr();
        let init = Transport::new(init).unwrap();
        let target = Transport::new(target).unwrap();
        let mut notes = target.take_notifications().unwrap();
        let t = |i: u32| {
            Transfer::new(
                peer,
                Op::Write,
                vec![Descriptor {
                    region: src.id(),
                    offset: 0,
                    len: 64,
                }],
                vec![RemoteDescriptor {
                    key: dst_ad.key,
                    offset: 0,
                    len: 64,
                }],
            )
            .with_notify(i.to_le_bytes().to_vec())
        };
        // More than the channel and the backend's queue hold together
        // (one poll's worth, at most `CAP`, may wait between them).
        let n = (NOTIFY_CHANNEL + 3 * CAP) as u32;
        let handles: Vec<_> = (0..n).map(|i| init.submit(t(i)).unwrap()).collect();
        let (mut ok, mut full) = (0usize, 0usize);
        for h in handles {
            match h.wait() {
                Ok(()) => ok += 1,
                Err(e @ DataError::NotificationQueueFull { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains(&peer.to_string()), "{msg}");
                    assert!(msg.contains(&target_addr.to_string()), "{msg}");
                    assert!(msg.contains("notification queue is full"), "{msg}");
                    assert!(e.is_busy());
                    full += 1;
                }
                Err(e) => panic!("unexpected error: {e}"),
            }
        }
        assert!(full > 0, "no notification was refused ({ok} delivered)");
        assert!(ok <= NOTIFY_CHANNEL + 2 * CAP, "{ok} held unread");
        let refused = target.with_backend(|b| b.tcp_counters().unwrap().refused_notify_queue_full);
        assert_eq!(refused, full as u64);
        // Every accepted notification reaches the application, once.
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        while got.len() < ok {
            match notes.try_recv() {
                Ok(note) => got.push(note),
                Err(_) => {
                    assert!(Instant::now() < end, "{} of {ok} arrived", got.len());
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        assert!(notes.try_recv().is_err(), "a refused notification arrived");
        // Drained: notifications work again.
        init.submit(t(u32::MAX)).unwrap().wait().unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let note = loop {
            if let Ok(note) = notes.try_recv() {
                break note;
            }
            assert!(
                Instant::now() < end,
                "the notification after draining is missing"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(&note.payload[..], &u32::MAX.to_le_bytes());
    }
}

/// Refusals that only the target can make (the initiator's own checks
/// pass because the advertisement is stale or wrong) come back typed.
mod target_refusals {
    use kvlane_data::conformance::collect;
    use kvlane_data::{
        Access, Backend, DataError, Descriptor, Op, Region, RemoteDescriptor, RemoteRegion,
        TcpBackend, TcpConfig, Transfer,
    };
    use std::time::Duration;

    #[test]
    fn wire_refusals_map_to_typed_errors_and_suppress_notifications() {
        let mut init = TcpBackend::new(TcpConfig::default()).unwrap();
        let mut target = TcpBackend::new(TcpConfig::default()).unwrap();
        let local = Region::from_vec(vec![1; 8192], Access::ALL).unwrap();
        init.register(&local).unwrap();
        let ro = Region::alloc(4096, Access::REMOTE_READ).unwrap();
        let gone = Region::alloc(4096, Access::ALL).unwrap();
        let ro_ad = target.register(&ro).unwrap();
        let gone_ad = target.register(&gone).unwrap();
        target.deregister(gone.id()).unwrap();
        // Advertise more than the target grants.
        let lie = RemoteRegion {
            len: 8192,
            access: Access::ALL,
            ..ro_ad
        };
        let (peer, _) = init.prepare_peer().unwrap();
        let (_, ep) = target.prepare_peer().unwrap();
        init.connect_peer(peer, &ep, &[lie, gone_ad]).unwrap();
        let t = |op, key, offset: u64, len: u64| {
            Transfer::new(
                peer,
                op,
                vec![Descriptor {
                    region: local.id(),
                    offset: 0,
                    len,
                }],
                vec![RemoteDescriptor { key, offset, len }],
            )
            .with_notify(&b"must not arrive"[..])
        };
        let cases = [
            t(Op::Write, ro_ad.key, 0, 64),
            t(Op::Read, ro_ad.key, 4000, 200),
            t(Op::Write, gone_ad.key, 0, 64),
        ];
        let ids: Vec<_> = cases.iter().map(|t| t.id).collect();
        for c in cases {
            init.submit(c).unwrap();
        }
        let r = collect(&mut init, &ids, Duration::from_secs(10));
        let err = |i: usize| r[&ids[i]].0.as_ref().expect_err("refused on the wire");
        assert!(
            matches!(err(0), DataError::AccessDenied { op: Op::Write, granted, .. } if *granted == Access::REMOTE_READ),
            "{}",
            err(0)
        );
        assert!(
            matches!(
                err(1),
                DataError::RemoteOutOfBounds {
                    offset: 4000,
                    len: 200,
                    region_len: 4096,
                    ..
                }
            ),
            "{}",
            err(1)
        );
        assert!(
            matches!(err(2), DataError::UnknownKey { key, .. } if *key == gone_ad.key),
            "{}",
            err(2)
        );
        assert_eq!(
            ro.to_vec().unwrap(),
            vec![0; 4096],
            "a refused WRITE landed"
        );
        let mut notes = Vec::new();
        std::thread::sleep(Duration::from_millis(50));
        target.poll_notifications(&mut notes);
        assert!(
            notes.is_empty(),
            "a failed transfer delivered its notification"
        );
        let c = target.counters();
        assert_eq!(
            (
                c.refused_access,
                c.refused_out_of_bounds,
                c.refused_unknown_key
            ),
            (1, 1, 1),
            "{c:?}"
        );
    }
}

/// Connecting through a [`Transport`](kvlane_data::Transport) holds the
/// backend only for the short steps: a peer whose data endpoint accepts but
/// never answers the authentication stalls only its own connect.
mod attach_off_lock {
    use kvlane_data::{
        Access, Backend, Descriptor, Op, Region, RemoteDescriptor, TcpBackend, TcpConfig,
        TcpEndpoint, Transfer, Transport,
    };
    use std::net::TcpListener;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_silent_endpoint_does_not_stall_another_peers_transfers() {
        let config = TcpConfig {
            connect_timeout: Duration::from_secs(3),
            ..TcpConfig::default()
        };
        let mut init = TcpBackend::new(config.clone()).unwrap();
        let mut target = TcpBackend::new(config).unwrap();
        let src = Region::from_vec(vec![0x5a; 128 << 10], Access::ALL).unwrap();
        let dst = Region::alloc(128 << 10, Access::ALL).unwrap();
        init.register(&src).unwrap();
        let dst_ad = target.register(&dst).unwrap();
        let (_, target_ep) = target.prepare_peer().unwrap();
        let transport = std::sync::Arc::new(Transport::new(init).unwrap());
        let (good, _) = transport.connect_peer(&target_ep, &[dst_ad]).unwrap();

        // A data endpoint that accepts connections and never answers them.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_ep = TcpEndpoint {
            addr: silent.local_addr().unwrap(),
            listen: silent.local_addr().unwrap(),
            token: [1; 16],
        }
        .to_endpoint();
        let (done_tx, done_rx) = mpsc::channel();
        let t = transport.clone();
        let dialer = std::thread::spawn(move || {
            let r = t.connect_peer(&silent_ep, &[]);
            let _ = done_tx.send(());
            r
        });
        // Wait until the dial is inside its authentication read.
        let (_held, _) = silent.accept().unwrap();

        for i in 0..20u64 {
            let w = Transfer::new(
                good,
                Op::Write,
                vec![Descriptor {
                    region: src.id(),
                    offset: 0,
                    len: 4096,
                }],
                vec![RemoteDescriptor {
                    key: dst_ad.key,
                    offset: i * 4096,
                    len: 4096,
                }],
            );
            transport.submit(w).unwrap().wait().unwrap();
        }
        assert!(
            done_rx.try_recv().is_err(),
            "the silent dial finished before the other peer's 20 writes: it was not the one waiting"
        );
        assert_eq!(
            dst.to_vec().unwrap()[..20 * 4096],
            vec![0x5a; 20 * 4096][..]
        );
        let err = dialer.join().unwrap().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&silent.local_addr().unwrap().to_string()),
            "{msg}"
        );
        assert!(msg.contains("authentication"), "{msg}");
    }
}

/// Hostile and stale peers on the target side: per-peer credentials, one
/// auth deadline per connection, caps counted after authentication.
mod hostile {
    use kvlane_data::tcp::wire::{Challenge, Hello, CHALLENGE_LEN, HELLO_ACK};
    use kvlane_data::{Access, Backend, Region, TcpBackend, TcpConfig, TcpEndpoint};
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    fn target(config: TcpConfig) -> TcpBackend {
        TcpBackend::new(config).unwrap()
    }

    fn endpoint(b: &mut TcpBackend) -> (kvlane_data::PeerId, TcpEndpoint) {
        let (peer, ep) = b.prepare_peer().unwrap();
        (peer, TcpEndpoint::from_endpoint(&ep).unwrap())
    }

    /// The challenge a fresh connection is sent first (`None`: closed
    /// before it came).
    fn challenge(s: &mut TcpStream) -> Option<Challenge> {
        let mut c = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut c).ok()?;
        Challenge::decode(&c).ok()
    }

    /// Proves `token`; `Some(stream)` when acknowledged, `None` when the
    /// target closed the connection instead.
    fn hello(ep: &TcpEndpoint, token: [u8; 16]) -> Option<TcpStream> {
        let mut s = TcpStream::connect(ep.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let c = challenge(&mut s)?;
        s.write_all(&Hello::answer(&c, &token).encode()).ok()?;
        let mut ack = [0u8; HELLO_ACK.len()];
        match s.read_exact(&mut ack) {
            Ok(()) => {
                assert_eq!(ack, HELLO_ACK);
                Some(s)
            }
            Err(_) => None,
        }
    }

    /// Presents `ep`'s own token until a slot freed a moment ago is seen
    /// (the target notices a close on its next turn); bounded to 5 s.
    fn hello_once_freed(ep: &TcpEndpoint) -> TcpStream {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(s) = hello(ep, ep.token) {
                return s;
            }
            assert!(Instant::now() < until, "the freed slot was never reused");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the target closes `s` within `within`.
    fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        s.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => true,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => true,
            _ => false,
        }
    }

    #[test]
    fn credentials_are_per_peer_and_revoked_with_the_peer() {
        let mut b = target(TcpConfig::default());
        let (p1, ep1) = endpoint(&mut b);
        let (_p2, ep2) = endpoint(&mut b);
        assert_ne!(ep1.token, ep2.token, "two peers got the same credential");
        let mut s1 = hello(&ep1, ep1.token).expect("peer 1's credential refused");
        let mut s2 = hello(&ep2, ep2.token).expect("peer 2's credential refused");
        b.remove_peer(p1);
        assert!(
            closed_within(&mut s1, Duration::from_secs(5)),
            "a removed peer's connection stayed open"
        );
        assert!(
            hello(&ep1, ep1.token).is_none(),
            "a revoked credential was accepted"
        );
        assert!(
            !closed_within(&mut s2, Duration::from_millis(200)),
            "another peer's connection was closed"
        );
        assert!(hello(&ep2, ep2.token).is_some());
        let c = b.counters();
        assert_eq!(c.connections_revoked, 1, "{c:?}");
        assert_eq!(c.auth_failures, 1, "{c:?}");
    }

    #[test]
    fn a_restarted_target_refuses_the_old_credentials() {
        let mut old = target(TcpConfig::default());
        let (_, ep) = endpoint(&mut old);
        assert!(hello(&ep, ep.token).is_some());
        drop(old);
        let mut new = target(TcpConfig {
            listen: ep.addr,
            ..TcpConfig::default()
        });
        let (_, new_ep) = endpoint(&mut new);
        assert_eq!(new_ep.addr, ep.addr);
        assert!(
            hello(&ep, ep.token).is_none(),
            "the old incarnation's credential was accepted"
        );
        assert!(hello(&new_ep, new_ep.token).is_some());
    }

    /// A hello trickled one byte at a time: a per-read timeout would never
    /// fire; the one deadline per connection closes it.
    #[test]
    fn one_auth_deadline_per_connection() {
        let mut b = target(TcpConfig {
            auth_timeout: Duration::from_millis(300),
            ..TcpConfig::default()
        });
        let (_, ep) = endpoint(&mut b);
        let mut s = TcpStream::connect(ep.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        let c = challenge(&mut s).expect("a challenge");
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut closed = false;
        let bytes = Hello::answer(&c, &ep.token).encode();
        for byte in bytes {
            if s.write_all(&[byte]).is_err() {
                closed = true;
                break;
            }
            let mut ack = [0u8; 8];
            match s.read(&mut ack) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(_) => panic!("a hello trickled past the auth deadline was acknowledged"),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                    closed = true;
                    break;
                }
                Err(_) => {} // timed out: nothing yet
            }
        }
        assert!(closed, "the connection outlived its auth deadline");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        let c = b.counters();
        assert_eq!(c.auth_timeouts, 1, "{c:?}");
    }

    /// Silent connections are capped apart: they never take an
    /// authenticated slot, and a legitimate peer gets in while they sit.
    /// Authenticated connections are counted after the hello.
    #[test]
    fn silent_connections_neither_take_slots_nor_keep_a_peer_out() {
        let mut b = target(TcpConfig {
            max_unauthenticated: 16,
            max_connections: 4,
            io_threads: 2,
            ..TcpConfig::default()
        });
        let (_, ep) = endpoint(&mut b);
        let silent: Vec<TcpStream> = (0..300)
            .map(|_| TcpStream::connect(ep.addr).unwrap())
            .collect();
        let mut authed: Vec<TcpStream> = (0..4)
            .map(|i| hello(&ep, ep.token).unwrap_or_else(|| panic!("stream {i} was refused")))
            .collect();
        assert!(
            hello(&ep, ep.token).is_none(),
            "a fifth authenticated connection was admitted past the cap of 4"
        );
        // A slot freed by a closed connection is reused.
        drop(authed.pop());
        let again = hello_once_freed(&ep);
        let c = b.counters();
        assert!(c.unauthenticated_evicted >= 300 - 16, "{c:?}");
        assert!(c.connections_refused >= 1, "{c:?}");
        drop((silent, authed, again));
    }

    /// One peer's credential holds at most `max_connections_per_peer`
    /// connections: past it its hello is refused, and another peer still
    /// gets in (before, one credential could take every slot of
    /// `max_connections`). A slot it frees is its own to reuse.
    #[test]
    fn one_peer_cannot_take_every_connection_slot() {
        let mut b = target(TcpConfig {
            max_connections: 8,
            max_connections_per_peer: 3,
            io_threads: 2,
            ..TcpConfig::default()
        });
        let (_, ep) = endpoint(&mut b);
        let (_, other) = endpoint(&mut b);
        let mut mine: Vec<TcpStream> = (0..3)
            .map(|i| hello(&ep, ep.token).unwrap_or_else(|| panic!("connection {i} was refused")))
            .collect();
        for _ in 0..5 {
            assert!(
                hello(&ep, ep.token).is_none(),
                "a 4th connection of one peer was admitted past its cap of 3"
            );
        }
        let theirs: Vec<TcpStream> = (0..3)
            .map(|i| {
                hello(&other, other.token)
                    .unwrap_or_else(|| panic!("the other peer's connection {i} was refused"))
            })
            .collect();
        drop(mine.pop());
        let again = hello_once_freed(&ep);
        assert!(b.counters().connections_refused >= 5);
        drop((mine, theirs, again));
    }

    #[test]
    fn region_keys_are_not_sequential() {
        let mut b = target(TcpConfig::default());
        let regions: Vec<Region> = (0..64)
            .map(|_| Region::alloc(64, Access::ALL).unwrap())
            .collect();
        let keys: Vec<u32> = regions
            .iter()
            .map(|r| b.register(r).unwrap().key.0)
            .collect();
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keys.len(), "a key was handed out twice");
        let steps = keys
            .windows(2)
            .filter(|w| w[1] == w[0].wrapping_add(1))
            .count();
        assert!(steps < 4, "keys are guessable: {keys:?}");
        assert!(!keys.contains(&0));
    }
}

/// Requests past what one stream keeps unanswered.
mod many_requests {
    use kvlane_data::conformance::{contents, run_one, setup, transfer, TcpFixture};
    use kvlane_data::{Access, Op};

    /// One transfer of 100,000 separate 64-byte pieces (reversed, so none
    /// merge: 100,000 requests, about 25,000 per stream, past the 8,192 a
    /// stream keeps unanswered): the rest is staged as answers come in,
    /// and every piece lands. (With the cap reached the I/O thread spun in
    /// its send loop without reading the answers, and the transfer hung.)
    #[test]
    fn a_transfer_of_more_requests_than_a_stream_keeps_unanswered_completes() {
        const N: u64 = 100_000;
        const B: u64 = 64;
        let len = (N * B) as usize;
        let mut s = setup(&TcpFixture(|| None), len, len, Access::ALL, 5);
        let pieces: Vec<_> = (0..N).map(|i| (i * B, (N - 1 - i) * B, B)).collect();
        let t = transfer(&s, Op::Write, &pieces);
        run_one(&mut s.init, &mut s.target, t).expect("100,000-request WRITE");
        let (l, r) = (contents(&s.local), contents(&s.remote));
        let b = B as usize;
        for i in 0..N as usize {
            let j = N as usize - 1 - i;
            assert!(
                l[i * b..(i + 1) * b] == r[j * b..(j + 1) * b],
                "piece {i} misplaced"
            );
        }
    }
}

#[path = "support/holding_proxy.rs"]
mod holding_proxy;

/// Issue 41, item 6: bytes of a WRITE that was reported failed never land
/// later, even when the network (here a store-and-forward proxy) still
/// holds them and delivers them seconds after the initiator gave up.
mod fences {
    use kvlane_data::{
        Access, Backend, Completion, DataError, PeerId, Region, RemoteRegion, TcpBackend,
        TcpConfig, TcpEndpoint, Transfer,
    };
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    const LEN: u64 = 64 << 10;
    const SPAN: u64 = 32 << 10;

    use super::holding_proxy::{proxy, Then};

    fn write(peer: PeerId, local: &Region, key: kvlane_data::RemoteKey, len: u64) -> Transfer {
        super::faults::write(peer, local, key, 0, len)
    }

    fn wait(b: &mut TcpBackend, id: kvlane_data::TransferId, within: Duration) -> Completion {
        let end = Instant::now() + within;
        let mut done = Vec::new();
        loop {
            b.poll(&mut done);
            if let Some(i) = done.iter().position(|c| c.id == id) {
                return done.swap_remove(i);
            }
            assert!(Instant::now() < end, "transfer {id:?} did not finish");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn late_bytes_of_a_failed_write_never_land(then: Then) {
        // The target: 64 KiB of 0x11.
        let mut target = TcpBackend::new(TcpConfig::default()).unwrap();
        let remote = Region::from_vec(vec![0x11; LEN as usize], Access::ALL).unwrap();
        let ad: RemoteRegion = target.register(&remote).unwrap();
        let (_, endpoint) = target.prepare_peer().unwrap();
        let ep = TcpEndpoint::from_endpoint(&endpoint).unwrap();
        let p = proxy(ep.addr, then);
        let via_proxy = TcpEndpoint { addr: p.addr, ..ep };
        // The initiator dials through the proxy, one stream.
        let mut init = TcpBackend::new(TcpConfig {
            streams: 1,
            ..TcpConfig::default()
        })
        .unwrap();
        let local = Region::alloc(LEN as usize, Access::ALL).unwrap();
        init.register(&local).unwrap();
        let (peer, _) = init.prepare_peer().unwrap();
        init.connect_peer(peer, &via_proxy.to_endpoint(), &[ad])
            .unwrap();
        // Through the proxy, a first WRITE lands.
        local.fill(0, LEN, 0x22).unwrap();
        let t = write(peer, &local, ad.key, 4096);
        let id = t.id;
        init.submit(t).unwrap();
        assert!(wait(&mut init, id, Duration::from_secs(10)).result.is_ok());
        assert_eq!(remote.to_vec().unwrap()[..4096], [0x22; 4096]);
        // The proxy now holds the stream's bytes: a 32 KiB WRITE of 0xee
        // fails (its deadline passes unanswered, or its connection is
        // reset), and the failure is reported.
        p.hold.store(true, Ordering::SeqCst);
        local.fill(0, LEN, 0xee).unwrap();
        let t = write(peer, &local, ad.key, SPAN)
            .with_deadline(Instant::now() + Duration::from_millis(300));
        let id = t.id;
        init.submit(t).unwrap();
        let c = wait(&mut init, id, Duration::from_secs(10));
        match then {
            Then::Hold => assert!(
                matches!(c.result, Err(DataError::Timeout { .. })),
                "{:?}",
                c.result
            ),
            Then::HoldAndReset => assert!(
                c.result.as_ref().is_err_and(DataError::is_peer_lost),
                "{:?}",
                c.result
            ),
        }
        // (A reset comes after the proxy's first read of it: 16 KiB.)
        let least = if then == Then::Hold { SPAN } else { 4096 };
        assert!(
            p.held.load(Ordering::SeqCst) >= least as usize,
            "the proxy holds the WRITE ({} bytes)",
            p.held.load(Ordering::SeqCst)
        );
        // 3 s later the proxy delivers them, over the connection the
        // target still serves.
        std::thread::sleep(Duration::from_secs(3));
        let fenced_before = target.counters().connections_fenced;
        p.release.store(true, Ordering::SeqCst);
        let end = Instant::now() + Duration::from_secs(10);
        while p.delivered.load(Ordering::SeqCst) == 0
            || target.counters().connections_fenced == fenced_before
        {
            assert!(
                Instant::now() < end,
                "the held bytes were not refused by a fence (delivered {}, counters {:?})",
                p.delivered.load(Ordering::SeqCst),
                target.counters()
            );
            if remote.to_vec().unwrap()[..SPAN as usize].contains(&0xee) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        let now = remote.to_vec().unwrap();
        assert!(
            !now[..SPAN as usize].contains(&0xee),
            "bytes of the failed WRITE landed {} s after its failure was reported",
            3
        );
        assert_eq!(now[..4096], [0x22; 4096]);
        assert_eq!(target.counters().unfenced_failures, 0);
        assert_eq!(init.counters().unfenced_failures, 0);
        // The fence was a new connection that took the failed one's place:
        // newer data goes through without connecting the peer again.
        local.fill(0, LEN, 0x33).unwrap();
        let t = write(peer, &local, ad.key, 4096);
        let id = t.id;
        init.submit(t).unwrap();
        let c = wait(&mut init, id, Duration::from_secs(10));
        assert!(c.result.is_ok(), "{:?}", c.result);
        assert_eq!(remote.to_vec().unwrap()[..4096], [0x33; 4096]);
        drop(init);
        drop(target);
    }

    /// A target that removes the peer (revokes its credential, closes its
    /// connections) with WRITEs in flight: they fail with `PeerLost`, and
    /// the fence that finds the credential refused counts nothing as
    /// unfenced (the target closed every connection of it).
    #[test]
    fn a_peer_removed_by_its_target_is_not_counted_unfenced() {
        let mut target = TcpBackend::new(TcpConfig::default()).unwrap();
        let remote = Region::alloc(64 << 20, Access::ALL).unwrap();
        let ad = target.register(&remote).unwrap();
        let mut init = TcpBackend::new(TcpConfig::default()).unwrap();
        let local = Region::alloc(64 << 20, Access::ALL).unwrap();
        init.register(&local).unwrap();
        let (peer, theirs) = kvlane_data::connect_pair(&mut init, &[], &mut target, &[ad]).unwrap();
        let ids: Vec<_> = (0..64u64)
            .map(|i| {
                let mut t = write(peer, &local, ad.key, 1 << 20);
                t.local[0].offset = i << 20;
                t.remote[0].offset = i << 20;
                let id = t.id;
                init.submit(t).unwrap();
                id
            })
            .collect();
        target.remove_peer(theirs);
        let mut lost = 0;
        let results = kvlane_data::conformance::collect(&mut init, &ids, Duration::from_secs(20));
        for (r, _) in results.into_values() {
            match r {
                Ok(()) => {}
                Err(e) if e.is_peer_lost() => lost += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(
            lost > 0,
            "all 64 MiB landed before the removal: nothing was in flight"
        );
        assert_eq!(init.counters().unfenced_failures, 0);
    }

    #[test]
    fn late_bytes_of_a_timed_out_write_never_land() {
        late_bytes_of_a_failed_write_never_land(Then::Hold);
    }

    #[test]
    fn late_bytes_of_a_write_on_a_reset_connection_never_land() {
        late_bytes_of_a_failed_write_never_land(Then::HoldAndReset);
    }
}
