//! Prefill → decode over kvlane: two agents, a layered KV cache, block-id
//! lists moved with WRITE plus a notification and with READ, and every byte
//! checked.
//!
//! ```sh
//! cargo run --release --example prefill_decode
//! ```
//!
//! The same exchange between two processes (or hosts): start the decode
//! side, then the prefill side pointed at it. Each checks the bytes it
//! received against the other's known contents and exits non-zero on a
//! mismatch.
//!
//! ```sh
//! host-a$ prefill_decode --role decode --listen 0.0.0.0:5555
//! host-b$ prefill_decode --role prefill --connect host-a:5555
//! ```

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Op, Region};
use kvlane::{Agent, BackendChoice, Error, Notification, Peer};
use std::time::{Duration, Instant};

const LAYERS: u32 = 8;
const BLOCKS: u32 = 256;
/// 16 tokens x 8 KV heads x 128 dims x 2 bytes (fp16) per layer and part.
const BLOCK_BYTES: u64 = 16 * 8 * 128 * 2;
/// Initial contents of the prefill and the decode cache.
const PREFILL_SEED: u8 = 7;
const DECODE_SEED: u8 = 13;
/// How long the two-process roles wait for each other.
const PATIENCE: Duration = Duration::from_secs(60);

type BoxError = Box<dyn std::error::Error>;

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

fn layout() -> Result<KvLayout, Error> {
    KvLayout::new(
        LAYERS,
        BLOCKS,
        BLOCK_BYTES,
        KvParts::Separate,
        LayoutOrder::LayerMajor,
    )
    .map_err(Error::from)
}

/// A cache with the contents `fill(seed)` gives.
fn cache(layout: &KvLayout, seed: u8) -> Result<Region, Error> {
    let region = Region::alloc(layout.required_len().unwrap_or(0) as usize, Access::ALL)?;
    fill(&region, seed)?;
    Ok(region)
}

/// An engine's agent on the tcp backend with `kv` registered.
async fn engine(
    id: &str,
    layout: KvLayout,
    kv: &Region,
    listen: Option<&str>,
) -> Result<Agent, Error> {
    let mut b = Agent::builder()
        .engine_id(id)
        .backend(BackendChoice::Tcp)
        .register_kv(layout, kv.clone());
    if let Some(addr) = listen {
        b = b.listen(addr);
    }
    b.build().await
}

/// Prefill's finished request: 64 sequential blocks into two runs on decode.
fn write_blocks() -> (Vec<u32>, Vec<u32>) {
    ((10..74).collect(), (100..132).chain(200..232).collect())
}

/// The blocks decode pulls back with READ, and where they land.
fn read_blocks() -> (Vec<u32>, Vec<u32>) {
    (vec![3, 4, 5, 90, 91], vec![0, 1, 2, 3, 4])
}

/// Prefill pushes its blocks to decode with WRITE and a notification.
async fn push(peer: &Peer) -> Result<Instant, Error> {
    let (src, dst) = write_blocks();
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
    Ok(t0)
}

async fn one_process() -> Result<(), BoxError> {
    let layout = layout()?;
    let len = layout.required_len().unwrap_or(0) as usize;
    println!(
        "KV cache: {LAYERS} layers x {BLOCKS} blocks x 2 parts x {BLOCK_BYTES} B = {} MiB per engine",
        len >> 20
    );

    let prefill_kv = cache(&layout, PREFILL_SEED)?;
    let decode_kv = cache(&layout, DECODE_SEED)?;
    let prefill = engine("prefill-0", layout, &prefill_kv, None).await?;
    let decode = engine("decode-0", layout, &decode_kv, None).await?;
    let mut decode_notes = decode.notifications().expect("first call");

    // The prefill engine pushes a finished request's blocks to decode.
    let peer = prefill.connect(decode.local_addr()).await?;
    let t0 = push(&peer).await?;
    let note = tokio::time::timeout(Duration::from_secs(10), decode_notes.recv())
        .await
        .ok()
        .flatten()
        .ok_or("decode got no notification")?;
    println!(
        "decode notified by {} after {:?}: {}",
        note.from,
        t0.elapsed(),
        String::from_utf8_lossy(&note.payload)
    );
    let (src, dst) = write_blocks();
    if !same_blocks(&prefill_kv, &src, &decode_kv, &dst, &layout)? {
        return Err("WRITE corrupted blocks".into());
    }

    // The decode engine pulls the blocks it wants from prefill with READ.
    let back = decode.connect(prefill.local_addr()).await?;
    let (want, into) = read_blocks();
    back.read_blocks(0..LAYERS, &into, &want, Some(b"pulled"))?
        .await?;
    if !same_blocks(&decode_kv, &into, &prefill_kv, &want, &layout)? {
        return Err("READ corrupted blocks".into());
    }
    println!("READ {} blocks back: contents verified", want.len());

    prefill.close().await;
    decode.close().await;
    println!("ok");
    Ok(())
}

