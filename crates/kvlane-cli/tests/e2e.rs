//! End to end: `kvlane serve` in a child process, an agent here, ZMQ
//! control plane and tcp data plane on 127.0.0.1.

use kvlane::control::Config;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, PeerEventKind};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const LAYERS: u32 = 2;
const BLOCKS: u32 = 32;
const BLOCK: u64 = 64 << 10;

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

/// What `kvlane serve --seed` fills its cache with.
fn pattern_byte(seed: u8, i: u64) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)
}

struct Served {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
}

impl Served {
    fn start(listen: &str, seed: u8, psk: Option<&str>) -> Self {
        Self::start_with(listen, seed, psk, &[])
    }

    fn start_with(listen: &str, seed: u8, psk: Option<&str>, extra: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvlane"));
        cmd.args(["serve", "--listen", listen, "--engine-id", "decode"])
            .args([
                "--layers",
                &LAYERS.to_string(),
                "--blocks",
                &BLOCKS.to_string(),
            ])
            .args([
                "--block-size",
                &BLOCK.to_string(),
                "--seed",
                &seed.to_string(),
            ])
            .args(extra)
            .env_remove("KVLANE_PSK")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(k) = psk {
            cmd.args(["--psk", k]);
        }
        let mut child = cmd.spawn().expect("spawn kvlane serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("serve printed nothing");
        let addr = first
            .strip_prefix("listening ")
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("unexpected first line: {first}"))
            .to_owned();
        Self { child, addr, lines }
    }

