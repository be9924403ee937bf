//! Lifecycle tests in simulated time: every DESIGN invariant that the
//! control plane owns has a named test here.

mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::{config, local, Cluster};
use kvlane_control::wire::{Hello, Message, PROTOCOL_VERSION};
use kvlane_control::{
    ConnectRefused, Event, GroupError, GroupHandshake, Link, PeerError, PortPlan, Ranks, Refusal,
    Registry, State,
};

fn is_ready(e: &kvlane_control::PeerEvent) -> bool {
    matches!(e.event, Event::Ready(_))
}
fn is_dead(e: &kvlane_control::PeerEvent) -> bool {
    matches!(e.event, Event::Dead { .. })
}

fn connected_pair() -> (Cluster, kvlane_control::ConnectionId) {
    let mut c = Cluster::pair(config());
    let id = c.connect(0, "b:1");
    c.drive_until_event(0, Duration::from_secs(1), is_ready);
    c.drive_until_event(1, Duration::from_secs(1), is_ready);
    (c, id)
}

#[test]
fn handshake_exchanges_identity_and_blobs() {
    let (c, id) = connected_pair();
    let remote = c.nodes[0]
        .reg
        .peer(id)
        .and_then(|p| p.remote().cloned())
        .expect("remote");
    assert_eq!(remote.engine_id, "b");
    assert_eq!(remote.data_plane, b"SECRET-BLOB-b-0-0");
    assert_eq!(remote.incarnation, c.nodes[1].local.incarnation);
    let Some(Event::Ready(inbound)) = c
        .events(1)
        .into_iter()
        .find(|e| matches!(e, Event::Ready(_)))
    else {
        panic!("acceptor saw no Ready");
    };
    assert_eq!(inbound.engine_id, "a");
    assert_eq!(inbound.data_plane, b"SECRET-BLOB-a-0-0");
}

#[test]
fn keepalive_holds_20x_liveness_budget() {
    let (mut c, id) = connected_pair();
    let bound = c.nodes[0].config.death_bound();
    c.clear_events();
    c.drive_for(bound * 20);
    assert!(
        c.events(0).is_empty(),
        "unexpected events: {:?}",
        c.events(0)
    );
    assert!(
        c.events(1).is_empty(),
        "unexpected events: {:?}",
        c.events(1)
    );
    assert_eq!(
        c.nodes[0].reg.peer(id).map(|p| p.state()),
        Some(State::Ready)
    );
}

#[test]
fn invariant_1_keepalive_never_kills_owner() {
    let (mut c, id) = connected_pair();
    let bound = c.nodes[0].config.death_bound();
    c.loss = 1.0;
    let start = c.now;
    let (t_suspect, _) = c.drive_until_event(0, bound * 2, |e| e.event == Event::Suspect);
    let (t_dead, dead) = c.drive_until_event(0, bound * 2, is_dead);
    assert!(t_suspect <= t_dead);
    assert!(
        t_dead - start <= bound,
        "dead after {:?}, bound {bound:?}",
        t_dead - start
    );
    let Event::Dead {
        peer,
        attempts,
        last_error,
    } = dead.event
    else {
        unreachable!()
    };
    assert_eq!(peer, "b:1");
    assert_eq!(dead.addr, "b:1");
    assert!(attempts >= 3, "attempts {attempts}");
    assert!(matches!(last_error, PeerError::KeepAliveTimeout { missed } if missed >= 3));
    // The owner keeps running: reconnects back off and, once the network
    // heals, the peer is ready again on the same registry.
    c.drive_for(bound * 5);
    assert_eq!(
        c.events(0)
            .iter()
            .filter(|e| matches!(e, Event::Dead { .. }))
            .count(),
        1
    );
    c.loss = 0.0;
    c.drive_until_event(0, Duration::from_secs(10), |e| {
        matches!(e.event, Event::Ready(_)) && e.id == id
    });
    assert_eq!(
        c.nodes[0].reg.peer(id).map(|p| p.state()),
        Some(State::Ready)
    );
}

