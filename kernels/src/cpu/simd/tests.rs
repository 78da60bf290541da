//! Each kernel against an f64 reference, on the portable path and (where the CPU has it) the
//! AVX2 path, over shapes with tails.
//!
//! Tolerances: f32 accumulation of `n ≤ 2048` terms errs by far less than
//! `1e-5 · Σ|aᵢ·bᵢ|` (the terms' absolute sum), while an indexing bug errs by `O(Σ|aᵢ·bᵢ|/√n)`
//! or more, so the check still catches them. The Q8 path is checked twice: against the exact
//! product with the *quantised* activations (same 1e-5 bound: the integer dots are exact), and
//! against the product with the original activations within the quantisation bound
//! `Σ_b (d_b / 2)·‖w_b‖₁` stated in `mod.rs`.
use half::{bf16, f16};
use proptest::prelude::*;
use rand::Rng;

use super::*;
use crate::cpu::quant::{dequantize_blocks, quantize_blocks};
use crate::cpu::testutil::{rand_vec, rng};

const TOL: f64 = 1e-5;

/// Every level this CPU can run, as (name, is-avx2).
fn levels() -> Vec<SimdLevel> {
    let mut v = vec![SimdLevel::Portable];
    if detect() == SimdLevel::Avx2 {
        v.push(SimdLevel::Avx2);
    } else {
        eprintln!("no AVX2/FMA/F16C here: checking the portable kernels only");
    }
    v
}

