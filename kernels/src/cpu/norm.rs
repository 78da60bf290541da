//! RMSNorm (Llama's `LlamaRMSNorm`).

/// `out[r,:] = x[r,:] / sqrt(mean(x[r,:]²) + eps) * weight` for each row `r`; `x` and `out` are
/// `[rows, weight.len()]`. The sum of squares is accumulated in f64 so the reference is at least
/// as accurate as HF's f32 `pow(2).mean()`; the scaling itself is f32 like HF.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0, "rms_norm: empty weight");
    assert_eq!(
        x.len() % d,
        0,
        "rms_norm: x has {} elements, not rows × {d}",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len(),
        "rms_norm: out has {} elements, x has {}",
        out.len(),
        x.len()
    );
    let mut ss = [0.0f64; LANE_ROWS];
    for (xs, os) in x.chunks(LANE_ROWS * d).zip(out.chunks_mut(LANE_ROWS * d)) {
        let rows = xs.len() / d;
        sums_of_squares(xs, d, &mut ss[..rows]);
        for ((xr, or), &ss) in xs.chunks_exact(d).zip(os.chunks_exact_mut(d)).zip(&ss) {
            let inv = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
                *o = v * inv * g;
            }
        }
    }
}

/// Rows whose sums of squares [`sums_of_squares`] runs side by side.
const LANE_ROWS: usize = 8;

/// `ss[r] = Σ_j x[r·d + j]²` in f64 for the `ss.len() ≤ LANE_ROWS` rows of `x`, each summed
/// in column order from `+0` (one rounding per add, the squares exact): the sequential sum
/// every row's norm is defined by. One row's sum is a chain of `d` dependent adds; with AVX2
/// eight rows run in the lanes of two f64 vectors, each lane its own row's chain, the same
/// adds in the same order (bit for bit the scalar loop, which other CPUs and short groups
/// run), so the chains overlap instead of waiting on each other.
fn sums_of_squares(x: &[f32], d: usize, ss: &mut [f64]) {
    debug_assert!(ss.len() <= LANE_ROWS && x.len() == ss.len() * d);
    #[cfg(target_arch = "x86_64")]
    if ss.len() == LANE_ROWS && crate::cpu::simd::simd_level() == crate::cpu::SimdLevel::Avx2 {
        // SAFETY: the level is `Avx2` only where the CPU has AVX2; `x` holds 8 rows of `d`.
        unsafe { sums_of_squares_avx2(x, d, ss) };
        return;
    }
    for (s, xr) in ss.iter_mut().zip(x.chunks_exact(d)) {
        *s = xr.iter().fold(0.0f64, |a, &v| a + (v as f64) * (v as f64));
    }
}

/// [`sums_of_squares`] for 8 rows: 8 × 8 blocks transposed so column `j` of the 8 rows fills
/// two f64 vectors (rows 0–3, 4–7), squared (exact) and added to the rows' sums; the last
/// `d mod 8` columns continue each row's sum in scalar code, in order.
///
/// # Safety
/// AVX2 available; `x` holds 8 rows of `d` values, `ss` 8 sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sums_of_squares_avx2(x: &[f32], d: usize, ss: &mut [f64]) {
    use std::arch::x86_64::*;
    assert!(x.len() >= 8 * d && ss.len() >= 8);
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let d8 = d - d % 8;
    let p = x.as_ptr();
    let mut j = 0;
    while j < d8 {
        // SAFETY: columns `j..j + 8 ≤ d` of rows `0..8`, inside `x` (asserted).
        let r: [__m256; 8] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(p.add(i * d + j)) });
        // `c[k]` = column `j + k` of rows 0..8.
        let c = crate::cpu::simd::transpose8(r);
        for ck in c {
            let a = _mm256_cvtps_pd(_mm256_castps256_ps128(ck));
            let b = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(ck));
            lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
            hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
        }
        j += 8;
    }
    // SAFETY: `ss` holds 8 sums (asserted).
    unsafe {
        _mm256_storeu_pd(ss.as_mut_ptr(), lo);
        _mm256_storeu_pd(ss.as_mut_ptr().add(4), hi);
    }
    for (s, xr) in ss.iter_mut().zip(x.chunks_exact(d)) {
        *s = xr[d8..]
            .iter()
            .fold(*s, |a, &v| a + (v as f64) * (v as f64));
    }
}