#[test]
fn total_loss_dead_within_bound() {
    for budget in [1, 3, 5] {
        let mut cfg = config();
        cfg.liveness_budget = budget;
        cfg.keepalive_interval = Duration::from_millis(250);
        let mut c = Cluster::pair(cfg.clone());
        c.connect(0, "b:1");
        c.drive_until_event(0, Duration::from_secs(1), is_ready);
        c.drive_for(Duration::from_millis(3100));
        c.loss = 1.0;
        let start = c.now;
        let (t0, _) = c.drive_until_event(0, cfg.death_bound() * 2, is_dead);
        let (t1, _) = c.drive_until_event(1, cfg.death_bound() * 2, is_dead);
        for t in [t0, t1] {
            assert!(
                t - start <= cfg.death_bound(),
                "budget {budget}: dead after {:?}",
                t - start
            );
        }
    }
}

#[test]
fn suspect_then_recovered() {
    let (mut c, _) = connected_pair();
    c.partition(0, 1);
    c.drive_until_event(0, Duration::from_secs(3), |e| e.event == Event::Suspect);
    c.heal();
    c.drive_until_event(0, Duration::from_secs(3), |e| e.event == Event::Recovered);
    assert!(!c.events(0).iter().any(|e| matches!(e, Event::Dead { .. })));
}

#[test]
fn invariant_2_restart_rehandshakes() {
    let (mut c, id) = connected_pair();
    let old = c.nodes[1].local.incarnation;
    c.kill(1);
    c.drive_until_event(0, Duration::from_secs(10), is_dead);
    c.restart(1);
    let new = c.nodes[1].local.incarnation;
    let (t_restart, ev) = c.drive_until_event(0, Duration::from_secs(30), |e| {
        matches!(e.event, Event::Restarted { .. })
    });
    assert_eq!(ev.event, Event::Restarted { old, new });
    assert_eq!(ev.id, id);
    let (t_ready, ev) = c.drive_until_event(0, Duration::from_secs(1), is_ready);
    assert!(t_restart <= t_ready);
    let Event::Ready(info) = ev.event else {
        unreachable!()
    };
    assert_eq!(info.incarnation, new);
    // Order: Restarted is emitted before the new Ready.
    let evs = c.events(0);
    let ri = evs
        .iter()
        .rposition(|e| matches!(e, Event::Restarted { .. }))
        .expect("restarted");
    let ready = evs
        .iter()
        .rposition(|e| matches!(e, Event::Ready(_)))
        .expect("ready");
    assert!(ri < ready);
}

#[test]
fn invariant_3_one_live_connection_per_peer() {
    let (mut c, id) = connected_pair();
    let now = c.now;
    match c.nodes[0].reg.connect(now, "b:1") {
        Err(ConnectRefused::Duplicate { existing, .. }) => assert_eq!(existing, id),
        other => panic!("expected duplicate, got {other:?}"),
    }
    c.kill(1);
    c.drive_until_event(0, Duration::from_secs(10), is_dead);
    // Connecting to a peer whose connection is dead retires the dead one.
    let now = c.now;
    let new = c.nodes[0]
        .reg
        .connect(now, "b:1")
        .expect("dead connection is retired, not asserted");
    assert_ne!(new, id);
    assert_eq!(c.nodes[0].reg.len(), 1);
    assert!(c.nodes[0].reg.peer(id).is_none());
    c.restart(1);
    c.drive_until_event(0, Duration::from_secs(10), |e| is_ready(e) && e.id == new);
    assert_eq!(c.nodes[0].reg.len(), 1);
}

#[test]
fn invariant_4_close_releases_after_dead_and_is_idempotent() {
    let (mut c, id) = connected_pair();
    c.kill(1);
    c.drive_until_event(0, Duration::from_secs(10), is_dead);
    assert_eq!(
        c.nodes[0].reg.peer(id).map(|p| p.state()),
        Some(State::Dead)
    );
    let now = c.now;
    c.nodes[0].reg.close(now);
    c.nodes[0].reg.close(now);
    c.drive_until_event(0, Duration::from_secs(1), |e| e.event == Event::Closed);
    assert!(c.nodes[0].reg.is_empty());
    assert_eq!(
        c.nodes[0].reg.poll_timeout(),
        None,
        "no timer survives close"
    );
    assert_eq!(
        c.events(0).iter().filter(|e| **e == Event::Closed).count(),
        1
    );
}

