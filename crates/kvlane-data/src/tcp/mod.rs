//! The tcp backend: software one-sided RDMA between processes and hosts.
//!
//! Each [`TcpBackend`] is both a target and an initiator.
//!
//! - **Target.** A listener (bound to [`TcpConfig::listen`]) serves READ,
//!   WRITE and NOTIFY requests on the regions registered with the backend,
//!   on [`TcpConfig::io_threads`] event-driven I/O threads whatever the
//!   number of connections. A connection must first prove a random
//!   128-bit credential issued for one peer by
//!   [`prepare_peer`](Backend::prepare_peer) (carried in that peer's
//!   [`Endpoint`], which the control plane only hands to peers that
//!   completed the handshake), within [`TcpConfig::auth_timeout`] of
//!   connecting: the target sends a fresh random challenge, the initiator
//!   answers with an HMAC of it keyed with the credential, which itself
//!   never crosses a data connection, so a recorded hello replayed on
//!   another connection is refused ([`wire`] has the format). Anything
//!   else is dropped before a request is read and counted
//!   ([`TcpCounters::auth_failures`]).
//!   [`remove_peer`](Backend::remove_peer) revokes the credential and closes
//!   the peer's connections. Unauthenticated connections are capped apart
//!   ([`TcpConfig::max_unauthenticated`]) from authenticated ones
//!   ([`TcpConfig::max_connections`]). Every request is checked against
//!   key, bounds and the region's remote rights before memory is touched;
//!   refusals are answered with a status and counted
//!   ([`TcpBackend::counters`]).
//! - **Initiator.** A connected peer gets [`TcpConfig::streams`] TCP
//!   connections, or fewer (one) once the process has
//!   [`TcpConfig::stream_budget`] of them. Transfers are checked locally
//!   against the regions the peer advertised, split into chunks of at most
//!   [`TcpConfig::chunk_bytes`] and striped over the streams; small
//!   requests are coalesced into few `write` calls. A notification is sent
//!   only after every chunk of its transfer was acknowledged.
//!
//! Both sides run on `mio` (epoll) loops on fixed sets of threads,
//! [`TcpConfig::io_threads`] each: the target's serve its connections, the
//! initiator's drive the streams to every peer (those are shared by the
//! process's backends, see [`TcpConfig::io_threads`]). A connection (or stream)
//! is a non-blocking state machine, so silent or slow peers cost a socket
//! and a few hundred bytes, not a thread, and a backend with 1,000 peers
//! has as many threads as one with one. `mio` rather than io_uring: it is
//! already in the tree (under tokio), needs no kernel newer than epoll,
//! and the per-request work here is one `read` into a buffer or region
//! and one `writev` of queued requests or answers, which epoll does in the
//! same number of syscalls. Rather than one thread per stream direction
//! (blocking `read`/`write`, as the initiator had before): the same
//! syscalls move bytes straight between the socket and region memory, a
//! response wakes the thread that sent the request (one context switch,
//! as before), and 4,000 streams no longer mean 8,000 threads. Connecting
//! and authenticating a stream still block, inside
//! [`Connecting::run`](crate::Connecting), off the backend lock.
//!
//! [`FrameReader`] and [`FrameWriter`] are the blocking form of the same
//! framed socket I/O (gathered `writev`s, large payloads straight between
//! the socket and region memory), public so that a baseline can move bytes
//! as the backend does with a thread always waiting on every socket
//! (`kvlane bench`'s raw-tcp ceiling reads and writes with them).
//!
//! Failures: a broken stream fails every transfer in flight to that peer
//! with [`DataError::PeerLost`] as soon as the socket reports it; deadlines
//! are enforced by [`poll`](Backend::poll). Completions and notifications
//! are announced through the waker given to
//! [`set_waker`](Backend::set_waker), so a [`Transport`](crate::Transport)
//! sleeps between them.
//!
//! # Example
//!
//! ```
//! use kvlane_data::{connect_pair, Access, Backend, Descriptor, Op, Region,
//!                   RemoteDescriptor, TcpBackend, TcpConfig, Transfer, Transport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut init = TcpBackend::new(TcpConfig::default())?;
//! let mut target = TcpBackend::new(TcpConfig::default())?;
//! let src = Region::from_vec(vec![7; 8192], Access::ALL)?;
//! let dst = Region::alloc(8192, Access::REMOTE_WRITE)?;
//! let src_ad = init.register(&src)?;
//! let dst_ad = target.register(&dst)?;
//! let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad])?;
//! let transport = Transport::new(init)?;
//! let write = Transfer::new(
//!     peer,
//!     Op::Write,
//!     vec![Descriptor { region: src.id(), offset: 0, len: 8192 }],
//!     vec![RemoteDescriptor { key: dst_ad.key, offset: 0, len: 8192 }],
//! );
//! transport.submit(write)?.wait()?;
//! assert_eq!(dst.to_vec()?, vec![7; 8192]);
//! # Ok(())
//! # }
//! ```
//!
//! # Resource cleanup
//!
//! Dropping the backend fails its peers' in-flight transfers, closes every
//! socket, and stops and joins both sides' I/O threads (the listener's
//! included).
//! [`remove_peer`](Backend::remove_peer) does the same for one peer, and
//! also revokes the credential it issued and closes that peer's
//! connections to this target.

// Region memory is reached only through `Region`'s copies and socket I/O
// (`read`/`write`, `recv_from`, `send_vectored`), never as a slice; GPU
// regions through `Region::{read,write}_chunks` (pinned staging).
#![forbid(unsafe_code)]

mod initiator;
mod io;
mod lease;
mod outq;
mod pool;
mod serve;
mod server;
mod shared;
mod stream;
#[doc(hidden)]
pub mod wire;

pub use io::{FrameReader, FrameWriter};
pub use server::TcpCounters;
#[doc(hidden)]
pub use server::{fuzz_request, fuzz_serve};

use crate::backend::{Backend, Connected, Connecting};
use crate::error::{DataError, SubmitError};
use crate::ids::{PeerId, RegionId, RemoteKey};
use crate::memory::{Access, Region, RemoteRegion};
use crate::transfer::{BackendKind, Completion, Endpoint, Notification, Op, Segment, Transfer};
use initiator::{Aftermath, ConnectConfig, Job, PeerConn, XferState};
use lease::Served;
use pool::IoPool;
use serde::{Deserialize, Serialize};
use server::{Counters, Credentials, RegionTable, Server, ServerConfig};
use shared::{lock, IdMap, Shared};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};
use wire::{RequestKind, MAX_CHUNK, MAX_NOTIFY, TOKEN_LEN};

/// A validated transfer's segments with their local regions (most
/// transfers have one).
type Checked = smallvec::SmallVec<[(Segment, Region); 2]>;

/// Small chunks are handed to a stream's sender in groups of up to this
/// many, the rest as `submit` returns: one hand-over (and at most one
/// wake-up of the sender) per group instead of one per request.
const STAGE_JOBS: usize = 64;
/// Chunks of this size and up go to their stream's sender at once, so
/// the first bytes of a large submission are on the wire before the rest
/// is planned.
const SEND_NOW: u64 = 64 << 10;

/// Default of [`TcpConfig::max_notifications`]: as many as the default
/// `queue_depth`, so one initiator's full queue of notifying transfers
/// fits while the application is slow to take them.
pub(crate) const MAX_NOTIFICATIONS: usize = 4096;
/// Default of [`TcpConfig::max_notification_bytes`]: 1,024 notifications
/// of the largest size ([`MAX_NOTIFY`], 64 KiB); small ones (the usual
/// few hundred bytes) are bounded by the count.
pub(crate) const MAX_NOTIFICATION_BYTES: usize = 64 << 20;

