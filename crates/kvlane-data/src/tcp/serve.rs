//! One served connection as a non-blocking state machine.
//!
//! [`ServeConn::drive`] reads whatever the socket has, decodes and checks
//! requests, moves WRITE payloads straight into region memory and queues
//! answers (READ payloads by reference to region memory when large), then
//! writes what it can. It returns when the socket would block, so one I/O
//! thread serves many connections. The same code runs over an in-memory
//! stream in the `tcp_serve` fuzz target ([`fuzz_serve`](super::fuzz_serve)).
//!
//! Every length and offset from the wire passes [`Request::decode`] (length
//! caps) and [`check_request`](super::server::check_request) (key, rights,
//! overflow-safe bounds) before it reaches any arithmetic or memory.
//! Output is bounded: once [`OUT_MAX`] bytes of answers are queued the
//! connection stops reading until the peer has taken them.

use super::io::{DIRECT_MIN, IO_BUF};
use super::lease::{Lease, Served};
use super::outq::{Outq, Sock};
use super::server::{bump, check_request, Counters, RegionTable};
use super::shared::Shared;
use super::wire::{
    Challenge, FrameError, Request, RequestKind, Response, Status, HELLO_ACK, HELLO_LEN,
    REQUEST_LEN,
};
use crate::ids::PeerId;
use bytes::Bytes;
use std::io;
use std::sync::{Arc, RwLock, RwLockReadGuard};

/// Answers queued (headers and READ payloads) before the connection stops
/// reading requests: bounds the memory one peer can make us hold and keeps
/// a peer that does not read its answers from growing a queue.
pub(crate) const OUT_MAX: usize = 4 << 20;

/// Answers are flushed at the latest once they acknowledge this many
/// WRITE payload bytes, even while more requests keep arriving (so acks
/// keep flowing while the initiator streams without pause).
const ACK_BATCH: u64 = 1 << 20;

/// Bytes one drive reads before it yields, so that connections sharing an
/// I/O thread take turns (a peer streaming without pause would otherwise
/// keep its thread until its socket ran dry): two default chunks.
const READ_BUDGET: usize = 1 << 20;

/// How a drive ended (without an error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Drove {
    /// Waiting for the socket: the next readiness event resumes it.
    Blocked,
    /// Used its read budget with input possibly left: drive it again after
    /// the other connections' turns (no event will come for it).
    Yielded,
}

/// Why a connection ended.
#[derive(Debug)]
pub(crate) enum End {
    /// The peer closed it (after its answers were sent, as far as it read them).
    Eof,
    /// A wrong hello or token.
    Auth,
    /// A header that did not decode.
    Frame(FrameError),
    /// Authenticated, but the connection cap was reached.
    Refused,
    /// A socket error.
    Io(io::Error),
    /// The connection's generation `gen` is below its peer's fence
    /// `floor`: a newer connection set of the peer fenced it.
    Fenced {
        /// The connection's generation (0: it sent no FENCE).
        gen: u64,
        /// The peer's fenced generation.
        floor: u64,
    },
}

/// One peer's fence: the highest connection generation it has fenced
/// (see [`wire`](super::wire)). Whatever writes into memory or delivers a
/// notification for a connection holds the read lock while it checks its
/// generation and writes; a FENCE raises the floor under the write lock,
/// so once it is answered no write of an older connection is in progress
/// and none starts.
#[derive(Debug, Default)]
pub(crate) struct PeerFence {
    floor: RwLock<u64>,
}