#[test]
fn close_of_ready_peer_says_bye_and_waits_for_ack() {
    let (mut c, id) = connected_pair();
    let now = c.now;
    c.nodes[0].reg.disconnect(now, id);
    let (t, _) = c.drive_until_event(0, Duration::from_secs(1), |e| e.event == Event::Closed);
    assert!(
        t - now < c.nodes[0].config.close_linger,
        "closed by the bye ack, not the linger"
    );
    let (_, ev) = c.drive_until_event(1, Duration::from_secs(1), is_dead);
    assert!(matches!(
        ev.event,
        Event::Dead {
            last_error: PeerError::RemoteClosed,
            ..
        }
    ));
}

#[test]
fn invariant_6_dead_reaped_before_inbound_routing() {
    let cfg = Arc::new(config());
    let mut reg = Registry::new(Arc::clone(&cfg), Arc::new(local("b", 0, 0, 1)));
    let now = Instant::now();
    let rid = Link::Accepted(Bytes::from_static(b"same-routing-id"));
    let hello = |inc: u64| {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            engine_id: "a".into(),
            incarnation: inc,
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
            fingerprint: "fp".into(),
            capabilities: vec![],
            auth: false,
            nonce: vec![],
            data_plane: Some(serde_bytes::ByteBuf::from(b"blob".to_vec())),
        })
        .encode()
        .expect("encode")
    };
    reg.handle_frame(now, rid.clone(), &hello(1));
    let first = drain_ready(&mut reg).expect("first ready");
    // The peer goes silent: the accepted connection dies.
    let later = now + cfg.death_bound() + Duration::from_millis(1);
    reg.handle_timeout(later);
    assert_eq!(reg.peer(first).map(|p| p.state()), Some(State::Dead));
    // It reconnects with the same routing id: its first frame must not be
    // dropped together with the dead entry.
    reg.handle_frame(later, rid, &hello(2));
    let second = drain_ready(&mut reg).expect("reconnecting peer's hello was routed");
    assert_ne!(first, second);
    assert!(reg.peer(first).is_none(), "dead entry reaped");
    assert_eq!(reg.len(), 1);
}

fn drain_ready(reg: &mut Registry) -> Option<kvlane_control::ConnectionId> {
    while let Some(_t) = reg.poll_transmit() {}
    let mut ready = None;
    while let Some(ev) = reg.poll_event() {
        if matches!(ev.event, Event::Ready(_)) {
            ready = Some(ev.id);
        }
    }
    ready
}

#[test]
fn invariant_6_reconnecting_peer_replaces_stale_live_entry() {
    let (mut c, _) = connected_pair();
    // A restarts while B still thinks the old connection is alive.
    c.restart(0);
    c.clear_events();
    c.connect(0, "b:1");
    c.drive_until_event(0, Duration::from_secs(1), is_ready);
    let (_, ev) = c.drive_until_event(1, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Restarted { .. })
    });
    assert!(matches!(ev.event, Event::Restarted { .. }));
    c.drive_until_event(1, Duration::from_secs(1), is_ready);
    assert_eq!(
        c.nodes[1].reg.len(),
        1,
        "one live connection per peer on the acceptor"
    );
}

fn group_cluster(bad: Option<u32>, silent: Option<u32>) -> (Cluster, usize) {
    let mut c = Cluster::new();
    let me = c.add("me:1", config(), local("me", 0, 0, 1));
    for tp in 0..4u32 {
        let mut cfg = config();
        let mut l = local("remote", 1, tp, 4);
        if bad == Some(tp) {
            l.fingerprint = "other-fp".into();
        }
        cfg.rng_seed = u64::from(tp);
        c.add(&format!("h:{}", 9000 + 4 + tp), cfg, l);
    }
    if let Some(tp) = silent {
        c.partition(me, 1 + tp as usize);
    }
    (c, me)
}

