//! `kvlane`: benchmark, serve, ping and list devices.
#![forbid(unsafe_code)]

mod bench;
mod devices;
mod liveness;
mod logging;
mod out;
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
    ///
    /// Baseline rows come from the same run, in slices between the
    /// backend points of each block size: `memcpy` copies the same blocks
    /// on `--threads` threads (the loopback ceiling); `raw-tcp` moves them
    /// over plain TCP streams, as many as the tcp backend opens (4 per
    /// thread), each block split into 512 KiB requests and striped over
    /// them as the backend does it (streams take turns every 512 KiB):
    /// `read` is READ-shaped (a small request out, the block back), `write`
    /// WRITE-shaped (the block out, a small acknowledgement back). Locally,
    /// `raw-tcp` runs on 127.0.0.1, when `tcp` is measured.
    ///
    /// Two hosts: `--role target` also serves a raw TCP sink/source on any
    /// free port of its `--listen` host and names that port in its engine
    /// id (`kvlane-bench-target raw-tcp=PORT`, printed on its first line
    /// too); `--role initiator` learns it in the handshake and measures the
    /// `raw-tcp` rows against the host it dialed with `--connect`: the
    /// link's ceiling, beside the agent's rows. `--no-baseline` turns both
    /// off.
    Bench(bench::BenchArgs),
    /// Register a KV cache and serve peers until Ctrl-C.
    Serve(serve::ServeArgs),
    /// Preflight, handshake and round-trip samples against an agent.
    Ping(ping::PingArgs),
    /// List GPUs (CUDA, ROCm) with their PCI addresses and RDMA devices,
    /// or say why there are none, and the GPU x NIC matrix of the PCIe
    /// tree; exits 2 when there is no RDMA device.
    Devices(devices::DevicesArgs),
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

/// The CLI's runtime. Its workers apply `KVLANE_CPUS` as they start (an
/// invalid value leaves them where they inherited; building an agent
/// reports it).
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    let cpus = kvlane::CpuPlacement::from_env()
        .ok()
        .flatten()
        .unwrap_or_default();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_start(move || cpus.clone().enter())
        .enable_all()
        .build()
        .expect("cannot start the tokio runtime")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logging never blocks the control or data path: lines go through a
    // bounded queue to a writer thread (a full stderr pipe drops them,
    // counted), drained (bounded) before the process exits.
    let log = logging::Lossy::stderr();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(log.clone())
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let code = match cli.cmd {
        Command::Bench(args) => {
            bench::run(args).map_or_else(|e| report(&*e), |()| ExitCode::SUCCESS)
        }
        Command::Serve(args) => {
            let rt = runtime();
            let r = rt.block_on(serve::run(args));
            // Tasks still running (a close cut short) are not waited for.
            rt.shutdown_timeout(std::time::Duration::from_millis(100));
            r.map_or_else(|e| report(&e), |()| ExitCode::SUCCESS)
        }
        Command::Ping(args) => runtime()
            .block_on(ping::run(args))
            .map_or_else(|e| report(&e), |()| ExitCode::SUCCESS),
        Command::Soak(args) => match runtime().block_on(soak::run(args)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => report(&*e),
        },
        Command::Devices(args) => {
            if devices::run(&args) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            }
        }
    };
    log.drain_for(std::time::Duration::from_millis(100));
    code
}