/// Settings of a [`TcpBackend`].
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Address the target side listens on. Default `127.0.0.1:0` (any free
    /// port; the real port is advertised in the endpoint).
    pub listen: SocketAddr,
    /// Host advertised to peers when `listen` is a wildcard address
    /// (`0.0.0.0`, `::`). Default: none: the wildcard is advertised and
    /// each peer dials the host it reached this side's control plane at
    /// ([`TcpEndpoint::reached_at`]).
    pub advertise: Option<IpAddr>,
    /// TCP connections per peer. Default 4: on a 2-core host (loopback,
    /// `examples/tcp_bench`) 4 streams matched or beat 1 and 2 for 64 KiB
    /// and 1 MiB blocks, and 8 was slower; small requests are not hurt
    /// because they stay on one stream until `chunk_bytes` are queued.
    /// Fewer once the process has many peers: see `stream_budget`.
    pub streams: usize,
    /// Initiator streams of the process (every tcp backend with the same
    /// `io_threads`, as they share I/O threads) up to which a newly
    /// connected peer gets `streams`; a peer connected nearer to it gets
    /// what fits, past it one. Several streams fill the link for one peer;
    /// with many peers the peers do, while four sockets each cost file
    /// descriptors, kernel buffers and the target's `max_connections`
    /// (4,096 by default: 1,024 peers of 4). A peer keeps the streams it
    /// got, so past the budget early peers have more than late ones: with
    /// a budget of 64, 100 peers (16 of 4 streams, 84 of 1) had a READ p99
    /// of 120-234 ms against 51-52 ms when all had 4 (`kvlane bench
    /// --peers 100 --block-sizes 64K --batch 16`, 2-core host). Default
    /// 1024: 256 peers (32 nodes of 8 GPUs) all get 4; at 1,000 peers the
    /// process holds 1,768 streams, not 4,000.
    pub stream_budget: usize,
    /// Largest request; longer contiguous spans are split into chunks of
    /// this size. It is also the striping unit: streams take turns every
    /// `chunk_bytes` of queued requests. Default 512 KiB (measured against
    /// 256 KiB-4 MiB with `examples/tcp_bench`; the differences were within
    /// the noise of a shared machine, 512 KiB was never worst). Capped at
    /// 64 MiB.
    pub chunk_bytes: u64,
    /// Transfers in flight (submitted, not yet returned by `poll`) before
    /// `submit` hands transfers back. Default 4096.
    pub queue_depth: usize,
    /// Timeout of connecting and authenticating one stream. Default 5 s.
    /// [`connect_peer`](Backend::connect_peer) blocks for at most this long
    /// per stream.
    pub connect_timeout: Duration,
    /// `SO_SNDBUF`/`SO_RCVBUF` of every socket; `None` (the default) keeps
    /// the kernel's auto-tuning.
    pub socket_buffer: Option<usize>,
    /// Dead-peer detection when the socket cannot tell at once (the host
    /// vanished without a reset): TCP keep-alive probes start after this
    /// idle time, and on Linux a connection whose sent data stays
    /// unacknowledged for twice this long is aborted; either fails the
    /// peer's transfers with [`DataError::PeerLost`]. Default 10 s; `None`
    /// leaves the system defaults (hours).
    pub keepalive: Option<Duration>,
    /// Authenticated connections the target side serves at once (counted
    /// after the hello; past it a hello is refused). Default 4096: 1,000
    /// peers of 4 streams (kvlane initiators open fewer per peer once they
    /// have many peers, see `stream_budget`).
    pub max_connections: usize,
    /// Authenticated connections one peer (one credential) holds at once
    /// on the target side; past it that peer's hello is refused, so one
    /// peer cannot take every slot of `max_connections`. Default 64: a
    /// kvlane initiator opens `streams` (4) per peer, and one that
    /// reconnects closes its old ones.
    pub max_connections_per_peer: usize,
    /// Connections accepted but not yet authenticated the target side
    /// holds at once; past it the oldest is closed to make room. Default
    /// 256.
    pub max_unauthenticated: usize,
    /// How long an accepted connection has to present its credential,
    /// counted once from the accept. Default 5 s.
    pub auth_timeout: Duration,
    /// Event-driven I/O threads of each side: the target serves its share
    /// of the connections on each of this many threads, and the initiator
    /// drives its streams to every peer on as many more (streams go to
    /// them round-robin). Threads do not grow with peers or connections.
    /// The initiator's threads are shared by every tcp backend of the
    /// process with the same value (one agent or a thousand, the same
    /// threads). Default: the available parallelism, at most 4.
    pub io_threads: usize,
    /// Notifications that arrived (from all peers together) and that the
    /// application has not taken yet
    /// ([`poll_notifications`](Backend::poll_notifications), or a
    /// [`Transport`](crate::Transport)'s receiver) held at most. Past it,
    /// or past `max_notification_bytes`, the target refuses a NOTIFY (it
    /// does not drop it silently): the initiator's transfer fails with
    /// [`DataError::NotificationQueueFull`] and the refusal is counted
    /// ([`TcpCounters::refused_notify_queue_full`]). Once the queue is
    /// half full, a peer that holds its share (this cap divided among the
    /// peers holding a credential; the same for the bytes) is refused too,
    /// so one peer cannot fill it for every peer. Default 4096.
    pub max_notifications: usize,
    /// Payload bytes of the notifications held (see `max_notifications`).
    /// Default 64 MiB.
    pub max_notification_bytes: usize,
    /// How long [`deregister`](Backend::deregister) lets requests the
    /// target already accepted on the region finish before it cuts them
    /// (see [`TcpBackend`]'s *Deregistration*). Default 100 ms: a request
    /// is at most [`chunk_bytes`](Self::chunk_bytes) long, which a live
    /// peer moves in far less; one that stalls is cut.
    pub deregister_grace: Duration,
    /// How long a failed connection waits for its target to fence it
    /// before its failed WRITEs and notifications are reported (see
    /// [`wire`]'s fences): the failures come that much later at most
    /// when the target is unreachable, and are then reported unfenced
    /// (counted in [`TcpCounters::unfenced_failures`]). Capped by
    /// `connect_timeout`. Default 1 s.
    pub fence_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise: None,
            streams: 4,
            stream_budget: 1024,
            chunk_bytes: 512 << 10,
            queue_depth: 4096,
            connect_timeout: Duration::from_secs(5),
            socket_buffer: None,
            keepalive: Some(Duration::from_secs(10)),
            max_connections: 4096,
            max_connections_per_peer: 64,
            max_unauthenticated: 256,
            auth_timeout: Duration::from_secs(5),
            io_threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
            max_notifications: MAX_NOTIFICATIONS,
            max_notification_bytes: MAX_NOTIFICATION_BYTES,
            deregister_grace: Duration::from_millis(100),
            fence_timeout: Duration::from_secs(1),
        }
    }
}

impl TcpConfig {
    fn socket_options(&self) -> io::SocketOptions {
        io::SocketOptions {
            buffer: self.socket_buffer,
            keepalive: self.keepalive,
        }
    }
}

/// What a tcp [`Endpoint`] carries: where the target listens and the token
/// its connections must present.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// The target's `host:port` as advertised. An unspecified host
    /// (`0.0.0.0`, `::`: a wildcard listen without `advertise`) means "the
    /// host you reached my control plane at"; see [`reached_at`](Self::reached_at).
    pub addr: SocketAddr,
    /// What the target's listener is bound to (named in dial errors, so an
    /// unreachable advertised address can be told from a wrong listen).
    pub listen: SocketAddr,
    /// The per-peer credential every connection presents first.
    pub token: [u8; TOKEN_LEN],
}

