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

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

// The raw ZMTP bytes the crate's flood tests send.
#[path = "../tests/common/zmtp.rs"]
mod zmtp;
use zmtp::{closed, preamble_and_wrong_hello};

/// Opens one flood connection; `None` if the connect or write failed.
fn open(addr: &str, hello: &[u8]) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.write_all(hello).ok()?;
    s.set_nonblocking(true).ok()?;
    Some(s)
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
    let hello = preamble_and_wrong_hello();
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
