//! `kvlane ping ADDR`: preflight, handshake, round-trip samples.

use crate::units;
use clap::Args;
use kvlane::{Agent, BackendChoice, Error};
use std::time::Duration;

/// Options of `kvlane ping`.
#[derive(Args, Debug)]
pub(crate) struct PingArgs {
    /// The agent to ping (`host:port` of its control plane).
    pub(crate) addr: String,
    /// Round trips to measure.
    #[arg(long, short = 'c', default_value_t = 5)]
    pub(crate) count: u32,
    /// Preflight and handshake timeout (e.g. 2s).
    #[arg(long, default_value = "2s", value_parser = units::parse_duration)]
    pub(crate) timeout: Duration,
    /// Pre-shared key.
    #[arg(long, env = "KVLANE_PSK", hide_env_values = true)]
    pub(crate) psk: Option<String>,
    /// Dial a peer's data endpoint on any host it advertises; default: only
    /// on the host of the control connection to it (a target that
    /// advertises another host on purpose needs this).
    #[arg(long)]
    pub(crate) dial_any_data_host: bool,
}

/// Why `ping` failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PingError {
    #[error("preflight failed")]
    Probe(#[from] kvlane_control::ProbeError),
    #[error("{addr}: {source}")]
    Agent {
        addr: String,
        #[source]
        source: Error,
    },
}

pub(crate) async fn run(args: PingArgs) -> Result<(), PingError> {
    let addr = args.addr.clone();
    let wrap = |source| PingError::Agent {
        addr: addr.clone(),
        source,
    };
    kvlane_control::probe(&args.addr, args.timeout).await?;
    let config = kvlane_control::Config {
        handshake_timeout: args.timeout,
        reconnect: false,
        ..kvlane_control::Config::default()
    };
    let mut b = Agent::builder()
        .engine_id(format!("kvlane-ping-{}", std::process::id()))
        .backend(BackendChoice::Tcp)
        .dial_any_data_host(args.dial_any_data_host)
        .control_config(config);
    if let Some(k) = &args.psk {
        b = b.psk(k.as_bytes().to_vec());
    }
    let agent = b.build().await.map_err(wrap)?;
    let t0 = std::time::Instant::now();
    let peer = agent.connect(&args.addr).await.map_err(wrap)?;
    crate::out::outln!(
        "connected to {} engine={} incarnation={:#x} handshake={:.3} ms",
        args.addr,
        peer.engine_id(),
        peer.incarnation().unwrap_or(0),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let mut rtts = Vec::new();
    for seq in 0..args.count {
        let rtt = peer.ping().await.map_err(wrap)?;
        crate::out::outln!(
            "pong from {} seq={seq} rtt={:.1} us",
            args.addr,
            rtt.as_secs_f64() * 1e6
        );
        rtts.push(rtt);
    }
    if !rtts.is_empty() {
        rtts.sort();
        let avg = rtts.iter().sum::<Duration>() / rtts.len() as u32;
        crate::out::outln!(
            "{} round trips: min {:.1} us, avg {:.1} us, max {:.1} us",
            rtts.len(),
            rtts[0].as_secs_f64() * 1e6,
            avg.as_secs_f64() * 1e6,
            rtts[rtts.len() - 1].as_secs_f64() * 1e6
        );
    }
    agent.close().await;
    Ok(())
}
