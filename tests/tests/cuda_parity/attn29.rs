//! Issue 29's attention kernels against the CPU oracle and against the classic kernels: prefill
//! attention on the tensor cores (`attention_prefill_tc.cu`, the default where served;
//! `THAW_CUDA_TC_PREFILL=0` turns it off) op by op, and whole engine steps with it and
//! flash-decoding (`attention_split.cu`, the default; `THAW_CUDA_ATTN_IMPL=classic`) both on,
//! against an engine on the classic kernels, set explicitly. Part of `cuda_parity` (its
//! helpers, its GPU skip rules).
//!
//! Tolerances: DESIGN §9's, as the rest of `cuda_parity`: a 16-bit cache ≤ 1e-2 normwise (the
//! tensor-core kernel also rounds the scaled queries and the softmax weights to the cache's
//! 16-bit type, a few more roundings of ~4e-3 relative each, averaged over the keys); f32 ≤ 1e-4
//! (the tensor-core kernel does not serve an f32 cache: the classic prefill runs). Greedy tokens:
//! identical to the engine on the classic kernels, and for f32 to the CPU engine.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cuda::{AttnImpl, CudaBackend, DType};
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_tests::{cpu_engine, TestModel};

use super::defaults::nine_off;
use super::{
    attention_vs_cpu, cfg, check, classic_kernels, mixed_step, run, shape, step_of, CONFIGS,
};

/// The caches the tensor-core kernel serves, with their tolerance.
const X16: [(DType, f64); 2] = [(DType::Bf16, 1e-2), (DType::F16, 1e-2)];

/// Every served head_dim, windows none / shorter than a key tile / longer than one, the mixed
/// step (prefill chunks under one 64-row tile, one continuing a prefix) and long chunks (several
/// query tiles and key tiles, a chunk continuing a 70-position prefix, a decode row beside
/// them).
#[test]
fn tc_prefill_matches_cpu() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let base = shape().config;
    let mixed = mixed_step(8);
    let long = step_of(&[(70, 150), (0, 130), (40, 1)], 16);
    for head_dim in [32, 64, 128] {
        let mut c = base.clone();
        c.head_dim = head_dim;
        for window in [None, Some(7), Some(100)] {
            c.sliding_window = window;
            for dt in X16 {
                for (name, (step, nb), bs) in [("mixed", &mixed, 8), ("long", &long, 16)] {
                    let what = format!("tc prefill {name} hd={head_dim} window={window:?}");
                    attention_vs_cpu(&c, dt, (step, *nb), bs, &what, |g| {
                        assert!(
                            g.set_tc_prefill(true).unwrap(),
                            "{dt:?} head_dim {head_dim} should be served"
                        );
                    });
                }
            }
        }
    }
    // Shapes it does not serve: the setter is accepted and the classic prefill keeps running
    // (with the variable unset too: a backend's default falls back, see `defaults.rs`).
    let mut g = CudaBackend::new(&base, &cfg(DType::F32)).unwrap();
    assert!(!g.set_tc_prefill(true).unwrap(), "f32 cache");
    assert!(!g.tc_prefill());
    let mut c = base.clone();
    c.head_dim = 96;
    let mut g = CudaBackend::new(&c, &cfg(DType::Bf16)).unwrap();
    assert!(!g.set_tc_prefill(true).unwrap(), "head_dim 96");
}

/// Prefill and three decodes of prompts of 40, 75 and 130 tokens through the engine with both
/// new kernels on (flash-decoding with 4-position chunks, so every decode splits): logits
/// within tolerance of the CPU engine, greedy tokens identical to the engine on the classic
/// kernels (all four switched off explicitly) and, for f32, to the CPU engine's. The nine of
/// `OptInPlan` are off in both (their engines have `opt_in.rs`'s test).
#[test]
fn split_decode_and_tc_prefill_engine_matches_cpu_and_classic() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let vocab = tm.model.config.vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    let prompts: Vec<Vec<u32>> = [40, 75, 130]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(3..vocab)).collect())
        .collect();
    let who = [None; 3];
    let want = run(
        &mut cpu_engine(tm.model.clone(), EngineConfig::default()),
        &who,
        &prompts,
    );
    for (dt, tol) in CONFIGS {
        let mut results = Vec::new();
        for new in [false, true] {
            let mut b = CudaBackend::new(&tm.model.config, &cfg(dt)).unwrap();
            if new {
                // The nine of `OptInPlan` off in both engines: the occupancy decode would
                // replace flash-decoding, and the 16-bit activations would part the two
                // engines' tokens at near ties, not this test's kernels.
                nine_off(&mut b);
                b.set_attn_impl(AttnImpl::Split { min_chunk: 4 }).unwrap();
                let tc = b.set_tc_prefill(true).unwrap();
                assert_eq!(tc, dt != DType::F32, "{dt:?}: tensor-core prefill served");
            } else {
                classic_kernels(&mut b);
            }
            let mut e = Engine::new(b, tm.model.clone(), EngineConfig::default()).unwrap();
            results.push(run(&mut e, &who, &prompts));
        }
        for (i, w) in want.iter().enumerate() {
            let got = &results[1][i];
            let what = format!("engine split+tc seq {i}");
            check(&format!("{what} prefill"), dt, tol, &got.0, &w.0);
            check(&format!("{what} decode"), dt, tol, &got.1, &w.1);
            assert_eq!(
                got.2, results[0][i].2,
                "{dt:?} seq {i}: greedy tokens differ from the classic kernels"
            );
            if dt == DType::F32 {
                assert_eq!(
                    got.2, w.2,
                    "seq {i}: greedy tokens differ from the CPU engine"
                );
            }
        }
        println!("{dt:?}: split decode + tc prefill engine matches over 4 steps");
    }
}
