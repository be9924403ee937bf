//! `kvlane soak`: is the path to these agents healthy under faults?
//!
//! One agent connects to every target at once (each target has its own
//! task, so a slow or blackholed one delays only itself) and, per target,
//! loops over rounds: WRITE a fresh pattern from a few local blocks into
//! remote blocks, READ them back into other local blocks, compare byte for
//! byte. Failures never stop the run; they are printed with their
//! [`ErrorKind`] and the round is retried after a short backoff. A peer
//! that died is brought back by the control plane's own reconnect (the
//! same connection, which is how a restart is recognised by its new
//! incarnation); a connection that is gone, refused or never came up is
//! dialed again with a bounded backoff. On a restart, a transfer prepared
//! against the old incarnation is posted and must fail with `Stale`.

mod report;
mod round;

use crate::liveness::LivenessArgs;
use crate::serve::ServeBackend;
use crate::units;
use clap::Args;
use kvlane::control::Backoff;
use kvlane::control::ConnectionId;
use kvlane::data::tcp::{TcpBackend, TcpConfig};
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Op, Region};
use kvlane::{Agent, BackendChoice, ErrorKind, Peer, PeerEvent, PeerEventKind};
use kvlane::{PreparedTransfer, DEFAULT_TRANSFER_DEADLINE};
use report::{ms, secs, Latencies, Line, Liveness, Out, PeerSummary, RailSummary};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::broadcast;

type BoxError = Box<dyn std::error::Error>;

/// Options of `kvlane soak`.
#[derive(Args, Debug)]
pub(crate) struct SoakArgs {
    /// Agents to soak: `host:port` of their control plane (comma list),
    /// e.g. `kvlane serve` targets.
    #[arg(long, value_delimiter = ',', required = true)]
    connect: Vec<String>,
    /// How long to run (e.g. 30s, 2.5s).
    #[arg(long, default_value = "30s", value_parser = units::parse_duration)]
    duration: Duration,
    /// Block size; must be the targets' block size (`serve --block-size`).
    #[arg(long, default_value = "16K", value_parser = units::parse_size)]
    block_size: u64,
    /// Blocks written and read back per round and target (the target's
    /// blocks 0..N of layer 0 are overwritten; block N is read by the
    /// restart check).
    #[arg(long, default_value_t = 4)]
    blocks: u32,
    /// Data-plane backend of the soaking agent.
    #[arg(long, value_enum, default_value = "tcp")]
    backend: ServeBackend,
    /// Data-plane dial timeout per stream (tcp backend).
    #[arg(long, default_value = "5s", value_parser = units::parse_duration)]
    connect_timeout: Duration,
    /// tcp data-plane listen addresses of the soaking agent, one rail each
    /// (comma list; give each network's own address); default: one rail on
    /// the tcp backend's default address.
    #[arg(long, value_delimiter = ',')]
    data_listen: Vec<String>,
    /// Serve the soaking agent's Prometheus metrics at
    /// `http://ADDR/metrics` (the address is printed on stderr).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// Interval of the per-peer `stats` lines.
    #[arg(long, default_value = "5s", value_parser = units::parse_duration)]
    stats_interval: Duration,
    #[command(flatten)]
    liveness: LivenessArgs,
    /// Pre-shared key of the handshake.
    #[arg(long, env = "KVLANE_PSK", hide_env_values = true)]
    psk: Option<String>,
    /// Dial a peer's data endpoint on any host it advertises; default: only
    /// on the host of the control connection to it (a target that
    /// advertises another host on purpose needs this).
    #[arg(long)]
    dial_any_data_host: bool,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

/// Backoff between failed rounds and connect attempts.
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// What the event stream last said about a target's current connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// No connection yet, or it ended: dial.
    Gone,
    Up,
    /// Dead, restarting or suspect: the control plane is on it.
    Waiting,
}

