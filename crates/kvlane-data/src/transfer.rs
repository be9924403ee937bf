//! Transfers: what to move, where, and how it ended.

use crate::error::DataError;
use crate::ids::{PeerId, RegionId, RemoteKey, TransferId};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt;
use std::time::{Duration, Instant};

/// Direction of a one-sided transfer, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Remote memory → local memory.
    Read,
    /// Local memory → remote memory.
    Write,
}

impl Op {
    /// The remote right this operation needs on the target's region (the
    /// one place that maps operations to rights).
    pub(crate) fn remote_access(self) -> crate::memory::Access {
        match self {
            Self::Read => crate::memory::Access::REMOTE_READ,
            Self::Write => crate::memory::Access::REMOTE_WRITE,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Read => "READ",
            Self::Write => "WRITE",
        })
    }
}

/// A span of a local region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// The registered region.
    pub region: RegionId,
    /// Byte offset inside the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A span of a region a peer advertised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteDescriptor {
    /// The key the peer serves the region under.
    pub key: RemoteKey,
    /// Byte offset inside the remote region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The local spans of a transfer: one span is held inline (no allocation
/// per transfer), more spill to the heap. Build it from a `Vec`, an array
/// of one or the re-exported [`smallvec!`](crate::smallvec) macro.
pub type Descriptors = SmallVec<[Descriptor; 1]>;

/// The remote spans of a transfer, held like [`Descriptors`].
pub type RemoteDescriptors = SmallVec<[RemoteDescriptor; 1]>;

/// Default deadline of a transfer, from its creation.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

/// One transfer: local and remote descriptor lists that cover the same
/// number of bytes (paired in order, like scatter-gather lists), an
/// operation, an optional notification and a deadline.
#[derive(Clone, Debug)]
pub struct Transfer {
    /// Caller-chosen id; completions carry it.
    pub id: TransferId,
    /// The target.
    pub peer: PeerId,
    /// READ or WRITE.
    pub op: Op,
    /// Local spans.
    pub local: Descriptors,
    /// Remote spans.
    pub remote: RemoteDescriptors,
    /// Delivered to the target once every byte of the transfer has landed.
    pub notify: Option<Bytes>,
    /// When the transfer fails with [`DataError::Timeout`] if not done.
    pub deadline: Instant,
}

impl Transfer {
    /// A transfer with a fresh id and the [`DEFAULT_DEADLINE`].
    pub fn new(
        peer: PeerId,
        op: Op,
        local: impl Into<Descriptors>,
        remote: impl Into<RemoteDescriptors>,
    ) -> Self {
        Self::due(peer, op, local, remote, Instant::now() + DEFAULT_DEADLINE)
    }

    /// A transfer with a fresh id that fails with [`DataError::Timeout`]
    /// if not done by `deadline` ([`new`](Self::new) then
    /// [`with_deadline`](Self::with_deadline), without a clock read for the
    /// default deadline that is replaced).
    pub fn due(
        peer: PeerId,
        op: Op,
        local: impl Into<Descriptors>,
        remote: impl Into<RemoteDescriptors>,
        deadline: Instant,
    ) -> Self {
        Self {
            id: TransferId::next(),
            peer,
            op,
            local: local.into(),
            remote: remote.into(),
            notify: None,
            deadline,
        }
    }

    /// Sets the notification payload.
    pub fn with_notify(mut self, payload: impl Into<Bytes>) -> Self {
        self.notify = Some(payload.into());
        self
    }

    /// Sets the deadline.
    pub fn with_deadline(mut self, deadline: Instant) -> Self {
        self.deadline = deadline;
        self
    }

    /// Sets the id.
    pub fn with_id(mut self, id: TransferId) -> Self {
        self.id = id;
        self
    }

    /// Total payload bytes.
    pub fn total_len(&self) -> u64 {
        self.local.iter().map(|d| d.len).sum()
    }

