//! What `kvlane soak` prints: one line per event, as JSON or as text, each
//! stamped with the seconds since the start (`t`) and the wall clock
//! (`unix_ms`, to line events up with other processes' logs).

use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One output line. Field names are the JSON keys.
#[derive(Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Line {
    /// The run's settings, first line.
    Start {
        peers: Vec<String>,
        backend: String,
        block_size: u64,
        blocks: u32,
        duration_s: f64,
        #[serde(flatten)]
        liveness: Liveness,
    },
    /// A connect attempt begins.
    Connecting { peer: String, attempt: u32 },
    /// A connect attempt succeeded.
    Connected {
        peer: String,
        conn: String,
        attempt: u32,
        elapsed_ms: f64,
        engine_id: String,
        incarnation: String,
    },
    /// A connect attempt failed.
    ConnectFailed {
        peer: String,
        attempt: u32,
        elapsed_ms: f64,
        kind: String,
        error: String,
    },
    /// A peer event of the agent (`up`, `suspect`, `recovered`, `dead`,
    /// `restarted`, `refused`, `closed`).
    Peer {
        peer: String,
        conn: String,
        state: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// The peer cannot be soaked (wrong layout, no cache); it is given up.
    Unusable { peer: String, error: String },
    /// A transfer failed (it never blocks the run: the next round follows
    /// after a short backoff).
    TransferFailed {
        peer: String,
        op: &'static str,
        kind: String,
        error: String,
        /// How long it had been in flight.
        elapsed_ms: f64,
    },
    /// Bytes read back differ from the bytes written.
    Mismatch {
        peer: String,
        round: u64,
        remote_block: u32,
        part: u64,
        first_offset: usize,
    },
    /// After a restart: the transfer prepared against the old incarnation
    /// was posted; `stale` says whether it failed with `Stale` (it must).
    StaleCheck {
        peer: String,
        stale: bool,
        prepared_incarnation: String,
        kind: Option<String>,
        error: Option<String>,
    },
    /// Periodic per-peer numbers; `interval_*` cover the last interval.
    Stats {
        peer: String,
        ok: u64,
        failed: u64,
        interval_s: f64,
        interval_ok: u64,
        p50_us: Option<u32>,
        p99_us: Option<u32>,
        gbps: f64,
    },
    /// What each rail carried so far (multi-rail agents), with `stats`.
    Rails { rails: Vec<RailSummary> },
    /// Last line.
    Summary {
        healthy: bool,
        duration_s: f64,
        #[serde(flatten)]
        liveness: Liveness,
        peers: Vec<PeerSummary>,
        /// What each rail carried, when the soaking agent has several.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        rails: Vec<RailSummary>,
    },
}

/// One rail of the soaking agent (see `kvlane::data::RailStats`).
#[derive(Debug, Serialize)]
pub(crate) struct RailSummary {
    pub(crate) rail: String,
    pub(crate) bytes: u64,
    pub(crate) parts: u64,
    pub(crate) failures: u64,
    pub(crate) reposts: u64,
    /// Peers it is set aside for now (lost, or its link down).
    pub(crate) down_peers: u64,
    /// Times it was paired again by an endpoint exchange (verbs).
    pub(crate) rejoins: u64,
    /// Rails messages dropped on it.
    pub(crate) dropped: u64,
}

/// The control-plane liveness settings in effect.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Liveness {
    pub(crate) keepalive_interval_ms: f64,
    pub(crate) liveness_budget: u32,
    /// Longest silence before a peer is declared dead:
    /// `keepalive_interval * (liveness_budget + 1)`.
    pub(crate) liveness_budget_ms: f64,
    pub(crate) handshake_timeout_ms: f64,
    /// Data-plane dial timeout per stream (tcp backend).
    pub(crate) connect_timeout_ms: Option<f64>,
}

/// Totals of one peer for the summary.
#[derive(Debug, Serialize)]
pub(crate) struct PeerSummary {
    pub(crate) peer: String,
    pub(crate) came_up: bool,
    pub(crate) unusable: bool,
    pub(crate) ok: u64,
    pub(crate) failed: u64,
    pub(crate) failures: BTreeMap<String, u64>,
    pub(crate) mismatches: u64,
    pub(crate) restarts: u64,
    pub(crate) stale_checks: u64,
    pub(crate) stale_violations: u64,
    pub(crate) p50_us: Option<u32>,
    pub(crate) p99_us: Option<u32>,
    pub(crate) gbps: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_error: Option<String>,
}

