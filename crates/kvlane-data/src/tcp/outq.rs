//! Output waiting for a non-blocking socket, shared by both sides: the
//! target's answers ([`ServeConn`](super::serve::ServeConn)) and the
//! initiator's requests ([`Stream`](super::stream::Stream)).
//!
//! Headers and small payloads are copied into buffers of up to
//! [`IO_BUF`] bytes; larger host payloads are referenced in region memory
//! and go from there to the socket (`writev`, no user-space copy); GPU
//! payloads are staged out (pinned chunks) a [`STAGE`] piece at a time, as
//! the socket takes them: a peer that stops reading holds at most one
//! piece of staged memory per connection, whatever length it asked for.

use super::io::{DIRECT_MIN, IO_BUF};
use super::lease::{Lease, Served};
use crate::memory::{send_vectored, IoPart, Region};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::sync::Arc;

/// Output buffers that grew to this and more are kept for reuse when
/// written ([`SPARE`]).
const SPARE_MIN: usize = 64 << 10;
/// Most buffers [`SPARE`] keeps per thread (4 MiB of [`IO_BUF`]s).
const SPARE_MAX: usize = 16;

thread_local! {
    /// Written output buffers of this thread, for the next ones. A batch
    /// of small answers used to fill a fresh buffer each time, grown by
    /// doubling to 256 KiB and freed once written: glibc handed the pages
    /// back and the next buffer faulted them in again (page faults and
    /// copies were ~8% of a 4 KiB READ run's CPU on the target side).
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer for at least `len` bytes: a spare one, or a new one.
fn new_buf(len: usize) -> Vec<u8> {
    let spare = SPARE
        .try_with(|s| s.borrow_mut().pop())
        .ok()
        .flatten()
        .filter(|v| v.capacity() >= len);
    spare.unwrap_or_else(|| Vec::with_capacity(len.max(4096)))
}

/// Keeps a written buffer for reuse if it is large and there is room.
fn recycle(mut v: Vec<u8>) {
    if v.capacity() < SPARE_MIN || v.capacity() > IO_BUF * 2 {
        return;
    }
    v.clear();
    let _ = SPARE.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARE_MAX {
            s.push(v);
        }
    });
}

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

/// Most bytes of a GPU payload staged into host memory at once.
const STAGE: u64 = 1 << 20;

/// One queued piece of output. A target's answer from region memory holds
/// a lease on it ([`Outq::leased`]) until it has left.
enum Out {
    Buf(Vec<u8>),
    Mem(Region, u64, u64, Option<Lease>),
    /// `len` bytes of GPU `region` from `offset`; `piece` holds the bytes
    /// from `at` (relative to `offset`) that are staged now.
    Staged {
        region: Region,
        offset: u64,
        len: u64,
        at: u64,
        piece: Vec<u8>,
        lease: Option<Lease>,
    },
}

impl Out {
    fn len(&self) -> usize {
        match self {
            Self::Buf(v) => v.len(),
            Self::Mem(_, _, len, _) | Self::Staged { len, .. } => {
                usize::try_from(*len).unwrap_or(usize::MAX)
            }
        }
    }
}

