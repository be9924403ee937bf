//! Framed socket I/O on blocking sockets ([`FrameReader`], [`FrameWriter`],
//! for baselines such as `kvlane bench`'s raw-tcp ceiling; the backend's
//! own non-blocking I/O is in `outq`, `serve` and `stream`, with the same
//! thresholds from here): headers are batched through a small buffer,
//! large payloads move between the socket and region memory without an
//! intermediate copy. Also the socket settings both sides apply.

use crate::memory::{send_vectored, IoPart, Region};
use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;

/// Payloads at least this large bypass the buffers (moved straight
/// between the socket and region memory); smaller ones are copied, which
/// is cheaper than a syscall each.
pub(crate) const DIRECT_MIN: usize = 16 << 10;

/// Buffer size of [`FrameReader`] and of the senders' coalescing buffers.
pub(crate) const IO_BUF: usize = 256 << 10;

/// Reads headers and payloads from a stream.
///
/// While payloads are small, reads fill a buffer, so one syscall brings in
/// many frames. After a large payload the next header is read on its own
/// when nothing is buffered, so the following large payload is not pulled
/// into the buffer and copied twice.
#[derive(Debug)]
pub struct FrameReader<'a> {
    rd: BufReader<&'a TcpStream>,
    direct: bool,
}

impl<'a> FrameReader<'a> {
    /// Reads from `stream` through a buffer of its own.
    pub fn new(stream: &'a TcpStream) -> Self {
        Self {
            rd: BufReader::with_capacity(IO_BUF, stream),
            direct: false,
        }
    }

    /// Whether nothing is buffered (the next read may block).
    pub fn is_drained(&self) -> bool {
        self.rd.buffer().is_empty()
    }

    /// Whether the next read would block: nothing buffered and nothing
    /// (not even an end of stream) waiting on the socket. A server flushes
    /// its gathered answers then, not after every request.
    pub fn would_block(&self) -> bool {
        self.is_drained() && !readable_now(self.rd.get_ref())
    }

    /// Reads exactly `dst.len()` header bytes. `UnexpectedEof` when the
    /// peer closed before the first byte or mid-header.
    pub fn header(&mut self, dst: &mut [u8]) -> io::Result<()> {
        if self.direct && self.is_drained() {
            self.rd.get_mut().read_exact(dst)
        } else {
            self.rd.read_exact(dst)
        }
    }

    /// Reads exactly `dst.len()` payload bytes.
    pub fn payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let buffered = self.rd.buffer();
        let n = buffered.len().min(dst.len());
        dst[..n].copy_from_slice(&buffered[..n]);
        self.rd.consume(n);
        self.direct = dst.len() >= DIRECT_MIN;
        let rest = &mut dst[n..];
        if rest.is_empty() {
            Ok(())
        } else if self.direct {
            // The buffer is empty here, so bypassing it keeps the order.
            self.rd.get_mut().read_exact(rest)
        } else {
            self.rd.read_exact(rest)
        }
    }

    /// Reads exactly `len` payload bytes into `region` from `offset`:
    /// buffered bytes are copied in, the rest is read from the socket
    /// straight into region memory ([`Region::recv_from`]) once the
    /// payload is large, through the buffer otherwise. The range is checked
    /// before anything is read.
    pub fn payload_into(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<()> {
        region.check_range(offset, len).map_err(io::Error::other)?;
        let (mut off, end) = (offset, offset + len);
        let buffered = self.rd.buffer();
        let n = (buffered.len() as u64).min(len);
        region
            .write(off, &buffered[..n as usize])
            .map_err(io::Error::other)?;
        self.rd.consume(n as usize);
        off += n;
        self.direct = len >= DIRECT_MIN as u64;
        while off < end {
            let got = if self.direct {
                // The buffer is empty here, so bypassing it keeps the order.
                region.recv_from(off, end - off, self.rd.get_ref().as_fd())?
            } else {
                let b = self.rd.fill_buf()?;
                let n = b.len().min((end - off) as usize);
                region.write(off, &b[..n]).map_err(io::Error::other)?;
                self.rd.consume(n);
                n
            };
            if got == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            off += got as u64;
        }
        Ok(())
    }

    /// Reads and discards `n` bytes.
    pub fn skip(&mut self, n: u64) -> io::Result<()> {
        let skipped = io::copy(&mut (&mut self.rd).take(n), &mut io::sink())?;
        if skipped == n {
            Ok(())
        } else {
            Err(io::ErrorKind::UnexpectedEof.into())
        }
    }
}

/// Payloads shorter than this are copied into the write buffer; longer
/// ones are sent from region memory by reference (an iovec each).
pub(crate) const COPY_MAX: u64 = 1024;