/// Residual add fused with RMSNorm (the CPU twin of CUDA's `add_rms_norm_*`, issue 29):
/// `residual += x`, then `out = rms_norm(residual) * weight`, row by row in one pass over each
/// row. Bit for bit [`crate::cpu::add_in_place`] then [`rms_norm`].
pub fn add_rms_norm(residual: &mut [f32], x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0, "add_rms_norm: empty weight");
    assert!(
        residual.len() == x.len() && out.len() == x.len() && x.len().is_multiple_of(d),
        "add_rms_norm: residual {}, x {}, out {} elements; all must be the same rows × {d}",
        residual.len(),
        x.len(),
        out.len()
    );
    for ((hr, xr), or) in residual
        .chunks_exact_mut(d)
        .zip(x.chunks_exact(d))
        .zip(out.chunks_exact_mut(d))
    {
        let mut ss = 0.0f64;
        for (h, &v) in hr.iter_mut().zip(xr) {
            *h += v;
            ss += (*h as f64) * (*h as f64);
        }
        let inv = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(hr.iter()).zip(weight) {
            *o = v * inv * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The fused op is exactly the two it replaces: the residual and the normed output
        /// match `add_in_place` then `rms_norm` bit for bit, for any shape and values.
        #[test]
        fn add_rms_norm_is_add_then_rms_norm(rows in 1usize..5, d in 1usize..300, seed in 0u64..500) {
            let mut r = crate::cpu::testutil::rng(seed);
            let h0 = crate::cpu::testutil::rand_vec(&mut r, rows * d, 4.0);
            let x = crate::cpu::testutil::rand_vec(&mut r, rows * d, 4.0);
            let w = crate::cpu::testutil::rand_vec(&mut r, d, 2.0);
            let (mut h1, mut out1) = (h0.clone(), vec![0.0; rows * d]);
            add_rms_norm(&mut h1, &x, &w, 1e-6, &mut out1);
            let (mut h2, mut out2) = (h0, vec![0.0; rows * d]);
            crate::cpu::add_in_place(&mut h2, &x);
            rms_norm(&h2, &w, 1e-6, &mut out2);
            prop_assert_eq!(h1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), h2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            prop_assert_eq!(out1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), out2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }
    use crate::cpu::testutil::{assert_close, rand_vec, rng};

    proptest! {
        /// The row-lane sums (8 rows at a time with AVX2) are the scalar sequential sums bit
        /// for bit, for any width (a `d mod 8` tail included), row count (groups of fewer
        /// than 8 rows) and values (wide magnitudes, zeros).
        #[test]
        fn rms_norm_is_the_sequential_sum(rows in 1usize..20, d in 1usize..200, seed in 0u64..500,
                                          zeros in any::<bool>()) {
            let mut r = rng(seed);
            let mut x = rand_vec(&mut r, rows * d, 4.0);
            for (i, v) in x.iter_mut().enumerate() {
                *v *= [1e-30, 1.0, 1e30][i % 3];
                if zeros && i % 5 == 0 {
                    *v = 0.0;
                }
            }
            let w = rand_vec(&mut r, d, 2.0);
            let mut got = vec![0.0; rows * d];
            rms_norm(&x, &w, 1e-6, &mut got);
            let mut want = vec![0.0f32; rows * d];
            for (xr, or) in x.chunks_exact(d).zip(want.chunks_exact_mut(d)) {
                let ss: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
                let inv = (1.0 / (ss / d as f64 + 1e-6f32 as f64).sqrt()) as f32;
                for ((o, &v), &g) in or.iter_mut().zip(xr).zip(&w) {
                    *o = v * inv * g;
                }
            }
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn matches_f64_reference() {
        let mut r = rng(10);
        for (rows, d) in [(1, 1), (3, 64), (5, 4096), (2, 37)] {
            let x = rand_vec(&mut r, rows * d, 3.0);
            let w = rand_vec(&mut r, d, 2.0);
            let eps = 1e-5f32;
            let mut out = vec![0.0; rows * d];
            rms_norm(&x, &w, eps, &mut out);
            let mut want = vec![0.0f64; rows * d];
            for i in 0..rows {
                let row = &x[i * d..(i + 1) * d];
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
                for j in 0..d {
                    want[i * d + j] = row[j] as f64 / (ms + eps as f64).sqrt() * w[j] as f64;
                }
            }
            // Per element: two f32 roundings (inv, products) ≈ 2·6e-8 relative; 1e-6 is loose
            // enough for that and tight enough to catch a wrong mean (e.g. dividing by d-1).
            assert_close("rms_norm", &out, &want, 1e-6);
        }
    }
}
