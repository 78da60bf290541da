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

#[cfg(test)]
mod tests {
    use super::*;
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
