//! `kvlane serve`: an agent that registers a KV cache and serves peers
//! until interrupted.

use crate::liveness::LivenessArgs;
use crate::units;
use clap::Args;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, Error};
use std::io::Write;
use std::net::IpAddr;
use std::time::Duration;

/// How long `serve` may take to exit after SIGTERM / Ctrl-C: the agent's
/// orderly close gets this long, then the process exits regardless of load.
const EXIT_BUDGET: Duration = Duration::from_millis(600);

/// Why `kvlane serve` did not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeError {
    /// A non-loopback listen address without a key.
    #[error(
        "refusing to serve on {addr} without --psk: anyone who reaches a non-loopback \
         address could read and write the served memory; give --psk KEY (or KVLANE_PSK), \
         or --insecure to serve without authentication"
    )]
    Unauthenticated {
        /// The listen address.
        addr: String,
    },
    /// Output could not be set up.
    #[error("cannot start the output thread")]
    Output(#[source] std::io::Error),
    /// The agent failed.
    #[error(transparent)]
    Agent(#[from] Error),
}

/// Options of `kvlane serve` (also used by `bench --role target`).
#[derive(Args, Debug, Clone)]
pub(crate) struct ServeArgs {
    /// Control-plane address to listen on (`host:port`, port 0 = any).
    #[arg(long, default_value = "127.0.0.1:5555")]
    pub(crate) listen: String,
    /// Data-plane (tcp backend) address; default: the control host, any port.
    #[arg(long)]
    pub(crate) data_listen: Option<String>,
    /// Host peers are told to reach the data plane at when listening on a
    /// wildcard address; default: the address each peer's control
    /// connection reached.
    #[arg(long)]
    pub(crate) advertise: Option<String>,
    /// Engine id shown to peers.
    #[arg(long, default_value = "kvlane-serve")]
    pub(crate) engine_id: String,
    /// Layers of the served KV cache.
    #[arg(long, default_value_t = 4)]
    pub(crate) layers: u32,
    /// Blocks per layer.
    #[arg(long, default_value_t = 64)]
    pub(crate) blocks: u32,
    /// Bytes per block (per layer and K/V part; K, M units).
    #[arg(long, default_value = "16K", value_parser = units::parse_size)]
    pub(crate) block_size: u64,
    /// Initial contents: byte i of the cache is `pattern_byte(seed, i)`.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u8,
    /// Data-plane backend (`auto`: verbs when built with it and a device is
    /// usable, else tcp; the served cache is plain memory, so no shm: see
    /// the README's "Same host").
    #[arg(long, value_enum, default_value = "tcp")]
    pub(crate) backend: ServeBackend,
    /// Pre-shared key peers must prove.
    #[arg(long, env = "KVLANE_PSK", hide_env_values = true)]
    pub(crate) psk: Option<String>,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (`host:port`).
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<String>,
    /// Serve on a non-loopback address without `--psk` (`kvlane serve`
    /// refuses to otherwise).
    #[arg(long)]
    pub(crate) insecure: bool,
    /// Dial a peer's data endpoint on any host it advertises; default: only
    /// on the host of the control connection to it (a target that
    /// advertises another host on purpose needs this).
    #[arg(long)]
    pub(crate) dial_any_data_host: bool,
    #[command(flatten)]
    pub(crate) liveness: LivenessArgs,
}

/// Backends `serve` can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ServeBackend {
    /// Software one-sided RDMA over TCP.
    Tcp,
    /// libibverbs (built with the `verbs` feature).
    Verbs,
    /// The agent's `Auto`: verbs if usable here, else tcp (its plain
    /// memory keeps it off shm; the reason is logged at `info`).
    Auto,
}

impl From<ServeBackend> for BackendChoice {
    fn from(b: ServeBackend) -> Self {
        match b {
            ServeBackend::Tcp => Self::Tcp,
            ServeBackend::Verbs => Self::Verbs,
            ServeBackend::Auto => Self::Auto,
        }
    }
}

/// The cache contents `serve --seed` starts with (tests recompute it).
pub(crate) fn pattern_byte(seed: u8, i: u64) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)
}

/// The layout `serve` registers.
pub(crate) fn layout(args: &ServeArgs) -> Result<KvLayout, Error> {
    Ok(KvLayout::new(
        args.layers,
        args.blocks,
        args.block_size,
        KvParts::Separate,
        LayoutOrder::LayerMajor,
    )?)
}

/// Builds the agent `serve` runs.
pub(crate) async fn agent(args: &ServeArgs) -> Result<Agent, Error> {
    let layout = layout(args)?;
    let len = layout.required_len().unwrap_or(u64::MAX);
    let data: Vec<u8> = (0..len).map(|i| pattern_byte(args.seed, i)).collect();
    let region = Region::from_vec(data, Access::ALL)?;
    let control = args
        .liveness
        .config()
        .map_err(kvlane::control::ControlError::from)?;
    let mut b = Agent::builder()
        .engine_id(&args.engine_id)
        .listen(&args.listen)
        .backend(args.backend.into())
        .control_config(control)
        .dial_any_data_host(args.dial_any_data_host)
        .register_kv(layout, region);
    if let Some(d) = &args.data_listen {
        b = b.data_listen(d);
    }
    if let Some(a) = &args.advertise {
        b = b.advertise(a);
    }
    if let Some(k) = &args.psk {
        b = b.psk(k.as_bytes().to_vec());
    }
    b.build().await
}

