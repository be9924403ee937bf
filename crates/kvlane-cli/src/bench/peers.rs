//! `kvlane bench --peers N[,N...]`: N initiator agents against one target.
//!
//! This process runs the target agent (listening on 127.0.0.1) and starts
//! `--peer-procs` worker processes of this binary (hidden `--peers-worker`
//! mode), which split the N initiator agents between them. Each worker
//! builds its agents on one small tokio runtime, connects them all, says
//! `ready`, and on `go` runs batches of block transfers on every agent at
//! once for `--duration`; it prints one JSON result (bytes moved, every
//! transfer's latency, its threads, RSS and fds, measured while its agents
//! are still connected) and waits for `bye` before closing them. The
//! target's threads, RSS and fds are measured after every result came in
//! and before the `bye`, so both sides are measured at full load.
//!
//! Per N (and op and block size) one row: aggregate GB/s (the bytes of
//! the transfers that completed within `--duration`, over it), average
//! and p99 latency over every transfer of every agent, and the resources
//! of both sides. A count that cannot be reached (a cap, a refused connection, a timeout)
//! gives a row with `error` saying which, and the next N still runs.

use super::remote::{flat_layout, RemoteOpts, PAGE};
use super::stats::Sample;
use super::{op_name, BenchPlan};
use crate::units::fmt_size;
use kvlane::data::{Access, Op, Region};
use kvlane::{Agent, Error, Peer, TransferHandle};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;

/// The agents of a `--peers` run: `remote::builder`'s, with a slower
/// keep-alive (5 s, budget 6). A thousand agents connecting at once from
/// two processes on a small host starve each other's pings for seconds,
/// and the default 1 s x 3 declared hundreds of them dead mid-run; this
/// bench measures throughput and resources, not liveness.
fn builder(opts: &RemoteOpts) -> kvlane::AgentBuilder {
    super::remote::builder(opts).control_config(kvlane_control::Config {
        keepalive_interval: Duration::from_secs(5),
        liveness_budget: 6,
        ..kvlane_control::Config::default()
    })
}
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;

/// How long workers may take to connect their agents, and to report after
/// their run, before the count is given up (and the workers killed).
const WORKER_WAIT: Duration = Duration::from_secs(120);

/// Threads, resident memory and open file descriptors of this process
/// (from `/proc/self`; zeros where there is no `/proc`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Usage {
    pub(crate) threads: u64,
    pub(crate) rss_mib: f64,
    pub(crate) fds: u64,
}

impl Usage {
    pub(crate) fn now() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        Self {
            threads: field("Threads:"),
            rss_mib: field("VmRSS:") as f64 / 1024.0,
            fds,
        }
    }

    fn add(self, o: Self) -> Self {
        Self {
            threads: self.threads + o.threads,
            rss_mib: self.rss_mib + o.rss_mib,
            fds: self.fds + o.fds,
        }
    }
}

/// What a worker reports after its run (one JSON line).
#[derive(Debug, Default, Serialize, Deserialize)]
struct WorkerReport {
    agents: usize,
    transfers: u64,
    /// Transfers that completed within the measured window.
    in_window: u64,
    lat_ns: Vec<u64>,
    usage: Usage,
    error: Option<String>,
}

/// One row of `--peers` (also its JSON schema).
#[derive(Debug, Default, Serialize)]
pub(crate) struct PeersRow {
    pub(crate) backend: String,
    pub(crate) op: String,
    pub(crate) block_size: u64,
    pub(crate) batch: usize,
    pub(crate) peers: usize,
    pub(crate) procs: usize,
    pub(crate) gbps: f64,
    pub(crate) lat_avg_us: f64,
    pub(crate) lat_p99_us: f64,
    pub(crate) transfers: u64,
    pub(crate) seconds: f64,
    pub(crate) target: Usage,
    pub(crate) initiators: Usage,
    pub(crate) error: Option<String>,
}

