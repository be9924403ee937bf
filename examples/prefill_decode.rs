//! Prefill → decode over kvlane: two agents, a layered KV cache, block-id
//! lists moved with WRITE plus a notification and with READ, and every byte
//! checked.
//!
//! ```sh
//! cargo run --release --example prefill_decode
//! ```

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Op, Region};
use kvlane::{Agent, BackendChoice, Error};
use std::time::{Duration, Instant};

const LAYERS: u32 = 8;
const BLOCKS: u32 = 256;
/// 16 tokens x 8 KV heads x 128 dims x 2 bytes (fp16) per layer and part.
const BLOCK_BYTES: u64 = 16 * 8 * 128 * 2;

fn fill(region: &Region, seed: u8) -> Result<(), Error> {
    let data: Vec<u8> = (0..region.len())
        .map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 12) as u8)
        .collect();
    Ok(region.write(0, &data)?)
}

/// Whether blocks `a_ids` of `a` equal blocks `b_ids` of `b` in every layer.
fn same_blocks(
    a: &Region,
    a_ids: &[u32],
    b: &Region,
    b_ids: &[u32],
    layout: &KvLayout,
) -> Result<bool, Error> {
    let mut x = vec![0u8; BLOCK_BYTES as usize];
    let mut y = vec![0u8; BLOCK_BYTES as usize];
    for (&i, &j) in a_ids.iter().zip(b_ids) {
        for layer in 0..LAYERS {
            for part in 0..2 {
                a.read(layout.offset(layer, part, i).unwrap_or(0), &mut x)?;
                b.read(layout.offset(layer, part, j).unwrap_or(0), &mut y)?;
                if x != y {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let layout = KvLayout::new(
        LAYERS,
        BLOCKS,
        BLOCK_BYTES,
        KvParts::Separate,
        LayoutOrder::LayerMajor,
    )?;
    let len = layout.required_len().unwrap_or(0) as usize;
    println!(
        "KV cache: {LAYERS} layers x {BLOCKS} blocks x 2 parts x {BLOCK_BYTES} B = {} MiB per engine",
        len >> 20
    );

    let prefill_kv = Region::alloc(len, Access::ALL)?;
    fill(&prefill_kv, 7)?;
    let decode_kv = Region::alloc(len, Access::ALL)?;
    fill(&decode_kv, 13)?;
    let prefill = Agent::builder()
        .engine_id("prefill-0")
        .backend(BackendChoice::Tcp)
        .register_kv(layout, prefill_kv.clone())
        .build()
        .await?;
    let decode = Agent::builder()
        .engine_id("decode-0")
        .backend(BackendChoice::Tcp)
        .register_kv(layout, decode_kv.clone())
        .build()
        .await?;
    let mut decode_notes = decode.notifications().expect("first call");

    // The prefill engine pushes a finished request's blocks to decode.
    let peer = prefill.connect(decode.local_addr()).await?;
    let src: Vec<u32> = (10..74).collect(); // 64 sequential blocks
    let dst: Vec<u32> = (100..132).chain(200..232).collect(); // two runs
    let prepared = peer.prepare(
        Op::Write,
        0..LAYERS,
        &src,
        &dst,
        Some(b"request 42: kv ready"),
    )?;
    println!(
        "WRITE {} blocks x {LAYERS} layers x 2 parts: {} descriptors after merging, {} KiB",
        src.len(),
        prepared.descriptors(),
        prepared.bytes() >> 10
    );
    let t0 = Instant::now();
    peer.post(prepared)?.await?;
    let note = tokio::time::timeout(Duration::from_secs(10), decode_notes.recv())
        .await
        .ok()
        .flatten()
        .expect("decode got no notification");
    println!(
        "decode notified by {} after {:?}: {}",
        note.from,
        t0.elapsed(),
        String::from_utf8_lossy(&note.payload)
    );
    assert!(
        same_blocks(&prefill_kv, &src, &decode_kv, &dst, &layout)?,
        "WRITE corrupted blocks"
    );

    // The decode engine pulls the blocks it wants from prefill with READ.
    let back = decode.connect(prefill.local_addr()).await?;
    let want: Vec<u32> = vec![3, 4, 5, 90, 91];
    let into: Vec<u32> = vec![0, 1, 2, 3, 4];
    back.read_blocks(0..LAYERS, &into, &want, Some(b"pulled"))?
        .await?;
    assert!(
        same_blocks(&decode_kv, &into, &prefill_kv, &want, &layout)?,
        "READ corrupted blocks"
    );
    println!("READ {} blocks back: contents verified", want.len());

    prefill.close().await;
    decode.close().await;
    println!("ok");
    Ok(())
}