    /// Checks that both lists cover the same number of bytes.
    pub fn check_lengths(&self) -> Result<u64, DataError> {
        let local: u64 = self.local.iter().map(|d| d.len).sum();
        let remote: u64 = self.remote.iter().map(|d| d.len).sum();
        if local == remote {
            Ok(local)
        } else {
            Err(DataError::LengthMismatch { local, remote })
        }
    }

    /// The transfer as pieces that are contiguous on both sides, pairing the
    /// two lists in order. Zero-length descriptors are skipped.
    pub fn segments(&self) -> Result<Segments<'_>, DataError> {
        self.check_lengths()?;
        Ok(self.checked_segments())
    }

    /// [`segments`](Self::segments) of a transfer whose lengths the caller
    /// has already checked ([`check_lengths`](Self::check_lengths)).
    pub(crate) fn checked_segments(&self) -> Segments<'_> {
        Segments {
            local: &self.local,
            remote: &self.remote,
            li: 0,
            ri: 0,
            lo: 0,
            ro: 0,
        }
    }
}

/// A piece of a transfer that is contiguous locally and remotely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Local region.
    pub region: RegionId,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Remote key.
    pub key: RemoteKey,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Length in bytes (never zero).
    pub len: u64,
}

/// Iterator returned by [`Transfer::segments`].
#[derive(Debug)]
pub struct Segments<'a> {
    local: &'a [Descriptor],
    remote: &'a [RemoteDescriptor],
    li: usize,
    ri: usize,
    lo: u64,
    ro: u64,
}

impl Iterator for Segments<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        loop {
            let l = self.local.get(self.li)?;
            let r = self.remote.get(self.ri)?;
            let (lrest, rrest) = (l.len - self.lo, r.len - self.ro);
            if lrest == 0 {
                self.li += 1;
                self.lo = 0;
                continue;
            }
            if rrest == 0 {
                self.ri += 1;
                self.ro = 0;
                continue;
            }
            let len = lrest.min(rrest);
            let seg = Segment {
                region: l.region,
                local_offset: l.offset + self.lo,
                key: r.key,
                remote_offset: r.offset + self.ro,
                len,
            };
            self.lo += len;
            self.ro += len;
            return Some(seg);
        }
    }
}

/// How a submitted transfer ended.
#[derive(Debug)]
pub struct Completion {
    /// The transfer.
    pub id: TransferId,
    /// Its target.
    pub peer: PeerId,
    /// `Ok` once every byte landed (and the notification, if any, was
    /// delivered); otherwise why not.
    pub result: Result<(), DataError>,
}

impl Completion {
    /// Takes `peer`'s transfers out of `queue` (not started yet) and fails
    /// each into `failed` with `PeerLost` ("peer removed"): what a backend
    /// whose queue holds transfers until its poll does on `remove_peer`.
    pub(crate) fn fail_removed(
        queue: &mut std::collections::VecDeque<Transfer>,
        failed: &mut std::collections::VecDeque<Self>,
        peer: PeerId,
    ) {
        let (lost, kept): (std::collections::VecDeque<_>, _) =
            queue.drain(..).partition(|t| t.peer == peer);
        *queue = kept;
        failed.extend(lost.into_iter().map(|t| Self {
            id: t.id,
            peer,
            result: Err(DataError::PeerLost {
                peer,
                reason: "peer removed",
                source: None,
            }),
        }));
    }
}

/// A notification that arrived at this (target) side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The payload the initiator attached to its transfer.
    pub payload: Bytes,
    /// The peer it came from as this side knows it: the peer whose
    /// credential the connection presented (tcp) or whose queue pair it
    /// arrived on (verbs). `None` where the backend cannot tell (loopback).
    pub from: Option<PeerId>,
}

/// Which backend an endpoint or region belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// In-process memcpy.
    Loopback,
    /// Software one-sided RDMA over TCP.
    Tcp,
    /// libibverbs.
    Verbs,
    /// Shared memory between processes of one host.
    Shm,
}

