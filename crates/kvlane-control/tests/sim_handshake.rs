//! Handshake tests in simulated time: refusals naming both values, the
//! pre-shared-key handshake (no blob leaks), and the group handshake.

mod harness;

use std::time::Duration;

use bytes::Bytes;
use harness::{config, local, Cluster};
use kvlane_control::wire::Message;
use kvlane_control::{Event, GroupError, GroupHandshake, Link, PortPlan, Ranks, Refusal};

fn is_ready(e: &kvlane_control::PeerEvent) -> bool {
    matches!(e.event, Event::Ready(_))
}

fn group_cluster(bad: Option<u32>, silent: Option<u32>) -> (Cluster, usize) {
    let mut c = Cluster::new();
    let me = c.add("me:1", config(), local("me", 0, 0, 1));
    for tp in 0..4u32 {
        let mut cfg = config();
        let mut l = local("remote", 1, tp, 4);
        if bad == Some(tp) {
            l.identity.fingerprint = "other-fp".into();
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
            m.remote.identity.ranks(),
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
        err.reason
            .contains(&format!("local {}", kvlane_control::wire::PROTOCOL_VERSION))
            && err.reason.contains("remote 99"),
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
    l.identity.fingerprint = "fp-b".into();
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
    ca.psk = ka.map(kvlane_control::Psk::new);
    let mut cb = config();
    cb.psk = kb.map(kvlane_control::Psk::new);
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

/// The route the driver resolved reaches both sides' `RemoteInfo`: the
/// dialer learns the address it dialed, the acceptor the address the
/// dialer's `hello` said it sends from (where a data plane advertised on a
/// wildcard is dialed back), and each side knows its role.
#[test]
fn the_dialers_route_reaches_both_sides_remote_info() {
    let mut c = Cluster::new();
    let a = c.add("a:1", config(), local("a", 0, 0, 1));
    let b = c.add("b:1", config(), local("b", 0, 0, 1));
    let route = kvlane_control::Route {
        peer: Some("10.231.0.2".parse().unwrap()),
        source: Some("10.231.0.1".parse().unwrap()),
    };
    let now = c.now;
    c.nodes[a]
        .reg
        .connect_via(now, "b:1", route)
        .expect("connect");
    c.drive();
    let ready = |i: usize| {
        c.nodes[i]
            .events
            .iter()
            .find_map(|(_, e)| match &e.event {
                Event::Ready(info) => Some((e.role, info.peer_host)),
                _ => None,
            })
            .expect("ready")
    };
    assert_eq!(ready(a), (kvlane_control::Role::Initiator, route.peer));
    assert_eq!(ready(b), (kvlane_control::Role::Acceptor, route.source));
}