    fn wait_line(&self, needle: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("serve never printed {needle:?}"));
            if l.contains(needle) {
                return l;
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn initiator(psk: Option<&str>) -> (Agent, Region) {
    let len = layout().required_len().unwrap() as usize;
    let region = Region::from_vec(
        (0..len as u64).map(|i| pattern_byte(200, i)).collect(),
        Access::ALL,
    )
    .unwrap();
    let config = Config {
        keepalive_interval: Duration::from_millis(100),
        liveness_budget: 3,
        handshake_timeout: Duration::from_secs(3),
        backoff_max: Duration::from_millis(200),
        ..Config::default()
    };
    let mut b = Agent::builder()
        .engine_id("prefill")
        .backend(BackendChoice::Tcp)
        .control_config(config)
        .register_kv(layout(), region.clone());
    if let Some(k) = psk {
        b = b.psk(k.as_bytes().to_vec());
    }
    (b.build().await.unwrap(), region)
}

fn block(r: &Region, layer: u32, part: u64, id: u32) -> Vec<u8> {
    let mut out = vec![0; BLOCK as usize];
    r.read(layout().offset(layer, part, id).unwrap(), &mut out)
        .unwrap();
    out
}

fn served_block(seed: u8, layer: u32, part: u64, id: u32) -> Vec<u8> {
    let off = layout().offset(layer, part, id).unwrap();
    (off..off + BLOCK).map(|i| pattern_byte(seed, i)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_read_and_write_verified() {
    let served = Served::start("127.0.0.1:0", 5, None);
    let (agent, local) = initiator(None).await;
    let peer = agent.connect(&served.addr).await.unwrap();
    assert_eq!(peer.engine_id(), "decode");

    // READ: remote blocks 1..4 land in local blocks 10..13, byte for byte.
    peer.read_blocks(0..LAYERS, &[10, 11, 12], &[1, 2, 3], None)
        .unwrap()
        .await
        .unwrap();
    for (l, r) in [(10, 1), (11, 2), (12, 3)] {
        for layer in 0..LAYERS {
            for part in 0..2 {
                assert!(
                    block(&local, layer, part, l) == served_block(5, layer, part, r),
                    "READ block {r} layer {layer}"
                );
            }
        }
    }
    // WRITE with a notification, then READ it back into other blocks.
    peer.write_blocks(0..LAYERS, &[4, 5], &[20, 21], Some(b"req-1 done"))
        .unwrap()
        .await
        .unwrap();
    let line = served.wait_line("notification");
    assert!(
        line.contains("from=prefill") && line.contains("req-1 done"),
        "{line}"
    );
    peer.read_blocks(0..LAYERS, &[30, 31], &[20, 21], None)
        .unwrap()
        .await
        .unwrap();
    for (a, b) in [(4, 30), (5, 31)] {
        for layer in 0..LAYERS {
            for part in 0..2 {
                assert!(
                    block(&local, layer, part, a) == block(&local, layer, part, b),
                    "WRITE/READ block {a} layer {layer}"
                );
            }
        }
    }
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_metrics_are_scraped_over_http_while_a_peer_is_up() {
    let served = Served::start_with("127.0.0.1:0", 5, None, &["--metrics", "127.0.0.1:0"]);
    let line = served.wait_line("metrics http://");
    let url = line.strip_prefix("metrics http://").unwrap();
    let at = url.strip_suffix("/metrics").unwrap().to_string();
    let scrape = move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&at).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let before = scrape();
    assert!(before.starts_with("HTTP/1.1 200 OK"), "{before}");
    assert!(before.contains("kvlane_peers{state=\"up\"} 0"), "{before}");
    let (agent, _local) = initiator(None).await;
    let peer = agent.connect(&served.addr).await.unwrap();
    peer.write_blocks(0..1, &[1], &[2], Some(b"m"))
        .unwrap()
        .await
        .unwrap();
    served.wait_line("notification");
    // serve attaches its own data plane back to us in a task of its own:
    // the peer shows as attaching, then up.
    let mut during = String::new();
    for _ in 0..100 {
        let s = scrape.clone();
        during = tokio::task::spawn_blocking(s).await.unwrap();
        if during.contains("kvlane_peers{state=\"up\"} 1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(during.contains("kvlane_peers{state=\"up\"} 1"), "{during}");
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_target_fails_transfers_then_restart_recovers() {
    let mut served = Served::start("127.0.0.1:0", 5, None);
    let addr = served.addr.clone();
    let (agent, local) = initiator(None).await;
    let mut events = agent.events();
    let peer = agent.connect(&addr).await.unwrap();
    let old = peer.incarnation().unwrap();

    // Keep the data plane busy, then kill the target mid-transfer.
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let mut handles = Vec::new();
    for _ in 0..40 {
        handles.push(peer.write_blocks(0..LAYERS, &ids, &ids, None).unwrap());
    }
    served.child.kill().unwrap();
    served.child.wait().unwrap();
    let mut lost = 0;
    for h in handles {
        // Each transfer has a 30 s deadline; a dead peer must end them sooner.
        match tokio::time::timeout(Duration::from_secs(15), h)
            .await
            .expect("transfer hung after the target died")
        {
            Ok(()) => {}
            Err(e) => {
                assert!(e.is_peer_lost(), "expected PeerLost, got {e}");
                lost += 1;
            }
        }
    }
    assert!(
        lost > 0,
        "killing the target mid-transfer failed no transfer"
    );
    let dead = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            if let PeerEventKind::Dead { .. } = events.recv().await.unwrap().kind {
                break;
            }
        }
    })
    .await;
    assert!(dead.is_ok(), "no Dead event after the target was killed");

    // Start it again on the same address: restarted, then transfers work.
    let _served2 = Served::start(&addr, 7, None);
    let (o, n) = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let PeerEventKind::Restarted { old, new } = events.recv().await.unwrap().kind {
                break (old, new);
            }
        }
    })
    .await
    .expect("no Restarted event");
    assert_eq!(o, old);
    assert_ne!(n, old);
    tokio::time::timeout(Duration::from_secs(20), async {
        while peer.incarnation() != Some(n)
            || peer
                .prepare(kvlane::data::Op::Read, 0..1, &[0], &[0], None)
                .is_err()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("peer never came back");
    peer.read_blocks(0..LAYERS, &[9], &[3], None)
        .unwrap()
        .await
        .unwrap();
    for layer in 0..LAYERS {
        assert!(
            block(&local, layer, 1, 9) == served_block(7, layer, 1, 3),
            "READ after restart"
        );
    }
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_pre_shared_key_is_refused() {
    let served = Served::start("127.0.0.1:0", 5, Some("right-key"));
    let (agent, _) = initiator(Some("wrong-key")).await;
    let e = agent
        .connect(&served.addr)
        .await
        .expect_err("wrong key accepted");
    assert!(
        e.is_refused(),
        "expected a refusal, got {e} ({:?})",
        e.kind()
    );
    agent.close().await;
    let (agent, _) = initiator(Some("right-key")).await;
    let peer = agent
        .connect(&served.addr)
        .await
        .expect("right key refused");
    peer.read_blocks(0..1, &[0], &[0], None)
        .unwrap()
        .await
        .unwrap();
    agent.close().await;
}

#[test]
fn ping_unreachable_fails_fast_naming_the_address() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["ping", "127.0.0.1:1", "--timeout", "2s"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("127.0.0.1:1"), "{err}");
}

#[test]
fn ping_measures_round_trips() {
    let served = Served::start("127.0.0.1:0", 1, None);
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["ping", &served.addr, "--count", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches("pong from").count(), 3, "{text}");
    assert!(text.contains("engine=decode"), "{text}");
}

/// `kvlane ping ... | head -1`: stdout closes after the first line; the
/// later lines must not panic the process (`println!` does on a closed
/// pipe), and the pings still run to their end.
#[test]
fn ping_into_a_closed_pipe_does_not_panic() {
    let served = Served::start("127.0.0.1:0", 1, None);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["ping", &served.addr, "--count", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first).unwrap();
    // The reader (and the pipe's read end) is dropped here, as `head` exits.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(first.contains("connected to"), "{first}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?}: {err}", out.status);
}

/// What an initiator printed against a `kvlane bench --role target`.
struct BenchRun {
    /// The target's first line.
    first: String,
    /// `(backend, op, block_size)` of every JSON row.
    points: Vec<(String, String, u64)>,
    rows: Vec<serde_json::Value>,
    stderr: String,
}

/// `kvlane bench --role target` (with `target_args`) and an initiator
/// (with `initiator_args`) against it.
fn bench_two_processes(target_args: &[&str], initiator_args: &[&str]) -> BenchRun {
    let cmd = Command::new(env!("CARGO_BIN_EXE_kvlane"));
    let (mut target, first, addr) = bench_target(cmd, target_args);
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["bench", "--role", "initiator", "--connect", &addr, "--json"])
        .args(["--block-sizes", "4K,64K", "--batch", "4"])
        .args(["--duration", "50ms"])
        .args(initiator_args)
        .output()
        .unwrap();
    let _ = target.kill();
    let _ = target.wait();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    let points = rows
        .iter()
        .map(|r| {
            (
                r["backend"].as_str().unwrap().to_owned(),
                r["op"].as_str().unwrap().to_owned(),
                r["block_size"].as_u64().unwrap(),
            )
        })
        .collect();
    BenchRun {
        first,
        points,
        rows,
        stderr,
    }
}

/// Starts `cmd` (`kvlane`, no arguments yet) as `bench --role target` on
/// 127.0.0.1 with a 4 MiB pool and `extra` arguments: the child, its first
/// line and the address it listens on.
fn bench_target(mut cmd: Command, extra: &[&str]) -> (Child, String, String) {
    let mut target = cmd
        .args(["bench", "--role", "target", "--listen", "127.0.0.1:0"])
        .args(["--pool", "4M"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(target.stdout.take().unwrap()).lines();
    let first = lines.next().expect("target printed nothing").unwrap();
    let addr = first
        .strip_prefix("listening ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{first}"))
        .to_owned();
    (target, first, addr)
}

fn points(kinds: &[(&str, &str)]) -> Vec<(String, String, u64)> {
    [4096, 65536]
        .into_iter()
        .flat_map(|b| {
            kinds
                .iter()
                .map(move |(backend, op)| ((*backend).to_owned(), (*op).to_owned(), b))
        })
        .collect()
}

#[test]
fn bench_across_two_processes_reports_every_point_and_the_link_ceiling() {
    let tcp = ["--backend", "tcp"];
    let BenchRun {
        first,
        points: points_seen,
        rows,
        stderr,
    } = bench_two_processes(&tcp, &tcp);
    assert!(first.contains(" raw-tcp="), "{first}");
    // Per block size: the raw-tcp ceiling of the link (READ- and
    // WRITE-shaped, against the target's raw port), then the agent.
    assert_eq!(
        points_seen,
        points(&[
            ("raw-tcp", "read"),
            ("raw-tcp", "write"),
            ("tcp", "read"),
            ("tcp", "write")
        ])
    );
    for r in &rows {
        assert!(
            r["gbps"].as_f64().unwrap() > 0.0 && r["transfers"].as_u64().unwrap() >= 12,
            "{r}"
        );
    }
    assert!(
        stderr.contains("raw-tcp ceiling: 4 streams to 127.0.0.1:"),
        "{stderr}"
    );
    assert!(!stderr.contains("WARN"), "{stderr}");
}

/// `--backend shm` on both sides, and the default (`auto`) on both sides
/// of one host, which picks shm for the target (both pools are shareable
/// memory): the agent's rows are shm, and the initiator measures the
/// ceiling of a peer on its host, `memcpy` of the same blocks, in the same
/// run (no raw-tcp rows).
#[cfg(target_os = "linux")]
#[test]
fn bench_over_shm_across_two_processes_reports_memcpy_as_the_ceiling() {
    for args in [&["--backend", "shm"][..], &[]] {
        let BenchRun {
            first,
            points: points_seen,
            rows,
            stderr,
        } = bench_two_processes(args, args);
        assert!(args.is_empty() || first.contains("backend=shm"), "{first}");
        assert_eq!(
            points_seen,
            points(&[("shm", "read"), ("shm", "write"), ("memcpy", "copy")]),
            "bench {args:?}"
        );
        for r in &rows {
            assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["transfers"].as_u64().unwrap() >= 12, "{r}");
        }
        assert!(!stderr.contains("WARN"), "{stderr}");
    }
}

/// `--backend shm --shm-cross-memory-attach` on both sides: plain pools
/// (as memory an engine allocated) served by cross-memory attach; without
/// the flag the same target would refuse them.
#[cfg(target_os = "linux")]
#[test]
fn bench_over_shm_with_cross_memory_attach_across_two_processes() {
    let args = ["--backend", "shm", "--shm-cross-memory-attach"];
    let BenchRun {
        first,
        points: points_seen,
        rows,
        stderr,
    } = bench_two_processes(&args, &args);
    assert!(first.contains("backend=shm"), "{first}");
    assert_eq!(
        points_seen,
        points(&[("shm", "read"), ("shm", "write"), ("memcpy", "copy")])
    );
    for r in &rows {
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(!stderr.contains("WARN"), "{stderr}");
}

/// `--backend shm` in one process: a pair of shm backends on shareable
/// memory, beside the memcpy rows.
#[cfg(target_os = "linux")]
#[test]
fn bench_runs_the_shm_backend_locally() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["bench", "--backend", "shm", "--json", "--block-sizes", "4K"])
        .args(["--batch", "4", "--duration", "50ms"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    let shm = rows.iter().filter(|r| r["backend"] == "shm").count();
    let memcpy = rows.iter().filter(|r| r["backend"] == "memcpy").count();
    assert!(shm == 2 && memcpy == 1, "{rows:?}");
}

/// `--post single`: each batch goes to the agent as one transfer of its
/// blocks; the rows say so and count blocks, as the other modes' do.
#[test]
fn bench_posts_a_batch_as_one_transfer_with_post_single() {
    let BenchRun {
        points: points_seen,
        rows,
        stderr,
        ..
    } = bench_two_processes(
        &["--no-baseline", "--backend", "tcp"],
        &["--post", "single", "--backend", "tcp"],
    );
    assert_eq!(points_seen, points(&[("tcp", "read"), ("tcp", "write")]));
    for r in &rows {
        let blocks = r["transfers"].as_u64().unwrap();
        assert_eq!(r["post"], "single", "{r}");
        // Three batches of 4 blocks at least, and whole batches only.
        assert!(blocks >= 12 && blocks % 4 == 0, "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(!stderr.contains("WARN"), "{stderr}");
}

#[test]
fn post_modes_other_than_each_need_an_initiator() {
    for mode in ["single", "batch"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
            .args(["bench", "--backend", "loopback", "--post", mode])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains(&format!("--post {mode}")) && err.contains("--role initiator"),
            "{err}"
        );
    }
}

#[test]
fn a_target_without_baselines_serves_no_ceiling_and_the_initiator_says_so() {
    let BenchRun {
        first,
        points: points_seen,
        stderr,
        ..
    } = bench_two_processes(
        &["--no-baseline", "--backend", "tcp"],
        &["--backend", "tcp"],
    );
    assert!(!first.contains("raw-tcp"), "{first}");
    assert_eq!(points_seen, points(&[("tcp", "read"), ("tcp", "write")]));
    assert!(stderr.contains("serves no raw-tcp ceiling"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_dying_leaves_transfers_to_another_untouched() {
    let mut doomed = Served::start("127.0.0.1:0", 5, None);
    let healthy = Served::start("127.0.0.1:0", 6, None);
    let (agent, local) = initiator(None).await;
    let a = agent.connect(&doomed.addr).await.unwrap();
    let b = agent.connect(&healthy.addr).await.unwrap();
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let mut to_a = Vec::new();
    let mut to_b = Vec::new();
    for _ in 0..20 {
        to_a.push(a.write_blocks(0..LAYERS, &ids, &ids, None).unwrap());
        to_b.push(b.write_blocks(0..LAYERS, &ids, &ids, None).unwrap());
    }
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    for h in to_b {
        tokio::time::timeout(Duration::from_secs(30), h)
            .await
            .expect("a transfer to the healthy peer hung")
            .expect("a transfer to the healthy peer failed because another peer died");
    }
    for h in to_a {
        if let Err(e) = tokio::time::timeout(Duration::from_secs(15), h)
            .await
            .expect("hung")
        {
            assert!(e.is_peer_lost(), "{e}");
        }
    }
    // The healthy peer got every byte and still serves: its block 2 now
    // holds what our block 2 held, and reads back into our block 7.
    b.read_blocks(0..LAYERS, &[7], &[2], None)
        .unwrap()
        .await
        .unwrap();
    for layer in 0..LAYERS {
        for part in 0..2 {
            assert!(
                block(&local, layer, part, 7) == block(&local, layer, part, 2),
                "layer {layer}"
            );
            assert!(
                block(&local, layer, part, 7) != served_block(6, layer, part, 2),
                "WRITE lost"
            );
        }
    }
    agent.close().await;
}

/// `kvlane bench --peers 1,3 --peer-procs 2`: one JSON row per count, the
/// agents spread over two worker processes, every row with transfers,
/// a rate over the window, latency and the resources of both sides (threads and fds from /proc),
/// and more initiator threads and fds at 3 peers than at 1.
#[test]
fn bench_peers_reports_aggregate_rows_per_peer_count() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args([
            "bench",
            "--peers",
            "1,3",
            "--peer-procs",
            "2",
            "--backend",
            "tcp",
        ])
        .args(["--op", "write", "--block-sizes", "64K", "--batch", "2"])
        .args(["--duration", "300ms", "--json"])
        .output()
        .expect("run kvlane bench --peers");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (r, (peers, procs)) in rows.iter().zip([(1, 1), (3, 2)]) {
        assert_eq!(r["peers"], peers, "{r}");
        assert_eq!(r["procs"], procs, "{r}");
        assert!(r["error"].is_null(), "{r}");
        assert!(r["transfers"].as_u64().unwrap() >= 2 * peers, "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
        // The rate is over the window, of what completed within it: at
        // most every transfer's bytes over the window.
        assert_eq!(r["seconds"].as_f64().unwrap(), 0.3, "{r}");
        let every = r["transfers"].as_f64().unwrap() * 65536.0 / 0.3 / 1e9;
        assert!(r["gbps"].as_f64().unwrap() <= every * (1.0 + 1e-9), "{r}");
        assert!(r["lat_p99_us"].as_f64().unwrap() > 0.0, "{r}");
        if cfg!(target_os = "linux") {
            for side in ["target", "initiators"] {
                assert!(r[side]["threads"].as_u64().unwrap() > 0, "{r}");
                assert!(r[side]["fds"].as_u64().unwrap() > 0, "{r}");
                assert!(r[side]["rss_mib"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
    }
    let fds = |i: usize| rows[i]["initiators"]["fds"].as_u64().unwrap();
    let threads = |i: usize| rows[i]["initiators"]["threads"].as_u64().unwrap();
    if cfg!(target_os = "linux") {
        assert!(fds(1) > fds(0) && threads(1) > threads(0), "{rows:?}");
    }
}

#[test]
fn devices_prints_the_gpu_nic_matrix_of_a_sysfs_tree() {
    let tree = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kvlane-data/tests/data/topology/dgx-h100"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(["devices", "--sysfs", tree])
        .output()
        .expect("run kvlane devices");
    let text = String::from_utf8_lossy(&out.stdout);
    let row = |gpu: &str| -> Vec<String> {
        text.lines()
            .find(|l| l.starts_with(gpu))
            .unwrap_or_else(|| panic!("no {gpu} row:\n{text}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        row("GPU5 "),
        [
            "GPU5",
            "0000:ab:00.0",
            "1",
            "SYS",
            "SYS",
            "SYS",
            "SYS",
            "NODE",
            "PIX",
            "NODE",
            "NODE"
        ],
        "{text}"
    );
    assert!(text.contains("nearest to GPU5: mlx5_5"), "{text}");
}

#[test]
fn bench_rows_carry_the_rails_a_backend_ran_over() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args([
            "bench",
            "--backend",
            "tcp",
            "--rails",
            "2",
            "--block-sizes",
            "1M",
        ])
        .args([
            "--batch",
            "4",
            "--duration",
            "100ms",
            "--no-baseline",
            "--json",
        ])
        .output()
        .expect("run kvlane bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(
            (r["backend"].as_str(), r["rails"].as_u64()),
            (Some("tcp"), Some(2)),
            "{r}"
        );
        assert!(r["transfers"].as_u64() > Some(0), "{r}");
    }
}

/// `kvlane devices` and a two-process `kvlane bench --memory rocm:N`
/// against a MOCK HIP runtime (`testdata/mock_hip.c`: host memory behind
/// HIP's API, not a GPU): the ROCm path of the binary, end to end.
#[test]
fn rocm_devices_are_listed_and_benched_from_their_memory() {
    let dir = std::env::temp_dir().join(format!("kvlane-e2e-hip-{}", std::process::id()));
    let lib = kvlane_data::conformance::build_mock_hip(&dir, 60_200_000).expect("needs cc");
    let kvlane = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvlane"));
        c.args(args)
            .env("KVLANE_HIP_LIBRARY", &lib)
            .env("KVLANE_MOCK_HIP_DEVICES", "2");
        c
    };
    let out = kvlane(&["devices"]).output().expect("run kvlane devices");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("gpu rocm:1 kvlane mock HIP device 1 (host memory) pci 0000:c4:00.0"),
        "{text}"
    );
    let (mut target, _, addr) = bench_target(kvlane(&[]), &["--memory", "rocm:1"]);
    let out = kvlane(&["bench", "--role", "initiator", "--connect", &addr])
        .args(["--memory", "rocm:0", "--json", "--no-baseline"])
        .args(["--block-sizes", "1M", "--batch", "4", "--duration", "50ms"])
        .output()
        .unwrap();
    let _ = target.kill();
    let _ = target.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["read", "write"], "{rows:?}");
    for r in &rows {
        assert_eq!(r["memory"], "rocm:0", "{r}");
        assert!(r["transfers"].as_u64().unwrap() > 0, "{r}");
        assert!(r.get("error").is_none(), "{r}");
    }
}