impl std::fmt::Debug for TcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never logged.
        f.debug_struct("TcpEndpoint")
            .field("addr", &self.addr)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct EndpointWire {
    addr: String,
    token: String,
    /// Absent from older peers: then the listen address is `addr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
}

impl TcpEndpoint {
    /// Encodes as an [`Endpoint`] (msgpack map `{addr, token}`).
    pub fn to_endpoint(&self) -> Endpoint {
        let wire = EndpointWire {
            addr: self.addr.to_string(),
            token: self.token.iter().map(|b| format!("{b:02x}")).collect(),
            listen: (self.listen != self.addr).then(|| self.listen.to_string()),
        };
        Endpoint {
            backend: BackendKind::Tcp,
            // Serializing a struct of two strings cannot fail.
            data: rmp_serde::to_vec_named(&wire).unwrap_or_default(),
        }
    }

    /// Decodes a peer's [`Endpoint`].
    pub fn from_endpoint(e: &Endpoint) -> Result<Self, DataError> {
        // A multi-rail peer's endpoint: this backend pairs its first rail.
        let e = &e.primary();
        let bad = |reason: String| DataError::BadEndpoint {
            backend: "tcp",
            reason,
        };
        if e.backend != BackendKind::Tcp {
            return Err(bad(format!("endpoint is for the {} backend", e.backend)));
        }
        let wire: EndpointWire =
            rmp_serde::from_slice(&e.data).map_err(|err| bad(err.to_string()))?;
        let parse = |a: &str| -> Result<SocketAddr, DataError> {
            a.parse().map_err(|_| bad(format!("bad address {a:?}")))
        };
        let addr = parse(&wire.addr)?;
        let listen = match &wire.listen {
            Some(l) => parse(l)?,
            None => addr,
        };
        let hex = wire.token.as_bytes();
        if hex.len() != 2 * TOKEN_LEN {
            return Err(bad(format!("token of {} hex digits", hex.len())));
        }
        let mut token = [0u8; TOKEN_LEN];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let s = std::str::from_utf8(pair).map_err(|_| bad("token is not hex".into()))?;
            token[i] = u8::from_str_radix(s, 16).map_err(|_| bad("token is not hex".into()))?;
        }
        Ok(Self {
            addr,
            listen,
            token,
        })
    }

    /// The address to dial for a peer whose control plane this side
    /// reached at `host`: a wildcard (unspecified) advertised host becomes
    /// `host`. Fails, naming both addresses, when the endpoint cannot be
    /// reached from `host`'s side: a loopback address advertised to a peer
    /// that is not on this host's loopback, a wildcard whose host is not
    /// known (`None`), or an IPv4 wildcard reached over IPv6.
    pub fn reached_at(mut self, host: Option<IpAddr>) -> Result<Self, DataError> {
        let unreachable = |why: &str| DataError::Unreachable {
            advertised: self.addr,
            listen: self.listen,
            why: match host {
                Some(h) => format!("{why} (its control plane was reached at {h})"),
                None => why.to_owned(),
            },
        };
        let ip = self.addr.ip();
        let Some(host) = host else {
            if ip.is_unspecified() {
                return Err(unreachable(
                    "it advertises a wildcard address and its host is not known here",
                ));
            }
            return Ok(self);
        };
        if ip.is_unspecified() {
            let host = match (ip, host) {
                (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => host,
                (IpAddr::V6(_), IpAddr::V4(v4)) => IpAddr::V6(v4.to_ipv6_mapped()),
                (IpAddr::V4(_), IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                    Some(v4) => IpAddr::V4(v4),
                    None => {
                        return Err(unreachable(
                            "it listens on IPv4 only and was reached over IPv6",
                        ))
                    }
                },
            };
            self.addr.set_ip(host);
        } else if ip.is_loopback() && !host.is_loopback() {
            return Err(unreachable(
                "it advertises a loopback address; listen on a routable address or set `advertise`",
            ));
        }
        Ok(self)
    }
}

use crate::host_registry::HostRegistry;
pub(crate) use crate::ids::FastMap;

struct PeerSlot {
    conn: Option<Arc<PeerConn>>,
    regions: FastMap<RemoteKey, RemoteRegion>,
    /// Other addresses of the peer's process to fence through
    /// ([`Backend::set_fence_routes`]); shared with its connections.
    routes: Arc<Mutex<Vec<SocketAddr>>>,
}

/// Software one-sided RDMA over TCP (see the [module docs](self)).
///
/// # Deregistration
///
/// [`deregister`](Backend::deregister) returns once the target side no
/// longer reads or writes the region, so its memory may be freed right
/// after (what `Region::from_raw`'s contract needs). Requests for its key
/// that arrive later are refused ([`DataError::UnknownKey`] at the
/// initiator). Requests already accepted get
/// [`TcpConfig::deregister_grace`] to finish; those still in progress
/// then are cut: a WRITE fails with [`DataError::RemoteRegionRevoked`]
/// (part of it may have landed), a READ whose answer is being sent ends
/// its connection, failing the initiator's transfers on it with
/// [`DataError::PeerLost`]. Cut requests are counted
/// ([`TcpCounters::requests_cut`]). In the rare case an I/O thread does
/// not confirm, the error is [`DataError::DeregisterStuck`] and the memory
/// must be kept.
pub struct TcpBackend {
    config: TcpConfig,
    endpoint: TcpEndpoint,
    regions: Arc<RegionTable>,
    counters: Arc<Counters>,
    creds: Arc<Credentials>,
    shared: Arc<Shared>,
    registry: HostRegistry,
    next_peer: u64,
    peers: FastMap<PeerId, PeerSlot>,
    in_flight: IdMap<Arc<XferState>>,
    ready: Vec<Completion>,
    next_deadline: Option<Instant>,
    /// The last `submit` left work only `poll` moves on
    /// ([`Backend::poll_after_submit`]).
    poll_due: bool,
    drained: Vec<Completion>,
    /// The chunks of the submission (or batch of submissions, see
    /// [`Backend::submit_batch`]) being planned, per connection and
    /// stream, not yet handed over. Between calls it holds no chunk and
    /// at most one connection's (empty) vectors, kept for the next
    /// submission (see [`hand_over`](Self::hand_over)).
    stage: Vec<(Arc<PeerConn>, Vec<Vec<Job>>)>,
    /// Connection generations (see [`wire`]'s fences), shared with the
    /// connections (a fence or a replacement takes the next).
    gens: Arc<std::sync::atomic::AtomicU64>,
    // Dropped after the peers are failed in `Drop`: the initiator's I/O
    // threads, then the target's.
    pool: Arc<IoPool>,
    server: Server,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("addr", &self.endpoint.addr)
            .field("regions", &self.registry.len())
            .field("peers", &self.peers.len())
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl TcpBackend {
    /// Starts the listener and returns the backend.
    pub fn new(config: TcpConfig) -> Result<Self, DataError> {
        let regions = Arc::new(RegionTable::default());
        let counters = Arc::new(Counters::default());
        let shared = Arc::new(Shared {
            note_caps: shared::NoteCaps {
                entries: config.max_notifications.max(1),
                bytes: config.max_notification_bytes,
            },
            ..Shared::default()
        });
        let creds = Arc::new(Credentials::default());
        let server = Server::start(
            ServerConfig {
                listen: config.listen,
                max_connections: config.max_connections.max(1),
                max_connections_per_peer: config.max_connections_per_peer.max(1),
                max_unauthenticated: config.max_unauthenticated.max(1),
                auth_timeout: config.auth_timeout,
                io_threads: config.io_threads.max(1),
                socket: config.socket_options(),
            },
            regions.clone(),
            shared.clone(),
            counters.clone(),
            creds.clone(),
        )?;
        let listen = server.local_addr();
        let pool = IoPool::for_process(config.io_threads)?;
        let mut addr = listen;
        if let (true, Some(host)) = (listen.ip().is_unspecified(), config.advertise) {
            addr.set_ip(host);
        }
        Ok(Self {
            config,
            endpoint: TcpEndpoint {
                addr,
                listen,
                // Replaced by each peer's credential in `prepare_peer`.
                token: [0; TOKEN_LEN],
            },
            regions,
            counters,
            creds,
            shared,
            registry: HostRegistry::default(),
            next_peer: 1,
            peers: FastMap::default(),
            in_flight: IdMap::default(),
            ready: Vec::new(),
            next_deadline: None,
            poll_due: false,
            drained: Vec::new(),
            stage: Vec::new(),
            gens: Arc::new(std::sync::atomic::AtomicU64::new(1)),
            pool,
            server,
        })
    }

    /// Lets every backend of `backends` (the tcp rails of one process)
    /// admit the others' peers to FENCE: a connection whose target cannot
    /// be reached at its own address (its rail's network is down, or holds
    /// the bytes) is then fenced through another rail's address before its
    /// failed WRITEs are reported or moved, so no byte of them lands later
    /// (see [`wire`]). Such a connection proves the failed rail's
    /// credential, may FENCE and nothing else, and is counted in
    /// [`TcpCounters::sibling_fences`]. [`Rails`](crate::Rails) gives each
    /// rail the other rails' addresses of a peer
    /// ([`Backend::set_fence_routes`]); the agent links its tcp rails.
    pub fn fence_through_each_other(backends: &[&Self]) {
        for a in backends {
            for b in backends {
                if !Arc::ptr_eq(&a.creds, &b.creds) {
                    a.creds.add_sibling(&b.creds);
                }
            }
        }
    }

    /// The `host:port` advertised to peers.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.addr
    }