fn run_group(
    c: &mut Cluster,
    me: usize,
) -> (
    Duration,
    Result<Vec<kvlane_control::GroupMember>, GroupError>,
) {
    let plan = PortPlan::new(9000, &[1], 4).expect("plan");
    let start = c.now;
    let mut g = GroupHandshake::new("h", start + c.nodes[me].config.handshake_timeout);
    for ranks in plan.ranks() {
        let addr = format!("h:{}", plan.port(ranks).expect("port"));
        let now = c.now;
        let id = c.nodes[me]
            .reg
            .connect(now, &addr)
            .map_err(|e| e.to_string());
        g.expect(ranks, addr, id);
    }
    let mut seen = 0;
    loop {
        for (_, ev) in &c.nodes[me].events[seen..] {
            g.handle_event(ev.id, &ev.event);
        }
        seen = c.nodes[me].events.len();
        g.handle_timeout(c.now);
        if let Some(outcome) = g.poll_outcome() {
            return (c.now - start, outcome);
        }
        assert!(c.step(), "idle before the group verdict");
    }
}

#[test]
fn invariant_7_group_handshake_all_ready() {
    let (mut c, me) = group_cluster(None, None);
    let (_, outcome) = run_group(&mut c, me);
    let members = outcome.expect("all ranks ready");
    assert_eq!(members.len(), 4);
    for (tp, m) in members.iter().enumerate() {
        assert_eq!(
            m.remote.ranks,
            Ranks {
                dp_rank: 1,
                tp_rank: tp as u32,
                tp_size: 4
            }
        );
    }
}

#[test]
fn invariant_7_group_handshake_fails_uniformly_naming_every_bad_rank() {
    let (mut c, me) = group_cluster(Some(2), Some(0));
    let (took, outcome) = run_group(&mut c, me);
    let deadline = c.nodes[me].config.handshake_timeout;
    assert!(
        took <= deadline,
        "verdict after {took:?}, deadline {deadline:?}"
    );
    let Err(GroupError::RanksFailed {
        host,
        total,
        failures,
    }) = outcome
    else {
        panic!("expected a uniform failure, got {outcome:?}");
    };
    assert_eq!((host.as_str(), total), ("h", 4));
    let failed: Vec<_> = failures.iter().map(|f| f.ranks.tp_rank).collect();
    assert_eq!(failed, vec![0, 2], "{failures:?}");
    assert!(
        failures[0].cause.contains("handshake timed out"),
        "{}",
        failures[0].cause
    );
    assert_eq!(failures[0].addr, "h:9004");
    assert!(
        failures[1].cause.contains("fingerprint"),
        "{}",
        failures[1].cause
    );
    assert!(
        failures[1].cause.contains("other-fp"),
        "{}",
        failures[1].cause
    );
    let msg = GroupError::RanksFailed {
        host,
        total,
        failures,
    }
    .to_string();
    assert!(
        msg.contains("tp_rank 0") && msg.contains("tp_rank 2"),
        "{msg}"
    );
}

#[test]
fn handshake_with_silent_peer_ends_at_its_deadline() {
    let mut c = Cluster::pair(config());
    c.partition(0, 1);
    let start = c.now;
    c.connect(0, "b:1");
    let (t, ev) = c.drive_until_event(0, Duration::from_secs(20), is_dead);
    assert_eq!(t - start, c.nodes[0].config.handshake_timeout);
    assert!(
        matches!(
            ev.event,
            Event::Dead {
                last_error: PeerError::HandshakeTimeout(_),
                attempts: 1,
                ..
            }
        ),
        "{ev:?}"
    );
}

#[test]
fn peer_down_retries_with_backoff_then_dead_at_deadline() {
    let mut c = Cluster::pair(config());
    c.kill(1);
    let start = c.now;
    c.connect(0, "b:1");
    let (t, ev) = c.drive_until_event(0, Duration::from_secs(20), is_dead);
    assert_eq!(t - start, c.nodes[0].config.handshake_timeout);
    let Event::Dead {
        attempts,
        last_error,
        ..
    } = ev.event
    else {
        unreachable!()
    };
    assert!(
        attempts > 3,
        "backoff retries within the deadline: {attempts}"
    );
    assert!(
        matches!(last_error, PeerError::Channel(ref r) if r.contains("refused")),
        "{last_error:?}"
    );
}

