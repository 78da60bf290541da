//! The batched products over stored 16-bit float weights ([`gemm_nt`], [`gemm_nt_prompt`]):
//! bit for bit against the AVX2 row dots and the f32 kernels over the widened weight (where
//! the CPU has AVX-512F), and against the portable kernels within the module's tolerance.
//!
//! Tolerance against the portable path: both sum the same exact products (f16/bf16 widen to
//! f32 exactly) in f32, in different orders, so they differ by f32 rounding of `k ≤ 400`
//! terms, far below `1e-5 · Σ|xᵢ·wᵢ|`; an indexing bug errs by `O(Σ|xᵢ·wᵢ| / √k)`.
use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::cpu::testutil::{rand_vec, rng};

/// The two 16-bit float formats, each as (name, weights, the widened f32 weights).
fn weights(n: usize, k: usize, seed: u64) -> [(&'static str, Vec<u16>, Vec<f32>); 2] {
    let w = rand_vec(&mut rng(seed), n * k, 1.0);
    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    [
        (
            "f16",
            h.iter().map(|v| v.to_bits()).collect(),
            h.iter().map(|v| v.to_f32()).collect(),
        ),
        (
            "bf16",
            b.iter().map(|v| v.to_bits()).collect(),
            b.iter().map(|v| v.to_f32()).collect(),
        ),
    ]
}

/// `bits` as the weights of format `name`.
fn as_float<'a>(
    name: &str,
    bits: &'a [u16],
    h: &'a mut Vec<f16>,
    b: &'a mut Vec<bf16>,
) -> FloatWeights<'a> {
    if name == "f16" {
        *h = bits.iter().map(|&v| f16::from_bits(v)).collect();
        FloatWeights::F16(h)
    } else {
        *b = bits.iter().map(|&v| bf16::from_bits(v)).collect();
        FloatWeights::BF16(b)
    }
}

/// The portable row dot of `x` with the 16-bit row (`name`'s format).
fn portable_dot(name: &str, x: &[f32], bits: &[u16]) -> f32 {
    if name == "f16" {
        let w: Vec<f16> = bits.iter().map(|&v| f16::from_bits(v)).collect();
        portable::dot_f16(x, &w)
    } else {
        let w: Vec<bf16> = bits.iter().map(|&v| bf16::from_bits(v)).collect();
        portable::dot_bf16(x, &w)
    }
}

/// [`gemm_nt`] or [`gemm_nt_prompt`].
type Kernel = fn(&[f32], FloatWeights<'_>, (usize, usize, usize), &mut [f32], usize) -> bool;

/// Runs `kernel` over `[m, k]` × `[n, k]` 16-bit weights at a stride wider than `n`, then
/// checks every output: within the tolerance of the portable dot, bit for bit equal to
/// `exact(x_i, widened w_j)`, the padding untouched. A kernel that reports no AVX-512F here
/// is not checked.
fn check(
    (m, k, n): (usize, usize, usize),
    seed: u64,
    what: &str,
    kernel: Kernel,
    exact: impl Fn(&[f32], &[f32]) -> f32,
) {
    let x = rand_vec(&mut rng(seed ^ 0x5eed), m * k, 1.0);
    for (name, bits, wide) in weights(n, k, seed) {
        if name == "bf16" && what == "gemm_nt_prompt" && bf16_dot_active() {
            continue; // bf16 activations: `prompt_bf16_dot` checks it
        }
        let (mut h, mut b) = (Vec::new(), Vec::new());
        let w = as_float(name, &bits, &mut h, &mut b);
        let ldo = n + 2;
        let mut got = vec![f32::NAN; m * ldo];
        for i in 0..m {
            got[i * ldo..i * ldo + n].fill(7.0);
        }
        if !kernel(&x, w, (m, k, n), &mut got, ldo) {
            eprintln!("no AVX-512F here: {what} is not checked");
            return;
        }
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            for j in 0..n {
                let (wj, bj) = (&wide[j * k..(j + 1) * k], &bits[j * k..(j + 1) * k]);
                let g = got[i * ldo + j];
                let mag: f32 = xi.iter().zip(wj).map(|(a, b)| (a * b).abs()).sum();
                let p = portable_dot(name, xi, bj);
                assert!(
                    (g - p).abs() as f64 <= 1e-5 * mag as f64 + 1e-30,
                    "{what} {name} {m}x{k}x{n} at ({i}, {j}): {g} vs portable {p}"
                );
                let e = exact(xi, wj);
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{what} {name} {m}x{k}x{n} at ({i}, {j})"
                );
            }
            assert!(
                got[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
                "{what}: padding written"
            );
        }
    }
}

/// The in-place kernel over 16-bit weights sums each output as the AVX2 row dot over the
/// stored weights does (and so as the f32 row dot over the widened weights).
fn in_place(m: usize, k: usize, n: usize, seed: u64) {
    check((m, k, n), seed, "gemm_nt", gemm_nt, |xi, wj| {
        let mut o = [0.0];
        dot_rows_f32(xi, wj, &mut o);
        o[0]
    });
}

/// The packed prompt kernel over 16-bit weights is one FMA chain over the widened weights.
fn prompt(m: usize, k: usize, n: usize, seed: u64) {
    check(
        (m, k, n),
        seed,
        "gemm_nt_prompt",
        gemm_nt_prompt,
        |xi, wj| xi.iter().zip(wj).fold(0.0f32, |s, (a, b)| a.mul_add(*b, s)),
    );
}

