//! Launch geometry of `lora_punica.cu`'s split-K shrink, as a pure function the CUDA backend
//! calls once per (step, module) and the tests check without a GPU.
//!
//! The shrink `v = x · Aᵀ` has K = d_in (up to tens of thousands) and N = rank (8–256): too few
//! output elements to fill a GPU at decode batch sizes, so K is split across blocks. Each block
//! stages one K chunk of its rows of `x` in shared memory, so a chunk is at most
//! [`shape::PUNICA_K_CHUNK`] elements; below that the split count is raised until the grid has
//! about [`WAVES`] blocks per SM, but no chunk gets shorter than [`MIN_K_CHUNK`] (a block must
//! stream enough of A to amortise its start). The partial sums land in `v_parts`
//! (`[splits, rows, v_stride]` f32) and the expand adds them up.
use super::registry::shape;

/// Blocks per SM the shrink's grid aims for.
pub const WAVES: usize = 4;
/// The shortest K chunk split-K makes (elements).
pub const MIN_K_CHUNK: usize = 256;
/// The most K chunks: d_in ≤ `MAX_SPLITS · PUNICA_K_CHUNK`.
pub const MAX_SPLITS: usize = 64;

/// How one shrink splits K.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SplitK {
    /// Number of K chunks (≥ 1); every chunk but possibly the last is full.
    pub splits: usize,
    /// Elements per chunk: a multiple of 8 (a 16-byte load of 16-bit weights).
    pub k_chunk: usize,
}

impl SplitK {
    /// Plans the split of `d_in` for a shrink whose grid has `blocks` blocks before splitting
    /// (segments × rank tiles × row chunks) on a device with `sms` multiprocessors. `max_chunk`
    /// caps the chunk below [`shape::PUNICA_K_CHUNK`] (tests force many splits with it; it is
    /// rounded up to a multiple of 8). `None` when d_in needs more than [`MAX_SPLITS`] chunks.
    pub fn plan(d_in: usize, blocks: usize, sms: usize, max_chunk: usize) -> Option<SplitK> {
        let cap = max_chunk
            .clamp(8, shape::PUNICA_K_CHUNK)
            .next_multiple_of(8);
        let cap = cap.min(shape::PUNICA_K_CHUNK);
        let d = d_in.max(1);
        let min_splits = d.div_ceil(cap);
        if min_splits > MAX_SPLITS {
            return None;
        }
        // Splits that fill the device, bounded by the shortest worthwhile chunk.
        let want = (WAVES * sms.max(1)).div_ceil(blocks.max(1));
        let by_len = d.div_ceil(MIN_K_CHUNK.min(cap)).max(1);
        let splits = want.min(by_len).clamp(min_splits, MAX_SPLITS);
        let k_chunk = d.div_ceil(splits).next_multiple_of(8).min(cap);
        // Rounding the chunk up may leave the last split empty: drop it.
        let splits = d.div_ceil(k_chunk);
        Some(SplitK { splits, k_chunk })
    }

    /// f32 elements of `v_parts` for `rows` rows of `v_stride` columns.
    pub fn v_len(&self, rows: usize, v_stride: usize) -> usize {
        self.splits * rows * v_stride
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decode_on_an_h100_splits_a_7b_projection() {
        // One row, one rank-16 adapter: 1 segment × 1 rank tile × 1 row chunk on 132 SMs.
        let p = SplitK::plan(4096, 1, 132, usize::MAX).unwrap();
        assert_eq!(
            p,
            SplitK {
                splits: 16,
                k_chunk: 256
            }
        );
        // A big batch fills the device without splitting past the staging limit.
        let p = SplitK::plan(4096, 64 * 8, 132, usize::MAX).unwrap();
        assert_eq!(
            p,
            SplitK {
                splits: 4,
                k_chunk: 1024
            }
        );
        // Llama-70B's down projection needs 28 chunks whatever the batch.
        let p = SplitK::plan(28672, 10_000, 132, usize::MAX).unwrap();
        assert_eq!(
            p,
            SplitK {
                splits: 28,
                k_chunk: 1024
            }
        );
        assert_eq!(SplitK::plan(1 << 20, 1, 132, usize::MAX), None);
    }

    proptest! {
        #[test]
        fn chunks_cover_d_in_exactly_and_respect_the_limits(
            d_in in 1usize..70_000,
            blocks in 1usize..100_000,
            sms in 1usize..200,
            max_chunk in 1usize..4096,
        ) {
            match SplitK::plan(d_in, blocks, sms, max_chunk) {
                None => prop_assert!(d_in.div_ceil(max_chunk.clamp(8, 1024).next_multiple_of(8).min(1024)) > MAX_SPLITS),
                Some(p) => {
                    prop_assert!(p.splits >= 1 && p.splits <= MAX_SPLITS);
                    prop_assert_eq!(p.k_chunk % 8, 0);
                    prop_assert!(p.k_chunk <= shape::PUNICA_K_CHUNK);
                    prop_assert!(p.k_chunk <= max_chunk.max(8).next_multiple_of(8));
                    // Every chunk starts inside d_in and together they reach its end.
                    prop_assert!((p.splits - 1) * p.k_chunk < d_in);
                    prop_assert!(p.splits * p.k_chunk >= d_in);
                    prop_assert_eq!(p.v_len(3, 16), p.splits * 48);
                }
            }
        }
    }
}
