//! [`KvLayout`]: the geometry of an engine's KV cache, and the planner that
//! turns block-id lists into descriptor pairs.
//!
//! A layout describes one registered region holding `num_layers` layers of
//! `num_blocks` blocks, each `block_bytes` long (K and V fused in one block,
//! or stored as two separate parts). The byte offset of `(layer, part,
//! block)` is `base + layer * layer_stride + part * kv_stride + block *
//! block_stride`; [`KvLayout::new`] derives the strides for the two common
//! orders and [`KvLayout::with_strides`] accepts any others.
//!
//! [`plan`] maps `(layer range, local block ids, remote block ids)` to
//! `(local offset, remote offset, len)` triples and merges runs that are
//! contiguous on **both** sides, so sequential ids post few large
//! descriptors instead of one per block.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// How K and V are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvParts {
    /// K and V together in one block of `block_bytes`.
    Fused,
    /// K and V as two parts of `block_bytes` each.
    Separate,
}

impl KvParts {
    /// Number of parts (1 or 2).
    pub fn count(self) -> u64 {
        match self {
            Self::Fused => 1,
            Self::Separate => 2,
        }
    }
}

/// Memory order of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutOrder {
    /// `[layer][part][block]`: each layer's blocks are contiguous (vLLM-style
    /// per-layer caches in one pool).
    LayerMajor,
    /// `[block][layer][part]`: all layers of a block are contiguous.
    BlockMajor,
}

/// Geometry of a KV cache inside one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Layers.
    pub num_layers: u32,
    /// Blocks per layer.
    pub num_blocks: u32,
    /// Bytes of one block of one layer and one part.
    pub block_bytes: u64,
    /// K/V storage.
    pub parts: KvParts,
    /// Offset of the cache inside its region.
    pub base: u64,
    /// Distance between consecutive layers.
    pub layer_stride: u64,
    /// Distance between K and V (unused when fused).
    pub kv_stride: u64,
    /// Distance between consecutive blocks.
    pub block_stride: u64,
}

