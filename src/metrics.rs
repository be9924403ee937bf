//! Prometheus metrics of an agent: what it moved, how long that took, what
//! failed, and the state of its peers.
//!
//! [`Agent::metrics`](crate::Agent::metrics) renders them in the text
//! exposition format; [`serve_http`] answers `GET /metrics` with them
//! (`kvlane serve --metrics ADDR`). Names follow Prometheus conventions:
//!
//! | name | type | labels |
//! |---|---|---|
//! | `kvlane_transfers_total` | counter | `peer`, `op`, `rail`, `outcome` (`ok` or an error kind) |
//! | `kvlane_transfer_bytes_total` | counter | `peer`, `op`, `rail` (bytes of transfers that completed) |
//! | `kvlane_transfer_duration_seconds` | histogram | `op` (post to completion) |
//! | `kvlane_transfer_errors_total` | counter | `kind` |
//! | `kvlane_peers` | gauge | `state` (`up`, `attaching`, `down`) |
//! | `kvlane_transfers_in_flight` | gauge | |
//! | `kvlane_notifications_dropped_total` | counter | (unread queue full) |
//! | `kvlane_notifications_queued` | gauge | (delivered, not yet read by the application) |
//! | `kvlane_notifications_refused_total` | counter | (notifications naming another sender than the peer they came from, or from a sender that maps to no connection) |
//! | `kvlane_offers_dropped_total` | counter | (data-plane endpoint offers a peer sent while one of its offers was being accepted; one is accepted at a time per connection) |
//!
//! | `kvlane_rail_bytes_total` | counter | `rail` (multi-rail agents: bytes each rail carried) |
//! | `kvlane_rail_parts_total` | counter | `rail` (transfer parts completed on it) |
//! | `kvlane_rail_failures_total` | counter | `rail` (parts that failed on it) |
//! | `kvlane_rail_reposts_total` | counter | `rail` (failed parts moved to another rail) |
//! | `kvlane_rail_rejoins_total` | counter | `rail` (times paired again by an endpoint exchange over another rail: verbs) |
//! | `kvlane_rail_dropped_messages_total` | counter | `rail` (rails messages dropped on it) |
//! | `kvlane_rail_down_peers` | gauge | `rail` (peers it is set aside for) |
//!
//! | `kvlane_control_refused_total` | counter | `reason`: `unauthenticated` (inbound peers refused before they proved the key: peer cap, failed or incompatible handshake), `handshake_evicted` (handshakes dropped for newer ones at the handshake cap) |
//! | `kvlane_control_frames_dropped_total` | counter | `reason`: `oversized`, `malformed`, `unknown_type`, `unexpected`, `hello_on_live_link` (a hello on a live connection's routing id, refused) |
//! | `kvlane_data_connections_refused_total` | counter | `reason`: `auth_failed` (wrong or revoked credential), `auth_timeout`, `unauthenticated_evicted`, `cap` (connection cap), `revoked` (open connections closed when their peer was removed), `framing`, `panic`, `fenced` (closed when a newer connection of their peer fenced them: a late WRITE or notification on one is dropped) (tcp target) |
//! | `kvlane_data_unfenced_failures_total` | counter | `reason`: `fence_timeout` (tcp initiator: failed connections whose target could not be fenced within `TcpConfig::fence_timeout` before their failures were reported) |
//! | `kvlane_data_requests_refused_total` | counter | `reason`: `unknown_key`, `out_of_bounds`, `access`, `notify_queue_full`, `region_deregistered` (accepted requests cut by a deregistration) (tcp target) |
//! | `kvlane_data_served_requests_total` | counter | `op` (`read`, `write`): requests the tcp target served for peers |
//! | `kvlane_data_served_bytes_total` | counter | `op`: bytes peers read from or wrote into this side's memory (tcp target) |
//!
//! The control counters are read from the control driver about once a
//! second, so a scrape may lag them by that much.
//!
//! `rail` on the transfer families is the backend that carries the peer's
//! transfers (`tcp`, `loopback`, `verbs`, or `shm` for a peer on this host
//! that `Auto` reached over shared memory); the `kvlane_rail_*` families name each rail of a multi-rail
//! agent (its device or `tcp:ADDR`).

