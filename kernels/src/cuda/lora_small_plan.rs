//! Whether a LoRA call runs as `lora_fused_small.cu`'s one launch (issue 29, opt-in
//! `THAW_CUDA_LORA_SMALL=1`) instead of `lora_punica.cu`'s shrink + expand pair, and with what
//! grid: a pure function the CUDA backend calls per (step, module) and the tests check without a
//! GPU.
//!
//! The fused kernel is correct for any call (every block recomputes the shrink for its rows and
//! waits on no other block); this plan only says where it is expected to be the faster one.
//! Every block reads the whole of A and its rows of x (from L2 after the first block's read), so
//! one block's shrink costs about `d_in · (rank · weight bytes + rows · 4)` bytes at the
//! bandwidth one SM draws from L2 (of the order of 100 GB/s): the plan takes calls of at most
//! [`MAX_ROWS`] rows and rank [`MAX_RANK`] whose block reads at most [`MAX_BLOCK_BYTES`] (about
//! 5 µs at that rate, under the host cost of the launch it saves), and splits the output
//! columns into few enough tiles that A and x are re-read at most [`MAX_SHRINK_READS`] times a
//! call (the L2's bandwidth is shared by all SMs) and at most [`MAX_TILES`] times per adapter.
//! The numbers are first guesses to be tuned from `thaw-bench gpu`'s side-by-side rows.
use super::registry::{shape, DType};

/// The most rows a fused call takes (a decode step's few sequences).
pub const MAX_ROWS: usize = 8;
/// The largest adapter rank a fused call takes.
pub const MAX_RANK: usize = 64;
/// The most bytes one block's shrink may read: all of A plus its rows of x.
pub const MAX_BLOCK_BYTES: usize = 640 << 10;
/// The most column tiles per (segment, row chunk) or BGMV row: each re-reads A and x.
pub const MAX_TILES: usize = 16;
/// The most blocks a call launches, so at most this many re-reads of the shrink's inputs.
pub const MAX_SHRINK_READS: usize = 64;
/// The fewest output columns a tile takes (past this, more tiles only add shrink re-reads).
pub const MIN_COLS: usize = 64;

/// The facts the decision reads, about one LoRA call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SmallCall {
    /// Rows of the call (the step's rows).
    pub rows: usize,
    /// The largest rank among the call's on-device adapters for this module.
    pub max_rank: usize,
    pub d_in: usize,
    pub d_out: usize,
    /// The adapters' stored dtype.
    pub dtype: DType,
    /// The device's multiprocessors.
    pub sms: usize,
    /// Blocks per column tile: for SGMV, segments × ⌈longest segment / `PUNICA_ROWS`⌉; for
    /// BGMV, rows.
    pub units: usize,
}

/// The fused kernel's column tiling: grid `(units…, tiles)`, block `PUNICA_THREADS`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SmallGrid {
    /// Output columns per block: a multiple of 32.
    pub cols: usize,
    /// Column tiles, `⌈d_out / cols⌉`: none of them empty.
    pub tiles: usize,
}

/// Bytes one block's shrink reads: A (`max_rank × d_in` weights) and up to `PUNICA_ROWS` rows
/// of x in f32.
pub fn block_bytes(c: &SmallCall) -> usize {
    let rows = c.rows.min(shape::PUNICA_ROWS as usize);
    c.d_in
        .saturating_mul(c.max_rank * c.dtype.size() + rows * 4)
}

