//! The cuBLASLt products (a default, off: `THAW_CUDA_CUBLASLT=0`; `lt.rs`) against `cublasGemmEx` and
//! the CPU oracle, op by op for bf16 and f16 weights, rows {1, 3, 8, 17, 128, 300}, with and
//! without a bias, f32 and 16-bit outputs; whole engines with it on against off (Llama, and
//! Qwen2 whose q/k/v biases take the bias epilogue); and a steady decode step with it on
//! allocating nothing. Part of `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerances (normwise relative, `rel_err`, unless said):
//! - f32 output against the CPU oracle fed the same operands (weights, activations and bias
//!   rounded to the weight dtype on the host, as the upload and the cast kernel round them; so
//!   both multiply identical values, whose products are exact in f32): 1e-5 — f32 sums in
//!   another order (~√d_in ulp), as the GEMV's test;
//! - f32 output against `cublasGemmEx` (+ `add_bias`): 1e-5 — the same operands, another
//!   algorithm's summation order;
//! - 16-bit output against the same oracle, element by element: one rounding of each output to
//!   the weight dtype, at most half an ulp (bf16 2^-9, f16 2^-12 relative), plus the f32
//!   summation's ~1e-6 of the row scale: |got − want| ≤ 2^-8 |want| + 1e-5 max|want| for bf16,
//!   2^-10 |want| + 1e-5 max|want| for f16 (a full ulp: the f32 result the rounding starts from
//!   may sit on the other side of a midpoint than the oracle's); with a bias in the epilogue
//!   twice that: on an H200 (2026-11-27) cuBLASLt's BIAS epilogue into a bf16 D gave
//!   -0.15234375 where the oracle is -0.15323469 (1001 → 77, 8 rows), one bf16 step off, as if
//!   the product were rounded before the bias is added and the sum rounded again;
//! - engines: greedy tokens identical but at a near tie (`gemv.rs`' `check_off_on`; the same
//!   operands in another summation order can move a logit by ~1e-6), logits within the suite's
//!   tolerance (f32 1e-4, 16-bit 1e-2).
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{CudaBackend, DType};
use thaw_runtime::backend::lt_plan::row_bucket;
use thaw_runtime::backend::Backend;
use thaw_server::gen::{ArchOptions, GenArch};
use thaw_tests::{test_preset, TestModel};

use super::gemv::{check_off_on, off_on_runs, rounded};
use super::host_overhead::decode_counts_with;
use super::{cfg, check, rand_vec, shape};

/// (d_in, d_out): Llama-7B's q/k/v/o, a small model's pair, odd widths (cuBLASLt's heuristic
/// must find an algorithm for unaligned leading dimensions too).
const SHAPES: [(usize, usize); 4] = [(4096, 4096), (576, 1536), (1536, 576), (1001, 77)];

const ROWS: [usize; 6] = [1, 3, 8, 17, 128, 300];

/// The test preset as a Qwen2 (q/k/v biases) with weights from `seed`.
fn qwen2(seed: u64) -> TestModel {
    let arch = ArchOptions {
        arch: GenArch::Qwen2,
        ..Default::default()
    };
    TestModel::with_arch(&test_preset(), seed, arch)
}

/// The 16-bit output's element-wise bound (module docs), for `roundings` roundings to the
/// 16-bit type (2 with a bias epilogue).
fn check_x16(what: &str, dt: DType, roundings: f32, got: &[f32], want: &[f32]) {
    let ulp = if dt == DType::F16 {
        2f32.powi(-10)
    } else {
        2f32.powi(-8)
    };
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let bound = roundings * ulp * w.abs() + 1e-5 * scale;
        assert!(
            (g - w).abs() <= bound,
            "{dt:?} {what}: element {i} is {g}, the oracle {w} (bound {bound:e})"
        );
        worst = worst.max((g - w).abs() / bound.max(f32::MIN_POSITIVE));
    }
    println!("{what:<36} {dt:?}: worst error {worst:.2} of its bound");
}

