//! Output waiting for a non-blocking socket, shared by both sides: the
//! target's answers ([`ServeConn`](super::serve::ServeConn)) and the
//! initiator's requests ([`Stream`](super::stream::Stream)).
//!
//! Headers and small payloads are copied into buffers of up to
//! [`IO_BUF`] bytes; larger host payloads are referenced in region memory
//! and go from there to the socket (`writev`, no user-space copy); GPU
//! payloads are staged out (pinned chunks) into a buffer when queued.

use super::io::{DIRECT_MIN, IO_BUF};
use crate::memory::{send_vectored, IoPart, Region};
use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::AsFd;

/// Answers' payloads below this are copied into the output buffer with
/// their header (one `writev` slice); larger ones are sent from region
/// memory.
const COPY_MAX: u64 = DIRECT_MIN as u64;

/// Most slices gathered into one `writev` of answers.
const MAX_SLICES: usize = 64;

/// Requests' payloads below this are copied, larger ones referenced, and
/// up to this many slices go into one `writev`: what the blocking
/// initiator's [`FrameWriter`](super::io::FrameWriter) did. Measured on
/// the shared 2-core host (`examples/tcp_bench --block 4096 --op write`,
/// load ~6.5, three runs each): 0.77/0.73/0.94 ms per batch of 128 with
/// these limits, 0.93/0.95/1.16 ms with the answers' (copied, 64 slices).
const REQUEST_COPY_MAX: u64 = super::io::COPY_MAX;
const REQUEST_SLICES: usize = super::io::MAX_SEGS;

/// What a connection reads from and writes to: a socket, or the fuzz
/// target's in-memory stream. Region memory is reached only through
/// `Region`'s own socket I/O and copies.
pub(crate) trait Sock {
    /// Reads into `buf`.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Reads at most `len` bytes into `region` at `offset` (checked).
    fn read_into(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<usize>;
    /// Writes some of `parts` (one `writev`).
    fn write_parts(&mut self, parts: &[IoPart<'_>]) -> io::Result<usize>;
}

/// Sockets: the target's (`mio`) and the initiator's (non-blocking std
/// sockets, owned by their [`PeerConn`](super::initiator::PeerConn), which
/// aborts them on failure, and driven through a shared reference).
impl<T: Read + AsFd> Sock for T {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Read::read(self, buf)
    }

    fn read_into(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<usize> {
        region.recv_from(offset, len, self.as_fd())
    }

    fn write_parts(&mut self, parts: &[IoPart<'_>]) -> io::Result<usize> {
        send_vectored(self.as_fd(), parts)
    }
}

/// One queued piece of output.
enum Out {
    Buf(Vec<u8>),
    Mem(Region, u64, u64),
}

/// Output waiting for the socket.
pub(crate) struct Outq {
    segs: VecDeque<Out>,
    /// Bytes of the front segment already written.
    head: usize,
    /// Bytes queued and not yet written.
    pub(crate) bytes: usize,
    /// Payloads below this are copied.
    copy_max: u64,
    /// Most slices per `writev`.
    slices: usize,
}

impl Default for Outq {
    /// The target's answers.
    fn default() -> Self {
        Self::with_limits(COPY_MAX, MAX_SLICES)
    }
}

impl Outq {
    /// The initiator's requests.
    pub(crate) fn requests() -> Self {
        Self::with_limits(REQUEST_COPY_MAX, REQUEST_SLICES)
    }

    fn with_limits(copy_max: u64, slices: usize) -> Self {
        Self {
            segs: VecDeque::new(),
            head: 0,
            bytes: 0,
            copy_max: copy_max.min(COPY_MAX),
            slices,
        }
    }

    /// Queues a copy of `b`.
    pub(crate) fn put(&mut self, b: &[u8]) {
        self.bytes += b.len();
        if let Some(Out::Buf(v)) = self.segs.back_mut() {
            if v.len() + b.len() <= IO_BUF {
                v.extend_from_slice(b);
                return;
            }
        }
        let mut v = Vec::with_capacity(b.len().max(4096));
        v.extend_from_slice(b);
        self.segs.push_back(Out::Buf(v));
    }

    /// Queues `len` bytes of `region` from `offset`.
    pub(crate) fn region(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<()> {
        if region.device().is_some() {
            // GPU memory: staged out into the output buffer (no socket I/O
            // straight from device memory).
            region.check_range(offset, len).map_err(io::Error::other)?;
            let mut v = vec![0u8; len as usize];
            region.copy_out(offset, &mut v).map_err(io::Error::other)?;
            self.bytes = self.bytes.saturating_add(v.len());
            self.segs.push_back(Out::Buf(v));
            return Ok(());
        }
        if len < self.copy_max {
            // `len` < 16 KiB (checked against the region by `read`).
            let mut tmp = [0u8; COPY_MAX as usize];
            let tmp = &mut tmp[..len as usize];
            region.read(offset, tmp).map_err(io::Error::other)?;
            self.put(tmp);
            return Ok(());
        }
        self.bytes = self
            .bytes
            .saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
        self.segs.push_back(Out::Mem(region.clone(), offset, len));
        Ok(())
    }

    /// Writes until done or the socket would block; `Ok(true)` when empty.
    pub(crate) fn flush<S: Sock>(&mut self, s: &mut S) -> io::Result<bool> {
        while !self.segs.is_empty() {
            let n = match self.write_some(s) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            };
            self.advance(n);
        }
        Ok(true)
    }

    /// One `writev` of the leading segments.
    fn write_some<S: Sock>(&self, s: &mut S) -> io::Result<usize> {
        let mut parts: Vec<IoPart<'_>> = Vec::with_capacity(self.slices.min(self.segs.len()));
        let mut skip = self.head;
        for seg in self.segs.iter().take(self.slices) {
            parts.push(match seg {
                Out::Buf(v) => IoPart::Bytes(&v[skip..]),
                Out::Mem(region, off, len) => {
                    IoPart::Region(region, off + skip as u64, len - skip as u64)
                }
            });
            skip = 0;
        }
        s.write_parts(&parts)
    }

    fn advance(&mut self, mut n: usize) {
        self.bytes -= n.min(self.bytes);
        while n > 0 {
            let Some(front) = self.segs.front() else {
                return;
            };
            let len = match front {
                Out::Buf(v) => v.len(),
                Out::Mem(_, _, len) => usize::try_from(*len).unwrap_or(usize::MAX),
            } - self.head;
            if n < len {
                self.head += n;
                return;
            }
            n -= len;
            self.head = 0;
            self.segs.pop_front();
        }
    }
}
