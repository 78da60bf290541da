//! Launch geometry of `attention_split.cu`'s flash-decoding, as a pure function: how many
//! blocks one decode row's context is split across.
//!
//! A decode step has `rows · n_heads` (row, head) pairs; at small batch that is far fewer than
//! the blocks a GPU needs in flight to stream the KV cache at full bandwidth, so each context
//! is cut into chunks of at least `min_chunk` positions (a block must read enough keys to
//! amortise its start and the reduce) until the grid has about [`WAVES`] blocks per SM.
pub const WAVES: usize = 4;
/// The shortest chunk the planner makes by default (positions).
pub const MIN_CHUNK: usize = 256;
/// The most splits of one context (bounds the scratch).
pub const MAX_SPLITS: usize = 64;

/// How a decode step splits its contexts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DecodeSplit {
    /// Blocks per (row, head), ≥ 1.
    pub splits: usize,
    /// Positions per block, ≥ 1; `splits · chunk` ≥ the longest context.
    pub chunk: usize,
}

impl DecodeSplit {
    /// Plans a step whose longest attended context is `max_ctx` positions (window applied),
    /// over `pairs` (row, head) pairs on `sms` multiprocessors, no chunk under `min_chunk`.
    pub fn plan(max_ctx: usize, pairs: usize, sms: usize, min_chunk: usize) -> DecodeSplit {
        let ctx = max_ctx.max(1);
        let by_len = (ctx / min_chunk.max(1)).max(1);
        let want = (WAVES * sms.max(1)).div_ceil(pairs.max(1));
        let splits = want.min(by_len).clamp(1, MAX_SPLITS);
        let chunk = ctx.div_ceil(splits);
        DecodeSplit {
            splits: ctx.div_ceil(chunk),
            chunk,
        }
    }

    /// f32 elements of the two scratch buffers: (partial outputs, (max, sum) pairs).
    pub fn scratch_len(&self, pairs: usize, head_dim: usize) -> (usize, usize) {
        (pairs * self.splits * head_dim, pairs * self.splits * 2)
    }
}

/// Blocks per SM the occupancy plan ([`occupancy_splits`]) aims for.
pub const OCC_WAVES: usize = 2;
/// The occupancy plan's default floor chunk (positions): no split reads fewer keys of the
/// longest context (a block of 4 warps then walks ≥ 8 keys a warp).
pub const OCC_MIN_CHUNK: usize = 32;

/// The occupancy plan (`THAW_CUDA_SPLIT_PLAN=occupancy`): how many blocks each (row, head)
/// pair's context is split across, so that `pairs · splits` reaches [`OCC_WAVES`] blocks per SM
/// where the longest context (`max_ctx`, window applied) allows, never cutting it into chunks
/// under `floor` positions and never more than [`MAX_SPLITS`]. A context under `2 · floor` is
/// not split. Unlike [`DecodeSplit::plan`] the split count, not a chunk length, is planned:
/// every row then cuts its own context into `splits` near-equal ranges ([`split_range`]), so
/// no block of the longest row is empty and a CUDA graph can fix `splits` per bucket.
/// Monotone in `max_ctx`, antitone in `pairs`.
pub fn occupancy_splits(max_ctx: usize, pairs: usize, sms: usize, floor: usize) -> usize {
    let by_len = max_ctx / floor.max(1);
    let want = (OCC_WAVES * sms.max(1)).div_ceil(pairs.max(1));
    want.min(by_len).clamp(1, MAX_SPLITS)
}

/// Partial results (row, head, split) of one occupancy-planned launch are fewer than this on
/// `sms` multiprocessors whenever it splits (`splits > 1` means `pairs < target`, and `splits
/// ≤ ⌈target / pairs⌉`), so a scratch of this many partials, allocated once, serves every
/// step, eager or captured in a CUDA graph. One split needs no scratch.
pub fn occupancy_max_partials(sms: usize) -> usize {
    2 * OCC_WAVES * sms.max(1)
}

/// The splits a row whose attended context is `len` positions uses of a launch's `splits`:
/// as many as keep its chunks at least `floor` long, at least 1. The launch's other blocks of
/// the row write a neutral partial (max −∞, sum 0) that the reduce skips. A launch planned
/// from the step's longest context gives that row all of them; a CUDA graph's launch, planned
/// for the bucket without knowing the contexts, gives each row what its context allows.
/// `attention_split_ilp.cu` computes the same count.
pub fn row_splits(len: usize, splits: usize, floor: usize) -> usize {
    (len / floor.max(1)).clamp(1, splits.max(1))
}

