//! Planning: resolve a transfer into work requests striped over a peer's
//! healthy queue pairs, checking every span first (a refused transfer moves
//! nothing).

use super::state::{Local, Planned, PlannedWr, VerbsBackend};
use crate::error::DataError;
use crate::memory::Access;
use crate::transfer::{Op, Transfer};

impl VerbsBackend {
    /// Resolves a transfer into work requests striped over the peer's healthy
    /// QPs, checking every span first (a refused transfer moves nothing).
    pub(crate) fn plan(&self, t: &Transfer) -> Result<Planned, DataError> {
        let p = self
            .peers
            .get(&t.peer)
            .ok_or(DataError::UnknownPeer(t.peer))?;
        let healthy: Vec<usize> = (0..p.qps.len()).filter(|&i| !p.qps[i].broken).collect();
        if healthy.is_empty() {
            return Err(DataError::PeerLost {
                peer: t.peer,
                reason: "every rdma queue pair to the peer failed; reconnect to rebuild them",
                source: None,
            });
        }
        if t.notify.is_some() && p.qps[0].broken {
            return Err(DataError::PeerLost {
                peer: t.peer,
                reason: "the notification queue pair failed; reconnect to rebuild it",
                source: None,
            });
        }
        let mut plan = Vec::new();
        let mut keep: Vec<Local> = Vec::new();
        // The starting QP rotates with the transfer id.
        let mut k = (t.id.0 % healthy.len() as u64) as usize;
        for seg in t.segments()? {
            let local = self
                .regions
                .get(&seg.region)
                .ok_or(DataError::UnknownRegion(seg.region))?;
            if t.op == Op::Read && !local.region.access().contains(Access::LOCAL_WRITE) {
                return Err(DataError::AccessDenied {
                    op: t.op,
                    target: format!("local {}", seg.region),
                    needed: Access::LOCAL_WRITE,
                    granted: local.region.access(),
                });
            }
            local.region.check_range(seg.local_offset, seg.len)?;
            let remote = p.remote.get(&seg.key).ok_or(DataError::UnknownKey {
                peer: t.peer,
                key: seg.key,
            })?;
            remote.check(t.peer, t.op, seg.remote_offset, seg.len)?;
            if !keep.iter().any(|l| l.region.id() == seg.region) {
                keep.push(local.clone());
            }
            let mut off = 0;
            while off < seg.len {
                let len = (seg.len - off).min(self.chunk);
                plan.push(PlannedWr {
                    qp: healthy[k % healthy.len()],
                    local_addr: local.mr.addr() + seg.local_offset + off,
                    len: len as u32,
                    lkey: local.mr.lkey(),
                    remote_addr: remote.addr + seg.remote_offset + off,
                    rkey: remote.key.0,
                });
                k += 1;
                off += len;
            }
        }
        Ok((plan, keep))
    }
}
