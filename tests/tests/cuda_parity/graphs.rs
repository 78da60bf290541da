//! CUDA graphs of decode steps (issue 29) against eager steps: the same requests through a CUDA
//! engine with graphs on and one with them off give identical greedy tokens, at batch sizes
//! that fill a captured size (1, 2, 8) and that are padded up to one (3 → 4, 5 → 8, 13 → 16),
//! one above the largest captured size (eager in both), with no adapter, one rank-8 adapter on
//! q,v and a rank-32 adapter on every projection in the same batch. Part of `cuda_parity` (its
//! helpers, its GPU skip rules).
//!
//! Both engines use BGMV for LoRA (a graph always does: its launch shape cannot depend on the
//! step's segments), so the only differences are the padded rows, which no real row reads, and
//! the GEMMs' row count, which may pick another cuBLAS kernel (another f32 summation order):
//! logits within the suite's tolerance (f32 1e-4, bf16 1e-2), greedy tokens identical.
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cuda::{CudaBackend, DType};
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{Engine, EngineConfig, GraphStats, HostModel};
use thaw_runtime::ids::AdapterId;
use thaw_tests::graphs::{decode_batch, prompts, Decoded};
use thaw_tests::TestModel;

use super::{cfg, check, CONFIGS};

/// An engine on the default kernels but the 16-bit activations: their plan reads the step's
/// adapters in eager steps and the graph key's rank class in a graph (`act16_plan`), so a
/// batch with a q/v adapter rounds the MLP to 16 bits eagerly and keeps it f32 in its graph —
/// by design, but not the same arithmetic, which this test's identical tokens need. Their
/// graphs are `act16.rs`'s, `attn16.rs`'s and `residual16.rs`'s tests (near ties allowed).
fn engine(
    model: &HostModel,
    dt: DType,
    adapters: &[Arc<LoraAdapter>],
    graphs: bool,
) -> Engine<CudaBackend> {
    engine_with(model, dt, adapters, graphs, |b| b.set_act16(false).unwrap())
}

/// An engine with `setup` run on its backend before the model loads (tests switch kernels
/// there: grouped products need their weights placed at load).
pub(super) fn engine_with(
    model: &HostModel,
    dt: DType,
    adapters: &[Arc<LoraAdapter>],
    graphs: bool,
    setup: impl FnOnce(&mut CudaBackend),
) -> Engine<CudaBackend> {
    let mut b = CudaBackend::new(&model.config, &cfg(dt)).expect("CUDA backend");
    setup(&mut b);
    let ecfg = EngineConfig {
        cuda_graphs: graphs,
        cuda_graph_max_bs: Some(16),
        max_batch_seqs: 32,
        lora_kernel: LoraKernel::Bgmv,
        ..Default::default()
    };
    let mut e = Engine::new(b, model.clone(), ecfg).unwrap();
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone()).unwrap();
    }
    e.wait_adapters_landed(std::time::Duration::from_secs(60))
        .unwrap();
    e
}

#[test]
fn graph_captured_decode_gives_the_eager_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let adapters = [
        tm.adapter(8, &["q", "v"], 80),
        tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 81),
    ];
    let vocab = tm.model.config.vocab_size;
    let steps = 6;
    let batches = [1, 2, 3, 5, 8, 13, 20];
    let who = |b: usize| -> Vec<Option<u32>> {
        (0..b).map(|i| [None, Some(0), Some(1)][i % 3]).collect()
    };
    for (dt, tol) in CONFIGS {
        let mut runs: Vec<Vec<Vec<Decoded>>> = Vec::new();
        let mut stats = None;
        for graphs in [false, true] {
            let mut e = engine(&tm.model, dt, &adapters, graphs);
            let mut first = 0;
            let mut per_batch = Vec::new();
            for &b in &batches {
                let p = prompts(b, vocab, 100 + b as u64);
                per_batch.push(decode_batch(&mut e, first, &who(b), &p, steps));
                first += b as u64;
            }
            // The same batches again: now every graph is captured and replays from its first step.
            for &b in &batches {
                let p = prompts(b, vocab, 100 + b as u64);
                per_batch.push(decode_batch(&mut e, first, &who(b), &p, steps));
                first += b as u64;
            }
            stats = e.graph_stats().cloned();
            runs.push(per_batch);
        }
        for (k, &b) in batches.iter().chain(&batches).enumerate() {
            assert_eq!((runs[0][k].len(), runs[1][k].len()), (b, b));
            for (i, (eager, graph)) in runs[0][k].iter().zip(&runs[1][k]).enumerate() {
                check(
                    &format!("graph vs eager b{b} s{i}"),
                    dt,
                    tol,
                    &graph.logits,
                    &eager.logits,
                );
                assert_eq!(
                    graph.tokens, eager.tokens,
                    "{dt:?} batch {b}, seq {i}: graph-captured and eager greedy tokens differ"
                );
            }
        }
        let s: GraphStats = stats.expect("graphs are on");
        println!("{dt:?}: {s:?}");
        // Batches up to 16 run as graphs (20 is above --cuda-graph-max-bs 16). Keys: bucket 1
        // (no adapter), 2 (rank 8), 4, 8, 16 (rank 32; 5 and 8 share bucket 8): 5 captures,
        // each after one warm-up; every other decode step of them replays.
        let graph_steps = 2 * 6 * steps as u64;
        assert_eq!(s.failed, 0, "no capture failed");
        assert_eq!((s.warmups, s.captures), (5, 5));
        assert_eq!(s.replays, graph_steps - 10);
        assert_eq!(s.eager, 2 * batches.len() as u64 + 2 * steps as u64);
    }
}
