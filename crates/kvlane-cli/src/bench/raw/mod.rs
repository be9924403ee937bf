//! The `raw-tcp` baseline: what plain TCP streams do on the same link, in
//! the same shapes as the tcp backend's one-sided operations.
//!
//! A [`RawServer`] serves memory it is given (the target's own: the
//! agent's pool with `--role target`, the backend pair's target region
//! locally); a [`RawClient`] opens as many streams to it as the tcp
//! backend opens to a peer (`TcpConfig::default().streams` per initiator
//! thread), with a sender and a receiver thread per stream on its side
//! and one thread per connection on the server's (blocking I/O with a
//! thread always waiting on each socket: a ceiling; the backend drives
//! the same streams from its event-driven I/O threads), and splits and
//! stripes blocks over them as the backend does. Per stream, once:
//!
//! ```text
//! client -> server  MAGIC                  (8 bytes)
//! server -> client  MAGIC len:u64le        the bytes of memory it serves
//! ```
//!
//! then requests, answered in order:
//!
//! ```text
//! client -> server  'w' offset:u64le len:u64le payload  WRITE-shaped: the block out,
//! server -> client  len:u64le                           a small acknowledgement back
//! client -> server  'r' offset:u64le len:u64le          READ-shaped: a small request out,
//! server -> client  payload                             the block back
//! ```
//!
//! A block lands in (or comes from) the server's memory where the
//! backend's target keeps it: block `i` at `(i mod slots) x block`, with
//! `slots` the blocks that memory holds. Both ends read and write with
//! the tcp backend's own framed I/O ([`kvlane_data::tcp::FrameReader`]
//! and [`FrameWriter`]: headers through a buffer, payloads straight
//! between socket and memory, gathered writes), so the ceiling differs
//! from the backend only by what the backend adds.
//!
//! Until 2026-12 the server sank and sourced one 2 MiB buffer per
//! connection, which stays in cache while the target's memory of a 1 MiB
//! batch (128 MiB) does not: on this 2-core VM that made the ceiling
//! 10-20% higher at 64 KiB and 1 MiB than the same bytes in the target's
//! memory (raw-tcp 1 MiB WRITE 5.35-5.42 against 4.50-4.58 GB/s, READ
//! 4.67-4.84 against 4.09-4.19, two runs each; `kvlane bench --role
//! initiator`, 128-block batches), a gap the backend can never close.
//!
//! [`FrameWriter`]: kvlane_data::tcp::FrameWriter

mod client;
mod server;

pub(crate) use client::RawClient;
pub(crate) use server::RawServer;

use kvlane_data::{Access, Op, Region};
use std::io;
use std::time::Duration;

/// The first bytes either side sends: the service and its version.
const MAGIC: [u8; 8] = *b"kvlraw/2";
/// A request: its kind, its offset in the server's memory and its length.
const HEADER_LEN: usize = 17;
const WRITE: u8 = b'w';
const READ: u8 = b'r';
/// Largest request the server takes (the tcp backend's cap on a chunk).
const MAX_REQUEST: u64 = 64 << 20;
/// Unit of the server's reads and writes of payload.
const IO_CHUNK: usize = 1 << 20;
/// How long a side waits for the other's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

fn header(op: Op, offset: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    h[0] = match op {
        Op::Write => WRITE,
        Op::Read => READ,
    };
    h[1..9].copy_from_slice(&offset.to_le_bytes());
    h[9..].copy_from_slice(&len.to_le_bytes());
    h
}