#[derive(Default)]
struct Counters {
    ok: u64,
    failed: u64,
    failures: BTreeMap<String, u64>,
    mismatches: u64,
    restarts: u64,
    stale_checks: u64,
    stale_violations: u64,
    bytes: u64,
    lat: Latencies,
    interval_ok: u64,
    interval_bytes: u64,
    interval_lat: Latencies,
    came_up: bool,
    /// Given up on: its cache cannot be soaked with ours.
    unusable: bool,
    last_error: Option<String>,
}

/// A transfer prepared against one incarnation, posted after a restart.
struct Canary {
    conn: ConnectionId,
    incarnation: u64,
    prepared: PreparedTransfer,
}

/// One target.
struct Target {
    addr: String,
    index: usize,
    src: Vec<u32>,
    dst: Vec<u32>,
    remote: Vec<u32>,
    canary_local: u32,
    link: Mutex<(ConnectionId, Link)>,
    /// The worker's handle (the restart check posts through it).
    peer: Mutex<Option<Peer>>,
    canary: Mutex<Option<Canary>>,
    counters: Mutex<Counters>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Ctx {
    agent: Agent,
    layout: KvLayout,
    region: Region,
    out: Out,
    targets: Vec<Arc<Target>>,
    start: Instant,
    duration: Duration,
    stop: AtomicBool,
    connect_bound: Duration,
    transfer_bound: Duration,
}

/// The error and its causes on one line, without repeating a cause the
/// message already contains.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        let c_text = c.to_string();
        if !s.contains(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        source = c.source();
    }
    s
}

/// Payload GB/s (10^9 bytes/s), four decimals.
fn gbps(bytes: u64, secs: f64) -> f64 {
    (bytes as f64 / secs.max(1e-9) / 1e5).round() / 1e4
}

