//! The measuring end of the raw-tcp baseline: `groups` x
//! `TcpConfig::default().streams` streams, one thread each, and batches of
//! blocks split and striped over them the way the tcp backend splits and
//! stripes a peer's transfers.

use super::{buffer, header, invalid, read_into, HELLO_TIMEOUT, MAGIC};
use crate::bench::schedule::{run_for, Slice};
use crate::bench::stats::Sample;
use crate::bench::BenchError;
use kvlane_data::tcp::{FrameReader, FrameWriter, TcpConfig};
use kvlane_data::{Op, Region};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Requests in flight per stream: enough that the link, not round trips,
/// limits (64 x 4 KiB already outlasts a loopback round trip), few enough
/// that requests and acknowledgements (9 and 8 bytes each) never fill a
/// socket buffer, which could stall both sides at once.
const WINDOW: usize = 64;

/// A stalled link fails the baseline after this long instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// One stream's share of a batch: `(block index, request length)` each,
/// sent in order; `arrived` is when each was answered.
struct Job {
    op: Op,
    requests: Vec<(usize, u64)>,
    arrived: Vec<Instant>,
}

impl Job {
    fn new(op: Op) -> Self {
        Self {
            op,
            requests: Vec::new(),
            arrived: Vec::new(),
        }
    }
}

struct Lane {
    jobs: Sender<Job>,
    done: Receiver<io::Result<Job>>,
    /// The job buffers while this lane is idle (reused batch after batch).
    spare: Option<Job>,
    busy: bool,
    thread: JoinHandle<()>,
}

/// Streams to a [`super::RawServer`], in groups: a group is what one
/// initiator thread of the tcp backend would open to its peer.
pub(crate) struct RawClient {
    addr: SocketAddr,
    per_group: usize,
    /// Largest request: the tcp backend's `chunk_bytes`.
    chunk: u64,
    lanes: Vec<Lane>,
    /// When each block of the batch in progress had all its bytes.
    arrived: Vec<Instant>,
    /// Bytes queued so far per group: picks the stream.
    striped: Vec<u64>,
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
        let lanes = (0..groups.max(1) * per_group)
            .map(|i| Lane::start(addr, i, tcp.chunk_bytes as usize).map_err(|e| fail(i, e)))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            addr,
            per_group,
            chunk: tcp.chunk_bytes,
            lanes,
            arrived: Vec::new(),
            striped: vec![0; groups.max(1)],
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
        let groups = self.deal(op, block, batch);
        let t0 = Instant::now();
        self.arrived.clear();
        self.arrived.resize(groups * batch, t0);
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let Some(job) = lane.spare.take_if(|j| !j.requests.is_empty()) else {
                continue;
            };
            lane.jobs.send(job).map_err(|_| ended(self.addr, i))?;
            lane.busy = true;
        }
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            if !std::mem::take(&mut lane.busy) {
                continue;
            }
            let job = match lane.done.recv() {
                Ok(Ok(job)) => job,
                Ok(Err(source)) => {
                    return Err(BenchError::RawTcp {
                        addr: self.addr,
                        stream: i,
                        source,
                    })
                }
                Err(_) => return Err(ended(self.addr, i)),
            };
            for (&(b, _), &t) in job.requests.iter().zip(&job.arrived) {
                self.arrived[b] = self.arrived[b].max(t);
            }
            lane.spare = Some(job);
        }
        lat.extend(self.arrived.iter().map(|&t| t - t0));
        Ok(())
    }

    /// Fills the streams' jobs for one batch of `batch` blocks per group:
    /// each block split into requests of at most `chunk` bytes, striped
    /// over its group's streams like the tcp backend stripes a peer's
    /// requests (`PeerConn::add_chunk`): the streams take turns every
    /// `chunk` bytes queued, so a run of small blocks stays on one stream
    /// and each full-size request gets one to itself. Returns the groups.
    fn deal(&mut self, op: Op, block: u64, batch: usize) -> usize {
        let per = self.per_group;
        let groups = self.lanes.len() / per;
        for lane in &mut self.lanes {
            let job = lane.spare.get_or_insert_with(|| Job::new(op));
            job.op = op;
            job.requests.clear();
        }
        for g in 0..groups {
            for i in 0..batch {
                let mut left = block;
                while left > 0 {
                    let len = left.min(self.chunk);
                    let at = self.striped[g];
                    self.striped[g] += len;
                    let turn = (at / self.chunk) as usize % per;
                    let lane = &mut self.lanes[g * per + turn];
                    let job = lane.spare.get_or_insert_with(|| Job::new(op));
                    job.requests.push((g * batch + i, len));
                    left -= len;
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
            let Lane { jobs, thread, .. } = lane;
            drop(jobs);
            if thread.join().is_err() {
                tracing::error!(addr = %self.addr, stream = i, "raw-tcp stream thread panicked");
            }
        }
    }
}

impl Lane {
    fn start(addr: SocketAddr, i: usize, chunk: usize) -> io::Result<Self> {
        let stream = hello(addr)?;
        let payload = buffer(chunk, 0x5a)?;
        let sink = buffer(chunk, 0)?;
        let (jobs, rx) = mpsc::channel();
        let (tx, done) = mpsc::channel();
        let thread = thread::Builder::new()
            .name(format!("kvlane-raw-{i}"))
            .spawn(move || {
                let mut io = StreamIo {
                    r: FrameReader::new(&stream),
                    w: FrameWriter::new(&stream),
                    payload: &payload,
                    sink: &sink,
                };
                for mut job in rx {
                    let r = io.run(&mut job);
                    let failed = r.is_err();
                    if tx.send(r.map(|()| job)).is_err() || failed {
                        return;
                    }
                }
            })?;
        Ok(Self {
            jobs,
            done,
            spare: None,
            busy: false,
            thread,
        })
    }
}

/// Connects to `addr` and checks that a raw-tcp server answers there.
fn hello(addr: SocketAddr) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, HELLO_TIMEOUT)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(HELLO_TIMEOUT))?;
    s.write_all(&MAGIC)?;
    let mut magic = [0; MAGIC.len()];
    match s.read_exact(&mut magic) {
        Ok(()) if magic == MAGIC => {}
        Ok(()) => return Err(invalid("not a kvlane raw-tcp server (wrong hello)".into())),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("no raw-tcp hello (is this a kvlane bench target?): {e}"),
            ))
        }
    }
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// One stream's two directions and buffers.
struct StreamIo<'a> {
    r: FrameReader<'a>,
    w: FrameWriter<'a>,
    /// WRITE payload (requests are at most this long).
    payload: &'a Region,
    /// Where READ payload lands.
    sink: &'a Region,
}

