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
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * g;
        }
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