/// The connection may write: its fence (if it has one) is held until the
/// returned guard drops.
fn pass(fence: &Option<Arc<PeerFence>>, gen: u64) -> Result<Option<RwLockReadGuard<'_, u64>>, End> {
    let Some(f) = fence else {
        return Ok(None);
    };
    let floor = f.floor.read().unwrap_or_else(|e| e.into_inner());
    if *floor > gen {
        return Err(End::Fenced { gen, floor: *floor });
    }
    Ok(Some(floor))
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// Maps a hello and the challenge it answers to the peer it proves (and
/// that peer's fence). No peer: the hello proves a credential of a
/// sibling server (another rail of this process, see
/// `TcpBackend::fence_through_each_other`): the connection may FENCE that
/// peer's connections there and do nothing else.
pub(crate) type Authenticate<'a> =
    dyn Fn(&[u8; HELLO_LEN], &Challenge) -> Result<(Option<PeerId>, Arc<PeerFence>), End> + 'a;

/// What serving needs from the server.
pub(crate) struct Ctx<'a> {
    pub(crate) regions: &'a RegionTable,
    pub(crate) shared: &'a Shared,
    pub(crate) counters: &'a Counters,
    /// Maps a hello to the peer whose credential it proves for the
    /// connection's challenge and admits the connection (counts it against
    /// the cap), or says why not.
    pub(crate) authenticate: &'a Authenticate<'a>,
}

/// What the next input bytes are.
enum Incoming {
    /// The hello answering this challenge (sent when the connection was
    /// accepted).
    Hello(Challenge),
    Header,
    Write {
        lease: Lease,
        offset: u64,
        len: u64,
        done: u64,
        tag: u64,
    },
    Notify {
        buf: Vec<u8>,
        len: usize,
        tag: u64,
    },
    Skip {
        left: u64,
        tag: u64,
        status: Status,
    },
}

/// What [`ServeConn::cut`] cut.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cut {
    /// Requests cut.
    pub(crate) requests: usize,
    /// The connection must be closed (a READ answer was cut).
    pub(crate) close: bool,
}

/// The read buffer of one drive: a per-thread scratch buffer, of which
/// `start..end` is unconsumed input.
struct Input<'b> {
    buf: &'b mut [u8],
    start: usize,
    end: usize,
}

/// One served connection (see the [module docs](self)).
///
/// Between drives a connection keeps less than one header of input (every
/// state but `Header` and `Hello` consumes whatever is buffered), except
/// when it stopped at the output cap with requests still buffered; so the
/// read buffer is the I/O thread's, not the connection's: an idle
/// connection holds a few hundred bytes, not a buffer.
pub(crate) struct ServeConn {
    carry: Vec<u8>,
    incoming: Incoming,
    out: Outq,
    peer: Option<PeerId>,
    /// The peer's fence, once authenticated.
    fence: Option<Arc<PeerFence>>,
    /// This connection's generation (its FENCE's; 0 before one).
    gen: u64,
    /// WRITE bytes acknowledged by answers not yet flushed.
    acked: u64,
    /// The last request was a WRITE large enough to be read straight into
    /// region memory: the next header is read on its own while nothing is
    /// buffered, so the large payload likely behind it is not pulled into
    /// the buffer and copied twice (as the blocking server's reader did).
    direct: bool,
}

impl ServeConn {
    /// A connection that must answer a fresh challenge first: the
    /// challenge is queued at once (the first drive sends it).
    pub(crate) fn new() -> Self {
        let challenge = Challenge::fresh();
        let mut out = Outq::default();
        out.put(&challenge.encode());
        Self {
            carry: Vec::new(),
            incoming: Incoming::Hello(challenge),
            out,
            peer: None,
            fence: None,
            gen: 0,
            acked: 0,
            direct: false,
        }
    }

    /// A connection past its hello (for the fuzz target).
    pub(crate) fn authenticated(peer: PeerId) -> Self {
        Self {
            carry: Vec::new(),
            incoming: Incoming::Header,
            out: Outq::default(),
            peer: Some(peer),
            fence: None,
            gen: 0,
            acked: 0,
            direct: false,
        }
    }

    /// The peer whose credential the connection presented, once it has.
    pub(crate) fn peer(&self) -> Option<PeerId> {
        self.peer
    }

