//! The measuring end of the raw-tcp baseline: `groups` x
//! `TcpConfig::default().streams` streams, and batches of blocks split and
//! striped over them the way the tcp backend splits and stripes a peer's
//! transfers. Every stream has a sender thread, which writes its requests
//! back to back, and a receiver thread, which reads and times the answers
//! meanwhile (the backend's initiator did so before its streams moved to
//! event-driven I/O threads; blocking threads are the ceiling).
//!
//! On this side the blocks come from and land in memory of the batch's
//! footprint, block `i` at `i * block`, as the backend's do: a READ of 128
//! blocks of 1 MiB fills 128 MiB, not one 512 KiB buffer over and over.
//! Measured on a 2-core VM, a hot 512 KiB sink made raw READ at 1 MiB
//! ~10% faster (3.5 against 3.0–3.2 GB/s) than the same bytes landing
//! across 128 MiB, which the backend can never be. On the server's side
//! they land in (and come from) the target's memory, where the backend's
//! target keeps block `i`: `(i mod slots) * block`, `slots` being the
//! blocks the server's memory holds (its size comes with the hello).

use super::{buffer, header, invalid, HELLO_TIMEOUT, MAGIC};
use crate::bench::schedule::{run_for, Slice};
use crate::bench::stats::Sample;
use crate::bench::BenchError;
use kvlane_data::tcp::{FrameReader, FrameWriter, TcpConfig};
use kvlane_data::{Op, Region};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// A stalled link fails the baseline after this long instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// One request: its block, its offset in the batch's memory here, its
/// offset in the server's memory, its length.
type Request = (usize, u64, u64, u64);

/// One stream's share of a batch, in sending order.
type Requests = Arc<[Request]>;

/// What a batch's sender and receiver threads are handed: the operation,
/// their requests and the batch's memory (WRITE source, READ sink).
type Work = (Op, Requests, Region);

struct Lane {
    /// To the sender thread.
    send: Sender<Work>,
    /// To the receiver thread.
    receive: Sender<Work>,
    /// When each request of the batch was answered, from the receiver.
    done: Receiver<io::Result<Vec<Instant>>>,
    /// Why the sender stopped, if it failed (it then closes the stream, so
    /// the receiver fails too and the batch ends).
    send_error: Arc<Mutex<Option<io::Error>>>,
    /// This lane's share of the batch being dealt.
    requests: Vec<Request>,
    /// The share in flight.
    in_flight: Option<Requests>,
    threads: [JoinHandle<()>; 2],
}

/// Streams to a [`super::RawServer`], in groups: a group is what one
/// initiator thread of the tcp backend would open to its peer.
pub(crate) struct RawClient {
    addr: SocketAddr,
    per_group: usize,
    /// Largest request: the tcp backend's `chunk_bytes`.
    chunk: u64,
    /// Bytes of memory the server serves (the smallest any stream's hello
    /// announced).
    served: u64,
    lanes: Vec<Lane>,
    /// When each block of the batch in progress had all its bytes.
    arrived: Vec<Instant>,
    /// Bytes queued so far per group: picks the stream.
    striped: Vec<u64>,
    /// The batch's memory, every group's blocks end to end (grown to the
    /// largest batch measured).
    memory: Option<Region>,
}

impl RawClient {
    /// Opens `groups` x `TcpConfig::default().streams` streams to `addr`,
    /// each checked with the hello.
    pub(crate) fn connect(addr: SocketAddr, groups: usize) -> Result<Self, BenchError> {
        let tcp = TcpConfig::default();
        let per_group = tcp.streams.max(1);
        let fail = |stream, source| BenchError::RawTcp {
            addr,
            stream,
            source,
        };
        let mut served = u64::MAX;
        let lanes = (0..groups.max(1) * per_group)
            .map(|i| {
                let (lane, n) = Lane::start(addr, i).map_err(|e| fail(i, e))?;
                served = served.min(n);
                Ok(lane)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            addr,
            per_group,
            chunk: tcp.chunk_bytes,
            served,
            lanes,
            arrived: Vec::new(),
            striped: vec![0; groups.max(1)],
            memory: None,
        })
    }

    /// Streams open.
    pub(crate) fn streams(&self) -> usize {
        self.lanes.len()
    }

