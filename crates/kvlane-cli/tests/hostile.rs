//! Adversarial: `kvlane serve --psk` in a child process whose stdout and
//! stderr nobody reads, a key-holding agent here running transfers, and at
//! the same time floods of unauthenticated hellos, silent connections on
//! the control port, frame headers announcing 1 GiB and more, and garbage
//! on the data port. The legitimate transfers must all complete; the
//! server's memory, threads and fds stay bounded; SIGTERM ends it.
//!
//! Timings (p99 unloaded / loaded, SIGTERM to exit) are printed, not
//! asserted (run with `--nocapture` to see them); the exit after SIGTERM
//! has only a hang guard.

use kvlane::control::wire::{Hello, Identity, Message};
use kvlane::control::Config;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &str = "adversarial-suite-key";
const LAYERS: u32 = 2;
const BLOCKS: u32 = 32;
const BLOCK: u64 = 16 << 10;

const HELLOS: usize = 5_000;
const SILENT_CONTROL: usize = 2_000;
const SILENT_DATA: usize = 200;
const GARBAGE_DATA: usize = 200;

fn layout() -> KvLayout {
    KvLayout::new(
        LAYERS,
        BLOCKS,
        BLOCK,
        KvParts::Separate,
        LayoutOrder::LayerMajor,
    )
    .unwrap()
}

/// One value of `/proc/PID/status` (`VmRSS`, `VmHWM` in bytes; `Threads`).
fn status(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status is needed to measure the server: {e}"));
    let v = s
        .lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let n: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap();
    if v.contains("kB") {
        n * 1024
    } else {
        n
    }
}

fn fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd is needed to count the server's fds: {e}"))
        .count() as u64
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `kvlane serve` with a key; its first stdout line is read, then neither
/// stdout nor stderr is read again (full pipes must not stall it).
fn serve(data_port: u16) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["serve", "--listen", "127.0.0.1:0", "--psk", KEY])
        .args(["--data-listen", &format!("127.0.0.1:{data_port}")])
        .args([
            "--layers",
            &LAYERS.to_string(),
            "--blocks",
            &BLOCKS.to_string(),
        ])
        .args(["--block-size", &BLOCK.to_string()])
        .env_remove("KVLANE_PSK")
        // Every refused peer logs debug lines: lots of output into a pipe
        // nobody drains.
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvlane serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).expect("listening line");
    let addr = first
        .strip_prefix("listening ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line: {first}"))
        .to_owned();
    // Keep the pipe ends open (unread) for the life of the child.
    std::mem::forget(out);
    (child, addr)
}

// Raw ZMTP bytes, as kvlane-control's own flood tests send them.
#[path = "../../kvlane-control/tests/common/zmtp.rs"]
mod zmtp;
use zmtp::{long_frame_header, zmtp_dealer_preamble};

/// A ZMTP message of one frame.
fn zmtp_frame(body: &[u8]) -> Vec<u8> {
    let mut f = long_frame_header(body.len() as u64, false);
    f.extend_from_slice(body);
    f
}

/// A keyed hello from somebody without the key (they can never prove it).
fn unauthenticated_hello(i: usize) -> Vec<u8> {
    let id = Identity {
        engine_id: format!("flood-{i}"),
        ..Identity::default()
    };
    let mut h = Hello::new(id, Some(vec![i as u8; 32]), Vec::new(), None);
    h.auth = true;
    Message::Hello(h).encode().unwrap()
}

async fn agent() -> Agent {
    let len = layout().required_len().unwrap() as usize;
    let region = Region::from_vec(vec![0; len], Access::ALL).unwrap();
    let config = Config {
        keepalive_interval: Duration::from_millis(200),
        liveness_budget: 10,
        handshake_timeout: Duration::from_secs(10),
        ..Config::default()
    };
    Agent::builder()
        .engine_id("legit")
        .backend(BackendChoice::Tcp)
        .control_config(config)
        .psk(KEY.as_bytes().to_vec())
        .register_kv(layout(), region)
        .build()
        .await
        .unwrap()
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

async fn transfers(peer: &kvlane::Peer, n: usize) -> Vec<Duration> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let b = (i % 16) as u32;
        let t = Instant::now();
        peer.read_blocks(0..LAYERS, &[b], &[b + 16], None)
            .unwrap_or_else(|e| panic!("prepare transfer {i}: {e}"))
            .await
            .unwrap_or_else(|e| panic!("legitimate transfer {i} failed: {e}"));
        lat.push(t.elapsed());
    }
    lat
}