/// Output waiting for the socket.
pub(crate) struct Outq {
    segs: VecDeque<Out>,
    /// Bytes of the front segment already written.
    head: usize,
    /// Bytes queued and not yet written.
    pub(crate) bytes: usize,
    /// Bytes written since the queue was made: the output up to here has
    /// left (a position in the output, for [`queued`](Self::queued)).
    pub(crate) written: u64,
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
            written: 0,
            copy_max: copy_max.min(COPY_MAX),
            slices,
        }
    }

    /// The position in the output (see [`written`](Self::written)) up to
    /// which everything queued so far ends.
    pub(crate) fn queued(&self) -> u64 {
        self.written + self.bytes as u64
    }

    /// Queues a copy of `b`.
    pub(crate) fn put(&mut self, b: &[u8]) {
        self.buf_for(b.len()).extend_from_slice(b);
        self.bytes += b.len();
    }

    /// The buffer the next `len` bytes are appended to: the last one if
    /// they fit, else a new one.
    fn buf_for(&mut self, len: usize) -> &mut Vec<u8> {
        let fits = matches!(self.segs.back(), Some(Out::Buf(v)) if v.len() + len <= IO_BUF);
        if !fits {
            self.segs.push_back(Out::Buf(new_buf(len)));
        }
        match self.segs.back_mut() {
            Some(Out::Buf(v)) => v,
            // Pushed just above when the back was not a buffer.
            _ => unreachable!("the back segment is a buffer"),
        }
    }

    /// Queues `len` bytes of `region` from `offset`.
    pub(crate) fn region(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<()> {
        self.queue_region(region, offset, len, None)
    }

    /// Queues `len` bytes of the region `lease` is on, from `offset`; the
    /// lease is held until they have left (dropped at once when they are
    /// copied here).
    pub(crate) fn leased(&mut self, lease: Lease, offset: u64, len: u64) -> io::Result<()> {
        let region = lease.region().clone();
        self.queue_region(&region, offset, len, Some(lease))
    }

    /// Queued segments that hold a lease on `served`.
    pub(crate) fn leases_on(&self, served: &Arc<Served>) -> usize {
        self.segs
            .iter()
            .filter(|seg| match seg {
                Out::Mem(_, _, _, lease) | Out::Staged { lease, .. } => {
                    lease.as_ref().is_some_and(|l| l.is_on(served))
                }
                Out::Buf(_) => false,
            })
            .count()
    }

    fn queue_region(
        &mut self,
        region: &Region,
        offset: u64,
        len: u64,
        lease: Option<Lease>,
    ) -> io::Result<()> {
        if region.device().is_some() {
            // GPU memory: staged out a piece at a time when written (no
            // socket I/O straight from device memory).
            region.check_range(offset, len).map_err(io::Error::other)?;
            if len == 0 {
                // Nothing to send (an empty segment would read as a
                // zero-byte write, taken for a dead socket).
                return Ok(());
            }
            self.bytes = self
                .bytes
                .saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
            self.segs.push_back(Out::Staged {
                region: region.clone(),
                offset,
                len,
                at: 0,
                piece: Vec::new(),
                lease,
            });
            return Ok(());
        }
        if len < self.copy_max {
            // `len` < 16 KiB (checked against the region by
            // `extend_vec`, which appends nothing when it is bad): copied
            // straight into the output buffer, with no zero-fill first
            // (that memset was ~3% of a 4 KiB READ target's samples).
            let v = self.buf_for(len as usize);
            region
                .extend_vec(offset, len, v)
                .map_err(io::Error::other)?;
            self.bytes += len as usize;
            return Ok(());
        }
        self.bytes = self
            .bytes
            .saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
        self.segs
            .push_back(Out::Mem(region.clone(), offset, len, lease));
        Ok(())
    }

    /// Writes until done or the socket would block; `Ok(true)` when empty.
    pub(crate) fn flush<S: Sock>(&mut self, s: &mut S) -> io::Result<bool> {
        while !self.segs.is_empty() {
            self.stage_front()?;
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

    /// Stages the next piece of a GPU payload at the front once the
    /// socket has taken the previous one (the bytes from `head` on).
    fn stage_front(&mut self) -> io::Result<()> {
        let head = self.head as u64;
        let Some(Out::Staged {
            region,
            offset,
            len,
            at,
            piece,
            ..
        }) = self.segs.front_mut()
        else {
            return Ok(());
        };
        if head < *at + piece.len() as u64 {
            return Ok(());
        }
        let n = (*len - head).min(STAGE) as usize;
        piece.clear();
        piece.resize(n, 0);
        region
            .copy_out(*offset + head, piece)
            .map_err(io::Error::other)?;
        *at = head;
        Ok(())
    }

    /// One `writev` of the leading segments (a GPU payload goes as far as
    /// its staged piece; one behind the front waits for its turn there).
    fn write_some<S: Sock>(&self, s: &mut S) -> io::Result<usize> {
        let mut parts: Vec<IoPart<'_>> = Vec::with_capacity(self.slices.min(self.segs.len()));
        let mut skip = self.head;
        for (i, seg) in self.segs.iter().take(self.slices).enumerate() {
            parts.push(match seg {
                Out::Buf(v) => IoPart::Bytes(&v[skip..]),
                Out::Mem(region, off, len, _) => {
                    IoPart::Region(region, off + skip as u64, len - skip as u64)
                }
                Out::Staged { .. } if i > 0 => break,
                Out::Staged { at, piece, len, .. } => {
                    let from = skip - *at as usize;
                    parts.push(IoPart::Bytes(&piece[from..]));
                    if *at + (piece.len() as u64) < *len {
                        // More of it is to be staged first.
                        break;
                    }
                    skip = 0;
                    continue;
                }
            });
            skip = 0;
        }
        s.write_parts(&parts)
    }

    fn advance(&mut self, mut n: usize) {
        self.bytes -= n.min(self.bytes);
        self.written += n as u64;
        while n > 0 {
            let Some(front) = self.segs.front() else {
                return;
            };
            let len = front.len() - self.head;
            if n < len {
                self.head += n;
                return;
            }
            n -= len;
            self.head = 0;
            if let Some(Out::Buf(v)) = self.segs.pop_front() {
                recycle(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Access;

    /// Takes at most 1,000 bytes per write (short writes), keeping them.
    #[derive(Default)]
    struct Sink(Vec<u8>);

    impl Sock for Sink {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Ok(0)
        }
        fn read_into(&mut self, _: &Region, _: u64, _: u64) -> io::Result<usize> {
            Ok(0)
        }
        fn write_parts(&mut self, parts: &[IoPart<'_>]) -> io::Result<usize> {
            let mut left = 1000usize;
            for p in parts {
                let n = (p.len() as usize).min(left);
                match p {
                    IoPart::Bytes(b) => self.0.extend_from_slice(&b[..n]),
                    IoPart::Region(r, off, _) => {
                        let mut v = vec![0u8; n];
                        r.read(*off, &mut v).map_err(io::Error::other)?;
                        self.0.extend_from_slice(&v);
                    }
                }
                left -= n;
                if left == 0 {
                    break;
                }
            }
            Ok(1000 - left)
        }
    }

    /// Queues `n` headers and 4 KiB answers of `region`, flushes them
    /// through short writes, and returns what reached the socket.
    fn round(region: &Region, n: u64) -> (Vec<u8>, Vec<u8>) {
        let mut q = Outq::default();
        let mut want = Vec::new();
        for i in 0..n {
            let header = [i as u8; 9];
            q.put(&header);
            want.extend_from_slice(&header);
            q.region(region, i * 4096, 4096).unwrap();
            let mut block = vec![0u8; 4096];
            region.read(i * 4096, &mut block).unwrap();
            want.extend_from_slice(&block);
        }
        assert_eq!(q.bytes, want.len());
        let mut sink = Sink::default();
        assert!(q.flush(&mut sink).unwrap());
        assert_eq!(q.bytes, 0);
        (sink.0, want)
    }

    #[test]
    fn recycled_buffers_carry_only_new_output() {
        let a = Region::from_vec((0..100u32 << 12).map(|i| i as u8).collect(), Access::ALL);
        let b = Region::from_vec(vec![0xEE; 100 << 12], Access::ALL);
        let (a, b) = (a.unwrap(), b.unwrap());
        // 100 answers of 4 KiB fill two buffers, kept when written.
        let (got, want) = round(&a, 100);
        assert!(got == want, "first round's output differs");
        let kept = SPARE.with(|s| s.borrow().len());
        assert!(kept >= 1, "no written buffer was kept");
        // Fewer, different answers into the kept buffers: nothing of the
        // first round shows.
        let (got, want) = round(&b, 30);
        assert!(got == want, "second round's output differs");
        assert!(SPARE.with(|s| s.borrow().len()) <= SPARE_MAX);
    }

    #[test]
    fn a_small_answer_outside_its_region_queues_nothing() {
        let r = Region::from_vec(vec![1; 4096], Access::ALL).unwrap();
        let mut q = Outq::default();
        q.put(b"header");
        assert!(q.region(&r, 4000, 200).is_err());
        assert_eq!(q.bytes, 6);
        let mut sink = Sink::default();
        assert!(q.flush(&mut sink).unwrap());
        assert_eq!(sink.0, b"header");
    }
}
