//! Framed socket I/O shared by both sides: headers are batched through a
//! small buffer, large payloads move between the socket and region memory
//! without an intermediate copy.

use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::net::TcpStream;

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
pub(crate) struct FrameReader<'a> {
    rd: BufReader<&'a TcpStream>,
    direct: bool,
}

impl<'a> FrameReader<'a> {
    pub(crate) fn new(stream: &'a TcpStream) -> Self {
        Self {
            rd: BufReader::with_capacity(IO_BUF, stream),
            direct: false,
        }
    }

    /// Whether nothing is buffered (the next read may block).
    pub(crate) fn is_drained(&self) -> bool {
        self.rd.buffer().is_empty()
    }

    /// Reads exactly `dst.len()` header bytes. `UnexpectedEof` when the
    /// peer closed before the first byte or mid-header.
    pub(crate) fn header(&mut self, dst: &mut [u8]) -> io::Result<()> {
        if self.direct && self.is_drained() {
            self.rd.get_mut().read_exact(dst)
        } else {
            self.rd.read_exact(dst)
        }
    }

    /// Reads exactly `dst.len()` payload bytes.
    pub(crate) fn payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
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

    /// Reads and discards `n` bytes.
    pub(crate) fn skip(&mut self, n: u64) -> io::Result<()> {
        let skipped = io::copy(&mut (&mut self.rd).take(n), &mut io::sink())?;
        if skipped == n {
            Ok(())
        } else {
            Err(io::ErrorKind::UnexpectedEof.into())
        }
    }
}

/// Gathers headers and small payloads; writes them together with a large
/// payload in one vectored write.
pub(crate) struct FrameWriter<'a> {
    stream: &'a TcpStream,
    buf: Vec<u8>,
}

impl<'a> FrameWriter<'a> {
    pub(crate) fn new(stream: &'a TcpStream) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(IO_BUF + DIRECT_MIN),
        }
    }

    /// Bytes gathered and not yet written.
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Appends bytes to the buffer.
    pub(crate) fn put(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Writes the buffer, then `tail`, then clears the buffer.
    pub(crate) fn flush_with(&mut self, tail: &[u8]) -> io::Result<()> {
        let r = write_two(&mut &*self.stream, &self.buf, tail);
        self.buf.clear();
        r
    }

    /// Appends a payload: copied when small, else written at once with
    /// everything buffered before it.
    pub(crate) fn payload(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.len() < DIRECT_MIN {
            self.put(bytes);
            Ok(())
        } else {
            self.flush_with(bytes)
        }
    }
}

/// Writes `a` then `b` with vectored writes (one syscall when possible).
fn write_two(w: &mut &TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() {
        let n = w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if n >= a.len() {
            b = &b[n - a.len()..];
            a = &[];
        } else {
            a = &a[n..];
        }
    }
    if b.is_empty() {
        Ok(())
    } else {
        w.write_all(b)
    }
}

/// `TCP_NODELAY`, and socket buffer sizes when configured.
pub(crate) fn tune_socket(s: &TcpStream, buffer: Option<usize>) {
    if let Err(e) = s.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    if let Some(size) = buffer {
        let sock = socket2::SockRef::from(s);
        if let Err(e) = sock
            .set_send_buffer_size(size)
            .and_then(|()| sock.set_recv_buffer_size(size))
        {
            tracing::debug!(error = %e, size, "socket buffer size");
        }
    }
}

/// Whether bytes (or an EOF) are waiting on `stream`, without blocking.
/// Where the check is unsupported it answers `false`, so callers flush.
pub(crate) fn readable_now(stream: &TcpStream) -> bool {
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
