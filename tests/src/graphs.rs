//! The decode driver the CUDA-graph tests share (`tests/tests/graph_padding.rs` on the CPU,
//! `cuda_parity/graphs.rs` on the GPU): the same requests through an engine with graphs on and
//! one with graphs off must give the same greedy tokens.
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;

/// What one sequence of [`decode_batch`] produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decoded {
    /// Greedy tokens: the prefill's, then one per decode step.
    pub tokens: Vec<u32>,
    /// Logits of every decode step, concatenated.
    pub logits: Vec<f32>,
}

/// Sequences `first_id..` with `prompts` (sequence `i` on adapter `who[i]`): one step that
/// prefills them all (eager: many rows per sequence), then `steps` decode steps of the whole
/// batch (graph-captured where the engine has graphs on). Greedy, EOS ignored; the sequences
/// finish with the last step.
pub fn decode_batch<B: Backend>(
    e: &mut Engine<B>,
    first_id: u64,
    who: &[Option<u32>],
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Decoded> {
    let ids: Vec<SeqId> = (0..who.len() as u64).map(|i| SeqId(first_id + i)).collect();
    for ((&id, a), p) in ids.iter().zip(who).zip(prompts) {
        e.add_sequence(
            id,
            SequenceParams {
                prompt: p.clone(),
                adapter: a.map(AdapterId),
                sampling: SamplingParams::greedy(),
                max_new_tokens: steps + 1,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .expect("the sequence is admitted");
    }
    let mut out = vec![Decoded::default(); who.len()];
    for s in 0..=steps {
        let plan = StepPlan {
            items: ids
                .iter()
                .zip(prompts)
                .map(|(&seq, p)| PlanItem {
                    seq,
                    num_tokens: if s == 0 { p.len() } else { 1 },
                })
                .collect(),
            return_logits: true,
        };
        let step = e.step(&plan).expect("a batch step");
        assert_eq!(step.len(), who.len(), "every sequence samples each step");
        for o in step {
            let d = &mut out[(o.seq.0 - first_id) as usize];
            d.tokens.push(o.token.id);
            if s > 0 {
                d.logits.extend(o.logits.expect("return_logits"));
            }
        }
    }
    out
}

/// `n` prompts of 3 to 13 tokens from the vocabulary (ids 3.. skip the special tokens),
/// deterministic in `seed`.
pub fn prompts(n: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let len = 3 + (next() % 11) as usize;
            (0..len)
                .map(|_| 3 + (next() % (vocab as u64 - 3)) as u32)
                .collect()
        })
        .collect()
}

/// A CPU engine over `model` with `adapters` registered as ids 0, 1, …; with `graphs`, CUDA
/// graphs on (buckets up to 8) and the backend emulating them, so a decode step is padded to
/// its bucket as on a GPU.
pub fn emulated_engine(
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    graphs: bool,
) -> Engine<CpuBackend> {
    emulated_engine_on(CpuBackend::new(&model.config), model, adapters, graphs)
}

/// [`emulated_engine`] over a backend the caller set up (e.g. with the 16-bit activations'
/// emulation on).
pub fn emulated_engine_on(
    mut b: CpuBackend,
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    graphs: bool,
) -> Engine<CpuBackend> {
    b.set_graph_emulation(graphs);
    let cfg = EngineConfig {
        cuda_graphs: graphs,
        cuda_graph_max_bs: Some(8),
        max_batch_seqs: 16,
        ..Default::default()
    };
    let mut e = Engine::new(b, model.clone(), cfg).unwrap();
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone()).unwrap();
    }
    e
}