#[test]
fn invariant_8_peer_death_is_isolated() {
    let mut c = Cluster::new();
    c.add("a:1", config(), local("a", 0, 0, 1));
    c.add("b:1", config(), local("b", 0, 0, 1));
    c.add("c:1", config(), local("c", 0, 0, 1));
    let idb = c.connect(0, "b:1");
    let idc = c.connect(0, "c:1");
    c.drive_until_event(0, Duration::from_secs(1), |e| is_ready(e) && e.id == idb);
    c.drive_for(Duration::from_millis(10));
    c.clear_events();
    c.kill(1);
    let start = c.now;
    let (t, ev) = c.drive_until_event(0, Duration::from_secs(10), is_dead);
    assert_eq!(ev.id, idb);
    assert!(t - start <= c.nodes[0].config.death_bound());
    c.drive_for(Duration::from_secs(10));
    assert!(
        c.nodes[0].events.iter().all(|(_, e)| e.id != idc),
        "other peer untouched"
    );
    assert_eq!(
        c.nodes[0].reg.peer(idc).map(|p| p.state()),
        Some(State::Ready)
    );
}

#[test]
fn invariant_9_malformed_oversized_unknown_dropped_and_counted() {
    let mut cfg = config();
    cfg.frame_cap = 1024;
    let (mut c, id) = {
        let mut c = Cluster::pair(cfg);
        let id = c.connect(0, "b:1");
        c.drive_until_event(0, Duration::from_secs(1), is_ready);
        (c, id)
    };
    let now = c.now;
    let unknown = rmp_serde::to_vec_named(&serde_json_like("teleport")).expect("encode");
    let reg = &mut c.nodes[0].reg;
    reg.handle_frame(now, Link::Dial(id), b"\xff\x00garbage");
    reg.handle_frame(now, Link::Dial(id), &vec![0x90; 4096]);
    reg.handle_frame(now, Link::Dial(id), &unknown);
    // Same on the listener side, from a link it never saw.
    let b = &mut c.nodes[1].reg;
    b.handle_frame(now, Link::Accepted(Bytes::from_static(b"x")), b"\xc1");
    b.handle_frame(now, Link::Accepted(Bytes::from_static(b"x")), &unknown);
    let sa = c.nodes[0].reg.stats();
    assert_eq!((sa.malformed, sa.oversized, sa.unknown_type), (1, 1, 1));
    let sb = c.nodes[1].reg.stats();
    assert_eq!((sb.malformed, sb.unknown_type), (1, 1));
    // Nothing ended: the peer stays ready and keep-alive keeps working.
    c.drive_for(Duration::from_secs(10));
    assert_eq!(
        c.nodes[0].reg.peer(id).map(|p| p.state()),
        Some(State::Ready)
    );
    assert!(!c.events(0).iter().any(|e| matches!(e, Event::Dead { .. })));
}

fn serde_json_like(kind: &'static str) -> std::collections::BTreeMap<&'static str, rmpv_like::V> {
    let mut m = std::collections::BTreeMap::new();
    m.insert("type", rmpv_like::V::S(kind));
    m.insert("version", rmpv_like::V::U(u64::from(PROTOCOL_VERSION)));
    m
}

mod rmpv_like {
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    pub(crate) enum V {
        S(&'static str),
        U(u64),
    }
}

#[test]
fn invariant_10_peer_cap_refuses_clearly() {
    let mut cfg = config();
    cfg.peer_cap = 2;
    let mut c = Cluster::new();
    c.add("t:1", cfg.clone(), local("t", 0, 0, 1));
    for i in 0..3 {
        c.add(
            &format!("i{i}:1"),
            config(),
            local(&format!("i{i}"), 0, 0, 1),
        );
    }
    c.connect(1, "t:1");
    c.connect(2, "t:1");
    c.drive_until_event(2, Duration::from_secs(1), is_ready);
    c.connect(3, "t:1");
    let (_, ev) = c.drive_until_event(3, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Refused { .. })
    });
    let Event::Refused { refusal, peer } = ev.event else {
        unreachable!()
    };
    assert_eq!(peer, "t:1");
    assert!(
        matches!(&refusal, Refusal::Remote { code, reason } if code == "peer_cap" && reason.contains('2')),
        "{refusal:?}"
    );
    assert_eq!(c.nodes[0].reg.refused_at_cap(), 1);
    assert_eq!(c.nodes[0].reg.len(), 2);
    // Outbound side of the cap.
    let now = c.now;
    assert!(matches!(
        c.nodes[0].reg.connect(now, "i1:1"),
        Err(ConnectRefused::PeerCap { cap: 2, .. })
    ));
}

