//! CUDA-graph decode's engine side on the CPU (issue 29): with graph emulation on, the CPU
//! backend takes part in the graph protocol but runs every graph step eagerly on its padded
//! shape, so the engine's choice of bucket, its padding rows (scratch KV block, no adapter,
//! logits dropped) and its bookkeeping are checked here against plain eager steps; capture and
//! replay themselves are `cuda_parity`'s (GPU).
//!
//! Tolerance: padded and unpadded steps run the same kernels over the same rows, but the CPU
//! backend splits a step's work by its row count (threads, fused few-row LoRA), which may change
//! f32 summation order: logits within 1e-5 relative (normwise), greedy tokens identical.
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, GraphStats, HostModel, PlanItem, StepPlan};
use thaw_runtime::ids::SeqId;
use thaw_tests::graphs::{decode_batch, prompts, Decoded};
use thaw_tests::{rel_err, TestModel};

fn engine(model: &HostModel, adapters: &[Arc<LoraAdapter>], graphs: bool) -> Engine<CpuBackend> {
    thaw_tests::graphs::emulated_engine(model, adapters, graphs)
}

fn who(batch: usize) -> Vec<Option<u32>> {
    (0..batch)
        .map(|i| match i % 3 {
            0 => None,
            1 => Some(0),
            _ => Some(1),
        })
        .collect()
}

#[test]
fn padded_graph_steps_give_the_eager_tokens() {
    let tm = TestModel::llama(7);
    let adapters = [
        tm.adapter(8, &["q", "v"], 70),
        tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 71),
    ];
    let vocab = tm.model.config.vocab_size;
    let steps = 4;
    // Buckets 1, 2, 4 (3 padded), 8 (5 padded), 8; 13 is above --cuda-graph-max-bs 8: eager.
    let batches = [1, 2, 3, 5, 8, 13];
    let mut runs: Vec<Vec<Vec<Decoded>>> = Vec::new();
    let mut stats = None;
    for graphs in [false, true] {
        let mut e = engine(&tm.model, &adapters, graphs);
        let mut first = 0;
        let mut per_batch = Vec::new();
        for &b in &batches {
            let p = prompts(b, vocab, b as u64);
            per_batch.push(decode_batch(&mut e, first, &who(b), &p, steps));
            first += b as u64;
        }
        runs.push(per_batch);
        stats = e.graph_stats().cloned();
        assert_eq!(stats.is_some(), graphs);
    }
    for (k, &b) in batches.iter().enumerate() {
        assert_eq!((runs[0][k].len(), runs[1][k].len()), (b, b));
        for (i, (eager, graph)) in runs[0][k].iter().zip(&runs[1][k]).enumerate() {
            assert_eq!(
                graph.tokens, eager.tokens,
                "batch {b}, seq {i}: padded graph steps changed the greedy tokens"
            );
            let e = rel_err(&graph.logits, &eager.logits);
            assert!(e <= 1e-5, "batch {b}, seq {i}: logits rel err {e:e}");
        }
    }
    // Every decode step of batches up to 8 went through the graph protocol; the prefills and
    // the batch of 13 ran eagerly.
    let graph_steps = (batches.len() - 1) as u64 * steps as u64;
    assert_eq!(
        stats.unwrap(),
        GraphStats {
            warmups: graph_steps,
            eager: batches.len() as u64 + steps as u64,
            ..Default::default()
        }
    );
}

#[test]
fn the_padding_block_is_held_while_graphs_are_on_and_mixed_steps_run_eagerly() {
    let tm = TestModel::llama(8);
    let mut e = engine(&tm.model, &[], true);
    let vocab = tm.model.config.vocab_size;
    let p = prompts(3, vocab, 5);
    for (i, p) in p.iter().enumerate() {
        e.add_sequence(
            SeqId(i as u64),
            thaw_runtime::engine::SequenceParams {
                prompt: p.clone(),
                max_new_tokens: 8,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let plan = |n: &[usize]| StepPlan {
        items: n
            .iter()
            .enumerate()
            .map(|(i, &num_tokens)| PlanItem {
                seq: SeqId(i as u64),
                num_tokens,
            })
            .collect(),
        return_logits: false,
    };
    // Sequences 0 and 1 prefill; then 0 and 1 decode while 2 prefills (mixed: eager); then
    // all three decode (a graph of 4).
    e.step(&plan(&[p[0].len(), p[1].len()])).unwrap();
    let used_before = e.kv_usage().used_blocks;
    e.step(&plan(&[1, 1, p[2].len()])).unwrap();
    assert_eq!(e.graph_stats().unwrap().warmups, 0, "a mixed step is eager");
    let used_mixed = e.kv_usage().used_blocks;
    e.step(&plan(&[1, 1, 1])).unwrap();
    assert_eq!(e.graph_stats().unwrap().warmups, 1);
    // The graph step took one block more than its sequences: the padding rows' scratch block.
    assert_eq!(e.kv_usage().used_blocks, used_mixed + 1);
    assert!(used_mixed >= used_before);
    assert!(!e.set_cuda_graphs(false));
    assert_eq!(e.graph_stats(), None);
    assert_eq!(
        e.kv_usage().used_blocks,
        used_mixed,
        "switching graphs off frees it"
    );
    assert!(
        e.set_cuda_graphs(true),
        "the emulating CPU backend takes graphs again"
    );
}