    /// Counters of the target side (requests served and refused,
    /// authentication and framing failures).
    pub fn counters(&self) -> TcpCounters {
        let mut c = self.counters.snapshot();
        c.unfenced_failures = self
            .shared
            .unfenced
            .load(std::sync::atomic::Ordering::Relaxed);
        c
    }

    /// Requests this backend's submitting threads wrote to their streams
    /// themselves: a transfer submitted to an idle stream (nothing in
    /// flight on it) leaves from the submitting thread, without waking an
    /// I/O thread; the first of a burst and the rest of it go through the
    /// stream's I/O thread, which writes them together.
    pub fn direct_sends(&self) -> u64 {
        self.shared
            .direct_sends
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Initiator streams open in this process's tcp backends that share
    /// this one's I/O threads (what [`TcpConfig::stream_budget`] counts).
    /// A dropped connection's streams leave the count once its I/O thread
    /// let them go.
    pub fn initiator_streams(&self) -> usize {
        self.pool.shared().open_streams()
    }

    fn check_local(
        &self,
        id: RegionId,
        op: Op,
        offset: u64,
        len: u64,
    ) -> Result<&Region, DataError> {
        let region = self.registry.get(id).ok_or(DataError::UnknownRegion(id))?;
        if op == Op::Read && !region.access().contains(Access::LOCAL_WRITE) {
            return Err(DataError::AccessDenied {
                op,
                target: format!("local {id}"),
                needed: Access::LOCAL_WRITE,
                granted: region.access(),
            });
        }
        region.check_range(offset, len)?;
        Ok(region)
    }

    /// Everything checkable before sending: deadline, connection, local
    /// regions, and the remote spans against what the peer advertised
    /// (the target checks again).
    ///
    /// Returns the connection and the transfer's segments with their local
    /// regions, so staging walks them once more without looking anything
    /// up again. The caller has checked the lengths (`submit_staged`
    /// refuses a mismatch before this).
    fn validate(&self, t: &Transfer, now: Instant) -> Result<(Arc<PeerConn>, Checked), DataError> {
        if now >= t.deadline {
            return Err(DataError::Timeout {
                id: t.id,
                peer: t.peer,
                overdue: now - t.deadline,
            });
        }
        let slot = self
            .peers
            .get(&t.peer)
            .ok_or(DataError::UnknownPeer(t.peer))?;
        let conn = slot.conn.clone().ok_or(DataError::PeerLost {
            peer: t.peer,
            reason: "prepared but never connected",
            source: None,
        })?;
        let mut checked = Checked::new();
        for seg in t.checked_segments() {
            let region = self.check_local(seg.region, t.op, seg.local_offset, seg.len)?;
            let ad = slot.regions.get(&seg.key).ok_or(DataError::UnknownKey {
                peer: t.peer,
                key: seg.key,
            })?;
            ad.check(t.peer, t.op, seg.remote_offset, seg.len)
                .map_err(|e| match e {
                    // Name the target's address too.
                    DataError::AccessDenied {
                        op,
                        target,
                        needed,
                        granted,
                    } => DataError::AccessDenied {
                        op,
                        target: format!("{target} ({})", conn.addr()),
                        needed,
                        granted,
                    },
                    other => other,
                })?;
            checked.push((seg, region.clone()));
        }
        Ok((conn, checked))
    }

    /// Plans one transfer into [`stage`](Self::stage) (chunks of
    /// `chunk_bytes` and up, and every [`STAGE_JOBS`] small ones of a
    /// stream, go to their stream at once); the caller hands the rest over
    /// ([`hand_over`](Self::hand_over)) before it returns.
    fn submit_staged(&mut self, t: Transfer, now: Instant) -> Result<(), SubmitError> {
        // This backend announces its arrivals: its driver polls it, busy
        // or idle, only when woken and at the deadline it was last told
        // (`poll_by`, never later than the earliest in flight). A
        // deadline earlier than that, or the first after idle, needs a
        // poll scheduled now; so does one sooner than a driver's longest
        // sleep (a driver that does not count on the waker).
        self.poll_due |= t.deadline < now + crate::handle::IDLE_PARK
            || self.next_deadline.is_none_or(|d| t.deadline < d);
        if !self.peers.contains_key(&t.peer) {
            return Err(SubmitError::Rejected(DataError::UnknownPeer(t.peer)));
        }
        if let Err(e) = t.check_lengths() {
            return Err(SubmitError::Rejected(e));
        }
        if let Some(n) = &t.notify {
            if n.len() as u64 > MAX_NOTIFY {
                return Err(SubmitError::Rejected(DataError::NotificationTooLarge {
                    len: n.len(),
                    max: MAX_NOTIFY as usize,
                }));
            }
        }
        if self.in_flight.contains_key(&t.id) {
            return Err(SubmitError::Rejected(DataError::DuplicateTransfer(t.id)));
        }
        let in_flight = self.in_flight();
        if in_flight >= self.config.queue_depth {
            return Err(SubmitError::QueueFull {
                transfer: Box::new(t),
                in_flight,
            });
        }
        let (conn, checked) = match self.validate(&t, now) {
            Ok(v) => v,
            Err(e) => {
                self.fail_now(&t, e);
                return Ok(());
            }
        };
        let x = Arc::new(XferState::new(
            t.id,
            t.peer,
            t.deadline,
            t.notify.clone(),
            t.op == Op::Write,
        ));
        if let Err(e) = conn.start(&x) {
            self.fail_now(&t, e);
            return Ok(());
        }
        self.in_flight.insert(t.id, x.clone());
        self.next_deadline = Some(self.next_deadline.map_or(t.deadline, |d| d.min(t.deadline)));
        let chunk = self.config.chunk_bytes.clamp(1, MAX_CHUNK);
        let kind = match t.op {
            Op::Read => RequestKind::Read,
            Op::Write => RequestKind::Write,
        };
        // The connection's staging, searched from the last one staged (a
        // batch's transfers mostly go to one peer).
        let at = match self.stage.iter().rposition(|(c, _)| Arc::ptr_eq(c, &conn)) {
            Some(at) => at,
            None => {
                self.stage.push((
                    conn.clone(),
                    (0..conn.streams()).map(|_| Vec::new()).collect(),
                ));
                self.stage.len() - 1
            }
        };
        let stage = &mut self.stage[at].1;
        for (seg, region) in checked {
            // The last chunk takes the region, the others a reference each.
            let mut region = Some(region);
            let mut done = 0;
            while done < seg.len {
                let len = chunk.min(seg.len - done);
                let i = conn.add_chunk(&x, len, chunk);
                let staged = &mut stage[i];
                staged.push(Job {
                    kind,
                    key: seg.key,
                    remote_offset: seg.remote_offset + done,
                    len,
                    local: if done + len == seg.len {
                        region.take()
                    } else {
                        region.clone()
                    },
                    local_offset: seg.local_offset + done,
                    xfer: x.clone(),
                });
                if staged.len() >= STAGE_JOBS || len >= chunk.min(SEND_NOW) {
                    conn.send_jobs(i, staged);
                }
                done += len;
            }
        }
        // The rest waits for `hand_over`, at the end of the call. The
        // submission's own unit: its chunks are counted, so it cannot
        // finish before the last of them is answered.
        conn.release(&x, false);
        Ok(())
    }

    /// Hands every staged chunk to its stream: one hand-over per stream,
    /// and no driver wake-up to carry it (measured, batch-1 4 KiB READ:
    /// 2.2-2.6x a TCP ping-pong's round trip with staging for `poll`,
    /// 0.9-1.7x without).
    ///
    /// The last connection's staging stays for the next call, with its
    /// vectors' room (a run of submissions to one peer allocates no
    /// staging: measured, allocation was ~11% of a thread posting 4 KiB
    /// READs one by one), unless that connection failed; `remove_peer`
    /// clears it, so a removed peer's connection is not kept alive here.
    fn hand_over(&mut self) {
        for (conn, streams) in &mut self.stage {
            for (i, staged) in streams.iter_mut().enumerate() {
                if !staged.is_empty() {
                    conn.send_jobs(i, staged);
                }
            }
        }
        let older = self.stage.len().saturating_sub(1);
        self.stage.drain(..older);
        if self.stage.last().is_some_and(|(c, _)| c.is_dead()) {
            self.stage.clear();
        }
    }

    /// Puts connections made to replace failed ones (see
    /// `PeerConn::fail`) in their places, if the failed one still holds
    /// it (else the peer was removed or connected again meanwhile, and
    /// the replacement is closed).
    fn adopt_replacements(&mut self) {
        let taken = {
            let mut r = lock(&self.shared.replacements);
            if r.is_empty() {
                return;
            }
            std::mem::take(&mut *r)
        };
        for (peer, gen, new) in taken {
            match self.peers.get_mut(&peer) {
                Some(slot) if slot.conn.as_ref().is_some_and(|c| c.gen == gen) => {
                    tracing::info!(%peer, addr = %new.addr(), gen = new.gen, "tcp connection replaced after a failure");
                    slot.conn = Some(new);
                }
                _ => new.fail("superseded", None, Aftermath::Report),
            }
        }
    }

    fn fail_now(&mut self, t: &Transfer, e: DataError) {
        self.poll_due = true;
        self.ready.push(Completion {
            id: t.id,
            peer: t.peer,
            result: Err(e),
        });
    }

    fn expire(&mut self, now: Instant, out: &mut Vec<Completion>) {
        if self.next_deadline.is_none_or(|d| now < d) {
            return;
        }
        let mut next: Option<Instant> = None;
        let peers = &self.peers;
        let mut abort: Vec<(Arc<PeerConn>, Vec<Completion>)> = Vec::new();
        self.in_flight.retain(|id, x| {
            let keep = |next: &mut Option<Instant>, at: Instant| {
                *next = Some(next.map_or(at, |n| n.min(at)));
                true
            };
            if x.deadline > now {
                return keep(&mut next, x.deadline);
            }
            match x.try_take_done_unlanded() {
                // READ bytes are being copied this instant: retry at the
                // next poll (the copy does not wait on the network).
                None => return keep(&mut next, now),
                // Finished by an I/O thread an instant ago: its
                // completion is drained by the next `poll`.
                Some(false) => return keep(&mut next, x.deadline),
                Some(true) => {}
            }
            let timeout = Completion {
                id: *id,
                peer: x.peer,
                result: Err(DataError::Timeout {
                    id: *id,
                    peer: x.peer,
                    overdue: now - x.deadline,
                }),
            };
            if let Some(conn) = peers.get(&x.peer).and_then(|s| s.conn.as_ref()) {
                conn.forget(*id);
                // Any WRITE or notification of it may still be in the
                // network: reported once the target fenced the connection.
                if (x.has_unsent() || x.fences) && !conn.is_dead() {
                    match abort.iter_mut().find(|(c, _)| Arc::ptr_eq(c, conn)) {
                        Some((_, list)) => list.push(timeout),
                        None => abort.push((conn.clone(), vec![timeout])),
                    }
                    return false;
                }
            }
            out.push(timeout);
            false
        });
        // A WRITE or notification of a transfer that timed out may still
        // be on its way: staged and not all written (its payload would be
        // read from the caller's memory and sent after the timeout is
        // reported), or sent and held somewhere in the network (it would
        // land after the timeout, over newer data). Abort its connection
        // first, as a failure does (once the sockets are shut no write is
        // in progress and none reads the memory), and report the timeout
        // once the target fenced the connection (see `PeerConn::fail`).
        // The connection's other transfers fail with `PeerLost` (those
        // past their deadline with `Timeout`); the fence is a new
        // connection that takes the old one's place, so the peer stays
        // connected when its target answers; while it is being made,
        // transfers fail with `PeerLost`.
        for (conn, timed_out) in abort {
            conn.abort_after_timeout(
                "a WRITE or notification timed out unanswered",
                now,
                timed_out,
            );
        }
        self.next_deadline = next;
    }
}

impl Backend for TcpBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Tcp
    }

    fn register(&mut self, region: &Region) -> Result<RemoteRegion, DataError> {
        let key = self.registry.register("tcp", region)?;
        // Registered again: the accesses in flight stay counted on the
        // entry they leased.
        self.regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_insert_with(|| Served::new(region.clone()));
        Ok(region.advert(key))
    }

    /// Stops serving the region, and returns once the target side touches
    /// its memory no more (see *Deregistration* in [`TcpBackend`]'s docs):
    /// the caller may then free it. Blocks for up to
    /// [`TcpConfig::deregister_grace`] (plus one turn of the I/O threads)
    /// while peers' requests on the region are in flight.
    fn deregister(&mut self, region: RegionId) -> Result<(), DataError> {
        let key = self.registry.deregister(region)?;
        self.server
            .deregister(key, region, self.config.deregister_grace)
    }

    fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
        let peer = PeerId(self.next_peer);
        self.next_peer += 1;
        let endpoint = TcpEndpoint {
            token: self.creds.issue(peer),
            ..self.endpoint
        };
        self.shared
            .peers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.peers.insert(
            peer,
            PeerSlot {
                conn: None,
                regions: FastMap::default(),
                routes: Arc::default(),
            },
        );
        Ok((peer, endpoint.to_endpoint()))
    }

    fn connect_peer(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<(), DataError> {
        let connected = self.start_connect(peer, remote, regions)?.run()?;
        self.finish_connect(peer, connected)
    }

    fn start_connect(
        &mut self,
        peer: PeerId,
        remote: &Endpoint,
        regions: &[RemoteRegion],
    ) -> Result<Connecting, DataError> {
        let Some(slot) = self.peers.get(&peer) else {
            return Err(DataError::UnknownPeer(peer));
        };
        let ep = TcpEndpoint::from_endpoint(remote)?;
        let cfg = ConnectConfig {
            streams: self.config.streams,
            stream_budget: self.config.stream_budget,
            timeout: self.config.connect_timeout,
            socket: self.config.socket_options(),
            gens: self.gens.clone(),
            fence_timeout: self.config.fence_timeout,
            routes: slot.routes.clone(),
        };
        let shared = self.shared.clone();
        let pool = self.pool.shared();
        let regions: FastMap<RemoteKey, RemoteRegion> =
            regions.iter().map(|r| (r.key, *r)).collect();
        Ok(Connecting::new(move || {
            let conn = PeerConn::connect(peer, &ep, &cfg, shared, &pool)?;
            Ok(Box::new((conn, regions)))
        }))
    }

    fn finish_connect(&mut self, peer: PeerId, connected: Connected) -> Result<(), DataError> {
        type Made = (Arc<PeerConn>, FastMap<RemoteKey, RemoteRegion>);
        let (conn, regions) = *connected.take::<Made>().ok_or(DataError::BadEndpoint {
            backend: "tcp",
            reason: "finish_connect was given another backend's connect".into(),
        })?;
        let Some(slot) = self.peers.get_mut(&peer) else {
            conn.fail("peer removed while connecting", None, Aftermath::Report);
            return Err(DataError::UnknownPeer(peer));
        };
        if let Some(old) = slot.conn.replace(conn) {
            // The new connection's fence covers the old one.
            old.fail("peer reconnected", None, Aftermath::Report);
        }
        slot.regions = regions;
        Ok(())
    }

    fn set_fence_routes(&mut self, peer: PeerId, routes: &[Endpoint]) {
        let Some(slot) = self.peers.get(&peer) else {
            return;
        };
        let addrs: Vec<SocketAddr> = routes
            .iter()
            .filter_map(|ep| TcpEndpoint::from_endpoint(ep).ok())
            .map(|t| t.addr)
            .collect();
        *lock(&slot.routes) = addrs;
    }

    fn remove_peer(&mut self, peer: PeerId) {
        // Its credential goes too, and with it its connections to us.
        self.server.revoke(peer);
        // Kept staging may hold its connection (see `hand_over`).
        self.stage.clear();
        if let Some(slot) = self.peers.remove(&peer) {
            self.shared
                .peers
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(conn) = slot.conn {
                conn.fail("peer removed", None, Aftermath::Report);
            }
        }
    }

    fn submit(&mut self, t: Transfer) -> Result<(), SubmitError> {
        self.submit_at(t, Instant::now())
    }

    fn submit_at(&mut self, t: Transfer, now: Instant) -> Result<(), SubmitError> {
        // A deadline sooner than the driver's longest sleep needs a poll
        // scheduled by it; so does a failure queued here. Every chunk goes
        // to its stream before `submit` returns.
        self.poll_due = false;
        self.adopt_replacements();
        let r = self.submit_staged(t, now);
        self.hand_over();
        r
    }

    /// One hand-over per stream for the whole batch: a batch of small
    /// transfers leaves in a few large writes, as one transfer of as many
    /// blocks does, instead of a wake-up of the stream's I/O thread and a
    /// write per transfer.
    fn submit_batch(
        &mut self,
        transfers: Vec<Transfer>,
        results: &mut Vec<Result<(), SubmitError>>,
    ) -> bool {
        self.poll_due = false;
        self.adopt_replacements();
        let now = Instant::now();
        for t in transfers {
            results.push(self.submit_staged(t, now));
        }
        self.hand_over();
        self.poll_due
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) -> usize {
        let before = completions.len();
        self.adopt_replacements();
        completions.append(&mut self.ready);
        std::mem::swap(&mut self.drained, &mut lock(&self.shared.completions));
        for c in self.drained.drain(..) {
            self.in_flight.remove(&c.id);
            completions.push(c);
        }
        self.expire(Instant::now(), completions);
        completions.len() - before
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) -> usize {
        let mut q = lock(&self.shared.notifications);
        let n = q.queue.len();
        out.extend(
            q.take()
                .map(|(from, payload)| Notification { payload, from }),
        );
        n
    }

    fn tcp_counters(&self) -> Option<TcpCounters> {
        Some(self.counters())
    }

    /// Every prepared peer gets its own credential (revoked with the
    /// peer), so endpoints are exchanged per connection.
    fn endpoint_per_peer(&self) -> bool {
        true
    }

    /// The peer keeps its credential (the remote's connections to us stay
    /// valid) and can be connected again.
    fn disconnect_peer(&mut self, peer: PeerId) -> bool {
        let Some(slot) = self.peers.get_mut(&peer) else {
            return false;
        };
        if let Some(conn) = slot.conn.take() {
            conn.fail("connection dropped", None, Aftermath::Fence);
        }
        true
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len() + self.ready.len()
    }

    /// The I/O threads wake the driver for every answer and every
    /// notification that arrives (at the end of their turn).
    fn announces_arrivals(&self) -> bool {
        true
    }

    /// Completions and notifications are announced by the I/O threads
    /// through the waker, and `submit` hands every chunk to its stream;
    /// what only `poll` notices is a deadline.
    /// With nothing in flight there is none and the driver parks idle.
    fn poll_by(&self) -> Option<Instant> {
        if self.ready.is_empty() {
            self.next_deadline
        } else {
            Some(Instant::now())
        }
    }

    fn poll_after_submit(&self) -> bool {
        self.poll_due
    }

    fn set_waker(&mut self, waker: Waker) {
        *lock(&self.shared.waker) = Some(waker);
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        for slot in self.peers.values() {
            if let Some(conn) = &slot.conn {
                conn.fail("backend dropped", None, Aftermath::Report);
            }
        }
        let mut r = lock(&self.shared.replacements);
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        for (_, _, conn) in r.drain(..) {
            conn.fail("backend dropped", None, Aftermath::Report);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(addr: &str, listen: &str) -> TcpEndpoint {
        TcpEndpoint {
            addr: addr.parse().unwrap(),
            listen: listen.parse().unwrap(),
            token: [9; TOKEN_LEN],
        }
    }

    #[test]
    fn endpoints_round_trip_with_their_listen_address() {
        for e in [
            ep("10.0.0.1:4000", "0.0.0.0:4000"),
            ep("0.0.0.0:4000", "0.0.0.0:4000"),
            ep("[::1]:4000", "[::1]:4000"),
        ] {
            let back = TcpEndpoint::from_endpoint(&e.to_endpoint()).unwrap();
            assert!(back == e, "{e:?} came back as {back:?}");
        }
    }

    #[test]
    fn a_wildcard_is_dialed_at_the_host_the_control_plane_reached() {
        let host: IpAddr = "10.231.0.1".parse().unwrap();
        let got = ep("0.0.0.0:4000", "0.0.0.0:4000")
            .reached_at(Some(host))
            .unwrap();
        assert_eq!(got.addr, "10.231.0.1:4000".parse().unwrap());
        assert_eq!(got.listen, "0.0.0.0:4000".parse().unwrap());
        // A loopback peer gets loopback, an IPv6 peer of a `::` listener
        // its IPv6 address, an IPv4 peer of a dual-stack `::` listener the
        // mapped address.
        let lo = ep("0.0.0.0:4000", "0.0.0.0:4000")
            .reached_at(Some(Ipv4Addr::LOCALHOST.into()))
            .unwrap();
        assert_eq!(lo.addr, "127.0.0.1:4000".parse().unwrap());
        let v6 = ep("[::]:4000", "[::]:4000")
            .reached_at(Some("fd00::2".parse().unwrap()))
            .unwrap();
        assert_eq!(v6.addr, "[fd00::2]:4000".parse().unwrap());
        let mapped = ep("[::]:4000", "[::]:4000").reached_at(Some(host)).unwrap();
        assert_eq!(mapped.addr, "[::ffff:10.231.0.1]:4000".parse().unwrap());
        // A routable advertised address is kept as it is.
        let kept = ep("10.9.9.9:4000", "0.0.0.0:4000")
            .reached_at(Some(host))
            .unwrap();
        assert_eq!(kept.addr, "10.9.9.9:4000".parse().unwrap());
    }

    #[test]
    fn an_endpoint_the_peer_cannot_reach_is_an_error_naming_both_addresses() {
        let remote: IpAddr = "10.231.0.2".parse().unwrap();
        let cases = [
            (
                ep("127.0.0.1:4000", "127.0.0.1:4000"),
                Some(remote),
                "loopback",
            ),
            (
                ep("0.0.0.0:4000", "0.0.0.0:4000"),
                Some("fd00::2".parse().unwrap()),
                "IPv4 only",
            ),
            (ep("0.0.0.0:4000", "0.0.0.0:4000"), None, "not known"),
        ];
        for (e, host, why) in cases {
            let err = e.reached_at(host).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, DataError::Unreachable { .. }), "{msg}");
            assert!(msg.contains(&e.addr.to_string()), "{msg}");
            assert!(msg.contains(&format!("listens on {}", e.listen)), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
    }

    /// A panic while an I/O thread drives a stream fails that peer's
    /// transfers at once (not at their deadline); another peer served by
    /// the same threads keeps working.
    #[test]
    fn a_panic_in_the_initiator_io_fails_only_that_peer_promptly() {
        use crate::backend::connect_pair;
        use crate::transfer::{Descriptor, RemoteDescriptor};
        let config = TcpConfig {
            io_threads: 1,
            ..TcpConfig::default()
        };
        let mut init = TcpBackend::new(config.clone()).unwrap();
        let mut target = TcpBackend::new(config).unwrap();
        let local = Region::alloc(1 << 20, Access::ALL).unwrap();
        let remote = Region::alloc(1 << 20, Access::ALL).unwrap();
        let local_ad = init.register(&local).unwrap();
        let remote_ad = target.register(&remote).unwrap();
        let (bad, _) = connect_pair(&mut init, &[local_ad], &mut target, &[remote_ad]).unwrap();
        let (good, _) = connect_pair(&mut init, &[local_ad], &mut target, &[remote_ad]).unwrap();
        let conn = init.peers[&bad].conn.clone().unwrap();
        conn.panic_in_io
            .store(true, std::sync::atomic::Ordering::Release);
        let write = |peer| {
            Transfer::new(
                peer,
                Op::Write,
                vec![Descriptor {
                    region: local.id(),
                    offset: 0,
                    len: 1 << 20,
                }],
                vec![RemoteDescriptor {
                    key: remote_ad.key,
                    offset: 0,
                    len: 1 << 20,
                }],
            )
            .with_deadline(Instant::now() + Duration::from_secs(30))
        };
        let (b, g) = (write(bad), write(good));
        let ids = [b.id, g.id];
        init.submit(b).unwrap();
        init.submit(g).unwrap();
        let start = Instant::now();
        let got = crate::conformance::collect(&mut init, &ids, Duration::from_secs(20));
        let (r, at) = &got[&ids[0]];
        let e = r
            .as_ref()
            .expect_err("a panicking stream completed a transfer");
        assert!(e.is_peer_lost(), "{e}");
        assert!(e.to_string().contains("panicked"), "{e}");
        assert!(
            *at - start < Duration::from_secs(5),
            "took {:?}",
            *at - start
        );
        assert!(got[&ids[1]].0.is_ok(), "{:?}", got[&ids[1]].0);
    }

    /// An I/O thread with nothing to do waits in `epoll_wait`; a request
    /// queued for one of its streams must wake it (nothing else would: the
    /// connection is idle, and the backend's poll does no I/O). Each round
    /// lets the thread park first, then one small WRITE and one small READ
    /// must complete, byte-checked, long before their deadline. Lone
    /// transfers like these leave from the submitting thread; here the
    /// connection sends every request through its I/O thread.
    #[test]
    fn a_parked_io_thread_is_woken_by_each_submission() {
        use crate::conformance::{one_span, run_one, setup, Fixture};
        /// Tcp backends on a pool of their own: a thread count no other
        /// test here uses.
        struct OwnPool;
        impl Fixture for OwnPool {
            type Backend = TcpBackend;
            fn backends(&self) -> (TcpBackend, TcpBackend) {
                let config = TcpConfig {
                    io_threads: 7,
                    ..TcpConfig::default()
                };
                (
                    TcpBackend::new(config.clone()).unwrap(),
                    TcpBackend::new(config).unwrap(),
                )
            }
        }
        let mut s = setup(&OwnPool, 1 << 16, 1 << 16, Access::ALL, 7);
        let conn = s.init.peers[&s.peer].conn.clone().unwrap();
        conn.no_direct
            .store(true, std::sync::atomic::Ordering::Relaxed);
        drop(conn);
        let deadline = Duration::from_secs(10);
        let mut landed = vec![0u8; 4096];
        for round in 0..20u8 {
            // Idle long enough for every I/O thread to wait in the kernel.
            std::thread::sleep(Duration::from_millis(20));
            s.local.write(0, &[round; 4096]).unwrap();
            let w = one_span(s.peer, Op::Write, (&s.local, 0), (s.remote_ad.key, 0), 4096)
                .with_deadline(Instant::now() + deadline);
            let r = run_one(&mut s.init, &mut s.target, w);
            assert!(r.is_ok(), "round {round} WRITE: {r:?}");
            s.remote.read(0, &mut landed).unwrap();
            assert!(
                landed.iter().all(|&b| b == round),
                "round {round} WRITE bytes"
            );

            std::thread::sleep(Duration::from_millis(20));
            s.remote.write(8192, &[!round; 4096]).unwrap();
            let rd = one_span(
                s.peer,
                Op::Read,
                (&s.local, 8192),
                (s.remote_ad.key, 8192),
                4096,
            )
            .with_deadline(Instant::now() + deadline);
            let r = run_one(&mut s.init, &mut s.target, rd);
            assert!(r.is_ok(), "round {round} READ: {r:?}");
            s.local.read(8192, &mut landed).unwrap();
            assert!(
                landed.iter().all(|&b| b == !round),
                "round {round} READ bytes"
            );
        }
    }

    /// Waits (10 s at most, then fails) until `cond` holds.
    pub(super) fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < until, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until every stream of `peer`'s connection is idle and not
    /// being driven: the I/O thread that took the last answer may still
    /// be finishing its turn when the transfer's result is out, and a
    /// submission meeting that turn goes through the I/O thread.
    fn settle(b: &TcpBackend, peer: PeerId) {
        let conn = b.peers[&peer].conn.clone().unwrap();
        wait_for("the streams to settle", || conn.settled());
    }

    /// A lone transfer on an idle stream is written by the thread that
    /// submits it; a batch handed over in one call too, as one write.
    /// Bytes land either way.
    #[test]
    fn a_lone_transfer_leaves_from_the_submitting_thread() {
        use crate::conformance::{collect, one_span, run_one, setup, TcpFixture};
        let mut s = setup(&TcpFixture(|| None), 1 << 16, 1 << 16, Access::ALL, 11);
        assert_eq!(s.init.direct_sends(), 0);
        settle(&s.init, s.peer);
        s.local.write(0, &[0x5a; 4096]).unwrap();
        let w = one_span(s.peer, Op::Write, (&s.local, 0), (s.remote_ad.key, 0), 4096);
        run_one(&mut s.init, &mut s.target, w).unwrap();
        assert_eq!(s.init.direct_sends(), 1, "the lone WRITE");
        let mut landed = vec![0u8; 4096];
        s.remote.read(0, &mut landed).unwrap();
        assert!(landed.iter().all(|&b| b == 0x5a));

        s.remote.write(8192, &[0xa5; 4096]).unwrap();
        settle(&s.init, s.peer);
        let r = one_span(
            s.peer,
            Op::Read,
            (&s.local, 8192),
            (s.remote_ad.key, 8192),
            4096,
        );
        run_one(&mut s.init, &mut s.target, r).unwrap();
        assert_eq!(s.init.direct_sends(), 2, "the lone READ");
        s.local.read(8192, &mut landed).unwrap();
        assert!(landed.iter().all(|&b| b == 0xa5));

        // Eight READs in one call: one hand-over to one stream (32 KiB
        // stay within a stripe), written at once by this thread.
        let batch: Vec<Transfer> = (0..8u64)
            .map(|k| {
                let at = 16384 + k * 4096;
                one_span(
                    s.peer,
                    Op::Read,
                    (&s.local, at),
                    (s.remote_ad.key, at),
                    4096,
                )
            })
            .collect();
        let ids: Vec<_> = batch.iter().map(|t| t.id).collect();
        let mut results = Vec::new();
        settle(&s.init, s.peer);
        s.init.submit_batch(batch, &mut results);
        assert!(results.iter().all(Result::is_ok));
        for (_, (r, _)) in collect(&mut s.init, &ids, Duration::from_secs(10)) {
            r.unwrap();
        }
        assert_eq!(s.init.direct_sends(), 3, "the batch, as one write");
        let (mut want, mut got) = (vec![0u8; 32768], vec![0u8; 32768]);
        s.remote.read(16384, &mut want).unwrap();
        s.local.read(16384, &mut got).unwrap();
        assert!(want == got, "READ bytes of the batch");
    }

    /// The I/O thread that comes to drive a stream while a submitter
    /// holds it leaves it and sets `missed`; the submitter hands the
    /// stream back when it lets go and consumes the flag. A flag left set
    /// would have every later lone transfer wake the I/O thread too.
    #[test]
    fn a_stream_missed_by_its_io_thread_is_handed_back_once() {
        use crate::conformance::{one_span, run_one, setup, TcpFixture};
        let mut s = setup(&TcpFixture(|| None), 1 << 16, 1 << 16, Access::ALL, 13);
        let conn = s.init.peers[&s.peer].conn.clone().unwrap();
        let held = conn.hold_stream(0);
        conn.test_ready(0);
        wait_for("the I/O thread to come to the held stream", || {
            conn.missed(0)
        });
        drop(held);
        assert!(conn.test_hand_back(0), "the stream is handed back");
        assert!(!conn.missed(0), "the hand-back consumes the flag");
        assert!(!conn.test_hand_back(0), "and hands back only once");
        drop(conn);

        // The stream still works, and a lone READ still leaves directly
        // once the handed-back turn is over.
        s.remote.write(0, &[0x3c; 4096]).unwrap();
        settle(&s.init, s.peer);
        let before = s.init.direct_sends();
        let r = one_span(s.peer, Op::Read, (&s.local, 0), (s.remote_ad.key, 0), 4096);
        run_one(&mut s.init, &mut s.target, r).unwrap();
        assert_eq!(s.init.direct_sends(), before + 1);
        let mut landed = vec![0u8; 4096];
        s.local.read(0, &mut landed).unwrap();
        assert!(landed.iter().all(|&b| b == 0x3c));
    }

    /// Requests written by submitting threads and by the I/O thread share
    /// one stream's tag sequence: lone transfers (direct) and bursts
    /// (the I/O thread) interleaved at random, READ and WRITE, all on one
    /// stream, every byte checked. A request out of order would fail the
    /// peer ("response out of order").
    #[test]
    fn direct_and_io_thread_requests_interleave_in_order() {
        use crate::conformance::{collect, contents, setup, Rng, TcpFixture};
        let mut s = setup(&TcpFixture(|| None), 1 << 20, 1 << 20, Access::ALL, 12);
        let mut rng = Rng::new(99);
        let mut lone = 0;
        let mut touched = Vec::new();
        for round in 0..200u64 {
            let n = if rng.below(2) == 0 {
                1
            } else {
                2 + rng.below(6)
            };
            lone += u64::from(n == 1);
            let mut ids = Vec::new();
            for k in 0..n {
                // Distinct 1 KiB slots per transfer of the round.
                let at = ((round * 8 + k) % 1024) * 1024;
                touched.push(at as usize);
                let op = if rng.below(2) == 0 {
                    Op::Read
                } else {
                    Op::Write
                };
                let t = crate::conformance::one_span(
                    s.peer,
                    op,
                    (&s.local, at),
                    (s.remote_ad.key, at),
                    1024,
                );
                ids.push(t.id);
                s.init.submit(t).unwrap();
            }
            for (id, (r, _)) in collect(&mut s.init, &ids, Duration::from_secs(10)) {
                assert!(r.is_ok(), "round {round}: {id}: {r:?}");
            }
        }
        // READs copied target bytes here and WRITEs the reverse: both
        // sides agree on every slot touched.
        let (l, r) = (contents(&s.local), contents(&s.remote));
        for at in touched {
            assert!(
                l[at..at + 1024] == r[at..at + 1024],
                "initiator and target differ at {at}"
            );
        }
        assert!(
            lone > 0 && s.init.direct_sends() > 0,
            "no lone transfer went direct"
        );
    }

    #[test]
    fn a_wildcard_listener_advertises_the_wildcard_or_the_advertised_host() {
        let wild = TcpBackend::new(TcpConfig {
            listen: "0.0.0.0:0".parse().unwrap(),
            ..TcpConfig::default()
        })
        .unwrap();
        assert!(wild.local_addr().ip().is_unspecified());
        let adv = TcpBackend::new(TcpConfig {
            listen: "0.0.0.0:0".parse().unwrap(),
            advertise: Some("10.231.0.1".parse().unwrap()),
            ..TcpConfig::default()
        })
        .unwrap();
        let e = TcpEndpoint::from_endpoint(&adv.endpoint.to_endpoint()).unwrap();
        assert_eq!(e.addr.ip(), "10.231.0.1".parse::<IpAddr>().unwrap());
        assert!(e.listen.ip().is_unspecified());
        assert_eq!(e.addr.port(), e.listen.port());
    }
}