fn table_header() -> String {
    format!(
        "{:<7} {:<5} {:>6} {:>5} {:>6} {:>5} {:>8} {:>10} {:>10} {:>18} {:>18}  error",
        "backend",
        "op",
        "block",
        "batch",
        "peers",
        "procs",
        "GB/s",
        "lat avg us",
        "lat p99 us",
        "target thr/MiB/fd",
        "init thr/MiB/fd"
    )
}

fn table_line(r: &PeersRow) -> String {
    let u = |u: &Usage| format!("{}/{:.0}/{}", u.threads, u.rss_mib, u.fds);
    format!(
        "{:<7} {:<5} {:>6} {:>5} {:>6} {:>5} {:>8.3} {:>10.1} {:>10.1} {:>18} {:>18}  {}",
        r.backend,
        r.op,
        fmt_size(r.block_size),
        r.batch,
        r.peers,
        r.procs,
        r.gbps,
        r.lat_avg_us,
        r.lat_p99_us,
        u(&r.target),
        u(&r.initiators),
        r.error.as_deref().unwrap_or("")
    )
}

/// Options of a `--peers` run.
pub(crate) struct PeersOpts {
    pub(crate) counts: Vec<usize>,
    pub(crate) procs: usize,
    pub(crate) json: bool,
}

/// Runs every count of `--peers` against a target in this process.
pub(crate) fn run(plan: &BenchPlan, opts: &RemoteOpts, peers: &PeersOpts) -> Result<(), BoxError> {
    if let Some(b) = plan.block_sizes.iter().find(|&&b| b % PAGE != 0 || b == 0) {
        return Err(format!("--peers needs block sizes that are multiples of 4K, not {b}").into());
    }
    if peers.counts.contains(&0) || peers.procs == 0 {
        return Err("--peers and --peer-procs must be at least 1".into());
    }
    let batch = plan.batches.first().copied().unwrap_or(1);
    let rt = crate::runtime();
    let pool = pool_bytes(plan, batch);
    let layout = flat_layout(pool)?;
    let region = Region::alloc(layout.required_len().unwrap_or(pool) as usize, Access::ALL)?;
    let target = rt.block_on(
        builder(opts)
            .engine_id("kvlane-bench-peers-target")
            .listen("127.0.0.1:0")
            .register_kv(layout, region)
            .build(),
    )?;
    let addr = target.local_addr().to_owned();
    let backend = target.backend_kind().to_string();
    if !peers.json {
        crate::out::outln!("{}", table_header());
    }
    let mut failed = 0;
    for &n in &peers.counts {
        for &op in &plan.ops {
            for &block in &plan.block_sizes {
                eprintln!(
                    "kvlane bench: {n} peers, {} {} x {batch} each -> {addr}",
                    op_name(op),
                    fmt_size(block)
                );
                let mut row = PeersRow {
                    backend: backend.clone(),
                    op: op_name(op).into(),
                    block_size: block,
                    batch,
                    peers: n,
                    procs: peers.procs.min(n),
                    ..PeersRow::default()
                };
                if let Err(e) = measure(&addr, n, op, block, plan, opts, &mut row) {
                    row.error = Some(e.to_string());
                    failed += 1;
                }
                if peers.json {
                    crate::out::outln!("{}", serde_json::to_string(&row)?);
                } else {
                    crate::out::outln!("{}", table_line(&row));
                }
            }
        }
    }
    rt.block_on(target.close());
    if failed > 0 {
        return Err(format!("{failed} of the --peers points failed (see their error)").into());
    }
    Ok(())
}

/// Target memory: room for every block of one batch at the largest size.
fn pool_bytes(plan: &BenchPlan, batch: usize) -> u64 {
    let block = plan.block_sizes.iter().copied().max().unwrap_or(PAGE);
    (block * batch as u64).max(1 << 20)
}

