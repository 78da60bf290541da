//! The engine's KV on demand against its oracles: a sequence preempted by recompute at any
//! step and resumed produces the greedy tokens of an undisturbed run, each exactly once; a
//! prefix shared from the cache gives the logits a full recompute gives (within the f32
//! tolerance of a different summation order), and only under the same adapter generation.
use std::sync::Arc;

use proptest::prelude::*;
use thaw_runtime::engine::{EngineConfig, SequenceParams};
use thaw_runtime::ids::{AdapterId, Generation, SeqId};
use thaw_tests::{cpu_engine, rel_err, step_all_pending, CpuEngine, TestModel};

/// Relative error between logits computed from cached KV and from a full recompute: the
/// same f32 values through GEMMs of other row counts (see `oracle.rs`).
const TOL: f64 = 1e-4;

fn engine(tm: &TestModel, blocks: usize, caching: bool) -> CpuEngine {
    cpu_engine(
        tm.model.clone(),
        EngineConfig {
            num_kv_blocks: blocks,
            kv_block_size: 4,
            enable_prefix_caching: caching,
            ..Default::default()
        },
    )
}

fn params(prompt: &[u32], adapter: Option<(AdapterId, Generation)>, max: usize) -> SequenceParams {
    SequenceParams {
        prompt: prompt.to_vec(),
        adapter: adapter.map(|a| a.0),
        adapter_generation: adapter.map(|a| a.1).unwrap_or_default(),
        max_new_tokens: max,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs `seq` to its end, one whole pending chunk per step, preempting it (and resuming it
/// the next step) before each step in `preempt_at`; returns every token it emitted.
fn run(e: &mut CpuEngine, seq: SeqId, preempt_at: &[usize]) -> Vec<u32> {
    let mut out = Vec::new();
    for step in 0.. {
        if preempt_at.contains(&step) {
            let before = e.pending_tokens(seq).unwrap();
            e.preempt_sequence(seq).unwrap();
            assert!(
                e.pending_tokens(seq).unwrap() >= before,
                "its KV is to be recomputed"
            );
            e.resume_sequence(seq).unwrap();
        }
        let o = step_all_pending(e, seq, false);
        let done = o.iter().any(|o| o.finish.is_some());
        out.extend(o.iter().map(|o| o.token.id));
        if done {
            return out;
        }
    }
    unreachable!()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Preempted and resumed at arbitrary steps, with or without the prefix cache keeping its
    /// blocks: the same tokens, none repeated, none dropped.
    #[test]
    fn preemption_changes_no_token(
        at in proptest::collection::vec(0usize..12, 0..4),
        caching in any::<bool>(),
        len in 5usize..30,
    ) {
        let tm = TestModel::llama(3);
        let prompt: Vec<u32> = (0..len as u32).map(|i| 3 + (i * 37) % 300).collect();
        let mut plain = engine(&tm, 64, false);
        plain.add_sequence(SeqId(1), params(&prompt, None, 10)).unwrap();
        let want = run(&mut plain, SeqId(1), &[]);
        let mut e = engine(&tm, 64, caching);
        e.add_sequence(SeqId(1), params(&prompt, None, 10)).unwrap();
        let got = run(&mut e, SeqId(1), &at);
        prop_assert_eq!(got, want);
        prop_assert_eq!(e.kv_usage().used_blocks, 0, "a finished sequence holds no block");
    }
}

#[test]
fn a_cached_prefix_gives_the_logits_of_a_recompute_under_its_adapter_generation_only() {
    let tm = TestModel::llama(5);
    let a: Arc<_> = tm.adapter(8, &["q", "k", "v", "o"], 11);
    let b: Arc<_> = tm.adapter(8, &["q", "k", "v", "o"], 12);
    let prefix: Vec<u32> = (0..24u32).map(|i| 3 + (i * 53) % 300).collect();
    let prompt = [prefix.clone(), vec![7, 9, 11]].concat();
    let ka = Some((AdapterId(1), Generation(1)));
    let logits = |e: &mut CpuEngine, seq| step_all_pending(e, seq, true).remove(0).logits.unwrap();

    let mut fresh = engine(&tm, 64, false);
    fresh.register_adapter(AdapterId(1), a.clone()).unwrap();
    fresh
        .add_sequence(SeqId(9), params(&prompt, ka, 2))
        .unwrap();
    let want = logits(&mut fresh, SeqId(9));

    let mut e = engine(&tm, 64, true);
    e.register_adapter(AdapterId(1), a.clone()).unwrap();
    let first = [prefix.clone(), vec![5]].concat();
    assert_eq!(e.add_sequence(SeqId(1), params(&first, ka, 1)).unwrap(), 0);
    step_all_pending(&mut e, SeqId(1), false);
    assert_eq!(
        e.kv_usage().cached_blocks,
        6,
        "24 prompt tokens: six full blocks of 4 cached"
    );
    let cached = e.add_sequence(SeqId(2), params(&prompt, ka, 2)).unwrap();
    assert_eq!(cached, 24);
    let got = logits(&mut e, SeqId(2));
    let err = rel_err(&got, &want);
    assert!(err < TOL, "cached prefix vs recompute: {err}");

    // Another generation of the same id: nothing reused.
    let kb = Some((AdapterId(1), Generation(2)));
    assert_eq!(e.add_sequence(SeqId(3), params(&prompt, kb, 2)).unwrap(), 0);
    e.remove_sequence(SeqId(3)).unwrap();
    // Unregistering the adapter drops its blocks; its replacement shares nothing.
    e.remove_sequence(SeqId(2)).unwrap();
    assert!(e.kv_usage().cached_blocks >= 6);
    e.unregister_adapter(AdapterId(1)).unwrap();
    assert_eq!(e.kv_usage().cached_blocks, 0);
    e.register_adapter(AdapterId(1), b).unwrap();
    assert_eq!(e.add_sequence(SeqId(4), params(&prompt, ka, 2)).unwrap(), 0);
}

#[test]
fn kv_capacity_evicts_cached_blocks_and_bounds_growth() {
    let tm = TestModel::llama(6);
    let mut e = engine(&tm, 16, true);
    let prompt: Vec<u32> = (0..17u32).map(|i| 3 + i).collect();
    e.add_sequence(SeqId(1), params(&prompt, None, 1)).unwrap();
    step_all_pending(&mut e, SeqId(1), false);
    assert_eq!(e.kv_usage().cached_blocks, 4);
    assert_eq!(
        e.set_kv_capacity(2),
        2,
        "two cached blocks beyond the new capacity"
    );
    e.add_sequence(SeqId(2), params(&prompt, None, 4)).unwrap();
    assert_eq!(
        e.kv_usage().free_blocks(),
        0,
        "the two cached blocks it shares fill it"
    );
    assert!(
        e.step(&thaw_runtime::engine::StepPlan {
            items: vec![thaw_runtime::engine::PlanItem {
                seq: SeqId(2),
                num_tokens: 1
            }],
            return_logits: false,
        })
        .is_err(),
        "growing past the capacity fails"
    );
    e.set_kv_capacity(16);
    step_all_pending(&mut e, SeqId(2), false);
}

#[test]
fn a_preempted_sequences_adapter_may_leave_and_come_back() {
    let tm = TestModel::llama(7);
    let a: Arc<_> = tm.adapter(8, &["q", "v"], 21);
    let prompt: Vec<u32> = (0..9u32).map(|i| 3 + i * 11).collect();
    let ka = Some((AdapterId(1), Generation(1)));
    let mut plain = engine(&tm, 64, false);
    plain.register_adapter(AdapterId(1), a.clone()).unwrap();
    plain
        .add_sequence(SeqId(1), params(&prompt, ka, 6))
        .unwrap();
    let want = run(&mut plain, SeqId(1), &[]);

    let mut e = engine(&tm, 64, true);
    e.register_adapter(AdapterId(1), a.clone()).unwrap();
    e.add_sequence(SeqId(1), params(&prompt, ka, 6)).unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(
            step_all_pending(&mut e, SeqId(1), false)
                .iter()
                .map(|o| o.token.id),
        );
    }
    assert!(
        e.unregister_adapter(AdapterId(1)).is_err(),
        "a running sequence uses it"
    );
    e.preempt_sequence(SeqId(1)).unwrap();
    e.unregister_adapter(AdapterId(1)).unwrap();
    assert!(
        e.resume_sequence(SeqId(1)).is_err(),
        "its adapter must be back first"
    );
    e.register_adapter(AdapterId(1), a).unwrap();
    e.resume_sequence(SeqId(1)).unwrap();
    got.extend(run(&mut e, SeqId(1), &[]));
    assert_eq!(got, want);
}
