//! The fused CUDA kernels (issue 29, `THAW_CUDA_FUSED=1`, a default) against their CPU twins
//! and, with the wide norms and the 16-bit activations that would replace them off, against
//! the unfused kernels: residual add + RMSNorm, SwiGLU with the down projection's 16-bit input
//! written beside it, and whole engine steps (same greedy tokens, same logits). Part of
//! `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerances: against the CPU twins as the rest of `cuda_parity`; fused against
//! unfused on the GPU: equal bit for bit (the fused kernels do the same f32 operations in the
//! same order, and the 16-bit copy is the same round-to-nearest-even of the same value).
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cuda::CudaBackend;
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_tests::TestModel;

use super::{cfg, check, rand_vec, CONFIGS};

#[test]
fn fused_add_rms_norm_and_swiglu_match_cpu_and_unfused() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = TestModel::llama(3).model;
    let c = &m.config;
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    for (dt, tol) in CONFIGS {
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        // The wide norms (a default) would run in place of the fused add + RMSNorm, and the
        // residual below is read back as f32 (the 16-bit residual, a default with bf16 weights,
        // is private to the backend): both off, so the fused kernels are what runs.
        g.set_wide(false).unwrap();
        g.set_act16(false).unwrap();
        let rows = 37;
        let d = c.hidden_size;
        let h = rand_vec(&mut rng, rows * d, 2.0);
        let x = rand_vec(&mut rng, rows * d, 2.0);
        let w = rand_vec(&mut rng, d, 1.5);
        // CPU twin.
        let (mut hc, mut oc) = (h.clone(), vec![0.0; rows * d]);
        thaw_kernels::cpu::add_rms_norm(&mut hc, &x, &w, 1e-5, &mut oc);
        let wg = g.upload_vector(w).unwrap();
        let xg = g.upload_f32(&x).unwrap();
        let mut runs = Vec::new();
        for fused in [false, true] {
            g.set_fused(fused).unwrap();
            let mut hg = g.upload_f32(&h).unwrap();
            let mut og = g.alloc(rows * d).unwrap();
            g.add_rms_norm(&mut hg, &xg, &wg, 1e-5, rows, d, &mut og);
            let (hr, or) = (
                g.download_f32(&hg, rows * d).unwrap(),
                g.download_f32(&og, rows * d).unwrap(),
            );
            check(
                &format!("add_rms_norm residual fused={fused}"),
                dt,
                1e-6,
                &hr,
                &hc,
            );
            check(
                &format!("add_rms_norm out fused={fused}"),
                dt,
                tol,
                &or,
                &oc,
            );
            runs.push((hr, or));
        }
        assert_eq!(
            runs[0], runs[1],
            "{dt:?}: fused add_rms_norm differs from add + rms_norm"
        );

        // SwiGLU, then the down projection over its output: with the fused kernels the GEMM
        // reads the 16-bit copy SwiGLU wrote; the result must not change.
        let inter = c.intermediate_size;
        let gate = rand_vec(&mut rng, rows * inter, 3.0);
        let up = rand_vec(&mut rng, rows * inter, 2.0);
        let mut sc = vec![0.0; rows * inter];
        thaw_kernels::cpu::swiglu(&gate, &up, &mut sc);
        let down = g
            .upload_linear(rand_vec(&mut rng, d * inter, 0.05), d, inter, None)
            .unwrap();
        let (gg, ug) = (g.upload_f32(&gate).unwrap(), g.upload_f32(&up).unwrap());
        let mut outs = Vec::new();
        for fused in [false, true] {
            g.set_fused(fused).unwrap();
            let mut act = g.alloc(rows * inter).unwrap();
            let mut y = g.alloc(rows * d).unwrap();
            g.swiglu(&gg, &ug, rows * inter, &mut act);
            g.linear(&act, &down, rows, &mut y);
            let a = g.download_f32(&act, rows * inter).unwrap();
            check(&format!("swiglu fused={fused}"), dt, 1e-5, &a, &sc);
            outs.push((a, g.download_f32(&y, rows * d).unwrap()));
        }
        assert_eq!(
            outs[0], outs[1],
            "{dt:?}: SwiGLU + down differ with the fused kernels"
        );
        g.check().unwrap();
    }
}

/// Whole steps: the fused engine's greedy tokens and logits equal the unfused engine's
/// (the same prefill + decode run as `cuda_parity`'s engine oracle).
#[test]
fn fused_engine_steps_equal_unfused() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let vocab = tm.model.config.vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| (0..4 + 9 * i).map(|_| rng.random_range(3..vocab)).collect())
        .collect();
    for (dt, _) in CONFIGS {
        let mut results = Vec::new();
        for fused in [false, true] {
            let mut b = CudaBackend::new(&tm.model.config, &cfg(dt)).unwrap();
            // The nine of `OptInPlan` off: the wide norms and the 16-bit activations (defaults)
            // would run in place of most fused kernels, leaving little of them to compare.
            super::defaults::nine_off(&mut b);
            b.set_fused(fused).unwrap();
            let mut e = Engine::new(b, tm.model.clone(), EngineConfig::default()).unwrap();
            // Prefill, then decodes: step 0 and 1 logits, 4 greedy tokens per sequence.
            results.push(super::run(&mut e, &[None; 3], &prompts));
        }
        assert_eq!(
            results[0], results[1],
            "{dt:?}: fused and unfused engines differ"
        );
        println!("{dt:?}: fused engine equals unfused over 4 steps");
    }
}
