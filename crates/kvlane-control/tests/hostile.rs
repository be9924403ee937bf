//! Hostile peers against the sans-IO registry (no sockets): unauthenticated
//! hellos, forged identities, spliced handshake fields, floods. Each test
//! drives two real [`Registry`] machines by hand so a frame can be
//! inspected, forged or altered on the way.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvlane_control::wire::{Auth, AuthAck, Hello, HelloAck, Message, PROTOCOL_VERSION};
use kvlane_control::{
    Config, ConnectionId, Event, Link, LocalInfo, PeerEvent, Psk, Ranks, Refusal, Registry, State,
    Transmit,
};

const KEY: &[u8] = b"the pre-shared key";

fn local(engine: &str) -> LocalInfo {
    let mut l = LocalInfo::new(
        engine,
        Ranks {
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
        },
        "fingerprint-secret",
    )
    .with_data_plane(format!("SECRET-BLOB-{engine}").into_bytes());
    l.identity.capabilities = vec![format!("cap-of-{engine}")];
    l
}

fn keyed(key: &[u8]) -> Config {
    Config {
        psk: Some(Psk::new(key)),
        ..Config::default()
    }
}

fn registry(engine: &str, config: Config) -> Registry {
    Registry::new(Arc::new(config), Arc::new(local(engine)))
}

/// The initiator `a` (dialing), the acceptor `b`, and the routing id `b`
/// sees `a`'s connection under.
struct Pair {
    now: Instant,
    a: Registry,
    b: Registry,
    rid: Bytes,
    events_a: Vec<PeerEvent>,
    events_b: Vec<PeerEvent>,
}

impl Pair {
    fn new(ca: Config, cb: Config) -> Self {
        Self {
            now: Instant::now(),
            a: registry("a", ca),
            b: registry("b", cb),
            rid: Bytes::from_static(b"rid-of-a"),
            events_a: Vec::new(),
            events_b: Vec::new(),
        }
    }

    /// Delivers frames both ways until quiet; `tamper` may alter (or drop,
    /// returning `None`) each frame in flight; `true` = from `a`.
    fn pump(&mut self, mut tamper: impl FnMut(bool, Message) -> Option<Message>) {
        for _ in 0..100 {
            let mut moved = false;
            while let Some((_, _, t)) = self.a.poll_transmit() {
                if let Transmit::Frame(f) = t {
                    moved = true;
                    let m = Message::decode(&f, 1 << 20).expect("a sends valid frames");
                    if let Some(m) = tamper(true, m) {
                        let f = m.encode().expect("encode");
                        self.b
                            .handle_frame(self.now, Link::Accepted(self.rid.clone()), &f);
                    }
                }
            }
            while let Some((id, link, t)) = self.b.poll_transmit() {
                if let (Transmit::Frame(f), Link::Accepted(rid)) = (t, link) {
                    if rid != self.rid {
                        continue; // to a forged peer: nobody listens
                    }
                    let _ = id;
                    moved = true;
                    let m = Message::decode(&f, 1 << 20).expect("b sends valid frames");
                    if let Some(m) = tamper(false, m) {
                        let f = m.encode().expect("encode");
                        let dial = self.a.ids().into_iter().next().expect("a dialed");
                        self.a.handle_frame(self.now, Link::Dial(dial), &f);
                    }
                }
            }
            while let Some(e) = self.a.poll_event() {
                self.events_a.push(e);
            }
            while let Some(e) = self.b.poll_event() {
                self.events_b.push(e);
            }
            if !moved {
                return;
            }
        }
        panic!("handshake did not settle in 100 rounds");
    }

    fn connect(&mut self) -> ConnectionId {
        let id = self.a.connect(self.now, "b:1").expect("connect");
        self.pump(|_, m| Some(m));
        id
    }
}

fn ready(events: &[PeerEvent]) -> bool {
    events.iter().any(|e| matches!(e.event, Event::Ready(_)))
}

fn refused(events: &[PeerEvent]) -> Option<Refusal> {
    events.iter().find_map(|e| match &e.event {
        Event::Refused { refusal, .. } => Some(refusal.clone()),
        _ => None,
    })
}

/// A keyed `hello` as anybody could send it, claiming `engine`'s identity
/// (rank 0 of 1) in the fields a keyed hello leaves empty.
fn forged_hello(engine: &str, nonce_len: usize) -> Vec<u8> {
    let identity = kvlane_control::wire::Identity {
        incarnation: 1,
        capabilities: Vec::new(),
        ..local(engine).identity
    };
    let mut h = Hello::new(identity, None, Vec::new(), None);
    h.auth = true;
    h.nonce = vec![7; nonce_len];
    h.data_plane = None;
    Message::Hello(h).encode().expect("encode")
}