/// The fused kernel's grid for `c`, or `None` where the two-launch path should run (see the
/// module docs for the limits).
pub fn plan(c: &SmallCall) -> Option<SmallGrid> {
    let fits_i32 = |v: usize| i32::try_from(v).is_ok();
    let served = (1..=MAX_ROWS).contains(&c.rows)
        && (1..=MAX_RANK.min(shape::PUNICA_MAX_RANK)).contains(&c.max_rank)
        && c.d_in > 0
        && c.d_out > 0
        && c.units > 0
        && fits_i32(c.d_in)
        && fits_i32(c.d_out)
        && block_bytes(c) <= MAX_BLOCK_BYTES;
    if !served {
        return None;
    }
    let blocks = c.sms.clamp(1, MAX_SHRINK_READS);
    let want = (blocks / c.units)
        .clamp(1, MAX_TILES)
        .min(c.d_out.div_ceil(MIN_COLS))
        .max(1);
    let cols = c.d_out.div_ceil(want).next_multiple_of(32);
    Some(SmallGrid {
        cols,
        tiles: c.d_out.div_ceil(cols),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn call(rows: usize, max_rank: usize, d_in: usize, d_out: usize, dtype: DType) -> SmallCall {
        SmallCall {
            rows,
            max_rank,
            d_in,
            d_out,
            dtype,
            sms: 132,
            units: rows,
        }
    }

    #[test]
    fn a_7b_decode_step_fuses_and_wide_calls_do_not() {
        // q_proj at one row, rank 16, bf16 on an H100: 16 tiles of 256 columns.
        let g = plan(&call(1, 16, 4096, 4096, DType::Bf16));
        assert_eq!(
            g,
            Some(SmallGrid {
                cols: 256,
                tiles: 16
            })
        );
        // Eight rows of distinct adapters (BGMV): 8 tiles each, 64 blocks in all.
        let g = plan(&call(8, 16, 4096, 4096, DType::Bf16)).unwrap();
        assert_eq!((g.cols, g.tiles), (512, 8));
        // Rank 64 at eight rows still fits a block's budget in bf16, not in f32.
        assert!(plan(&call(8, 64, 4096, 4096, DType::Bf16)).is_some());
        assert_eq!(plan(&call(1, 64, 4096, 4096, DType::F32)), None);
        // down_proj (d_in 11008) at rank 16 fuses, at rank 64 its A alone is 1.4 MB a block.
        assert!(plan(&call(4, 16, 11008, 4096, DType::Bf16)).is_some());
        assert_eq!(plan(&call(1, 64, 11008, 4096, DType::Bf16)), None);
        // Past the row or rank limits, and empty calls: the two-launch path.
        assert_eq!(plan(&call(9, 16, 4096, 4096, DType::Bf16)), None);
        assert_eq!(plan(&call(1, 128, 1024, 1024, DType::Bf16)), None);
        assert_eq!(plan(&call(0, 16, 4096, 4096, DType::Bf16)), None);
        assert_eq!(plan(&call(1, 0, 4096, 4096, DType::Bf16)), None);
        // A narrow output (576 columns) is not cut below MIN_COLS a tile.
        let g = plan(&call(1, 16, 1536, 576, DType::F16)).unwrap();
        assert_eq!((g.cols, g.tiles), (64, 9));
    }

    proptest! {
        #[test]
        fn the_grid_covers_d_out_within_the_limits(
            rows in 0usize..12,
            max_rank in 0usize..300,
            d_in in 0usize..20_000,
            d_out in 0usize..20_000,
            dt in 0usize..3,
            sms in 0usize..300,
            units in 0usize..40,
        ) {
            let c = SmallCall {
                rows, max_rank, d_in, d_out, dtype: DType::ALL[dt], sms, units,
            };
            match plan(&c) {
                None => prop_assert!(
                    !(1..=MAX_ROWS).contains(&rows)
                        || !(1..=MAX_RANK).contains(&max_rank)
                        || d_in == 0
                        || d_out == 0
                        || units == 0
                        || block_bytes(&c) > MAX_BLOCK_BYTES
                ),
                Some(g) => {
                    prop_assert!(rows <= MAX_ROWS && max_rank <= MAX_RANK);
                    prop_assert!(block_bytes(&c) <= MAX_BLOCK_BYTES);
                    prop_assert_eq!(g.cols % 32, 0);
                    // Every column in exactly one tile, no tile empty.
                    prop_assert!(g.tiles * g.cols >= d_out);
                    prop_assert!((g.tiles - 1) * g.cols < d_out);
                    prop_assert!(g.tiles <= MAX_TILES);
                    // The shrink is re-read at most MAX_SHRINK_READS times, unless one tile
                    // per unit already exceeds it.
                    prop_assert!(g.tiles == 1 || g.tiles * units <= MAX_SHRINK_READS);
                    prop_assert!(g.tiles == 1 || g.cols >= MIN_COLS);
                    // A smaller rank is served too (the budget only grows with the rank).
                    let smaller = SmallCall { max_rank: (max_rank / 2).max(1), ..c };
                    prop_assert!(plan(&smaller).is_some());
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "lora_small_emu_tests.rs"]
mod emu_tests;
