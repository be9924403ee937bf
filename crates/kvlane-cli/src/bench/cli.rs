//! The `kvlane bench` command line: options, backend choice, output.

use super::output::Output;
use super::{local, remote, BenchError, BenchPlan};
use crate::units;
use clap::{Args, ValueEnum};
use kvlane_data::tcp::{TcpBackend, TcpConfig};
use kvlane_data::{Backend, BackendKind, LoopbackBackend, Op};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    Loopback,
    Tcp,
    Verbs,
    /// Shared memory between processes of one host (memory allocated with
    /// `Region::alloc_shared`); `--role initiator` prints `memcpy` rows of
    /// the same blocks, the ceiling, instead of raw-tcp rows.
    Shm,
    /// The best backend: in one process (`--role local`), verbs, else
    /// tcp; with `--role target|initiator`, the agent's `Auto`: shm to a
    /// target on this host (same kernel and network namespace; the pools
    /// are shareable memory), else verbs or tcp. Rows name the backend
    /// that ran.
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum OpArg {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Both sides in this process (default).
    Local,
    /// Serve memory for an initiator in another process or host, and the
    /// same memory over raw TCP for its link-ceiling rows (any free port of the
    /// `--listen` host, announced to the initiator in the handshake).
    Target,
    /// Measure against `--connect ADDR`, with `raw-tcp` rows of the same
    /// link (the target's raw TCP port, at the host of `--connect`).
    Initiator,
}

/// Options of `kvlane bench`.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Backends to measure (comma list). With `--role target|initiator`
    /// the one non-loopback entry is the agent's backend.
    #[arg(long, value_delimiter = ',', default_value = "loopback,auto")]
    backend: Vec<BackendArg>,
    /// Operations (comma list).
    #[arg(long, value_delimiter = ',', default_value = "read,write")]
    op: Vec<OpArg>,
    /// Block sizes (comma list; K, M, G are binary units).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M", value_parser = units::parse_size)]
    block_sizes: Vec<u64>,
    /// Transfers posted per batch (comma list).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    batch: Vec<usize>,
    /// How a batch is posted: `each`, one call per transfer; `batch`, all
    /// its transfers in one call (`Peer::post_batch`), as raw-tcp deals a
    /// batch to its streams; `single`, the batch as one transfer of all
    /// its blocks (one block per descriptor, as an engine posts a
    /// request's blocks). `--role initiator` only; rows carry `post`.
    #[arg(long, value_enum, default_value = "each")]
    post: super::PostMode,
    /// Measuring time per point (e.g. 2s, 500ms).
    #[arg(long, default_value = "1s", value_parser = units::parse_duration)]
    duration: Duration,
    /// Initiator threads, each with its own backend pair, memcpy copy and
    /// raw-tcp streams (local role).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Skip the memcpy / raw-tcp baseline rows (`--role target`: serve
    /// no raw TCP port).
    #[arg(long)]
    no_baseline: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Where the two sides run.
    #[arg(long, value_enum, default_value = "local")]
    role: Role,
    /// Control address the target listens on (`--role target`).
    #[arg(long, default_value = "0.0.0.0:5555")]
    listen: String,
    /// Target control address (`--role initiator`).
    #[arg(long)]
    connect: Option<String>,
    /// Memory the target serves (`--role target`).
    #[arg(long, default_value = "512M", value_parser = units::parse_size)]
    pool: u64,
    /// Pre-shared key for the handshake (both roles).
    #[arg(long, env = "KVLANE_PSK", hide_env_values = true)]
    psk: Option<String>,
    /// Host the target tells peers to reach its data plane at when it
    /// listens on a wildcard address (`--role target`); default: the
    /// address each peer's control connection reached.
    #[arg(long)]
    advertise: Option<String>,
    /// Dial a peer's data endpoint on any host it advertises; default: only
    /// on the host of the control connection to it (a target that
    /// advertises another host on purpose needs this).
    #[arg(long)]
    dial_any_data_host: bool,
    /// With `--backend shm` and `--role target|initiator`: the pool is
    /// plain host memory (`Region::alloc`, as memory an engine allocated),
    /// served by cross-memory attach (`process_vm_readv`/`writev`) instead
    /// of a shared memory file. Opt-in: it exposes the whole process to
    /// same-user peers (see `kvlane_data::shm`).
    #[arg(long)]
    shm_cross_memory_attach: bool,
    /// Peer counts (comma list): for each, that many initiator agents, in
    /// `--peer-procs` processes, against one target agent in this process
    /// (127.0.0.1); one row per count with aggregate GB/s, p99 latency and
    /// the threads, RSS and fds of the target and of the initiators. Uses
    /// the first `--batch` (per agent) and the network backend of
    /// `--backend`.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<usize>,
    /// Initiator processes the `--peers` agents are spread over.
    #[arg(long, default_value_t = 2)]
    peer_procs: usize,
    /// Internal: run as one `--peers` initiator process.
    #[arg(long, hide = true)]
    peers_worker: bool,
    /// Internal: agents of one `--peers-worker` process.
    #[arg(long, hide = true, default_value_t = 1)]
    agents: usize,
    /// Memory the backends move from and to: `host`, or a GPU (`cuda:0`,
    /// `rocm:0`). The memcpy and raw-tcp baselines stay in host memory.
    #[arg(long, default_value = "host", value_parser = parse_memory)]
    memory: Memory,
    /// Rails per backend: in-process runs give tcp that many tcp backends
    /// and verbs that many RDMA devices (those with an ACTIVE port, in
    /// order), joined as one (`kvlane_data::Rails`); `--role` agents use at
    /// most that many of theirs. Rows carry `rails`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    rails: u64,
    /// With `--role target`: serve the target agent's Prometheus metrics at
    /// `http://ADDR/metrics` (the address is printed on stderr) while it
    /// runs.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

