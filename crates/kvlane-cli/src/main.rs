//! `kvlane`: benchmark, serve, ping and list devices.
#![forbid(unsafe_code)]

mod bench;
mod devices;
mod ping;
mod serve;
mod units;

use bench::{BenchError, BenchPlan};
use clap::{Parser, Subcommand, ValueEnum};
use kvlane_data::tcp::{TcpBackend, TcpConfig};
use kvlane_data::{Backend, BackendKind, LoopbackBackend, Op};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "kvlane",
    version,
    about = "KV-cache transport: benchmark and tools"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure batched one-sided READ/WRITE throughput and latency.
    Bench(BenchArgs),
    /// Register a KV cache and serve peers until Ctrl-C.
    Serve(serve::ServeArgs),
    /// Preflight, handshake and round-trip samples against an agent.
    Ping(ping::PingArgs),
    /// List RDMA devices, or say why there are none.
    Devices,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Loopback,
    Tcp,
    Verbs,
    /// The best backend this machine has (verbs, else tcp).
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Read,
    Write,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Backends to measure (comma list).
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
    /// Measuring time per point (e.g. 2s, 500ms).
    #[arg(long, default_value = "1s", value_parser = units::parse_duration)]
    duration: std::time::Duration,
    /// Skip the memcpy / raw-tcp baseline rows.
    #[arg(long)]
    no_baseline: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

fn make_backend(kind: BackendKind) -> Result<Box<dyn Backend>, BenchError> {
    match kind {
        BackendKind::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendKind::Tcp => TcpBackend::new(TcpConfig::default())
            .map(|b| Box::new(b) as Box<dyn Backend>)
            .map_err(|source| BenchError::Data {
                backend: "tcp".into(),
                source,
            }),
        #[cfg(feature = "verbs")]
        BackendKind::Verbs => {
            // Device: KVLANE_IB_DEVICE, else the first ACTIVE port.
            kvlane_data::verbs::VerbsBackend::new(kvlane_data::verbs::VerbsConfig::default())
                .map(|b| Box::new(b) as Box<dyn Backend>)
                .map_err(|e| BenchError::Data {
                    backend: "verbs".into(),
                    source: e.into(),
                })
        }
        #[cfg(not(feature = "verbs"))]
        other => Err(BenchError::Failed {
            backend: other.to_string(),
            what: "not available in this build (cargo build --features verbs)".into(),
        }),
    }
}

fn resolve(arg: BackendArg) -> BackendKind {
    match arg {
        BackendArg::Loopback => BackendKind::Loopback,
        BackendArg::Tcp | BackendArg::Auto => BackendKind::Tcp,
        BackendArg::Verbs => BackendKind::Verbs,
    }
}

fn bench(args: BenchArgs) -> Result<(), BenchError> {
    if args.batch.contains(&0) {
        return Err(BenchError::Failed {
            backend: "bench".into(),
            what: "--batch must be at least 1".into(),
        });
    }
    let mut backends: Vec<BackendKind> = args.backend.iter().map(|&b| resolve(b)).collect();
    backends.dedup();
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
        block_sizes: args.block_sizes,
        batches: args.batch,
        duration: args.duration,
        baselines: !args.no_baseline,
    };
    let total = plan.block_sizes.len()
        * plan.batches.len()
        * (plan.backends.len() * plan.ops.len()
            + usize::from(plan.baselines)
            + usize::from(plan.baselines && plan.backends.contains(&BackendKind::Tcp)));
    let tty = std::io::stderr().is_terminal();
    let mut step = 0;
    let progress = |what: &str| {
        step += 1;
        if tty {
            eprint!("\r\x1b[2K[{step}/{total}] {what}");
        } else {
            eprintln!("[{step}/{total}] {what}");
        }
    };
    let mut out = std::io::stdout().lock();
    if !args.json {
        let _ = writeln!(out, "{}", bench::table_header());
    }
    let json = args.json;
    let result = bench::run(&plan, &make_backend, progress, |row| {
        if tty {
            eprint!("\r\x1b[2K");
        }
        let line = if json {
            serde_json::to_string(row).unwrap_or_default()
        } else {
            bench::table_line(row)
        };
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    });
    if tty {
        eprintln!();
    }
    result
}

fn report(e: &dyn std::error::Error) -> ExitCode {
    eprintln!("kvlane: error: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        eprintln!("  caused by: {s}");
        source = s.source();
    }
    ExitCode::FAILURE
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("cannot start the tokio runtime")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.cmd {
        Command::Bench(args) => bench(args).map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Serve(args) => runtime()
            .block_on(serve::run(args))
            .map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Ping(args) => runtime()
            .block_on(ping::run(args))
            .map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Devices => {
            if devices::run() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
    }
}