/// Milliseconds of a duration, as printed (to the microsecond).
pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Seconds of a duration, as printed (to the millisecond).
pub(crate) fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e3).round() / 1e3
}

/// Serializes lines to stdout, one writer at a time.
pub(crate) struct Out {
    json: bool,
    start: Instant,
    lock: Mutex<()>,
}

#[derive(Serialize)]
struct Stamped<'a> {
    t: f64,
    unix_ms: u64,
    #[serde(flatten)]
    line: &'a Line,
}

impl Out {
    pub(crate) fn new(json: bool) -> Self {
        Self {
            json,
            start: Instant::now(),
            lock: Mutex::new(()),
        }
    }

    pub(crate) fn emit(&self, line: &Line) {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let t = secs(self.start.elapsed());
        let stamped = Stamped { t, unix_ms, line };
        let text = if self.json {
            serde_json::to_string(&stamped).unwrap_or_default()
        } else {
            text_line(t, line)
        };
        let _serial = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{text}");
        let _ = out.flush();
    }
}

/// `   1.234s connect_failed  peer=10.0.0.2:5555 kind=Timeout ...`
fn text_line(t: f64, line: &Line) -> String {
    let value = serde_json::to_value(line).unwrap_or_default();
    let mut s = format!("{t:>9.3}s");
    let Some(map) = value.as_object() else {
        return s;
    };
    if let Some(ev) = map.get("event").and_then(|e| e.as_str()) {
        s.push_str(&format!(" {ev:<15}"));
    }
    for (k, v) in map.iter().filter(|(k, _)| k.as_str() != "event") {
        match v {
            serde_json::Value::Null => {}
            serde_json::Value::String(x) => s.push_str(&format!(" {k}={x}")),
            serde_json::Value::Array(items)
                if k == "peers" && items.iter().all(|i| i.is_object()) =>
            {
                for item in items {
                    s.push_str(&format!("\n           peer {item}"));
                }
            }
            other => s.push_str(&format!(" {k}={other}")),
        }
    }
    s
}

/// Latency samples in microseconds.
#[derive(Debug, Default)]
pub(crate) struct Latencies(Vec<u32>);

impl Latencies {
    pub(crate) fn push(&mut self, d: Duration) {
        self.0
            .push(u32::try_from(d.as_micros()).unwrap_or(u32::MAX));
    }

    pub(crate) fn take(&mut self) -> Self {
        Self(std::mem::take(&mut self.0))
    }

    /// The `p`-th percentile (nearest rank), `None` without samples.
    pub(crate) fn percentile(&self, p: f64) -> Option<u32> {
        let mut v = self.0.clone();
        v.sort_unstable();
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v.get(rank.clamp(1, v.len().max(1)) - 1).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut l = Latencies::default();
        assert_eq!(l.percentile(50.0), None);
        for us in (1..=100).rev() {
            l.push(Duration::from_micros(us));
        }
        assert_eq!(l.percentile(50.0), Some(50));
        assert_eq!(l.percentile(99.0), Some(99));
        assert_eq!(l.percentile(100.0), Some(100));
        assert_eq!(l.take().percentile(1.0), Some(1));
        assert_eq!(l.percentile(50.0), None);
    }

    #[test]
    fn lines_are_tagged_json_and_readable_text() {
        let line = Line::TransferFailed {
            peer: "10.0.0.2:5555".into(),
            op: "write",
            kind: "PeerLost".into(),
            error: "peer conn#1 is dead".into(),
            elapsed_ms: 812.5,
        };
        let v = serde_json::to_value(Stamped {
            t: 1.5,
            unix_ms: 7,
            line: &line,
        })
        .unwrap();
        assert_eq!(v["event"], "transfer_failed");
        assert_eq!(v["kind"], "PeerLost");
        assert_eq!(v["t"], 1.5);
        let text = text_line(1.5, &line);
        assert!(
            text.contains("transfer_failed") && text.contains("peer=10.0.0.2:5555"),
            "{text}"
        );
    }
}
