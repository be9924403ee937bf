//! Span-level transfers: arbitrary `(address, length)` spans of registered
//! memory, for callers that move memory regions rather than KV blocks
//! (NIXL-style descriptor lists). Local spans are resolved against the
//! agent's registrations (KV caches and plain regions), remote spans
//! against what the peer advertised in its handshake; each pair must have
//! the same length, every span must lie inside one registration with the
//! rights its side needs, and runs contiguous on both sides are merged.

use crate::error::{Error, ErrorKind};
use kvlane_data::{
    Access, Descriptor, Descriptors, Op, Region, RemoteDescriptor, RemoteDescriptors, RemoteRegion,
};

/// A span of memory by address: `addr..addr + len` in the address space of
/// the side it names (this process for local spans, the peer's for remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemSpan {
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes (not zero).
    pub len: u64,
}

impl MemSpan {
    /// The span `addr..addr + len`.
    pub fn new(addr: u64, len: u64) -> Self {
        Self { addr, len }
    }
}

fn invalid(msg: String) -> Error {
    Error::msg(ErrorKind::InvalidInput, msg)
}

/// Registrations a side holds at most before the lookup sorts them
/// (below it a linear scan, no allocation: the common case is a KV cache
/// and a few regions).
const SCAN_MAX: usize = 16;

/// Index into `bases` (`(addr, len)` of each registration, in any order)
/// of the registration holding `s`, or an error naming the span and
/// `side`.
fn locate(bases: &Bases, s: MemSpan, side: &str, i: usize) -> Result<usize, Error> {
    if s.len == 0 {
        return Err(invalid(format!(
            "{side} span {i} at {:#x} is empty",
            s.addr
        )));
    }
    let inside = |&(addr, len): &(u64, u64)| {
        addr <= s.addr
            && s.addr
                .checked_add(s.len)
                .is_some_and(|end| end <= addr.saturating_add(len))
    };
    let found = match bases {
        Bases::Few(b) => b.iter().position(inside),
        Bases::Sorted(b, order) => {
            let at = b.partition_point(|&(addr, _)| addr <= s.addr);
            at.checked_sub(1)
                .filter(|&k| inside(&b[k]))
                .map(|k| order[k])
        }
    };
    found.ok_or_else(|| {
        invalid(format!(
            "{side} span {i} ({:#x}, {} bytes) lies outside every {side} registration",
            s.addr, s.len
        ))
    })
}

/// The registrations of one side, as `locate` searches them. It lives on
/// the stack for one call: boxing the inline variant would bring back the
/// allocation it exists to avoid.
#[allow(clippy::large_enum_variant)]
enum Bases {
    /// Few: in their own order, scanned.
    Few(kvlane_data::SmallVec<[(u64, u64); SCAN_MAX]>),
    /// Many: sorted by address, with each one's index in the caller's order.
    Sorted(Vec<(u64, u64)>, Vec<usize>),
}

impl Bases {
    fn new(it: impl ExactSizeIterator<Item = (u64, u64)>) -> Self {
        if it.len() <= SCAN_MAX {
            return Self::Few(it.collect());
        }
        let mut v: Vec<(usize, (u64, u64))> = it.enumerate().collect();
        v.sort_by_key(|(_, (addr, _))| *addr);
        let order = v.iter().map(|(i, _)| *i).collect();
        Self::Sorted(v.into_iter().map(|(_, b)| b).collect(), order)
    }
}

/// Resolves local spans against `regions`; `op` decides the right needed
/// (a READ writes into local memory).
pub(crate) fn resolve_local(
    regions: &[&Region],
    spans: &[MemSpan],
    op: Op,
) -> Result<Vec<Descriptor>, Error> {
    let bases = Bases::new(regions.iter().map(|r| (r.addr(), r.len())));
    spans
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let r = regions[locate(&bases, s, "local", i)?];
            if op == Op::Read && !r.access().contains(Access::LOCAL_WRITE) {
                return Err(Error::msg(
                    ErrorKind::Refused,
                    format!(
                        "local span {i} ({:#x}, {} bytes) is in {}, which is registered \
                         read-only: it cannot be the destination of a READ",
                        s.addr,
                        s.len,
                        r.id()
                    ),
                ));
            }
            Ok(Descriptor {
                region: r.id(),
                offset: s.addr - r.addr(),
                len: s.len,
            })
        })
        .collect()
}

/// Resolves remote spans against the regions the peer advertised; `peer`
/// names it in errors (formatted only then).
pub(crate) fn resolve_remote(
    advertised: &[RemoteRegion],
    spans: &[MemSpan],
    op: Op,
    peer: impl std::fmt::Display,
) -> Result<Vec<RemoteDescriptor>, Error> {
    let bases = Bases::new(advertised.iter().map(|r| (r.addr, r.len)));
    let needed = match op {
        Op::Read => Access::REMOTE_READ,
        Op::Write => Access::REMOTE_WRITE,
    };
    spans
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let k = locate(&bases, s, "remote", i)
                .map_err(|e| invalid(format!("{e} (of the regions {peer} advertised)")))?;
            let r = advertised[k];
            if !r.access.contains(needed) {
                return Err(Error::msg(
                    ErrorKind::Refused,
                    format!(
                        "remote span {i} ({:#x}, {} bytes): {peer} does not grant {op} on it \
                         (it grants {})",
                        s.addr, s.len, r.access
                    ),
                ));
            }
            Ok(RemoteDescriptor {
                key: r.key,
                offset: s.addr - r.addr,
                len: s.len,
            })
        })
        .collect()
}