#[test]
fn keyed_pair_becomes_ready_with_each_others_identity_and_blob() {
    let mut p = Pair::new(keyed(KEY), keyed(KEY));
    p.connect();
    let info = |evs: &[PeerEvent]| {
        evs.iter()
            .find_map(|e| match &e.event {
                Event::Ready(i) => Some(i.clone()),
                _ => None,
            })
            .expect("ready")
    };
    let (ia, ib) = (info(&p.events_a), info(&p.events_b));
    assert_eq!(
        (ia.identity.engine_id.as_str(), ia.data_plane.as_slice()),
        ("b", &b"SECRET-BLOB-b"[..])
    );
    assert_eq!(
        (ib.identity.engine_id.as_str(), ib.data_plane.as_slice()),
        ("a", &b"SECRET-BLOB-a"[..])
    );
    assert_eq!(ia.identity.capabilities, vec!["cap-of-b".to_string()]);
    assert_eq!(ib.identity.fingerprint, "fingerprint-secret");
}

/// Before the key is proven, the acceptor's answer carries the version, a
/// nonce and a proof: not its engine id, incarnation, ranks, fingerprint,
/// capabilities or blob; and an incompatible fingerprint is not named to an
/// unauthenticated peer.
#[test]
fn hello_ack_before_the_proof_reveals_nothing_about_the_acceptor() {
    let mut b = registry("b", keyed(KEY));
    let now = Instant::now();
    b.handle_frame(
        now,
        Link::Accepted(Bytes::from_static(b"x")),
        &forged_hello("x", 32),
    );
    let (_, _, t) = b.poll_transmit().expect("b answers");
    let Transmit::Frame(f) = t else {
        panic!("expected a frame, got {t:?}")
    };
    let Ok(Message::HelloAck(ack)) = Message::decode(&f, 1 << 20) else {
        panic!("expected hello_ack")
    };
    let b_local = local("b");
    assert_eq!(ack.identity, kvlane_control::wire::Identity::default());
    assert!(ack.data_plane.is_none());
    assert_eq!(ack.nonce.len(), 32);
    for needle in [
        b"fingerprint-secret".to_vec(),
        b"cap-of-b".to_vec(),
        b"SECRET-BLOB".to_vec(),
        b_local.identity.incarnation.to_be_bytes().to_vec(),
    ] {
        assert!(
            !f.windows(needle.len()).any(|w| w == needle.as_slice()),
            "hello_ack leaks {:?}",
            String::from_utf8_lossy(&needle)
        );
    }
}

#[test]
fn keyed_hello_carries_no_identity_of_the_initiator() {
    let mut a = registry("a", keyed(KEY));
    a.connect(Instant::now(), "b:1").expect("connect");
    let frame = std::iter::from_fn(|| a.poll_transmit())
        .find_map(|(_, _, t)| match t {
            Transmit::Frame(f) => Some(f),
            _ => None,
        })
        .expect("hello");
    for needle in [&b"fingerprint-secret"[..], b"cap-of-a", b"SECRET-BLOB"] {
        assert!(!frame.windows(needle.len()).any(|w| w == needle));
    }
}

/// An unauthenticated hello claiming a connected engine's identity (same
/// engine id and ranks) neither retires the live connection nor takes
/// its place, also when it comes on the live connection's routing id.
#[test]
fn unauthenticated_hello_never_retires_a_live_connection() {
    let mut p = Pair::new(keyed(KEY), keyed(KEY));
    p.connect();
    assert!(ready(&p.events_b));
    let live = p.b.ids()[0];
    p.events_b.clear();
    let now = p.now;
    for rid in [&b"forger"[..], b"rid-of-a"] {
        p.b.handle_frame(
            now,
            Link::Accepted(Bytes::copy_from_slice(rid)),
            &forged_hello("a", 32),
        );
    }
    while let Some(e) = p.b.poll_event() {
        p.events_b.push(e);
    }
    assert_eq!(p.b.peer(live).map(|x| x.state()), Some(State::Ready));
    assert!(
        !p.events_b.iter().any(|e| e.id == live),
        "the live connection saw {:?}",
        p.events_b
    );
    // Its keep-alive still flows: a ping from `a` reaches the live entry.
    let later = now + Duration::from_secs(1);
    p.a.handle_timeout(later);
    p.now = later;
    p.pump(|_, m| Some(m));
    assert_eq!(p.b.peer(live).map(|x| x.state()), Some(State::Ready));
}