/// What serving without a key exposes, when there is no key. Loopback is
/// served without one, but it is not private: every local user (every
/// process on the host) can connect.
fn unauthenticated_warning(args: &ServeArgs, bound: &str) -> Option<String> {
    if args.psk.is_some() {
        return None;
    }
    let who = if is_loopback(&args.listen) {
        "every local user (any process on this host)"
    } else {
        "anyone who reaches this address"
    };
    Some(format!(
        "serving on {bound} without --psk: {who} can connect and read and write the served \
         memory; give --psk KEY (or KVLANE_PSK) to require a key"
    ))
}

/// Whether `listen` (`host:port`) binds only loopback.
fn is_loopback(listen: &str) -> bool {
    let host = listen
        .rsplit_once(':')
        .map_or(listen, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Runs until Ctrl-C / SIGTERM, printing peer events and notifications.
/// After the signal it exits within [`EXIT_BUDGET`] (plus the runtime's
/// shutdown) whatever the load: event lines go through a lossy queue, so
/// a stdout nobody reads never holds up the loop that sees the signal.
pub(crate) async fn run(args: ServeArgs) -> Result<(), ServeError> {
    if args.psk.is_none() && !args.insecure && !is_loopback(&args.listen) {
        return Err(ServeError::Unauthenticated {
            addr: args.listen.clone(),
        });
    }
    let agent = agent(&args).await?;
    if let Some(warning) = unauthenticated_warning(&args, agent.local_addr()) {
        // Straight to stderr, whatever RUST_LOG filters, before the
        // `listening` line: the one line a user must see.
        eprintln!("kvlane serve: warning: {warning}");
    }
    let mut events = agent.events();
    let mut notes = agent.notifications();
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "listening {} engine={} incarnation={:#x} backend={}",
            agent.local_addr(),
            agent.engine_id(),
            agent.incarnation(),
            agent.backend_kind()
        );
        let _ = out.flush();
    }
    let metrics = metrics_if(&agent, args.metrics.as_deref(), |url| {
        crate::out::outln!("metrics {url}")
    })
    .await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| {
            Error::from(kvlane::data::DataError::Io {
                op: "install SIGTERM handler".into(),
                source: e,
            })
        })?;
    let out = crate::logging::Lossy::stdout().map_err(ServeError::Output)?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            ev = events.recv() => match ev {
                Ok(ev) => out.line(format!("event {} {} {:?}", ev.peer, ev.addr, ev.kind)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => out.line(format!("event lagged {n}")),
                Err(_) => break,
            },
            Some(n) = async { match notes.as_mut() { Some(rx) => rx.recv().await, None => None } } => {
                out.line(format!("notification from={} payload={:?}", n.from, String::from_utf8_lossy(&n.payload)));
            }
        }
    }
    tracing::info!("kvlane serve: shutting down");
    if let Some(task) = metrics {
        task.abort();
    }
    if tokio::time::timeout(EXIT_BUDGET, agent.close())
        .await
        .is_err()
    {
        tracing::warn!(budget = ?EXIT_BUDGET, "agent close did not finish in time; exiting anyway");
    }
    out.drain_for(Duration::from_millis(50));
    Ok(())
}

/// With an address, [`serve_metrics`] there and hand its URL to `announce`
/// (`--metrics` of serve, soak and bench); `None` without one.
pub(crate) async fn metrics_if(
    agent: &Agent,
    addr: Option<&str>,
    announce: impl FnOnce(&str),
) -> Result<Option<tokio::task::JoinHandle<()>>, Error> {
    let Some(addr) = addr else { return Ok(None) };
    let (task, bound) = serve_metrics(agent, addr).await?;
    announce(&format!("http://{bound}/metrics"));
    Ok(Some(task))
}

/// Binds `addr` and answers `GET /metrics` with the agent's metrics until
/// the returned task is aborted; returns it and the bound address.
pub(crate) async fn serve_metrics(
    agent: &Agent,
    addr: &str,
) -> Result<(tokio::task::JoinHandle<()>, String), Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::from(kvlane::data::DataError::Io {
            op: format!("bind the metrics listener on {addr}"),
            source: e,
        })
    })?;
    let bound = listener
        .local_addr()
        .map_or(addr.to_string(), |a| a.to_string());
    let agent = agent.clone();
    let task = tokio::spawn(kvlane::metrics::serve_http(listener, move || {
        agent.metrics()
    }));
    Ok((task, bound))
}

#[cfg(test)]
mod tests {
    use super::is_loopback;

    #[test]
    fn loopback_addresses() {
        for a in ["127.0.0.1:5555", "127.3.4.5:0", "[::1]:5555", "localhost:1"] {
            assert!(is_loopback(a), "{a}");
        }
        for a in [
            "0.0.0.0:5555",
            "[::]:5555",
            "10.0.0.1:1",
            "example.com:1",
            "[::ffff:10.0.0.1]:1",
        ] {
            assert!(!is_loopback(a), "{a}");
        }
    }
}
