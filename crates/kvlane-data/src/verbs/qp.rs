//! Reliable-connected queue pairs as a coarse typestate:
//! [`QpBuilder`] → [`PreparedQp`] (INIT; its [`QpEndpoint`] is what the
//! handshake carries) → [`ConnectedQp`] (RTR → RTS, ready to post).

use std::net::Ipv6Addr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendError, PostSendGuard as _, QueuePair as _, QueuePairAttribute,
    QueuePairState, SetScatterGatherEntry as _, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::error::{io_cause, VerbsError};
use super::resources::{CompletionQueue, ProtectionDomain};

/// Everything a peer needs to connect its queue pair to ours. Serializable:
/// the control plane's handshake carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qp_num: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Source GID (IPv4 appears as `::ffff:a.b.c.d`).
    pub gid: Ipv6Addr,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active path MTU of the sender's port, in bytes.
    pub mtu: u32,
    /// RDMA READs this side serves at once as responder.
    pub max_dest_rd_atomic: u8,
}

/// Tunables of a queue pair. Defaults fit RoCE and InfiniBand fabrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpOptions {
    /// Send queue depth (clamped to the device's `max_qp_wr`).
    pub max_send_wr: u32,
    /// Receive queue depth, used for WRITE_WITH_IMM notifications.
    pub max_recv_wr: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR`.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer (12 ≈ 0.64 ms).
    pub min_rnr_timer: u8,
}

/// Environment variable setting the default ACK timeout exponent
/// ([`QpOptions::timeout`], 1..=31). Soft-RoCE under emulation (QEMU TCG)
/// needs about 18 (1 s): at the default 14 (67 ms) rxe retransmits, and
/// Debian 6.1's rxe then fails some WRITEs with "remote invalid request"
/// (seen in `ci/verbs-2host.sh`, and with `ib_write_bw -q 2` alike).
pub const ENV_QP_TIMEOUT: &str = "KVLANE_IB_TIMEOUT";

/// The ACK timeout exponent [`ENV_QP_TIMEOUT`] asks for, if it is set and
/// valid (a bad value is logged and ignored, like the other `KVLANE_IB_*`).
fn env_timeout() -> Option<u8> {
    let v = std::env::var(ENV_QP_TIMEOUT).ok()?;
    match v.trim().parse::<u8>() {
        Ok(t @ 1..=31) => Some(t),
        _ => {
            tracing::warn!(value = %v, "{ENV_QP_TIMEOUT} is not an ACK timeout exponent in 1..=31; using 14");
            None
        }
    }
}

/// Depths are not tuned on hardware: 512 send requests keep a 100 Gb/s link
/// busy with 64 KiB messages (≈2.7 ms of data in flight, far above a
/// fabric RTT); 128 receives bound the notifications in flight per peer.
/// The ACK timeout defaults to 14 (≈67 ms), or [`ENV_QP_TIMEOUT`].
impl Default for QpOptions {
    fn default() -> Self {
        Self {
            max_send_wr: 512,
            max_recv_wr: 128,
            timeout: env_timeout().unwrap_or(14),
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// Builds an RC queue pair on a protection domain.
#[derive(Debug)]
pub struct QpBuilder {
    pd: Arc<ProtectionDomain>,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    options: QpOptions,
}

impl QpBuilder {
    /// A builder whose QP reports to `send_cq` and `recv_cq` (may be the same).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
    ) -> Self {
        Self {
            pd: Arc::clone(pd),
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            options: QpOptions::default(),
        }
    }

    /// Replaces the options.
    pub fn options(mut self, options: QpOptions) -> Self {
        self.options = options;
        self
    }

    /// Creates the QP and moves it to INIT.
    pub fn build(self) -> Result<PreparedQp, VerbsError> {
        let ctx = Arc::clone(self.pd.context());
        let limits = *ctx.limits();
        let mut o = self.options;
        o.max_send_wr = o.max_send_wr.clamp(1, limits.max_qp_wr.max(1));
        o.max_recv_wr = o.max_recv_wr.clamp(1, limits.max_qp_wr.max(1));
        let qp = self
            .pd
            .raw()
            .create_qp_builder()
            .setup_max_send_wr(o.max_send_wr)
            .setup_max_recv_wr(o.max_recv_wr)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(self.send_cq.raw()))
            .setup_recv_cq(Arc::clone(self.recv_cq.raw()))
            .build()
            .map_err(|e| VerbsError::Create {
                device: ctx.name().to_owned(),
                what: format!("queue pair (send depth {})", o.max_send_wr),
                source: io_cause(&e),
            })?;
        let mut qp = Qp {
            qp,
            pd: self.pd,
            _send_cq: self.send_cq,
            _recv_cq: self.recv_cq,
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(ctx.port().port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&attr, "INIT")?;
        let psn = random_psn(qp.qpn());
        let endpoint = QpEndpoint {
            qp_num: qp.qpn(),
            psn,
            gid: ctx.gid().gid,
            lid: ctx.port().lid,
            mtu: ctx.port().active_mtu,
            max_dest_rd_atomic: limits.max_qp_rd_atom.max(1),
        };
        Ok(PreparedQp {
            qp,
            options: o,
            endpoint,
        })
    }
}

/// The queue pair and the objects it depends on (declared after it, so they
/// are dropped after it).
struct Qp {
    qp: BasicQueuePair,
    pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
}

impl Qp {
    fn qpn(&self) -> u32 {
        self.qp.qp_number()
    }

    fn device(&self) -> String {
        self.pd.context().name().to_owned()
    }

    fn modify(&mut self, attr: &QueuePairAttribute, state: &'static str) -> Result<(), VerbsError> {
        self.qp.modify(attr).map_err(|e| VerbsError::ModifyQp {
            device: self.device(),
            qpn: self.qpn(),
            state,
            source: io_cause(&e),
        })
    }
}

/// A queue pair in INIT, waiting for the peer's [`QpEndpoint`].
pub struct PreparedQp {
    qp: Qp,
    options: QpOptions,
    endpoint: QpEndpoint,
}

impl std::fmt::Debug for PreparedQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedQp")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl PreparedQp {
    /// What the handshake sends to the peer.
    pub fn endpoint(&self) -> QpEndpoint {
        self.endpoint
    }

    /// Connects to the peer's endpoint: INIT → RTR → RTS. The path MTU is the
    /// smaller of both sides; outstanding READs are bounded by both the local
    /// initiator limit and the peer's responder resources.
    pub fn connect(mut self, remote: &QpEndpoint) -> Result<ConnectedQp, VerbsError> {
        let ctx = Arc::clone(self.qp.pd.context());
        let mtu_bytes = self.endpoint.mtu.min(remote.mtu);
        let mtu = mtu_from_bytes(mtu_bytes).ok_or(VerbsError::InvalidEndpoint {
            device: ctx.name().to_owned(),
            qpn: self.qp.qpn(),
            reason: "path mtu is not one of 256, 512, 1024, 2048, 4096",
        })?;
        if remote.gid.is_unspecified() && remote.lid == 0 {
            return Err(VerbsError::InvalidEndpoint {
                device: ctx.name().to_owned(),
                qpn: self.qp.qpn(),
                reason: "remote has neither a gid nor a lid",
            });
        }
        let sgid_index =
            u8::try_from(ctx.gid().index).map_err(|_| VerbsError::InvalidEndpoint {
                device: ctx.name().to_owned(),
                qpn: self.qp.qpn(),
                reason: "local gid index does not fit the address vector (> 255)",
            })?;
        let o = self.options;

        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(ctx.port().port)
            .setup_service_level(0);
        if !remote.gid.is_unspecified() {
            ah.setup_grh(&Gid::from(remote.gid), 0, sgid_index, 64, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qp_num)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.endpoint.max_dest_rd_atomic)
            .setup_min_rnr_timer(o.min_rnr_timer)
            .setup_address_vector(&ah);
        self.qp.modify(&attr, "RTR")?;

        let max_rd_atomic = ctx
            .limits()
            .max_qp_init_rd_atom
            .max(1)
            .min(remote.max_dest_rd_atomic.max(1));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.endpoint.psn)
            .setup_timeout(o.timeout)
            .setup_retry_cnt(o.retry_cnt)
            .setup_rnr_retry(o.rnr_retry)
            .setup_max_read_atomic(max_rd_atomic);
        self.qp.modify(&attr, "RTS")?;

        Ok(ConnectedQp {
            qp: self.qp,
            local: self.endpoint,
            remote: *remote,
            mtu: mtu_bytes,
            max_rd_atomic,
            sq_depth: o.max_send_wr,
            rq_depth: o.max_recv_wr,
        })
    }
}

/// One-sided operation of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOp {
    /// RDMA WRITE; with `Some(imm)` it is WRITE_WITH_IMM and consumes a receive
    /// at the target.
    Write(Option<u32>),
    /// RDMA READ.
    Read,
}

/// One send work request: one local buffer, one remote address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// Operation.
    pub op: WrOp,
    /// Local address.
    pub local_addr: u64,
    /// Length in bytes (at most the port's max message size).
    pub len: u32,
    /// Local key of the registration holding `local_addr`.
    pub lkey: u32,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Generate a completion for this request.
    pub signaled: bool,
}

/// A connected queue pair (RTS).
pub struct ConnectedQp {
    qp: Qp,
    local: QpEndpoint,
    remote: QpEndpoint,
    mtu: u32,
    max_rd_atomic: u8,
    sq_depth: u32,
    rq_depth: u32,
}

impl std::fmt::Debug for ConnectedQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectedQp")
            .field("local", &self.local)
            .field("remote", &self.remote)
            .field("mtu", &self.mtu)
            .finish_non_exhaustive()
    }
}

impl ConnectedQp {
    /// Local queue pair number.
    pub fn qpn(&self) -> u32 {
        self.local.qp_num
    }

    /// Local endpoint.
    pub fn local(&self) -> &QpEndpoint {
        &self.local
    }

    /// Remote endpoint.
    pub fn remote(&self) -> &QpEndpoint {
        &self.remote
    }

    /// Negotiated path MTU in bytes.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// RDMA READs that may be outstanding at once.
    pub fn max_rd_atomic(&self) -> u8 {
        self.max_rd_atomic
    }

    /// Send queue depth.
    pub fn sq_depth(&self) -> u32 {
        self.sq_depth
    }

    /// Receive queue depth.
    pub fn rq_depth(&self) -> u32 {
        self.rq_depth
    }

    /// Posts `wrs` as one chain with one doorbell (`ibv_post_send`).
    ///
    /// On error some prefix of the chain may have been posted; callers should
    /// [`fail`](Self::fail) the queue pair so those are flushed.
    ///
    /// # Safety
    ///
    /// Every `local_addr..local_addr + len` must lie in a live registration
    /// with key `lkey`, and stay valid until the work request has completed
    /// or been flushed; the NIC reads it (WRITE) or writes it (READ).
    pub unsafe fn post_send(&mut self, wrs: &[SendWr]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut guard = self.qp.qp.start_post_send();
        for wr in wrs {
            let flags = if wr.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = guard.construct_wr(wr.wr_id, flags);
            let h = match wr.op {
                WrOp::Write(None) => h.setup_write(wr.rkey, wr.remote_addr),
                WrOp::Write(Some(imm)) => h.setup_write_imm(wr.rkey, wr.remote_addr, imm),
                WrOp::Read => h.setup_read(wr.rkey, wr.remote_addr),
            };
            // SAFETY: the caller guarantees the local range is registered under
            // `lkey` and outlives the work request.
            unsafe { h.setup_sge(wr.lkey, wr.local_addr, wr.len) };
        }
        guard.post().map_err(|e| VerbsError::Post {
            device: self.qp.device(),
            qpn: self.qpn(),
            what: "send work requests",
            source: match e {
                PostSendError::NotEnoughResources(io)
                | PostSendError::InvalidWorkRequest(io)
                | PostSendError::InvalidQueuePair(io)
                | PostSendError::Ibverbs(io) => io,
                other => io_cause(&other),
            },
        })
    }

    /// Posts `wr_ids.len()` zero-length receives (one doorbell); each absorbs one
    /// incoming WRITE_WITH_IMM.
    pub fn post_recv(&mut self, wr_ids: impl IntoIterator<Item = u64>) -> Result<(), VerbsError> {
        let mut guard = self.qp.qp.start_post_recv();
        let mut any = false;
        for id in wr_ids {
            // Zero scatter/gather entries: WRITE_WITH_IMM carries no payload
            // into the receive buffer.
            let _ = guard.construct_wr(id);
            any = true;
        }
        if !any {
            return Ok(());
        }
        guard.post().map_err(|e| VerbsError::Post {
            device: self.qp.device(),
            qpn: self.local.qp_num,
            what: "receive work requests",
            source: io_cause(&e),
        })
    }

    /// Moves the queue pair to the ERROR state: every outstanding work request
    /// is flushed with `IBV_WC_WR_FLUSH_ERR`. The QP is unusable afterwards;
    /// a new handshake builds a new one.
    pub fn fail(&mut self) -> Result<(), VerbsError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp.modify(&attr, "ERR")
    }
}

fn mtu_from_bytes(bytes: u32) -> Option<Mtu> {
    Some(match bytes {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// A 24-bit initial PSN, different per QP and process run.
fn random_psn(qpn: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qpn);
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    (h.finish() as u32) & 0x00ff_ffff
}
