//! `kvlane`: benchmark, serve, ping and list devices.
#![forbid(unsafe_code)]

mod bench;
mod bench_cli;
mod bench_remote;
mod devices;
mod ping;
mod serve;
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
        Command::Devices => {
            if devices::run() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
    }
}