/// Pairs resolved spans (equal lengths pair by pair) and merges runs that
/// are contiguous on both sides.
pub(crate) fn pair(
    local: Vec<Descriptor>,
    remote: Vec<RemoteDescriptor>,
) -> Result<(Descriptors, RemoteDescriptors), Error> {
    if local.len() != remote.len() {
        return Err(invalid(format!(
            "{} local spans but {} remote spans: the lists pair one to one",
            local.len(),
            remote.len()
        )));
    }
    let mut l = Descriptors::with_capacity(local.len());
    let mut r = RemoteDescriptors::with_capacity(remote.len());
    for (i, (ld, rd)) in local.into_iter().zip(remote).enumerate() {
        if ld.len != rd.len {
            return Err(invalid(format!(
                "span pair {i}: the local span has {} bytes, the remote one {}",
                ld.len, rd.len
            )));
        }
        if let (Some(pl), Some(pr)) = (l.last_mut(), r.last_mut()) {
            let (pl, pr): (&mut Descriptor, &mut RemoteDescriptor) = (pl, pr);
            if pl.region == ld.region
                && pr.key == rd.key
                && pl.offset + pl.len == ld.offset
                && pr.offset + pr.len == rd.offset
            {
                pl.len += ld.len;
                pr.len += rd.len;
                continue;
            }
        }
        l.push(ld);
        r.push(rd);
    }
    Ok((l, r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlane_data::RemoteKey;

    fn remote(addr: u64, len: u64, access: Access) -> RemoteRegion {
        RemoteRegion {
            key: RemoteKey(addr as u32),
            addr,
            len,
            access,
        }
    }

    #[test]
    fn spans_resolve_inside_registrations_and_merge_contiguous_runs() {
        let a = Region::alloc(8192, Access::ALL).unwrap();
        let base = a.addr();
        let local = resolve_local(
            &[&a],
            &[MemSpan::new(base, 4096), MemSpan::new(base + 4096, 4096)],
            Op::Write,
        )
        .unwrap();
        let regions = [remote(0x10_0000, 1 << 20, Access::ALL)];
        let remote = resolve_remote(
            &regions,
            &[MemSpan::new(0x10_0000, 4096), MemSpan::new(0x10_1000, 4096)],
            Op::Write,
            "peer",
        )
        .unwrap();
        let (l, r) = pair(local, remote).unwrap();
        assert_eq!(
            (l.len(), l[0].len, r[0].len, r[0].offset),
            (1, 8192, 8192, 0)
        );
    }

    #[test]
    fn spans_outside_registrations_wrong_rights_and_mismatched_lengths_are_refused() {
        let a = Region::alloc(4096, Access::REMOTE_READ).unwrap();
        let e = resolve_local(&[&a], &[MemSpan::new(a.addr() + 4000, 200)], Op::Write).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(
            e.to_string().contains("outside every local registration"),
            "{e}"
        );
        let e = resolve_local(&[&a], &[MemSpan::new(a.addr(), 16)], Op::Read).unwrap_err();
        assert!(e.to_string().contains("read-only"), "{e}");
        let regions = [remote(0x1000, 4096, Access::REMOTE_READ)];
        let e = resolve_remote(&regions, &[MemSpan::new(0x1000, 16)], Op::Write, "p").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused);
        let e = resolve_remote(&regions, &[MemSpan::new(0x10, 16)], Op::Read, "p").unwrap_err();
        assert!(e.to_string().contains("advertised"), "{e}");
        let local = resolve_local(&[&a], &[MemSpan::new(a.addr(), 16)], Op::Write).unwrap();
        let remote = resolve_remote(&regions, &[MemSpan::new(0x1000, 32)], Op::Read, "p").unwrap();
        let e = pair(local, remote).unwrap_err();
        assert!(e.to_string().contains("span pair 0"), "{e}");
    }

    /// Few registrations are scanned, many are searched sorted: the same
    /// answers either way, whatever order the registrations come in.
    #[test]
    fn many_and_few_registrations_resolve_alike() {
        for n in [3u64, 16, 17, 40] {
            // Out of address order: descending, with gaps between them.
            let regions: Vec<RemoteRegion> = (0..n)
                .rev()
                .map(|k| remote(0x10_0000 + k * 0x2000, 0x1000, Access::ALL))
                .collect();
            for k in 0..n {
                let addr = 0x10_0000 + k * 0x2000;
                let r = resolve_remote(&regions, &[MemSpan::new(addr + 16, 64)], Op::Read, "p")
                    .unwrap_or_else(|e| panic!("{n} regions, region {k}: {e}"));
                assert_eq!((r[0].key, r[0].offset), (RemoteKey(addr as u32), 16));
                // The gap after each region, and a span running past its end.
                for bad in [
                    MemSpan::new(addr + 0x1000, 8),
                    MemSpan::new(addr + 0xff0, 32),
                ] {
                    let e = resolve_remote(&regions, &[bad], Op::Read, "p").unwrap_err();
                    assert!(e.to_string().contains("outside every remote"), "{n}: {e}");
                }
            }
            let below = resolve_remote(&regions, &[MemSpan::new(0x1000, 8)], Op::Read, "p");
            assert!(below.is_err(), "{n} regions: a span below all of them");
        }
    }
}
