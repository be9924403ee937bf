//! `kvlane`: benchmark, serve, ping and list devices.
#![forbid(unsafe_code)]

mod bench;
mod bench_cli;
mod bench_remote;
mod devices;
mod liveness;
mod ping;
mod serve;
mod soak;
mod units;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
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
    Bench(bench_cli::BenchArgs),
    /// Register a KV cache and serve peers until Ctrl-C.
    Serve(serve::ServeArgs),
    /// Preflight, handshake and round-trip samples against an agent.
    Ping(ping::PingArgs),
    /// List RDMA devices, or say why there are none.
    Devices,
    /// Keep verified transfers running against agents and report every
    /// failure, peer event, restart check and latency.
    ///
    /// Per target, in a loop: WRITE a fresh pattern into a few of its blocks,
    /// READ them back into other local blocks and compare every byte. A
    /// failed transfer is printed with its error kind (`PeerLost`, `Timeout`,
    /// `Stale`, ...) and the run goes on: a dead peer comes back through the
    /// control plane's reconnect, a connection that is gone or never came up
    /// is dialed again with a bounded backoff. After a restart, a transfer
    /// prepared against the old incarnation is posted and must fail with
    /// `Stale`. Periodic `stats` lines give transfers done and p50/p99
    /// latency; the `summary` gives totals and the liveness budget in effect.
    ///
    /// Exit code 1 when a byte differed, a target never came up or cannot be
    /// soaked (block size), or a stale transfer was accepted; transfer
    /// failures alone do not fail the run.
    Soak(soak::SoakArgs),
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

pub(crate) fn runtime() -> tokio::runtime::Runtime {
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
        Command::Bench(args) => {
            bench_cli::run(args).map_or_else(|e| report(&*e), |()| ExitCode::SUCCESS)
        }
        Command::Serve(args) => runtime()
            .block_on(serve::run(args))
            .map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Ping(args) => runtime()
            .block_on(ping::run(args))
            .map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Soak(args) => match runtime().block_on(soak::run(args)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => report(&*e),
        },
        Command::Devices => {
            if devices::run() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
    }
}