/// A hello on the routing id of a live connection (forged, or the real
/// peer's own hello sent again) is refused and counted: the live
/// connection keeps its link, so its peer's keep-alive keeps reaching it
/// for many death bounds, nothing is sent back on the link, and no
/// connection starts. (Before, the link was routed to a new handshake: the
/// live connection heard nothing more and died by keep-alive.)
#[test]
fn a_hello_on_a_live_links_routing_id_is_refused_and_counted() {
    for keyed_pair in [true, false] {
        let config = || {
            if keyed_pair {
                keyed(KEY)
            } else {
                Config::default()
            }
        };
        let mut p = Pair::new(config(), config());
        let dial = p.connect();
        assert!(ready(&p.events_b), "{:?}", p.events_b);
        let live = p.b.ids()[0];
        p.events_b.clear();
        let now = p.now;
        // A forged hello, and `a`'s own hello (a valid one) sent again.
        let again = Message::Hello(Hello::new(local("a").identity, None, Vec::new(), None))
            .encode()
            .expect("encode");
        for hello in [forged_hello("a", 32), again] {
            p.b.handle_frame(now, Link::Accepted(p.rid.clone()), &hello);
        }
        assert_eq!(p.b.stats().hellos_on_live_links, 2);
        assert_eq!(p.b.len(), 1, "a connection started on the live link");
        assert!(
            std::iter::from_fn(|| p.b.poll_transmit()).next().is_none(),
            "something was sent back on the live link"
        );
        // Keep-alive runs for five death bounds: the live connection hears
        // its peer all along and stays up, on both sides.
        let cfg = config();
        let step = cfg.keepalive_interval / 2;
        let end = now + cfg.death_bound() * 5;
        while p.now < end {
            p.now += step;
            let t = p.now;
            p.a.handle_timeout(t);
            p.b.handle_timeout(t);
            p.pump(|_, m| Some(m));
        }
        for (side, reg, id) in [("acceptor", &p.b, live), ("dialer", &p.a, dial)] {
            let state = reg.peer(id).map(|x| x.state());
            assert!(
                matches!(state, Some(State::Ready | State::Suspect)),
                "keyed {keyed_pair}: the {side}'s live connection is {state:?}"
            );
        }
        assert!(
            !p.events_b
                .iter()
                .any(|e| e.id == live && matches!(e.event, Event::Dead { .. })),
            "keyed {keyed_pair}: {:?}",
            p.events_b
        );
        assert_eq!(p.b.ids(), vec![live]);
    }
}

/// A flood of unauthenticated hellos cycles through the handshake slots:
/// it never takes a peer slot, the authenticated peer stays up, the
/// registry stays bounded, and a new keyed peer still gets in.
#[test]
fn hello_flood_takes_no_peer_slot_and_stays_bounded() {
    let cb = Config {
        peer_cap: 2,
        handshake_cap: 8,
        ..keyed(KEY)
    };
    let mut p = Pair::new(keyed(KEY), cb);
    p.connect();
    let live = p.b.ids()[0];
    let now = p.now;
    for i in 0..5_000u32 {
        let rid = Bytes::from(format!("flood-{i}"));
        p.b.handle_frame(now, Link::Accepted(rid), &forged_hello("a", 32));
        assert!(p.b.len() <= 1 + 8, "registry grew to {}", p.b.len());
        while p.b.poll_transmit().is_some() {}
        while p.b.poll_event().is_some() {}
    }
    assert_eq!(p.b.peer(live).map(|x| x.state()), Some(State::Ready));
    assert_eq!(p.b.stats().handshakes_evicted, 5_000 - 8);
    // A second keyed engine is accepted during the flood.
    let mut c = Pair {
        b: p.b,
        ..Pair::new(keyed(KEY), keyed(KEY))
    };
    c.a = Registry::new(Arc::new(keyed(KEY)), Arc::new(local("c")));
    c.rid = Bytes::from_static(b"rid-of-c");
    c.connect();
    assert!(ready(&c.events_a), "{:?}", c.events_a);
}

#[test]
fn a_nonce_of_the_wrong_length_is_refused() {
    for len in [0, 8, 31, 33, 4096] {
        let mut b = registry("b", keyed(KEY));
        b.handle_frame(
            Instant::now(),
            Link::Accepted(Bytes::from_static(b"x")),
            &forged_hello("x", len),
        );
        let evs: Vec<_> = std::iter::from_fn(|| b.poll_event()).collect();
        assert!(
            matches!(refused(&evs), Some(Refusal::Auth { ref reason }) if reason.contains("nonce")),
            "{len}: {evs:?}"
        );
    }
}

