//! Helpers shared by the facade's integration tests.

// Each test binary that includes this module uses some of them.
#![allow(dead_code)]

use kvlane::{Agent, AgentBuilder};

/// Builds `n` agents on consecutive ports (`base + rank`), `make(rank,
/// port)` giving each one's builder, and retries other bases until all of
/// them bind.
pub(crate) async fn rank_agents(
    n: u16,
    make: impl Fn(u16, u16) -> AgentBuilder,
) -> (u16, Vec<Agent>) {
    'base: for attempt in 0..50u16 {
        let base = 20_000 + (std::process::id() as u16 % 20_000) + attempt * 97;
        let mut agents = Vec::new();
        for rank in 0..n {
            match make(rank, base + rank).build().await {
                Ok(a) => agents.push(a),
                Err(_) => {
                    for a in agents {
                        a.close().await;
                    }
                    continue 'base;
                }
            }
        }
        return (base, agents);
    }
    panic!("no free run of {n} ports");
}

/// This machine's address on its default route (no packet is sent).
pub(crate) fn routable_local_ip() -> std::net::IpAddr {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    s.connect("192.0.2.1:9")
        .expect("this test needs an IPv4 default route (a non-loopback local address)");
    let ip = s.local_addr().unwrap().ip();
    assert!(!ip.is_loopback(), "no non-loopback local address: {ip}");
    ip
}

/// The value of the metric line `name` (with its labels, as the text
/// shows them) in `agent`'s metrics, if there is one.
pub(crate) fn metric(agent: &Agent, name: &str) -> Option<u64> {
    agent
        .metrics()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}
