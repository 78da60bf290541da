//! `lora_fused_small.cu`'s index arithmetic replayed on the CPU, thread by thread (review
//! h29rev): the shrink (`small_rank_dots`: every (rank, k) term taken exactly once, every load of
//! A in bounds and aligned, every v element owned by one warp in every K chunk), the staging of x
//! (`small_fetch_x` / the scalar path: each staged value once, in bounds), and the expand
//! (`punica_expand_cols` over the plan's column tiles and the SGMV / BGMV grids: every y element
//! of a row with an adapter added to exactly once, by one block, and none of another row).
use super::*;
use crate::cuda::registry::shape::{PUNICA_K_CHUNK, PUNICA_MAX_RANK};
use proptest::prelude::*;

const THREADS: usize = shape::PUNICA_THREADS as usize;
const WARPS: usize = THREADS / 32;
const ROWS: usize = shape::PUNICA_ROWS as usize;
/// `SMALL_RANKS_IN_FLIGHT`, `SMALL_LOADS_IN_FLIGHT`.
const RU: usize = 2;
const U: usize = 4;

/// Elements of the weight dtype in one 16-byte load (`Vec16<W>::N`).
fn vec16(dt: DType) -> usize {
    16 / dt.size()
}

/// `small_rank_dots` for one K chunk, every warp and lane: adds 1 to `terms[r · d_in + k]` for
/// each term of A it multiplies (and checks each load's bounds and alignment), and returns the
/// warp that stores each `vs[k][r]`.
#[allow(clippy::too_many_arguments)]
fn shrink_chunk(
    dt: DType,
    a_aligned: bool,
    (k0, len, d_in): (usize, usize, usize),
    n: usize,
    rank: usize,
    terms: &mut [u8],
    writer: &mut [Option<usize>],
) {
    let v = vec16(dt);
    let step = 32 * v;
    let vec = a_aligned && (d_in * dt.size()).is_multiple_of(16) && k0.is_multiple_of(v);
    let mut take = |r: usize, j: usize, width: usize| {
        // A row r, chunk offset j: `width` consecutive elements, all inside A and the chunk.
        assert!(j + width <= len && k0 + j + width <= d_in && r < rank);
        if width > 1 {
            assert_eq!((r * d_in + k0 + j) % v, 0, "16-byte aligned load of A");
            assert_eq!(j % 4, 0, "float4 read of the staged x");
        }
        (0..width).for_each(|e| terms[r * d_in + k0 + j + e] += 1);
    };
    for warp in 0..WARPS {
        for lane in 0..32 {
            for r0 in (warp..rank).step_by(RU * WARPS) {
                let ranks = (0..RU).map(|q| r0 + q * WARPS).filter(|&r| r < rank);
                if vec {
                    let mut j = lane * v;
                    while j + (U - 1) * step + v <= len {
                        for r in ranks.clone() {
                            (0..U).for_each(|u| take(r, j + u * step, v));
                        }
                        j += U * step;
                    }
                    while j + v <= len {
                        ranks.clone().for_each(|r| take(r, j, v));
                        j += step;
                    }
                }
                for r in ranks.clone() {
                    let first = if vec { (len / v) * v + lane } else { lane };
                    (first..len).step_by(32).for_each(|j| take(r, j, 1));
                }
                if lane == 0 {
                    for r in ranks {
                        for k in 0..n {
                            assert!(r < PUNICA_MAX_RANK && k < ROWS, "vs[{k}][{r}]");
                            let w = &mut writer[k * PUNICA_MAX_RANK + r];
                            // The same warp every chunk (its read-modify-write is ordered).
                            assert!(w.is_none_or(|w| w == warp), "vs[{k}][{r}] by two warps");
                            *w = Some(warp);
                        }
                    }
                }
            }
        }
    }
}