    /// Runs batches of `batch` blocks per group for `slice`, after an
    /// unmeasured warm-up batch when `first`.
    pub(crate) fn measure(
        &mut self,
        op: Op,
        block: u64,
        batch: usize,
        slice: Slice,
        first: bool,
    ) -> Result<Sample, BenchError> {
        if first {
            self.batch(op, block, batch, &mut Vec::new())?;
        }
        let mut s = Sample::default();
        s.secs = run_for(slice, || self.batch(op, block, batch, &mut s.lat))?;
        Ok(s)
    }

    /// One batch on every group at once (see [`Self::deal`]). A block's
    /// latency is the time from the batch's start until its last request
    /// was answered.
    fn batch(
        &mut self,
        op: Op,
        block: u64,
        batch: usize,
        lat: &mut Vec<Duration>,
    ) -> Result<(), BenchError> {
        if block > self.served {
            return Err(BenchError::RawTcp {
                addr: self.addr,
                stream: 0,
                source: invalid(format!(
                    "a {block}-byte block does not fit the {} bytes the server serves",
                    self.served
                )),
            });
        }
        let groups = self.deal(block, batch);
        let footprint = (groups * batch) as u64 * block;
        let memory = match &self.memory {
            Some(m) if m.len() >= footprint => m.clone(),
            _ => {
                let m = buffer(footprint as usize, 0x5a).map_err(|source| BenchError::RawTcp {
                    addr: self.addr,
                    stream: 0,
                    source,
                })?;
                self.memory = Some(m.clone());
                m
            }
        };
        let t0 = Instant::now();
        self.arrived.clear();
        self.arrived.resize(groups * batch, t0);
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            if lane.requests.is_empty() {
                continue;
            }
            let requests: Requests = std::mem::take(&mut lane.requests).into();
            // The sender first: the bytes start moving while the receiver
            // wakes (answers wait in the socket for it).
            lane.send
                .send((op, requests.clone(), memory.clone()))
                .and_then(|()| lane.receive.send((op, requests.clone(), memory.clone())))
                .map_err(|_| ended(self.addr, i))?;
            lane.in_flight = Some(requests);
        }
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let Some(requests) = lane.in_flight.take() else {
                continue;
            };
            let arrived = match lane.done.recv() {
                Ok(Ok(arrived)) => arrived,
                Ok(Err(e)) => {
                    let sent = lane
                        .send_error
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take();
                    return Err(BenchError::RawTcp {
                        addr: self.addr,
                        stream: i,
                        source: sent.unwrap_or(e),
                    });
                }
                Err(_) => return Err(ended(self.addr, i)),
            };
            for (&(b, ..), &t) in requests.iter().zip(&arrived) {
                self.arrived[b] = self.arrived[b].max(t);
            }
        }
        lat.extend(self.arrived.iter().map(|&t| t - t0));
        Ok(())
    }

    /// Fills the streams' shares of one batch of `batch` blocks per group:
    /// each block split into requests of at most `chunk` bytes, striped
    /// over its group's streams like the tcp backend stripes a peer's
    /// requests (`PeerConn::add_chunk`): the streams take turns every
    /// `chunk` bytes queued, so a run of small blocks stays on one stream
    /// and each full-size request gets one to itself. Block `b` is at
    /// `b * block` here and at `(b mod slots) * block` in the server's
    /// memory of `slots` blocks. Returns the groups.
    fn deal(&mut self, block: u64, batch: usize) -> usize {
        let per = self.per_group;
        let groups = self.lanes.len() / per;
        let slots = (self.served / block.max(1)).max(1);
        for lane in &mut self.lanes {
            lane.requests.clear();
        }
        for g in 0..groups {
            for i in 0..batch {
                let b = g * batch + i;
                let mut done = 0;
                while done < block {
                    let len = (block - done).min(self.chunk);
                    let at = self.striped[g];
                    self.striped[g] += len;
                    let turn = (at / self.chunk) as usize % per;
                    let remote = (b as u64 % slots) * block + done;
                    self.lanes[g * per + turn].requests.push((
                        b,
                        b as u64 * block + done,
                        remote,
                        len,
                    ));
                    done += len;
                }
            }
        }
        groups
    }
}