/// A started worker: its process, its stdin and its stdout lines.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Worker {
    fn spawn(
        addr: &str,
        agents: usize,
        op: Op,
        block: u64,
        plan: &BenchPlan,
        opts: &RemoteOpts,
    ) -> Result<Self, BoxError> {
        let batch = plan.batches.first().copied().unwrap_or(1);
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["bench", "--peers-worker", "--connect", addr])
            .args(["--agents", &agents.to_string()])
            .args(["--op", op_name(op)])
            .args(["--block-sizes", &block.to_string()])
            .args(["--batch", &batch.to_string()])
            .args(["--duration", &format!("{}ms", plan.duration.as_millis())])
            .args(["--backend", backend_arg(opts.backend)])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(k) = &opts.psk {
            cmd.env("KVLANE_PSK", k);
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take().ok_or("worker without stdin")?;
        let stdout = child.stdout.take().ok_or("worker without stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    /// The next line, or why there is none by `deadline`.
    fn line(&self, deadline: Instant, what: &str) -> Result<String, BoxError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        self.lines.recv_timeout(wait).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => format!(
                "worker {} did not {what} within {WORKER_WAIT:?}",
                self.child.id()
            )
            .into(),
            mpsc::RecvTimeoutError::Disconnected => {
                format!("worker {} exited before it could {what}", self.child.id()).into()
            }
        })
    }

    fn say(&mut self, word: &str) {
        // A worker that is gone is reported by its missing line.
        let _ = writeln!(self.stdin, "{word}");
        let _ = self.stdin.flush();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing stdin tells a worker to close its agents; give it a
        // moment, then kill it: nothing outlives the point.
        self.say("bye");
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn backend_arg(b: kvlane::BackendChoice) -> &'static str {
    match b {
        kvlane::BackendChoice::Tcp => "tcp",
        kvlane::BackendChoice::Verbs => "verbs",
        kvlane::BackendChoice::Shm => "shm",
        _ => "auto",
    }
}

/// One point: `n` agents over the workers, all running at once.
fn measure(
    addr: &str,
    n: usize,
    op: Op,
    block: u64,
    plan: &BenchPlan,
    opts: &RemoteOpts,
    row: &mut PeersRow,
) -> Result<(), BoxError> {
    let procs = row.procs;
    let mut workers = Vec::with_capacity(procs);
    for i in 0..procs {
        let agents = n / procs + usize::from(i < n % procs);
        workers.push(Worker::spawn(addr, agents, op, block, plan, opts)?);
    }
    let deadline = Instant::now() + WORKER_WAIT;
    for w in &workers {
        let line = w.line(deadline, "connect its agents")?;
        if line != "ready" {
            return Err(worker_error(&line).into());
        }
    }
    for w in &mut workers {
        w.say("go");
    }
    let deadline = Instant::now() + plan.duration + WORKER_WAIT;
    let mut reports = Vec::with_capacity(procs);
    for w in &workers {
        let line = w.line(deadline, "report")?;
        let r: WorkerReport =
            serde_json::from_str(&line).map_err(|e| format!("worker report {line:?}: {e}"))?;
        if let Some(e) = &r.error {
            return Err(e.clone().into());
        }
        reports.push(r);
    }
    row.target = Usage::now();
    let mut sample = Sample::default();
    let mut initiators = Usage::default();
    let mut in_window = 0;
    for r in reports {
        initiators = initiators.add(r.usage);
        in_window += r.in_window;
        sample
            .lat
            .extend(r.lat_ns.iter().map(|&ns| Duration::from_nanos(ns)));
    }
    row.initiators = initiators;
    // Bytes that completed within the window, over the window. Until the
    // last agent stopped counted the tail in which agents finish their
    // last batches one by one with fewer and fewer in flight: at 1,000
    // peers (batches of 0.5-1 s) 0.15-0.27 s past a 3 s window.
    let secs = plan.duration.as_secs_f64();
    sample.secs = secs;
    let r = sample.row(&row.backend, &row.op, block, row.batch);
    row.gbps = if secs > 0.0 {
        (in_window * block) as f64 / secs / 1e9
    } else {
        0.0
    };
    row.lat_avg_us = r.lat_avg_us;
    row.lat_p99_us = r.lat_p99_us;
    row.transfers = r.transfers;
    row.seconds = r.seconds;
    drop(workers);
    Ok(())
}

