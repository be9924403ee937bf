//! A node whose driver does not run for longer than its death bound (its
//! thread starved on a core shared with an engine's busy threads: vLLM on
//! CPU pins the transport's threads beside its own) must not declare a
//! peer dead that answered all along. Issue 40: two vLLM engines lost KV
//! loads to "peer removed" while both were alive.
//!
//! Node A runs on a current-thread runtime driven by this test's thread:
//! between `block_on` calls nothing runs A's driver, which is the stall.
//! Node B runs on its own runtime and keeps answering; its own death bound
//! is longer than the stalls, so only A's judgement is under test.

mod common;

use std::thread;
use std::time::Duration;

use common::{fast_config, local};
use kvlane_control::{Config, ControlNode, Event, State};
use tokio::sync::broadcast::error::TryRecvError;

#[test]
fn a_stalled_driver_keeps_its_live_peers() {
    let rt_a = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime a");
    let rt_b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime b");
    // A: pings every 100 ms, dead after 3 unanswered (bound 400 ms).
    let a_cfg = fast_config();
    // B: the same pings, but a budget far past the stalls below.
    let b_cfg = Config {
        liveness_budget: 100,
        ..fast_config()
    };
    let b = rt_b
        .block_on(ControlNode::bind(b_cfg, local("b"), "127.0.0.1:0"))
        .expect("bind b");
    let a = rt_a
        .block_on(ControlNode::bind(a_cfg, local("a"), "127.0.0.1:0"))
        .expect("bind a");
    let mut a_events = a.events();
    let (id, _) = rt_a.block_on(a.connect(b.local_addr())).expect("connect");
    let mut dead = Vec::new();
    for round in 0..8 {
        // A runs for a while (pings answered)...
        rt_a.block_on(async { tokio::time::sleep(Duration::from_millis(300)).await });
        // ...then its driver does not run for 3x its death bound.
        thread::sleep(Duration::from_millis(1200));
        loop {
            match a_events.try_recv() {
                Ok(ev) if ev.id == id && matches!(ev.event, Event::Dead { .. }) => {
                    dead.push(format!("round {round}: {:?}", ev.event));
                }
                Ok(_) | Err(TryRecvError::Lagged(_)) => {}
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            }
        }
    }
    rt_a.block_on(async { tokio::time::sleep(Duration::from_millis(500)).await });
    while let Ok(ev) = a_events.try_recv() {
        if ev.id == id && matches!(ev.event, Event::Dead { .. }) {
            dead.push(format!("after the rounds: {:?}", ev.event));
        }
    }
    assert!(
        dead.is_empty(),
        "A declared B, which answered throughout, dead after its own stalls: {dead:?}"
    );
    let peers = rt_a.block_on(a.peers()).expect("peers");
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(peers[0].state, State::Ready, "{peers:?}");
    rt_a.block_on(a.close());
    rt_b.block_on(b.close());
}
