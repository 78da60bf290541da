//! The adapter deltas of a prompt step split over the compute pool by rows.
//!
//! A step of 16 prompts of 128 tokens runs each module's deltas over 2,048 rows; on the engine
//! thread alone (as before) the helpers spun through it: on SmolLM2-135M with three adapters
//! of rank 8/16/64 the shrink and expand are about 4.5 % of a one-thread prompt step, so
//! about 9 % of a two-thread one. Each adapter's run of rows is cut into pieces of at least
//! [`MIN_PIECE_ROWS`] rows, the pieces (in row order) are grouped into one contiguous range of
//! rows per thread by their multiply-adds, and each thread runs the same kernel call on its
//! pieces with its own scratch.
//!
//! **Bits.** `lora_delta` computes each row's delta from that row alone (one accumulator per
//! row and rank in the shrink, per row and output in the expand, in a fixed order), on the
//! same path for any row count above [`BCAST_ROWS`] (below it, f32 `B` takes a broadcast
//! expand): pieces never go below it unless the whole run does, so every output equals the
//! one-call result bit for bit (tested below against the serial calls).
use std::ops::Range;

use thaw_cpu_lora::kernel::{lora_delta, LoraProblem, Scratch};

use super::cpu_par::{balance, ComputePool};
use super::LinearDims;
use crate::adapter::LoraWeights;

/// Rows at and below which `lora_delta` may take its few-rows expand (the kernel crate's
/// `BCAST_LANES`): no piece of a longer run is cut this short.
const BCAST_ROWS: usize = 16;

/// Fewest rows in a piece of a run: above [`BCAST_ROWS`], and enough rows that each piece's
/// own pass over `A` and `B` (widened and packed per call) stays a small share of its work.
pub(super) const MIN_PIECE_ROWS: usize = 32;
const _: () = assert!(MIN_PIECE_ROWS > BCAST_ROWS);

/// Pieces per thread a run is cut into at most, so the grouping can even out the ranks.
const PIECES_PER_PART: usize = 4;

/// One adapter's run of rows: rows `rows` of the step get the delta of the adapter with this
/// index in the batch.
pub(super) type Job = (Range<usize>, u32);

/// `y[rows] += scale · x[rows] · Aᵀ · Bᵀ` for one adapter's factors (`rows` absolute in `x`,
/// relative to `y_row0` in `y`), read in their stored dtype, accumulated in f32.
pub(super) fn add_delta(
    s: &mut Scratch,
    x: &[f32],
    (y, y_row0): (&mut [f32], usize),
    dims: LinearDims,
    rows: Range<usize>,
    w: &LoraWeights,
) {
    let p = LoraProblem {
        rows: rows.len(),
        d_in: dims.d_in,
        d_out: dims.d_out,
        rank: w.rank,
        scale: w.scale,
    };
    let (o0, o1) = (rows.start - y_row0, rows.end - y_row0);
    lora_delta(
        &p,
        &x[rows.start * dims.d_in..rows.end * dims.d_in],
        w.a.mat(),
        w.b.mat(),
        &mut y[o0 * dims.d_out..o1 * dims.d_out],
        true,
        s,
    )
    .expect("LoRA shapes were validated when the adapter was loaded");
}

/// Cuts each job (in row order, disjoint) into pieces of at least [`MIN_PIECE_ROWS`] rows
/// (a job shorter than two pieces stays whole), about `PIECES_PER_PART · parts` pieces over
/// the step, appended to `out` in row order.
pub(super) fn pieces(jobs: &[Job], parts: usize, out: &mut Vec<Job>) {
    out.clear();
    let total: usize = jobs.iter().map(|(r, _)| r.len()).sum();
    let want = (total / (PIECES_PER_PART * parts.max(1))).max(MIN_PIECE_ROWS);
    for (r, w) in jobs {
        let n = (r.len() / want).clamp(1, (r.len() / MIN_PIECE_ROWS).max(1));
        for p in 0..n {
            let (a, b) = (r.len() * p / n, r.len() * (p + 1) / n);
            out.push((r.start + a..r.start + b, *w));
        }
    }
}

/// Multiply-adds of one piece of rank `rank`: its shrink and expand.
fn cost(rows: &Range<usize>, rank: usize, dims: LinearDims) -> u64 {
    (rows.len() * rank * (dims.d_in + dims.d_out)) as u64
}

/// Reused buffers of [`apply`]: the jobs (the caller fills them), their pieces, the pieces'
/// grouping and the groups' first outputs.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub jobs: Vec<Job>,
    pieces: Vec<Job>,
    bounds: Vec<usize>,
    out_bounds: Vec<usize>,
}

