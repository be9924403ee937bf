//! The sink and source end of the raw-tcp baseline: one thread per
//! connection, in-process for the local bench, beside the agent for
//! `--role target`.

use super::{invalid, parse_header, HEADER_LEN, HELLO_TIMEOUT, IO_CHUNK, MAGIC};
use kvlane_data::Op;
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Connections served at once; more are closed at once. Many times what an
/// initiator opens (4 streams per thread), few enough that a stray client
/// cannot pile up threads.
const MAX_CONNECTIONS: usize = 256;

/// How often the listener looks for a connection (and for the stop flag);
/// it delays only the opening of the baseline's streams.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// A raw-tcp sink and source, listening until dropped.
pub(crate) struct RawServer {
    addr: SocketAddr,
    state: Arc<State>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct State {
    stop: AtomicBool,
    /// Open connections (clones, to close them when the server goes).
    conns: Mutex<HashMap<u64, TcpStream>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RawServer {
    /// Listens on `addr` (port 0: any free port; see [`Self::local_addr`]).
    pub(crate) fn bind(addr: impl ToSocketAddrs) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        // Polled, so that dropping the server needs only the stop flag.
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
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
                match serve(stream) {
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
/// protocol or the connection (`Err`).
fn serve(stream: TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut r = BufReader::with_capacity(64 << 10, stream.try_clone()?);
    let mut w = BufWriter::with_capacity(64 << 10, stream);
    let mut magic = [0; MAGIC.len()];
    r.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(invalid(
            "no raw-tcp hello: not a kvlane bench client".into(),
        ));
    }
    w.write_all(&MAGIC)?;
    w.flush()?;
    // Between the slices of other points a client stays silent for long.
    w.get_ref().set_read_timeout(None)?;
    let mut sink = vec![0u8; IO_CHUNK];
    let source = vec![0xa5u8; IO_CHUNK];
    loop {
        // Answers go out together, but before this side could block.
        if r.buffer().is_empty() {
            w.flush()?;
        }
        let Some(h) = read_header(&mut r)? else {
            return Ok(());
        };
        let (op, mut left) = parse_header(&h)?;
        let len = left;
        while left > 0 {
            let n = left.min(IO_CHUNK as u64) as usize;
            match op {
                Op::Write => r.read_exact(&mut sink[..n])?,
                Op::Read => w.write_all(&source[..n])?,
            }
            left -= n as u64;
        }
        if op == Op::Write {
            w.write_all(&len.to_le_bytes())?;
        }
    }
}

/// The next request header; `None` when the client closed the connection
/// between requests.
fn read_header(r: &mut impl Read) -> io::Result<Option<[u8; HEADER_LEN]>> {
    let mut h = [0; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(h))
}