#[test]
fn an_empty_key_is_refused() {
    let err = keyed(b"").validate().expect_err("empty key");
    assert_eq!(err.field, "psk");
    // Unvalidated (a node over a custom channel), it never authenticates.
    let mut p = Pair::new(keyed(b""), keyed(b""));
    p.connect();
    assert!(!ready(&p.events_a) && !ready(&p.events_b));
    assert!(refused(&p.events_a).is_some());
}

/// The MACs cover both identities and both blobs: a man in the middle who
/// alters any of them (he cannot recompute the MAC) is refused.
#[test]
fn the_mac_binds_both_identities_and_both_blobs() {
    type Tamper = fn(bool, Message) -> Option<Message>;
    let cases: [(&str, Tamper); 4] = [
        ("initiator blob", |from_a, m| match m {
            Message::Auth(a) if from_a => Some(Message::Auth(Auth {
                data_plane: b"EVIL".to_vec(),
                ..a
            })),
            m => Some(m),
        }),
        ("initiator identity", |from_a, m| match m {
            Message::Auth(mut a) if from_a => {
                a.identity.engine_id = "mallory".into();
                Some(Message::Auth(a))
            }
            m => Some(m),
        }),
        ("acceptor blob", |from_a, m| match m {
            Message::AuthAck(a) if !from_a => Some(Message::AuthAck(AuthAck {
                data_plane: b"EVIL".to_vec(),
                ..a
            })),
            m => Some(m),
        }),
        ("acceptor identity", |from_a, m| match m {
            Message::AuthAck(mut a) if !from_a => {
                a.identity.incarnation ^= 1;
                Some(Message::AuthAck(a))
            }
            m => Some(m),
        }),
    ];
    for (what, tamper) in cases {
        let mut p = Pair::new(keyed(KEY), keyed(KEY));
        p.a.connect(p.now, "b:1").expect("connect");
        p.pump(tamper);
        let victim = if what.starts_with("initiator") {
            &p.events_b
        } else {
            &p.events_a
        };
        assert!(!ready(victim), "{what}: altered handshake accepted");
        assert!(
            matches!(refused(victim), Some(Refusal::Auth { .. })),
            "{what}: {victim:?}"
        );
    }
    // Replaying an old hello_ack proof against a new nonce fails too.
    let mut p = Pair::new(keyed(KEY), keyed(KEY));
    p.a.connect(p.now, "b:1").expect("connect");
    let stale = HelloAck::keyed(vec![1; 32], vec![2; 32]);
    p.pump(move |from_a, m| match m {
        Message::HelloAck(_) if !from_a => Some(Message::HelloAck(stale.clone())),
        m => Some(m),
    });
    assert!(matches!(refused(&p.events_a), Some(Refusal::Auth { .. })));
    let _ = PROTOCOL_VERSION;
}

