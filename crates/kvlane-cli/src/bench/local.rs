//! The in-process bench (`--role local`): backend pairs in this process,
//! the memcpy baseline on their buffers and the raw-tcp baseline on
//! 127.0.0.1, interleaved per block size.

use super::memcpy::MemcpyPoint;
use super::pair::{point, pool_blocks, Pair};
use super::raw::{RawClient, RawServer};
use super::schedule::{rounds, Point};
use super::stats::Sample;
use super::{op_name, BenchError, BenchPlan, Factory, Row};
use crate::units::fmt_size;
use kvlane_data::BackendKind;

/// One point of a block size, measured slice by slice.
enum Contender {
    Memcpy(MemcpyPoint),
    /// Measured on the block size's raw-tcp streams.
    RawTcp(Point),
    /// Measured on `pairs[.0]`.
    Backend(usize, Point),
}

impl Contender {
    fn sample(&self) -> (&Sample, usize) {
        match self {
            Self::Memcpy(m) => (&m.sample, m.batch()),
            Self::RawTcp(p) | Self::Backend(_, p) => (&p.sample, p.batch),
        }
    }
}

/// Rows of one block size the plan yields, in the order they are printed.
pub(crate) fn rows_per_block_size(plan: &BenchPlan) -> usize {
    let baselines = usize::from(plan.baselines);
    let raw = usize::from(plan.baselines && plan.backends.contains(&BackendKind::Tcp));
    plan.batches.len() * (baselines + (raw + plan.backends.len()) * plan.ops.len())
}

