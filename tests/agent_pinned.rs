//! Liveness under the placement an engine imposes (issue 40): vLLM's CPU
//! worker pins its main thread to one core before it builds the transport,
//! so every thread kvlane starts inherits that core, which the engine's
//! own busy threads share. Two processes, each pinned to one core beside
//! threads that spin like model threads, run READs with a notification
//! for a while: no peer may be declared Suspect or Dead, no handshake may
//! fail, and every transfer must succeed. A wait that only a timer ends
//! (a lost wake-up, a task stuck behind a blocked worker) shows up here as
//! unanswered keep-alives and transfers that end at their deadline.
//!
//! The target is this test binary run again as a child process
//! (`pinned_target`, which does nothing unless `KVLANE_PINNED_CHILD` is set).
//! `KVLANE_PINNED_SECS` sets how long the transfers run (default 20).

use kvlane::control::Config;
use kvlane::data::{Access, Op, Region};
use kvlane::{Agent, BackendChoice, MemSpan, PeerEventKind};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const BLOCK: usize = 128 << 10;
const BLOCKS: usize = 4;
/// Busy threads beside kvlane on the pinned core, per process.
const SPINNERS: usize = 2;

/// Keep-alive every 200 ms, dead after 5 unanswered pings (1 s): long
/// against a scheduler's time slices (a few ms per runnable thread), short
/// against a wait that only a 10 s transfer deadline ends.
fn control() -> Config {
    Config {
        keepalive_interval: Duration::from_millis(200),
        liveness_budget: 5,
        ..Config::default()
    }
}

const TRANSFER_DEADLINE: Duration = Duration::from_secs(10);

