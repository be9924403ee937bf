//! One initiator stream as a non-blocking state machine, driven by an I/O
//! thread of the [pool](super::pool), or, to write a lone request to an
//! idle stream, by the thread that submits it ([`Stream::send`] only; see
//! [`PeerConn::send_jobs`]). Whoever drives it holds its lock.
//!
//! [`Stream::drive`] takes the requests queued for the stream, stages them
//! (headers and small WRITE payloads copied, large payloads referenced in
//! region memory, see [`Outq`]) and writes what the socket takes; then it
//! reads what the socket has: responses, matched strictly in order to the
//! requests sent (by tag), and READ payloads, which land in local memory
//! under the transfer's landing lock, one non-blocking read at a time, and
//! only while the transfer is not finished (a READ that already timed out
//! or failed is read and discarded, never written). It returns when the
//! socket would block, or yields after [`READ_BUDGET`] bytes.
//!
//! Memory is bounded: staging stops at [`OUT_CAP`] bytes of unwritten
//! output or [`MAX_PENDING`] unanswered requests (the rest waits in the
//! stream's backlog, whose jobs the backend submitted: `queue_depth`
//! bounds those in flight, and the requests of a transfer that timed out
//! are let go at the next drive, see [`Stream::sweep`]), and between
//! drives a stream keeps less than one response header of input.

use super::initiator::{Job, PeerConn, XferState};
use super::io::DIRECT_MIN;
use super::outq::Outq;
use super::serve::Drove;
use super::shared::lock;
use super::wire::{Request, RequestKind, Response, Status, RESPONSE_LEN};
use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Unwritten output past which no more requests are staged: a few
/// default chunks in flight per stream keep the socket busy (the kernel
/// buffers as much again), and GPU payloads, copied when staged, are
/// bounded by it too.
const OUT_CAP: usize = 4 << 20;

/// Bytes one drive reads before it yields, so that streams sharing an
/// I/O thread take turns: two default chunks.
const READ_BUDGET: usize = 1 << 20;

/// Requests sent and not yet answered, per stream, past which no more
/// are staged (the rest waits in the backlog, where a transfer that times
/// out drops its requests): a target that reads requests and never
/// answers cannot make the stream remember requests without bound. With
/// 4 KiB requests that is 32 MiB in flight per stream, far more than a
/// link's bandwidth-delay product.
const MAX_PENDING: usize = 8192;

/// A sent request waiting for its response.
struct Pending {
    tag: u64,
    /// `None` once its transfer finished otherwise (deadline, failure):
    /// its local memory and state are let go (see [`Stream::sweep`]); the
    /// answer is still read, and a READ's payload discarded.
    job: Option<Job>,
    /// A READ's payload length (what follows a successful answer).
    read_len: Option<u64>,
}

/// What the next input bytes are.
enum Incoming {
    Header,
    /// A READ's payload: `done` of `job.len` bytes read. GPU memory is
    /// gathered in `staged` and copied onto the device at the end.
    Payload {
        job: Job,
        done: u64,
        staged: Option<Vec<u8>>,
    },
    /// The payload of a READ whose transfer finished meanwhile (see
    /// [`Pending::job`]): `left` bytes to read and discard.
    Discard {
        left: u64,
    },
}

/// One stream of a [`PeerConn`] (see the [module docs](self)), kept in
/// the connection behind a lock: its I/O thread drives it, and a
/// submitter that finds it idle writes its requests itself
/// ([`PeerConn::send_jobs`]). Its methods take the connection it belongs
/// to.
pub(crate) struct Stream {
    i: usize,
    /// Requests taken from the queue but not staged yet (output was full).
    backlog: VecDeque<Job>,
    out: Outq,
    pending: VecDeque<Pending>,
    /// Staged WRITEs whose payload is not all written yet: where in the
    /// output ([`Outq::queued`]) each ends, oldest first (see
    /// `XferState::unsent`).
    unsent: VecDeque<(u64, Arc<XferState>)>,
    tag: u64,
    incoming: Incoming,
    /// A partial response header left from the last drive.
    carry: Vec<u8>,
    /// The last payload was large: the next header is read on its own
    /// while nothing is buffered, so a large payload behind it is read
    /// straight into region memory instead of through the buffer.
    direct: bool,
    /// Whether submitters were last told the stream is idle (see
    /// [`PeerConn::send_jobs`]).
    pub(crate) noted_idle: bool,
}

