//! The CPU backend's elementwise ops (RMSNorm, SwiGLU, the residual add) split over the
//! compute pool.
//!
//! In a decode step of 16 sequences the products use every compute thread while these ops
//! ran on the engine thread alone and the helpers spun: SmolLM2-135M's 30 layers ask for
//! 737k SwiGLU elements (an `exp` each) and 61 RMSNorms of 16 × 576 a step, and a prompt of
//! 2,048 tokens 128 times as many. Each element (each row, for RMSNorm) is computed by the
//! same kernel call on a contiguous piece, so results do not depend on the split: pieces
//! start on 16-element boundaries, where the kernels' 16-lane loops would have started them
//! anyway. `THAW_PAR_ELEMENTWISE=0` (read once) keeps them on the engine thread, for A/B runs.
use std::sync::OnceLock;

use thaw_kernels::cpu as k;

use super::cpu_par::ComputePool;

/// Fewest elements an elementwise op splits at: a decode batch of 16 rows of SmolLM2's
/// hidden size (9,216) splits, a single sequence's step does not (waking a helper costs
/// about what a few thousand elements of work do).
pub(crate) const MIN_SPLIT_ELEMS: usize = 8 * 1024;

/// Pieces of an elementwise split start on multiples of this many elements.
const ALIGN: usize = 16;

/// Whether elementwise ops split over the pool (unless `THAW_PAR_ELEMENTWISE=0`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !k::switched_off("THAW_PAR_ELEMENTWISE"))
}

/// How many parts an elementwise op over `elems` elements in `units` independent units
/// (rows, or 16-element groups) splits into with `active` threads: one below `min_elems` or
/// when switched off, else one per thread but never more than there are units.
pub(crate) fn parts(
    on: bool,
    elems: usize,
    units: usize,
    active: usize,
    min_elems: usize,
) -> usize {
    if !on || elems < min_elems {
        1
    } else {
        active.clamp(1, units.max(1))
    }
}

fn parts_for(pool: &ComputePool, elems: usize, units: usize) -> usize {
    parts(enabled(), elems, units, pool.active(), MIN_SPLIT_ELEMS)
}

/// [`k::rms_norm`] of `rows` rows of `w.len()` elements, split by rows.
pub(super) fn rms_norm(
    pool: &ComputePool,
    x: &[f32],
    w: &[f32],
    eps: f32,
    rows: usize,
    out: &mut [f32],
) {
    let d = w.len();
    let n = rows * d;
    let parts = parts_for(pool, n, rows);
    pool.split_mut(rows, 1, parts, &mut out[..n], d, |r, chunk| {
        k::rms_norm(&x[r.start * d..r.end * d], w, eps, chunk)
    });
}

/// [`k::swiglu`] over the first `len` elements, split into 16-aligned pieces.
pub(super) fn swiglu(pool: &ComputePool, gate: &[f32], up: &[f32], len: usize, out: &mut [f32]) {
    let parts = parts_for(pool, len, len.div_ceil(ALIGN));
    pool.split_mut(len, ALIGN, parts, &mut out[..len], 1, |r, chunk| {
        k::swiglu(&gate[r.clone()], &up[r], chunk)
    });
}

/// [`k::add_in_place`] over the first `len` elements, split into 16-aligned pieces.
pub(super) fn add(pool: &ComputePool, y: &mut [f32], x: &[f32], len: usize) {
    let parts = parts_for(pool, len, len.div_ceil(ALIGN));
    pool.split_mut(len, ALIGN, parts, &mut y[..len], 1, |r, chunk| {
        k::add_in_place(chunk, &x[r])
    });
}

/// [`k::RopeCache::apply`] over the `positions.len()` tokens of `x` (`n_heads` heads of
/// `head_dim` each), split by tokens: each token is rotated by its own position alone.
pub(super) fn rope(
    pool: &ComputePool,
    cache: &mut k::RopeCache,
    x: &mut [f32],
    positions: &[usize],
    (n_heads, head_dim): (usize, usize),
) {
    let width = n_heads * head_dim;
    let tokens = positions.len();
    cache.prepare(positions);
    let cache = &*cache;
    let parts = parts_for(pool, tokens * width, tokens);
    pool.split_mut(
        tokens,
        1,
        parts,
        &mut x[..tokens * width],
        width,
        |r, chunk| cache.apply_prepared(chunk, &positions[r], n_heads),
    );
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::backend::cpu_par::CpuThreads;

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Never more parts than threads or units, at least one, and one below the threshold
        /// or when switched off.
        #[test]
        fn parts_stay_in_bounds(on in any::<bool>(), elems in 0usize..100_000,
                                units in 0usize..5000, active in 1usize..33, min in 0usize..20_000) {
            let p = parts(on, elems, units, active, min);
            prop_assert!(p >= 1 && p <= active && p <= units.max(1));
            if !on || elems < min {
                prop_assert_eq!(p, 1);
            }
            if on && elems >= min && units >= active {
                prop_assert_eq!(p, active);
            }
        }

        /// Split over 2 or 3 threads, every op gives the one-thread kernel's bits, for any
        /// row count and width (pieces that end mid-row or off the 16-lane grid included),
        /// below the threshold (not split) and above it.
        #[test]
        fn split_ops_equal_the_serial_kernels(rows in 1usize..40, width in 1usize..200,
                                              threads in 2usize..4, seed in any::<u32>()) {
            let pool = ComputePool::new(CpuThreads::unpinned(threads)).unwrap();
            let mut rnd = crate::backend::test_values(seed);
            let w = rnd(width);
            let reps = MIN_SPLIT_ELEMS.div_ceil(rows * width);
            for rows in [rows, rows * reps] {
                let n = rows * width;
                // Gates over [-20, 20): SiLU's exp sees both tails.
                let a: Vec<f32> = rnd(n).iter().map(|v| v * 40.0).collect();
                let b = rnd(n);
                let mut want = vec![f32::NAN; n];
                k::swiglu(&a, &b, &mut want);
                let mut got = vec![f32::NAN; n];
                swiglu(&pool, &a, &b, n, &mut got);
                prop_assert!(same(&got, &want), "swiglu, {} elements", n);
                let (mut want, mut got) = (a.clone(), a.clone());
                k::add_in_place(&mut want, &b);
                add(&pool, &mut got, &b, n);
                prop_assert!(same(&got, &want), "add, {} elements", n);
                let mut want = vec![f32::NAN; n];
                k::rms_norm(&a, &w, 1e-5, &mut want);
                let mut got = vec![f32::NAN; n];
                rms_norm(&pool, &a, &w, 1e-5, rows, &mut got);
                prop_assert!(same(&got, &want), "rms_norm, {} rows of {}", rows, width);
                // Tokens of `heads` heads of 2·⌈width/4⌉ (even) at scattered positions.
                let (heads, hd) = (1 + width % 3, 2 * width.div_ceil(4));
                let positions: Vec<usize> = (0..rows).map(|i| (i * 37 + width) % 500).collect();
                let table = k::RopeTable::new(hd, 10_000.0, &k::RopeScaling::None);
                let x = rnd(rows * heads * hd);
                let mut want = x.clone();
                table.apply(&mut want, &positions, heads);
                let mut got = x;
                let mut cache = k::RopeCache::new(table);
                rope(&pool, &mut cache, &mut got, &positions, (heads, hd));
                prop_assert!(same(&got, &want), "rope, {} tokens of {}×{}", rows, heads, hd);
            }
        }
    }
}
