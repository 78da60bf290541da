//! Greedy token ids instead of logits (issue 29, `engine::greedy`) through the CPU engine:
//! with greedy ids on, a step whose rows are all greedy without logprobs brings back one id per
//! row ([`Backend::greedy_ids`], [`Backend::graph_end_ids`] under graph emulation); off, the
//! logits and the host's sampler, as before. The tokens must be identical, eager and
//! graph-padded alike, and a step with a row that needs its logits must keep them.
//!
//! [`Backend::greedy_ids`]: thaw_runtime::backend::Backend::greedy_ids
//! [`Backend::graph_end_ids`]: thaw_runtime::backend::Backend::graph_end_ids
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, HostModel};
use thaw_runtime::sampling::SamplingParams;
use thaw_tests::graphs::prompts;
use thaw_tests::greedy::{generate, token_ids};
use thaw_tests::TestModel;

fn engine(
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    graphs: bool,
    ids: bool,
) -> Engine<CpuBackend> {
    let mut e = thaw_tests::graphs::emulated_engine(model, adapters, graphs);
    e.set_greedy_ids(ids);
    assert_eq!(e.greedy_ids(), ids);
    e
}

const WHO: [Option<u32>; 5] = [None, Some(0), None, Some(0), None];
const NEW_TOKENS: usize = 6;

#[test]
fn greedy_tokens_are_identical_with_ids_on_and_off() {
    let tm = TestModel::llama(7);
    let adapters = [tm.adapter(8, &["q", "v"], 70)];
    let p = prompts(WHO.len(), tm.model.config.vocab_size, 11);
    let greedy = vec![SamplingParams::greedy(); WHO.len()];
    let mut runs = Vec::new();
    for graphs in [false, true] {
        for ids in [false, true] {
            let mut e = engine(&tm.model, &adapters, graphs, ids);
            let t = generate(&mut e, 0, &WHO, &p, &greedy, NEW_TOKENS);
            // One prefill step and NEW_TOKENS - 1 decode steps, every row greedy.
            let want = if ids { NEW_TOKENS as u64 } else { 0 };
            assert_eq!(e.greedy_id_steps(), want, "graphs {graphs}, ids {ids}");
            if graphs {
                let s = e.graph_stats().expect("graphs on");
                assert!(s.warmups + s.replays > 0, "decode steps ran padded: {s:?}");
            }
            for tok in t.iter().flatten() {
                assert!(tok.logprob.is_nan() && tok.top.is_empty(), "{tok:?}");
            }
            runs.push((graphs, ids, token_ids(&t)));
        }
    }
    let (_, _, base) = &runs[0];
    assert!(base.iter().all(|t| t.len() == NEW_TOKENS));
    for (graphs, ids, t) in &runs[1..] {
        assert_eq!(
            t, base,
            "graphs {graphs}, ids {ids}: the greedy tokens changed"
        );
    }
}

#[test]
fn a_row_that_needs_its_logits_keeps_the_step_on_logits() {
    let tm = TestModel::llama(7);
    let adapters = [tm.adapter(8, &["q", "v"], 70)];
    let p = prompts(WHO.len(), tm.model.config.vocab_size, 12);
    let mut params = vec![SamplingParams::greedy(); WHO.len()];
    params[2].logprobs = true;
    params[2].top_logprobs = 2;
    params[4] = SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        ..Default::default()
    };
    let mut runs = Vec::new();
    for ids in [false, true] {
        let mut e = engine(&tm.model, &adapters, false, ids);
        let t = generate(&mut e, 100, &WHO, &p, &params, NEW_TOKENS);
        assert_eq!(
            e.greedy_id_steps(),
            0,
            "every step has rows that need logits"
        );
        runs.push(t);
    }
    for (seq, (off, on)) in runs[0].iter().zip(&runs[1]).enumerate() {
        for (a, b) in off.iter().zip(on) {
            assert_eq!(a.id, b.id, "seq {seq}");
            assert_eq!(a.logprob.to_bits(), b.logprob.to_bits(), "seq {seq}");
            assert_eq!(a.top, b.top, "seq {seq}");
        }
    }
    assert!(runs[1][2]
        .iter()
        .all(|t| t.logprob < 0.0 && t.top.len() == 2));
}
