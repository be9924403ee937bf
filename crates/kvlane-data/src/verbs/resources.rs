//! RAII verbs objects: [`Context`] → [`ProtectionDomain`] → [`MemoryRegistration`],
//! [`CompletionQueue`]. Every child holds its parent by `Arc`, so the drop
//! order is right by construction; nothing has a manual `destroy()`.

use std::os::fd::RawFd;
use std::sync::Arc;

use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::DeviceInfo as _;
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain as SwPd;
use sideway::ibverbs::AccessFlags;

use super::device::{
    describe, device_list, port_status, select, DeviceConfig, GidInfo, PortInfo, PortStatus,
    Selection,
};
use super::device::{DeviceInfo, DeviceLimits};
use super::error::{io_cause, is_unsupported, Unsupported, VerbsError};

/// An open RDMA device bound to one port and one GID.
pub struct Context {
    ctx: Arc<DeviceContext>,
    info: DeviceInfo,
    port: PortInfo,
    gid: GidInfo,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.info.name)
            .field("port", &self.port.port)
            .field("gid", &self.gid)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the device chosen by `config` (see [`DeviceConfig`]).
    pub fn open(config: &DeviceConfig) -> Result<Arc<Self>, VerbsError> {
        let Selection { device, port, gid } = select(config)?;
        let list = device_list()?;
        let dev = list
            .iter()
            .find(|d| d.name() == device.name)
            .ok_or_else(|| VerbsError::DeviceNotFound {
                name: device.name.clone(),
                available: "none (device vanished)".to_owned(),
            })?;
        let ctx = dev.open().map_err(|e| VerbsError::OpenDevice {
            device: device.name.clone(),
            source: io_cause(&e),
        })?;
        // Re-query through this context so the snapshot matches what we opened.
        let info = describe(&device.name, &ctx)?;
        Ok(Arc::new(Self {
            ctx,
            info,
            port,
            gid,
        }))
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The device as listed.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Device limits.
    pub fn limits(&self) -> &DeviceLimits {
        &self.info.limits
    }

    /// The port this context uses, as it was when the context was opened.
    pub fn port(&self) -> &PortInfo {
        &self.port
    }

    /// The port's logical state now (one `ibv_query_port`): a port whose
    /// link went down reads `Down` until it is ACTIVE again.
    pub fn port_state(&self) -> Result<PortStatus, VerbsError> {
        let attr = self
            .ctx
            .query_port(self.port.port)
            .map_err(|e| VerbsError::Query {
                device: self.info.name.clone(),
                what: format!("port {}", self.port.port),
                source: io_cause(&e),
            })?;
        Ok(port_status(attr.attr.state))
    }

    /// The GID this context uses.
    pub fn gid(&self) -> &GidInfo {
        &self.gid
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>, VerbsError> {
        let pd = self.ctx.alloc_pd().map_err(|e| VerbsError::Create {
            device: self.info.name.clone(),
            what: "protection domain".to_owned(),
            source: io_cause(&e),
        })?;
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: Arc::clone(self),
        }))
    }

    /// Creates a completion queue with at least `entries` entries (clamped to
    /// the device's `max_cqe`).
    pub fn create_cq(self: &Arc<Self>, entries: u32) -> Result<Arc<CompletionQueue>, VerbsError> {
        let entries = entries.clamp(1, self.info.limits.max_cqe.max(1));
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(entries)
            .build()
            .map_err(|e| VerbsError::Create {
                device: self.info.name.clone(),
                what: format!("completion queue ({entries} entries)"),
                source: io_cause(&e),
            })?;
        Ok(Arc::new(CompletionQueue {
            cq,
            entries,
            ctx: Arc::clone(self),
        }))
    }
}

/// A protection domain; memory registrations and queue pairs hang off it.
pub struct ProtectionDomain {
    pd: Arc<SwPd>,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.ctx.name())
            .finish_non_exhaustive()
    }
}

/// Remote access a registration allows (local read is always allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrAccess {
    /// The NIC may write into the memory (needed for local targets of READ and remote WRITE).
    pub local_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
}

impl MrAccess {
    /// Everything allowed.
    pub const ALL: Self = Self {
        local_write: true,
        remote_read: true,
        remote_write: true,
    };

    fn flags(self) -> AccessFlags {
        let mut f = AccessFlags::none();
        // Remote write requires local write (ibv_reg_mr(3)).
        if self.local_write || self.remote_write {
            f |= AccessFlags::LocalWrite;
        }
        if self.remote_read {
            f |= AccessFlags::RemoteRead;
        }
        if self.remote_write {
            f |= AccessFlags::RemoteWrite;
        }
        f
    }
}

