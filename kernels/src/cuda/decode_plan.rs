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
    }
}
