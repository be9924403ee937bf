//! Throughput of the tcp backend against a raw TCP baseline, in one run.
//!
//! ```text
//! cargo run --release -p kvlane-data --example tcp_bench -- [--streams N] [--chunk BYTES]
//!     [--secs S] [--sockbuf BYTES] [--block BYTES] [--op write|read] [--io-threads N]
//! ```
//!
//! Baseline: one plain TCP stream between two threads pushing 1 MiB
//! buffers. Backend: batches of 128 transfers of one block each (4 KiB,
//! 64 KiB, 1 MiB), WRITE and READ, between two backends of this process.
//! GB/s = 1e9 bytes per second.

use kvlane_data::{
    connect_pair, Access, Backend, Completion, Descriptor, Op, Region, RemoteDescriptor,
    SubmitError, TcpBackend, TcpConfig, Transfer,
};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Wakes the bench thread when the backend announces completions, so the
/// bench waits like an application would instead of spinning on a core
/// the I/O threads need.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

const BATCH: u64 = 128;

fn raw_tcp(secs: f64) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let reader = std::thread::Builder::new()
        .name("raw-reader".into())
        .spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0u64;
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return total,
                    Ok(n) => total += n as u64,
                }
            }
        })
        .expect("spawn reader");
    let writer = std::thread::Builder::new()
        .name("raw-writer".into())
        .spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_nodelay(true).expect("nodelay");
            let buf = vec![7u8; 1 << 20];
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                s.write_all(&buf).expect("write");
            }
            start
        })
        .expect("spawn writer");
    let start = writer.join().expect("writer");
    let total = reader.join().expect("reader");
    total as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// A connected initiator/target pair with one batch worth of memory.
struct Pair {
    init: TcpBackend,
    _target: TcpBackend,
    peer: kvlane_data::PeerId,
    local: Region,
    key: kvlane_data::RemoteKey,
    block: u64,
}

fn pair(config: &TcpConfig, block: u64) -> Pair {
    let mut init = TcpBackend::new(config.clone()).expect("initiator");
    let mut target = TcpBackend::new(config.clone()).expect("target");
    let len = (BATCH * block) as usize;
    let local = Region::alloc(len, Access::ALL).expect("alloc");
    let remote = Region::alloc(len, Access::ALL).expect("alloc");
    let local_ad = init.register(&local).expect("register");
    let remote_ad = target.register(&remote).expect("register");
    let (peer, _) = connect_pair(&mut init, &[local_ad], &mut target, &[remote_ad]).expect("pair");
    init.set_waker(Waker::from(Arc::new(Unpark(std::thread::current()))));
    Pair {
        init,
        _target: target,
        peer,
        local,
        key: remote_ad.key,
        block,
    }
}

/// Runs batches of `op` for `secs`; returns (bytes, elapsed, batches).
fn backend_run(p: &mut Pair, op: Op, secs: f64) -> (u64, Duration, u32) {
    let block = p.block;
    let mut done: Vec<Completion> = Vec::new();
    let mut bytes = 0u64;
    let mut batches = 0u32;
    let start = Instant::now();
    let mut submitting = Duration::ZERO;
    while start.elapsed().as_secs_f64() < secs {
        let t0 = Instant::now();
        for i in 0..BATCH {
            let mut t = Transfer::new(
                p.peer,
                op,
                vec![Descriptor {
                    region: p.local.id(),
                    offset: i * block,
                    len: block,
                }],
                vec![RemoteDescriptor {
                    key: p.key,
                    offset: i * block,
                    len: block,
                }],
            );
            loop {
                match p.init.submit(t) {
                    Ok(()) => break,
                    Err(SubmitError::QueueFull { transfer, .. }) => {
                        t = *transfer;
                        p.init.poll(&mut done);
                    }
                    Err(e) => panic!("submit: {e}"),
                }
            }
        }
        submitting += t0.elapsed();
        let mut n = 0;
        while n < BATCH as usize {
            if p.init.poll(&mut done) == 0 {
                std::thread::park_timeout(Duration::from_millis(1));
            }
            for c in done.drain(..) {
                c.result.expect("transfer failed");
                n += 1;
            }
        }
        bytes += BATCH * block;
        batches += 1;
    }
    if std::env::var_os("TCP_BENCH_VERBOSE").is_some() {
        eprintln!("  submit loop: {:?} per batch", submitting / batches.max(1));
    }
    (bytes, start.elapsed(), batches)
}

fn main() {
    let mut config = TcpConfig::default();
    let mut secs = 2.0;
    let mut blocks = vec![4u64 << 10, 64 << 10, 1 << 20];
    let mut ops = vec![Op::Write, Op::Read];
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let v = pair.get(1).map(String::as_str).unwrap_or("");
        match pair[0].as_str() {
            "--streams" => config.streams = v.parse().expect("--streams N"),
            "--chunk" => config.chunk_bytes = v.parse().expect("--chunk BYTES"),
            "--secs" => secs = v.parse().expect("--secs S"),
            "--block" => blocks = vec![v.parse().expect("--block BYTES")],
            "--op" => {
                ops = vec![match v {
                    "write" => Op::Write,
                    "read" => Op::Read,
                    _ => panic!("--op write|read"),
                }]
            }
            "--sockbuf" => config.socket_buffer = Some(v.parse().expect("--sockbuf BYTES")),
            "--io-threads" => config.io_threads = v.parse().expect("--io-threads N"),
            other => panic!("unknown argument {other}"),
        }
    }
    println!(
        "streams={} chunk_bytes={} socket_buffer={:?} io_threads={} batch={BATCH} secs={secs}",
        config.streams, config.chunk_bytes, config.socket_buffer, config.io_threads
    );
    // The machine may be shared: raw and backend slices alternate
    // (ROUNDS each per point) and the ratio is of their totals.
    const ROUNDS: u32 = 4;
    let slice = secs / f64::from(ROUNDS);
    println!(
        "{:>6} {:>8} {:>9} {:>9} {:>7} {:>12}",
        "op", "block", "raw GB/s", "GB/s", "x raw", "batch time"
    );
    for &block in &blocks {
        let mut p = pair(&config, block);
        for &op in &ops {
            let (mut raw_gb, mut raw_s) = (0.0, 0.0);
            let (mut bytes, mut el, mut batches) = (0u64, Duration::ZERO, 0u32);
            for _ in 0..ROUNDS {
                let r = raw_tcp(slice);
                raw_gb += r * slice;
                raw_s += slice;
                let (b, e, n) = backend_run(&mut p, op, slice);
                bytes += b;
                el += e;
                batches += n;
            }
            let raw = raw_gb / raw_s;
            let gbs = bytes as f64 / el.as_secs_f64() / 1e9;
            println!(
                "{:>6} {:>7}K {:>9.2} {:>9.2} {:>7.2} {:>12?}",
                op.to_string(),
                block >> 10,
                raw,
                gbs,
                gbs / raw,
                el / batches.max(1)
            );
        }
    }
}