impl ProtectionDomain {
    /// The context this PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> &Arc<SwPd> {
        &self.pd
    }

    /// Registers host memory (`ibv_reg_mr`).
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be valid, mapped memory that stays allocated (not
    /// freed or unmapped) until the returned registration and every work request
    /// using it are gone. The NIC reads and writes it behind the compiler's back:
    /// the caller must not rely on Rust aliasing guarantees for it.
    pub unsafe fn register_host(
        self: &Arc<Self>,
        addr: usize,
        len: usize,
        access: MrAccess,
    ) -> Result<Arc<MemoryRegistration>, VerbsError> {
        // SAFETY: forwarded from this function's contract: the range is valid and
        // outlives the registration.
        let mr = unsafe { self.pd.reg_mr(addr, len, access.flags()) }.map_err(|e| {
            VerbsError::RegisterMemory {
                device: self.ctx.name().to_owned(),
                kind: "host",
                len,
                source: io_cause(&e),
            }
        })?;
        Ok(Arc::new(MemoryRegistration {
            mr,
            addr: addr as u64,
            len,
            pd: Arc::clone(self),
        }))
    }

    /// Registers GPU memory by its device virtual address (`ibv_reg_mr`),
    /// which works only where a peer-memory module (nvidia-peermem,
    /// amdgpu's) lets the NIC pin device pages.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be device memory that stays allocated until
    /// the returned registration and every work request using it are gone.
    pub unsafe fn register_device_address(
        self: &Arc<Self>,
        addr: u64,
        len: usize,
        access: MrAccess,
    ) -> Result<Arc<MemoryRegistration>, VerbsError> {
        // SAFETY: forwarded from this function's contract.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access.flags()) }.map_err(|e| {
            VerbsError::RegisterMemory {
                device: self.ctx.name().to_owned(),
                kind: "GPU (by address)",
                len,
                source: io_cause(&e),
            }
        })?;
        Ok(Arc::new(MemoryRegistration {
            mr,
            addr,
            len,
            pd: Arc::clone(self),
        }))
    }

    /// The RDMA device's name.
    pub fn device_name(&self) -> &str {
        self.ctx.name()
    }

    /// Registers device memory exported as a dma-buf (`ibv_reg_dmabuf_mr`).
    /// `iova` is the address work requests will use for it (normally the GPU
    /// virtual address). A device or kernel that cannot register dma-bufs
    /// yields [`Unsupported::Operation`].
    ///
    /// # Safety
    ///
    /// `fd` must be a dma-buf whose `offset..offset + len` range stays valid
    /// until the returned registration and every work request using it are gone.
    pub unsafe fn register_dmabuf(
        self: &Arc<Self>,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: MrAccess,
    ) -> Result<Arc<MemoryRegistration>, VerbsError> {
        // SAFETY: forwarded from this function's contract: the dma-buf range is
        // valid and outlives the registration.
        let res = unsafe { self.pd.reg_dmabuf_mr(offset, len, iova, fd, access.flags()) };
        let mr = res.map_err(|e| {
            let io = io_cause(&e);
            if is_unsupported(&io) {
                VerbsError::Unsupported(Unsupported::Operation {
                    device: self.ctx.name().to_owned(),
                    what: "dma-buf memory registration (ibv_reg_dmabuf_mr)",
                })
            } else {
                VerbsError::RegisterMemory {
                    device: self.ctx.name().to_owned(),
                    kind: "dma-buf",
                    len,
                    source: io,
                }
            }
        })?;
        Ok(Arc::new(MemoryRegistration {
            mr,
            addr: iova,
            len,
            pd: Arc::clone(self),
        }))
    }
}

/// A memory registration (`ibv_mr`); deregistered on drop.
pub struct MemoryRegistration {
    mr: Arc<MemoryRegion>,
    addr: u64,
    len: usize,
    pd: Arc<ProtectionDomain>,
}

impl std::fmt::Debug for MemoryRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistration")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish_non_exhaustive()
    }
}

impl MemoryRegistration {
    /// Local key, used in scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key, advertised to peers.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Start address as work requests see it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` for a zero-length registration.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The protection domain it belongs to.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

/// A completion queue; polled without blocking.
pub struct CompletionQueue {
    cq: Arc<BasicCompletionQueue>,
    entries: u32,
    ctx: Arc<Context>,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("device", &self.ctx.name())
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request id it completes.
    pub wr_id: u64,
    /// `enum ibv_wc_status` (0 = success).
    pub status: u32,
    /// `enum ibv_wc_opcode`.
    pub opcode: u32,
    /// Immediate data (valid for receive completions of WRITE_WITH_IMM).
    pub imm: u32,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// Vendor error code, for diagnostics.
    pub vendor_err: u32,
}

impl CompletionQueue {
    /// Number of entries.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The context this CQ belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> &Arc<BasicCompletionQueue> {
        &self.cq
    }

    /// Moves every available completion into `out` without blocking; returns
    /// how many were added. (The poller is always drained: sideway's poller
    /// fetches completions in batches, stopping early would drop some.)
    pub fn poll(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        use sideway::ibverbs::completion::PollCompletionQueueError as E;
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(E::CompletionQueueEmpty) => return Ok(0),
            Err(e) => {
                return Err(VerbsError::PollCq {
                    device: self.ctx.name().to_owned(),
                    source: io_cause(&e),
                })
            }
        };
        let before = out.len();
        for wc in poller {
            out.push(WorkCompletion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                opcode: wc.opcode(),
                imm: wc.imm_data(),
                byte_len: wc.byte_len(),
                vendor_err: wc.vendor_err(),
            });
        }
        Ok(out.len() - before)
    }
}
