//! `kvlane bench`: throughput and latency of batched one-sided transfers,
//! with same-run baselines (`memcpy`, `raw-tcp`).
//!
//! Each point posts `batch` transfers of one block each, then polls until
//! all completed, and repeats for `--duration`. The points of one block size
//! (baselines included) take turns in slices of at most 200 ms
//! ([`schedule`]), so that a baseline and the backend it bounds see the
//! same machine. Reported per point: payload GB/s (10^9 bytes/s), average
//! and p99 latency of a transfer from just before its post to completion
//! (so a post that writes the transfer itself counts), and the average
//! cost of preparing (building descriptors) and posting (`submit`) one
//! transfer.
//!
//! Baselines: `memcpy` copies the same blocks on `--threads` threads (the
//! loopback ceiling, [`memcpy`]); `raw-tcp` moves them over plain TCP
//! streams, as many as the tcp backend opens, WRITE-shaped for `write` and
//! READ-shaped for `read` ([`raw`]): against an in-process server locally,
//! against the target host with `--role initiator` ([`remote`]).

mod announce;
mod cli;
mod local;
mod memcpy;
mod output;
mod pair;
mod peers;
mod raw;
mod remote;
mod schedule;
mod stats;

pub(crate) use cli::{run, BenchArgs};

use kvlane_data::{Backend, BackendKind, GpuDevice, Op};
use serde::Serialize;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// What to measure.
#[derive(Clone, Debug)]
pub(crate) struct BenchPlan {
    pub(crate) backends: Vec<BackendKind>,
    pub(crate) ops: Vec<Op>,
    pub(crate) block_sizes: Vec<u64>,
    pub(crate) batches: Vec<usize>,
    pub(crate) duration: Duration,
    pub(crate) baselines: bool,
    /// Initiator threads, each with its own backend pair (in-process runs).
    pub(crate) threads: usize,
    /// Where the backends' memory lives: host (`None`) or this GPU.
    pub(crate) memory: Option<GpuDevice>,
    /// Rails (devices, or tcp backends) per in-process backend; 1 = none.
    pub(crate) rails: usize,
    /// How a batch's transfers are posted.
    pub(crate) post: PostMode,
}

/// How a batch's transfers are handed to the backend (`--post`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PostMode {
    /// All of them in one call (`Peer::post_batch`,
    /// `Backend::submit_batch`), as the raw-tcp baseline deals a batch to
    /// its streams.
    Batch,
    /// One call per transfer (`Peer::post`, `Backend::submit`): what every
    /// earlier row measured.
    #[default]
    Each,
    /// The whole batch as a single transfer of `batch` blocks (one
    /// `Peer::prepare` of every block's ids, one `Peer::post`), as an
    /// engine posts a request's blocks (NIXL's `make_prepped_xfer` with a
    /// descriptor per block). The blocks lie one slot apart, so each still
    /// moves as a request of its own; rows count blocks (a block's latency
    /// is its transfer's, post time is spread over the blocks).
    Single,
}

impl PostMode {
    /// As rows print it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Each => "each",
            Self::Single => "single",
        }
    }
}

impl BenchPlan {
    /// `host` or the GPU, as rows print it.
    pub(crate) fn memory_name(&self) -> String {
        self.memory
            .map_or_else(|| "host".to_owned(), |d| d.to_string())
    }
}

/// One measured point; also the JSON schema of `--json` (one per line).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) backend: String,
    /// `host`, or the GPU the backend's memory is on (`cuda:0`); baselines
    /// (memcpy, raw-tcp) always run on host memory.
    pub(crate) memory: String,
    /// Rails the backend moved the bytes over (1 for baselines and
    /// single-device backends).
    pub(crate) rails: usize,
    pub(crate) op: String,
    pub(crate) block_size: u64,
    pub(crate) batch: usize,
    /// How the batch was handed over: `batch` (one call) or `each` (a call
    /// per transfer; in-process backends always). Baselines deal a batch
    /// at once (`batch`).
    pub(crate) post: &'static str,
    pub(crate) gbps: f64,
    pub(crate) lat_avg_us: f64,
    pub(crate) lat_p99_us: f64,
    pub(crate) prepare_avg_us: f64,
    pub(crate) post_avg_us: f64,
    pub(crate) transfers: u64,
    pub(crate) seconds: f64,
}

/// Why a point could not be measured.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    #[error("{backend} backend: {source}")]
    Data {
        backend: String,
        #[source]
        source: kvlane_data::DataError,
    },
    #[error("{backend}: {what}")]
    Failed { backend: String, what: String },
    #[error("raw-tcp baseline against {addr}, stream {stream}: {source}")]
    RawTcp {
        addr: SocketAddr,
        stream: usize,
        #[source]
        source: io::Error,
    },
    #[error("raw-tcp baseline: cannot listen on {addr}: {source}")]
    RawListen {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot print a result row: {0}")]
    Output(#[source] io::Error),
}

/// Creates one backend of `kind`.
pub(crate) type Factory = dyn Fn(BackendKind) -> Result<Box<dyn Backend>, BenchError>;

/// `op` as the rows print it.
pub(crate) fn op_name(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
    }
}
