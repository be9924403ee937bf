//! `kvlane serve`: an agent that registers a KV cache and serves peers
//! until interrupted.

use crate::liveness::LivenessArgs;
use crate::units;
use clap::Args;
use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, Error};
use std::io::Write;

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
    /// usable, else tcp).
    #[arg(long, value_enum, default_value = "tcp")]
    pub(crate) backend: ServeBackend,
    /// Pre-shared key peers must prove.
    #[arg(long, env = "KVLANE_PSK", hide_env_values = true)]
    pub(crate) psk: Option<String>,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (`host:port`).
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<String>,
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
    /// Verbs if usable here, else tcp.
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

/// Runs until Ctrl-C / SIGTERM, printing peer events and notifications.
pub(crate) async fn run(args: ServeArgs) -> Result<(), Error> {
    let agent = agent(&args).await?;
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
    let metrics = match &args.metrics {
        Some(addr) => Some(serve_metrics(&agent, addr).await?),
        None => None,
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| {
            Error::from(kvlane::data::DataError::Io {
                op: "install SIGTERM handler".into(),
                source: e,
            })
        })?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            ev = events.recv() => match ev {
                Ok(ev) => println!("event {} {} {:?}", ev.peer, ev.addr, ev.kind),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => println!("event lagged {n}"),
                Err(_) => break,
            },
            Some(n) = async { match notes.as_mut() { Some(rx) => rx.recv().await, None => None } } => {
                println!("notification from={} payload={:?}", n.from, String::from_utf8_lossy(&n.payload));
            }
        }
    }
    eprintln!("kvlane serve: shutting down");
    if let Some(task) = metrics {
        task.abort();
    }
    agent.close().await;
    Ok(())
}

/// Binds `addr` and answers `GET /metrics` with the agent's metrics until
/// the returned task is aborted.
pub(crate) async fn serve_metrics(
    agent: &Agent,
    addr: &str,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::from(kvlane::data::DataError::Io {
            op: format!("bind the metrics listener on {addr}"),
            source: e,
        })
    })?;
    let bound = listener
        .local_addr()
        .map_or(addr.to_string(), |a| a.to_string());
    println!("metrics http://{bound}/metrics");
    let agent = agent.clone();
    Ok(tokio::spawn(kvlane::metrics::serve_http(
        listener,
        move || agent.metrics(),
    )))
}