/// A planner or layout error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A dimension is zero.
    #[error("layout has zero {0}")]
    Empty(&'static str),
    /// Strides make blocks overlap or the size overflows.
    #[error("layout strides overlap or overflow: {0}")]
    BadStrides(&'static str),
    /// The two block-id lists differ in length.
    #[error("{local} local block ids but {remote} remote block ids")]
    CountMismatch {
        /// Local ids.
        local: usize,
        /// Remote ids.
        remote: usize,
    },
    /// A block id is not in the layout.
    #[error("{side} block id {id} (position {index}) is out of range: the layout has {num_blocks} blocks")]
    BlockOutOfRange {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// The id.
        id: u32,
        /// Its position in the list.
        index: usize,
        /// Blocks in that layout.
        num_blocks: u32,
    },
    /// The layer range is empty or beyond a layout.
    #[error("layers {start}..{end} are not inside the {side} layout's {num_layers} layers")]
    LayersOutOfRange {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// Range start.
        start: u32,
        /// Range end.
        end: u32,
        /// Layers in that layout.
        num_layers: u32,
    },
    /// The two layouts cut blocks differently.
    #[error("local blocks are {local} bytes x {local_parts} parts but remote blocks are {remote} bytes x {remote_parts} parts")]
    BlockBytesMismatch {
        /// Local block bytes.
        local: u64,
        /// Local parts.
        local_parts: u64,
        /// Remote block bytes.
        remote: u64,
        /// Remote parts.
        remote_parts: u64,
    },
}

impl KvLayout {
    /// A dense layout in the given order.
    pub fn new(
        num_layers: u32,
        num_blocks: u32,
        block_bytes: u64,
        parts: KvParts,
        order: LayoutOrder,
    ) -> Result<Self, LayoutError> {
        let p = parts.count();
        let (l, b) = (u64::from(num_layers), u64::from(num_blocks));
        let overflow = LayoutError::BadStrides("size overflows u64");
        let (layer_stride, kv_stride, block_stride) = match order {
            LayoutOrder::LayerMajor => {
                let kv = b.checked_mul(block_bytes).ok_or(overflow.clone())?;
                (kv.checked_mul(p).ok_or(overflow)?, kv, block_bytes)
            }
            LayoutOrder::BlockMajor => {
                let layer = block_bytes.checked_mul(p).ok_or(overflow.clone())?;
                (layer, block_bytes, layer.checked_mul(l).ok_or(overflow)?)
            }
        };
        Self::with_strides(
            num_layers,
            num_blocks,
            block_bytes,
            parts,
            0,
            layer_stride,
            kv_stride,
            block_stride,
        )
    }

    /// A layout with explicit strides; checks that no two blocks overlap
    /// (for the dense orders and any stride set whose strides nest).
    #[allow(clippy::too_many_arguments)] // a layout is exactly these eight numbers
    pub fn with_strides(
        num_layers: u32,
        num_blocks: u32,
        block_bytes: u64,
        parts: KvParts,
        base: u64,
        layer_stride: u64,
        kv_stride: u64,
        block_stride: u64,
    ) -> Result<Self, LayoutError> {
        if num_layers == 0 {
            return Err(LayoutError::Empty("layers"));
        }
        if num_blocks == 0 {
            return Err(LayoutError::Empty("blocks"));
        }
        if block_bytes == 0 {
            return Err(LayoutError::Empty("block bytes"));
        }
        let layout = Self {
            num_layers,
            num_blocks,
            block_bytes,
            parts,
            base,
            layer_stride,
            kv_stride,
            block_stride,
        };
        layout
            .required_len()
            .ok_or(LayoutError::BadStrides("size overflows u64"))?;
        // Sort the (stride, count) dimensions and require each stride to
        // clear the whole extent of the finer dimensions below it.
        let mut dims = vec![(block_stride, u64::from(num_blocks))];
        if num_layers > 1 {
            dims.push((layer_stride, u64::from(num_layers)));
        }
        if parts == KvParts::Separate {
            dims.push((kv_stride, 2));
        }
        dims.sort_unstable();
        let mut extent = block_bytes;
        for (stride, count) in dims {
            if count > 1 && stride < extent {
                return Err(LayoutError::BadStrides("blocks overlap"));
            }
            extent += stride * (count - 1);
        }
        Ok(layout)
    }

    /// Bytes the region must hold for this layout (base included); `None`
    /// on overflow or for an empty layout.
    pub fn required_len(&self) -> Option<u64> {
        let last = self.offset(
            self.num_layers.checked_sub(1)?,
            self.parts.count() - 1,
            self.num_blocks.checked_sub(1)?,
        )?;
        last.checked_add(self.block_bytes)
    }

    /// Checks what [`with_strides`](Self::with_strides) checks, for a
    /// layout that did not come from it (one a peer sent).
    pub fn validate(&self) -> Result<(), LayoutError> {
        Self::with_strides(
            self.num_layers,
            self.num_blocks,
            self.block_bytes,
            self.parts,
            self.base,
            self.layer_stride,
            self.kv_stride,
            self.block_stride,
        )
        .map(|_| ())
    }

    /// Offset of `(layer, part, block)`; `None` on overflow.
    pub fn offset(&self, layer: u32, part: u64, block: u32) -> Option<u64> {
        self.base
            .checked_add(u64::from(layer).checked_mul(self.layer_stride)?)?
            .checked_add(part.checked_mul(self.kv_stride)?)?
            .checked_add(u64::from(block).checked_mul(self.block_stride)?)
    }

    /// Whether blocks are the outermost dimension in memory (block-major),
    /// so that walking layers and parts innermost keeps runs contiguous.
    fn blocks_outer(&self) -> bool {
        let layer = if self.num_layers > 1 {
            self.layer_stride
        } else {
            0
        };
        let kv = if self.parts == KvParts::Separate {
            self.kv_stride
        } else {
            0
        };
        self.block_stride > layer.max(kv)
    }

    fn check_ids(&self, side: &'static str, ids: &[u32]) -> Result<(), LayoutError> {
        match ids.iter().position(|&id| id >= self.num_blocks) {
            Some(index) => Err(LayoutError::BlockOutOfRange {
                side,
                id: ids[index],
                index,
                num_blocks: self.num_blocks,
            }),
            None => Ok(()),
        }
    }

    fn check_layers(&self, side: &'static str, layers: &Range<u32>) -> Result<(), LayoutError> {
        if layers.start >= layers.end || layers.end > self.num_layers {
            return Err(LayoutError::LayersOutOfRange {
                side,
                start: layers.start,
                end: layers.end,
                num_layers: self.num_layers,
            });
        }
        Ok(())
    }
}

/// One planned copy: `len` bytes at `local` in the local region to or from
/// `remote` in the remote region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedCopy {
    /// Offset in the local region.
    pub local: u64,
    /// Offset in the remote region.
    pub remote: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Plans the copies that move `layers` of the blocks `local_ids[i]` ↔
/// `remote_ids[i]`, merging runs contiguous on both sides. The walk follows
/// the local layout's memory order, so ascending ids give maximal merges.
pub fn plan(
    local: &KvLayout,
    local_ids: &[u32],
    remote: &KvLayout,
    remote_ids: &[u32],
    layers: Range<u32>,
) -> Result<Vec<PlannedCopy>, LayoutError> {
    let mut out = Vec::new();
    plan_into(local, local_ids, remote, remote_ids, layers, &mut out)?;
    Ok(out)
}

/// [`plan`] into a reused vector (cleared first).
pub fn plan_into(
    local: &KvLayout,
    local_ids: &[u32],
    remote: &KvLayout,
    remote_ids: &[u32],
    layers: Range<u32>,
    out: &mut Vec<PlannedCopy>,
) -> Result<(), LayoutError> {
    out.clear();
    if local.block_bytes != remote.block_bytes || local.parts != remote.parts {
        return Err(LayoutError::BlockBytesMismatch {
            local: local.block_bytes,
            local_parts: local.parts.count(),
            remote: remote.block_bytes,
            remote_parts: remote.parts.count(),
        });
    }
    if local_ids.len() != remote_ids.len() {
        return Err(LayoutError::CountMismatch {
            local: local_ids.len(),
            remote: remote_ids.len(),
        });
    }
    local.check_ids("local", local_ids)?;
    remote.check_ids("remote", remote_ids)?;
    local.check_layers("local", &layers)?;
    remote.check_layers("remote", &layers)?;
    let len = local.block_bytes;
    let parts = local.parts.count();
    // Offsets cannot overflow: required_len() was checked when each layout
    // was built and every index is inside it.
    let mut push = |l: u64, r: u64| match out.last_mut() {
        Some(last) if last.local + last.len == l && last.remote + last.len == r => last.len += len,
        _ => out.push(PlannedCopy {
            local: l,
            remote: r,
            len,
        }),
    };
    let off = |layout: &KvLayout, layer: u32, part: u64, block: u32| {
        layout.base
            + u64::from(layer) * layout.layer_stride
            + part * layout.kv_stride
            + u64::from(block) * layout.block_stride
    };
    if local.blocks_outer() {
        for (&lb, &rb) in local_ids.iter().zip(remote_ids) {
            for layer in layers.clone() {
                for part in 0..parts {
                    push(off(local, layer, part, lb), off(remote, layer, part, rb));
                }
            }
        }
    } else {
        for layer in layers {
            for part in 0..parts {
                for (&lb, &rb) in local_ids.iter().zip(remote_ids) {
                    push(off(local, layer, part, lb), off(remote, layer, part, rb));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_layouts_have_expected_strides() {
        let l = KvLayout::new(4, 10, 256, KvParts::Separate, LayoutOrder::LayerMajor).unwrap();
        assert_eq!(
            (l.layer_stride, l.kv_stride, l.block_stride),
            (5120, 2560, 256)
        );
        assert_eq!(l.required_len(), Some(4 * 10 * 2 * 256));
        let b = KvLayout::new(4, 10, 256, KvParts::Separate, LayoutOrder::BlockMajor).unwrap();
        assert_eq!(
            (b.layer_stride, b.kv_stride, b.block_stride),
            (512, 256, 2048)
        );
        assert_eq!(b.required_len(), Some(4 * 10 * 2 * 256));
    }

    #[test]
    fn overlapping_strides_are_refused() {
        let e = KvLayout::with_strides(2, 4, 100, KvParts::Fused, 0, 100, 0, 100).unwrap_err();
        assert_eq!(e, LayoutError::BadStrides("blocks overlap"));
        assert!(KvLayout::new(0, 1, 1, KvParts::Fused, LayoutOrder::LayerMajor).is_err());
    }

    #[test]
    fn sequential_ids_merge_into_one_copy_per_layer_part() {
        let l = KvLayout::new(3, 100, 64, KvParts::Separate, LayoutOrder::LayerMajor).unwrap();
        let p = plan(&l, &[5, 6, 7, 8], &l, &[20, 21, 22, 23], 0..3).unwrap();
        assert_eq!(p.len(), 6);
        assert!(p.iter().all(|c| c.len == 4 * 64));
        let bm = KvLayout::new(3, 100, 64, KvParts::Separate, LayoutOrder::BlockMajor).unwrap();
        let p = plan(&bm, &[5, 6, 7, 8], &bm, &[20, 21, 22, 23], 0..3).unwrap();
        assert_eq!(
            p,
            vec![PlannedCopy {
                local: 5 * 384,
                remote: 20 * 384,
                len: 4 * 384
            }]
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let l = KvLayout::new(2, 8, 64, KvParts::Fused, LayoutOrder::LayerMajor).unwrap();
        let e = plan(&l, &[1, 9], &l, &[1, 2], 0..2).unwrap_err();
        assert_eq!(
            e,
            LayoutError::BlockOutOfRange {
                side: "local",
                id: 9,
                index: 1,
                num_blocks: 8
            }
        );
        assert!(e.to_string().contains("local block id 9 (position 1)"));
        let e = plan(&l, &[1], &l, &[1, 2], 0..2).unwrap_err();
        assert_eq!(
            e,
            LayoutError::CountMismatch {
                local: 1,
                remote: 2
            }
        );
        let e = plan(&l, &[1], &l, &[1], 0..3).unwrap_err();
        assert!(matches!(e, LayoutError::LayersOutOfRange { end: 3, .. }));
        let other = KvLayout::new(2, 8, 32, KvParts::Fused, LayoutOrder::LayerMajor).unwrap();
        let e = plan(&l, &[1], &other, &[1], 0..2).unwrap_err();
        assert!(matches!(
            e,
            LayoutError::BlockBytesMismatch {
                local: 64,
                remote: 32,
                ..
            }
        ));
    }
}