/// `auth.source` (where the acceptor dials back a data plane advertised on
/// a wildcard address) is part of what the initiator's MAC covers: a relay
/// that rewrites it, to have the acceptor dial a host of its choosing, is
/// refused like any other altered handshake field.
#[test]
fn the_mac_covers_the_initiators_source_address() {
    for forged in [Some("10.6.6.6".to_owned()), None] {
        let mut p = Pair::new(keyed(KEY), keyed(KEY));
        let route = kvlane_control::Route {
            peer: Some("10.0.0.2".parse().expect("ip")),
            source: Some("10.0.0.1".parse().expect("ip")),
        };
        p.a.connect_via(p.now, "b:1", route).expect("connect");
        let f = forged.clone();
        p.pump(move |from_a, m| match m {
            Message::Auth(a) if from_a => {
                assert_eq!(a.source.as_deref(), Some("10.0.0.1"), "the sent source");
                Some(Message::Auth(Auth {
                    source: f.clone(),
                    ..a
                }))
            }
            m => Some(m),
        });
        assert!(
            !ready(&p.events_b),
            "source {forged:?}: altered auth.source accepted: {:?}",
            p.events_b
        );
        assert!(
            matches!(refused(&p.events_b), Some(Refusal::Auth { .. })),
            "source {forged:?}: {:?}",
            p.events_b
        );
    }
    // Unaltered, the acceptor takes the source it was sent.
    let mut p = Pair::new(keyed(KEY), keyed(KEY));
    let route = kvlane_control::Route {
        peer: Some("10.0.0.2".parse().expect("ip")),
        source: Some("10.0.0.1".parse().expect("ip")),
    };
    p.a.connect_via(p.now, "b:1", route).expect("connect");
    p.pump(|_, m| Some(m));
    let host = p.events_b.iter().find_map(|e| match &e.event {
        Event::Ready(info) => Some(info.peer_host),
        _ => None,
    });
    assert_eq!(host, Some(Some("10.0.0.1".parse().expect("ip"))));
}

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lines").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Refused unauthenticated peers are counted and summarized: a flood of
/// 2,000 bad hellos writes at most one WARN line, not one or two per peer.
#[test]
fn refusals_are_counted_and_logged_as_one_summary_line() {
    let lines = Lines::default();
    let sink = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let mut b = registry("b", keyed(KEY));
    tracing::subscriber::with_default(subscriber, || {
        let now = Instant::now();
        for i in 0..2_000u32 {
            let rid = Bytes::from(format!("bad-{i}"));
            // Wrong nonce length and no key proof: refused at the hello.
            b.handle_frame(now, Link::Accepted(rid), &forged_hello("x", 3));
            while b.poll_transmit().is_some() {}
            while b.poll_event().is_some() {}
        }
    });
    let text = String::from_utf8(lines.0.lock().expect("lines").clone()).expect("utf8");
    let warns = text.lines().filter(|l| l.contains("WARN")).count();
    assert!(warns <= 1, "{warns} WARN lines:\n{text}");
    assert_eq!(b.stats().refused_inbound, 2_000);
}

/// Reflection: `a` dials an attacker X who has no key. X sends `a`'s own
/// keyed hello to a listener of the same node (`a` itself, or another
/// registry speaking as the same identity) and relays every answer back
/// to `a`'s dialing side, and every frame of the dialing side back to the
/// listener. A proof made by the node itself must not pass for a peer's:
/// no `auth` (identity, blob) is sent, and nobody becomes ready.
#[test]
fn a_handshake_reflected_back_to_the_same_node_is_refused() {
    for same_registry in [true, false] {
        let now = Instant::now();
        let me = Arc::new(local("a"));
        let mut a = Registry::new(Arc::new(keyed(KEY)), Arc::clone(&me));
        let mut twin = Registry::new(Arc::new(keyed(KEY)), me);
        let dial = a.connect(now, "x:1").expect("connect");
        let rid = Link::Accepted(Bytes::from_static(b"x-to-a"));
        let mut relayed = Vec::new();
        let mut events = Vec::new();
        for _ in 0..20 {
            let mut moved = false;
            let mut out: Vec<_> = std::iter::from_fn(|| a.poll_transmit()).collect();
            out.extend(std::iter::from_fn(|| twin.poll_transmit()));
            for (_, link, t) in out {
                let Transmit::Frame(f) = t else { continue };
                moved = true;
                relayed.push(f.clone());
                match link {
                    Link::Dial(_) if same_registry => a.handle_frame(now, rid.clone(), &f),
                    Link::Dial(_) => twin.handle_frame(now, rid.clone(), &f),
                    Link::Accepted(_) => a.handle_frame(now, Link::Dial(dial), &f),
                }
            }
            events.extend(std::iter::from_fn(|| a.poll_event()));
            events.extend(std::iter::from_fn(|| twin.poll_event()));
            if !moved {
                break;
            }
        }
        let case = if same_registry {
            "same registry"
        } else {
            "twin"
        };
        assert!(!ready(&events), "{case}: ready with itself: {events:?}");
        for f in &relayed {
            assert!(
                !matches!(Message::decode(f, 1 << 20), Ok(Message::Auth(_))),
                "{case}: auth sent to the reflector"
            );
            for needle in [&b"SECRET-BLOB-a"[..], b"fingerprint-secret", b"cap-of-a"] {
                assert!(
                    !f.windows(needle.len()).any(|w| w == needle),
                    "{case}: {} leaked to the reflector",
                    String::from_utf8_lossy(needle)
                );
            }
        }
        assert!(
            matches!(refused(&events), Some(Refusal::Reflected { .. })),
            "{case}: {events:?}"
        );
    }
}

fn stray_auth_ack() -> Vec<u8> {
    Message::AuthAck(AuthAck {
        version: PROTOCOL_VERSION,
        mac: vec![0; 32],
        data_plane: Vec::new(),
        identity: kvlane_control::wire::Identity::default(),
    })
    .encode()
    .expect("encode")
}

