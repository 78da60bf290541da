//! Launch geometry of `lora_slices.cu` (issue 29, a default; off: `THAW_CUDA_LORA_SLICES=0`): the LoRA
//! of up to [`shape::PUNICA_MAX_SLICES`] modules sharing one input (q/k/v, gate/up) as one
//! shrink launch and one expand launch, as pure functions the CUDA backend calls and the tests
//! check without a GPU. The block decoders mirror the kernels' index math line for line.
//!
//! Every slice runs with ONE split-K plan ([`common_split`]): the one its per-module launch
//! would use, so its f32 sums run in the same order and its result is bit-identical to the
//! per-module Punica path. Where the slices' own plans differ (modules of different ranks
//! whose rank tiles change the planner's block count), the caller launches per module.
use super::punica_plan::SplitK;
use super::registry::shape;

/// What the slices' blocks walk: SGMV segments (in row chunks of [`shape::PUNICA_ROWS`]) or
/// BGMV rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Gather {
    Sgmv { n_segs: usize, chunks: usize },
    Bgmv { rows: usize },
}

impl Gather {
    /// grid.x (segments or rows) and the inner factor of grid.z (row chunks, 1 for BGMV).
    fn units(self) -> (usize, usize) {
        match self {
            Gather::Sgmv { n_segs, chunks } => (n_segs, chunks),
            Gather::Bgmv { rows } => (rows, 1),
        }
    }
}

/// The two grids of one sliced call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SliceGrids {
    pub shrink: (u32, u32, u32),
    pub expand: (u32, u32, u32),
}

fn dim(n: usize, what: &str) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{what} = {n} does not fit a grid dimension"))
}

/// The largest grid.y / grid.z CUDA launches.
pub const MAX_GRID_YZ: usize = 65_535;

/// The grids for `gather` with `tiles` rank tiles (of the largest rank over the slices),
/// `splits` K chunks and the slices' output widths `d_outs` (1 to
/// [`shape::PUNICA_MAX_SLICES`]). None when grid.y or grid.z would pass [`MAX_GRID_YZ`] (a
/// prefill segment of more than 87,380 rows with three slices): the caller launches per
/// module.
pub fn grids(gather: Gather, tiles: usize, splits: usize, d_outs: &[usize]) -> Option<SliceGrids> {
    assert!(
        (1..=shape::PUNICA_MAX_SLICES).contains(&d_outs.len()),
        "{} slices: lora_slices.cu takes 1 to {}",
        d_outs.len(),
        shape::PUNICA_MAX_SLICES
    );
    let (x, inner) = gather.units();
    let z = inner * d_outs.len();
    let widest = d_outs.iter().copied().max().unwrap_or(0);
    let cols = widest.div_ceil(shape::PUNICA_EXPAND_COLS as usize);
    if [z, tiles * splits, cols].iter().any(|&n| n > MAX_GRID_YZ) {
        return None;
    }
    let (x, z) = (dim(x, "grid.x"), dim(z, "grid.z"));
    Some(SliceGrids {
        shrink: (x, dim(tiles * splits, "grid.y"), z),
        expand: (x, dim(cols, "grid.y"), z),
    })
}

/// The work of one shrink block: (slice, segment or row, row chunk, rank tile, K split).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShrinkBlock {
    pub slice: usize,
    pub unit: usize,
    pub chunk: usize,
    pub tile: usize,
    pub split: usize,
}

/// What shrink block `(bx, by, bz)` computes, as `slices_{sgmv,bgmv}_shrink` decode it (None:
/// it returns at once).
pub fn shrink_block(
    gather: Gather,
    n_slices: usize,
    splits: usize,
    (bx, by, bz): (usize, usize, usize),
) -> Option<ShrinkBlock> {
    let (units, inner) = gather.units();
    let (slice, chunk) = (bz / inner, bz % inner);
    (bx < units && slice < n_slices).then_some(ShrinkBlock {
        slice,
        unit: bx,
        chunk,
        tile: by / splits,
        split: by % splits,
    })
}

/// The work of one expand block: (slice, segment or row, row chunk, first output column).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExpandBlock {
    pub slice: usize,
    pub unit: usize,
    pub chunk: usize,
    pub c0: usize,
}

/// What expand block `(bx, by, bz)` computes for slices of widths `d_outs`, as
/// `slices_{sgmv,bgmv}_expand` decode it (None: past its slice's d_out, it returns).
pub fn expand_block(
    gather: Gather,
    d_outs: &[usize],
    (bx, by, bz): (usize, usize, usize),
) -> Option<ExpandBlock> {
    let (units, inner) = gather.units();
    let (slice, chunk) = (bz / inner, bz % inner);
    let c0 = by * shape::PUNICA_EXPAND_COLS as usize;
    (bx < units && slice < d_outs.len() && c0 < d_outs[slice]).then_some(ExpandBlock {
        slice,
        unit: bx,
        chunk,
        c0,
    })
}