    /// Drops every lease this connection holds on `served` (its region
    /// was deregistered), so that it touches the region no more. A WRITE
    /// being received is refused with [`Status::Revoked`] once the rest of
    /// its payload has been read and dropped (what landed before stays);
    /// the initiator's transfer fails. A READ answer queued or being sent
    /// from the region cannot be refused any more (its header went ahead
    /// of it): the connection must be closed (`close`), which fails the
    /// initiator's transfers on it.
    pub(crate) fn cut(&mut self, served: &Arc<Served>) -> Cut {
        let mut cut = Cut::default();
        if let Incoming::Write {
            lease,
            len,
            done,
            tag,
            ..
        } = &self.incoming
        {
            if lease.is_on(served) {
                self.incoming = Incoming::Skip {
                    left: *len - *done,
                    tag: *tag,
                    status: Status::Revoked,
                };
                cut.requests += 1;
            }
        }
        let reads = self.out.leases_on(served);
        cut.requests += reads;
        cut.close = reads > 0;
        cut
    }

    /// Serves until the socket would block; `Err` ends the connection.
    /// `scratch` (at least [`HELLO_LEN`] bytes; [`IO_BUF`] is good) is
    /// the read buffer, shared by the connections of one thread.
    pub(crate) fn drive<S: Sock>(
        &mut self,
        s: &mut S,
        ctx: &Ctx<'_>,
        scratch: &mut [u8],
    ) -> Result<Drove, End> {
        let carried = self.carry.len();
        scratch[..carried].copy_from_slice(&self.carry);
        let mut input = Input {
            buf: scratch,
            start: 0,
            end: carried,
        };
        let r = self.run(s, ctx, &mut input);
        if r.is_ok() {
            self.carry.clear();
            self.carry
                .extend_from_slice(&input.buf[input.start..input.end]);
            if self.carry.len() < REQUEST_LEN {
                // Only a partial header: do not keep a large buffer idle.
                self.carry.shrink_to(REQUEST_LEN);
            }
        }
        r
    }

