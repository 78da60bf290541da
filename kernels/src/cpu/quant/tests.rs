use half::f16;
use proptest::prelude::*;
use rand::Rng;

use super::*;
use crate::cpu::simd::{
    bf16_dot_active, q8_dot_supported, quantize_q8_for, vnni_dot_active, vnni_prompt_active,
    Q8Block,
};
use crate::cpu::testutil::{assert_close, rand_vec, rng};

const ROWS: usize = 3;
const COLS: usize = 512;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// (format, quantised bytes, gguf's dequantisation, gguf's quantisation input if any), from
/// `fixtures/gen_quant_fixtures.py` (ggml's Python reference, PyPI `gguf` 0.19).
type Fixture = (WeightFormat, &'static [u8], Vec<f32>, Option<Vec<f32>>);

fn fixtures() -> Vec<Fixture> {
    macro_rules! fx {
        ($f:ident) => {
            (
                WeightFormat::$f,
                &include_bytes!(concat!("fixtures/", stringify!($f), ".q"))[..],
                f32s(include_bytes!(concat!("fixtures/", stringify!($f), ".f32"))),
            )
        };
    }
    macro_rules! src {
        ($f:ident) => {
            Some(f32s(include_bytes!(concat!(
                "fixtures/",
                stringify!($f),
                ".src"
            ))))
        };
    }
    let (a, b, c, d, e) = (fx!(Q8_0), fx!(Q4_0), fx!(Q4_1), fx!(Q4_K), fx!(Q6_K));
    vec![
        (a.0, a.1, a.2, src!(Q8_0)),
        (b.0, b.1, b.2, src!(Q4_0)),
        (c.0, c.1, c.2, src!(Q4_1)),
        (d.0, d.1, d.2, None),
        (e.0, e.1, e.2, None),
    ]
}

/// Dequantisation equals ggml's reference. Tolerance 1e-6 of (|x| + RMS): both compute
/// `d·sc·q − dmin·m` in f32 but may associate the products differently (≤ 2 ulp apart).
#[test]
fn dequantize_matches_ggml_reference() {
    for (f, q, want, _) in fixtures() {
        let mut got = vec![0.0; ROWS * COLS];
        dequantize_blocks(f, q, &mut got).unwrap();
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close(f.name(), &got, &want, 1e-6);
        let m = WeightMatrix::from_bytes(f, q, ROWS, COLS).unwrap();
        assert_close(f.name(), &m.to_f32(), &want, 1e-6);
        let mut row = vec![0.0; COLS];
        m.row_to_f32(2, &mut row);
        assert_eq!(row, got[2 * COLS..]);
    }
}

/// Thaw's quantiser reproduces ggml's reference bytes for the 32-value types (a quant may
/// differ only where x·id sits on a rounding tie, which random inputs do not hit).
#[test]
fn quantize_matches_ggml_reference() {
    for (f, q, _, src) in fixtures() {
        let Some(src) = src else { continue };
        let mut got = vec![0u8; q.len()];
        quantize_blocks(f, &src, &mut got).unwrap();
        assert_eq!(got, q, "{f}");
    }
    let mut out = vec![0u8; 144];
    let e = quantize_blocks(WeightFormat::Q4_K, &[0.5; 256], &mut out).unwrap_err();
    assert!(e.to_string().contains("llama-quantize"), "{e}");
}

fn naive(x: &[f32], w: &[f32], m: usize, k: usize, cols: std::ops::Range<usize>) -> Vec<f64> {
    let mut y = Vec::with_capacity(m * cols.len());
    for i in 0..m {
        for j in cols.clone() {
            y.push(
                (0..k)
                    .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                    .sum(),
            );
        }
    }
    y
}

/// A `[rows, cols]` matrix in `f` with random contents (float formats: random values;
/// quantised formats: random blocks with sane f16 scales).
pub(super) fn random_matrix(f: WeightFormat, rows: usize, cols: usize, seed: u64) -> WeightMatrix {
    let mut r = rng(seed);
    if !f.is_quantized() {
        let w = WeightMatrix::from_f32(rand_vec(&mut r, rows * cols, 1.0), rows, cols);
        return w.convert(f).unwrap();
    }
    let mut b: Vec<u8> = (0..f.bytes_for(rows * cols).unwrap())
        .map(|_| r.random())
        .collect();
    let scale_at: &[usize] = match f {
        WeightFormat::Q8_0 | WeightFormat::Q4_0 => &[0],
        WeightFormat::Q4_1 | WeightFormat::Q4_K => &[0, 2],
        _ => &[208],
    };
    for blk in b.chunks_exact_mut(f.block_bytes()) {
        for &at in scale_at {
            let d = f16::from_f32(r.random_range(-0.05f32..0.05));
            blk[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    }
    WeightMatrix::from_bytes(f, &b, rows, cols).unwrap()
}

/// Rows of `x` (`k` wide) as the Q8 path over weights of `f` sees them: quantised
/// ([`quantize_q8_for`]) and dequantised.
pub(super) fn q8_rows(f: WeightFormat, x: &[f32], k: usize) -> Vec<f32> {
    let mut q = vec![Q8Block::default(); k / 32];
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(k) {
        quantize_q8_for(f, row, &mut q);
        out.extend(
            q.iter()
                .flat_map(|b| b.qs.iter().map(move |&v| b.d * v as f32)),
        );
    }
    out
}

/// What a product over Q4_1 weights on Q8_1 activations adds to the product of the widened
/// weight with [`q8_rows`]: per block, the weight's minimum times the f16-rounded sum `s`
/// less `d·Σq` (ggml's `quantize_row_q8_1` rounds `s` on its own). `[m, cols]` like the
/// product; zeros for every other format.
pub(super) fn q8_1_sum_terms(
    w: &WeightMatrix,
    x: &[f32],
    m: usize,
    cols: std::ops::Range<usize>,
) -> Vec<f64> {
    let mut t = vec![0.0f64; m * cols.len()];
    let WeightData::Quant(WeightFormat::Q4_1, b) = w.data() else {
        return t;
    };
    let (k, bb) = (w.cols(), WeightFormat::Q4_1.block_bytes());
    let kb = k / 32;
    let mut q = vec![Q8Block::default(); kb];
    for i in 0..m {
        quantize_q8_for(WeightFormat::Q4_1, &x[i * k..(i + 1) * k], &mut q);
        for (jj, j) in cols.clone().enumerate() {
            t[i * cols.len() + jj] = q
                .iter()
                .enumerate()
                .map(|(c, xb)| {
                    let o = (j * kb + c) * bb;
                    let min = f16::from_le_bytes([b[o + 2], b[o + 3]]).to_f32() as f64;
                    let sum: i32 = xb.qs.iter().map(|&v| v as i32).sum();
                    min * (xb.s as f64 - xb.d as f64 * sum as f64)
                })
                .sum();
        }
    }
    t
}

/// `x·Wᵀ` over every stored format equals the f64 product with the dequantised weights, for
/// decode-sized and prefill-sized row counts and for column sub-ranges. Tolerance 1e-5 of
/// (|y| + RMS(y)): f32 accumulation over k = 512 terms errs by ~√k·6e-8 ≈ 1.4e-6.
#[test]
fn matmul_matches_dequantised_f32() {
    let (n, k) = (40, 512);
    for (s, f) in WeightFormat::ALL.into_iter().enumerate() {
        let w = random_matrix(f, n, k, 100 + s as u64);
        assert_eq!(w.format(), f);
        assert_eq!(w.storage_bytes(), f.bytes_for(n * k).unwrap());
        let wf = w.to_f32();
        let mut r = rng(7);
        for m in [1, 3, 16, 17, 45] {
            let x = rand_vec(&mut r, m * k, 1.0);
            for cols in [0..n, 5..33, 39..40] {
                let mut y = vec![f32::NAN; m * cols.len()];
                w.matmul_range(&x, m, &mut y, cols.clone());
                // Decode rows over Q8_0/Q4_0/Q4_1 multiply Q8-quantised activations (integer
                // dots, exact): the oracle uses those activations (`simd::tests` checks the
                // quantisation error bound against the original ones).
                // Q8_0/Q4_K/Q4_1 on AVX512-VNNI multiply Q8-quantised activations at every
                // `m` (Q4_1 decode rows by default, `q8_activations`; its prompt rows by
                // `q8_prompt`), Q4_1's as ggml's Q8_1 blocks (`q8_1_sum_terms`).
                let q8 = vnni_dot_active(f)
                    || (m > 16 && vnni_prompt_active(f))
                    || (m <= 16 && super::q8_activations() && q8_dot_supported(f));
                let xs = if q8 {
                    q8_rows(f, &x, k)
                } else if f == WeightFormat::BF16 && bf16_dot_active() && k % 2 == 0 {
                    // Rows over bf16 weights multiply bf16-rounded activations (prompt and,
                    // for even `k`, decode rows).
                    x.iter()
                        .map(|&v| half::bf16::from_f32(v).to_f32())
                        .collect()
                } else {
                    x.clone()
                };
                let mut want = naive(&xs, &wf, m, k, cols.clone());
                if q8 {
                    let terms = q8_1_sum_terms(&w, &x, m, cols.clone());
                    want.iter_mut().zip(terms).for_each(|(y, t)| *y += t);
                }
                assert_close(&format!("{f} m={m} {cols:?}"), &y, &want, 1e-5);
            }
        }
    }
}

#[test]
fn bad_lengths_are_errors() {
    let e = WeightMatrix::from_bytes(WeightFormat::Q4_1, &[0; 40], 2, 48).unwrap_err();
    assert!(e.to_string().contains("multiple of the block size"), "{e}");
    let e = WeightMatrix::from_bytes(WeightFormat::Q4_1, &[0; 39], 2, 32).unwrap_err();
    assert!(e.to_string().contains("39 bytes but 40"), "{e}");
    let e = WeightMatrix::from_data(WeightData::F16(vec![f16::ZERO; 5].into()), 2, 3).unwrap_err();
    assert!(e.to_string().contains("10 bytes but 12"), "{e}");
}

/// Per-format round-trip bound for ggml's reference quantiser: half a step of the block's
/// grid (a full step for Q4_0, whose grid is asymmetric: −8..7 with the extreme at −8),
/// plus the f16 rounding of the scale and offset (2⁻¹⁰ of the block's magnitude).
fn round_trip_bound(f: WeightFormat, block: &[f32]) -> f32 {
    let amax = block.iter().fold(0.0f32, |a, x| a.max(x.abs()));
    let (lo, hi) = block
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &x| {
            (l.min(x), h.max(x))
        });
    let step = match f {
        WeightFormat::Q8_0 => amax / 127.0 * 0.5,
        WeightFormat::Q4_0 => amax / 8.0,
        WeightFormat::Q4_1 => (hi - lo) / 15.0 * 0.5,
        _ => amax * 2f32.powi(-8),
    };
    step * 1.001 + amax * 2f32.powi(-9)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// quantise → dequantise stays within the format's rounding bound, block by block.
    #[test]
    fn quant_round_trip_is_bounded(
        fi in 0usize..6,
        vals in proptest::collection::vec(-100.0f32..100.0, 64),
        scale in 1e-3f32..10.0,
    ) {
        let f = [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1,
                 WeightFormat::F16, WeightFormat::BF16, WeightFormat::F32][fi];
        let x: Vec<f32> = vals.iter().map(|v| v * scale).collect();
        let mut q = vec![0u8; f.bytes_for(x.len()).unwrap()];
        quantize_blocks(f, &x, &mut q).unwrap();
        let mut y = vec![0.0; x.len()];
        dequantize_blocks(f, &q, &mut y).unwrap();
        let be = f.block_elems().max(32);
        for (xb, yb) in x.chunks(be).zip(y.chunks(be)) {
            for (a, b) in xb.iter().zip(yb) {
                let bound = if f.is_quantized() { round_trip_bound(f, xb) } else {
                    a.abs() * 2f32.powi(-7)
                };
                prop_assert!((a - b).abs() <= bound, "{f}: {a} -> {b} (bound {bound})");
            }
        }
    }

    /// A run of rows widened in one call ([`WeightMatrix::rows_to_f32`], the decode tile's
    /// path) is, bit for bit, the scalar dequantiser's values of those rows (every format,
    /// every SIMD level the CPU has, any run).
    #[test]
    fn row_runs_widen_as_the_scalar_dequantiser(
        fi in 0usize..8, n in 1usize..14, a in 0usize..14, len in 0usize..14,
        blocks in 1usize..4, seed in 0u64..1000,
    ) {
        let f = WeightFormat::ALL[fi];
        let k = blocks * f.block_elems().max(32);
        let w = random_matrix(f, n, k, seed);
        let a = a.min(n);
        let b = (a + len).min(n);
        let mut got = vec![f32::NAN; (b - a) * k];
        w.rows_to_f32(a..b, &mut got);
        let all = w.to_f32();
        let want = &all[a * k..b * k];
        for (i, (g, e)) in got.iter().zip(want).enumerate() {
            prop_assert_eq!(g.to_bits(), e.to_bits(), "{} rows {}..{}: value {}", f.name(), a, b, i);
        }
    }

    /// Any split of the output columns computes the same values as the whole product.
    #[test]
    fn column_ranges_compose(fi in 0usize..8, m in 1usize..20, split in 0usize..=24, seed in 0u64..1000) {
        let f = WeightFormat::ALL[fi];
        let (n, k) = (24, 256);
        let w = random_matrix(f, n, k, seed);
        let x = rand_vec(&mut rng(seed + 1), m * k, 1.0);
        let mut whole = vec![0.0; m * n];
        w.matmul(&x, m, &mut whole);
        let mut a = vec![0.0; m * split];
        let mut b = vec![0.0; m * (n - split)];
        w.matmul_range(&x, m, &mut a, 0..split);
        w.matmul_range(&x, m, &mut b, split..n);
        let want: Vec<f64> = whole.iter().map(|&v| v as f64).collect();
        let mut got = Vec::with_capacity(m * n);
        for i in 0..m {
            got.extend_from_slice(&a[i * split..(i + 1) * split]);
            got.extend_from_slice(&b[i * (n - split)..(i + 1) * (n - split)]);
        }
        assert_close("split", &got, &want, 1e-5);
    }
}

/// Float payloads are taken as their little-endian bytes at any alignment in the file (a
/// safetensors tensor starts wherever the previous one ended): the same values as decoding
/// each element.
#[test]
fn float_payloads_read_at_any_alignment() {
    let mut r = rng(7);
    let vals = rand_vec(&mut r, 2 * 24, 3.0);
    for (format, width) in [
        (WeightFormat::F32, 4usize),
        (WeightFormat::F16, 2),
        (WeightFormat::BF16, 2),
    ] {
        let le: Vec<u8> = vals
            .iter()
            .flat_map(|&v| match format {
                WeightFormat::F32 => v.to_le_bytes().to_vec(),
                WeightFormat::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            })
            .collect();
        let want: Vec<f32> = le
            .chunks_exact(width)
            .map(|b| match format {
                WeightFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                WeightFormat::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
                _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            })
            .collect();
        for skew in 0..4 {
            let mut buf = vec![0xA5u8; skew];
            buf.extend_from_slice(&le);
            let m = WeightMatrix::from_bytes(format, &buf[skew..], 2, 24).unwrap();
            assert_eq!(m.format(), format);
            assert_eq!(m.to_f32(), want, "{format:?} at offset {skew}");
        }
    }
}
