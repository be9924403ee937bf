//! A flood of unauthenticated hellos against a kvlane control listener
//! (issue 41, item 1): N TCP connections, each sends the ZMTP greeting of
//! a DEALER and one `hello` whose config fingerprint no node accepts, then
//! stays connected. Every connection the server closes (refused, evicted)
//! is opened again at once, so N stay open or queued for the whole run.
//!
//! ```sh
//! kvlane serve --listen 127.0.0.1:5555 &
//! cargo run --release -p kvlane-control --example hello_flood -- 127.0.0.1:5555 3000 30
//! # meanwhile, in another shell: kvlane ping 127.0.0.1:5555
//! ```
//!
//! Arguments: the listener's `host:port`, connections (default 3000),
//! seconds (default 30). Needs an fd limit above the connection count
//! (`ulimit -n`). Prints one line per second on stderr and a summary line
//! at the end: `hello_flood connections=N seconds=S opened=M`.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvlane_control::wire::{Hello, Identity, Message};

/// A ZMTP 3.0 greeting (NULL mechanism) and READY command of a DEALER.
fn zmtp_dealer_preamble() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    g.push(0x04);
    g.extend(u8::try_from(body.len()));
    g.extend_from_slice(&body);
    g
}

/// The preamble and one ZMTP frame holding a hello with a wrong fingerprint.
fn bad_hello() -> Result<Vec<u8>, String> {
    let hello = Message::Hello(Hello::new(
        Identity {
            engine_id: "mallory".into(),
            fingerprint: "not-the-fingerprint".into(),
            tp_size: 1,
            ..Default::default()
        },
        None,
        Vec::new(),
        None,
    ))
    .encode()
    .map_err(|e| format!("encode hello: {e}"))?;
    let len = u8::try_from(hello.len()).map_err(|_| "hello longer than a short frame")?;
    let mut bytes = zmtp_dealer_preamble();
    bytes.extend_from_slice(&[0x00, len]);
    bytes.extend_from_slice(&hello);
    Ok(bytes)
}

/// Opens one flood connection; `None` if the connect or write failed.
fn open(addr: &str, hello: &[u8]) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.write_all(hello).ok()?;
    s.set_nonblocking(true).ok()?;
    Some(s)
}

/// Whether the server closed `s` (without blocking).
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .ok_or("usage: hello_flood HOST:PORT [CONNECTIONS] [SECONDS]")?;
    let n: usize = match args.next() {
        Some(a) => a.parse().map_err(|e| format!("connections {a:?}: {e}"))?,
        None => 3000,
    };
    let secs: u64 = match args.next() {
        Some(a) => a.parse().map_err(|e| format!("seconds {a:?}: {e}"))?,
        None => 30,
    };
    let hello = bad_hello()?;
    let mut held: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut opened = 0u64;
    let mut report = start + Duration::from_secs(1);
    while Instant::now() < end {
        for slot in &mut held {
            if slot.as_mut().is_none_or(closed) {
                opened += 1;
                *slot = open(&addr, &hello);
            }
        }
        if Instant::now() >= report {
            let open_now = held.iter().filter(|s| s.is_some()).count();
            eprintln!(
                "hello_flood t={:.0}s open={open_now} opened={opened}",
                start.elapsed().as_secs_f64()
            );
            report += Duration::from_secs(1);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    println!("hello_flood connections={n} seconds={secs} opened={opened}");
    Ok(())
}
