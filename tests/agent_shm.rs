//! The shm backend through the facade, across two processes: `Auto` (the
//! default; `SameHost` is its alias) picks shm for a peer on this host
//! whose regions are shareable, data
//! moves both ways, a WRITE's notification arrives after its bytes; a
//! killed target fails in-flight transfers `PeerLost` within the liveness
//! budget, a restarted one makes old plans `Stale`; a target that tries to
//! truncate its memory under transfers harms nobody; memory the engine
//! allocated goes over shm with cross-memory attach, over tcp without;
//! GPU memory (the MOCK CUDA driver, not a GPU) goes over shm by IPC
//! handle.
//!
//! The target is this test binary run again as `shm_target` (which does
//! nothing unless `KVLANE_SHM_CHILD` is set).

#![cfg(target_os = "linux")]

use kvlane::control::Config;
use kvlane::data::conformance::{contents, use_mock_cuda};
use kvlane::data::{Access, BackendKind, Op, Region};
use kvlane::{Agent, BackendChoice, MemSpan, PeerEventKind};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const LEN: usize = 4 << 20;
const BLOCK: usize = 64 << 10;

/// Keep-alive every 200 ms, dead after 5 unanswered pings: a 1 s budget.
fn control() -> Config {
    Config {
        keepalive_interval: Duration::from_millis(200),
        liveness_budget: 5,
        ..Config::default()
    }
}

fn budget() -> Duration {
    let c = control();
    c.keepalive_interval * c.liveness_budget
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// FNV-1a, to compare a region across processes in one line.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn shared(seed: u8) -> Region {
    let r = Region::alloc_shared(LEN, Access::ALL).unwrap();
    r.write(0, &pattern(seed)).unwrap();
    r
}

async fn agent(name: &str, listen: &str, backend: BackendChoice, region: Region) -> Agent {
    agent_with(name, listen, backend, region, false).await
}

/// [`agent`], with cross-memory attach opted in when `attach`.
async fn agent_with(
    name: &str,
    listen: &str,
    backend: BackendChoice,
    region: Region,
    attach: bool,
) -> Agent {
    Agent::builder()
        .engine_id(name)
        .listen(listen)
        .backend(backend)
        .shm_cross_memory_attach(attach)
        .control_config(control())
        .transfer_deadline(Duration::from_secs(30))
        .register_region(region)
        .build()
        .await
        .unwrap()
}