async fn next_note(
    notes: &mut tokio::sync::mpsc::Receiver<Notification>,
) -> Result<Notification, BoxError> {
    tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| format!("no notification from prefill within {PATIENCE:?}").into())
}

/// `--role decode`: serves its cache, waits for prefill's WRITE and its
/// notification, checks the blocks against prefill's known contents, then
/// waits until prefill read its blocks back.
async fn decode_role(listen: &str) -> Result<(), BoxError> {
    let layout = layout()?;
    let decode_kv = cache(&layout, DECODE_SEED)?;
    let decode = engine("decode-0", layout, &decode_kv, Some(listen)).await?;
    let mut notes = decode.notifications().expect("first call");
    println!("listening {}", decode.local_addr());
    let note = next_note(&mut notes).await?;
    println!(
        "decode notified by {}: {}",
        note.from,
        String::from_utf8_lossy(&note.payload)
    );
    let (src, dst) = write_blocks();
    let expected = cache(&layout, PREFILL_SEED)?;
    if !same_blocks(&expected, &src, &decode_kv, &dst, &layout)? {
        return Err("WRITE corrupted blocks".into());
    }
    println!("WRITE {} blocks: contents verified", src.len());
    let note = next_note(&mut notes).await?;
    println!(
        "decode notified by {}: {}",
        note.from,
        String::from_utf8_lossy(&note.payload)
    );
    decode.close().await;
    println!("ok");
    Ok(())
}

/// `--role prefill`: pushes its blocks to decode at `addr`, then reads
/// decode's blocks and checks them against decode's known contents.
async fn prefill_role(addr: &str) -> Result<(), BoxError> {
    let layout = layout()?;
    let prefill_kv = cache(&layout, PREFILL_SEED)?;
    let prefill = engine("prefill-0", layout, &prefill_kv, None).await?;
    let peer = tokio::time::timeout(PATIENCE, prefill.connect(addr))
        .await
        .map_err(|_| format!("connect to {addr}: no answer within {PATIENCE:?}"))??;
    let t0 = push(&peer).await?;
    println!("WRITE landed after {:?}", t0.elapsed());
    let (want, into) = read_blocks();
    peer.read_blocks(0..LAYERS, &into, &want, Some(b"pulled"))?
        .await?;
    let expected = cache(&layout, DECODE_SEED)?;
    if !same_blocks(&prefill_kv, &into, &expected, &want, &layout)? {
        return Err("READ corrupted blocks".into());
    }
    println!("READ {} blocks back: contents verified", want.len());
    prefill.close().await;
    println!("ok");
    Ok(())
}

enum Mode {
    OneProcess,
    Decode { listen: String },
    Prefill { connect: String },
}

fn mode() -> Result<Mode, BoxError> {
    let usage = "usage: prefill_decode [--role decode --listen HOST:PORT | --role prefill --connect HOST:PORT]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    if args.is_empty() {
        return Ok(Mode::OneProcess);
    }
    match (
        value("--role").as_deref(),
        value("--listen"),
        value("--connect"),
    ) {
        (Some("decode"), Some(listen), None) if args.len() == 4 => Ok(Mode::Decode { listen }),
        (Some("prefill"), None, Some(connect)) if args.len() == 4 => Ok(Mode::Prefill { connect }),
        _ => Err(usage.into()),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    match mode()? {
        Mode::OneProcess => one_process().await,
        Mode::Decode { listen } => decode_role(&listen).await,
        Mode::Prefill { connect } => prefill_role(&connect).await,
    }
}