fn worker_error(line: &str) -> String {
    serde_json::from_str::<WorkerReport>(line)
        .ok()
        .and_then(|r| r.error)
        .unwrap_or_else(|| format!("unexpected worker line {line:?}"))
}

/// The hidden `--peers-worker` mode: `agents` initiator agents against
/// `addr`, driven by `ready` / `go` / report / `bye` on stdin and stdout.
pub(crate) fn worker(
    addr: &str,
    agents: usize,
    plan: &BenchPlan,
    opts: &RemoteOpts,
) -> Result<(), BoxError> {
    let op = plan.ops.first().copied().unwrap_or(Op::Write);
    let block = plan.block_sizes.first().copied().unwrap_or(PAGE);
    let batch = plan.batches.first().copied().unwrap_or(1);
    let rt = crate::runtime();
    let mut stdin = std::io::stdin().lock();
    let mut word = String::new();
    let connected = rt.block_on(connect_all(addr, agents, block, batch, opts));
    let (agents_up, peers) = match connected {
        Ok(v) => v,
        Err(e) => {
            report(&WorkerReport {
                error: Some(e.to_string()),
                ..WorkerReport::default()
            })?;
            return Ok(());
        }
    };
    let pages = (block / PAGE) as u32;
    // One unmeasured batch per agent, all at once, before the window
    // opens, as a single peer's point has (`remote.rs`): connections past
    // their first bytes, memory touched. Without it the window counted
    // 1,000 agents' cold first batches (p99 0.5-0.8 s on the 2-core VM):
    // 1,000-peer WRITE measured 0.62-0.83x one peer over 3 s windows and
    // 1.02-1.13x over 6 s ones.
    let warmed: Result<Vec<()>, String> = rt
        .block_on(join_all(
            peers
                .iter()
                .map(|peer| warm_up(peer.clone(), op, pages, batch)),
        ))
        .into_iter()
        .collect();
    if let Err(e) = warmed {
        report(&WorkerReport {
            error: Some(format!("warm-up batch: {e}")),
            ..WorkerReport::default()
        })?;
        return Ok(());
    }
    crate::out::outln!("ready");
    std::io::stdout().flush()?;
    word.clear();
    stdin.read_line(&mut word)?;
    if word.trim() != "go" {
        return Ok(());
    }
    let started = Instant::now();
    let end = started + plan.duration;
    let results = rt.block_on(join_all(
        peers
            .into_iter()
            .map(|peer| drive(peer, op, pages, batch, end)),
    ));
    let mut out = WorkerReport {
        agents,
        usage: Usage::now(),
        ..WorkerReport::default()
    };
    for r in results {
        match r {
            Ok((lat, in_window)) => {
                out.lat_ns.extend(lat);
                out.in_window += in_window;
            }
            Err(e) => {
                out.error.get_or_insert(e);
            }
        }
    }
    out.transfers = out.lat_ns.len() as u64;
    report(&out)?;
    word.clear();
    let _ = stdin.read_line(&mut word);
    rt.block_on(async {
        for a in &agents_up {
            a.close().await;
        }
    });
    Ok(())
}

fn report(r: &WorkerReport) -> Result<(), BoxError> {
    crate::out::outln!("{}", serde_json::to_string(r)?);
    std::io::stdout().flush()?;
    Ok(())
}

/// Agents of one worker that build and connect at the same time. On a
/// Soft-RoCE VM under TCG, 100 verbs agents over 2 workers missed the 5 s
/// handshake timeout all at once (11 of 50 connected) and the 6 s
/// endpoint-offer timeout 16 at a time (5 of 50); 4 at a time all
/// connected. The run measures transfers, not a connection storm.
const CONNECT_AT_ONCE: usize = 4;