/// `--memory`: host or a GPU.
#[derive(Clone, Copy, Debug)]
struct Memory(Option<kvlane_data::GpuDevice>);

fn parse_memory(s: &str) -> Result<Memory, String> {
    if s == "host" {
        return Ok(Memory(None));
    }
    s.parse()
        .map(|d| Memory(Some(d)))
        .map_err(|e| format!("{e}, or host"))
}

/// The agent backend of `--role target|initiator`: the one entry of
/// `--backend` that is not loopback (the default list gives `auto`).
fn role_backend(args: &[BackendArg]) -> Result<kvlane::BackendChoice, String> {
    let mut network = args.iter().filter(|b| **b != BackendArg::Loopback);
    match (network.next(), network.next()) {
        (Some(b), None) => Ok(match b {
            BackendArg::Tcp => kvlane::BackendChoice::Tcp,
            BackendArg::Verbs => kvlane::BackendChoice::Verbs,
            BackendArg::Shm => kvlane::BackendChoice::Shm,
            _ => kvlane::BackendChoice::Auto,
        }),
        (None, _) => Err(
            "--role target|initiator needs a network backend (tcp, verbs, shm or auto), not loopback"
                .into(),
        ),
        (Some(_), Some(_)) => {
            Err("--role target|initiator takes one network backend in --backend".into())
        }
    }
}

/// Rail backends with their names, in rail order.
type NamedRails = Vec<(String, Box<dyn Backend>)>;

/// `rails` backends of `kind` joined as one (one: the backend itself).
fn make_rails(kind: BackendKind, rails: usize) -> Result<Box<dyn Backend>, BenchError> {
    if rails <= 1 || kind == BackendKind::Loopback {
        return make_backend(kind);
    }
    let data = |source| BenchError::Data {
        backend: kind.to_string(),
        source,
    };
    let named: NamedRails = match kind {
        BackendKind::Verbs => verbs_rails(rails).map_err(data)?,
        _ => (0..rails)
            .map(|i| Ok((format!("{kind}{i}"), make_backend(kind)?)))
            .collect::<Result<_, BenchError>>()?,
    };
    Ok(Box::new(
        kvlane_data::Rails::new(named, kvlane_data::RailsConfig::default()).map_err(data)?,
    ))
}