#[test]
fn version_mismatch_refused_naming_both_values() {
    let mut c = Cluster::pair(config());
    let now = c.now;
    let mut hello = match Message::decode(&first_hello(&mut c), 1 << 20) {
        Ok(Message::Hello(h)) => h,
        other => panic!("{other:?}"),
    };
    hello.version = 99;
    let bytes = Message::Hello(hello).encode().expect("encode");
    c.nodes[1]
        .reg
        .handle_frame(now, Link::Accepted(Bytes::from_static(b"v")), &bytes);
    let frames: Vec<_> = std::iter::from_fn(|| c.nodes[1].reg.poll_transmit()).collect();
    let err = frames.iter().find_map(|(_, _, t)| match t {
        kvlane_control::Transmit::Frame(f) => match Message::decode(f, 1 << 20) {
            Ok(Message::Error(e)) => Some(e),
            _ => None,
        },
        _ => None,
    });
    let err = err.expect("error frame");
    assert_eq!(err.code, "version_mismatch");
    assert!(
        err.reason.contains("local 1") && err.reason.contains("remote 99"),
        "{}",
        err.reason
    );
}

fn first_hello(c: &mut Cluster) -> Vec<u8> {
    let now = c.now;
    c.nodes[0].reg.connect(now, "b:1").expect("connect");
    std::iter::from_fn(|| c.nodes[0].reg.poll_transmit())
        .find_map(|(_, _, t)| match t {
            kvlane_control::Transmit::Frame(f) => Some(f),
            _ => None,
        })
        .expect("hello")
}

#[test]
fn fingerprint_mismatch_refused_on_both_sides_naming_both_values() {
    let mut c = Cluster::new();
    c.add("a:1", config(), local("a", 0, 0, 1));
    let mut l = local("b", 0, 0, 1);
    l.fingerprint = "fp-b".into();
    c.add("b:1", config(), l);
    c.connect(0, "b:1");
    let (_, ea) = c.drive_until_event(0, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Refused { .. })
    });
    let (_, eb) = c.drive_until_event(1, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Refused { .. })
    });
    for ev in [ea, eb] {
        let Event::Refused { refusal, .. } = ev.event else {
            unreachable!()
        };
        let s = refusal.to_string();
        assert!(s.contains("\"fp\"") && s.contains("\"fp-b\""), "{s}");
    }
    // A refused initiator does not keep dialing.
    let sent = c.sent.len();
    c.drive_for(Duration::from_secs(30));
    assert_eq!(c.sent.len(), sent);
}

fn psk_pair(ka: Option<&[u8]>, kb: Option<&[u8]>) -> Cluster {
    let mut c = Cluster::new();
    let mut ca = config();
    ca.psk = ka.map(<[u8]>::to_vec);
    let mut cb = config();
    cb.psk = kb.map(<[u8]>::to_vec);
    c.add("a:1", ca, local("a", 0, 0, 1));
    c.add("b:1", cb, local("b", 0, 0, 1));
    c.connect(0, "b:1");
    c
}

fn leaked(c: &Cluster, needle: &[u8]) -> bool {
    c.sent
        .iter()
        .any(|s| s.bytes.windows(needle.len()).any(|w| w == needle))
}