/// The target process: an agent on `KVLANE_SHM_LISTEN` (default any port)
/// serving a shared region filled with `pattern(1)`; prints `ADDR <addr>
/// <region addr>`, `NOTE <payload> <fnv of the region>` per notification;
/// runs until its stdin closes. Mode `attach`: the region is
/// `Region::alloc` (not shareable), served with cross-memory attach.
/// Mode `gpu`: the region is memory of the mock CUDA driver's `cuda:0`.
/// Mode `truncate`: a thread tries to shrink
/// and grow the region's memory file all along, and `TRUNCATE <done>
/// <refused>` is printed at the end.
#[test]
#[ignore = "the target process of the tests in this file; does nothing unless KVLANE_SHM_CHILD is set"]
fn shm_target() {
    let Ok(mode) = std::env::var("KVLANE_SHM_CHILD") else {
        return;
    };
    let listen = std::env::var("KVLANE_SHM_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let region = if mode == "attach" {
        // Memory the engine allocated, served by cross-memory attach.
        let r = Region::alloc(LEN, Access::ALL).unwrap();
        r.write(0, &pattern(1)).unwrap();
        r
    } else if mode == "gpu" {
        // GPU memory (the MOCK CUDA driver), served by IPC handle.
        let r = Region::alloc_device(use_mock_cuda(), LEN, Access::ALL).unwrap();
        r.copy_in(0, &pattern(1)).unwrap();
        r
    } else {
        shared(1)
    };
    let a = rt.block_on(agent_with(
        "shm-target",
        &listen,
        BackendChoice::Auto,
        region.clone(),
        mode == "attach",
    ));
    let mut notes = a.notifications().unwrap();
    let seen = region.clone();
    rt.spawn(async move {
        while let Some(n) = notes.recv().await {
            let sum = fnv(&contents(&seen));
            println!("NOTE {} {sum}", String::from_utf8_lossy(&n.payload));
            std::io::stdout().flush().unwrap();
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (done, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let truncator = (mode == "truncate").then(|| {
        let files = memory_files();
        assert!(!files.is_empty(), "no memory file found in /proc/self/fd");
        let (stop, done, refused) = (stop.clone(), done.clone(), refused.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for f in &files {
                    for len in [0, 4096, 2 * LEN as u64] {
                        match f.set_len(len) {
                            Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                            Err(_) => refused.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                }
                // Not a busy loop: on a small machine it would starve the
                // keep-alives of both processes.
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    });
    println!("ADDR {} {}", a.local_addr(), region.addr());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = truncator {
        t.join().unwrap();
        println!(
            "TRUNCATE {} {}",
            done.load(Ordering::Relaxed),
            refused.load(Ordering::Relaxed)
        );
    }
    println!("END");
    std::io::stdout().flush().unwrap();
    rt.block_on(a.close());
}

/// This process's memory files, opened for writing through `/proc`.
fn memory_files() -> Vec<std::fs::File> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let target = std::fs::read_link(&path).ok()?;
            target
                .to_string_lossy()
                .starts_with("/memfd:")
                .then(|| std::fs::OpenOptions::new().write(true).open(&path).ok())
                .flatten()
        })
        .collect()
}

struct Target {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    addr: String,
    region_addr: u64,
}

impl Target {
    fn spawn(mode: &str, listen: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "shm_target", "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .env("KVLANE_SHM_CHILD", mode)
            .env("KVLANE_SHM_LISTEN", listen)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut t = Self {
            child,
            stdin,
            lines,
            addr: String::new(),
            region_addr: 0,
        };
        let rest = t.expect("ADDR ");
        let mut it = rest.split(' ');
        t.addr = it.next().unwrap().to_owned();
        t.region_addr = it.next().unwrap().parse().unwrap();
        t
    }

    /// The rest of the next line that contains `prefix` (the harness may
    /// print its own text before it on the same line).
    fn expect(&self, prefix: &str) -> String {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("the target printed no {prefix:?}: {e}"));
            if let Some((_, rest)) = line.split_once(prefix) {
                return rest.to_owned();
            }
        }
    }

    /// Closes its stdin: it prints what it has to say and exits.
    fn finish(&mut self) {
        self.stdin = None;
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(t: &Target, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &t.pid()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {}", t.pid());
}

/// Waits until every thread of `t` is stopped (a signal is delivered to
/// a thread running on another CPU a little later).
fn wait_stopped(t: &Target) {
    let until = Instant::now() + Duration::from_secs(10);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{}/task", t.pid()))
            .unwrap()
            .all(|task| {
                let stat =
                    std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name.
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
            })
    };
    while !stopped() {
        assert!(Instant::now() < until, "the target never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn spans(
    local: &Region,
    remote: u64,
    blocks: std::ops::Range<usize>,
) -> (Vec<MemSpan>, Vec<MemSpan>) {
    blocks
        .map(|b| {
            let off = (b * BLOCK) as u64;
            (
                MemSpan::new(local.addr() + off, BLOCK as u64),
                MemSpan::new(remote + off, BLOCK as u64),
            )
        })
        .unzip()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_shm_for_a_process_on_this_host_and_moves_data_both_ways() {
    let target = Target::spawn("serve", "127.0.0.1:0");
    let mem = shared(9);
    let a = agent(
        "shm-initiator",
        "127.0.0.1:0",
        BackendChoice::Auto,
        mem.clone(),
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    // READ the target's whole region.
    let (local, remote) = spans(&mem, target.region_addr, 0..LEN / BLOCK);
    let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(mem.to_vec().unwrap() == pattern(1), "READ over shm");
    // WRITE it back changed; the notification comes after every byte.
    mem.write(0, &pattern(5)).unwrap();
    let write = peer
        .prepare_spans(Op::Write, &local, &remote, Some(b"w1"))
        .unwrap();
    peer.post(write).unwrap().await.unwrap();
    let note = target.expect("NOTE w1 ");
    assert_eq!(
        note.parse::<u64>().unwrap(),
        fnv(&pattern(5)),
        "WRITE over shm"
    );
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_uses_tcp_when_this_side_serves_memory_that_is_not_shareable() {
    let target = Target::spawn("serve", "127.0.0.1:0");
    let mem = Region::alloc(LEN, Access::ALL).unwrap();
    let a = agent(
        "tcp-initiator",
        "127.0.0.1:0",
        BackendChoice::Auto,
        mem.clone(),
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Tcp));
    let (local, remote) = spans(&mem, target.region_addr, 0..4);
    let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(mem.to_vec().unwrap()[..4 * BLOCK] == pattern(1)[..4 * BLOCK]);
    a.close().await;
}

/// Memory the engine allocated on both sides, cross-memory attach opted
/// in on both: `SameHost` picks shm, data moves both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_serves_memory_the_engine_allocated_with_cross_memory_attach() {
    let target = Target::spawn("attach", "127.0.0.1:0");
    let mem = Region::alloc(LEN, Access::ALL).unwrap();
    let a = agent_with(
        "attach-initiator",
        "127.0.0.1:0",
        BackendChoice::SameHost,
        mem.clone(),
        true,
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    let (local, remote) = spans(&mem, target.region_addr, 0..LEN / BLOCK);
    let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(mem.to_vec().unwrap() == pattern(1), "READ over shm");
    mem.write(0, &pattern(5)).unwrap();
    let write = peer
        .prepare_spans(Op::Write, &local, &remote, Some(b"w1"))
        .unwrap();
    peer.post(write).unwrap().await.unwrap();
    let note = target.expect("NOTE w1 ");
    assert_eq!(
        note.parse::<u64>().unwrap(),
        fnv(&pattern(5)),
        "WRITE over shm"
    );
    a.close().await;
}

/// GPU memory on both sides (the MOCK CUDA driver, not a GPU):
/// `SameHost` picks shm, which maps the target's memory by IPC handle;
/// data moves both ways between the two processes' device memory, the
/// notification after the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_serves_gpu_memory_by_ipc_handle() {
    let target = Target::spawn("gpu", "127.0.0.1:0");
    let mem = Region::alloc_device(use_mock_cuda(), LEN, Access::ALL).unwrap();
    mem.copy_in(0, &pattern(9)).unwrap();
    let a = agent(
        "gpu-initiator",
        "127.0.0.1:0",
        BackendChoice::SameHost,
        mem.clone(),
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    let (local, remote) = spans(&mem, target.region_addr, 0..LEN / BLOCK);
    let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(contents(&mem) == pattern(1), "READ over shm");
    mem.copy_in(0, &pattern(5)).unwrap();
    let write = peer
        .prepare_spans(Op::Write, &local, &remote, Some(b"w1"))
        .unwrap();
    peer.post(write).unwrap().await.unwrap();
    let note = target.expect("NOTE w1 ");
    assert_eq!(
        note.parse::<u64>().unwrap(),
        fnv(&pattern(5)),
        "WRITE over shm"
    );
    a.close().await;
}

/// The same target, but this side does not opt in while it serves memory
/// that is not shareable: `Auto` (the default) uses tcp for the peer, and
/// the data still moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_without_the_opt_in_serves_engine_memory_over_tcp() {
    let target = Target::spawn("attach", "127.0.0.1:0");
    let mem = Region::alloc(LEN, Access::ALL).unwrap();
    let a = Agent::builder()
        .engine_id("no-attach")
        .control_config(control())
        .register_region(mem.clone())
        .build()
        .await
        .unwrap();
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Tcp));
    let (local, remote) = spans(&mem, target.region_addr, 0..4);
    let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(read).unwrap().await.unwrap();
    assert!(mem.to_vec().unwrap()[..4 * BLOCK] == pattern(1)[..4 * BLOCK]);
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_shm_is_refused_memory_that_is_not_shareable() {
    let e = Agent::builder()
        .backend(BackendChoice::Shm)
        .register_region(Region::alloc(4096, Access::ALL).unwrap())
        .build()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("alloc_shared"), "{e}");
    assert!(e.to_string().contains("cross_memory_attach"), "{e}");
    // With the opt-in it is served.
    let a = Agent::builder()
        .backend(BackendChoice::Shm)
        .shm_cross_memory_attach(true)
        .register_region(Region::alloc(4096, Access::ALL).unwrap())
        .build()
        .await
        .unwrap();
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_target_fails_in_flight_transfers_peer_lost_within_the_budget() {
    let target = Target::spawn("serve", "127.0.0.1:0");
    let mem = shared(9);
    let a = agent(
        "shm-initiator",
        "127.0.0.1:0",
        BackendChoice::Shm,
        mem.clone(),
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    // A stopped target answers no notification: these WRITEs are copied
    // and stay in flight, waiting for its answer.
    signal(&target, "-STOP");
    wait_stopped(&target);
    let (local, remote) = spans(&mem, target.region_addr, 0..8);
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let p = peer
                .prepare_spans(Op::Write, &local, &remote, Some(format!("n{i}").as_bytes()))
                .unwrap();
            peer.post(p).unwrap()
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    signal(&target, "-KILL");
    let killed = Instant::now();
    for h in handles {
        let e = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("a transfer outlived its dead target")
            .expect_err("a transfer to a stopped, then killed target succeeded");
        assert!(e.is_peer_lost(), "expected PeerLost, got {e}");
    }
    let took = killed.elapsed();
    assert!(
        took <= budget(),
        "in-flight transfers failed {took:?} after the kill, past the {:?} liveness budget",
        budget()
    );
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_target_makes_old_plans_stale_and_new_ones_run_over_shm() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let target = Target::spawn("serve", &listen);
    let mem = shared(9);
    let a = agent(
        "shm-initiator",
        "127.0.0.1:0",
        BackendChoice::SameHost,
        mem.clone(),
    )
    .await;
    let mut events = a.events();
    let peer = a.connect(&target.addr).await.unwrap();
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    let old = peer.incarnation().unwrap();
    let (local, remote) = spans(&mem, target.region_addr, 0..2);
    let stale = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    drop(target);
    let target = Target::spawn("serve", &listen);
    let new = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let PeerEventKind::Restarted { new, .. } = events.recv().await.unwrap().kind {
                break new;
            }
        }
    })
    .await
    .expect("no Restarted event");
    assert_ne!(new, old);
    tokio::time::timeout(Duration::from_secs(20), async {
        while peer.incarnation() != Some(new) || !peer.is_attached() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the restarted target was never attached");
    let e = peer.post(stale).unwrap_err();
    assert!(e.is_stale(), "{e}");
    assert_eq!(peer.backend_kind(), Some(BackendKind::Shm));
    let (local, remote) = spans(&mem, target.region_addr, 0..2);
    let fresh = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
    peer.post(fresh).unwrap().await.unwrap();
    assert!(mem.to_vec().unwrap()[..2 * BLOCK] == pattern(1)[..2 * BLOCK]);
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_truncating_its_memory_under_transfers_cannot_crash_the_initiator() {
    let mut target = Target::spawn("truncate", "127.0.0.1:0");
    let mem = shared(9);
    let a = agent(
        "shm-initiator",
        "127.0.0.1:0",
        BackendChoice::Shm,
        mem.clone(),
    )
    .await;
    let peer = a.connect(&target.addr).await.unwrap();
    let (local, remote) = spans(&mem, target.region_addr, 0..LEN / BLOCK);
    for round in 0..50u8 {
        let read = peer.prepare_spans(Op::Read, &local, &remote, None).unwrap();
        peer.post(read).unwrap().await.unwrap();
        let write = peer
            .prepare_spans(Op::Write, &local, &remote, None)
            .unwrap();
        peer.post(write).unwrap().await.unwrap();
        assert!(mem.to_vec().unwrap() == pattern(1), "round {round}");
    }
    target.finish();
    let counts = target.expect("TRUNCATE ");
    let (done, refused) = counts.split_once(' ').unwrap();
    assert_eq!(done, "0", "the target resized its memory file");
    assert!(refused.parse::<u64>().unwrap() > 0, "no resize was tried");
    a.close().await;
}