/// Verbs backends on the first `n` devices with an ACTIVE port.
#[cfg(feature = "verbs")]
fn verbs_rails(n: usize) -> Result<NamedRails, kvlane_data::DataError> {
    use kvlane_data::verbs::{list_devices, DeviceConfig, VerbsBackend, VerbsConfig};
    let names: Vec<String> = list_devices()?
        .into_iter()
        .filter(|d| d.first_active_port().is_some())
        .map(|d| d.name)
        .collect();
    if names.len() < n {
        return Err(kvlane_data::DataError::Unsupported {
            backend: "verbs",
            what: "--rails asks for more RDMA devices than have an ACTIVE port",
        });
    }
    names
        .into_iter()
        .take(n)
        .map(|name| {
            let cfg = VerbsConfig {
                device: DeviceConfig::device(name.clone()),
                ..VerbsConfig::default()
            };
            Ok((name, Box::new(VerbsBackend::new(cfg)?) as Box<dyn Backend>))
        })
        .collect()
}

#[cfg(not(feature = "verbs"))]
fn verbs_rails(_: usize) -> Result<NamedRails, kvlane_data::DataError> {
    verbs_backend().map(|b| vec![("verbs".into(), b)])
}

fn make_backend(kind: BackendKind) -> Result<Box<dyn Backend>, BenchError> {
    let data = |source| BenchError::Data {
        backend: kind.to_string(),
        source,
    };
    match kind {
        BackendKind::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendKind::Tcp => Ok(Box::new(
            TcpBackend::new(TcpConfig::default()).map_err(data)?,
        )),
        BackendKind::Verbs => verbs_backend().map_err(data),
        BackendKind::Shm => shm_backend().map_err(data),
    }
}

#[cfg(target_os = "linux")]
fn shm_backend() -> Result<Box<dyn Backend>, kvlane_data::DataError> {
    Ok(Box::new(kvlane_data::ShmBackend::new(
        kvlane_data::ShmConfig::default(),
    )?))
}

#[cfg(not(target_os = "linux"))]
fn shm_backend() -> Result<Box<dyn Backend>, kvlane_data::DataError> {
    Err(kvlane_data::DataError::Unsupported {
        backend: "shm",
        what: "the shm backend is Linux only",
    })
}

#[cfg(feature = "verbs")]
fn verbs_backend() -> Result<Box<dyn Backend>, kvlane_data::DataError> {
    Ok(Box::new(kvlane_data::verbs::VerbsBackend::new(
        kvlane_data::verbs::VerbsConfig::default(),
    )?))
}

#[cfg(not(feature = "verbs"))]
fn verbs_backend() -> Result<Box<dyn Backend>, kvlane_data::DataError> {
    Err(kvlane_data::DataError::Unsupported {
        backend: "verbs",
        what: "this kvlane was built without the `verbs` feature",
    })
}

/// `auto`: verbs when it can be opened here, else tcp (saying why).
fn resolve(arg: BackendArg) -> BackendKind {
    match arg {
        BackendArg::Loopback => BackendKind::Loopback,
        BackendArg::Tcp => BackendKind::Tcp,
        BackendArg::Verbs => BackendKind::Verbs,
        BackendArg::Shm => BackendKind::Shm,
        BackendArg::Auto => match verbs_backend() {
            Ok(_) => BackendKind::Verbs,
            Err(e) => {
                eprintln!("kvlane bench: auto backend: using tcp ({e})");
                BackendKind::Tcp
            }
        },
    }
}