/// Pins the calling thread to `cpu` (threads it starts later inherit it).
fn pin_to(cpu: usize) {
    // SAFETY: `cpu_set_t` is plain data for which all-zero is a valid
    // (empty) set; CPU_SET writes inside it for `cpu` < CPU_SETSIZE (checked
    // below), and sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of
    // it. Pid 0 is the calling thread.
    unsafe {
        assert!(cpu < libc::CPU_SETSIZE as usize);
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let rc = libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(
            rc,
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The first CPU this thread may run on.
fn first_cpu() -> usize {
    // SAFETY: as in `pin_to`; sched_getaffinity fills the set it is given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set);
        assert_eq!(
            rc,
            0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("no CPU in this thread's affinity mask")
    }
}

/// Threads that spin until `stop`, on the caller's CPUs (like an engine's
/// model threads).
fn spinners(stop: &Arc<AtomicBool>) -> Vec<thread::JoinHandle<()>> {
    (0..SPINNERS)
        .map(|i| {
            let stop = stop.clone();
            thread::Builder::new()
                .name(format!("spinner-{i}"))
                .spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                })
                .unwrap()
        })
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn agent(name: &str, region: Region) -> Agent {
    Agent::builder()
        .engine_id(name)
        .backend(BackendChoice::Tcp)
        .control_config(control())
        .transfer_deadline(TRANSFER_DEADLINE)
        .register_region(region)
        .build()
        .await
        .unwrap()
}

/// Peer events that break liveness, as lines (`Suspect`, `Dead`, ...).
fn watch_events(
    rt: &tokio::runtime::Runtime,
    a: &Agent,
    who: &'static str,
) -> Arc<std::sync::Mutex<Vec<String>>> {
    let bad = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut events = a.events();
    let b = bad.clone();
    let t0 = Instant::now();
    rt.spawn(async move {
        while let Ok(ev) = events.recv().await {
            let line = match &ev.kind {
                PeerEventKind::Suspect
                | PeerEventKind::Dead { .. }
                | PeerEventKind::Refused { .. }
                | PeerEventKind::Restarted { .. } => {
                    format!("{who} at {:?}: {} {:?}", t0.elapsed(), ev.addr, ev.kind)
                }
                _ => continue,
            };
            eprintln!("{line}");
            b.lock().unwrap().push(line);
        }
    });
    bad
}

/// The target process: pinned beside spinners, serves its region, takes
/// notifications, prints its address, and when its stdin closes prints
/// the liveness events it saw (`BAD ...`) and exits.
#[test]
#[ignore = "the child process of `pinned_processes_keep_their_peers_alive`"]
fn pinned_target() {
    let Ok(cpu) = std::env::var("KVLANE_PINNED_CHILD") else {
        return;
    };
    pin_to(cpu.parse().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let spin = spinners(&stop);
    let rt = runtime();
    let region = Region::from_vec(vec![7u8; BLOCK * BLOCKS], Access::ALL).unwrap();
    let a = rt.block_on(agent("pinned-target", region.clone()));
    let bad = watch_events(&rt, &a, "target");
    let mut notes = a.notifications().unwrap();
    rt.spawn(async move { while notes.recv().await.is_some() {} });
    println!("ADDR {} {} {}", a.local_addr(), region.addr(), region.len());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    stop.store(true, Ordering::Relaxed);
    for t in spin {
        t.join().unwrap();
    }
    for line in bad.lock().unwrap().iter() {
        println!("BAD {line}");
    }
    println!("END");
    rt.block_on(a.close());
}

#[test]
fn pinned_processes_keep_their_peers_alive() {
    let secs: u64 = std::env::var("KVLANE_PINNED_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let gap = Duration::from_millis(
        std::env::var("KVLANE_PINNED_GAP_MS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(50),
    );
    let cpu = first_cpu();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "pinned_target",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVLANE_PINNED_CHILD", cpu.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let (addr, remote_addr): (String, u64) = loop {
        let line = out
            .next()
            .expect("the target exited before it listened")
            .unwrap();
        // The harness may print the test's name on the same line.
        if let Some((_, rest)) = line.split_once("ADDR ") {
            let mut it = rest.split(' ');
            let addr = it.next().unwrap().to_owned();
            let raddr = it.next().unwrap().parse().unwrap();
            break (addr, raddr);
        }
    };

    // The initiator, as vLLM's worker: this thread pinned first, then the
    // engine's busy threads, then the transport. It reports its failures,
    // then closes its agent once the target has reported (a close is not a
    // liveness failure the target should see).
    let (report_tx, report_rx) = std::sync::mpsc::channel();
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let initiator = thread::spawn(move || {
        pin_to(cpu);
        let stop = Arc::new(AtomicBool::new(false));
        let spin = spinners(&stop);
        let rt = runtime();
        let region = Region::from_vec(vec![0u8; BLOCK * BLOCKS], Access::ALL).unwrap();
        let a = rt.block_on(agent("pinned-initiator", region.clone()));
        let bad = watch_events(&rt, &a, "initiator");
        let mut failures = Vec::new();
        let t0 = Instant::now();
        match rt.block_on(a.connect(&addr)) {
            Err(e) => failures.push(format!("connect failed: {e}")),
            Ok(peer) => {
                let local: Vec<_> = (0..BLOCKS)
                    .map(|i| MemSpan::new(region.addr() + (i * BLOCK) as u64, BLOCK as u64))
                    .collect();
                let remote: Vec<_> = (0..BLOCKS)
                    .map(|i| MemSpan::new(remote_addr + (i * BLOCK) as u64, BLOCK as u64))
                    .collect();
                let mut n = 0u64;
                while t0.elapsed() < Duration::from_secs(secs) {
                    let started = Instant::now();
                    let r = peer
                        .prepare_spans(Op::Read, &local, &remote, Some(b"blocks ready"))
                        .and_then(|p| peer.post(p))
                        .and_then(|h| h.wait());
                    n += 1;
                    if std::env::var_os("KVLANE_PINNED_VERBOSE").is_some() {
                        eprintln!("transfer {n}: {:?}", started.elapsed());
                    }
                    if let Err(e) = r {
                        failures.push(format!(
                            "transfer {n} failed after {:?} at {:?}: {e}",
                            started.elapsed(),
                            t0.elapsed()
                        ));
                        break;
                    }
                    // Engine steps between loads: the transport goes idle
                    // and its threads park between transfers.
                    thread::sleep(gap);
                }
                eprintln!("initiator: {n} transfers in {:?}", t0.elapsed());
            }
        }
        failures.extend(bad.lock().unwrap().iter().cloned());
        let _ = report_tx.send(failures);
        let _ = close_rx.recv();
        stop.store(true, Ordering::Relaxed);
        for t in spin {
            t.join().unwrap();
        }
        rt.block_on(a.close());
    });
    let failures = report_rx.recv().expect("the initiator thread panicked");

    drop(child.stdin.take());
    let mut target_bad = Vec::new();
    for line in out {
        let line = line.unwrap();
        if let Some((_, b)) = line.split_once("BAD ") {
            target_bad.push(b.to_owned());
        }
    }
    let status = child.wait().unwrap();
    drop(close_tx);
    initiator.join().unwrap();
    assert!(status.success(), "the target process failed: {status}");
    assert!(
        failures.is_empty() && target_bad.is_empty(),
        "liveness broken on a pinned core:\ninitiator: {failures:#?}\ntarget: {target_bad:#?}"
    );
}
