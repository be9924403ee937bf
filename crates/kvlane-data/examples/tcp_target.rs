//! A tcp-backend target in its own process, for two-process tests and
//! manual runs across hosts.
//!
//! ```text
//! cargo run -p kvlane-data --example tcp_target -- [--listen ADDR] [--len BYTES]
//! ```
//!
//! Registers one zeroed region (all rights) and prints one line on stdout:
//! the hex of the msgpack pair `(Endpoint, [RemoteRegion])` that a
//! handshake would carry. Then it serves until stdin closes, answering
//! commands read from stdin, one per line:
//!
//! - `sum`: prints the FNV-1a 64 hash of the whole region as 16 hex digits;
//! - `notes`: prints the number of notifications received so far.

use kvlane_data::{Access, Backend, Region, TcpBackend, TcpConfig};
use std::io::{BufRead, Write};

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = TcpConfig::default();
    let mut len: usize = 16 << 20;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let v = pair.get(1).ok_or("missing value")?;
        match pair[0].as_str() {
            "--listen" => config.listen = v.parse()?,
            "--len" => len = v.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let mut backend = TcpBackend::new(config)?;
    let region = Region::alloc(len, Access::ALL)?;
    let ad = backend.register(&region)?;
    let (_, endpoint) = backend.prepare_peer()?;
    let blob = rmp_serde::to_vec_named(&(endpoint, vec![ad]))?;
    let hex: String = blob.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{hex}")?;
    out.flush()?;
    let mut notes = Vec::new();
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "sum" => writeln!(out, "{:016x}", fnv1a(&region.to_vec()?))?,
            "notes" => {
                backend.poll_notifications(&mut notes);
                writeln!(out, "{}", notes.len())?;
            }
            other => writeln!(out, "unknown command {other:?}")?,
        }
        out.flush()?;
    }
    Ok(())
}
