//! The `raw-tcp` baseline: what plain TCP streams do on the same link, in
//! the same shapes as the tcp backend's one-sided operations.
//!
//! A [`RawServer`] is a sink and a source; a [`RawClient`] opens as many
//! streams to it as the tcp backend opens to a peer
//! (`TcpConfig::default().streams` per initiator thread), with a sender
//! and a receiver thread per stream on its side and one thread per
//! connection on the server's (blocking I/O with a thread always waiting
//! on each socket: a ceiling; the backend drives the same streams from
//! its event-driven I/O threads), and splits and stripes blocks over them
//! as the backend does. Per stream, once:
//!
//! ```text
//! client -> server  MAGIC                  (8 bytes)
//! server -> client  MAGIC
//! ```
//!
//! then requests, answered in order:
//!
//! ```text
//! client -> server  'w' len:u64le payload  WRITE-shaped: the block out,
//! server -> client  len:u64le              a small acknowledgement back
//! client -> server  'r' len:u64le          READ-shaped: a small request out,
//! server -> client  payload                the block back
//! ```
//!
//! Both ends read and write with the tcp backend's own framed I/O
//! ([`kvlane_data::tcp::FrameReader`] and [`FrameWriter`]: headers through
//! a buffer, payloads straight between socket and memory, gathered
//! writes), so the ceiling differs from the backend only by what the
//! backend adds. The server serves no memory of anyone's: it discards what
//! it is sent and sends a fixed pattern.
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
const MAGIC: [u8; 8] = *b"kvlraw/1";
/// A request: its kind and its length.
const HEADER_LEN: usize = 9;
const WRITE: u8 = b'w';
const READ: u8 = b'r';
/// Largest request the server takes (the tcp backend's cap on a chunk).
const MAX_REQUEST: u64 = 64 << 20;
/// Unit of the server's reads and writes of payload.
const IO_CHUNK: usize = 1 << 20;
/// How long a side waits for the other's hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

fn header(op: Op, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    h[0] = match op {
        Op::Write => WRITE,
        Op::Read => READ,
    };
    h[1..].copy_from_slice(&len.to_le_bytes());
    h
}

fn parse_header(h: &[u8; HEADER_LEN]) -> io::Result<(Op, u64)> {
    let mut len = [0; 8];
    len.copy_from_slice(&h[1..]);
    let len = u64::from_le_bytes(len);
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
    Ok((op, len))
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

/// Reads `len` payload bytes into the start of `sink`.
fn read_into(
    rd: &mut kvlane_data::tcp::FrameReader<'_>,
    sink: &Region,
    len: u64,
) -> io::Result<()> {
    rd.payload_into(sink, 0, len)
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn hello(addr: std::net::SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&MAGIC).unwrap();
        let mut m = [0; 8];
        s.read_exact(&mut m).unwrap();
        assert_eq!(m, MAGIC);
        s
    }

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        for (op, len) in [
            (Op::Read, 0),
            (Op::Write, 512 << 10),
            (Op::Read, MAX_REQUEST),
        ] {
            assert_eq!(parse_header(&header(op, len)).unwrap(), (op, len));
        }
        assert!(parse_header(&header(Op::Write, MAX_REQUEST + 1)).is_err());
        let mut h = header(Op::Read, 1);
        h[0] = b'x';
        assert!(parse_header(&h).is_err());
    }

    #[test]
    fn the_server_sources_reads_and_acknowledges_writes_byte_for_byte() {
        let server = RawServer::bind("127.0.0.1:0").unwrap();
        let mut s = hello(server.local_addr());
        // READ of 3 MiB + 1 byte: exactly that many bytes come back.
        let len = 3 * IO_CHUNK as u64 + 1;
        s.write_all(&header(Op::Read, len)).unwrap();
        let mut got = vec![0; len as usize];
        s.read_exact(&mut got).unwrap();
        // WRITE of 1000 bytes, then one of none: each acknowledged with its
        // length, in order, and nothing else arrives in between.
        s.write_all(&header(Op::Write, 1000)).unwrap();
        s.write_all(&[7; 1000]).unwrap();
        s.write_all(&header(Op::Write, 0)).unwrap();
        let mut acks = [0; 16];
        s.read_exact(&mut acks).unwrap();
        assert_eq!(acks[..8], 1000u64.to_le_bytes());
        assert_eq!(acks[8..], 0u64.to_le_bytes());
        // A request past the cap ends the connection.
        s.write_all(&header(Op::Read, MAX_REQUEST + 1)).unwrap();
        assert_eq!(s.read(&mut acks).unwrap_or(0), 0);
    }

    #[test]
    fn a_client_times_every_block_of_every_group() {
        use crate::bench::schedule::Slice;
        let server = RawServer::bind("127.0.0.1:0").unwrap();
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
        let server = RawServer::bind("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut buf = [0; 8];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    }
}
