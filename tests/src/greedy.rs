//! The generation driver the greedy-ids tests share (`tests/tests/greedy_ids.rs` on the CPU,
//! `cuda_parity/argmax.rs` on the GPU): the same requests through an engine with greedy ids
//! on and one with them off must give the same tokens.
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::{Engine, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::{SampledToken, SamplingParams};

/// Sequences `first_id..` with `prompts` (sequence `i` on adapter `who[i]`, sampled with
/// `params[i]`), stepped together, each step computing every pending token of every live
/// sequence (the first step prefills them all), until each has `new_tokens` tokens (EOS
/// ignored). No logits are asked for. Returns each sequence's sampled tokens.
pub fn generate<B: Backend>(
    e: &mut Engine<B>,
    first_id: u64,
    who: &[Option<u32>],
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
    new_tokens: usize,
) -> Vec<Vec<SampledToken>> {
    assert!(who.len() == prompts.len() && prompts.len() == params.len());
    let ids: Vec<SeqId> = (0..who.len() as u64).map(|i| SeqId(first_id + i)).collect();
    for (((&id, a), p), s) in ids.iter().zip(who).zip(prompts).zip(params) {
        e.add_sequence(
            id,
            SequenceParams {
                prompt: p.clone(),
                adapter: a.map(AdapterId),
                sampling: s.clone(),
                max_new_tokens: new_tokens,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .expect("the sequence is admitted");
    }
    let mut out = vec![Vec::new(); who.len()];
    let mut live: Vec<SeqId> = ids.clone();
    while !live.is_empty() {
        let plan = StepPlan {
            items: live
                .iter()
                .map(|&seq| PlanItem {
                    seq,
                    num_tokens: e.pending_tokens(seq).expect("a live sequence"),
                })
                .collect(),
            return_logits: false,
        };
        for o in e.step(&plan).expect("a batch step") {
            assert!(o.logits.is_none(), "no logits were asked for");
            out[(o.seq.0 - first_id) as usize].push(o.token);
            if o.finish.is_some() {
                live.retain(|&s| s != o.seq);
            }
        }
    }
    out
}

/// The ids of `tokens`, per sequence.
pub fn token_ids(tokens: &[Vec<SampledToken>]) -> Vec<Vec<u32>> {
    tokens
        .iter()
        .map(|t| t.iter().map(|x| x.id).collect())
        .collect()
}