/// `small_lora_block`'s staging of chunk `k0` of rows `start .. start + n`: each `xs[k][j]` of
/// the chunk written once, none other, every global read inside `rows × d_in`.
fn stage_x(x_aligned: bool, (start, n, rows): (usize, usize, usize), d_in: usize, k0: usize) {
    let len = PUNICA_K_CHUNK.min(d_in - k0);
    let mut xs = vec![0u8; ROWS * PUNICA_K_CHUNK];
    if x_aligned && d_in.is_multiple_of(4) {
        for tid in 0..THREADS {
            let t4 = 4 * tid;
            for k in 0..n {
                // small_fetch_x loaded it iff k0 + t4 < d_in; the store takes it iff t4 < len.
                assert_eq!(k0 + t4 < d_in, t4 < len);
                if t4 < len {
                    assert!((start + k) * d_in + k0 + t4 + 4 <= rows * d_in);
                    (0..4).for_each(|e| xs[k * PUNICA_K_CHUNK + t4 + e] += 1);
                }
            }
        }
    } else {
        for tid in 0..THREADS {
            for i in (tid..n * len).step_by(THREADS) {
                let (k, j) = (i / len, i % len);
                assert!((start + k) * d_in + k0 + j < rows * d_in);
                xs[k * PUNICA_K_CHUNK + j] += 1;
            }
        }
    }
    for k in 0..ROWS {
        for j in 0..PUNICA_K_CHUNK {
            let want = u8::from(k < n && j < len);
            assert_eq!(xs[k * PUNICA_K_CHUNK + j], want, "xs[{k}][{j}] at k0 {k0}");
        }
    }
}

