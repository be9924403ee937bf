//! The initiator's copies: every segment of a transfer checked against
//! the local registrations and the target's grants, then moved through
//! the mapping of a memory file or by cross-memory attach.

use super::peer::{attach_refusal, Conn, PeerRegion, Reach};
use super::sys;
use crate::error::DataError;
use crate::host_registry::HostRegistry;
use crate::memory::{Access, Region};
use crate::transfer::{Op, Segment, Transfer};
use std::time::Instant;

/// Checks every segment of `t` against the local registrations and the
/// target's grants, then copies them all (nothing moves when any check
/// fails): through the mapping of a memory file, or by cross-memory
/// attach to the target's process (one batch of syscalls per transfer).
pub(super) fn execute(
    t: &Transfer,
    now: Instant,
    local: &HostRegistry,
    conn: &Conn,
    plan: &mut Vec<Segment>,
) -> Result<(), DataError> {
    if now > t.deadline {
        return Err(DataError::Timeout {
            id: t.id,
            peer: t.peer,
            overdue: now - t.deadline,
        });
    }
    plan.clear();
    let lookup = |seg: &Segment| -> Result<(&Region, &PeerRegion), DataError> {
        let l = local
            .get(seg.region)
            .ok_or(DataError::UnknownRegion(seg.region))?;
        let r = conn.regions.get(&seg.key).ok_or(DataError::UnknownKey {
            peer: t.peer,
            key: seg.key,
        })?;
        Ok((l, r))
    };
    let mut attached = 0;
    for seg in t.segments()? {
        let (l, r) = lookup(&seg)?;
        if t.op == Op::Read && !l.access().contains(Access::LOCAL_WRITE) {
            return Err(DataError::AccessDenied {
                op: t.op,
                target: format!("local {}", seg.region),
                needed: Access::LOCAL_WRITE,
                granted: l.access(),
            });
        }
        l.check_range(seg.local_offset, seg.len)?;
        // The grant's rights and length; WRITE into the mapping only when
        // the grant has REMOTE_WRITE (the mapping is writable exactly then).
        r.advert().check(t.peer, t.op, seg.remote_offset, seg.len)?;
        if matches!(r.reach, Reach::Attached(_)) {
            // The kernel copies to or from this side's memory directly:
            // host memory only.
            l.host_ptr(seg.local_offset, seg.len)?;
            attached += 1;
        }
        plan.push(seg);
    }
    let mut pieces = Vec::with_capacity(attached);
    let mut of_piece = Vec::with_capacity(attached);
    for seg in plan.iter() {
        let (l, r) = lookup(seg)?;
        match (&r.reach, t.op) {
            // Host memory by memcpy; GPU memory (either side) by the
            // driver, through pinned staging buffers, every stream
            // synchronized before the call returns.
            (Reach::Mapped(m), Op::Write) => crate::gpu::staging::copy_between(
                l,
                seg.local_offset,
                m,
                seg.remote_offset,
                seg.len,
            )
            .map_err(|e| driver_fault(e, t, seg))?,
            (Reach::Mapped(m), Op::Read) => crate::gpu::staging::copy_between(
                m,
                seg.remote_offset,
                l,
                seg.local_offset,
                seg.len,
            )
            .map_err(|e| driver_fault(e, t, seg))?,
            (Reach::Attached(addr), _) => {
                pieces.push(sys::Piece {
                    local: l,
                    offset: seg.local_offset,
                    // Inside the grant (checked above), whose end does not
                    // wrap (checked when it was granted).
                    remote: addr + seg.remote_offset,
                    len: seg.len,
                });
                of_piece.push(seg);
            }
        }
    }
    if pieces.is_empty() {
        return Ok(());
    }
    let copied = sys::cross_copy(conn.pid, t.op == Op::Write, &pieces);
    copied.map_err(|f| {
        let seg = of_piece[f.piece];
        if f.error.raw_os_error() == Some(libc::ESRCH) {
            return DataError::PeerLost {
                peer: t.peer,
                reason: "its process is gone (cross-memory attach: ESRCH)",
                source: Some(std::sync::Arc::new(f.error)),
            };
        }
        DataError::RemoteMemoryFault {
            backend: "shm",
            peer: t.peer,
            op: t.op,
            key: seg.key,
            offset: seg.remote_offset + f.done,
            reason: attach_refusal(conn.pid, &f.error),
        }
    })
}

/// A GPU driver's failure while copying `seg`, as an error that names the
/// peer, the region's key and the offset (the device and the call are in
/// the reason).
fn driver_fault(e: DataError, t: &Transfer, seg: &Segment) -> DataError {
    match e {
        DataError::Gpu(g) => DataError::RemoteMemoryFault {
            backend: "shm",
            peer: t.peer,
            op: t.op,
            key: seg.key,
            offset: seg.remote_offset,
            reason: format!("the GPU driver failed to copy {} bytes: {g}", seg.len),
        },
        other => other,
    }
}