/// A request's kind, offset and length; the length is capped here, the
/// span is checked against the server's memory by the server.
fn parse_header(h: &[u8; HEADER_LEN]) -> io::Result<(Op, u64, u64)> {
    let word = |at: usize| {
        let mut w = [0; 8];
        w.copy_from_slice(&h[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let (offset, len) = (word(1), word(9));
    let op = match h[0] {
        WRITE => Op::Write,
        READ => Op::Read,
        k => return Err(invalid(format!("unknown request kind {k:#04x}"))),
    };
    if len > MAX_REQUEST {
        return Err(invalid(format!(
            "a {len}-byte request, more than {MAX_REQUEST}"
        )));
    }
    Ok((op, offset, len))
}

/// Memory the baseline sends from or reads into: `len` bytes of `byte`,
/// allocated as at least 2 MiB, the size from which `Region::alloc` maps
/// huge pages, as it does for the backends' regions. Reading into a 1 MiB
/// `Vec` (4 KiB pages) instead, the raw server's copies from the socket
/// took 7.7% of a 1 MiB WRITE run's CPU samples; into this, 4.2% (perf,
/// this 2-core host, about the same bytes).
fn buffer(len: usize, byte: u8) -> io::Result<Region> {
    let len = len.max(2 << 20);
    let r = Region::alloc(len, Access::ALL).map_err(io::Error::other)?;
    r.fill(0, len as u64, byte).map_err(io::Error::other)?;
    Ok(r)
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    /// A server of `len` bytes, every byte its offset mod 251.
    fn server(len: usize) -> (RawServer, Region) {
        let memory = buffer(len, 0).unwrap();
        let pattern: Vec<u8> = (0..memory.len() as usize)
            .map(|i| (i % 251) as u8)
            .collect();
        memory.write(0, &pattern).unwrap();
        let s = RawServer::bind("127.0.0.1:0", memory.clone()).unwrap();
        (s, memory)
    }

    fn hello(addr: std::net::SocketAddr) -> (TcpStream, u64) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&MAGIC).unwrap();
        let mut m = [0; 16];
        s.read_exact(&mut m).unwrap();
        assert_eq!(m[..8], MAGIC);
        (s, u64::from_le_bytes(m[8..].try_into().unwrap()))
    }

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        for (op, offset, len) in [
            (Op::Read, 0, 0),
            (Op::Write, 3 << 20, 512 << 10),
            (Op::Read, u64::MAX, MAX_REQUEST),
        ] {
            assert_eq!(
                parse_header(&header(op, offset, len)).unwrap(),
                (op, offset, len)
            );
        }
        assert!(parse_header(&header(Op::Write, 0, MAX_REQUEST + 1)).is_err());
        let mut h = header(Op::Read, 0, 1);
        h[0] = b'x';
        assert!(parse_header(&h).is_err());
    }

    #[test]
    fn the_server_reads_and_writes_its_memory_at_the_requested_offsets() {
        let len = 4 * IO_CHUNK;
        let (server, memory) = server(len);
        let (mut s, served) = hello(server.local_addr());
        assert_eq!(served, len as u64);
        // READ of 2 MiB + 1 byte at 1 MiB - 7: exactly those bytes of the
        // server's memory come back.
        let (at, n) = (IO_CHUNK as u64 - 7, 2 * IO_CHUNK as u64 + 1);
        s.write_all(&header(Op::Read, at, n)).unwrap();
        let mut got = vec![0; n as usize];
        s.read_exact(&mut got).unwrap();
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, &b)| b == ((at as usize + i) % 251) as u8));
        // WRITE of 1000 bytes at 12345, then one of none: each
        // acknowledged with its length, in order, and the 1000 bytes are in
        // the server's memory there (and nowhere else).
        s.write_all(&header(Op::Write, 12345, 1000)).unwrap();
        s.write_all(&[7; 1000]).unwrap();
        s.write_all(&header(Op::Write, 0, 0)).unwrap();
        let mut acks = [0; 16];
        s.read_exact(&mut acks).unwrap();
        assert_eq!(acks[..8], 1000u64.to_le_bytes());
        assert_eq!(acks[8..], 0u64.to_le_bytes());
        let mut back = vec![0; 1002];
        memory.read(12344, &mut back).unwrap();
        assert_eq!(back[0], (12344 % 251) as u8);
        assert!(back[1..1001].iter().all(|&b| b == 7));
        assert_eq!(back[1001], (13345 % 251) as u8);
        // A request past the cap ends the connection.
        s.write_all(&header(Op::Read, 0, MAX_REQUEST + 1)).unwrap();
        assert_eq!(s.read(&mut acks).unwrap_or(0), 0);
    }

    #[test]
    fn a_request_outside_the_served_memory_ends_the_connection() {
        let (server, memory) = server(2 << 20);
        let size = memory.len();
        for (at, n) in [(size - 10, 11), (size, 1), (u64::MAX - 3, 8)] {
            let (mut s, _) = hello(server.local_addr());
            s.write_all(&header(Op::Write, at, n)).unwrap();
            s.write_all(&vec![1; n as usize]).ok();
            let mut b = [0; 8];
            assert_eq!(s.read(&mut b).unwrap_or(0), 0, "{at}+{n}");
        }
        // Nothing landed: the last bytes are still the pattern.
        let mut tail = [0; 10];
        memory.read(size - 10, &mut tail).unwrap();
        assert!(tail
            .iter()
            .enumerate()
            .all(|(i, &b)| b == ((size as usize - 10 + i) % 251) as u8));
    }

    #[test]
    fn a_client_times_every_block_of_every_group() {
        use crate::bench::schedule::Slice;
        let (server, _) = server(8 << 20);
        let mut c = RawClient::connect(server.local_addr(), 2).unwrap();
        let streams = kvlane_data::tcp::TcpConfig::default().streams;
        assert_eq!(c.streams(), 2 * streams);
        let slice = Slice {
            time: Duration::ZERO,
            batches: 2,
            limit: Duration::from_secs(60),
        };
        // 1 MiB + 1 blocks: three requests each (512 KiB, 512 KiB, 1 byte).
        for op in [Op::Read, Op::Write] {
            let s = c.measure(op, (1 << 20) + 1, 3, slice, true).unwrap();
            // Two batches of three blocks per group, the warm-up not counted.
            assert_eq!(s.lat.len(), 2 * 3 * 2, "{op:?}");
            assert!(s.secs > 0.0 && s.lat.iter().all(|l| !l.is_zero()));
        }
    }

    #[test]
    fn a_client_refuses_a_port_that_is_not_a_raw_tcp_server() {
        // Something that accepts and answers, but not with the hello.
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = other.local_addr().unwrap();
        let answer = std::thread::spawn(move || {
            let (mut s, _) = other.accept().unwrap();
            s.write_all(b"SSH-2.0-x\r\n").unwrap();
            let mut buf = [0; 8];
            s.read_exact(&mut buf).ok();
        });
        let e = RawClient::connect(addr, 1).err().expect("connected");
        let text = e.to_string();
        assert!(
            text.contains(&addr.to_string()) && text.contains("not a kvlane raw-tcp server"),
            "{text}"
        );
        answer.join().unwrap();
    }

    #[test]
    fn the_server_drops_a_client_without_the_hello() {
        let (server, _) = server(2 << 20);
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut buf = [0; 8];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    }
}