/// Floods running on threads until `stop`.
/// Floods running on threads until `stop`; `hellos` counts the hellos sent.
fn flood(
    control: String,
    data: String,
    stop: Arc<AtomicBool>,
    hellos: Arc<AtomicUsize>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    // Unauthenticated hellos, each on its own connection.
    for t in 0..2 {
        let (control, stop, hellos) = (control.clone(), Arc::clone(&stop), Arc::clone(&hellos));
        threads.push(std::thread::spawn(move || {
            // At least HELLOS in all, then on until `stop` (bounded).
            let mut i = t;
            while (i < HELLOS || !stop.load(Ordering::Relaxed)) && i < 40 * HELLOS {
                if let Ok(mut s) = TcpStream::connect(&control) {
                    let mut bytes = zmtp_dealer_preamble();
                    bytes.extend(zmtp_frame(&unauthenticated_hello(i)));
                    if s.write_all(&bytes).is_ok() {
                        hellos.fetch_add(1, Ordering::Relaxed);
                    }
                }
                i += 2;
            }
        }));
    }
    // Silent connections on the control port, held until the end.
    {
        let (control, stop) = (control.clone(), Arc::clone(&stop));
        threads.push(std::thread::spawn(move || {
            let held: Vec<_> = (0..SILENT_CONTROL)
                .filter_map(|_| TcpStream::connect(&control).ok())
                .collect();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(held);
        }));
    }
    // Frame headers announcing 1 GiB and more, then real bytes.
    {
        let control = control.clone();
        threads.push(std::thread::spawn(move || {
            for len in [1u64 << 30, 4 << 30, u64::MAX, 1 << 62] {
                if let Ok(mut s) = TcpStream::connect(&control) {
                    let _ = s.write_all(&zmtp_dealer_preamble());
                    let _ = s.write_all(&long_frame_header(len, false));
                    let chunk = vec![0x5au8; 1 << 20];
                    for _ in 0..64 {
                        if s.write_all(&chunk).is_err() {
                            break;
                        }
                    }
                }
            }
        }));
    }
    // Garbage and silence on the data port.
    {
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            let mut held = Vec::new();
            for i in 0..(SILENT_DATA + GARBAGE_DATA) {
                let Ok(mut s) = TcpStream::connect(&data) else {
                    continue;
                };
                if i % 2 == 0 {
                    let garbage: Vec<u8> = (0..4096u32).map(|x| (x * 7 + i as u32) as u8).collect();
                    let _ = s.write_all(&garbage);
                } else {
                    held.push(s);
                }
            }
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(held);
        }));
    }
    threads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holding_peer_is_served_through_floods_and_sigterm_ends_serve() {
    let data_port = free_port();
    let (mut child, addr) = serve(data_port);
    let pid = child.id();
    let agent = agent().await;
    let peer = agent.connect(&addr).await.expect("legitimate connect");
    let unloaded = transfers(&peer, 300).await;
    let idle_rss = status(pid, "VmRSS");
    let idle_threads = status(pid, "Threads");
    let idle_fds = fds(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let hellos = Arc::new(AtomicUsize::new(0));
    let threads = flood(
        addr.clone(),
        format!("127.0.0.1:{data_port}"),
        Arc::clone(&stop),
        Arc::clone(&hellos),
    );
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = Arc::clone(&sampling);
        std::thread::spawn(move || {
            let (mut threads, mut fds_max) = (0, 0);
            while sampling.load(Ordering::Relaxed) {
                threads = status(pid, "Threads").max(threads);
                fds_max = fds(pid).max(fds_max);
                std::thread::sleep(Duration::from_millis(10));
            }
            (threads, fds_max)
        })
    };
    // Legitimate transfers while the floods run (the hello floods go on
    // until `stop`, at least 5,000 hellos).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut loaded = Vec::new();
    while loaded.len() < 1_000 || hellos.load(Ordering::Relaxed) < HELLOS {
        loaded.extend(transfers(&peer, 100).await);
        assert!(
            loaded.len() < 1_000_000,
            "the hello flood never got {HELLOS} hellos out"
        );
    }
    let (n_loaded, n_unloaded) = (loaded.len(), unloaded.len());
    let peak_rss = status(pid, "VmHWM");
    sampling.store(false, Ordering::Relaxed);
    let (max_threads, max_fds) = sampler.join().expect("sampler");

    // SIGTERM while the hello flood still runs.
    let t = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("run kill (procps/coreutils is needed to send SIGTERM)");
    assert!(kill.success(), "kill -TERM {pid} failed");
    let exit = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t.elapsed() >= Duration::from_secs(10) {
            // Not left running after the test (a hung serve once was).
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve still running 10 s after SIGTERM under a flood");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let sigterm_to_exit = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        let _ = th.join();
    }
    agent.close().await;

    println!(
        "adversarial: transfers unloaded {n_unloaded} p99 {:?}, loaded {n_loaded} p99 {:?}; \
         serve RSS idle {} MiB, peak {} MiB; threads idle {idle_threads} max {max_threads}; \
         fds idle {idle_fds} max {max_fds}; SIGTERM to exit {sigterm_to_exit:?} ({exit})",
        p99(unloaded),
        p99(loaded),
        idle_rss >> 20,
        peak_rss >> 20,
    );
    assert!(
        peak_rss <= idle_rss + (64 << 20),
        "serve peak RSS {} MiB > idle {} MiB + 64 MiB",
        peak_rss >> 20,
        idle_rss >> 20
    );
    // Control: at most peer_cap + handshake_cap (1024 + 256) accepted
    // connections; data: today's tcp server caps its connections at 1024
    // (a thread each).
    assert!(
        max_fds <= idle_fds + 1280 + 1024,
        "serve held {max_fds} fds"
    );
    assert!(
        max_threads <= idle_threads + 1024,
        "serve ran {max_threads} threads"
    );
}

/// On a non-loopback address `serve` refuses to start without a key, naming
/// the address and both ways out; `--insecure` or `--psk` lets it start.
#[test]
fn serve_on_a_non_loopback_address_needs_a_key_or_insecure() {
    let bin = env!("CARGO_BIN_EXE_kvlane");
    let out = Command::new(bin)
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env_remove("KVLANE_PSK")
        .output()
        .expect("run kvlane serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "serve started without a key:\n{stderr}"
    );
    assert!(
        stderr.contains("0.0.0.0:0") && stderr.contains("--psk") && stderr.contains("--insecure"),
        "{stderr}"
    );
    for extra in [&["--insecure"][..], &["--psk", KEY]] {
        let mut child = Command::new(bin)
            .args(["serve", "--listen", "0.0.0.0:0"])
            .args(extra)
            .env_remove("KVLANE_PSK")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvlane serve");
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .expect("read");
        let _ = child.kill();
        let _ = child.wait();
        assert!(first.starts_with("listening "), "{extra:?}: {first:?}");
    }
}