/// Positions `[start, end)` (relative to the row's first attended position) that split `s` of
/// `splits` covers of a context of `len` positions: `[s · len / splits, (s + 1) · len /
/// splits)`. The ranges tile `0..len` in order, each `len / splits` or one more long.
/// `attention_split_ilp.cu` computes the same bounds (with `splits` = [`row_splits`]).
pub fn split_range(len: usize, splits: usize, s: usize) -> (usize, usize) {
    let n = splits.max(1);
    (s * len / n, (s + 1) * len / n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn batch_one_long_context_fills_an_h100() {
        // 32 heads, 8k context on 132 SMs: 17 splits of 482 positions → 544 blocks.
        let p = DecodeSplit::plan(8192, 32, 132, MIN_CHUNK);
        assert_eq!(
            p,
            DecodeSplit {
                splits: 17,
                chunk: 482
            }
        );
        // A full batch needs no split; a short context is never cut below min_chunk.
        assert_eq!(DecodeSplit::plan(8192, 64 * 32, 132, MIN_CHUNK).splits, 1);
        assert_eq!(DecodeSplit::plan(300, 32, 132, MIN_CHUNK).splits, 1);
        assert_eq!(DecodeSplit::plan(600, 32, 132, MIN_CHUNK).splits, 2);
        assert_eq!(DecodeSplit::plan(100, 1, 132, MIN_CHUNK).splits, 1);
    }

    proptest! {
        #[test]
        fn chunks_cover_every_context_and_none_is_empty(
            max_ctx in 1usize..200_000,
            pairs in 1usize..10_000,
            sms in 1usize..200,
            min_chunk in 1usize..2048,
        ) {
            let p = DecodeSplit::plan(max_ctx, pairs, sms, min_chunk);
            prop_assert!(p.splits >= 1 && p.splits <= MAX_SPLITS && p.chunk >= 1);
            prop_assert!(p.splits * p.chunk >= max_ctx);
            // The longest context reaches into the last split.
            prop_assert!((p.splits - 1) * p.chunk < max_ctx);
            if p.splits > 1 {
                prop_assert!(p.chunk >= min_chunk);
            }
            prop_assert_eq!(p.scratch_len(3, 64), (3 * p.splits * 64, 6 * p.splits));
        }

        #[test]
        fn the_occupancy_plan_tiles_every_context_and_meets_its_target(
            max_ctx in 0usize..100_000,
            pairs in 1usize..5_000,
            sms in 1usize..200,
            floor in 1usize..512,
            shorter in 0usize..100_000,
        ) {
            let splits = occupancy_splits(max_ctx, pairs, sms, floor);
            prop_assert!((1..=MAX_SPLITS).contains(&splits));
            // Tiny contexts are not split.
            if max_ctx < 2 * floor {
                prop_assert_eq!(splits, 1);
            }
            // The longest context's chunks are never under the floor.
            if splits > 1 {
                prop_assert!(max_ctx / splits >= floor);
            }
            // The block target is met wherever the context and MAX_SPLITS allow it.
            let target = OCC_WAVES * sms;
            let want = target.div_ceil(pairs);
            if max_ctx / floor >= want && want <= MAX_SPLITS {
                prop_assert!(pairs * splits >= target);
                // ... and not overshot by more than one split's worth.
                prop_assert!(pairs * (splits - 1) < target);
            }
            // The fixed scratch holds every launch that splits.
            if splits > 1 {
                prop_assert!(pairs * splits < occupancy_max_partials(sms));
            }
            // Monotone in the context, antitone in the pairs.
            prop_assert!(occupancy_splits(max_ctx + 1, pairs, sms, floor) >= splits);
            prop_assert!(occupancy_splits(max_ctx, pairs + 1, sms, floor) <= splits);
            // Every position of every row (the longest and a shorter one) is covered exactly
            // once, in order, over the row's own splits; the longest row uses them all, with no
            // empty one; a row's chunks are under the floor only where it has one split.
            // The same with a CUDA graph's launch, planned without the contexts.
            let graph = occupancy_splits(usize::MAX, pairs, sms, floor);
            prop_assert!(graph >= splits);
            for (launch, len) in [
                (splits, max_ctx),
                (splits, shorter.min(max_ctx)),
                (graph, max_ctx),
                (graph, shorter),
            ] {
                let rs = row_splits(len, launch, floor);
                prop_assert!((1..=launch).contains(&rs));
                if len == max_ctx && launch == splits {
                    prop_assert_eq!(rs, splits);
                }
                let mut next = 0;
                for s in 0..rs {
                    let (a, b) = split_range(len, rs, s);
                    prop_assert_eq!(a, next);
                    prop_assert!(b >= a && b - a <= len / rs + 1);
                    if rs > 1 {
                        prop_assert!(b - a >= floor);
                    }
                    next = b;
                }
                prop_assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn the_occupancy_plan_splits_a_short_decode_across_the_gpu() {
        // Llama-7B at batch 1, 130 positions, 132 SMs: 264 blocks wanted, 9 splits a head;
        // the 32-position floor allows 4 (128 blocks instead of the fixed plan's 32).
        assert_eq!(occupancy_splits(130, 32, 132, OCC_MIN_CHUNK), 4);
        assert_eq!(DecodeSplit::plan(130, 32, 132, MIN_CHUNK).splits, 1);
        assert_eq!(occupancy_splits(2048, 32, 132, OCC_MIN_CHUNK), 9);
        // Batch 8 (256 pairs): 2 splits; batch 32 fills the GPU unsplit; 63 positions never split.
        assert_eq!(occupancy_splits(512, 8 * 32, 132, OCC_MIN_CHUNK), 2);
        assert_eq!(occupancy_splits(8191, 32 * 32, 132, OCC_MIN_CHUNK), 1);
        assert_eq!(occupancy_splits(63, 1, 132, OCC_MIN_CHUNK), 1);
        // A graph of bucket 1 plans for any context: 9 splits, of which a 130-position row
        // uses 4.
        assert_eq!(occupancy_splits(usize::MAX, 32, 132, OCC_MIN_CHUNK), 9);
        assert_eq!(row_splits(130, 9, OCC_MIN_CHUNK), 4);
        assert_eq!(row_splits(20, 9, OCC_MIN_CHUNK), 1);
        assert_eq!(occupancy_max_partials(132), 528);
        assert_eq!(split_range(130, 4, 0), (0, 32));
        assert_eq!(split_range(130, 4, 3), (97, 130));
    }
}
