//! [`gemm_nt_vnni`]'s kernel (Q8_0, Q4_K and Q4_1 on AVX512-VNNI) against the scalar path: the weights
//! dequantised by the scalar dequantiser (`quant::dequantize_blocks`) times the activations
//! quantised by [`quantize_q8_for`] and dequantised, summed in f64 (for Q4_1 plus its
//! f16-rounded block sums: ggml's Q8_1).
//!
//! Tolerances: the integer dots are exact, so against the quantised activations only f32
//! rounding remains: one product and one fused add per block (two for Q4_K), at most
//! `k/32 + 2` roundings of partial sums bounded by `Σ|w·x̂|`, far below `1e-5·Σ|w·x̂|` for
//! `k ≤ 4096` (a block or indexing bug errs by a block's worth, `O(Σ|w·x̂|·32/k)`, or more).
//! Against the original activations the activation rounding adds at most
//! `Σ_b (d_b / 2)·‖w_b‖₁` (`mod.rs`). Where the CPU lacks AVX512-VNNI the kernel declines
//! (returns false) and the tests say so.
use half::f16;
use proptest::prelude::*;
use rand::Rng;

use super::*;
use crate::cpu::quant::dequantize_blocks;
use crate::cpu::testutil::{rand_vec, rng};

const TOL: f64 = 1e-5;
const FORMATS: [WeightFormat; 3] = [WeightFormat::Q8_0, WeightFormat::Q4_K, WeightFormat::Q4_1];

/// `n` rows of `k` in `f` (Q8_0, Q4_K or Q4_1): random codes, sane f16 scales (and a
/// minimum of either sign).
pub(super) fn weights(f: WeightFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut r = rng(seed);
    let mut b = vec![0u8; f.bytes_for(n * k).unwrap()];
    r.fill(&mut b[..]);
    for blk in b.chunks_exact_mut(f.block_bytes()) {
        let d = f16::from_f32(r.random_range(1e-3..0.05f32));
        blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        if f != WeightFormat::Q8_0 {
            let m = f16::from_f32(r.random_range(-0.02..0.02f32));
            blk[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
        }
    }
    b
}

/// Activations with a zero row block and a tiny one where there is room (scale 0 and a
/// scale near the f32 minimum exercise the quantiser's edges).
pub(super) fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut x = rand_vec(&mut rng(seed), m * k, 3.0);
    if k >= 64 {
        x[..32].fill(0.0);
        x[32..64].iter_mut().for_each(|v| *v *= 1e-6);
    }
    x
}