/// Adds the delta of every job in `plan.jobs` (adapter `i`'s factors: `get(i)`) to `y`
/// (`[rows, d_out]`, rows absolute as in `x`): on the calling thread when the work is too
/// small to split or there is one piece, else over the pool, one contiguous range of pieces
/// per thread, each with its own scratch from `scratch` (one per thread the pool may use).
pub(super) fn apply<'w>(
    pool: &ComputePool,
    scratch: &mut [Scratch],
    plan: &mut Plan,
    (x, y): (&[f32], &mut [f32]),
    dims: LinearDims,
    get: impl Fn(u32) -> &'w LoraWeights + Sync,
) {
    let work: u64 = plan
        .jobs
        .iter()
        .map(|(r, i)| cost(r, get(*i).rank, dims))
        .sum();
    let parts = pool.parts(work as usize).min(scratch.len());
    if parts > 1 {
        pieces(&plan.jobs, parts, &mut plan.pieces);
    }
    if parts <= 1 || plan.pieces.len() <= 1 {
        for (r, i) in &plan.jobs {
            add_delta(&mut scratch[0], x, (&mut *y, 0), dims, r.clone(), get(*i));
        }
        return;
    }
    let ps = &plan.pieces[..];
    let costs = ps.iter().map(|(r, i)| cost(r, get(*i).rank, dims));
    balance(costs, parts, &mut plan.bounds);
    let groups = plan.bounds.len() - 1;
    // Group g owns the rows from its first piece's start to the next group's (rows between
    // pieces carry no delta); the first from row 0, the last to the end of `y`.
    plan.out_bounds.clear();
    plan.out_bounds.extend((0..=groups).map(|g| match g {
        0 => 0,
        _ if g == groups => y.len(),
        _ => ps[plan.bounds[g]].0.start * dims.d_out,
    }));
    let (bounds, out_bounds) = (&plan.bounds, &plan.out_bounds);
    pool.groups_mut(y, out_bounds, scratch, |g, chunk, s| {
        let row0 = out_bounds[g] / dims.d_out.max(1);
        for (r, i) in &ps[bounds[g]..bounds[g + 1]] {
            add_delta(s, x, (&mut *chunk, row0), dims, r.clone(), get(*i));
        }
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::adapter::{LoraTensor, WeightDtype};
    use crate::backend::cpu_par::CpuThreads;

    fn weights(rank: usize, dims: LinearDims, seed: u32, dtype: WeightDtype) -> LoraWeights {
        let mut rnd = crate::backend::test_values(seed);
        LoraWeights {
            rank,
            scale: 0.5,
            a: LoraTensor::encode(&rnd(rank * dims.d_in), dtype),
            b: LoraTensor::encode(&rnd(dims.d_out * rank), dtype),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Pieces tile each job in order, none shorter than `MIN_PIECE_ROWS` unless its job is.
        #[test]
        fn pieces_tile_the_jobs(lens in proptest::collection::vec(0usize..400, 1..6),
                                parts in 1usize..5) {
            let mut at = 0;
            let jobs: Vec<Job> = lens.iter().map(|&l| {
                let r = at..at + l;
                at += l + 3;
                (r, 0)
            }).collect();
            let mut out = Vec::new();
            pieces(&jobs, parts, &mut out);
            let mut it = out.iter();
            for (r, _) in &jobs {
                let mut next = r.start;
                while next < r.end || (r.is_empty() && next == r.start) {
                    let (p, _) = it.next().expect("a piece");
                    prop_assert_eq!(p.start, next);
                    prop_assert!(p.len() >= MIN_PIECE_ROWS.min(r.len()));
                    next = p.end;
                    if r.is_empty() { break; }
                }
                prop_assert_eq!(next, r.end);
            }
            prop_assert!(it.next().is_none());
        }

        /// Split over 2 or 3 threads, the deltas equal the serial calls' bit for bit, for runs
        /// long and short (a few rows: the broadcast expand), ranks below and above the runs'
        /// lengths, f32 and bf16 factors, and rows between runs without an adapter.
        #[test]
        fn split_deltas_equal_the_serial_calls(lens in proptest::collection::vec(1usize..150, 1..5),
                                               ranks in proptest::collection::vec(1usize..70, 5),
                                               d_in in 8usize..96, d_out in 8usize..96,
                                               threads in 2usize..4, bf16 in any::<bool>(),
                                               seed in any::<u32>()) {
            let dims = LinearDims { d_in, d_out };
            let dtype = if bf16 { WeightDtype::Bf16 } else { WeightDtype::F32 };
            let ws: Vec<LoraWeights> = ranks.iter().enumerate()
                .map(|(i, &r)| weights(r, dims, seed ^ i as u32, dtype)).collect();
            let mut at = 2;
            let jobs: Vec<Job> = lens.iter().enumerate().map(|(i, &l)| {
                let r = at..at + l;
                at += l + (i % 2);
                (r, i as u32)
            }).collect();
            let rows = at + 1;
            let mut rnd = crate::backend::test_values(seed.wrapping_add(9));
            let x = rnd(rows * d_in);
            let y0 = rnd(rows * d_out);
            let mut want = y0.clone();
            let mut s = Scratch::new();
            for (r, i) in &jobs {
                add_delta(&mut s, &x, (&mut want, 0), dims, r.clone(), &ws[*i as usize]);
            }
            let pool = ComputePool::new(CpuThreads {
                min_part_work: 1,
                ..CpuThreads::unpinned(threads)
            }).unwrap();
            let mut scratch: Vec<Scratch> = (0..threads).map(|_| Scratch::new()).collect();
            let mut plan = Plan { jobs, ..Plan::default() };
            let mut got = y0.clone();
            apply(&pool, &mut scratch, &mut plan, (&x, &mut got), dims, |i| &ws[i as usize]);
            prop_assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