/// Builds `n` agents sharing one registered region and connects each to
/// `addr`, [`CONNECT_AT_ONCE`] at a time.
async fn connect_all(
    addr: &str,
    n: usize,
    block: u64,
    batch: usize,
    opts: &RemoteOpts,
) -> Result<(Vec<Agent>, Vec<Peer>), BoxError> {
    let bytes = block * batch as u64;
    let layout = flat_layout(bytes)?;
    let region = Region::alloc(layout.required_len().unwrap_or(bytes) as usize, Access::ALL)?;
    let pid = std::process::id();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(CONNECT_AT_ONCE));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let b = builder(opts)
            .engine_id(format!("kvlane-bench-peer-{pid}-{i}"))
            .register_kv(layout, region.clone());
        let addr = addr.to_owned();
        let gate = std::sync::Arc::clone(&gate);
        set.spawn(async move {
            let _permit = gate.acquire_owned().await;
            let agent = b.build().await?;
            match agent.connect(&addr).await {
                Ok(peer) => Ok((agent, peer)),
                Err(e) => {
                    agent.close().await;
                    Err(e)
                }
            }
        });
    }
    let (mut agents, mut peers) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut first_error: Option<String> = None;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok((a, p))) => {
                agents.push(a);
                peers.push(p);
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(e.to_string());
            }
            Err(e) => {
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    if let Some(e) = first_error {
        for a in &agents {
            a.close().await;
        }
        let up = agents.len();
        return Err(
            format!("{up} of {n} agents of worker {pid} connected; first failure: {e}").into(),
        );
    }
    Ok((agents, peers))
}

/// Runs every task at once on the runtime; their results, a panicked
/// task's as its message.
async fn join_all<T: Send + 'static>(
    tasks: impl Iterator<Item = impl std::future::Future<Output = Result<T, Error>> + Send + 'static>,
) -> Vec<Result<T, String>> {
    let mut set = tokio::task::JoinSet::new();
    for t in tasks {
        set.spawn(t);
    }
    let mut all = Vec::new();
    while let Some(r) = set.join_next().await {
        all.push(
            r.map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string())),
        );
    }
    all
}

/// Posts one batch: block `i` of the agent's memory to block `i` of the
/// target's, each handle with its post time.
fn post_batch(
    peer: &Peer,
    op: Op,
    pages: u32,
    batch: usize,
    ids: &mut Vec<u32>,
    posted: &mut Vec<(Instant, TransferHandle)>,
) -> Result<(), Error> {
    for i in 0..batch as u32 {
        ids.clear();
        ids.extend(i * pages..(i + 1) * pages);
        let prepared = peer.prepare(op, 0..1, ids, ids, None)?;
        posted.push((Instant::now(), peer.post(prepared)?));
    }
    Ok(())
}

/// One unmeasured batch, waited for.
async fn warm_up(peer: Peer, op: Op, pages: u32, batch: usize) -> Result<(), Error> {
    let mut posted = Vec::with_capacity(batch);
    post_batch(&peer, op, pages, batch, &mut Vec::new(), &mut posted)?;
    for (_, h) in posted {
        h.await?;
    }
    Ok(())
}

/// One agent's loop: batches of `batch` block transfers until `end`; the
/// latency of each transfer, from post to completion, and how many
/// completed by `end`.
async fn drive(
    peer: Peer,
    op: Op,
    pages: u32,
    batch: usize,
    end: Instant,
) -> Result<(Vec<u64>, u64), Error> {
    let mut lat = Vec::new();
    let mut in_window = 0;
    let mut ids: Vec<u32> = Vec::with_capacity(pages as usize);
    let mut posted = Vec::with_capacity(batch);
    while Instant::now() < end {
        post_batch(&peer, op, pages, batch, &mut ids, &mut posted)?;
        for (t, h) in posted.drain(..) {
            h.await?;
            let now = Instant::now();
            lat.push((now - t).as_nanos() as u64);
            in_window += u64::from(now <= end);
        }
    }
    Ok((lat, in_window))
}