/// With AVX512-BF16, the prompt kernel over bf16 weights multiplies the activations rounded
/// to bf16 (nearest even): within the tolerance above of the f64 product of those rounded
/// activations, and each output's bits depend only on its own two rows (the whole product
/// equals each row computed alone, at a wider stride, padding untouched).
fn prompt_bf16_dot(m: usize, k: usize, n: usize, seed: u64) {
    if !bf16_dot_active() {
        eprintln!("no AVX512-BF16 here (or THAW_BF16_DOT=0): the bf16-pair kernel is not checked");
        return;
    }
    let x = rand_vec(&mut rng(seed ^ 0xb16), m * k, 1.0);
    let [_, (_, bits, wide)] = weights(n, k, seed);
    let w: Vec<bf16> = bits.iter().map(|&v| bf16::from_bits(v)).collect();
    let ldo = n + 2;
    let mut got = vec![f32::NAN; m * ldo];
    assert!(gemm_nt_prompt(
        &x,
        FloatWeights::BF16(&w),
        (m, k, n),
        &mut got,
        ldo
    ));
    for i in 0..m {
        let xi = &x[i * k..(i + 1) * k];
        let mut alone = vec![f32::NAN; n];
        assert!(gemm_nt_prompt(
            xi,
            FloatWeights::BF16(&w),
            (1, k, n),
            &mut alone,
            n
        ));
        for j in 0..n {
            let wj = &wide[j * k..(j + 1) * k];
            let xr = xi.iter().map(|&v| bf16::from_f32(v).to_f32());
            let (want, mag) = xr.zip(wj).fold((0.0f64, 0.0f64), |(s, a), (xv, &wv)| {
                let t = xv as f64 * wv as f64;
                (s + t, a + t.abs())
            });
            let g = got[i * ldo + j];
            assert!(
                (g as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                "bf16 pairs {m}x{k}x{n} at ({i}, {j}): {g} vs {want}"
            );
            assert_eq!(
                g.to_bits(),
                alone[j].to_bits(),
                "bf16 pairs: row {i} depends on its batch"
            );
        }
        assert!(
            got[i * ldo + n..(i + 1) * ldo].iter().all(|v| v.is_nan()),
            "padding written"
        );
    }
}

#[test]
fn batched_16bit_kernels_at_model_shapes() {
    in_place(16, 576, 20, 1); // a decode batch × q rows
    in_place(1, 1536, 9, 2); // one decode row × down rows
    in_place(5, 0, 3, 3); // empty reduction: zeros
    prompt(64, 576, 50, 4); // a prompt chunk × a panel and a 2-column panel
    prompt(17, 1536, 9, 5); // × down rows: 10 k-blocks
    prompt(9, 0, 5, 6);
    prompt_bf16_dot(64, 576, 50, 7); // two panels, 576 = 288 pairs: two KC blocks
    prompt_bf16dot_tails();
}

/// Odd `k` (a lone last element), pair counts that are not multiples of 16, one column.
fn prompt_bf16dot_tails() {
    for (m, k, n) in [(3, 1, 1), (9, 33, 17), (17, 47, 49), (8, 0, 3)] {
        prompt_bf16_dot(m, k, n, (m * k + n) as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn in_place_16bit_any_shape(m in 1usize..18, k in 0usize..120, n in 1usize..10, seed in any::<u64>()) {
        in_place(m, k, n, seed);
    }

    #[test]
    fn prompt_bf16_pairs_any_shape(m in 1usize..20, k in 0usize..400, n in 1usize..110, seed in any::<u64>()) {
        prompt_bf16_dot(m, k, n, seed);
    }

    #[test]
    fn prompt_16bit_any_shape(m in 1usize..20, k in 0usize..400, n in 1usize..110, seed in any::<u64>()) {
        prompt(m, k, n, seed);
    }
}

/// Q4_K and Q6_K rows dequantised by [`dequantize_row`] (AVX-512F where it runs) equal the
/// scalar dequantiser bit for bit: random codes and scales, sane f16 scales (Q4_K's `d` and
/// `dmin` at bytes 0 and 2, Q6_K's `d` at byte 208).
fn k_quant_row_equals_scalar(f: WeightFormat, blocks: usize, seed: u64) {
    use rand::Rng;
    let mut r = rng(seed);
    let bb = f.block_bytes();
    let mut w: Vec<u8> = (0..blocks * bb).map(|_| r.random()).collect();
    let scales: &[usize] = if f == WeightFormat::Q4_K {
        &[0, 2]
    } else {
        &[208]
    };
    for b in w.chunks_exact_mut(bb) {
        for &at in scales {
            let v = f16::from_f32(r.random_range(-0.05f32..0.05));
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    let mut want = vec![0.0f32; blocks * 256];
    crate::cpu::quant::dequantize_blocks(f, &w, &mut want).unwrap();
    let mut got = vec![f32::NAN; blocks * 256];
    if !dequantize_row(f, &w, &mut got) {
        eprintln!("no AVX-512F here: the {f} row dequantiser is not checked");
        return;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "{f}, {blocks} blocks");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn k_quant_rows_any_length(q6 in any::<bool>(), blocks in 0usize..8, seed in any::<u64>()) {
        let f = if q6 { WeightFormat::Q6_K } else { WeightFormat::Q4_K };
        k_quant_row_equals_scalar(f, blocks, seed);
    }
}
