//! `BackendChoice::Auto` (the default) and peers on this host, two agents
//! in one process: shared memory on both sides gives shm, said by the
//! peer's backend kind and by the metrics' `rail` label; memory the
//! application allocated turns shm off and the transfer moves over tcp;
//! `same_host_shm(false)` and `KVLANE_SAME_HOST_SHM=0` give the old
//! verbs-or-tcp `Auto` (the variable: `tests/agent_auto_env.rs`);
//! `SameHost` stays shm. Across network namespaces:
//! `crates/kvlane-cli/tests/multihost.rs`.

#![cfg(target_os = "linux")]

use kvlane::data::{Access, BackendKind, Op, Region};
use kvlane::{Agent, AgentBuilder, BackendChoice, MemSpan};

const LEN: usize = 1 << 20;
const BLOCK: u64 = 64 << 10;

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

fn shared() -> Region {
    Region::alloc_shared(LEN, Access::ALL).unwrap()
}

/// An agent named `name` serving `region`, as `tweak` builds it.
async fn agent(name: &str, region: &Region, tweak: fn(AgentBuilder) -> AgentBuilder) -> Agent {
    tweak(builder(name, region.clone())).build().await.unwrap()
}

/// No change to the builder: `Auto`, the default.
fn auto(b: AgentBuilder) -> AgentBuilder {
    b
}

fn builder(name: &str, region: Region) -> AgentBuilder {
    Agent::builder()
        .engine_id(name)
        .listen("127.0.0.1:0")
        .register_region(region)
}

/// `initiator` connects to `target` (serving `remote`), READs all of it
/// into `local` and WRITEs it back changed; returns the peer's backend
/// kind and the initiator's metrics text.
async fn roundtrip(
    initiator: &Agent,
    local: &Region,
    target: &Agent,
    remote: &Region,
) -> (BackendKind, String) {
    remote.write(0, &pattern(1)).unwrap();
    let peer = initiator.connect(target.local_addr()).await.unwrap();
    let kind = peer.backend_kind().expect("attached");
    let spans = |r: &Region| -> Vec<MemSpan> {
        (0..LEN as u64 / BLOCK)
            .map(|b| MemSpan::new(r.addr() + b * BLOCK, BLOCK))
            .collect()
    };
    let read = peer
        .prepare_spans(Op::Read, &spans(local), &spans(remote), None)
        .unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(local.to_vec().unwrap() == pattern(1), "READ over {kind}");
    local.write(0, &pattern(5)).unwrap();
    let write = peer
        .prepare_spans(Op::Write, &spans(local), &spans(remote), None)
        .unwrap();
    peer.post(write).unwrap().await.unwrap();
    assert!(remote.to_vec().unwrap() == pattern(5), "WRITE over {kind}");
    (kind, initiator.metrics())
}

fn rail_of(metrics: &str) -> Vec<&str> {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvlane_transfers_total{"))
        .filter_map(|l| l.split("rail=\"").nth(1))
        .filter_map(|l| l.split('"').next())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_gives_two_agents_of_this_host_shm_with_shared_memory() {
    let (mine, theirs) = (shared(), shared());
    let t = agent("auto-target", &theirs, auto).await;
    let i = agent("auto-initiator", &mine, auto).await;
    let (kind, metrics) = roundtrip(&i, &mine, &t, &theirs).await;
    assert_eq!(kind, BackendKind::Shm);
    let rails = rail_of(&metrics);
    assert!(
        !rails.is_empty() && rails.iter().all(|r| *r == "shm"),
        "the transfers' rail label is not shm: {rails:?}\n{metrics}"
    );
    i.close().await;
    t.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_moves_memory_the_application_allocated_over_tcp() {
    // The target serves shared memory; this side serves plain memory (a
    // tensor's, an array's), which turns shm off here: both ways tcp.
    let (mine, theirs) = (Region::alloc(LEN, Access::ALL).unwrap(), shared());
    let t = agent("auto-target", &theirs, auto).await;
    let i = agent("auto-initiator", &mine, auto).await;
    let (kind, metrics) = roundtrip(&i, &mine, &t, &theirs).await;
    assert_eq!(kind, BackendKind::Tcp);
    assert!(rail_of(&metrics).iter().all(|r| *r == "tcp"), "{metrics}");
    // And the other way: the target's side of it is plain memory.
    let (kind, _) = roundtrip(&t, &theirs, &i, &mine).await;
    assert_eq!(kind, BackendKind::Tcp, "a target serving plain memory");
    i.close().await;
    t.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_registered_later_that_shm_cannot_serve_turns_shm_off_for_new_peers() {
    let (mine, theirs) = (shared(), shared());
    let t = agent("auto-target", &theirs, auto).await;
    let i = agent("auto-initiator", &mine, auto).await;
    i.register_region(Region::alloc(4096, Access::ALL).unwrap())
        .await
        .unwrap();
    let (kind, _) = roundtrip(&i, &mine, &t, &theirs).await;
    assert_eq!(kind, BackendKind::Tcp);
    i.close().await;
    t.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_shm_off_gives_tcp_and_same_host_still_asks_for_shm() {
    let (mine, theirs) = (shared(), shared());
    let t = agent("target", &theirs, |b| {
        b.backend(BackendChoice::SameHost).same_host_shm(false)
    })
    .await;
    let off = agent("off", &mine, |b| b.same_host_shm(false)).await;
    let (kind, _) = roundtrip(&off, &mine, &t, &theirs).await;
    assert_eq!(kind, BackendKind::Tcp, "Auto with same_host_shm(false)");
    off.close().await;
    let on = agent("on", &mine, auto).await;
    let (kind, _) = roundtrip(&on, &mine, &t, &theirs).await;
    assert_eq!(
        kind,
        BackendKind::Shm,
        "SameHost ignores same_host_shm(false)"
    );
    on.close().await;
    t.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_tcp_stays_plain_tcp() {
    let (mine, theirs) = (shared(), shared());
    let t = agent("target", &theirs, auto).await;
    let i = agent("tcp", &mine, |b| b.backend(BackendChoice::Tcp)).await;
    let (kind, _) = roundtrip(&i, &mine, &t, &theirs).await;
    assert_eq!(kind, BackendKind::Tcp);
    i.close().await;
    t.close().await;
}