#[test]
fn psk_mutual_handshake_succeeds() {
    let mut c = psk_pair(Some(b"k1"), Some(b"k1"));
    let (_, ev) = c.drive_until_event(0, Duration::from_secs(1), is_ready);
    let Event::Ready(info) = ev.event else {
        unreachable!()
    };
    assert_eq!(info.data_plane, b"SECRET-BLOB-b-0-0");
    let (_, ev) = c.drive_until_event(1, Duration::from_secs(1), is_ready);
    let Event::Ready(info) = ev.event else {
        unreachable!()
    };
    assert_eq!(info.data_plane, b"SECRET-BLOB-a-0-0");
}

#[test]
fn psk_wrong_key_refused_on_both_sides_and_no_blob_leaks() {
    let mut c = psk_pair(Some(b"key-a"), Some(b"key-b"));
    let (_, ea) = c.drive_until_event(0, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Refused { .. })
    });
    let (_, eb) = c.drive_until_event(1, Duration::from_secs(1), |e| {
        matches!(e.event, Event::Refused { .. })
    });
    let Event::Refused { peer, refusal } = ea.event else {
        unreachable!()
    };
    assert_eq!(peer, "b:1", "the error names the peer address");
    assert!(
        matches!(refusal, Refusal::Auth { ref reason } if reason.contains("b:1")),
        "{refusal:?}"
    );
    assert!(matches!(eb.event, Event::Refused { .. }));
    c.drive_for(Duration::from_secs(10));
    assert!(
        !leaked(&c, b"SECRET-BLOB"),
        "a data-plane blob was transmitted"
    );
    assert!(!c.events(0).iter().any(|e| matches!(e, Event::Ready(_))));
    assert!(!c.events(1).iter().any(|e| matches!(e, Event::Ready(_))));
}

#[test]
fn psk_on_one_side_only_is_refused_without_leaking() {
    for (ka, kb) in [(Some(&b"k"[..]), None), (None, Some(&b"k"[..]))] {
        let mut c = psk_pair(ka, kb);
        c.drive_until_event(0, Duration::from_secs(1), |e| {
            matches!(e.event, Event::Refused { .. })
        });
        c.drive_until_event(1, Duration::from_secs(1), |e| {
            matches!(e.event, Event::Refused { .. })
        });
        // Only the key-less side may have sent its own blob (it has nothing to protect).
        let keyed = if ka.is_some() { "a" } else { "b" };
        assert!(
            !leaked(&c, format!("SECRET-BLOB-{keyed}").as_bytes()),
            "keyed side leaked its blob"
        );
    }
}

#[test]
fn backoff_reconnects_are_deterministic_for_a_seed() {
    let run = || {
        let mut c = Cluster::pair(config());
        c.kill(1);
        c.connect(0, "b:1");
        c.drive_for(Duration::from_secs(4));
        c.sent.len()
    };
    // Connect attempts to a dead peer produce no frames on the wire here;
    // compare the event timelines instead.
    let timeline = || {
        let mut c = Cluster::pair(config());
        c.kill(1);
        let start = c.now;
        c.connect(0, "b:1");
        c.drive_for(Duration::from_secs(20));
        c.nodes[0]
            .events
            .iter()
            .map(|(t, _)| *t - start)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
    assert_eq!(timeline(), timeline());
}

#[test]
fn port_plan_rejects_collisions_and_zero_tp() {
    assert!(PortPlan::new(5000, &[0, 1], 0).is_err());
    let p = PortPlan::new(5000, &[0, 1], 2).expect("plan");
    let ports: Vec<_> = p.ranks().map(|r| p.port(r).expect("port")).collect();
    assert_eq!(ports, vec![5000, 5001, 5002, 5003]);
    assert!(matches!(
        PortPlan::new(5000, &[1, 1], 2),
        Err(kvlane_control::PlanError::Collision { port: 5002, .. })
    ));
    assert!(PortPlan::new(65535, &[0], 2).is_err());
    let any = PortPlan::new(0, &[0, 1], 2).expect("port 0 binds any");
    assert!(any.ranks().all(|r| any.port(r) == Ok(0)));
}