impl BackendKind {
    /// Lowercase name, as used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Loopback => "loopback",
            Self::Tcp => "tcp",
            Self::Verbs => "verbs",
            Self::Shm => "shm",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a peer reaches this backend, carried in the control-plane handshake.
/// `data` is backend-specific (msgpack for tcp and verbs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The backend that produced it.
    pub backend: BackendKind,
    /// Backend-specific bytes.
    #[serde(with = "serde_bytes_compat")]
    pub data: Vec<u8>,
}

impl Endpoint {
    /// This endpoint as dialed by a peer that reached this endpoint's
    /// owner's control plane at `host`: a tcp endpoint advertised on a
    /// wildcard address gets `host`, and one that `host`'s side cannot
    /// reach fails with [`DataError::Unreachable`] naming both addresses
    /// ([`TcpEndpoint::reached_at`](crate::TcpEndpoint::reached_at)).
    /// Other backends' endpoints do not carry an IP address and are
    /// returned as they are.
    pub fn reached_at(&self, host: Option<std::net::IpAddr>) -> Result<Self, DataError> {
        #[cfg(target_os = "linux")]
        if let Some(r) = crate::samehost::map_other(self, |other| other.reached_at(host)) {
            return r;
        }
        if let Some(r) = crate::rails::map_rails(self, |rail| rail.reached_at(host)) {
            return r;
        }
        match self.backend {
            BackendKind::Tcp => Ok(crate::tcp::TcpEndpoint::from_endpoint(self)?
                .reached_at(host)?
                .to_endpoint()),
            _ => Ok(self.clone()),
        }
    }
}

/// Serializes `Vec<u8>` as a msgpack bin (not an array of integers).
mod serde_bytes_compat {
    use serde::{Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::new();
                while let Some(b) = a.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(region: u64, offset: u64, len: u64) -> Descriptor {
        Descriptor {
            region: RegionId(region),
            offset,
            len,
        }
    }
    fn r(key: u32, offset: u64, len: u64) -> RemoteDescriptor {
        RemoteDescriptor {
            key: RemoteKey(key),
            offset,
            len,
        }
    }

    #[test]
    fn segments_pair_lists_of_different_shapes() {
        let t = Transfer::new(
            PeerId(1),
            Op::Write,
            vec![d(1, 0, 10), d(2, 100, 0), d(2, 100, 6)],
            vec![r(9, 50, 4), r(8, 0, 12)],
        );
        let segs: Vec<_> = t.segments().unwrap().collect();
        let flat: Vec<_> = segs
            .iter()
            .map(|s| (s.region.0, s.local_offset, s.key.0, s.remote_offset, s.len))
            .collect();
        assert_eq!(
            flat,
            vec![(1, 0, 9, 50, 4), (1, 4, 8, 0, 6), (2, 100, 8, 6, 6)]
        );
    }

    #[test]
    fn one_span_is_held_inline_and_more_spill() {
        let one = Transfer::new(PeerId(1), Op::Read, vec![d(1, 0, 8)], [r(2, 0, 8)]);
        assert!(!one.local.spilled() && !one.remote.spilled());
        let two = Transfer::new(
            PeerId(1),
            Op::Read,
            vec![d(1, 0, 8), d(1, 16, 8)],
            vec![r(2, 0, 16)],
        );
        assert!(two.local.spilled() && !two.remote.spilled());
        assert_eq!(two.check_lengths().unwrap(), 16);
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        let t = Transfer::new(PeerId(1), Op::Read, vec![d(1, 0, 10)], vec![r(1, 0, 9)]);
        let err = t.segments().unwrap_err();
        assert!(
            matches!(
                err,
                DataError::LengthMismatch {
                    local: 10,
                    remote: 9
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn endpoint_roundtrips_as_msgpack_bin() {
        let e = Endpoint {
            backend: BackendKind::Tcp,
            data: vec![1, 2, 3],
        };
        let bytes = rmp_serde::to_vec_named(&e).unwrap();
        // 0xc4 = bin8: the payload is a byte string, not an array.
        assert!(bytes.windows(2).any(|w| w == [0xc4, 3]));
        let back: Endpoint = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, e);
    }
}