use crate::error::ErrorKind;
use kvlane_data::Op;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// One transfer direction, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum OpLabel {
    read,
    write,
}

impl From<Op> for OpLabel {
    fn from(op: Op) -> Self {
        match op {
            Op::Read => Self::read,
            Op::Write => Self::write,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransferLabels {
    peer: String,
    op: OpLabel,
    rail: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabels {
    peer: String,
    op: OpLabel,
    rail: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: OpLabel,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// Peer counts and queue depths read at scrape time.
#[derive(Clone, Debug, Default)]
pub(crate) struct Snapshot {
    pub(crate) up: i64,
    pub(crate) attaching: i64,
    pub(crate) down: i64,
    pub(crate) in_flight: i64,
    pub(crate) rails: Vec<kvlane_data::RailStats>,
    pub(crate) notifications_dropped: u64,
    pub(crate) notifications_queued: i64,
    pub(crate) notifications_refused: u64,
    pub(crate) offers_dropped: u64,
    pub(crate) control: kvlane_control::Stats,
    pub(crate) tcp: Option<kvlane_data::TcpCounters>,
}

/// What the collector encodes, from the last scrape's snapshot.
#[derive(Debug, Default)]
struct Scraped {
    rails: Vec<kvlane_data::RailStats>,
    notifications_dropped: u64,
    notifications_queued: i64,
    notifications_refused: u64,
    offers_dropped: u64,
    control: kvlane_control::Stats,
    tcp: Option<kvlane_data::TcpCounters>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RailLabels {
    rail: String,
}

/// Counters kept elsewhere (the multi-rail backend, the notification
/// queue, the control driver, the tcp target), as they were at the last
/// scrape.
#[derive(Debug, Default)]
struct RailsCollector(Mutex<Scraped>);

/// A counter family by `reason`: name, help, (reason, value) pairs.
type ReasonFamily = (&'static str, &'static str, Vec<(&'static str, u64)>);

/// Encodes one counter family labelled by `reason`.
fn reasons(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    values: &[(&'static str, u64)],
) -> Result<(), std::fmt::Error> {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::counter::ConstCounter;
    let mut family = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for &(reason, v) in values {
        ConstCounter::new(v).encode(family.encode_family(&ReasonLabels { reason })?)?;
    }
    Ok(())
}

impl prometheus_client::collector::Collector for RailsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let dropped = encoder.encode_descriptor(
            "notifications_dropped",
            "Notifications dropped because the unread queue was full",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        let scraped = self.0.lock().unwrap_or_else(|e| e.into_inner());
        ConstCounter::new(scraped.notifications_dropped).encode(dropped)?;
        let queued = encoder.encode_descriptor(
            "notifications_queued",
            "Notifications delivered and not yet read by the application",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        ConstGauge::new(scraped.notifications_queued).encode(queued)?;
        let refused = encoder.encode_descriptor(
            "notifications_refused",
            "Data-plane notifications refused: they named another sender than the peer they came from",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        ConstCounter::new(scraped.notifications_refused).encode(refused)?;
        let offers = encoder.encode_descriptor(
            "offers_dropped",
            "Data-plane endpoint offers dropped: the peer sent more while one was being accepted",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        ConstCounter::new(scraped.offers_dropped).encode(offers)?;
        let (c, t) = (&scraped.control, scraped.tcp);
        let mut families: Vec<ReasonFamily> = vec![
            (
                "control_refused",
                "Inbound control connections refused or dropped before they were authenticated",
                vec![
                    ("unauthenticated", c.refused_inbound),
                    ("handshake_evicted", c.handshakes_evicted),
                ],
            ),
            (
                "control_frames_dropped",
                "Control frames dropped instead of acted on",
                vec![
                    ("oversized", c.oversized),
                    ("malformed", c.malformed),
                    ("unknown_type", c.unknown_type),
                    ("unexpected", c.unexpected),
                    ("hello_on_live_link", c.hellos_on_live_links),
                ],
            ),
        ];
        if let Some(t) = t {
            families.push((
                "data_connections_refused",
                "Data-plane connections refused or closed by the tcp target",
                vec![
                    ("auth_failed", t.auth_failures),
                    ("auth_timeout", t.auth_timeouts),
                    ("unauthenticated_evicted", t.unauthenticated_evicted),
                    ("cap", t.connections_refused),
                    ("revoked", t.connections_revoked),
                    ("framing", t.framing_errors),
                    ("panic", t.connection_panics),
                    ("fenced", t.connections_fenced),
                ],
            ));
            families.push((
                "data_unfenced_failures",
                "Failed tcp connections whose target could not be fenced before their failures were reported",
                vec![("fence_timeout", t.unfenced_failures)],
            ));
            families.push((
                "data_requests_refused",
                "Data-plane requests the tcp target refused, or cut (their region deregistered)",
                vec![
                    ("unknown_key", t.refused_unknown_key),
                    ("out_of_bounds", t.refused_out_of_bounds),
                    ("access", t.refused_access),
                    ("notify_queue_full", t.refused_notify_queue_full),
                    ("region_deregistered", t.requests_cut),
                ],
            ));
        }
        for (name, help, values) in &families {
            reasons(&mut encoder, name, help, values)?;
        }
        if let Some(t) = t {
            // What peers moved through this side's memory (tcp target).
            let served = [
                (
                    "data_served_requests",
                    "Requests the tcp target served for peers",
                    [("read", t.reads_served), ("write", t.writes_served)],
                ),
                (
                    "data_served_bytes",
                    "Bytes peers read from or wrote into this side's memory (tcp target)",
                    [("read", t.bytes_read), ("write", t.bytes_written)],
                ),
            ];
            for (name, help, values) in served {
                let mut family = encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for (op, v) in values {
                    ConstCounter::new(v).encode(family.encode_family(&ServedLabels { op })?)?;
                }
            }
        }
        let rails = &scraped.rails;
        if rails.is_empty() {
            return Ok(());
        }
        type Pick = fn(&kvlane_data::RailStats) -> u64;
        let counters: [(&str, &str, Pick); 6] = [
            ("rail_bytes", "Bytes each rail carried", |r| r.bytes),
            ("rail_parts", "Transfer parts completed on each rail", |r| {
                r.parts
            }),
            (
                "rail_failures",
                "Transfer parts that failed on each rail",
                |r| r.failures,
            ),
            (
                "rail_reposts",
                "Failed parts moved from each rail to another",
                |r| r.reposts,
            ),
            (
                "rail_rejoins",
                "Times each rail was paired again with a peer by an endpoint exchange over another rail",
                |r| r.rejoins,
            ),
            (
                "rail_dropped_messages",
                "Rails messages dropped on each rail (malformed, unknown sender, stale)",
                |r| r.dropped,
            ),
        ];
        for (name, help, pick) in counters {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for r in rails.iter() {
                let labels = RailLabels {
                    rail: r.name.clone(),
                };
                ConstCounter::new(pick(r)).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "rail_down_peers",
            "Peers each rail is set aside for after a failure",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for r in rails.iter() {
            let labels = RailLabels {
                rail: r.name.clone(),
            };
            ConstGauge::new(i64::try_from(r.down_peers).unwrap_or(i64::MAX))
                .encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// What one peer's successful transfers of one direction add to: its
/// `transfers` (outcome `ok`) and `transfer_bytes` series and the
/// direction's duration histogram.
struct OkSeries {
    transfers: Counter,
    bytes: Counter,
    duration: Histogram,
}

/// Records the ended transfers of one peer over one rail: the series a
/// successful transfer adds to are looked up once per direction (on its
/// first transfer, so nothing is exposed before), then each transfer is
/// two atomic adds and a histogram observation, not three labelled
/// look-ups with five string allocations (measured: 10% of the
/// initiator's I/O thread at 4 KiB READs). Failures take the labelled
/// path ([`Metrics::transfer`]).
pub(crate) struct PeerMetrics {
    metrics: Metrics,
    peer: String,
    rail: &'static str,
    /// By direction: read, write.
    ok: [OnceLock<OkSeries>; 2],
}

impl PeerMetrics {
    /// The `rail` label of this peer's transfers.
    pub(crate) fn rail(&self) -> &'static str {
        self.rail
    }

    /// The same peer's metrics under another `rail` label.
    pub(crate) fn on_rail(&self, rail: &'static str) -> Arc<Self> {
        self.metrics.for_peer(&self.peer, rail)
    }
}

/// The facade observes each transfer it posts with its peer's metrics (no
/// closure allocated per transfer).
impl kvlane_data::Observer for PeerMetrics {
    fn ended(&self, t: kvlane_data::Ended, result: &Result<(), kvlane_data::DataError>) {
        let outcome = result.as_ref().map(|_| ()).map_err(crate::error::data_kind);
        self.transfer(t.op, t.bytes, t.elapsed, outcome);
    }
}

impl PeerMetrics {
    /// Counts one ended transfer.
    pub(crate) fn transfer(
        &self,
        op: Op,
        bytes: u64,
        elapsed: Duration,
        outcome: Result<(), ErrorKind>,
    ) {
        if outcome.is_err() {
            return self
                .metrics
                .transfer(&self.peer, op, self.rail, bytes, elapsed, outcome);
        }
        let label = OpLabel::from(op);
        let series = self.ok[label as usize].get_or_init(|| {
            let m = &self.metrics.inner;
            OkSeries {
                transfers: m
                    .transfers
                    .get_or_create(&TransferLabels {
                        peer: self.peer.clone(),
                        op: label,
                        rail: self.rail.to_string(),
                        outcome: "ok".to_string(),
                    })
                    .clone(),
                bytes: m
                    .bytes
                    .get_or_create(&BytesLabels {
                        peer: self.peer.clone(),
                        op: label,
                        rail: self.rail.to_string(),
                    })
                    .clone(),
                duration: m.duration.get_or_create(&OpLabels { op: label }).clone(),
            }
        });
        series.transfers.inc();
        series.bytes.inc_by(bytes);
        series.duration.observe(elapsed.as_secs_f64());
    }
}

/// An agent's metrics. Cheap to clone; recording takes no lock the data
/// path holds.
#[derive(Clone)]
pub(crate) struct Metrics {
    inner: Arc<MetricsInner>,
}

struct MetricsInner {
    registry: Mutex<Registry>,
    transfers: Family<TransferLabels, Counter>,
    bytes: Family<BytesLabels, Counter>,
    duration: Family<OpLabels, Histogram>,
    errors: Family<KindLabels, Counter>,
    peers: Family<StateLabels, Gauge>,
    in_flight: Gauge,
    rails: Arc<RailsCollector>,
}

fn duration_histogram() -> Histogram {
    // 1 µs .. ~17 s, doubling.
    Histogram::new(exponential_buckets(1e-6, 2.0, 25))
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("kvlane");
        let transfers = Family::<TransferLabels, Counter>::default();
        let bytes = Family::<BytesLabels, Counter>::default();
        let duration =
            Family::<OpLabels, Histogram>::new_with_constructor(duration_histogram as fn() -> _);
        let errors = Family::<KindLabels, Counter>::default();
        let peers = Family::<StateLabels, Gauge>::default();
        let in_flight = Gauge::default();
        registry.register(
            "transfers",
            "Transfers that ended, by peer, op, rail and outcome",
            transfers.clone(),
        );
        registry.register(
            "transfer_bytes",
            "Bytes of completed transfers, by peer, op and rail",
            bytes.clone(),
        );
        registry.register_with_unit(
            "transfer_duration",
            "Time from post to completion",
            prometheus_client::registry::Unit::Seconds,
            duration.clone(),
        );
        registry.register(
            "transfer_errors",
            "Transfers that failed, by error kind",
            errors.clone(),
        );
        registry.register("peers", "Connections by data-plane state", peers.clone());
        registry.register(
            "transfers_in_flight",
            "Transfers posted and not yet ended",
            in_flight.clone(),
        );
        let rails = Arc::new(RailsCollector::default());
        registry.register_collector(Box::new(rails.clone()));
        Self {
            inner: Arc::new(MetricsInner {
                registry: Mutex::new(registry),
                transfers,
                bytes,
                duration,
                errors,
                peers,
                in_flight,
                rails,
            }),
        }
    }

    /// Counts one ended transfer.
    pub(crate) fn transfer(
        &self,
        peer: &str,
        op: Op,
        rail: &str,
        bytes: u64,
        elapsed: Duration,
        outcome: Result<(), ErrorKind>,
    ) {
        let m = &self.inner;
        let op = OpLabel::from(op);
        let outcome_label = match outcome {
            Ok(()) => "ok".to_string(),
            Err(k) => kind_label(k),
        };
        m.transfers
            .get_or_create(&TransferLabels {
                peer: peer.to_string(),
                op,
                rail: rail.to_string(),
                outcome: outcome_label,
            })
            .inc();
        match outcome {
            Ok(()) => {
                m.bytes
                    .get_or_create(&BytesLabels {
                        peer: peer.to_string(),
                        op,
                        rail: rail.to_string(),
                    })
                    .inc_by(bytes);
                m.duration
                    .get_or_create(&OpLabels { op })
                    .observe(elapsed.as_secs_f64());
            }
            Err(k) => {
                m.errors
                    .get_or_create(&KindLabels {
                        kind: kind_label(k),
                    })
                    .inc();
            }
        }
    }

    /// One peer's recorder of ended transfers (see [`PeerMetrics`]).
    pub(crate) fn for_peer(&self, peer: &str, rail: &'static str) -> Arc<PeerMetrics> {
        Arc::new(PeerMetrics {
            metrics: self.clone(),
            peer: peer.to_owned(),
            rail,
            ok: [OnceLock::new(), OnceLock::new()],
        })
    }

    /// Counts a transfer refused before it was posted.
    pub(crate) fn refused(&self, kind: ErrorKind) {
        self.inner
            .errors
            .get_or_create(&KindLabels {
                kind: kind_label(kind),
            })
            .inc();
    }

    /// The text exposition, with the gauges set from `snap`.
    pub(crate) fn encode(&self, snap: Snapshot) -> String {
        let m = &self.inner;
        for (state, v) in [
            ("up", snap.up),
            ("attaching", snap.attaching),
            ("down", snap.down),
        ] {
            m.peers.get_or_create(&StateLabels { state }).set(v);
        }
        m.in_flight.set(snap.in_flight);
        *m.rails.0.lock().unwrap_or_else(|e| e.into_inner()) = Scraped {
            rails: snap.rails,
            notifications_dropped: snap.notifications_dropped,
            notifications_queued: snap.notifications_queued,
            notifications_refused: snap.notifications_refused,
            offers_dropped: snap.offers_dropped,
            control: snap.control,
            tcp: snap.tcp,
        };
        let mut out = String::new();
        let registry = m.registry.lock().unwrap_or_else(|e| e.into_inner());
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

fn kind_label(k: ErrorKind) -> String {
    let mut s = String::new();
    for (i, c) in k.to_string().chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_lowercase());
    }
    s
}

/// Connections the metrics endpoint serves at once.
const HTTP_CONNECTIONS: usize = 16;

/// Answers `GET /metrics` on `listener` with `render()`, until the task is
/// aborted. Each connection is read for at most 5 s and 8 KiB of request
/// head, and at most 16 are served at once: a connection that finds 16
/// open closes the oldest of them (a scrape is answered in milliseconds,
/// so the oldest is the one most likely idle), so idle or slow sockets
/// cannot lock scrapes out. Anything but `GET /metrics` gets a 404.
pub async fn serve_http<F>(listener: tokio::net::TcpListener, render: F)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let render = Arc::new(render);
    // Oldest first.
    let mut open: std::collections::VecDeque<tokio::task::JoinHandle<()>> =
        std::collections::VecDeque::with_capacity(HTTP_CONNECTIONS);
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!(error = %e, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|h| !h.is_finished());
        if open.len() >= HTTP_CONNECTIONS {
            if let Some(oldest) = open.pop_front() {
                tracing::debug!(%from, "metrics listener: {HTTP_CONNECTIONS} connections open, the oldest closed");
                oldest.abort();
            }
        }
        let render = render.clone();
        open.push_back(tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(stream, &*render)).await;
        }));
    }
}

async fn answer(
    mut s: tokio::net::TcpStream,
    render: &(dyn Fn() -> String + Send + Sync),
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await?;
        if n == 0 || head.len() + n > 8192 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next(), words.next());
    let (status, body, ctype) = match (method, path) {
        (Some(b"GET"), Some(p)) if p == b"/metrics" || p.starts_with(b"/metrics?") => (
            "200 OK",
            render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        _ => (
            "404 Not Found",
            "kvlane serves GET /metrics only\n".to_string(),
            "text/plain; charset=utf-8",
        ),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(reply.as_bytes()).await?;
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_are_counted_by_peer_op_rail_and_outcome() {
        let m = Metrics::new();
        m.transfer(
            "decode",
            Op::Write,
            "tcp",
            4096,
            Duration::from_micros(30),
            Ok(()),
        );
        m.transfer(
            "decode",
            Op::Write,
            "tcp",
            4096,
            Duration::from_micros(50),
            Ok(()),
        );
        m.transfer(
            "decode",
            Op::Read,
            "tcp",
            4096,
            Duration::from_millis(5),
            Err(ErrorKind::PeerLost),
        );
        let text = m.encode(Snapshot {
            up: 3,
            in_flight: 2,
            ..Snapshot::default()
        });
        let has = |line: &str| text.lines().any(|l| l == line);
        assert!(
            has(r#"kvlane_transfers_total{peer="decode",op="write",rail="tcp",outcome="ok"} 2"#),
            "{text}"
        );
        assert!(
            has(
                r#"kvlane_transfers_total{peer="decode",op="read",rail="tcp",outcome="peer_lost"} 1"#
            ),
            "{text}"
        );
        assert!(
            has(r#"kvlane_transfer_bytes_total{peer="decode",op="write",rail="tcp"} 8192"#),
            "{text}"
        );
        assert!(
            has(r#"kvlane_transfer_duration_seconds_count{op="write"} 2"#),
            "{text}"
        );
        assert!(
            has(r#"kvlane_transfer_errors_total{kind="peer_lost"} 1"#),
            "{text}"
        );
        assert!(has(r#"kvlane_peers{state="up"} 3"#), "{text}");
        assert!(has("kvlane_transfers_in_flight 2"), "{text}");
        assert!(has("kvlane_notifications_dropped_total 0"), "{text}");
        assert!(has("kvlane_notifications_queued 0"), "{text}");
        assert!(text.contains("# TYPE kvlane_transfer_duration_seconds histogram"));
    }

    #[test]
    fn error_kinds_are_snake_case_labels() {
        assert_eq!(kind_label(ErrorKind::InvalidInput), "invalid_input");
        assert_eq!(kind_label(ErrorKind::Io), "io");
    }
}