fn ended(addr: SocketAddr, stream: usize) -> BenchError {
    BenchError::RawTcp {
        addr,
        stream,
        source: io::Error::other("the stream's thread ended"),
    }
}

impl Drop for RawClient {
    /// Closes the streams between requests (the server sees a clean end)
    /// and joins their threads.
    fn drop(&mut self) {
        for (i, lane) in self.lanes.drain(..).enumerate() {
            let Lane {
                send,
                receive,
                threads,
                ..
            } = lane;
            drop((send, receive));
            for t in threads {
                if t.join().is_err() {
                    tracing::error!(addr = %self.addr, stream = i, "raw-tcp stream thread panicked");
                }
            }
        }
    }
}

impl Lane {
    /// A stream to `addr` and its threads; with the bytes the server
    /// serves.
    fn start(addr: SocketAddr, i: usize) -> io::Result<(Self, u64)> {
        let (stream, served) = hello(addr)?;
        let (send, sends) = mpsc::channel::<Work>();
        let (receive, receives) = mpsc::channel::<Work>();
        let (answered, done) = mpsc::channel();
        let send_error = Arc::new(Mutex::new(None));
        let (out, failed) = (stream.try_clone()?, send_error.clone());
        let sender = thread::Builder::new()
            .name(format!("kvlane-raw-tx-{i}"))
            .spawn(move || {
                let mut w = FrameWriter::new(&out);
                for (op, requests, payload) in sends {
                    if let Err(e) = send_all(&mut w, op, &requests, &payload) {
                        *failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                        // Ends the receiver's wait too.
                        out.shutdown(Shutdown::Both).ok();
                        return;
                    }
                }
            })?;
        let receiver = thread::Builder::new()
            .name(format!("kvlane-raw-rx-{i}"))
            .spawn(move || {
                let mut r = FrameReader::new(&stream);
                for (op, requests, sink) in receives {
                    let got = receive_all(&mut r, op, &requests, &sink);
                    if got.is_err() {
                        // Ends a sender stuck on a stream nobody reads.
                        stream.shutdown(Shutdown::Both).ok();
                    }
                    let failed = got.is_err();
                    if answered.send(got).is_err() || failed {
                        return;
                    }
                }
            })?;
        let lane = Self {
            send,
            receive,
            done,
            send_error,
            requests: Vec::new(),
            in_flight: None,
            threads: [sender, receiver],
        };
        Ok((lane, served))
    }
}

/// Connects to `addr` and checks that a raw-tcp server answers there;
/// with the bytes of memory it serves.
fn hello(addr: SocketAddr) -> io::Result<(TcpStream, u64)> {
    let mut s = TcpStream::connect_timeout(&addr, HELLO_TIMEOUT)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(HELLO_TIMEOUT))?;
    s.write_all(&MAGIC)?;
    let mut magic = [0; MAGIC.len()];
    let mut served = [0; 8];
    match s.read_exact(&mut magic) {
        Ok(()) if magic == MAGIC => {}
        Ok(()) if magic.starts_with(b"kvlraw/") => {
            return Err(invalid(format!(
                "a raw-tcp server of another version ({}; this is {})",
                String::from_utf8_lossy(&magic),
                String::from_utf8_lossy(&MAGIC)
            )))
        }
        Ok(()) => return Err(invalid("not a kvlane raw-tcp server (wrong hello)".into())),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("no raw-tcp hello (is this a kvlane bench target?): {e}"),
            ))
        }
    }
    s.read_exact(&mut served)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok((s, u64::from_le_bytes(served)))
}

/// Sends `requests` (with their payload for WRITE) back to back, gathered
/// into as few writes as the backend's sender would use.
fn send_all(
    w: &mut FrameWriter<'_>,
    op: Op,
    requests: &[Request],
    payload: &Region,
) -> io::Result<()> {
    for &(_, at, remote, len) in requests {
        w.put(&header(op, remote, len));
        if op == Op::Write {
            w.region(payload, at, len)?;
        }
        if w.is_full() {
            w.flush()?;
        }
    }
    w.flush()
}

