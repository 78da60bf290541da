//! The one-row streaming order (`stream.rs`) against the interleaved order it replaces, bit
//! for bit (no tolerance: each output keeps its own accumulator and order of operations), and
//! the float rows against the AVX2 row dots ([`dot_rows_f32`] and its 16-bit siblings), also
//! bit for bit. Shapes cover whole and partial tiles and groups (`n` not a multiple of 4 or
//! 8) and rows with 8-wide and scalar tails (`k` not a multiple of 16).
use std::sync::Mutex;

use half::{bf16, f16};
use proptest::prelude::*;

use super::tests_vnni::{activations, weights};
use super::*;
use crate::cpu::testutil::{rand_vec, rng};

/// The switch is process-wide: the tests here flip it one at a time.
static SWITCH: Mutex<()> = Mutex::new(());

/// `f()` with the streaming order on, then off (the setting restored after).
fn both<T>(mut f: impl FnMut() -> T) -> (T, T) {
    let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let was = set_row_stream(true);
    let on = f();
    set_row_stream(false);
    let off = f();
    set_row_stream(was);
    (on, off)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One activation row × `n` weight rows of `k` in f32, f16 and bf16.
fn check_float(k: usize, n: usize, seed: u64) {
    let x = rand_vec(&mut rng(seed ^ 0x5eed), k, 1.0);
    let w = rand_vec(&mut rng(seed), n * k, 1.0);
    let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let cases: [(&str, FloatWeights<'_>); 3] = [
        ("f32", FloatWeights::F32(&w)),
        ("f16", FloatWeights::F16(&h)),
        ("bf16", FloatWeights::BF16(&b)),
    ];
    for (name, fw) in cases {
        let run = || {
            let mut out = vec![f32::NAN; n];
            gemm_nt(&x, fw, (1, k, n), &mut out, n).then_some(out)
        };
        let (on, off) = both(run);
        let (Some(on), Some(off)) = (on, off) else {
            eprintln!("no AVX-512F here: {name} streaming order not checked");
            return;
        };
        assert_eq!(bits(&on), bits(&off), "{name} k={k} n={n}: stream vs tiles");
        let mut want = vec![0.0f32; 1];
        for (j, got) in on.iter().enumerate() {
            let row = j * k..(j + 1) * k;
            match fw {
                FloatWeights::F32(w) => dot_rows_f32(&x, &w[row], &mut want),
                FloatWeights::F16(w) => dot_rows_f16(&x, &w[row], &mut want),
                FloatWeights::BF16(w) => dot_rows_bf16(&x, &w[row], &mut want),
            }
            assert_eq!(
                got.to_bits(),
                want[0].to_bits(),
                "{name} k={k} row {j}: vs row dot"
            );
        }
    }
}

/// One activation row × `n` quantised weight rows of `k` on the VNNI row kernel, with and
/// without the prefetch-ahead groups.
fn check_vnni(f: WeightFormat, k: usize, n: usize, seed: u64) {
    let (w, x) = (weights(f, n, k, seed), activations(1, k, seed ^ 0x5eed));
    let run = || {
        let mut out = vec![f32::NAN; n];
        gemm_nt_vnni(f, &w, &x, (1, k, n), &mut out, n).then_some(out)
    };
    match both(run) {
        (Some(on), Some(off)) => assert_eq!(bits(&on), bits(&off), "{f} k={k} n={n}"),
        _ => eprintln!("no AVX512-VNNI here: {f} streaming order not checked"),
    }
}

#[test]
fn smollm2_shapes_stream_bit_identically() {
    for (k, n) in [(576, 576), (576, 192), (1536, 576), (576, 1536)] {
        check_float(k, n, k as u64 ^ n as u64);
        check_vnni(WeightFormat::Q8_0, k, n, 7);
    }
    check_vnni(WeightFormat::Q4_K, 512, 77, 8);
    check_vnni(WeightFormat::Q4_1, 576, 77, 9);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn float_rows_stream_bit_identically(k in 1usize..300, n in 1usize..21, seed in any::<u64>()) {
        check_float(k, n, seed);
    }

    #[test]
    fn vnni_rows_stream_bit_identically(blocks in 1usize..24, n in 1usize..42, seed in any::<u64>()) {
        check_vnni(WeightFormat::Q8_0, 32 * blocks, n, seed);
        check_vnni(WeightFormat::Q4_1, 32 * blocks, n, seed);
        check_vnni(WeightFormat::Q4_K, 256 * (1 + blocks % 3), n, seed);
    }
}

/// Decode batches over float weights with the batch prefetch (`THAW_BATCH_PREFETCH`) on and
/// off, bit for bit (a hint: no tolerance), at SmolLM2-135M's shapes with 16 rows and at
/// partial tiles (rows and weight rows not multiples of 4, `k` with 8-wide and scalar tails).
#[test]
fn batch_prefetch_changes_no_bit() {
    for (m, k, n) in [
        (16, 576, 576),
        (16, 576, 1536),
        (16, 1536, 576),
        (16, 576, 49152),
        (5, 100, 7),
        (2, 24, 9),
        (7, 13, 3),
    ] {
        let x = rand_vec(&mut rng(k as u64 ^ 0xba7c), m * k, 1.0);
        let w = rand_vec(&mut rng(n as u64), n * k, 1.0);
        let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let cases: [(&str, FloatWeights<'_>); 3] = [
            ("f32", FloatWeights::F32(&w)),
            ("f16", FloatWeights::F16(&h)),
            ("bf16", FloatWeights::BF16(&b)),
        ];
        for (name, fw) in cases {
            let run = |on: bool| {
                let was = set_batch_prefetch(on);
                let mut out = vec![f32::NAN; m * n];
                let done = gemm_nt(&x, fw, (m, k, n), &mut out, n);
                set_batch_prefetch(was);
                done.then_some(out)
            };
            let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
            let (Some(on), Some(off)) = (run(true), run(false)) else {
                eprintln!("no AVX-512F here: {name} batch prefetch not checked");
                return;
            };
            assert!(on.iter().all(|v| v.is_finite()), "{name} {m}x{k}x{n}");
            assert_eq!(
                bits(&on),
                bits(&off),
                "{name} {m}x{k}x{n}: prefetch on vs off"
            );
        }
    }
}

/// The VNNI panel kernel's decode batches (4+ rows) with the batch prefetch spread over the
/// tiles (on) and issued per tile (off), bit for bit, for Q8_0, Q4_1 and Q4_K weights: at
/// SmolLM2-135M's shapes with 16 rows, and at row counts of 4, 9 and 16 over partial panels.
#[test]
fn vnni_batch_prefetch_changes_no_bit() {
    use super::tests_vnni::vnni;
    let q8 = [WeightFormat::Q8_0, WeightFormat::Q4_1];
    let mut cases: Vec<(WeightFormat, (usize, usize, usize))> = Vec::new();
    for f in q8 {
        for s in [
            (16, 576, 576),
            (16, 576, 1536),
            (16, 1536, 576),
            (16, 576, 49152),
        ] {
            cases.push((f, s));
        }
        cases.push((f, (9, 96, 53)));
    }
    for s in [(16, 512, 1536), (4, 256, 100), (9, 768, 49)] {
        cases.push((WeightFormat::Q4_K, s));
    }
    for (f, (m, k, n)) in cases {
        let w = weights(f, n, k, n as u64);
        let x = activations(m, k, k as u64);
        let run = |on: bool| {
            let was = set_batch_prefetch(on);
            let mut out = vec![f32::NAN; m * n];
            let done = vnni(f, &w, &x, (m, k, n), &mut out, n);
            set_batch_prefetch(was);
            done.then_some(out)
        };
        let _g = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(on), Some(off)) = (run(true), run(false)) else {
            eprintln!("no AVX512-VNNI here: batch prefetch not checked");
            return;
        };
        assert!(on.iter().all(|v| v.is_finite()), "{f:?} {m}x{k}x{n}");
        assert_eq!(
            bits(&on),
            bits(&off),
            "{f:?} {m}x{k}x{n}: prefetch on vs off"
        );
    }
}
