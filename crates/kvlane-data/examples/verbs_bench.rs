//! Throughput of the verbs backend: batches of one-sided WRITE or READ
//! between two backends (two sets of QPs) on one device, in this process —
//! the same shape as perftest's `ib_write_bw` / `ib_read_bw` loopback runs.
//!
//! ```text
//! KVLANE_IB_DEVICE=rxe0 cargo run --release -p kvlane-data --features verbs \
//!     --example verbs_bench -- [--op write|read|both] [--size 65536] [--iters 2000] \
//!     [--depth 128] [--qps 1] [--warmup 200] [--slots 1]
//! ```
//!
//! `--slots 1` (the default) makes every transfer use the same 64 KiB on
//! both sides, as perftest does for messages above half a page; more slots
//! spread transfers over `slots * size` bytes (a cache-cold working set).
//!
//! Prints one `RESULT` line per op (machine-readable) after a human line.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvlane_data::verbs::{VerbsBackend, VerbsConfig};
use kvlane_data::{
    connect_pair, Access, Backend, Descriptor, Op, Region, RemoteDescriptor, SubmitError, Transfer,
};

#[derive(Debug, Clone)]
struct Args {
    ops: Vec<Op>,
    size: u64,
    iters: u64,
    depth: u64,
    qps: usize,
    warmup: u64,
    slots: u64,
    signal_every: u32,
    sq_depth: u32,
    post_each: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        ops: vec![Op::Write, Op::Read],
        size: 65536,
        iters: 2000,
        depth: 128,
        qps: 1,
        warmup: 200,
        slots: 1,
        signal_every: VerbsConfig::default().signal_every,
        sq_depth: VerbsConfig::default().qp.max_send_wr,
        post_each: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--op" => {
                a.ops = match val()?.as_str() {
                    "write" => vec![Op::Write],
                    "read" => vec![Op::Read],
                    "both" => vec![Op::Write, Op::Read],
                    o => return Err(format!("unknown op {o}")),
                }
            }
            "--size" => a.size = num(val()?)?.max(1),
            "--iters" => a.iters = num(val()?)?.max(1),
            "--depth" => a.depth = num(val()?)?.max(1),
            "--qps" => a.qps = num(val()?)?.max(1) as usize,
            "--warmup" => a.warmup = num(val()?)?,
            "--slots" => a.slots = num(val()?)?.max(1),
            "--signal-every" => a.signal_every = num(val()?)?.max(1) as u32,
            "--sq-depth" => a.sq_depth = num(val()?)?.max(1) as u32,
            "--post-each" => a.post_each = true,
            "-h" | "--help" => {
                return Err("usage: verbs_bench [--op write|read|both] [--size N] \
                     [--iters N] [--depth N] [--qps N] [--warmup N] [--slots N] [--signal-every N] [--sq-depth N]"
                    .into())
            }
            o => return Err(format!("unknown argument {o}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbs_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    // Device: KVLANE_IB_DEVICE, else the first ACTIVE port.
    let config = VerbsConfig {
        qps_per_peer: args.qps,
        ..VerbsConfig::default()
    };
    let mut init = VerbsBackend::new(config.clone())?;
    let mut target = VerbsBackend::new(config)?;
    eprintln!(
        "device {} port {} gid {} mtu {}",
        init.context().name(),
        init.context().port().port,
        init.context().gid().gid,
        init.context().port().active_mtu
    );
    let len = (args.size * args.slots) as usize;
    let local = Region::alloc(len, Access::ALL)?;
    let remote = Region::alloc(len, Access::ALL)?;
    let local_ad = init.register(&local)?;
    let remote_ad = target.register(&remote)?;
    let (peer, _) = connect_pair(&mut init, &[local_ad], &mut target, &[remote_ad])?;

    for &op in &args.ops {
        let mk = |i: u64| {
            let slot = (i % args.slots) * args.size;
            Transfer::new(
                peer,
                op,
                vec![Descriptor {
                    region: local.id(),
                    offset: slot,
                    len: args.size,
                }],
                vec![RemoteDescriptor {
                    key: remote_ad.key,
                    offset: slot,
                    len: args.size,
                }],
            )
            .with_deadline(Instant::now() + Duration::from_secs(120))
        };
        drive(
            &mut init,
            &mut target,
            args.warmup,
            args.depth,
            args.post_each,
            &mk,
        )?;
        let t0 = Instant::now();
        drive(
            &mut init,
            &mut target,
            args.iters,
            args.depth,
            args.post_each,
            &mk,
        )?;
        let secs = t0.elapsed().as_secs_f64();
        let bytes = (args.iters * args.size) as f64;
        let gbps = bytes / secs / 1e9;
        println!(
            "kvlane verbs {op} {} B x {}: {:.3} GB/s ({:.2} MB/s, {:.0} ops/s, depth {}, {} qp(s))",
            args.size,
            args.iters,
            gbps,
            bytes / secs / 1e6,
            args.iters as f64 / secs,
            args.depth,
            args.qps
        );
        println!(
            "RESULT backend=kvlane-verbs op={} size={} iters={} MBps={:.2}",
            op.to_string().to_lowercase(),
            args.size,
            args.iters,
            bytes / secs / 1e6
        );
    }
    Ok(())
}

/// Keeps up to `depth` transfers in flight until `n` have completed.
fn drive(
    init: &mut VerbsBackend,
    target: &mut VerbsBackend,
    n: u64,
    depth: u64,
    post_each: bool,
    mk: &dyn Fn(u64) -> Transfer,
) -> Result<(), Box<dyn std::error::Error>> {
    let (mut submitted, mut completed) = (0u64, 0u64);
    let mut retry: Option<Transfer> = None;
    let mut done = Vec::with_capacity(depth as usize);
    while completed < n {
        while submitted < n && submitted - completed < depth {
            let t = retry.take().unwrap_or_else(|| mk(submitted));
            match init.submit(t) {
                Ok(()) => {
                    submitted += 1;
                    if post_each {
                        // One doorbell per transfer, like perftest's post loop.
                        init.poll(&mut done);
                    }
                }
                Err(SubmitError::QueueFull { transfer, .. }) => {
                    retry = Some(*transfer);
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        init.poll(&mut done);
        target.poll(&mut Vec::new());
        for c in done.drain(..) {
            c.result?;
            completed += 1;
        }
    }
    Ok(())
}
