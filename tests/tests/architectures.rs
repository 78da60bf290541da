//! Llama, Mistral and Qwen2 model directories written by `gen-model --arch` load and run, and
//! their architecture-specific parts (sliding window, q/k/v biases, tied embeddings) take effect.
use thaw_runtime::engine::{EngineConfig, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::model::Architecture;
use thaw_server::gen::{ArchOptions, GenArch};
use thaw_tests::{cpu_engine, rel_err, test_preset, CpuEngine, TestModel};

const TOL: f64 = 1e-4;

fn logits_once(e: &mut CpuEngine, id: u64, prompt: &[u32], adapter: Option<AdapterId>) -> Vec<f32> {
    e.add_sequence(
        SeqId(id),
        SequenceParams {
            prompt: prompt.to_vec(),
            adapter,
            max_new_tokens: 1,
            ..Default::default()
        },
    )
    .unwrap();
    e.step(&StepPlan {
        items: vec![PlanItem {
            seq: SeqId(id),
            num_tokens: prompt.len(),
        }],
        return_logits: true,
    })
    .unwrap()
    .remove(0)
    .logits
    .unwrap()
}

/// Decode 24 tokens with chunked prefill and compare each step against a full recompute.
fn decode_matches_recompute(tm: &TestModel) -> Vec<u32> {
    let adapter = tm.adapter(16, &["q", "k", "v", "o", "down"], 3);
    let cfg = EngineConfig {
        kv_block_size: 4,
        num_kv_blocks: 256,
        ..Default::default()
    };
    let mut e = cpu_engine(tm.model.clone(), cfg.clone());
    let mut full = cpu_engine(tm.model.clone(), cfg);
    for x in [&mut e, &mut full] {
        x.register_adapter(AdapterId(0), adapter.clone()).unwrap();
    }
    let mut tokens: Vec<u32> = (0..11).map(|i| 5 + 7 * i).collect();
    e.add_sequence(
        SeqId(0),
        SequenceParams {
            prompt: tokens.clone(),
            adapter: Some(AdapterId(0)),
            max_new_tokens: 24,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .unwrap();
    for step in 0..24 {
        let n = e.pending_tokens(SeqId(0)).unwrap().min(5);
        let out = e
            .step(&StepPlan {
                items: vec![PlanItem {
                    seq: SeqId(0),
                    num_tokens: n,
                }],
                return_logits: true,
            })
            .unwrap();
        let Some(o) = out.into_iter().next() else {
            continue;
        };
        let want = logits_once(&mut full, 100 + step, &tokens, Some(AdapterId(0)));
        let err = rel_err(o.logits.as_ref().unwrap(), &want);
        assert!(err <= TOL, "step {step}: rel err {err:e}");
        tokens.push(o.token.id);
    }
    tokens
}

#[test]
fn llama_with_tied_embeddings() {
    let tm = TestModel::with_arch(
        &test_preset(),
        21,
        ArchOptions {
            tie_word_embeddings: true,
            ..Default::default()
        },
    );
    assert_eq!(tm.model.config.architecture, Architecture::Llama);
    assert!(tm.model.config.tie_word_embeddings);
    assert!(
        tm.model.lm_head.is_none(),
        "tied model has no separate head"
    );
    decode_matches_recompute(&tm);
}

#[test]
fn mistral_sliding_window_limits_attention() {
    let window = 6;
    let windowed = TestModel::with_arch(
        &test_preset(),
        22,
        ArchOptions {
            arch: GenArch::Mistral,
            sliding_window: Some(window),
            ..Default::default()
        },
    );
    let c = &windowed.model.config;
    assert_eq!(c.architecture, Architecture::Mistral);
    assert_eq!(c.sliding_window, Some(window));
    decode_matches_recompute(&windowed);
    // Same weights without the window: identical while the context fits in the window,
    // different once it does not.
    let mut unwindowed = windowed.model.clone();
    unwindowed.config.sliding_window = None;
    let short: Vec<u32> = (0..window as u32).map(|i| 10 + i).collect();
    let long: Vec<u32> = (0..3 * window as u32).map(|i| 10 + i).collect();
    let mut a = cpu_engine(windowed.model.clone(), EngineConfig::default());
    let mut b = cpu_engine(unwindowed, EngineConfig::default());
    let (s1, s2) = (
        logits_once(&mut a, 1, &short, None),
        logits_once(&mut b, 1, &short, None),
    );
    assert!(
        rel_err(&s1, &s2) <= TOL,
        "window changed a context that fits in it"
    );
    let (l1, l2) = (
        logits_once(&mut a, 2, &long, None),
        logits_once(&mut b, 2, &long, None),
    );
    assert!(rel_err(&l1, &l2) > 1e-3, "sliding window had no effect");
}

#[test]
fn qwen2_biases_load_and_matter() {
    let tm = TestModel::with_arch(
        &test_preset(),
        23,
        ArchOptions {
            arch: GenArch::Qwen2,
            tie_word_embeddings: true,
            ..Default::default()
        },
    );
    let c = &tm.model.config;
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert!(c.attention_bias, "qwen2 has q/k/v biases by default");
    let l0 = &tm.model.layers[0];
    assert!(l0.bias[0].is_some() && l0.bias[1].is_some() && l0.bias[2].is_some());
    assert!(l0.bias[3].is_none(), "qwen2 has no o_proj bias");
    decode_matches_recompute(&tm);
    // Zeroing the biases changes the output, so they are applied.
    let mut nobias = tm.model.clone();
    for l in &mut nobias.layers {
        for b in l.bias.iter_mut().flatten() {
            b.iter_mut().for_each(|x| *x = 0.0);
        }
    }
    let p: Vec<u32> = (0..9).map(|i| 4 + 3 * i).collect();
    let with = logits_once(
        &mut cpu_engine(tm.model.clone(), EngineConfig::default()),
        1,
        &p,
        None,
    );
    let without = logits_once(
        &mut cpu_engine(nobias, EngineConfig::default()),
        1,
        &p,
        None,
    );
    assert!(rel_err(&with, &without) > 1e-3, "biases had no effect");
}