fn timed_out(events: &[PeerEvent], id: ConnectionId) -> bool {
    events.iter().any(|e| {
        e.id == id
            && matches!(
                e.event,
                Event::Dead {
                    last_error: kvlane_control::PeerError::HandshakeTimeout(_),
                    ..
                }
            )
    })
}

/// A handshake frame for the wrong step (anybody can send one) is dropped
/// and counted: the handshake deadline still fires on both sides, and the
/// right frames arriving afterwards still complete the handshake.
#[test]
fn a_handshake_frame_for_the_wrong_step_never_wedges_the_handshake() {
    let timeout = keyed(KEY).handshake_timeout;
    let now = Instant::now();

    // Dialing side: an auth_ack while it waits for hello_ack.
    let mut a = registry("a", keyed(KEY));
    let id = a.connect(now, "b:1").expect("connect");
    a.handle_frame(now, Link::Dial(id), &stray_auth_ack());
    assert_eq!(a.stats().unexpected, 1);
    a.handle_timeout(now + timeout);
    let events: Vec<_> = std::iter::from_fn(|| a.poll_event()).collect();
    assert!(timed_out(&events, id), "dialer wedged: {events:?}");
    assert_eq!(a.peer(id).map(|p| p.state()), Some(State::Dead));

    // Accepting side: an auth_ack while it waits for auth.
    let mut b = registry("b", keyed(KEY));
    let rid = Link::Accepted(Bytes::from_static(b"r"));
    b.handle_frame(now, rid.clone(), &forged_hello("x", 32));
    let inbound = b.ids()[0];
    b.handle_frame(now, rid, &stray_auth_ack());
    b.handle_timeout(now + timeout);
    let events: Vec<_> = std::iter::from_fn(|| b.poll_event()).collect();
    assert!(timed_out(&events, inbound), "acceptor wedged: {events:?}");

    // A stray frame on each side before the real ones: still ready.
    let mut p = Pair::new(keyed(KEY), keyed(KEY));
    let id = p.a.connect(p.now, "b:1").expect("connect");
    p.a.handle_frame(p.now, Link::Dial(id), &stray_auth_ack());
    let stray = stray_auth_ack();
    let rid = p.rid.clone();
    let mut hello_seen = false;
    let now = p.now;
    let mut late = Vec::new();
    p.pump(|from_a, m| {
        if from_a && matches!(m, Message::Hello(_)) {
            hello_seen = true;
            late.push(m.encode().expect("encode"));
            return None;
        }
        Some(m)
    });
    assert!(hello_seen);
    p.b.handle_frame(now, Link::Accepted(rid.clone()), &late[0]);
    p.b.handle_frame(now, Link::Accepted(rid), &stray);
    p.pump(|_, m| Some(m));
    assert!(ready(&p.events_a), "{:?}", p.events_a);
    assert!(ready(&p.events_b), "{:?}", p.events_b);
}

/// Drop counters never go backwards: the frames a connection dropped stay
/// counted after the connection is released (evicted for a newer
/// handshake, timed out and reaped, or replaced by a new hello).
#[test]
fn drop_counters_survive_the_connection_that_counted_them() {
    let now = Instant::now();
    let cb = Config {
        handshake_cap: 1,
        ..keyed(KEY)
    };
    let timeout = cb.handshake_timeout;
    let mut b = registry("b", cb);
    let rid = |r: &'static [u8]| Link::Accepted(Bytes::from_static(r));
    let mut expected = 0;
    for r in [&b"r1"[..], b"r2", b"r3"] {
        b.handle_frame(now, rid(r), &forged_hello("x", 32));
        for _ in 0..3 {
            b.handle_frame(now, rid(r), b"\xc1\xc1 not msgpack");
            expected += 1;
            assert_eq!(b.stats().malformed, expected);
        }
        b.handle_frame(now, rid(r), &stray_auth_ack());
        // r1 is evicted by r2's hello, r2 by r3's: the counts stay.
        assert_eq!(b.stats().malformed, expected);
        assert_eq!(b.stats().unexpected, expected / 3);
    }
    // r3 times out and is reaped on the next frame; a new hello on r3.
    b.handle_timeout(now + timeout);
    b.handle_frame(now + timeout, rid(b"r3"), &forged_hello("x", 32));
    assert_eq!(b.len(), 1);
    assert_eq!(b.stats().malformed, expected);
    assert_eq!(b.stats().unexpected, expected / 3);
}
