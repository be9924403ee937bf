//! Property tests of the KV layout planner.

use kvlane_data::{plan, KvLayout, KvParts, LayoutOrder};
use proptest::prelude::*;

fn layout_strategy() -> impl Strategy<Value = KvLayout> {
    (
        1u32..5,
        1u32..40,
        1u64..48,
        any::<bool>(),
        any::<bool>(),
        0u64..64,
        0u64..16,
    )
        .prop_map(
            |(layers, blocks, bytes, separate, block_major, base, pad)| {
                let parts = if separate {
                    KvParts::Separate
                } else {
                    KvParts::Fused
                };
                let order = if block_major {
                    LayoutOrder::BlockMajor
                } else {
                    LayoutOrder::LayerMajor
                };
                let dense = KvLayout::new(layers, blocks, bytes, parts, order).unwrap();
                // Padding between blocks keeps layouts legal but non-dense.
                let (ls, ks, bs) = match order {
                    LayoutOrder::LayerMajor => {
                        let bs = bytes + pad;
                        let ks = bs * u64::from(blocks);
                        (ks * parts.count(), ks, bs)
                    }
                    LayoutOrder::BlockMajor => (
                        dense.layer_stride,
                        dense.kv_stride,
                        dense.block_stride + pad,
                    ),
                };
                KvLayout::with_strides(layers, blocks, bytes, parts, base, ls, ks, bs).unwrap()
            },
        )
}

/// Copies every (layer, part, block) pair one block at a time.
fn naive(
    local: &KvLayout,
    lids: &[u32],
    remote: &KvLayout,
    rids: &[u32],
    layers: std::ops::Range<u32>,
    src: &[u8],
    dst: &mut [u8],
) -> u64 {
    let mut moved = 0;
    for (&l, &r) in lids.iter().zip(rids) {
        for layer in layers.clone() {
            for part in 0..local.parts.count() {
                let lo = local.offset(layer, part, l).unwrap() as usize;
                let ro = remote.offset(layer, part, r).unwrap() as usize;
                let n = local.block_bytes as usize;
                dst[ro..ro + n].copy_from_slice(&src[lo..lo + n]);
                moved += n as u64;
            }
        }
    }
    moved
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The plan moves exactly the bytes a naive per-block copy moves.
    #[test]
    fn plan_matches_naive_copy(
        local in layout_strategy(),
        remote_seed in layout_strategy(),
        ids in prop::collection::vec((0u32..1000, 0u32..1000), 0..60),
        layer_pick in (0u32..8, 1u32..8),
    ) {
        // Same block geometry on both sides, any order/strides/counts.
        let remote = KvLayout::new(
            remote_seed.num_layers.max(local.num_layers),
            remote_seed.num_blocks,
            local.block_bytes,
            local.parts,
            if remote_seed.layer_stride < remote_seed.block_stride { LayoutOrder::BlockMajor } else { LayoutOrder::LayerMajor },
        ).unwrap();
        // Distinct remote ids keep the outcome independent of copy order.
        let mut seen = std::collections::HashSet::new();
        let (lids, rids): (Vec<u32>, Vec<u32>) = ids
            .into_iter()
            .map(|(a, b)| (a % local.num_blocks, b % remote.num_blocks))
            .filter(|&(_, b)| seen.insert(b))
            .unzip();
        let start = layer_pick.0 % local.num_layers;
        let end = (start + layer_pick.1).min(local.num_layers);
        let src: Vec<u8> = (0..local.required_len().unwrap()).map(|i| (i % 251) as u8 + 1).collect();
        let mut want = vec![0u8; remote.required_len().unwrap() as usize];
        let moved = naive(&local, &lids, &remote, &rids, start..end, &src, &mut want);

        let copies = plan(&local, &lids, &remote, &rids, start..end).unwrap();
        let mut got = vec![0u8; want.len()];
        let mut planned = 0;
        for c in &copies {
            prop_assert!(c.len > 0);
            let (l, r, n) = (c.local as usize, c.remote as usize, c.len as usize);
            got[r..r + n].copy_from_slice(&src[l..l + n]);
            planned += c.len;
        }
        prop_assert_eq!(planned, moved);
        prop_assert!(got == want, "planned copies differ from the naive copy");
        prop_assert!(copies.len() as u64 <= (lids.len() as u64) * u64::from(end - start) * local.parts.count());
    }

    /// Sorted runs contiguous on both sides become one descriptor each
    /// (per layer and part in a layer-major cache; one in all in a
    /// block-major cache moving every layer).
    #[test]
    fn contiguous_runs_become_one_descriptor(
        layers in 1u32..5,
        bytes in 1u64..64,
        separate in any::<bool>(),
        runs in prop::collection::vec((1u32..12, 1u32..6, 1u32..6), 1..8),
    ) {
        let parts = if separate { KvParts::Separate } else { KvParts::Fused };
        // Build id lists as runs separated by gaps on both sides.
        let (mut lids, mut rids) = (Vec::new(), Vec::new());
        let (mut l, mut r) = (0u32, 0u32);
        for &(len, lgap, rgap) in &runs {
            lids.extend(l..l + len);
            rids.extend(r..r + len);
            l += len + lgap;
            r += len + rgap;
        }
        let local = KvLayout::new(layers, l, bytes, parts, LayoutOrder::LayerMajor).unwrap();
        let remote = KvLayout::new(layers, r, bytes, parts, LayoutOrder::LayerMajor).unwrap();
        let copies = plan(&local, &lids, &remote, &rids, 0..layers).unwrap();
        prop_assert_eq!(copies.len() as u64, runs.len() as u64 * u64::from(layers) * parts.count());

        let local = KvLayout::new(layers, l, bytes, parts, LayoutOrder::BlockMajor).unwrap();
        let remote = KvLayout::new(layers, r, bytes, parts, LayoutOrder::BlockMajor).unwrap();
        let copies = plan(&local, &lids, &remote, &rids, 0..layers).unwrap();
        prop_assert_eq!(copies.len(), runs.len());
    }
}