/// The split-K plan every slice runs with: the slices' own (per-module) plans when they are
/// one plan, else None (the caller launches per module, so results stay bit-identical).
pub fn common_split(plans: &[SplitK]) -> Option<SplitK> {
    let first = *plans.first()?;
    plans.iter().all(|p| *p == first).then_some(first)
}

/// f32 elements of `v_parts` for `n_slices` slices of `rows` rows, `v_stride` columns.
pub fn v_len(split: &SplitK, n_slices: usize, rows: usize, v_stride: usize) -> usize {
    n_slices * split.v_len(rows, v_stride)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn all_blocks(g: (u32, u32, u32)) -> impl Iterator<Item = (usize, usize, usize)> {
        let (x, y, z) = (g.0 as usize, g.1 as usize, g.2 as usize);
        (0..x).flat_map(move |a| (0..y).flat_map(move |b| (0..z).map(move |c| (a, b, c))))
    }

    #[test]
    fn qkv_of_a_7b_at_batch_one_is_two_launches_over_three_slices() {
        // One segment of one row, rank 16, 16 splits; q 4096 wide, GQA k/v 1024.
        let g = grids(
            Gather::Sgmv {
                n_segs: 1,
                chunks: 1,
            },
            1,
            16,
            &[4096, 1024, 1024],
        )
        .unwrap();
        assert_eq!(g.shrink, (1, 16, 3));
        assert_eq!(g.expand, (1, 16, 3));
        // k's expand has 4 column tiles of work; the other 12 return at once.
        let live = all_blocks(g.expand)
            .filter_map(|b| {
                expand_block(
                    Gather::Sgmv {
                        n_segs: 1,
                        chunks: 1,
                    },
                    &[4096, 1024, 1024],
                    b,
                )
            })
            .filter(|e| e.slice == 1)
            .count();
        assert_eq!(live, 4);
    }

    #[test]
    fn a_grid_past_the_z_limit_is_left_to_the_per_module_launches() {
        let sgmv = |rows: usize| Gather::Sgmv {
            n_segs: 1,
            chunks: rows.div_ceil(shape::PUNICA_ROWS as usize),
        };
        assert!(grids(sgmv(87_380), 1, 4, &[4096; 3]).is_some());
        assert_eq!(grids(sgmv(87_381), 1, 4, &[4096; 3]), None);
        assert!(grids(sgmv(87_381), 1, 4, &[4096; 2]).is_some());
    }

    #[test]
    fn slices_share_a_plan_only_when_every_module_plans_the_same() {
        let a = SplitK::plan(4096, 1, 132, usize::MAX).unwrap();
        let b = SplitK::plan(4096, 64 * 8, 132, usize::MAX).unwrap();
        assert_ne!(a, b);
        assert_eq!(common_split(&[a, a, a]), Some(a));
        assert_eq!(common_split(&[a, b, a]), None);
        assert_eq!(common_split(&[]), None);
        assert_eq!(v_len(&a, 3, 2, 16), 3 * a.splits * 2 * 16);
    }

    fn gather() -> impl Strategy<Value = Gather> {
        prop_oneof![
            (1usize..9, 1usize..6).prop_map(|(n_segs, chunks)| Gather::Sgmv { n_segs, chunks }),
            (1usize..40).prop_map(|rows| Gather::Bgmv { rows }),
        ]
    }

    proptest! {
        /// Every (slice, unit, chunk, tile, split) is one shrink block, and every (slice, unit,
        /// chunk, column tile inside its d_out) one expand block: nothing computed twice (the
        /// expand adds into y) or skipped.
        #[test]
        fn grids_cover_every_slice_unit_tile_and_split_once(
            gather in gather(),
            tiles in 1usize..9,
            splits in 1usize..17,
            d_outs in prop::collection::vec(1usize..3000, 1..=3),
        ) {
            let g = grids(gather, tiles, splits, &d_outs).expect("small grids");
            let (units, inner) = gather.units();
            let n = d_outs.len();
            let mut seen = HashSet::new();
            for b in all_blocks(g.shrink) {
                let s = shrink_block(gather, n, splits, b).expect("every shrink block has work");
                prop_assert!(s.tile < tiles && s.split < splits && s.chunk < inner);
                prop_assert!(seen.insert(s), "shrink block {:?} twice", s);
            }
            prop_assert_eq!(seen.len(), n * units * inner * tiles * splits);
            let mut seen = HashSet::new();
            for b in all_blocks(g.expand) {
                if let Some(e) = expand_block(gather, &d_outs, b) {
                    prop_assert!(e.c0 < d_outs[e.slice]);
                    prop_assert!(seen.insert(e), "expand block {:?} twice", e);
                }
            }
            let cols = shape::PUNICA_EXPAND_COLS as usize;
            let want: usize = d_outs.iter().map(|d| units * inner * d.div_ceil(cols)).sum();
            prop_assert_eq!(seen.len(), want);
        }
    }
}