/// The rows kernels at an explicit level (no global state: tests run in parallel).
fn rows_f32(l: SimdLevel, x: &[f32], w: &[f32], out: &mut [f32]) {
    match l {
        SimdLevel::Portable => portable::rows(x, w.len(), out, |r| portable::dot_f32(r, w)),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect().unwrap().dot_rows_f32(x, w, out),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

fn rows_f16(l: SimdLevel, x: &[f32], w: &[f16], out: &mut [f32]) {
    match l {
        SimdLevel::Portable => portable::rows(x, w.len(), out, |r| portable::dot_f16(r, w)),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect().unwrap().dot_rows_f16(x, w, out),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

fn rows_bf16(l: SimdLevel, x: &[f32], w: &[bf16], out: &mut [f32]) {
    match l {
        SimdLevel::Portable => portable::rows(x, w.len(), out, |r| portable::dot_bf16(r, w)),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect().unwrap().dot_rows_bf16(x, w, out),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

fn rows_q8(l: SimdLevel, f: WeightFormat, w: &[u8], x: &[Q8Block], out: &mut [f32]) {
    match l {
        SimdLevel::Portable => {
            let kb = w.len() / f.block_bytes();
            for (o, xr) in out.iter_mut().zip(x.chunks_exact(kb)) {
                *o = portable::dot_q8(f, w, xr);
            }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect().unwrap().dot_rows_q8(f, w, x, out),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

/// One row through a rows kernel.
fn one(k: impl FnOnce(&mut [f32])) -> f32 {
    let mut o = [f32::NAN];
    k(&mut o);
    o[0]
}

fn f32_dot(l: SimdLevel, a: &[f32], b: &[f32]) -> f32 {
    one(|o| rows_f32(l, a, b, o))
}

fn f16_dot(l: SimdLevel, x: &[f32], w: &[f16]) -> f32 {
    one(|o| rows_f16(l, x, w, o))
}

fn bf16_dot(l: SimdLevel, x: &[f32], w: &[bf16]) -> f32 {
    one(|o| rows_bf16(l, x, w, o))
}

fn q8_dot(l: SimdLevel, f: WeightFormat, w: &[u8], x: &[Q8Block]) -> f32 {
    one(|o| rows_q8(l, f, w, x, o))
}

/// `Σ a·b` in f64 and `Σ |a·b|`.
fn reference(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> (f64, f64) {
    a.zip(b)
        .fold((0.0, 0.0), |(s, m), (x, y)| (s + x * y, m + (x * y).abs()))
}

fn check(what: &str, got: f32, (want, mag): (f64, f64), bound: f64) {
    let err = (got as f64 - want).abs();
    assert!(
        err <= bound + TOL * mag + 1e-30,
        "{what}: got {got}, want {want}, error {err:.3e} over {bound:.3e} + {TOL:.0e}·{mag:.3e}"
    );
}

fn float_dots(n: usize, seed: u64) {
    let mut r = rng(seed);
    let (x, w) = (rand_vec(&mut r, n, 2.0), rand_vec(&mut r, n, 0.5));
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let f64s = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
    let xs = f64s(&x);
    let want32 = reference(xs.iter().copied(), w.iter().map(|&v| v as f64));
    let want16 = reference(xs.iter().copied(), wh.iter().map(|v| v.to_f64()));
    let wantb = reference(xs.iter().copied(), wb.iter().map(|v| v.to_f64()));
    for l in levels() {
        check(&format!("f32 n={n} {l:?}"), f32_dot(l, &x, &w), want32, 0.0);
        check(
            &format!("f16 n={n} {l:?}"),
            f16_dot(l, &x, &wh),
            want16,
            0.0,
        );
        check(
            &format!("bf16 n={n} {l:?}"),
            bf16_dot(l, &x, &wb),
            wantb,
            0.0,
        );
    }
}

/// A weight row of `blocks` blocks of `f`: quantised from random values (`raw = false`) or
/// random bytes with sane scales (`raw`: every code, including Q8_0's -128).
fn weight_row(f: WeightFormat, blocks: usize, raw: bool, seed: u64) -> Vec<u8> {
    let mut r = rng(seed);
    let mut b = vec![0u8; blocks * f.block_bytes()];
    if raw {
        r.fill(&mut b[..]);
        for blk in b.chunks_exact_mut(f.block_bytes()) {
            let d = f16::from_f32(r.random_range(1e-3..0.1f32));
            blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
            if f == WeightFormat::Q4_1 {
                let m = f16::from_f32(r.random_range(-0.5..0.5f32));
                blk[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
            }
        }
    } else {
        let v = rand_vec(&mut r, blocks * 32, 0.3);
        quantize_blocks(f, &v, &mut b).unwrap();
    }
    b
}

fn q8_dots(f: WeightFormat, blocks: usize, raw: bool, seed: u64) {
    let w = weight_row(f, blocks, raw, seed);
    let mut wf = vec![0.0f32; blocks * 32];
    dequantize_blocks(f, &w, &mut wf).unwrap();
    let mut r = rng(seed ^ 0x5eed);
    let mut x = rand_vec(&mut r, blocks * 32, 3.0);
    if blocks > 1 {
        // A zero block (scale 0) and a tiny one.
        x[..32].fill(0.0);
        x[32..64].iter_mut().for_each(|v| *v *= 1e-6);
    }
    let mut q = vec![Q8Block::default(); blocks];
    quantize_q8(&x, &mut q);
    let xq: Vec<f64> = q
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&v| b.d as f64 * v as f64))
        .collect();
    let wd = || wf.iter().map(|&v| v as f64);
    let want_q = reference(wd(), xq.iter().copied());
    let want_x = reference(wd(), x.iter().map(|&v| v as f64));
    // The activation-quantisation bound: Σ_b (d_b / 2)·‖w_b‖₁.
    let bound: f64 = q
        .iter()
        .zip(wf.chunks_exact(32))
        .map(|(b, wb)| b.d as f64 / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>())
        .sum();
    for l in levels() {
        let got = q8_dot(l, f, &w, &q);
        let what = format!("{} x Q8, {blocks} blocks, raw {raw}, {l:?}", f.name());
        check(&format!("{what} vs quantised x"), got, want_q, 0.0);
        check(&format!("{what} vs original x"), got, want_x, bound);
    }
}

const Q8_FORMATS: [WeightFormat; 3] = [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1];

#[test]
fn float_dots_match_f64_at_model_widths() {
    for (i, n) in [0, 1, 7, 8, 31, 32, 33, 576, 1536, 2048]
        .into_iter()
        .enumerate()
    {
        float_dots(n, i as u64);
    }
}

#[test]
fn q8_dots_match_f64_at_model_widths() {
    for f in Q8_FORMATS {
        for (i, blocks) in [1, 2, 18, 48].into_iter().enumerate() {
            q8_dots(f, blocks, false, i as u64);
            q8_dots(f, blocks, true, 100 + i as u64);
        }
    }
}

#[test]
fn quantize_q8_rounds_within_half_a_step() {
    let mut r = rng(9);
    let x = rand_vec(&mut r, 96, 5.0);
    let mut q = vec![Q8Block::default(); 3];
    quantize_q8(&x, &mut q);
    for (b, v) in q.iter().zip(x.chunks_exact(32)) {
        let amax = v.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        assert_eq!(b.d, amax / 127.0);
        assert!(
            b.qs.iter().all(|&q| q != i8::MIN),
            "codes stay in [-127, 127]"
        );
        let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
        assert_eq!(b.s, b.d * sum as f32);
        for (&q, &x) in b.qs.iter().zip(v) {
            // Half a step, plus the rounding of `x / d` itself.
            assert!(
                (b.d * q as f32 - x).abs() <= b.d * (0.5 + 1e-5),
                "{x} -> {q}·{}",
                b.d
            );
        }
    }
    let mut z = [Q8Block::default()];
    quantize_q8(&[0.0; 32], &mut z);
    assert_eq!((z[0].d, z[0].s, z[0].qs), (0.0, 0.0, [0; 32]));
}

#[test]
fn dispatch_honours_the_level() {
    // The public entry points at whatever level is in effect agree with one of the levels.
    let mut r = rng(3);
    let (a, b) = (rand_vec(&mut r, 100, 1.0), rand_vec(&mut r, 100, 1.0));
    let got = dot_f32(&a, &b);
    assert!(levels().iter().any(|&l| f32_dot(l, &a, &b) == got));
    assert_eq!(simd_level(), simd_level());
}

/// Each row of a many-row call equals the one-row call bit for bit (a sequence's logits do
/// not depend on its batch), at every level, for 1..=9 rows (tiles of 4 plus remainders).
#[test]
fn rows_kernels_are_batch_invariant() {
    let (k, kb) = (96 + 13, 5);
    let mut r = rng(11);
    let x = rand_vec(&mut r, 9 * k, 1.0);
    let w = rand_vec(&mut r, k, 1.0);
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let xs = rand_vec(&mut r, 9 * kb * 32, 1.0);
    let mut q = vec![Q8Block::default(); 9 * kb];
    for (row, qr) in xs.chunks_exact(kb * 32).zip(q.chunks_exact_mut(kb)) {
        quantize_q8(row, qr);
    }
    for l in levels() {
        for m in 1..=9 {
            let mut out = vec![f32::NAN; m];
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            rows_f32(l, &x[..m * k], &w, &mut out);
            let single: Vec<f32> = (0..m)
                .map(|i| f32_dot(l, &x[i * k..(i + 1) * k], &w))
                .collect();
            assert_eq!(bits(&out), bits(&single), "f32 {l:?} m={m}");
            rows_f16(l, &x[..m * k], &wh, &mut out);
            let single: Vec<f32> = (0..m)
                .map(|i| f16_dot(l, &x[i * k..(i + 1) * k], &wh))
                .collect();
            assert_eq!(bits(&out), bits(&single), "f16 {l:?} m={m}");
            rows_bf16(l, &x[..m * k], &wb, &mut out);
            let single: Vec<f32> = (0..m)
                .map(|i| bf16_dot(l, &x[i * k..(i + 1) * k], &wb))
                .collect();
            assert_eq!(bits(&out), bits(&single), "bf16 {l:?} m={m}");
            for f in Q8_FORMATS {
                let wq = weight_row(f, kb, true, m as u64);
                rows_q8(l, f, &wq, &q[..m * kb], &mut out);
                let single: Vec<f32> = (0..m)
                    .map(|i| q8_dot(l, f, &wq, &q[i * kb..(i + 1) * kb]))
                    .collect();
                assert_eq!(bits(&out), bits(&single), "{} {l:?} m={m}", f.name());
            }
        }
    }
}

/// The AVX2 quantiser writes exactly the portable blocks (scales, sums and codes), for
/// ordinary values, ties at .5 steps, a zero block and one tiny block.
#[cfg(target_arch = "x86_64")]
#[test]
fn quantize_q8_avx2_equals_portable_bitwise() {
    let Some(t) = x86::Avx2::detect() else { return };
    let mut r = rng(21);
    let mut x = rand_vec(&mut r, 32 * 40, 3.0);
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 0.5; // many exact halves of a step
    }
    for v in &mut x[96..128] {
        *v *= 1e-30;
    }
    let mut want = vec![Q8Block::default(); 40];
    let mut got = vec![Q8Block::default(); 40];
    super::portable::quantize_q8(&x, &mut want);
    t.quantize_q8(&x, &mut got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            (g.d.to_bits(), g.s.to_bits(), g.qs),
            (w.d.to_bits(), w.s.to_bits(), w.qs),
            "block {i}"
        );
    }
}

/// `gemv_q8` at an explicit level.
fn gemv(
    l: SimdLevel,
    f: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[Q8Block],
    out: &mut [f32],
    ldo: usize,
) {
    match l {
        SimdLevel::Portable => gemv_q8_portable(f, w, n, x, out, ldo),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect().unwrap().gemv_q8(f, w, n, x, out, ldo),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

/// A whole product through `gemv_q8` equals `dot_rows_q8` row by row, bit for bit, at every
/// level, for 1..=6 activation rows written at a wider stride (padding untouched).
#[test]
fn gemv_q8_equals_dot_rows() {
    let (n, kb) = (7, 3);
    let mut r = rng(5);
    let xs = rand_vec(&mut r, 6 * kb * 32, 1.0);
    let mut q = vec![Q8Block::default(); 6 * kb];
    for (row, qr) in xs.chunks_exact(kb * 32).zip(q.chunks_exact_mut(kb)) {
        quantize_q8(row, qr);
    }
    for l in levels() {
        for f in Q8_FORMATS {
            let w: Vec<u8> = (0..n)
                .flat_map(|j| weight_row(f, kb, true, 40 + j as u64))
                .collect();
            let rb = w.len() / n;
            for m in 1..=6 {
                let ldo = n + 2;
                let mut out = vec![f32::NAN; m * ldo];
                gemv(l, f, &w, n, &q[..m * kb], &mut out, ldo);
                for i in 0..m {
                    for j in 0..n {
                        let want = q8_dot(l, f, &w[j * rb..(j + 1) * rb], &q[i * kb..(i + 1) * kb]);
                        assert_eq!(
                            out[i * ldo + j].to_bits(),
                            want.to_bits(),
                            "{} {l:?} m={m}",
                            f.name()
                        );
                    }
                    assert!(out[i * ldo + n].is_nan(), "padding written");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every length (so every tail) of the float kernels.
    #[test]
    fn float_dots_any_length(n in 0usize..300, seed in any::<u64>()) {
        float_dots(n, seed);
    }

    /// Every block count of the Q8 kernels, quantised and raw weights.
    #[test]
    fn q8_dots_any_blocks(blocks in 1usize..40, raw in any::<bool>(), f in 0usize..3, seed in any::<u64>()) {
        q8_dots(Q8_FORMATS[f], blocks, raw, seed);
    }
}

/// `gemv_quant_f32` at an explicit level.
fn gemv_qf(
    l: SimdLevel,
    f: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[f32],
    out: &mut [f32],
    ldo: usize,
) {
    let kb = w.len() / f.block_bytes() / n;
    let m = x.len() / (kb * 32);
    match l {
        SimdLevel::Portable => gemv_quant_f32_portable(f, w, (n, kb), x, m, out, ldo),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86::Avx2::detect()
            .unwrap()
            .gemv_quant_f32(f, w, n, kb, x, m, out, ldo),
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 => unreachable!(),
    }
}

/// The f32-activation quantised product equals widening each weight row to f32 and dotting it
/// with the same level's f32 kernel, bit for bit, for 1..=6 activation rows (odd and even
/// weight-row counts: the paired decode tiles and the single remainder), written at a wider
/// stride with the padding untouched.
fn gemv_quant_f32_equals_widened(kb: usize, n: usize, seed: u64) {
    let mut r = rng(seed);
    let k = kb * 32;
    let xs = rand_vec(&mut r, 6 * k, 2.0);
    for l in levels() {
        for f in Q8_FORMATS {
            let w: Vec<u8> = (0..n)
                .flat_map(|j| weight_row(f, kb, j % 2 == 0, seed ^ (40 + j as u64)))
                .collect();
            let mut wide = vec![0.0f32; n * k];
            dequantize_blocks(f, &w, &mut wide).unwrap();
            for m in 1..=6 {
                let ldo = n + 2;
                let mut out = vec![f32::NAN; m * ldo];
                gemv_qf(l, f, &w, n, &xs[..m * k], &mut out, ldo);
                for i in 0..m {
                    for j in 0..n {
                        let want = f32_dot(l, &xs[i * k..(i + 1) * k], &wide[j * k..(j + 1) * k]);
                        assert_eq!(
                            out[i * ldo + j].to_bits(),
                            want.to_bits(),
                            "{} {l:?} m={m} row {j}: {} vs {want}",
                            f.name(),
                            out[i * ldo + j]
                        );
                    }
                    assert!(out[i * ldo + n].is_nan(), "padding written");
                }
            }
        }
    }
}

#[test]
fn gemv_quant_f32_equals_widened_at_model_widths() {
    gemv_quant_f32_equals_widened(18, 7, 3); // 576 wide (SmolLM2's hidden size)
    gemv_quant_f32_equals_widened(48, 4, 4); // 1536 wide (its MLP)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any block count and row count, quantised and raw codes.
    #[test]
    fn gemv_quant_f32_equals_widened_any_shape(kb in 1usize..12, n in 1usize..6, seed in any::<u64>()) {
        gemv_quant_f32_equals_widened(kb, n, seed);
    }
}

/// The AVX2 row dequantiser writes exactly the scalar values, for quantised and raw codes.
#[test]
fn dequantize_row_equals_scalar() {
    for f in Q8_FORMATS {
        for (seed, raw) in [(1, false), (2, true)] {
            let w = weight_row(f, 9, raw, seed);
            let mut want = vec![0.0f32; 9 * 32];
            dequantize_blocks(f, &w, &mut want).unwrap();
            let mut got = vec![f32::NAN; 9 * 32];
            assert!(dequantize_row(f, &w, &mut got));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{} raw {raw}", f.name());
        }
    }
    // Formats without a row dequantiser decline (K-quants have one where AVX-512F runs).
    assert!(!dequantize_row(WeightFormat::F32, &[], &mut []));
}

/// The AVX-512 quantised kernels (used under the AVX2 level when the CPU has AVX-512F) equal
/// the 8-lane AVX2 kernel bit for bit, for decode (one activation row: 4-row weight tiles and
/// the remainder) and batches (1..=6 rows), and the row dequantiser equals the scalar one.
#[cfg(target_arch = "x86_64")]
fn avx512_equals_avx2(kb: usize, n: usize, seed: u64) {
    let (Some(z), Some(y)) = (x86_512::Avx512::detect(), x86::Avx2::detect()) else {
        eprintln!("no AVX-512F here: the AVX-512 kernels are not checked");
        return;
    };
    let mut r = rng(seed);
    let k = kb * 32;
    let xs = rand_vec(&mut r, 6 * k, 2.0);
    for f in Q8_FORMATS {
        let w: Vec<u8> = (0..n)
            .flat_map(|j| weight_row(f, kb, j % 2 == 0, seed ^ (70 + j as u64)))
            .collect();
        for m in 1..=6 {
            let ldo = n + 1;
            let mut want = vec![f32::NAN; m * ldo];
            let mut got = vec![f32::NAN; m * ldo];
            y.gemv_quant_f32_ymm(f, &w, n, kb, &xs[..m * k], m, &mut want, ldo);
            z.gemv_quant_f32(f, &w, n, kb, &xs[..m * k], m, &mut got, ldo);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{} m={m} n={n} kb={kb}", f.name());
        }
        let mut want = vec![0.0f32; n * k];
        dequantize_blocks(f, &w, &mut want).unwrap();
        let mut got = vec![f32::NAN; n * k];
        z.dequantize_row(f, &w, &mut got);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{} dequantize_row",
            f.name()
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_equals_avx2_at_model_widths() {
    avx512_equals_avx2(18, 9, 5); // 576 wide: two 4-row decode tiles and a remainder
    avx512_equals_avx2(48, 4, 6); // 1536 wide
}

#[cfg(target_arch = "x86_64")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn avx512_equals_avx2_any_shape(kb in 1usize..12, n in 1usize..11, seed in any::<u64>()) {
        avx512_equals_avx2(kb, n, seed);
    }
}

/// The in-place f32 GEMM (AVX-512) sums every output exactly as the row dot does, for tiles
/// with edges in both dimensions and every tail of `k` (16-wide steps, the 8-wide step, the
/// scalar tail), written at a wider stride with the padding untouched.
fn gemm_nt_equals_row_dots(m: usize, k: usize, n: usize, seed: u64) {
    check_gemm(m, k, n, seed, "gemm_nt_f32", gemm_nt_f32, |xi, wj| {
        f32_dot(SimdLevel::Avx2, xi, wj)
    });
}

type Gemm = fn(&[f32], &[f32], (usize, usize, usize), &mut [f32], usize) -> bool;

/// Runs `gemm` on random `[m, k]` × `[n, k]` operands, writing at a stride wider than `n`
/// over stale outputs, and checks every output bit for bit against `want` of its two rows,
/// the padding untouched (a kernel that reports no AVX-512F here is not checked).
fn check_gemm(
    m: usize,
    k: usize,
    n: usize,
    seed: u64,
    name: &str,
    gemm: Gemm,
    want: impl Fn(&[f32], &[f32]) -> f32,
) {
    let mut r = rng(seed);
    let (x, w) = (rand_vec(&mut r, m * k, 1.0), rand_vec(&mut r, n * k, 1.0));
    let ldo = n + 3;
    let mut got = vec![f32::NAN; m * ldo];
    for i in 0..m {
        got[i * ldo..i * ldo + n].fill(7.0);
    }
    if !gemm(&x, &w, (m, k, n), &mut got, ldo) {
        eprintln!("no AVX-512F here: {name} is not checked");
        return;
    }
    for i in 0..m {
        for j in 0..n {
            let want = want(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
            assert_eq!(
                got[i * ldo + j].to_bits(),
                want.to_bits(),
                "{name} {m}x{k}x{n} at ({i}, {j})"
            );
        }
        assert!(
            got[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
            "{name}: padding written"
        );
    }
}

#[test]
fn gemm_nt_equals_row_dots_at_model_shapes() {
    gemm_nt_equals_row_dots(64, 576, 40, 1); // a prompt chunk × q/o rows
    gemm_nt_equals_row_dots(1, 1536, 9, 2); // decode × down rows
    gemm_nt_equals_row_dots(7, 0, 5, 3); // empty reduction: zeros
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn gemm_nt_equals_row_dots_any_shape(m in 1usize..10, k in 0usize..80, n in 1usize..10, seed in any::<u64>()) {
        gemm_nt_equals_row_dots(m, k, n, seed);
    }
}

/// The prompt GEMM (AVX-512) computes every output as one sequential fused multiply-add
/// chain over `k` from zero — bit for bit what `f32::mul_add` folds to — for tiles with
/// edges in rows (8-row tiles), columns (48-column panels), every tail of `k` (16-wide
/// transposes, the 160-step blocks), written at a wider stride with the padding untouched
/// and stale outputs overwritten.
fn prompt_gemm_is_one_fma_chain(m: usize, k: usize, n: usize, seed: u64) {
    check_gemm(
        m,
        k,
        n,
        seed,
        "gemm_nt_f32_prompt",
        gemm_nt_f32_prompt,
        |xi, wj| xi.iter().zip(wj).fold(0.0f32, |s, (a, b)| a.mul_add(*b, s)),
    );
}

#[test]
fn prompt_gemm_is_one_fma_chain_at_model_shapes() {
    prompt_gemm_is_one_fma_chain(64, 576, 96, 1); // a prompt chunk × half the k/v rows
    prompt_gemm_is_one_fma_chain(17, 1536, 50, 2); // × down rows: 10 k-blocks, a 2-column panel
    prompt_gemm_is_one_fma_chain(9, 0, 5, 3); // empty reduction: zeros
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn prompt_gemm_is_one_fma_chain_any_shape(m in 1usize..20, k in 0usize..400, n in 1usize..110, seed in any::<u64>()) {
        prompt_gemm_is_one_fma_chain(m, k, n, seed);
    }
}