/// The kernel itself (Q4_1 included, which [`gemm_nt_vnni`] takes only where Q8 activations
/// are on: the default); false where the CPU lacks it or `THAW_VNNI_DOT=0`.
pub(super) fn vnni(
    f: WeightFormat,
    w: &[u8],
    x: &[f32],
    shape: (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    match x86_512_vnni::Avx512Vnni::enabled() {
        Some(z) if gemm_nt_available() => {
            z.gemm_nt(f, w, x, shape, out, ldo);
            true
        }
        _ => false,
    }
}

/// Checks every output of the kernel for `(m, k, n)` (at stride `ldo = n + 3`, the gap
/// untouched) against the scalar path; returns false where the kernel does not run.
fn check(f: WeightFormat, (m, k, n): (usize, usize, usize), seed: u64) -> bool {
    let w = weights(f, n, k, seed);
    let x = activations(m, k, seed ^ 0x5eed);
    check_with(f, &w, &x, (m, k, n))
}

/// [`check`] over given weights `w` (`n` rows of `k` in `f`) and activations `x` (`[m, k]`).
fn check_with(f: WeightFormat, w: &[u8], x: &[f32], (m, k, n): (usize, usize, usize)) -> bool {
    let ldo = n + 3;
    let mut got = vec![f32::NAN; m * ldo];
    if !vnni(f, w, x, (m, k, n), &mut got, ldo) {
        return false;
    }
    let mut wf = vec![0.0f32; n * k];
    dequantize_blocks(f, w, &mut wf).unwrap();
    let kb = k / Q8_BLOCK;
    let mut q = vec![Q8Block::default(); kb];
    for i in 0..m {
        let xi = &x[i * k..(i + 1) * k];
        quantize_q8_for(f, xi, &mut q);
        let xq: Vec<f64> = q
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&v| b.d as f64 * v as f64))
            .collect();
        for j in 0..n {
            let wj = &wf[j * k..(j + 1) * k];
            let (mut want_q, mut mag, mut want_x) = (0.0f64, 0.0f64, 0.0f64);
            for p in 0..k {
                want_q += wj[p] as f64 * xq[p];
                mag += (wj[p] as f64 * xq[p]).abs();
                want_x += wj[p] as f64 * xi[p] as f64;
            }
            // Q4_1 on ggml's Q8_1 blocks: the weight's minimum times the f16-rounded block
            // sum `s`, not `d·Σq`.
            if f == WeightFormat::Q4_1 {
                let bb = f.block_bytes();
                for (c, xb) in q.iter().enumerate() {
                    let o = (j * kb + c) * bb;
                    let min = f16::from_le_bytes([w[o + 2], w[o + 3]]).to_f32() as f64;
                    let sum: i32 = xb.qs.iter().map(|&v| v as i32).sum();
                    want_q += min * (xb.s as f64 - xb.d as f64 * sum as f64);
                }
            }
            // The activation rounding `d/2` per value, plus for Q4_1 the f16 rounding of each
            // block's scale and sum (2⁻¹¹ of each, or half f16's smallest step, 2⁻²⁵, where it
            // underflows): `|x − d̂·q| ≤ d/2 + 127·|d − d̂|` per value and the minimum's term
            // off by `|ŝ − s| + 32·127·|d − d̂|`.
            let bound: f64 = q
                .iter()
                .zip(wj.chunks_exact(Q8_BLOCK))
                .zip(xi.chunks_exact(Q8_BLOCK))
                .enumerate()
                .map(|(c, ((b, wb), xb))| {
                    let l1 = wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                    let d = xb.iter().fold(0.0f64, |a, v| a.max(v.abs() as f64)) / 127.0;
                    if f != WeightFormat::Q4_1 {
                        return b.d as f64 / 2.0 * l1;
                    }
                    let f16_err = |v: f64| (v.abs() * 2f64.powi(-11)).max(2f64.powi(-25));
                    let dd = f16_err(d);
                    let o = (j * kb + c) * f.block_bytes();
                    let min = f16::from_le_bytes([w[o + 2], w[o + 3]]).to_f32().abs() as f64;
                    let s_err = f16_err(d * 32.0 * 127.0) + 32.0 * 127.0 * dd;
                    (d / 2.0 + 127.0 * dd) * l1 + min * s_err
                })
                .sum();
            let g = got[i * ldo + j] as f64;
            let what = format!("{f} (m, k, n) = ({m}, {k}, {n}), output ({i}, {j})");
            assert!(
                (g - want_q).abs() <= TOL * mag + 1e-30,
                "{what}: {g} vs {want_q} with the quantised activations (Σ|w·x̂| = {mag})"
            );
            assert!(
                (g - want_x).abs() <= bound + TOL * mag + 1e-30,
                "{what}: {g} vs {want_x} with the original activations (bound {bound})"
            );
        }
        for j in n..ldo {
            assert!(got[i * ldo + j].is_nan(), "{f}: gap ({i}, {j}) written");
        }
    }
    // Each row alone (read in place, `x86_512_vnni_row`) computes its batch's result (the
    // packed panel) bit for bit.
    for i in [0, m / 2, m - 1] {
        let mut one = vec![f32::NAN; n];
        assert!(vnni(f, w, &x[i * k..(i + 1) * k], (1, k, n), &mut one, n));
        for j in 0..n {
            assert_eq!(
                one[j].to_bits(),
                got[i * ldo + j].to_bits(),
                "{f} ({m}, {k}, {n}): row {i} col {j} alone vs in its batch"
            );
        }
    }
    true
}

#[test]
fn vnni_products_at_model_shapes() {
    // SmolLM2-135M's projections (k = 576 / 1536) with decode and prompt row counts, and a
    // k spanning several driver blocks (Q4_K needs whole 256-value blocks).
    // (3 rows: the in-place kernel row by row, outputs at a stride.)
    let shapes: [(usize, usize, usize); 5] = [
        (1, 576, 64),
        (3, 1536, 37),
        (16, 576, 100),
        (17, 1536, 50),
        (40, 4096, 20),
    ];
    for f in FORMATS {
        for (m, k, n) in shapes {
            if f == WeightFormat::Q4_K && !k.is_multiple_of(256) {
                continue;
            }
            if !check(f, (m, k, n), (m * 31 + n) as u64) {
                let here = is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && gemm_nt_available();
                let off = crate::cpu::switched_off("THAW_VNNI_DOT");
                assert!(
                    !here || off,
                    "the CPU has AVX512-VNNI but gemm_nt_vnni declined"
                );
                eprintln!("no AVX512-VNNI here (or THAW_VNNI_DOT=0): gemm_nt_vnni declined");
                return;
            }
        }
    }
}