/// Most iovecs gathered before a write (Linux caps a `writev` at 1024).
pub(crate) const MAX_SEGS: usize = 512;

/// One piece of pending output.
enum Seg {
    /// `buf[start..end]`.
    Buf(usize, usize),
    /// A span of region memory, sent without a copy.
    Mem(Region, u64, u64),
    /// A span of GPU memory, staged through pinned buffers when written.
    Staged(Region, u64, u64),
}

/// Gathers frames and writes them with vectored writes: headers and tiny
/// payloads are copied into a buffer, other payloads are referenced in
/// region memory and go from there to the socket (no user-space copy).
pub struct FrameWriter<'a> {
    stream: &'a TcpStream,
    buf: Vec<u8>,
    segs: Vec<Seg>,
    bytes: usize,
}

impl std::fmt::Debug for FrameWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameWriter")
            .field("buffered", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl<'a> FrameWriter<'a> {
    /// Writes to `stream`; nothing leaves before [`flush`](Self::flush).
    pub fn new(stream: &'a TcpStream) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(64 << 10),
            segs: Vec::with_capacity(MAX_SEGS + 2),
            bytes: 0,
        }
    }

    /// Bytes gathered and not yet written.
    pub fn buffered(&self) -> usize {
        self.bytes
    }

    /// Whether enough is gathered that it should be written now.
    pub fn is_full(&self) -> bool {
        self.bytes >= IO_BUF || self.segs.len() >= MAX_SEGS
    }

    /// Appends a copy of `bytes`.
    pub fn put(&mut self, bytes: &[u8]) {
        let start = self.buf.len();
        self.buf.extend_from_slice(bytes);
        let end = self.buf.len();
        self.bytes += bytes.len();
        match self.segs.last_mut() {
            Some(Seg::Buf(_, last_end)) if *last_end == start => *last_end = end,
            _ => self.segs.push(Seg::Buf(start, end)),
        }
    }

    /// Appends `len` bytes of `region` from `offset` (checked again when
    /// written).
    pub fn region(&mut self, region: &Region, offset: u64, len: u64) -> io::Result<()> {
        if region.device().is_some() {
            region
                .check_range(offset, len)
                .map_err(|e| io::Error::other(e.to_string()))?;
            self.segs.push(Seg::Staged(region.clone(), offset, len));
            self.bytes = self
                .bytes
                .saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
            return Ok(());
        }
        if len < COPY_MAX {
            let start = self.buf.len();
            region
                .extend_vec(offset, len, &mut self.buf)
                .map_err(io::Error::other)?;
            let end = self.buf.len();
            self.bytes += len as usize;
            match self.segs.last_mut() {
                Some(Seg::Buf(_, last_end)) if *last_end == start => *last_end = end,
                _ => self.segs.push(Seg::Buf(start, end)),
            }
            return Ok(());
        }
        self.segs.push(Seg::Mem(region.clone(), offset, len));
        self.bytes = self
            .bytes
            .saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
        Ok(())
    }

    /// Writes everything gathered.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.segs.is_empty() {
            return Ok(());
        }
        let r = write_segs(self.stream, &self.segs, &self.buf);
        self.segs.clear();
        self.buf.clear();
        self.bytes = 0;
        r
    }
}

/// Writes the segments in order: runs of host segments with vectored
/// writes, GPU spans chunk by chunk as they are staged (the copy of the
/// next chunk overlaps the socket write of this one).
fn write_segs(stream: &TcpStream, segs: &[Seg], buf: &[u8]) -> io::Result<()> {
    let mut run: Vec<IoPart<'_>> = Vec::with_capacity(segs.len());
    for seg in segs {
        match seg {
            Seg::Buf(a, b) => run.push(IoPart::Bytes(&buf[*a..*b])),
            Seg::Mem(region, off, len) => run.push(IoPart::Region(region, *off, *len)),
            Seg::Staged(region, off, len) => {
                write_all_parts(stream, &mut run)?;
                run.clear();
                region
                    .read_chunks(*off, *len, |c| {
                        write_all_parts(stream, &mut [IoPart::Bytes(c)])
                    })
                    .map_err(|e| io::Error::other(e.to_string()))??;
            }
        }
    }
    write_all_parts(stream, &mut run)
}

/// Writes every part, retrying partial writes; region memory goes to the
/// socket without a copy ([`send_vectored`]).
fn write_all_parts(w: &TcpStream, mut parts: &mut [IoPart<'_>]) -> io::Result<()> {
    loop {
        while parts.first().is_some_and(IoPart::is_empty) {
            parts = &mut parts[1..];
        }
        if parts.is_empty() {
            return Ok(());
        }
        let mut n = send_vectored(w.as_fd(), parts)? as u64;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let first = parts[0];
            let take = n.min(first.len());
            parts[0] = first.advance(take);
            n -= take;
            if parts[0].is_empty() {
                parts = &mut parts[1..];
            }
        }
    }
}

