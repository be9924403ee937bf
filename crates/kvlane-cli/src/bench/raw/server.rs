//! The serving end of the raw-tcp baseline: one thread per connection,
//! in-process for the local bench, beside the agent for `--role target`,
//! every connection reading and writing the one memory it was given.

use super::{invalid, parse_header, HEADER_LEN, HELLO_TIMEOUT, IO_CHUNK, MAGIC};
use kvlane_data::tcp::{FrameReader, FrameWriter};
use kvlane_data::{Op, Region};
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Connections served at once; more are closed at once. Many times what an
/// initiator opens (4 streams per thread), few enough that a stray client
/// cannot pile up threads.
const MAX_CONNECTIONS: usize = 256;

/// Answers are flushed at the latest once they cover this many payload
/// bytes, even while more requests wait (the tcp server's `ACK_BATCH`).
const ACK_BATCH: u64 = 1 << 20;

/// How often the listener looks for a connection (and for the stop flag);
/// it delays only the opening of the baseline's streams.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// A raw-tcp server of one memory, listening until dropped.
pub(crate) struct RawServer {
    addr: SocketAddr,
    state: Arc<State>,
    accept: Option<JoinHandle<()>>,
}

struct State {
    stop: AtomicBool,
    /// What WRITEs land in and READs come from (host memory).
    memory: Region,
    /// Open connections (clones, to close them when the server goes).
    conns: Mutex<HashMap<u64, TcpStream>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RawServer {
    /// Listens on `addr` (port 0: any free port; see [`Self::local_addr`])
    /// and serves `memory`, which must be host memory.
    pub(crate) fn bind(addr: impl ToSocketAddrs, memory: Region) -> io::Result<Self> {
        if memory.device().is_some() {
            return Err(invalid(
                "the raw-tcp baseline serves host memory only".into(),
            ));
        }
        let listener = TcpListener::bind(addr)?;
        // Polled, so that dropping the server needs only the stop flag.
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            stop: AtomicBool::new(false),
            memory,
            conns: Mutex::new(HashMap::new()),
        });
        let s = state.clone();
        let accept = thread::Builder::new()
            .name("kvlane-raw-accept".into())
            .spawn(move || accept_loop(&listener, &s))?;
        Ok(Self {
            addr,
            state,
            accept: Some(accept),
        })
    }

    /// The address it listens on, with the real port.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(Err(_)) = self.accept.take().map(JoinHandle::join) {
            tracing::error!(addr = %self.addr, "raw-tcp listener thread panicked");
        }
        for (_, s) in lock(&self.state.conns).drain() {
            // Closing what may already be closed: nothing to report.
            s.shutdown(Shutdown::Both).ok();
        }
    }
}

fn accept_loop(listener: &TcpListener, state: &Arc<State>) {
    let mut next_id = 0u64;
    while !state.stop.load(Ordering::Acquire) {
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "raw-tcp accept failed");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        {
            let mut conns = lock(&state.conns);
            if conns.len() >= MAX_CONNECTIONS {
                tracing::warn!(%from, cap = MAX_CONNECTIONS, "raw-tcp connection cap reached");
                continue;
            }
            match stream.try_clone() {
                Ok(c) => conns.insert(id, c),
                Err(e) => {
                    tracing::warn!(%from, error = %e, "raw-tcp connection dropped");
                    continue;
                }
            };
        }
        let st = state.clone();
        let spawned = thread::Builder::new()
            .name("kvlane-raw-conn".into())
            .spawn(move || {
                match serve(stream, &st.memory) {
                    Ok(()) => tracing::debug!(%from, "raw-tcp client closed the connection"),
                    Err(e) if st.stop.load(Ordering::Acquire) => {
                        tracing::debug!(%from, error = %e, "raw-tcp connection closed at shutdown")
                    }
                    Err(e) => tracing::warn!(%from, error = %e, "raw-tcp connection failed"),
                }
                lock(&st.conns).remove(&id);
            });
        if let Err(e) = spawned {
            tracing::warn!(%from, error = %e, "raw-tcp connection dropped: no thread");
            lock(&state.conns).remove(&id);
        }
    }
}

/// Serves one connection until the client closes it (`Ok`) or breaks the
/// protocol or the connection (`Err`): a request outside `memory` is a
/// broken protocol. Answers gather and leave together, in order, as the
/// tcp backend's server sends them.
fn serve(stream: TcpStream, memory: &Region) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut rd = FrameReader::new(&stream);
    let mut wr = FrameWriter::new(&stream);
    let mut magic = [0; MAGIC.len()];
    rd.header(&mut magic)?;
    if magic != MAGIC {
        return Err(invalid(
            "no raw-tcp hello: not a kvlane bench client".into(),
        ));
    }
    wr.put(&MAGIC);
    wr.put(&memory.len().to_le_bytes());
    wr.flush()?;
    // Between the slices of other points a client stays silent for long.
    stream.set_read_timeout(None)?;
    // Payload bytes answered but not yet flushed.
    let mut unflushed = 0u64;
    loop {
        // The tcp server's rule: flush before this side would block, or
        // once the answers cover `ACK_BATCH` bytes.
        if wr.buffered() > 0 && (unflushed >= ACK_BATCH || rd.would_block()) {
            wr.flush()?;
            unflushed = 0;
        }
        let mut h = [0; HEADER_LEN];
        match rd.header(&mut h) {
            Ok(()) => {}
            // Closed between requests (or within a header: nothing to
            // answer either way).
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return wr.flush(),
            Err(e) => return Err(e),
        }
        let (op, offset, len) = parse_header(&h)?;
        memory
            .check_range(offset, len)
            .map_err(|e| invalid(format!("a request outside the memory served: {e}")))?;
        unflushed += len;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(IO_CHUNK as u64);
            match op {
                Op::Write => rd.payload_into(memory, offset + done, n)?,
                Op::Read => wr.region(memory, offset + done, n)?,
            }
            done += n;
        }
        if op == Op::Write {
            wr.put(&len.to_le_bytes());
        }
        if wr.is_full() {
            wr.flush()?;
            unflushed = 0;
        }
    }
}
