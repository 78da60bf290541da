//! Elementwise activations, softmax and the residual add.
use super::expf::expf;

/// `out = silu(gate) * up` elementwise, with `silu(g) = g / (1 + e^(-g))`. All three slices have
/// the same length (`[rows, intermediate]`).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "swiglu: gate has {}, up has {}",
        gate.len(),
        up.len()
    );
    assert_eq!(
        gate.len(),
        out.len(),
        "swiglu: gate has {}, out has {}",
        gate.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::expf::vector_enabled() {
        // SAFETY: `vector_enabled` found AVX-512F; the asserts made the lengths equal.
        return unsafe { super::expf::x86::swiglu(gate, up, out) };
    }
    swiglu_scalar(gate, up, out);
}

/// [`swiglu`] one element at a time (the oracle of the 16-lane version, and its tail).
pub(super) fn swiglu_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + expf(-g)) * u;
    }
}

/// [`swiglu`] that also writes its output in a 16-bit `format` (round to nearest even): the
/// CPU twin of CUDA's `swiglu_x16_*` (issue 29), whose 16-bit copy is the down projection's
/// GEMM input. `out16` holds the bit patterns.
pub fn swiglu_x16(
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
    out16: &mut [u16],
    format: crate::cpu::FloatFormat,
) {
    swiglu(gate, up, out);
    assert_eq!(out16.len(), out.len(), "swiglu_x16: out16 length");
    for (o, &v) in out16.iter_mut().zip(out.iter()) {
        *o = match format {
            crate::cpu::FloatFormat::BF16 => half::bf16::from_f32(v).to_bits(),
            crate::cpu::FloatFormat::F16 => half::f16::from_f32(v).to_bits(),
            crate::cpu::FloatFormat::F32 => panic!("swiglu_x16: f32 has no 16-bit copy"),
        };
    }
}

/// Numerically stable softmax of `x` (any length) in place: subtracts the max before `exp`,
/// sums in f64. Entries equal to `-inf` get probability 0; an all-`-inf` input gives NaNs.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Log-softmax of `x` in place: `x - max - ln(Σ exp(x - max))`, summed in f64.
pub fn log_softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let shift = max as f64 + sum.ln();
    for v in x.iter_mut() {
        *v = (*v as f64 - shift) as f32;
    }
}

/// `y += x` elementwise; equal lengths.
pub fn add_in_place(y: &mut [f32], x: &[f32]) {
    assert_eq!(
        y.len(),
        x.len(),
        "add_in_place: y has {}, x has {}",
        y.len(),
        x.len()
    );
    for (a, b) in y.iter_mut().zip(x) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, rand_vec, rng};

    /// The 16-bit copy is the f32 output rounded once: within half a unit in the last place
    /// (2⁻⁸ relative for bf16, 2⁻¹¹ for f16 in the normal range), and the f32 output is
    /// `swiglu`'s exactly.
    #[test]
    fn swiglu_x16_rounds_swiglu_once() {
        let mut r = rng(21);
        let (g, u) = (rand_vec(&mut r, 999, 6.0), rand_vec(&mut r, 999, 3.0));
        let mut want = vec![0.0; 999];
        swiglu(&g, &u, &mut want);
        for (format, tol) in [
            (crate::cpu::FloatFormat::BF16, 1.0 / 256.0),
            (crate::cpu::FloatFormat::F16, 1.0 / 2048.0),
        ] {
            let (mut out, mut out16) = (vec![0.0; 999], vec![0u16; 999]);
            swiglu_x16(&g, &u, &mut out, &mut out16, format);
            assert_eq!(out, want);
            let bytes: Vec<u8> = out16.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut back = vec![0.0; 999];
            crate::cpu::bytes_to_f32(format, &bytes, &mut back).unwrap();
            for (b, w) in back.iter().zip(&want) {
                if w.abs() > 1e-3 {
                    assert!(((b - w) / w).abs() <= tol, "{format:?}: {b} vs {w}");
                }
            }
        }
    }

    #[test]
    fn swiglu_matches_f64() {
        let mut r = rng(20);
        let gate = rand_vec(&mut r, 1000, 12.0);
        let up = rand_vec(&mut r, 1000, 3.0);
        let mut out = vec![0.0; 1000];
        swiglu(&gate, &up, &mut out);
        let want: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64)
            .collect();
        // A few f32 roundings in exp/div/mul: ≤ ~4 ulp ≈ 2.4e-7 relative.
        assert_close("swiglu", &out, &want, 1e-6);
        // Saturation does not produce NaN.
        let mut o = [0.0f32; 2];
        swiglu(&[-200.0, 200.0], &[1.0, 1.0], &mut o);
        assert_eq!(o, [-0.0, 200.0]);
    }

    #[test]
    fn softmax_and_log_softmax_match_f64() {
        let mut r = rng(21);
        for n in [1, 7, 32000] {
            // Logits in [60, 140): an unshifted exp would overflow f32, so this tests the shift.
            let x: Vec<f32> = rand_vec(&mut r, n, 40.0)
                .iter()
                .map(|v| v + 100.0)
                .collect();
            let max = x
                .iter()
                .map(|&v| v as f64)
                .fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
            let want_p: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp() / z).collect();
            let want_l: Vec<f64> = x.iter().map(|&v| v as f64 - max - z.ln()).collect();

            let mut p = x.clone();
            softmax_in_place(&mut p);
            // x - max (|·| ≤ 80) is rounded to f32 before exp: relative error ≲ 80·6e-8 ≈ 5e-6.
            for (g, w) in p.iter().zip(&want_p) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-5 * w + 1e-30,
                    "softmax {g} vs {w}"
                );
            }
            let mut l = x.clone();
            log_softmax_in_place(&mut l);
            assert_close("log_softmax", &l, &want_l, 1e-6);
        }
    }

    #[test]
    fn add_in_place_adds() {
        let mut r = rng(22);
        let x = rand_vec(&mut r, 9, 1.0);
        let y0 = rand_vec(&mut r, 9, 1.0);
        let mut y = y0.clone();
        add_in_place(&mut y, &x);
        for i in 0..9 {
            assert_eq!(y[i], y0[i] + x[i]);
        }
    }
}
