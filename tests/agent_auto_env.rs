//! `KVLANE_SAME_HOST_SHM` turns shm off under `Auto`; the builder's
//! `same_host_shm` wins over it; a value it does not know fails the build
//! naming it. Its own test binary: it sets a variable of the process.

#![cfg(target_os = "linux")]

use kvlane::data::{Access, BackendKind, Region};
use kvlane::{Agent, AgentBuilder};

fn builder(name: &str) -> AgentBuilder {
    Agent::builder()
        .engine_id(name)
        .listen("127.0.0.1:0")
        .register_region(Region::alloc_shared(1 << 16, Access::ALL).unwrap())
}

async fn kind_to(a: &Agent, target: &Agent) -> BackendKind {
    let peer = a.connect(target.local_addr()).await.unwrap();
    peer.backend_kind().expect("attached")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_turns_shm_off_and_a_bad_value_is_named() {
    let t = builder("target").build().await.unwrap();
    std::env::set_var(kvlane::ENV_SAME_HOST_SHM, "maybe");
    let e = builder("bad").build().await.unwrap_err();
    assert!(e.to_string().contains("KVLANE_SAME_HOST_SHM"), "{e}");
    assert!(e.to_string().contains("maybe"), "{e}");
    std::env::set_var(kvlane::ENV_SAME_HOST_SHM, "0");
    let off = builder("off").build().await.unwrap();
    let on = builder("on").same_host_shm(true).build().await.unwrap();
    std::env::remove_var(kvlane::ENV_SAME_HOST_SHM);
    let unset = builder("unset").build().await.unwrap();
    assert_eq!(
        kind_to(&off, &t).await,
        BackendKind::Tcp,
        "KVLANE_SAME_HOST_SHM=0"
    );
    assert_eq!(kind_to(&on, &t).await, BackendKind::Shm, "the builder wins");
    assert_eq!(kind_to(&unset, &t).await, BackendKind::Shm, "on by default");
    for a in [off, on, unset, t] {
        a.close().await;
    }
}