/// `punica_expand_cols` of one block (columns `c0 .. c0 + cols`, rows `start .. start + n`):
/// adds 1 to `y[row · d_out + j]` per store, checking the reads of B and of v.
fn expand_block(
    dt: DType,
    b_aligned: bool,
    rank: usize,
    (start, n): (usize, usize),
    (c0, cols, d_out): (usize, usize, usize),
    y: &mut [u8],
) {
    let v = vec16(dt);
    let vec = b_aligned && (rank * dt.size()).is_multiple_of(16);
    let width = if vec { v } else { 1 };
    let chunks = rank.div_ceil(width);
    let mut g = 1;
    while g < chunks && g < 32 {
        g <<= 1;
    }
    let groups = THREADS / g;
    let iters = cols.div_ceil(groups);
    for tid in 0..THREADS {
        let (lane_g, group) = (tid & (g - 1), tid / g);
        // The shuffles (xor below g) stay inside one warp's aligned group of g lanes.
        assert!(32 % g == 0 && (tid - lane_g) / 32 == (tid - lane_g + g - 1) / 32);
        for i in 0..iters {
            let j = c0 + group + i * groups;
            let valid = j < d_out && group + i * groups < cols;
            if !valid {
                continue;
            }
            for c in (lane_g..chunks).step_by(g) {
                assert!(j * rank + c * width + width <= d_out * rank, "B read");
                assert!(
                    c * width + width <= rank && rank <= PUNICA_MAX_RANK,
                    "v read"
                );
                if vec {
                    assert_eq!((j * rank + c * v) % v, 0, "16-byte aligned load of B");
                }
            }
            if lane_g == 0 {
                (0..n).for_each(|k| y[(start + k) * d_out + j] += 1);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// One block's shrink over all of K: each A term once per row chunk, v written by one warp.
    #[test]
    fn the_shrink_takes_every_term_once_in_bounds(
        dt in prop::sample::select(DType::ALL.to_vec()),
        a_aligned in any::<bool>(),
        x_aligned in any::<bool>(),
        rank in prop_oneof![1usize..=MAX_RANK, Just(PUNICA_MAX_RANK)],
        d_in in prop_oneof![1usize..70, 1000usize..1100, Just(4096), 2040usize..2060, Just(5000)],
        n in 1usize..=ROWS,
    ) {
        let mut terms = vec![0u8; rank * d_in];
        let mut writer = vec![None; ROWS * PUNICA_MAX_RANK];
        let rows = n + 2;
        for k0 in (0..d_in).step_by(PUNICA_K_CHUNK) {
            let len = PUNICA_K_CHUNK.min(d_in - k0);
            stage_x(x_aligned, (2, n, rows), d_in, k0);
            shrink_chunk(dt, a_aligned, (k0, len, d_in), n, rank, &mut terms, &mut writer);
        }
        prop_assert!(terms.iter().all(|&t| t == 1), "every (rank, k) term once");
        for k in 0..ROWS {
            for r in 0..PUNICA_MAX_RANK {
                let want = k < n && r < rank;
                prop_assert_eq!(writer[k * PUNICA_MAX_RANK + r].is_some(), want);
            }
        }
    }

    /// A whole fused launch on the plan's grid: every y element of a row whose segment (SGMV)
    /// or row (BGMV) has the module's adapter gets exactly one `+=`, from one block; rows without
    /// one (table 0 or rank 0) get none.
    #[test]
    fn the_launch_adds_to_every_adapter_row_and_column_once(
        dt in prop::sample::select(DType::ALL.to_vec()),
        b_aligned in any::<bool>(),
        rows in 1usize..=MAX_ROWS,
        cuts in prop::collection::vec(any::<bool>(), MAX_ROWS),
        adapters in prop::collection::vec(0usize..=MAX_RANK, MAX_ROWS),
        d_out in prop_oneof![1usize..100, 500usize..700, Just(4096), 4000usize..4200],
        sms in prop::sample::select(vec![1usize, 46, 108, 132]),
        bgmv in any::<bool>(),
    ) {
        // Segments: `rows` cut where `cuts` says; segment s's (or, BGMV, row s's) rank
        // adapters[s], 0 = no adapter for this module.
        let mut segs = vec![(0usize, 1usize)];
        for (r, &cut) in cuts.iter().enumerate().take(rows).skip(1) {
            if cut || bgmv {
                segs.push((r, r + 1));
            } else {
                segs.last_mut().unwrap().1 = r + 1;
            }
        }
        let max_rank = adapters[..segs.len()].iter().copied().max().unwrap();
        let max_seg_rows = segs.iter().map(|s| s.1 - s.0).max().unwrap();
        let units = if bgmv { rows } else { segs.len() * max_seg_rows.div_ceil(ROWS) };
        // d_in 1024 keeps every rank ≤ MAX_RANK within the block budget, in every dtype.
        let call = SmallCall { rows, max_rank, d_in: 1024, d_out, dtype: dt, sms, units };
        let Some(grid) = plan(&call) else {
            // Declined only without any adapter (rank 0): punica_lora returns before.
            prop_assert_eq!(max_rank, 0);
            return Ok(());
        };
        let mut y = vec![0u8; rows * d_out];
        let z_chunks = if bgmv { 1 } else { max_seg_rows.div_ceil(ROWS) };
        for (s, &(s_start, s_end)) in segs.iter().enumerate() {
            let rank = adapters[s];
            prop_assert!(rank <= max_rank);
            if rank == 0 {
                continue; // the kernel's `!ls || ls->rank == 0` return
            }
            for by in 0..grid.tiles {
                let c0 = by * grid.cols;
                if c0 >= d_out {
                    continue;
                }
                for z in 0..z_chunks {
                    let start = s_start + z * ROWS;
                    if start >= s_end {
                        continue;
                    }
                    let n = (s_end - start).min(ROWS);
                    expand_block(dt, b_aligned, rank, (start, n), (c0, grid.cols, d_out), &mut y);
                }
            }
        }
        for (s, &(s_start, s_end)) in segs.iter().enumerate() {
            let want = u8::from(adapters[s] > 0);
            for r in s_start..s_end {
                prop_assert!(y[r * d_out..][..d_out].iter().all(|&c| c == want), "row {}", r);
            }
        }
    }
}
