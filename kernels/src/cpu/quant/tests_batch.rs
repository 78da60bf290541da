//! Batched products over every stored format: a decode row's result does not depend on its
//! batch, and every product equals the one over the weight widened to f32.
use proptest::prelude::*;

use super::tests::{q8_1_sum_terms, q8_rows, random_matrix};
use super::*;
use crate::cpu::simd::{
    bf16_dot_active, gemm_nt_available, q8_dot_supported, vnni_dot_active, vnni_prompt_active,
};
use crate::cpu::testutil::{assert_close, rand_vec, rng};

/// Each row of a decode batch (`m ≤ 16` rows) equals the one-row product bit for bit, for
/// every format: the batched kernels (a tile of dequantised rows shared by the batch, 16-bit
/// weights widened once per register tile) sum each row as the single-row kernels do.
fn decode_rows_are_batch_invariant(fi: usize, m: usize, seed: u64) {
    let f = WeightFormat::ALL[fi];
    let (n, k) = (20, 512);
    let w = random_matrix(f, n, k, seed);
    let x = rand_vec(&mut rng(seed + 1), m * k, 1.0);
    let mut batch = vec![f32::NAN; m * n];
    w.matmul(&x, m, &mut batch);
    for i in 0..m {
        let mut one = vec![f32::NAN; n];
        w.matmul(&x[i * k..(i + 1) * k], 1, &mut one);
        for j in 0..n {
            assert_eq!(
                batch[i * n + j].to_bits(),
                one[j].to_bits(),
                "{f} m={m} row {i} col {j}: {} vs {}",
                batch[i * n + j],
                one[j]
            );
        }
    }
}

/// The product over a stored format equals the product over its f32 widening: bit for bit
/// where the in-place and packed AVX-512 kernels run (both sides take the same kernel for
/// the same `m`), else within the f32 accumulation tolerance of `quant::tests` (1e-5 of
/// |y| + RMS(y)); Q8_0/Q4_K on AVX512-VNNI against the widened product of the Q8-rounded
/// activations, within that tolerance.
fn equals_widened(fi: usize, m: usize, seed: u64) {
    let f = WeightFormat::ALL[fi];
    let (n, k) = (37, 256);
    let w = random_matrix(f, n, k, seed);
    let wide = WeightMatrix::from_f32(w.to_f32(), n, k);
    let x = rand_vec(&mut rng(seed + 2), m * k, 1.0);
    let (mut got, mut want) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
    w.matmul(&x, m, &mut got);
    if vnni_dot_active(f)
        || (m > 16 && vnni_prompt_active(f))
        || (m <= 16 && q8_activations() && q8_dot_supported(f))
    {
        // Q8_0/Q4_K/Q4_1 on AVX512-VNNI (and decode rows over Q8_0/Q4_0/Q4_1 where Q8
        // activations are on) multiply Q8-quantised activations (integer dots, exact): the
        // widened product of those (plus Q4_1's f16-rounded block sums), within the tolerance.
        wide.matmul(&q8_rows(f, &x, k), m, &mut want);
        let terms = q8_1_sum_terms(&w, &x, m, 0..n);
        let want: Vec<f64> = want.iter().zip(terms).map(|(&v, t)| v as f64 + t).collect();
        assert_close(
            &format!("{f} m={m} (VNNI, Q8 activations)"),
            &got,
            &want,
            1e-5,
        );
        return;
    }
    if f == WeightFormat::BF16 && bf16_dot_active() && (m > 16 || k % 2 == 0) {
        // Rows over bf16 weights multiply bf16-rounded activations (`vdpbf16ps`; decode rows
        // for even `k`): the widened product of those, within the tolerance.
        let xr: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        wide.matmul(&xr, m, &mut want);
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close(&format!("{f} m={m} (bf16 pairs)"), &got, &want, 1e-5);
        return;
    }
    wide.matmul(&x, m, &mut want);
    if gemm_nt_available() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{f} m={m}");
    } else {
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close(&format!("{f} m={m}"), &got, &want, 1e-5);
    }
}

#[test]
fn batched_formats_at_decode_and_prompt_sizes() {
    for fi in 0..WeightFormat::ALL.len() {
        for m in [1, 4, 16] {
            decode_rows_are_batch_invariant(fi, m, 3);
        }
        for m in [1, 5, 16, 17, 40] {
            equals_widened(fi, m, 4);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn decode_batches_any_format(fi in 0usize..8, m in 1usize..=16, seed in 0u64..1000) {
        decode_rows_are_batch_invariant(fi, m, seed);
    }

    #[test]
    fn products_equal_widened_any_format(fi in 0usize..8, m in 1usize..40, seed in 0u64..1000) {
        equals_widened(fi, m, seed);
    }
}

/// Prompt rows over weights dequantised a tile at a time (Q4_0 always; Q4_1 where it is not
/// on the VNNI prompt path) equal the product over the widened weight, bit for bit where the
/// packed AVX-512 kernel runs, whatever the weight's row count: tiles are cut in whole
/// prompt-GEMM panels ([`crate::cpu::simd::PROMPT_PANEL_ROWS`]), and a panel cut short
/// (`n` not a multiple of 48, or below one tile) must still give every output its own
/// row's sum. `k = 256` makes a tile of 240 weight rows, so `n = 300` spans two.
#[test]
fn prompt_tiles_equal_widened_at_any_row_count() {
    for f in [WeightFormat::Q4_0, WeightFormat::Q4_1] {
        if vnni_prompt_active(f) {
            continue; // Q8 activations: `equals_widened` checks it within its tolerance
        }
        for (n, m) in [(47, 17), (48, 40), (49, 17), (241, 40), (300, 33)] {
            let k = 256;
            let w = random_matrix(f, n, k, n as u64);
            let wide = WeightMatrix::from_f32(w.to_f32(), n, k);
            let x = rand_vec(&mut rng(m as u64), m * k, 1.0);
            let (mut got, mut want) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            w.matmul(&x, m, &mut got);
            wide.matmul(&x, m, &mut want);
            if gemm_nt_available() {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{f} n={n} m={m}");
            } else {
                let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                assert_close(&format!("{f} n={n} m={m}"), &got, &want, 1e-5);
            }
        }
    }
}