#[test]
fn lt_matches_gemm_ex_and_the_cpu_oracle() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let mut rng = ChaCha8Rng::seed_from_u64(2931);
    let max_rows = *ROWS.iter().max().unwrap();
    for dt in [DType::Bf16, DType::F16] {
        let mut cpu = CpuBackend::new(c);
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        g.set_gemv(false).unwrap();
        // On at upload: the biased weights get the f32 bias the epilogue reads.
        g.set_cublaslt(true).unwrap();
        assert!(g.cublaslt() && g.cublaslt_workspace() >= 4 << 20);
        for (d_in, d_out) in SHAPES {
            let scale = 2.0 / (d_in as f32).sqrt();
            let w = rounded(&rand_vec(&mut rng, d_out * d_in, scale), dt);
            let bias = rounded(&rand_vec(&mut rng, d_out, 0.5), dt);
            let x = rand_vec(&mut rng, max_rows * d_in, 1.0);
            let xr = rounded(&x, dt);
            // One copy of x per run: a linear right after one over the same input reads that
            // one's 16-bit cast (the backend's X16Tag), so each run gets its own input and
            // casts it, and the launch counts below compare like with like.
            let xs = [g.upload_f32(&x).unwrap(), g.upload_f32(&x).unwrap()];
            for with_bias in [false, true] {
                let b = with_bias.then(|| bias.clone());
                let lc = cpu
                    .upload_linear(w.clone(), d_out, d_in, b.clone())
                    .unwrap();
                let lg = g.upload_linear(w.clone(), d_out, d_in, b).unwrap();
                let mut want = vec![0.0; max_rows * d_out];
                cpu.linear(&xr, &lc, max_rows, &mut want);
                for rows in ROWS {
                    let want = &want[..rows * d_out];
                    let what = format!("lt {d_in}->{d_out} rows {rows} bias {with_bias}");
                    // GemmEx (+ add_bias), then cuBLASLt, f32 out.
                    let mut runs = Vec::new();
                    for (on, xg) in [false, true].into_iter().zip(&xs) {
                        if g.cublaslt() != on {
                            g.set_cublaslt(on).unwrap();
                        }
                        let mut y = g.alloc(rows * d_out).unwrap();
                        let before = g.device_counts();
                        g.linear(xg, &lg, rows, &mut y);
                        let n = g.device_counts().since(&before);
                        // The cast, then one product; add_bias only on GemmEx.
                        let want_launches = 1 + u64::from(with_bias && !on);
                        assert_eq!(
                            (n.gemms, n.lt_products, n.bias_epilogues, n.launches),
                            (1, u64::from(on), u64::from(on && with_bias), want_launches),
                            "{dt:?} {what} cuBLASLt {on}: {n:?}"
                        );
                        runs.push(g.download_f32(&y, rows * d_out).unwrap());
                    }
                    check(&format!("{what} vs gemm_ex"), dt, 1e-5, &runs[1], &runs[0]);
                    check(&format!("{what} vs cpu"), dt, 1e-5, &runs[1], want);
                    check(&format!("{what} gemm_ex vs cpu"), dt, 1e-5, &runs[0], want);
                    // 16-bit D (bias in D's dtype: the stored one).
                    let mut y16 = g.alloc_x16(rows * d_out).unwrap();
                    g.lt_linear_x16(&xs[0], &lg, rows, &mut y16).unwrap();
                    let got = g.download_x16(&y16, rows * d_out).unwrap();
                    let roundings = if with_bias { 2.0 } else { 1.0 };
                    check_x16(&format!("{what} 16-bit out"), dt, roundings, &got, want);
                }
            }
        }
        g.check().unwrap();
    }
}

/// Rows of one bucket share one descriptor set (one heuristic query); another bucket, another
/// epilogue or another output dtype makes its own; turning the switch off and on drops them.
#[test]
fn lt_caches_descriptors_per_row_bucket() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let mut rng = ChaCha8Rng::seed_from_u64(2932);
    let dt = DType::Bf16;
    let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
    g.set_gemv(false).unwrap();
    g.set_cublaslt(true).unwrap();
    let (d_in, d_out) = (512, 256);
    let lg = g
        .upload_linear(rand_vec(&mut rng, d_out * d_in, 0.05), d_out, d_in, None)
        .unwrap();
    let lb = g
        .upload_linear(
            rand_vec(&mut rng, d_out * d_in, 0.05),
            d_out,
            d_in,
            Some(rand_vec(&mut rng, d_out, 0.5)),
        )
        .unwrap();
    let xg = g.upload_f32(&rand_vec(&mut rng, 64 * d_in, 1.0)).unwrap();
    let mut y = g.alloc(64 * d_out).unwrap();
    assert_eq!(g.cublaslt_cached(), 0);
    let mut seen = std::collections::HashSet::new();
    for rows in [3, 4, 3, 5, 8, 1, 2, 33, 64] {
        g.linear(&xg, &lg, rows, &mut y);
        seen.insert(row_bucket(rows));
        assert_eq!(g.cublaslt_cached(), seen.len(), "rows {rows}");
    }
    let n = seen.len();
    g.linear(&xg, &lb, 3, &mut y);
    assert_eq!(
        g.cublaslt_cached(),
        n + 1,
        "the bias epilogue is its own key"
    );
    let mut y16 = g.alloc_x16(4 * d_out).unwrap();
    g.lt_linear_x16(&xg, &lg, 4, &mut y16).unwrap();
    assert_eq!(g.cublaslt_cached(), n + 2, "a 16-bit D is its own key");
    g.set_cublaslt(false).unwrap();
    assert_eq!(g.cublaslt_cached(), 0);
    assert!(
        g.lt_linear_x16(&xg, &lg, 4, &mut y16).is_err(),
        "a 16-bit D needs cuBLASLt on"
    );
    g.check().unwrap();
}