impl Ctx {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.start.elapsed() >= self.duration
    }

    /// Sleeps `d`, but not past the end of the run.
    async fn pause(&self, d: Duration) {
        let left = self.duration.saturating_sub(self.start.elapsed());
        tokio::time::sleep(d.min(left)).await;
    }

    fn target(&self, addr: &str) -> Option<&Arc<Target>> {
        self.targets.iter().find(|t| t.addr == addr)
    }

    /// Dials `t` once, bounded.
    async fn connect(&self, t: &Target, attempt: u32) -> Option<Peer> {
        self.out.emit(&Line::Connecting {
            peer: t.addr.clone(),
            attempt,
        });
        let t0 = Instant::now();
        let r = tokio::time::timeout(self.connect_bound, self.agent.connect(&t.addr)).await;
        let (kind, error) = match r {
            Ok(Ok(peer)) => {
                self.out.emit(&Line::Connected {
                    peer: t.addr.clone(),
                    conn: peer.id().to_string(),
                    attempt,
                    elapsed_ms: ms(t0.elapsed()),
                    engine_id: peer.engine_id(),
                    incarnation: format!("{:#x}", peer.incarnation().unwrap_or(0)),
                });
                return Some(peer);
            }
            Ok(Err(e)) => (e.kind().to_string(), chain(&e)),
            Err(_) => (
                ErrorKind::Timeout.to_string(),
                format!(
                    "connect to {} did not finish within {:?}",
                    t.addr, self.connect_bound
                ),
            ),
        };
        lock(&t.counters).last_error = Some(error.clone());
        self.out.emit(&Line::ConnectFailed {
            peer: t.addr.clone(),
            attempt,
            elapsed_ms: ms(t0.elapsed()),
            kind,
            error,
        });
        None
    }

    /// Why `peer`'s cache cannot be soaked with ours, if it cannot.
    fn check_remote(&self, peer: &Peer) -> Result<(), String> {
        let addr = peer.addr();
        let Some(r) = peer.remote_layout() else {
            return Err(format!("{addr} serves no KV cache"));
        };
        let blocks = self.targets[0].src.len() as u32;
        if r.parts != KvParts::Separate {
            return Err(format!(
                "{addr} stores K and V together ({:?}); soak needs a `kvlane serve` target \
                 (K and V stored separately)",
                r.parts
            ));
        }
        if r.block_bytes != self.layout.block_bytes {
            return Err(format!(
                "{addr} serves blocks of {} bytes, this soak moves {}: run it with \
                 --block-size {}",
                r.block_bytes, self.layout.block_bytes, r.block_bytes
            ));
        }
        if r.num_blocks <= blocks || r.num_layers == 0 {
            return Err(format!(
                "{addr} serves {} blocks per layer; soak --blocks {blocks} needs {}",
                r.num_blocks,
                blocks + 1
            ));
        }
        Ok(())
    }

    /// Whether `peer` has a data plane now; keeps a transfer prepared
    /// against its current incarnation for the restart check.
    fn refresh_canary(&self, t: &Target, peer: &Peer) -> bool {
        let Ok(prepared) = peer.prepare(
            Op::Read,
            0..1,
            &[t.canary_local],
            &[t.remote.len() as u32],
            None,
        ) else {
            return false;
        };
        let mut slot = lock(&t.canary);
        // A canary of an older incarnation of this connection waits for its
        // `Restarted` event.
        let pending = matches!(&*slot, Some(c) if c.conn == peer.id()
            && c.incarnation != prepared.incarnation());
        if !pending {
            *slot = Some(Canary {
                conn: peer.id(),
                incarnation: prepared.incarnation(),
                prepared,
            });
        }
        true
    }

    /// Soaks one target until the run ends.
    async fn drive(self: Arc<Self>, t: Arc<Target>) {
        let seed = u64::from(std::process::id()) << 8 ^ t.index as u64;
        let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX, seed);
        let mut peer: Option<Peer> = None;
        let (mut round, mut attempt) = (0u64, 0u32);
        while !self.stopped() {
            let link = lock(&t.link).1;
            match &peer {
                Some(p) if self.refresh_canary(&t, p) => {
                    if self.round(&t, p, round).await {
                        backoff.reset();
                    } else {
                        self.pause(backoff.next_delay()).await;
                    }
                    round += 1;
                }
                // Dead or restarting: the control plane reconnects this
                // connection itself (and recognises a restart on it).
                Some(_) if link == Link::Waiting => self.pause(backoff.next_delay()).await,
                _ => {
                    attempt += 1;
                    match self.connect(&t, attempt).await {
                        Some(p) => {
                            if let Err(error) = self.check_remote(&p) {
                                {
                                    let mut c = lock(&t.counters);
                                    c.unusable = true;
                                    c.last_error = Some(error.clone());
                                }
                                self.out.emit(&Line::Unusable {
                                    peer: t.addr.clone(),
                                    error,
                                });
                                return;
                            }
                            {
                                let mut l = lock(&t.link);
                                if p.id() >= l.0 {
                                    *l = (p.id(), Link::Up);
                                }
                            }
                            lock(&t.counters).came_up = true;
                            *lock(&t.peer) = Some(p.clone());
                            peer = Some(p);
                            backoff.reset();
                        }
                        None => self.pause(backoff.next_delay()).await,
                    }
                }
            }
        }
    }

    /// Prints a peer event and tracks the state of the target's connection.
    fn on_event(&self, ev: PeerEvent) {
        let (state, detail, link) = match &ev.kind {
            PeerEventKind::Up {
                engine_id,
                incarnation,
            } => (
                "up",
                Some(format!("engine={engine_id} incarnation={incarnation:#x}")),
                Link::Up,
            ),
            PeerEventKind::Suspect => ("suspect", None, Link::Waiting),
            PeerEventKind::Recovered => ("recovered", None, Link::Up),
            PeerEventKind::Dead {
                attempts,
                last_error,
            } => (
                "dead",
                Some(format!("attempts={attempts} last_error={last_error}")),
                Link::Waiting,
            ),
            PeerEventKind::Restarted { old, new } => (
                "restarted",
                Some(format!("old={old:#x} new={new:#x}")),
                Link::Waiting,
            ),
            PeerEventKind::Refused { reason } => ("refused", Some(reason.clone()), Link::Gone),
            PeerEventKind::Closed => ("closed", None, Link::Gone),
            other => ("other", Some(format!("{other:?}")), Link::Waiting),
        };
        self.out.emit(&Line::Peer {
            peer: ev.addr.clone(),
            conn: ev.peer.to_string(),
            state,
            detail,
        });
        let Some(t) = self.target(&ev.addr) else {
            return;
        };
        {
            let mut l = lock(&t.link);
            if ev.peer >= l.0 {
                *l = (ev.peer, link);
            }
        }
        match ev.kind {
            PeerEventKind::Up { .. } => lock(&t.counters).came_up = true,
            PeerEventKind::Restarted { .. } => self.stale_check(t, ev.peer),
            _ => {}
        }
    }

    /// Posts the transfer prepared against the old incarnation: it must
    /// fail with `Stale`.
    fn stale_check(&self, t: &Target, conn: ConnectionId) {
        let canary = {
            let mut slot = lock(&t.canary);
            match slot.take() {
                Some(c) if c.conn == conn => Some(c),
                other => {
                    *slot = other;
                    None
                }
            }
        };
        lock(&t.counters).restarts += 1;
        let Some(c) = canary else {
            return;
        };
        let Some(peer) = lock(&t.peer).clone() else {
            return;
        };
        let (stale, kind, error) = match peer.post(c.prepared) {
            Err(e) => (e.is_stale(), Some(e.kind().to_string()), Some(chain(&e))),
            Ok(handle) => {
                // It went out: a stale key may have been used. Report how it
                // ended without waiting on it here.
                drop(handle);
                (
                    false,
                    None,
                    Some("the transfer prepared against the old incarnation was accepted".into()),
                )
            }
        };
        {
            let mut counters = lock(&t.counters);
            counters.stale_checks += 1;
            if !stale {
                counters.stale_violations += 1;
            }
        }
        self.out.emit(&Line::StaleCheck {
            peer: t.addr.clone(),
            stale,
            prepared_incarnation: format!("{:#x}", c.incarnation),
            kind,
            error,
        });
    }

    /// One `stats` line per target for the interval that just ended.
    fn stats(&self, interval: Duration) {
        for t in &self.targets {
            let line = {
                let mut c = lock(&t.counters);
                let lat = c.interval_lat.take();
                let line = Line::Stats {
                    peer: t.addr.clone(),
                    ok: c.ok,
                    failed: c.failed,
                    interval_s: secs(interval),
                    interval_ok: c.interval_ok,
                    p50_us: lat.percentile(50.0),
                    p99_us: lat.percentile(99.0),
                    gbps: gbps(c.interval_bytes, interval.as_secs_f64()),
                };
                c.interval_ok = 0;
                c.interval_bytes = 0;
                line
            };
            self.out.emit(&line);
        }
        let rails = self.rails();
        if !rails.is_empty() {
            self.out.emit(&Line::Rails { rails });
        }
    }

    fn rails(&self) -> Vec<RailSummary> {
        self.agent
            .rail_stats()
            .into_iter()
            .map(|r| RailSummary {
                rail: r.name,
                bytes: r.bytes,
                parts: r.parts,
                failures: r.failures,
                reposts: r.reposts,
                down_peers: r.down_peers,
                rejoins: r.rejoins,
                dropped: r.dropped,
            })
            .collect()
    }

    fn summary(&self, liveness: Liveness) -> (bool, Line) {
        let elapsed = self.start.elapsed();
        let peers: Vec<PeerSummary> = self
            .targets
            .iter()
            .map(|t| {
                let c = lock(&t.counters);
                PeerSummary {
                    peer: t.addr.clone(),
                    came_up: c.came_up,
                    unusable: c.unusable,
                    ok: c.ok,
                    failed: c.failed,
                    failures: c.failures.clone(),
                    mismatches: c.mismatches,
                    restarts: c.restarts,
                    stale_checks: c.stale_checks,
                    stale_violations: c.stale_violations,
                    p50_us: c.lat.percentile(50.0),
                    p99_us: c.lat.percentile(99.0),
                    gbps: gbps(c.bytes, elapsed.as_secs_f64()),
                    last_error: c.last_error.clone(),
                }
            })
            .collect();
        let healthy = peers
            .iter()
            .all(|p| p.came_up && !p.unusable && p.mismatches == 0 && p.stale_violations == 0);
        let rails = self.rails();
        let line = Line::Summary {
            healthy,
            duration_s: secs(elapsed),
            liveness,
            peers,
            rails,
        };
        (healthy, line)
    }
}