/// Runs `kvlane bench`.
pub(crate) fn run(args: BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.batch.contains(&0) || args.threads == 0 {
        return Err("--batch and --threads must be at least 1".into());
    }
    // Sizes become region lengths: refuse what no region can hold before
    // anything is allocated or printed.
    for &b in &args.block_sizes {
        units::check_region_size("--block-sizes", b)?;
    }
    units::check_region_size("--pool", args.pool)?;
    let mut backends: Vec<BackendKind> = Vec::new();
    if args.role == Role::Local {
        for &b in &args.backend {
            let k = resolve(b);
            if !backends.contains(&k) {
                backends.push(k);
            }
        }
    }
    let plan = BenchPlan {
        backends,
        ops: args
            .op
            .iter()
            .map(|o| {
                if *o == OpArg::Read {
                    Op::Read
                } else {
                    Op::Write
                }
            })
            .collect(),
        block_sizes: args.block_sizes.clone(),
        batches: args.batch.clone(),
        duration: args.duration,
        baselines: !args.no_baseline,
        threads: args.threads,
        memory: args.memory.0,
        rails: args.rails as usize,
        post: args.post,
    };
    let opts = remote::RemoteOpts {
        backend: if args.role == Role::Local {
            kvlane::BackendChoice::Auto
        } else {
            role_backend(&args.backend)?
        },
        psk: args.psk.clone(),
        advertise: args.advertise.clone(),
        dial_any_data_host: args.dial_any_data_host,
        shm_cross_memory_attach: args.shm_cross_memory_attach,
        memory: args.memory.0,
        rails: args.rails as usize,
        metrics: args.metrics.clone(),
    };
    if args.metrics.is_some() && args.role != Role::Target {
        return Err("--metrics serves the target agent's metrics: it needs --role target".into());
    }
    if args.post != super::PostMode::Each
        && (args.role != Role::Initiator || !args.peers.is_empty())
    {
        return Err(format!(
            "--post {} posts through an agent's Peer: it needs --role initiator",
            args.post.name()
        )
        .into());
    }
    if args.peers_worker {
        let addr = args
            .connect
            .as_deref()
            .ok_or("--peers-worker needs --connect")?;
        let opts = remote::RemoteOpts {
            backend: role_backend(&args.backend)?,
            ..opts
        };
        return super::peers::worker(addr, args.agents, &plan, &opts);
    }
    if !args.peers.is_empty() {
        if args.role != Role::Local {
            return Err("--peers runs its own target and initiators: leave out --role".into());
        }
        let opts = remote::RemoteOpts {
            backend: role_backend(&args.backend)?,
            ..opts
        };
        let peers = super::peers::PeersOpts {
            counts: args.peers.clone(),
            procs: args.peer_procs,
            json: args.json,
        };
        return super::peers::run(&plan, &opts, &peers);
    }
    match args.role {
        Role::Target => Ok(crate::runtime().block_on(remote::target(
            &args.listen,
            args.pool,
            &opts,
            plan.baselines,
        ))?),
        Role::Initiator => {
            let addr = args
                .connect
                .as_deref()
                .ok_or("--role initiator needs --connect HOST:PORT")?;
            // Agent rows, and as many raw-tcp rows when the target serves
            // its raw port.
            let points = plan.block_sizes.len() * plan.batches.len() * plan.ops.len();
            let out = Output::new(
                args.json,
                (points * (1 + usize::from(plan.baselines))) as u64,
            )?;
            let r = remote::initiator(addr, &plan, &opts, |w| out.progress(w), |r| out.row(r));
            out.finish();
            Ok(r?)
        }
        Role::Local => {
            let total = plan.block_sizes.len() * local::rows_per_block_size(&plan);
            let out = Output::new(args.json, total as u64)?;
            let rails = plan.rails;
            let factory = move |kind| make_rails(kind, rails);
            let r = local::run(&plan, &factory, |w| out.progress(w), |r| out.row(r));
            out.finish();
            Ok(r?)
        }
    }
}