/// Runs the whole plan, calling `emit` for the rows of each block size as
/// soon as they are measured.
pub(crate) fn run(
    plan: &BenchPlan,
    factory: &Factory,
    mut progress: impl FnMut(&str),
    mut emit: impl FnMut(&Row) -> std::io::Result<()>,
) -> Result<(), BenchError> {
    let max_batch = plan.batches.iter().copied().max().unwrap_or(1);
    let threads = plan.threads.max(1);
    for &block in &plan.block_sizes {
        let pool = pool_blocks(block, max_batch);
        let mut pairs: Vec<Vec<Pair>> = Vec::new();
        for &kind in &plan.backends {
            pairs.push(
                (0..threads)
                    .map(|_| Pair::new(factory, kind, block, pool, plan.memory))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        let mut contenders = Vec::new();
        // memcpy copies host memory: with GPU pairs it gets its own buffers.
        if plan.baselines {
            // Thread `i` copies between the very buffers the first
            // backend's pair `i` moves (its remote into its local region,
            // as a READ does): the same pages, so the same physical
            // placement, cache and TLB behaviour on both sides of the
            // comparison.
            let buffers: Vec<_> = pairs
                .first()
                .map(|ps| ps.iter().map(|p| (p.remote.clone(), p.local.clone())))
                .into_iter()
                .filter(|_| plan.memory.is_none())
                .flatten()
                .collect();
            for &batch in &plan.batches {
                contenders.push(Contender::Memcpy(MemcpyPoint::new(
                    block, batch, pool, threads, &buffers,
                )?));
            }
        }
        // Declared server first, so the client goes first: its streams end
        // between requests, which the server takes for a clean close.
        let (mut raw_server, mut raw) = (None, None);
        if plan.baselines && plan.backends.contains(&BackendKind::Tcp) {
            let listen = "127.0.0.1:0";
            // The server serves the tcp pair's target memory (thread 0's;
            // several threads' groups share it), as memcpy copies the
            // pairs' own buffers; GPU pairs get host memory of that size.
            let tcp = plan.backends.iter().position(|k| *k == BackendKind::Tcp);
            let memory = match tcp.and_then(|i| pairs[i].first()) {
                Some(p) if p.remote.device().is_none() => p.remote.clone(),
                _ => {
                    super::pair::filled(pool * block, None, 0x5a).map_err(|e| BenchError::Data {
                        backend: "raw-tcp".into(),
                        source: e,
                    })?
                }
            };
            let server =
                RawServer::bind(listen, memory).map_err(|source| BenchError::RawListen {
                    addr: listen.into(),
                    source,
                })?;
            raw = Some(RawClient::connect(server.local_addr(), threads)?);
            raw_server = Some(server);
            for &op in &plan.ops {
                for &batch in &plan.batches {
                    contenders.push(Contender::RawTcp(Point::new(op, batch)));
                }
            }
        }
        for (index, _) in plan.backends.iter().enumerate() {
            for &op in &plan.ops {
                for &batch in &plan.batches {
                    contenders.push(Contender::Backend(index, Point::new(op, batch)));
                }
            }
        }
        let points = contenders.len();
        rounds(
            &mut contenders,
            plan.duration,
            block,
            Contender::sample,
            |c, slice, first| {
                match (c, raw.as_mut()) {
                    (Contender::Memcpy(m), _) => return m.slice(slice, first),
                    (Contender::RawTcp(p), Some(client)) => {
                        let s = client.measure(p.op, block, p.batch, slice, first)?;
                        p.sample.merge(s);
                    }
                    (Contender::RawTcp(_), None) => {
                        unreachable!("raw-tcp points exist only with their streams")
                    }
                    (Contender::Backend(index, p), _) => {
                        let s = point(&mut pairs[*index], p.op, p.batch, slice)?;
                        p.sample.merge(s);
                    }
                }
                Ok(())
            },
            |round| {
                progress(&format!(
                    "{} blocks, round {round}: {} points",
                    fmt_size(block),
                    points
                ))
            },
        )?;
        for c in contenders {
            let row = match c {
                Contender::Memcpy(m) => m.row(),
                Contender::RawTcp(p) => Row {
                    post: "batch",
                    ..p.sample.row("raw-tcp", op_name(p.op), block, p.batch)
                },
                Contender::Backend(index, p) => {
                    let kind = plan.backends[index];
                    Row {
                        memory: plan.memory_name(),
                        rails: if kind == BackendKind::Loopback {
                            1
                        } else {
                            plan.rails
                        },
                        ..p.sample.row(kind.as_str(), op_name(p.op), block, p.batch)
                    }
                }
            };
            emit(&row).map_err(BenchError::Output)?;
        }
        drop(raw);
        drop(raw_server);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlane_data::{Backend, LoopbackBackend, Op};
    use std::time::Duration;

    fn loopback(kind: BackendKind) -> Result<Box<dyn Backend>, BenchError> {
        assert_eq!(kind, BackendKind::Loopback);
        Ok(Box::new(LoopbackBackend::default()))
    }

    /// The rows `plan` prints.
    fn rows_of(plan: &BenchPlan, factory: &Factory) -> Vec<Row> {
        let mut rows = Vec::new();
        let printed = |r: &Row| {
            rows.push(r.clone());
            Ok(())
        };
        run(plan, factory, |_| {}, printed).unwrap();
        rows
    }

    fn keys(rows: &[Row]) -> Vec<(&str, &str, u64)> {
        rows.iter()
            .map(|r| (r.backend.as_str(), r.op.as_str(), r.block_size))
            .collect()
    }

    #[test]
    fn a_tiny_plan_measures_every_point() {
        let plan = BenchPlan {
            backends: vec![BackendKind::Loopback],
            ops: vec![Op::Read, Op::Write],
            block_sizes: vec![4096, 65536],
            batches: vec![4],
            duration: Duration::from_millis(5),
            baselines: true,
            threads: 2,
            memory: None,
            rails: 1,
            post: super::super::PostMode::Each,
        };
        let rows = rows_of(&plan, &loopback);
        assert_eq!(
            keys(&rows),
            vec![
                ("memcpy", "copy", 4096),
                ("loopback", "read", 4096),
                ("loopback", "write", 4096),
                ("memcpy", "copy", 65536),
                ("loopback", "read", 65536),
                ("loopback", "write", 65536),
            ]
        );
        assert_eq!(rows.len(), 2 * rows_per_block_size(&plan));
        for r in &rows {
            // Two threads, so every batch counts 2 x 4 transfers; at
            // least two batches make the three `MIN_BATCHES` of the slice
            // rule (it counts batches of 4).
            assert!(r.gbps > 0.0 && r.transfers >= 16, "{r:?}");
            assert!(r.transfers.is_multiple_of(4), "{r:?}");
            assert!(r.lat_p99_us > 0.0 && r.lat_avg_us > 0.0, "{r:?}");
        }
    }

    #[test]
    fn a_tcp_plan_has_a_raw_tcp_row_of_each_shape() {
        let plan = BenchPlan {
            backends: vec![BackendKind::Tcp],
            ops: vec![Op::Read, Op::Write],
            block_sizes: vec![65536],
            batches: vec![8],
            duration: Duration::from_millis(5),
            baselines: true,
            threads: 1,
            memory: None,
            rails: 1,
            post: super::super::PostMode::Each,
        };
        let tcp = |_| -> Result<Box<dyn Backend>, BenchError> {
            Ok(Box::new(
                kvlane_data::TcpBackend::new(kvlane_data::TcpConfig::default()).unwrap(),
            ))
        };
        let rows = rows_of(&plan, &tcp);
        assert_eq!(
            keys(&rows),
            [
                ("memcpy", "copy", 65536),
                ("raw-tcp", "read", 65536),
                ("raw-tcp", "write", 65536),
                ("tcp", "read", 65536),
                ("tcp", "write", 65536),
            ]
        );
        assert_eq!(rows.len(), rows_per_block_size(&plan));
        for r in &rows {
            assert!(r.gbps > 0.0 && r.transfers >= 24, "{r:?}");
            assert!(r.transfers.is_multiple_of(8), "{r:?}");
        }
    }

    #[test]
    fn a_failed_row_write_ends_the_run() {
        let plan = BenchPlan {
            backends: vec![BackendKind::Loopback],
            ops: vec![Op::Read],
            block_sizes: vec![4096, 8192],
            batches: vec![2],
            duration: Duration::from_millis(1),
            baselines: false,
            threads: 1,
            memory: None,
            rails: 1,
            post: super::super::PostMode::Each,
        };
        let mut printed = 0;
        let e = run(
            &plan,
            &loopback,
            |_| {},
            |_| {
                printed += 1;
                Err(std::io::ErrorKind::BrokenPipe.into())
            },
        )
        .unwrap_err();
        assert!(matches!(e, BenchError::Output(_)), "{e}");
        assert_eq!(printed, 1);
    }
}