/// The soaking agent's tcp data plane: one backend per `--data-listen`
/// address (several: rails), each with the dial timeout.
fn tcp_rails(args: &SoakArgs) -> Result<Box<dyn kvlane::data::Backend>, BoxError> {
    let one = |listen: Option<&str>| -> Result<TcpBackend, BoxError> {
        let mut cfg = TcpConfig {
            connect_timeout: args.connect_timeout,
            ..TcpConfig::default()
        };
        if let Some(l) = listen {
            cfg.listen = l
                .parse()
                .map_err(|e| format!("--data-listen {l}: not an ip:port ({e})"))?;
        }
        Ok(TcpBackend::new(cfg)?)
    };
    match args.data_listen.as_slice() {
        [] => Ok(Box::new(one(None)?)),
        [l] => Ok(Box::new(one(Some(l))?)),
        many => {
            let made = many
                .iter()
                .map(|l| Ok((format!("tcp:{l}"), one(Some(l))?)))
                .collect::<Result<Vec<_>, BoxError>>()?;
            // A rail whose network is down fences through another rail.
            TcpBackend::fence_through_each_other(&made.iter().map(|(_, b)| b).collect::<Vec<_>>());
            let rails: Vec<(String, Box<dyn kvlane::data::Backend>)> = made
                .into_iter()
                .map(|(n, b)| (n, Box::new(b) as Box<dyn kvlane::data::Backend>))
                .collect();
            Ok(Box::new(kvlane::data::Rails::new(
                rails,
                kvlane::data::RailsConfig::default(),
            )?))
        }
    }
}