impl StreamIo<'_> {
    /// Sends the job's requests, at most `WINDOW` ahead of the answers,
    /// and times each answer.
    fn run(&mut self, job: &mut Job) -> io::Result<()> {
        let op = job.op;
        job.arrived.clear();
        let n = job.requests.len();
        let (mut sent, mut got) = (0, 0);
        while got < n {
            let upto = n.min(got + WINDOW);
            if sent < upto {
                self.send(op, &job.requests[sent..upto])?;
                sent = upto;
            }
            let len = job.requests[got].1;
            match op {
                Op::Write => {
                    let mut ack = [0; 8];
                    self.r.payload(&mut ack)?;
                    if u64::from_le_bytes(ack) != len {
                        return Err(invalid(format!(
                            "acknowledged {} bytes of a {len}-byte write",
                            u64::from_le_bytes(ack)
                        )));
                    }
                }
                Op::Read => read_into(&mut self.r, self.sink, len)?,
            }
            job.arrived.push(Instant::now());
            got += 1;
        }
        Ok(())
    }

    /// Sends `requests` (with their payload for WRITE), gathered into as
    /// few writes as the backend's sender would use.
    fn send(&mut self, op: Op, requests: &[(usize, u64)]) -> io::Result<()> {
        for &(_, len) in requests {
            self.w.put(&header(op, len));
            if op == Op::Write {
                self.w.region(self.payload, 0, len)?;
            }
            if self.w.is_full() {
                self.w.flush()?;
            }
        }
        self.w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::super::RawServer;
    use super::*;

    /// Per stream: the block of each request dealt to it.
    fn dealt(c: &RawClient) -> Vec<Vec<usize>> {
        c.lanes
            .iter()
            .map(|l| {
                l.spare
                    .iter()
                    .flat_map(|j| j.requests.iter().map(|r| r.0))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn requests_are_striped_like_the_tcp_backend_stripes_them() {
        let server = RawServer::bind("127.0.0.1:0").unwrap();
        let mut c = RawClient::connect(server.local_addr(), 1).unwrap();
        let streams = c.streams();
        assert!(streams >= 2, "{streams}");
        let chunk = c.chunk;
        // Small blocks: one chunk's worth stays on one stream, and the
        // next batch goes on where this one stopped.
        let per_chunk = (chunk / 4096) as usize;
        c.deal(Op::Write, 4096, per_chunk);
        let mut one = vec![Vec::new(); streams];
        one[0] = (0..per_chunk).collect();
        assert_eq!(dealt(&c), one);
        c.deal(Op::Write, 4096, 1);
        let mut next = vec![Vec::new(); streams];
        next[1] = vec![0];
        assert_eq!(dealt(&c), next);
        // Blocks of two chunks and a bit: every chunk gets a stream to
        // itself, and a bit shares the stream of the chunk after it.
        let mut c = RawClient::connect(server.local_addr(), 1).unwrap();
        c.deal(Op::Read, 2 * chunk + 1, 2);
        let requests: Vec<Vec<u64>> = c
            .lanes
            .iter()
            .map(|l| {
                l.spare
                    .iter()
                    .flat_map(|j| j.requests.iter().map(|r| r.1))
                    .collect()
            })
            .collect();
        assert_eq!(streams, 4, "the tcp default this case is written for");
        assert_eq!(
            requests,
            [vec![chunk, 1], vec![chunk], vec![1, chunk], vec![chunk]]
        );
        assert_eq!(dealt(&c), [vec![0, 1], vec![0], vec![0, 1], vec![1]]);
    }
}
