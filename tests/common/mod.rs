//! Helpers shared by the facade's integration tests.

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