    fn run<S: Sock>(
        &mut self,
        s: &mut S,
        ctx: &Ctx<'_>,
        input: &mut Input<'_>,
    ) -> Result<Drove, End> {
        let mut read = 0usize;
        loop {
            if self.out.bytes >= OUT_MAX {
                self.out.flush(s)?;
                if self.out.bytes >= OUT_MAX {
                    // The peer is not taking its answers: read no more
                    // requests until it does (a writable event resumes us).
                    return Ok(Drove::Blocked);
                }
            }
            self.consume(ctx, input)?;
            if self.out.bytes >= IO_BUF || self.acked >= ACK_BATCH {
                self.acked = 0;
                // Whether or not it all went out, read on: the cap above
                // stops reading once `OUT_MAX` is queued. (Looping back
                // here while the socket is full would spin.)
                self.out.flush(s)?;
            }
            // What `consume` leaves is less than the hello or header it
            // waits for, unless it stopped at the output cap.
            let need = match self.incoming {
                Incoming::Hello(_) => HELLO_LEN,
                _ => REQUEST_LEN,
            };
            if input.end - input.start >= need {
                // `consume` stopped at the cap with requests buffered: the
                // check above returns while the cap holds, or the flush
                // made room and they are served now. (Reading on instead
                // could end the drive with them buffered and no event left
                // to resume it.)
                continue;
            }
            match self.fill(s, input) {
                Ok(0) => {
                    // Half-closed: the initiator may still read its answers.
                    let _ = self.out.flush(s);
                    return Err(End::Eof);
                }
                Ok(n) => {
                    read += n;
                    if read >= READ_BUDGET {
                        self.consume(ctx, input)?;
                        self.out.flush(s)?;
                        return Ok(Drove::Yielded);
                    }
                }
                Err(End::Io(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(End::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.out.flush(s)?;
                    return Ok(Drove::Blocked);
                }
                Err(end) => return Err(end),
            }
        }
    }

    /// Reads from the socket: a large WRITE payload straight into region
    /// memory when nothing is buffered (unless the connection was fenced:
    /// [`End::Fenced`]), otherwise into the buffer.
    fn fill<S: Sock>(&mut self, s: &mut S, input: &mut Input<'_>) -> Result<usize, End> {
        if input.start == input.end {
            input.start = 0;
            input.end = 0;
            if let Incoming::Write {
                lease,
                offset,
                len,
                done,
                ..
            } = &mut self.incoming
            {
                let left = *len - *done;
                let region = lease.region();
                // GPU memory takes the buffered path (staged by `copy_in`).
                if left >= DIRECT_MIN as u64 && region.device().is_none() {
                    let _pass = pass(&self.fence, self.gen)?;
                    let n = s.read_into(region, *offset + *done, left)?;
                    *done += n as u64;
                    return Ok(n);
                }
            } else if self.direct && matches!(self.incoming, Incoming::Header) {
                let n = s.read(&mut input.buf[..REQUEST_LEN])?;
                input.end = n;
                return Ok(n);
            }
        } else if input.start > 0 {
            // What is left is less than one header: cheap to move.
            // (More is left only at the output cap, and then `run` does
            // not read.)
            input.buf.copy_within(input.start..input.end, 0);
            input.end -= input.start;
            input.start = 0;
        }
        if input.end == input.buf.len() {
            // `run` reads only after `consume` took all but a partial
            // header; a full buffer here is a bug, not an end of stream.
            return Err(io::Error::other("served connection's input buffer is full").into());
        }
        let n = s.read(&mut input.buf[input.end..])?;
        input.end += n;
        Ok(n)
    }

    /// Decodes and serves what is buffered.
    fn consume(&mut self, ctx: &Ctx<'_>, input: &mut Input<'_>) -> Result<(), End> {
        loop {
            let avail = input.end - input.start;
            let rbuf = &input.buf[input.start..input.end];
            match &mut self.incoming {
                Incoming::Hello(challenge) => {
                    if avail < HELLO_LEN {
                        return Ok(());
                    }
                    let mut h = [0u8; HELLO_LEN];
                    h.copy_from_slice(&rbuf[..HELLO_LEN]);
                    input.start += HELLO_LEN;
                    let (peer, fence) = (ctx.authenticate)(&h, challenge)?;
                    self.peer = peer;
                    self.fence = Some(fence);
                    self.incoming = Incoming::Header;
                    self.out.put(&HELLO_ACK);
                }
                Incoming::Header => {
                    if avail < REQUEST_LEN || self.out.bytes >= OUT_MAX {
                        // Later requests wait for the answers to drain.
                        return Ok(());
                    }
                    let mut h = [0u8; REQUEST_LEN];
                    h.copy_from_slice(&rbuf[..REQUEST_LEN]);
                    input.start += REQUEST_LEN;
                    let req = Request::decode(&h).map_err(End::Frame)?;
                    self.request(&req, ctx)?;
                }
                Incoming::Write {
                    lease,
                    offset,
                    len,
                    done,
                    tag,
                } => {
                    let n = (avail as u64).min(*len - *done);
                    if n > 0 {
                        let src = &rbuf[..n as usize];
                        let _pass = pass(&self.fence, self.gen)?;
                        // Host memory: a copy; GPU memory: staged onto the
                        // device before the ack.
                        lease
                            .region()
                            .copy_in(*offset + *done, src)
                            .map_err(|e| End::Io(io::Error::other(e)))?;
                        input.start += n as usize;
                        *done += n;
                    }
                    if *done < *len {
                        return Ok(());
                    }
                    bump(&ctx.counters.writes_served, 1);
                    bump(&ctx.counters.bytes_written, *len);
                    self.acked += *len;
                    let tag = *tag;
                    self.answer(Status::Ok, tag);
                }
                Incoming::Notify { buf, len, tag } => {
                    let want = *len - buf.len();
                    let n = avail.min(want);
                    buf.extend_from_slice(&rbuf[..n]);
                    input.start += n;
                    if n < want {
                        return Ok(());
                    }
                    let tag = *tag;
                    let payload = std::mem::take(buf);
                    // A full queue (the application is not taking its
                    // notifications) refuses it: the initiator's transfer
                    // fails with a clear error instead of the notification
                    // vanishing here or the queue growing without bound.
                    let status = {
                        let _pass = pass(&self.fence, self.gen)?;
                        if ctx.shared.notify(self.peer, Bytes::from(payload)) {
                            bump(&ctx.counters.notifications, 1);
                            Status::Ok
                        } else {
                            ctx.counters.refused(Status::NotifyQueueFull);
                            Status::NotifyQueueFull
                        }
                    };
                    self.answer(status, tag);
                }
                Incoming::Skip { left, tag, status } => {
                    let n = (avail as u64).min(*left);
                    input.start += n as usize;
                    *left -= n;
                    if *left > 0 {
                        return Ok(());
                    }
                    let (status, tag) = (*status, *tag);
                    self.answer(status, tag);
                }
            }
        }
    }

    /// A FENCE: this connection becomes of generation `req.offset`, and
    /// the peer's older connections write no more (see [`PeerFence`]).
    /// One below the peer's floor ends this connection instead.
    fn fence(&mut self, req: &Request) -> Result<(), End> {
        let gen = req.offset;
        if let Some(f) = &self.fence {
            // Waits for every write of the peer's connections in progress.
            // (The floor is never below this connection's own generation:
            // its own FENCE raised it.)
            let mut floor = f.floor.write().unwrap_or_else(|e| e.into_inner());
            if gen < *floor {
                return Err(End::Fenced { gen, floor: *floor });
            }
            *floor = gen;
        }
        self.gen = gen;
        self.answer(Status::Ok, req.tag);
        Ok(())
    }

    /// Queues a status answer and expects the next header.
    fn answer(&mut self, status: Status, tag: u64) {
        self.incoming = Incoming::Header;
        self.out.put(&Response { status, tag }.encode());
    }

    /// Checks one decoded request and starts serving it.
    fn request(&mut self, req: &Request, ctx: &Ctx<'_>) -> Result<(), End> {
        if req.kind == RequestKind::Fence {
            return self.fence(req);
        }
        if self.peer.is_none() {
            // Admitted through a sibling's credential: FENCE only.
            return Err(End::Auth);
        }
        // A fenced connection serves nothing more (its writes are also
        // checked as they land: a fence may come mid-payload).
        drop(pass(&self.fence, self.gen)?);
        self.direct = req.kind == RequestKind::Write && req.len >= DIRECT_MIN as u64;
        let checked = {
            let regions = ctx.regions.read().unwrap_or_else(|e| e.into_inner());
            check_request(&regions, req)
        };
        let c = ctx.counters;
        match checked {
            Ok(Some(lease)) if req.kind == RequestKind::Write => {
                self.incoming = Incoming::Write {
                    lease,
                    offset: req.offset,
                    len: req.len,
                    done: 0,
                    tag: req.tag,
                };
            }
            Ok(Some(lease)) => {
                self.out.put(
                    &Response {
                        status: Status::Ok,
                        tag: req.tag,
                    }
                    .encode(),
                );
                // Sent from region memory as the socket takes it: the
                // lease stays with the queued answer until it has left.
                self.out.leased(lease, req.offset, req.len)?;
                bump(&c.reads_served, 1);
                bump(&c.bytes_read, req.len);
            }
            Ok(None) => {
                // `len <= MAX_NOTIFY` (checked by decode).
                self.incoming = Incoming::Notify {
                    buf: Vec::with_capacity(req.len as usize),
                    len: req.len as usize,
                    tag: req.tag,
                };
            }
            Err(status) => {
                c.refused(status);
                // A refused WRITE's payload is skipped; it never reaches memory.
                self.incoming = Incoming::Skip {
                    left: req.payload_len(),
                    tag: req.tag,
                    status,
                };
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RemoteKey;
    use crate::memory::{Access, IoPart, Region};
    use crate::tcp::server::RegionTable;

    /// Input all at once, output taken `piece` bytes per round.
    struct Slow {
        input: Vec<u8>,
        piece: usize,
        wrote: bool,
        output: u64,
    }

    impl Sock for Slow {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.input.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.input.len());
            buf[..n].copy_from_slice(&self.input[..n]);
            self.input.drain(..n);
            Ok(n)
        }
        fn read_into(&mut self, _: &Region, _: u64, _: u64) -> io::Result<usize> {
            Err(io::ErrorKind::WouldBlock.into())
        }
        fn write_parts(&mut self, parts: &[IoPart<'_>]) -> io::Result<usize> {
            if self.wrote {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.wrote = true;
            let total: u64 = parts.iter().map(|p| p.len()).sum();
            let n = total.min(self.piece as u64);
            self.output += n;
            Ok(n as usize)
        }
    }

    /// A hello that arrives in part (more than a request header's worth,
    /// less than a hello) waits for the rest: the drive returns, it does
    /// not spin on the I/O thread. The challenge went out first.
    #[test]
    fn a_partial_hello_waits_for_the_rest() {
        let regions = RegionTable::default();
        let (shared, counters) = (Shared::default(), Counters::default());
        let mut s = Slow {
            input: vec![0x5a; HELLO_LEN - 1],
            piece: 1 << 20,
            wrote: false,
            output: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let ctx = Ctx {
                regions: &regions,
                shared: &shared,
                counters: &counters,
                authenticate: &|_, _| Err(End::Auth),
            };
            let mut conn = ServeConn::new();
            let mut scratch = vec![0u8; IO_BUF];
            let r = conn.drive(&mut s, &ctx, &mut scratch);
            let _ = tx.send((r.is_ok_and(|d| d == Drove::Blocked), s.output));
        });
        let (blocked, sent) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the drive returned");
        assert!(blocked, "a partial hello is waited for");
        assert_eq!(
            sent,
            super::super::wire::CHALLENGE_LEN as u64,
            "the challenge"
        );
    }

    /// Requests whose answers exceed the output cap are all answered once
    /// the peer takes its answers (none is lost in the carried input).
    #[test]
    fn requests_past_the_output_cap_are_answered_as_output_drains() {
        let regions = RegionTable::default();
        let region = Region::alloc(1 << 20, Access::ALL).unwrap();
        regions
            .write()
            .unwrap()
            .insert(RemoteKey(1), Served::new(region.clone()));
        let (shared, counters) = (Shared::default(), Counters::default());
        let ctx = Ctx {
            regions: &regions,
            shared: &shared,
            counters: &counters,
            authenticate: &|_, _| Err(End::Auth),
        };
        let n = 384u64;
        let mut input = Vec::new();
        for tag in 0..n {
            let req = Request {
                kind: RequestKind::Read,
                key: RemoteKey(1),
                tag,
                offset: 0,
                len: 64 << 10,
            };
            input.extend_from_slice(&req.encode());
        }
        let mut s = Slow {
            input,
            piece: 1 << 20,
            wrote: false,
            output: 0,
        };
        let mut conn = ServeConn::authenticated(PeerId(1));
        let mut scratch = vec![0u8; IO_BUF];
        let want = n * (24 + (64 << 10));
        // Edge-triggered events, as epoll gives them: the drive after
        // this one happens only if this one ended on a `WouldBlock` write
        // (a writable edge will follow); the input was read at once.
        for _ in 0..1000 {
            s.wrote = false;
            let blocked_before = s.output;
            let _ = conn.drive(&mut s, &ctx, &mut scratch).unwrap();
            if s.output == want {
                break;
            }
            let ended_blocked = s.wrote && s.output - blocked_before == s.piece as u64;
            assert!(
                ended_blocked,
                "the drive ended with answers owed and no event to resume it"
            );
        }
        assert_eq!(s.output, want, "answers lost");
    }
}