impl Stream {
    pub(crate) fn new(i: usize) -> Self {
        Self {
            i,
            backlog: VecDeque::new(),
            out: Outq::requests(),
            pending: VecDeque::new(),
            unsent: VecDeque::new(),
            tag: 0,
            incoming: Incoming::Header,
            carry: Vec::new(),
            direct: false,
            noted_idle: true,
        }
    }

    /// Nothing in flight and nothing to write: a request staged now is
    /// written at once and its answer is the next input.
    pub(crate) fn is_idle(&self) -> bool {
        self.backlog.is_empty() && self.out.bytes == 0 && self.pending.is_empty()
    }

    /// Writes and reads until the socket would block (see the
    /// [module docs](self)); `Err` ends the stream and fails its peer.
    pub(crate) fn drive(&mut self, conn: &PeerConn, scratch: &mut [u8]) -> io::Result<Drove> {
        if conn.is_dead() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed locally",
            ));
        }
        #[cfg(test)]
        if conn.panic_in_io.load(Ordering::Acquire) {
            panic!("test: driving a stream of {} panics", conn.peer());
        }
        if conn.take_sweep(self.i) {
            self.sweep(conn);
        }
        self.send(conn)?;
        let drove = self.receive(conn, scratch)?;
        // Answers may have queued a notification on this stream.
        self.send(conn)?;
        Ok(drove)
    }

    /// Stages queued requests and writes until done or blocked.
    pub(crate) fn send(&mut self, conn: &PeerConn) -> io::Result<()> {
        let mut sock = conn.socket(self.i);
        loop {
            if self.backlog.is_empty()
                && !conn.take_jobs(self.i, &mut self.backlog)
                && self.out.bytes == 0
            {
                return Ok(());
            }
            let mut staged = false;
            while self.out.bytes < OUT_CAP && self.pending.len() < MAX_PENDING {
                let Some(job) = self.backlog.pop_front() else {
                    break;
                };
                self.stage(conn, job)?;
                staged = true;
            }
            if !staged && self.out.bytes == 0 {
                // MAX_PENDING requests unanswered and all written: the
                // answers (read next) make room; looping here would spin
                // without ever reading them.
                return Ok(());
            }
            let flushed = self.out.flush(&mut sock);
            self.note_written();
            if !flushed? {
                // Blocked: a writable edge resumes us.
                return Ok(());
            }
        }
    }

    /// Lets go of the requests of transfers that finished otherwise
    /// (deadline, failure; see [`PeerConn::forget`]): those not staged yet
    /// are dropped, those sent keep only what matching their answers
    /// needs. Their local regions and states are released now, not when
    /// (if ever) the target answers.
    fn sweep(&mut self, conn: &PeerConn) {
        let mut dropped: Vec<Job> = Vec::new();
        conn.take_finished(self.i, &mut dropped);
        let mut kept = VecDeque::with_capacity(self.backlog.len());
        for job in self.backlog.drain(..) {
            if job.xfer.is_done() {
                dropped.push(job);
            } else {
                kept.push_back(job);
            }
        }
        self.backlog = kept;
        for p in &mut self.pending {
            if p.job.as_ref().is_some_and(|j| j.xfer.is_done()) {
                dropped.extend(p.job.take());
            }
        }
        for job in dropped {
            conn.release(&job.xfer, job.kind == RequestKind::Notify);
        }
    }

    /// Uncounts the staged WRITEs whose payload is now all written.
    fn note_written(&mut self) {
        while let Some((end, x)) = self.unsent.front() {
            if *end > self.out.written {
                return;
            }
            x.unsent.fetch_sub(1, Ordering::AcqRel);
            self.unsent.pop_front();
        }
    }

    /// Adds one request (and its payload) to the output.
    fn stage(&mut self, conn: &PeerConn, job: Job) -> io::Result<()> {
        // A WRITE is counted as unsent under the landing lock, so a
        // deadline either finds it counted (and aborts the connection) or
        // finishes first and it is not staged (see `XferState::unsent`).
        let xfer = job.xfer.clone();
        let landing = (job.kind == RequestKind::Write).then(|| lock(&xfer.landing));
        if job.xfer.is_done() {
            drop(landing);
            // Timed out or failed: nothing left to send for it.
            conn.release(&job.xfer, job.kind == RequestKind::Notify);
            return Ok(());
        }
        if landing.is_some() {
            job.xfer.unsent.fetch_add(1, Ordering::AcqRel);
        }
        self.tag = self.tag.wrapping_add(1);
        let tag = self.tag;
        let header = Request {
            kind: job.kind,
            key: job.key,
            tag,
            offset: job.remote_offset,
            len: job.len,
        }
        .encode();
        self.out.put(&header);
        match job.kind {
            // Fences are sent when a connection is made, not as jobs.
            RequestKind::Read | RequestKind::Fence => {}
            RequestKind::Notify => {
                if let Some(n) = &job.xfer.notify {
                    self.out.put(n);
                }
            }
            RequestKind::Write => {
                let Some(region) = &job.local else {
                    return Err(io::Error::other("WRITE without local memory"));
                };
                // Copied now (small, GPU) or referenced and read as it
                // is written; either way under the landing lock.
                let staged = self.out.region(region, job.local_offset, job.len);
                self.unsent.push_back((self.out.queued(), job.xfer.clone()));
                staged?;
            }
        }
        drop(landing);
        let read_len = (job.kind == RequestKind::Read).then_some(job.len);
        self.pending.push_back(Pending {
            tag,
            job: Some(job),
            read_len,
        });
        Ok(())
    }

    /// Reads and handles what the socket has, up to the read budget.
    /// `scratch` holds the unhandled input, `..end`: less than one header
    /// after every [`consume`](Self::consume).
    fn receive(&mut self, conn: &PeerConn, scratch: &mut [u8]) -> io::Result<Drove> {
        let mut sock = conn.socket(self.i);
        let mut end = self.carry.len();
        scratch[..end].copy_from_slice(&self.carry);
        self.carry.clear();
        let mut read = 0usize;
        loop {
            let r = match self.direct_payload(conn, &mut sock, end, scratch) {
                Some(r) => r,
                None => {
                    // After a large payload, a header on its own (see
                    // `direct`).
                    let limit = if self.direct && matches!(self.incoming, Incoming::Header) {
                        RESPONSE_LEN
                    } else {
                        scratch.len()
                    };
                    sock.read(&mut scratch[end..limit]).inspect(|&n| end += n)
                }
            };
            match r {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    read += n;
                    let used = self.consume(conn, &scratch[..end])?;
                    scratch.copy_within(used..end, 0);
                    end -= used;
                    if read >= READ_BUDGET {
                        self.carry.extend_from_slice(&scratch[..end]);
                        return Ok(Drove::Yielded);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.carry.extend_from_slice(&scratch[..end]);
                    return Ok(Drove::Blocked);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// With nothing buffered and a large READ payload of host memory
    /// expected: one read straight into region memory, under the landing
    /// lock and only while the transfer is not finished (otherwise into
    /// `scratch`, discarded). `None` when the payload takes the buffered
    /// path.
    fn direct_payload(
        &mut self,
        conn: &PeerConn,
        sock: &mut &TcpStream,
        end: usize,
        scratch: &mut [u8],
    ) -> Option<io::Result<usize>> {
        let Incoming::Payload { job, done, staged } = &mut self.incoming else {
            return None;
        };
        if end > 0 || staged.is_some() || job.len < DIRECT_MIN as u64 {
            return None;
        }
        let region = job.local.as_ref()?;
        let left = job.len - *done;
        let r = {
            let _landing = lock(&job.xfer.landing);
            if job.xfer.is_done() {
                None
            } else {
                Some(region.recv_from(job.local_offset + *done, left, sock.as_fd()))
            }
        };
        let r = r.unwrap_or_else(|| {
            let n = usize::try_from(left)
                .unwrap_or(usize::MAX)
                .min(scratch.len());
            sock.read(&mut scratch[..n])
        });
        if let Ok(n) = r {
            *done += n as u64;
            if n > 0 && *done == job.len {
                if let Err(e) = self.landed(conn) {
                    return Some(Err(e));
                }
            }
        }
        Some(r)
    }

    /// Handles buffered input; returns the bytes used (all but a partial
    /// header).
    fn consume(&mut self, conn: &PeerConn, buf: &[u8]) -> io::Result<usize> {
        let mut at = 0;
        loop {
            let avail = &buf[at..];
            match &mut self.incoming {
                Incoming::Header => {
                    if avail.len() < RESPONSE_LEN {
                        return Ok(at);
                    }
                    let mut h = [0u8; RESPONSE_LEN];
                    h.copy_from_slice(&avail[..RESPONSE_LEN]);
                    at += RESPONSE_LEN;
                    self.response(conn, &h)?;
                }
                Incoming::Discard { left } => {
                    let n = avail
                        .len()
                        .min(usize::try_from(*left).unwrap_or(usize::MAX));
                    at += n;
                    *left -= n as u64;
                    if *left > 0 {
                        return Ok(at);
                    }
                    self.incoming = Incoming::Header;
                }
                Incoming::Payload { job, done, staged } => {
                    let n = avail
                        .len()
                        .min(usize::try_from(job.len - *done).unwrap_or(usize::MAX));
                    if n == 0 && *done < job.len {
                        return Ok(at);
                    }
                    let bytes = &avail[..n];
                    if let Some(v) = staged {
                        v.extend_from_slice(bytes);
                    } else if let Some(region) = &job.local {
                        let _landing = lock(&job.xfer.landing);
                        if !job.xfer.is_done() {
                            region
                                .write(job.local_offset + *done, bytes)
                                .map_err(io::Error::other)?;
                        }
                    }
                    at += n;
                    *done += n as u64;
                    if *done == job.len {
                        self.landed(conn)?;
                    }
                }
            }
        }
    }

    /// One response header: matched to the oldest request sent.
    fn response(&mut self, conn: &PeerConn, h: &[u8; RESPONSE_LEN]) -> io::Result<()> {
        let protocol = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        let resp = Response::decode(h).map_err(|e| protocol(e.to_string()))?;
        let Some(p) = self.pending.pop_front() else {
            return Err(protocol("response without a request".into()));
        };
        if p.tag != resp.tag {
            return Err(protocol("response out of order".into()));
        }
        let Some(job) = p.job else {
            // Its transfer finished meanwhile: a READ's payload is read
            // and discarded.
            if let (Some(len), Status::Ok) = (p.read_len, resp.status) {
                if len > 0 {
                    self.direct = len >= DIRECT_MIN as u64;
                    self.incoming = Incoming::Discard { left: len };
                }
            }
            return Ok(());
        };
        if let Some(e) = conn.refusal(&job, resp.status) {
            lock(&job.xfer.error).get_or_insert(e);
        } else if job.kind == RequestKind::Read {
            let Some(region) = &job.local else {
                return Err(protocol("READ without local memory".into()));
            };
            region
                .check_range(job.local_offset, job.len)
                .map_err(io::Error::other)?;
            // GPU memory: gathered, then staged onto the device at once.
            let staged = region
                .device()
                .is_some()
                .then(|| Vec::with_capacity(usize::try_from(job.len).unwrap_or(0)));
            let empty = job.len == 0;
            self.incoming = Incoming::Payload {
                job,
                done: 0,
                staged,
            };
            if empty {
                self.landed(conn)?;
            }
            return Ok(());
        }
        conn.release(&job.xfer, job.kind == RequestKind::Notify);
        Ok(())
    }

    /// A READ's payload was read in full: GPU bytes go onto the device
    /// (under the landing lock, never after the transfer ended), then the
    /// chunk is done.
    fn landed(&mut self, conn: &PeerConn) -> io::Result<()> {
        let Incoming::Payload { job, staged, .. } =
            std::mem::replace(&mut self.incoming, Incoming::Header)
        else {
            return Ok(());
        };
        self.direct = job.len >= DIRECT_MIN as u64;
        if let (Some(buf), Some(region)) = (staged, &job.local) {
            let _landing = lock(&job.xfer.landing);
            if !job.xfer.is_done() {
                region
                    .copy_in(job.local_offset, &buf)
                    .map_err(io::Error::other)?;
            }
        }
        conn.release(&job.xfer, false);
        Ok(())
    }
}
