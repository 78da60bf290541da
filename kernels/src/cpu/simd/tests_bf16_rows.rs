//! [`gemm_nt_bf16_rows`] (decode rows over bf16 weights with `vdpbf16ps`) against the scalar
//! path: the activations rounded to bf16 by `half` (the portable rounding) times the stored
//! weights, summed in f64; and each row alone against its batch, bit for bit.
//!
//! Tolerance: every product of two bf16 values is exact in f32, so only the f32 roundings of
//! the partial sums remain (`k/32` steps per lane, then a 16-lane tree): far below
//! `1e-5·Σ|x̂·w|` for `k ≤ 4096`, while a wrong pair, row or lane errs by a whole product or
//! more. Against the portable f32-activation dot ([`portable::dot_bf16`]) the rounding of the
//! activations adds at most `2⁻⁸·Σ|x·w|` (bf16 keeps 8 significant bits: rounding to nearest
//! moves a value by at most half its last place, `2⁻⁸` of it).
//! Where the CPU lacks AVX512-BF16 the kernel declines (returns false) and the tests say so.
use half::bf16;
use proptest::prelude::*;

use super::*;
use crate::cpu::testutil::{rand_vec, rng};

/// Runs the kernel over `[m, k]` × `[n, k]` at a stride wider than `n` and checks every
/// output (see the module note); false where the kernel does not run here.
fn check(m: usize, k: usize, n: usize, seed: u64) -> bool {
    let x = rand_vec(&mut rng(seed ^ 0xd0d0), m * k, 2.0);
    let w: Vec<bf16> = rand_vec(&mut rng(seed), n * k, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let ldo = n + 3;
    let mut got = vec![f32::NAN; m * ldo];
    if !gemm_nt_bf16_rows(&x, &w, (m, k, n), &mut got, ldo) {
        assert!(
            k % 2 == 1 || !bf16_dot_active(),
            "declined an even k with AVX512-BF16 on"
        );
        eprintln!("no AVX512-BF16 here (or odd k {k}): gemm_nt_bf16_rows is not checked");
        return false;
    }
    for i in 0..m {
        let xi = &x[i * k..(i + 1) * k];
        let mut alone = vec![f32::NAN; n];
        assert!(gemm_nt_bf16_rows(xi, &w, (1, k, n), &mut alone, n));
        for j in 0..n {
            let wj = &w[j * k..(j + 1) * k];
            let (mut want, mut mag, mut mag_x) = (0.0f64, 0.0f64, 0.0f64);
            for (&xv, &wv) in xi.iter().zip(wj) {
                let t = bf16::from_f32(xv).to_f64() * wv.to_f64();
                want += t;
                mag += t.abs();
                mag_x += (xv as f64 * wv.to_f64()).abs();
            }
            let g = got[i * ldo + j];
            assert!(
                (g as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                "{m}x{k}x{n} at ({i}, {j}): {g} vs {want}"
            );
            let port = portable::dot_bf16(xi, wj) as f64;
            assert!(
                (g as f64 - port).abs() <= 2f64.powi(-8) * mag_x + 1e-5 * mag + 1e-30,
                "{m}x{k}x{n} at ({i}, {j}): {g} vs the portable f32 dot {port}"
            );
            assert_eq!(
                g.to_bits(),
                alone[j].to_bits(),
                "row {i} depends on its batch ({m}x{k}x{n})"
            );
        }
        assert!(
            got[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
            "padding written"
        );
    }
    true
}

#[test]
fn bf16_rows_at_model_shapes() {
    check(16, 576, 21, 1); // a decode batch × q rows: 288 pairs, 18 full steps
    check(1, 1536, 9, 2); // one decode row × down rows
    check(5, 34, 6, 3); // 17 pairs: one full step and a one-pair tail
    check(3, 0, 4, 4); // empty reduction: zeros
}

#[test]
fn bf16_rows_decline_odd_k() {
    let (x, w) = (vec![1.0f32; 3], vec![bf16::ONE; 6]);
    let mut out = vec![0.0f32; 2];
    assert!(!gemm_nt_bf16_rows(&x, &w, (1, 3, 2), &mut out, 2));
}

#[test]
fn bf16_rows_run_where_the_cpu_has_avx512_bf16() {
    // Detection, not numerics: a CPU with AVX512-BF16 at the AVX2 level must take the kernel.
    assert_eq!(check(2, 64, 3, 9), bf16_dot_active());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn bf16_rows_any_shape(m in 1usize..17, kp in 0usize..100, n in 1usize..14, seed in any::<u64>()) {
        check(m, 2 * kp, n, seed);
    }
}