/// Runs `kvlane soak`; `Ok(false)` when the path is not healthy (a byte
/// mismatch, a peer that never came up, a stale transfer that went out).
pub(crate) async fn run(args: SoakArgs) -> Result<bool, BoxError> {
    if args.blocks == 0 {
        return Err("--blocks must be at least 1".into());
    }
    let control = args.liveness.config()?;
    let n = u32::try_from(args.connect.len()).map_err(|_| "too many --connect targets")?;
    // Per target: `blocks` source, `blocks` destination and one canary block.
    let per_target = args.blocks.checked_mul(2).and_then(|b| b.checked_add(1));
    let blocks = per_target
        .and_then(|b| b.checked_mul(n))
        .ok_or("--blocks is too large")?;
    let layout = KvLayout::new(
        1,
        blocks,
        args.block_size,
        KvParts::Separate,
        LayoutOrder::LayerMajor,
    )?;
    let len = layout.required_len().ok_or("--block-size is too large")?;
    let region = Region::alloc(
        usize::try_from(len).map_err(|_| "--block-size is too large")?,
        Access::ALL,
    )?;
    let mut builder = Agent::builder()
        .engine_id(format!("kvlane-soak-{}", std::process::id()))
        .control_config(control.clone())
        .register_kv(layout, region.clone());
    builder = match args.backend {
        ServeBackend::Tcp => builder.backend_instance(tcp_rails(&args)?),
        ServeBackend::Verbs => builder.backend(BackendChoice::Verbs),
        ServeBackend::Auto => builder.backend(BackendChoice::Auto),
    };
    if let Some(k) = &args.psk {
        builder = builder.psk(k.as_bytes().to_vec());
    }
    let agent = builder
        .dial_any_data_host(args.dial_any_data_host)
        .build()
        .await?;
    let metrics = crate::serve::metrics_if(&agent, args.metrics.as_deref(), |url| {
        eprintln!("kvlane soak: metrics {url}");
    })
    .await?;
    let liveness = Liveness {
        keepalive_interval_ms: ms(control.keepalive_interval),
        liveness_budget: control.liveness_budget,
        liveness_budget_ms: ms(control.death_bound()),
        handshake_timeout_ms: ms(control.handshake_timeout),
        connect_timeout_ms: (args.backend == ServeBackend::Tcp).then(|| ms(args.connect_timeout)),
    };
    // A tcp attach dials every stream, each bounded by the connect timeout.
    let dial = if args.backend == ServeBackend::Tcp {
        args.connect_timeout * TcpConfig::default().streams as u32
    } else {
        Duration::from_secs(10)
    };
    let targets = args
        .connect
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let base = i as u32 * per_target.unwrap_or(1);
            Arc::new(Target {
                addr: addr.clone(),
                index: i,
                src: (base..base + args.blocks).collect(),
                dst: (base + args.blocks..base + 2 * args.blocks).collect(),
                remote: (0..args.blocks).collect(),
                canary_local: base + 2 * args.blocks,
                link: Mutex::new((ConnectionId(0), Link::Gone)),
                peer: Mutex::new(None),
                canary: Mutex::new(None),
                counters: Mutex::new(Counters::default()),
            })
        })
        .collect();
    let ctx = Arc::new(Ctx {
        agent,
        layout,
        region,
        out: Out::new(args.json),
        targets,
        start: Instant::now(),
        duration: args.duration,
        stop: AtomicBool::new(false),
        connect_bound: control.handshake_timeout + dial + Duration::from_secs(2),
        transfer_bound: DEFAULT_TRANSFER_DEADLINE + Duration::from_secs(5),
    });
    ctx.out.emit(&Line::Start {
        peers: args.connect.clone(),
        backend: ctx.agent.backend_kind().to_string(),
        block_size: args.block_size,
        blocks: args.blocks,
        duration_s: args.duration.as_secs_f64(),
        liveness,
    });

    // Events first, so no `up` of a fast target is missed.
    let mut events = ctx.agent.events();
    let ev_ctx = ctx.clone();
    let event_task = tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(ev) => ev_ctx.on_event(ev),
                Err(broadcast::error::RecvError::Lagged(n)) => ev_ctx.out.emit(&Line::Peer {
                    peer: String::new(),
                    conn: String::new(),
                    state: "lagged",
                    detail: Some(format!("{n} events missed")),
                }),
                Err(broadcast::error::RecvError::Closed) => break,
            }
        }
    });
    // Stats from a plain thread: they keep coming while every async
    // worker is stuck, which is what they are there to show.
    let (stop_stats, stats_rx) = mpsc::channel::<()>();
    let st_ctx = ctx.clone();
    let interval = args.stats_interval;
    let stats_thread = std::thread::spawn(move || {
        let mut last = Instant::now();
        while let Err(mpsc::RecvTimeoutError::Timeout) = stats_rx.recv_timeout(interval) {
            st_ctx.stats(last.elapsed());
            last = Instant::now();
        }
        st_ctx.stats(last.elapsed());
    });
    let workers: Vec<_> = ctx
        .targets
        .iter()
        .map(|t| tokio::spawn(ctx.clone().drive(t.clone())))
        .collect();

    tokio::time::sleep(args.duration).await;
    ctx.stop.store(true, Ordering::Relaxed);
    // A round in flight ends by its transfers' end: with a dead peer that is
    // the liveness budget; past a grace the workers are cancelled.
    let grace = control.death_bound() + Duration::from_secs(2);
    let end = tokio::time::Instant::now() + grace;
    for w in workers {
        let abort = w.abort_handle();
        if tokio::time::timeout_at(end, w).await.is_err() {
            abort.abort();
        }
    }
    let _ = stop_stats.send(());
    let _ = stats_thread.join();
    event_task.abort();
    if let Some(task) = metrics {
        task.abort();
    }
    let (healthy, summary) = ctx.summary(liveness);
    ctx.out.emit(&summary);
    ctx.agent.close().await;
    Ok(healthy)
}