/// Whole engines with cuBLASLt off and on (eager, and on with CUDA graphs) on the test Llama
/// (f32 and bf16 weights) and on a Qwen2 (q/k/v biases: the bias epilogue; bf16 and f16), with
/// and without adapters: the same greedy tokens.
#[test]
fn engines_with_cublaslt_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let llama = TestModel::llama(6);
    let qwen = qwen2(7);
    assert!(qwen.model.config.attention_bias);
    let who = |b: usize| -> Vec<Option<u32>> { (0..b).map(|i| [None, Some(0)][i % 2]).collect() };
    let f32 = (DType::F32, 1e-4);
    let (bf16, f16) = ((DType::Bf16, 1e-2), (DType::F16, 1e-2));
    for (name, tm, dtypes) in [
        ("llama", &llama, [f32, bf16]),
        ("qwen2", &qwen, [bf16, f16]),
    ] {
        let adapters = [tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 85)];
        let vocab = tm.model.config.vocab_size;
        for (dt, tol) in dtypes {
            let runs = off_on_runs(
                &tm.model,
                dt,
                &adapters,
                &[1, 3, 8, 20],
                who,
                6,
                310,
                |b, on| {
                    b.set_gemv(false).unwrap();
                    b.set_cublaslt(on).unwrap();
                },
            );
            check_off_on(&format!("cublaslt {name}"), dt, tol, &runs, vocab);
        }
    }
}

/// A steady decode step with cuBLASLt on allocates nothing (the workspace and descriptors are
/// made before), runs every product through it (one per projection and the LM head), and on
/// Qwen2 adds the q/k/v biases in the epilogue: 3 `add_bias` launches a layer fewer.
#[test]
fn steady_decode_with_cublaslt_allocates_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let qwen = qwen2(8);
    for (name, tm) in [("llama", &TestModel::llama(6)), ("qwen2", &qwen)] {
        let layers = tm.model.config.num_layers as u64;
        let biased = if tm.model.config.attention_bias { 3 } else { 0 };
        for dt in [DType::F32, DType::Bf16] {
            let counts = |on: bool| {
                decode_counts_with(tm, dt, 3, |b| {
                    b.set_gemv(false).unwrap();
                    b.set_cublaslt(on).unwrap();
                })
            };
            let (off, on) = (counts(false)[0], counts(true));
            for (i, c) in on.iter().enumerate() {
                assert_eq!(c, &on[0], "{name} {dt:?}: step {i} differs from the first");
            }
            let c = on[0];
            println!("{name} {dt:?} cuBLASLt on: {c:?}");
            assert_eq!(
                (c.allocs, c.alloc_bytes),
                (0, 0),
                "{name} {dt:?}: a steady decode step with cuBLASLt allocated device memory"
            );
            assert_eq!(c.gemms, 7 * layers + 1, "{name} {dt:?}");
            assert_eq!(
                c.lt_products, c.gemms,
                "{name} {dt:?}: every product via cuBLASLt"
            );
            assert_eq!(c.bias_epilogues, biased * layers, "{name} {dt:?}");
            assert_eq!(
                off.launches - c.launches,
                biased * layers,
                "{name} {dt:?}: the epilogue replaces each add_bias launch"
            );
            assert_eq!((off.lt_products, off.bias_epilogues), (0, 0));
        }
    }
}
