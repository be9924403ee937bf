//! One soak round against one target: WRITE a fresh pattern, READ it back
//! into other blocks, compare every byte; failures are counted and printed.

use super::report::{ms, Line};
use super::{chain, lock, Ctx, Target};
use crate::bench::op_name;
use kvlane::data::Op;
use kvlane::{Error, ErrorKind, Peer, DEFAULT_TRANSFER_DEADLINE};
use std::time::{Duration, Instant};

/// Contents of local blocks before a READ lands in them.
const POISON: u8 = 0xee;

/// Pattern byte `i` of a block, different for every round, block and part.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

impl Ctx {
    fn failed(&self, t: &Target, op: Op, e: &Error, in_flight: Duration) {
        let (kind, error) = (e.kind().to_string(), chain(e));
        self.failed_as(t, op, kind, error, in_flight);
    }

    fn failed_as(&self, t: &Target, op: Op, kind: String, error: String, in_flight: Duration) {
        {
            let mut c = lock(&t.counters);
            c.failed += 1;
            *c.failures.entry(kind.clone()).or_default() += 1;
            c.last_error = Some(error.clone());
        }
        self.out.emit(&Line::TransferFailed {
            peer: t.addr.clone(),
            op: op_name(op),
            kind,
            error,
            elapsed_ms: ms(in_flight),
        });
    }

    /// Posts one single-block transfer per pair, then waits for all.
    async fn transfers(&self, t: &Target, peer: &Peer, op: Op, local: &[u32]) -> bool {
        let bytes = self.layout.block_bytes * self.layout.parts.count();
        let mut posted = Vec::with_capacity(local.len());
        let mut all_ok = true;
        for (&l, &r) in local.iter().zip(&t.remote) {
            let t0 = Instant::now();
            match peer
                .prepare(op, 0..1, &[l], &[r], None)
                .and_then(|p| peer.post(p))
            {
                Ok(h) => posted.push((t0, h)),
                Err(e) => {
                    self.failed(t, op, &e, Duration::ZERO);
                    all_ok = false;
                }
            }
        }
        for (t0, h) in posted {
            match tokio::time::timeout_at((t0 + self.transfer_bound).into(), h).await {
                Ok(Ok(())) => {
                    let lat = t0.elapsed();
                    let mut c = lock(&t.counters);
                    c.ok += 1;
                    c.interval_ok += 1;
                    c.bytes += bytes;
                    c.interval_bytes += bytes;
                    c.lat.push(lat);
                    c.interval_lat.push(lat);
                }
                Ok(Err(e)) => {
                    self.failed(t, op, &e, t0.elapsed());
                    all_ok = false;
                }
                Err(_) => {
                    let msg = format!(
                        "{} transfer to {} did not end within {:?} although its deadline is {:?}",
                        op_name(op),
                        t.addr,
                        self.transfer_bound,
                        DEFAULT_TRANSFER_DEADLINE
                    );
                    self.failed_as(t, op, ErrorKind::Timeout.to_string(), msg, t0.elapsed());
                    all_ok = false;
                }
            }
        }
        all_ok
    }

    fn offset(&self, part: u64, block: u32) -> u64 {
        self.layout.offset(0, part, block).unwrap_or(0)
    }

    /// One round: WRITE a fresh pattern, READ it back, compare.
    pub(super) async fn round(&self, t: &Target, peer: &Peer, round: u64) -> bool {
        let len = self.layout.block_bytes as usize;
        let parts = self.layout.parts.count();
        let seed =
            |i: usize, part: u64| (t.index as u64) << 48 ^ round << 16 ^ (i as u64) << 1 ^ part;
        for (i, &b) in t.src.iter().enumerate() {
            for part in 0..parts {
                let _ = self
                    .region
                    .write(self.offset(part, b), &pattern(seed(i, part), len));
            }
        }
        for &b in &t.dst {
            for part in 0..parts {
                let _ = self.region.fill(self.offset(part, b), len as u64, POISON);
            }
        }
        if !self.transfers(t, peer, Op::Write, &t.src).await
            || !self.transfers(t, peer, Op::Read, &t.dst).await
        {
            return false;
        }
        let mut ok = true;
        let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
        for (i, (&s, &d)) in t.src.iter().zip(&t.dst).enumerate() {
            for part in 0..parts {
                let read = self
                    .region
                    .read(self.offset(part, s), &mut a)
                    .and_then(|()| self.region.read(self.offset(part, d), &mut b));
                let first = match read {
                    Ok(()) => a.iter().zip(&b).position(|(x, y)| x != y),
                    Err(_) => Some(0),
                };
                if let Some(first_offset) = first {
                    ok = false;
                    lock(&t.counters).mismatches += 1;
                    self.out.emit(&Line::Mismatch {
                        peer: t.addr.clone(),
                        round,
                        remote_block: t.remote[i],
                        part,
                        first_offset,
                    });
                }
            }
        }
        ok
    }
}