/// A row width of about `blocks` 32-value blocks that `f` stores whole (Q4_K: 256-value
/// super-blocks).
fn width(f: WeightFormat, blocks: usize) -> usize {
    if f == WeightFormat::Q4_K {
        256 * blocks.div_ceil(8)
    } else {
        32 * blocks
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// One row (the in-place kernel) against the scalar path and, bit for bit, against the
    /// same row in a batch of 4–7 (the packed panel), for weight row counts leaving 1–8 rows
    /// in the row kernel's last group of eight.
    #[test]
    fn vnni_one_row_any_shape(
        fi in 0usize..3,
        m in 4usize..8,
        blocks in 1usize..40,
        n in 1usize..30,
        seed in any::<u64>(),
    ) {
        let f = FORMATS[fi];
        let k = width(f, blocks);
        check(f, (1, k, n), seed);
        check(f, (m, k, n), seed);
    }

    #[test]
    fn vnni_products_any_shape(
        fi in 0usize..3,
        m in 1usize..20,
        blocks in 1usize..50,
        n in 1usize..110,
        seed in any::<u64>(),
    ) {
        let f = FORMATS[fi];
        let k = width(f, blocks);
        check(f, (m, k, n), seed);
    }
}

/// The codes at their extremes: Q8_0's −128 (the one code whose sign the row kernel cannot
/// flip, so it takes `|w|`) and 127, the 4-bit codes 0 and 15, against activations whose
/// blocks hit ±127; one row (in place) and its batch (packed) must still agree bit for bit
/// and stay within the scalar path's tolerance.
#[test]
fn vnni_extreme_codes() {
    let (m, n) = (5, 19);
    for f in FORMATS {
        let k = if f == WeightFormat::Q4_K { 512 } else { 96 };
        let mut w = weights(f, n, k, 41);
        let bb = f.block_bytes();
        for (i, blk) in w.chunks_exact_mut(bb).enumerate() {
            let codes = match f {
                WeightFormat::Q8_0 => &mut blk[2..],
                WeightFormat::Q4_1 => &mut blk[4..],
                _ => &mut blk[16..],
            };
            for (p, c) in codes.iter_mut().enumerate() {
                *c = match (f, (i + p) % 3) {
                    (WeightFormat::Q8_0, 0) => 0x80, // −128
                    (WeightFormat::Q8_0, 1) => 0x7f,
                    (_, 0) => 0xff, // 15, 15
                    (_, 1) => 0x0f, // 15, 0
                    _ => *c,
                };
            }
        }
        let x: Vec<f32> = (0..m * k)
            .map(|p| {
                if p % 7 == 0 {
                    -2.5
                } else {
                    ((p * 13) % 17) as f32 / 8.0 - 1.0
                }
            })
            .collect();
        if !check_with(f, &w, &x, (m, k, n)) {
            eprintln!("no AVX512-VNNI here (or THAW_VNNI_DOT=0): gemm_nt_vnni declined");
            return;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The Q4_K pack decodes 16 rows' sub-block scales and minimums at once (masked gathers,
    /// 6-bit fields spread over the 12 scale bytes): any scale bytes (every other row given
    /// ones, the rest random), any row count (partial groups of 16 and 48), against the
    /// scalar path and, bit for bit, each row alone (the row kernel decodes them its own way).
    #[test]
    fn vnni_q4_k_pack_scales_any_bytes(
        scales in proptest::array::uniform12(any::<u8>()),
        n in 1usize..60,
        m in 4usize..9,
        seed in any::<u64>(),
    ) {
        let (f, k) = (WeightFormat::Q4_K, 512);
        let mut w = weights(f, n, k, seed);
        for (i, blk) in w.chunks_exact_mut(f.block_bytes()).enumerate() {
            if i % 2 == 0 {
                blk[4..16].copy_from_slice(&scales);
            }
        }
        let x = activations(m, k, seed ^ 0x5eed);
        check_with(f, &w, &x, (m, k, n));
    }
}