/// Socket settings applied to every connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SocketOptions {
    /// `SO_SNDBUF`/`SO_RCVBUF`; `None` keeps auto-tuning.
    pub(crate) buffer: Option<usize>,
    /// Keep-alive idle time; see [`TcpConfig::keepalive`](super::TcpConfig::keepalive).
    pub(crate) keepalive: Option<std::time::Duration>,
}

/// `TCP_NODELAY`, buffer sizes and keep-alive. Failures only cost
/// performance or dead-peer detection time, so they are logged.
pub(crate) fn tune_socket(sock: socket2::SockRef<'_>, opts: SocketOptions) {
    if let Err(e) = sock.set_tcp_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    if let Some(size) = opts.buffer {
        if let Err(e) = sock
            .set_send_buffer_size(size)
            .and_then(|()| sock.set_recv_buffer_size(size))
        {
            tracing::debug!(error = %e, size, "socket buffer size");
        }
    }
    if let Some(idle) = opts.keepalive {
        let ka = socket2::TcpKeepalive::new().with_time(idle);
        #[cfg(target_os = "linux")]
        let ka = ka
            .with_interval((idle / 4).max(std::time::Duration::from_secs(1)))
            .with_retries(4);
        if let Err(e) = sock.set_tcp_keepalive(&ka) {
            tracing::debug!(error = %e, "TCP keep-alive");
        }
        #[cfg(target_os = "linux")]
        if let Err(e) = sock.set_tcp_user_timeout(Some(idle * 2)) {
            tracing::debug!(error = %e, "TCP_USER_TIMEOUT");
        }
    }
}

/// Whether bytes (or an EOF) are waiting on `stream`, without blocking.
/// Where the check is unsupported it answers `false`, so callers flush.
fn readable_now(stream: &TcpStream) -> bool {
    #[cfg(unix)]
    {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        socket2::SockRef::from(stream)
            .recv_with_flags(&mut probe, libc::MSG_PEEK | libc::MSG_DONTWAIT)
            .is_ok()
    }
    #[cfg(not(unix))]
    {
        let _ = stream;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Access;
    use std::net::TcpListener;

    /// Frames of mixed sizes (tiny copies, iovec payloads, more segments
    /// than one `writev` takes) arrive intact through both halves.
    #[test]
    fn frames_roundtrip_through_gather_writes_and_direct_reads() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut data = vec![0u8; 1 << 20];
        crate::conformance::Rng::new(3).fill(&mut data);
        let region = Region::from_vec(data.clone(), Access::ALL).unwrap();
        let sizes: Vec<u64> = (0..3000u64)
            .map(|i| match i % 7 {
                0 => 0,
                1 => 1 + i % 1000,
                2 => 1024,
                3 => 4096,
                4 => 20_000 + i,
                5 => 70_000,
                _ => 300_000,
            })
            .collect();
        let expected = sizes.clone();
        let writer = std::thread::spawn(move || {
            let s = TcpStream::connect(addr).unwrap();
            let mut w = FrameWriter::new(&s);
            for (i, &len) in expected.iter().enumerate() {
                let off = (i as u64 * 7919) % ((1 << 20) - len);
                w.put(&len.to_le_bytes());
                w.put(&off.to_le_bytes());
                w.region(&region, off, len).unwrap();
                if w.is_full() {
                    w.flush().unwrap();
                }
            }
            w.flush().unwrap();
        });
        let (s, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(&s);
        let mut payload = vec![0u8; 300_000];
        let sink = Region::alloc(300_005, Access::ALL).unwrap();
        for (i, &len) in sizes.iter().enumerate() {
            let mut h = [0u8; 16];
            r.header(&mut h).unwrap();
            let got_len = u64::from_le_bytes(h[..8].try_into().unwrap());
            let off = u64::from_le_bytes(h[8..].try_into().unwrap()) as usize;
            assert_eq!(got_len, len, "frame {i}");
            let dst = &mut payload[..len as usize];
            // Every other frame lands in region memory (buffered copies and
            // direct reads into the region), at an odd offset.
            if i % 2 == 0 {
                r.payload(dst).unwrap();
            } else {
                r.payload_into(&sink, 5, len).unwrap();
                sink.read(5, dst).unwrap();
            }
            assert!(dst == &data[off..off + len as usize], "frame {i} payload");
        }
        writer.join().unwrap();
        let mut h = [0u8; 1];
        assert_eq!(
            r.header(&mut h).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