/// Reads the answers to `requests`, in order, and when each arrived.
fn receive_all(
    r: &mut FrameReader<'_>,
    op: Op,
    requests: &[Request],
    sink: &Region,
) -> io::Result<Vec<Instant>> {
    let mut arrived = Vec::with_capacity(requests.len());
    for &(_, at, _, len) in requests {
        match op {
            Op::Write => {
                let mut ack = [0; 8];
                r.payload(&mut ack)?;
                if u64::from_le_bytes(ack) != len {
                    return Err(invalid(format!(
                        "acknowledged {} bytes of a {len}-byte write",
                        u64::from_le_bytes(ack)
                    )));
                }
            }
            Op::Read => r.payload_into(sink, at, len)?,
        }
        arrived.push(Instant::now());
    }
    Ok(arrived)
}

#[cfg(test)]
mod tests {
    use super::super::RawServer;
    use super::*;

    /// Per stream: the block of each request dealt to it.
    fn dealt(c: &RawClient) -> Vec<Vec<usize>> {
        c.lanes
            .iter()
            .map(|l| l.requests.iter().map(|r| r.0).collect())
            .collect()
    }

    #[test]
    fn requests_are_striped_like_the_tcp_backend_stripes_them() {
        let memory = buffer(8 << 20, 0).unwrap();
        let server = RawServer::bind("127.0.0.1:0", memory).unwrap();
        let mut c = RawClient::connect(server.local_addr(), 1).unwrap();
        let streams = c.streams();
        assert!(streams >= 2, "{streams}");
        let chunk = c.chunk;
        // Small blocks: one chunk's worth stays on one stream, and the
        // next batch goes on where this one stopped.
        let per_chunk = (chunk / 4096) as usize;
        c.deal(4096, per_chunk);
        let mut one = vec![Vec::new(); streams];
        one[0] = (0..per_chunk).collect();
        assert_eq!(dealt(&c), one);
        c.deal(4096, 1);
        let mut next = vec![Vec::new(); streams];
        next[1] = vec![0];
        assert_eq!(dealt(&c), next);
        // Blocks of two chunks and a bit: every chunk gets a stream to
        // itself, and a bit shares the stream of the chunk after it.
        let mut c = RawClient::connect(server.local_addr(), 1).unwrap();
        c.deal(2 * chunk + 1, 2);
        let requests: Vec<Vec<u64>> = c
            .lanes
            .iter()
            .map(|l| l.requests.iter().map(|r| r.3).collect())
            .collect();
        assert_eq!(streams, 4, "the tcp default this case is written for");
        assert_eq!(
            requests,
            [vec![chunk, 1], vec![chunk], vec![1, chunk], vec![chunk]]
        );
        assert_eq!(dealt(&c), [vec![0, 1], vec![0], vec![0, 1], vec![1]]);
    }

    #[test]
    fn blocks_lie_in_the_server_memory_as_in_the_target_pool() {
        // 8 MiB served: 1 MiB blocks wrap after 8, as the target's pool
        // slots do; here the batch's blocks lie end to end.
        let server = RawServer::bind("127.0.0.1:0", buffer(8 << 20, 0).unwrap()).unwrap();
        let mut c = RawClient::connect(server.local_addr(), 1).unwrap();
        assert_eq!(c.served, 8 << 20);
        let mb = 1u64 << 20;
        c.deal(mb, 10);
        let mut placed: Vec<(usize, u64, u64, u64)> =
            c.lanes.iter().flat_map(|l| l.requests.clone()).collect();
        placed.sort();
        let half = c.chunk.min(mb);
        let expect: Vec<_> = (0..10usize)
            .flat_map(|b| {
                (0..mb / half).map(move |k| {
                    let b64 = b as u64;
                    (b, b64 * mb + k * half, (b64 % 8) * mb + k * half, half)
                })
            })
            .collect();
        assert_eq!(placed, expect);
        // A block larger than the served memory is refused, naming both.
        let slice = Slice {
            time: Duration::ZERO,
            batches: 1,
            limit: Duration::from_secs(60),
        };
        let Err(e) = c.measure(Op::Read, 16 << 20, 1, slice, false) else {
            panic!("a 16 MiB block measured against 8 MiB served");
        };
        let text = e.to_string()
            + &std::error::Error::source(&e)
                .map(|s| s.to_string())
                .unwrap_or_default();
        assert!(
            text.contains("16777216") && text.contains("8388608"),
            "{text}"
        );
    }
}
