//! Prompt logprobs (`SequenceParams::prompt_logprobs`, behind `echo` + `logprobs`) against
//! the oracle of DESIGN §9: for every prompt position p ≥ 1, the log-softmax (in f64) of the
//! logits a solo prefill of `prompt[..p]` ends with, on merged weights when an adapter is in
//! play. Chunked prefills, batches that mix scored and unscored sequences, and steps whose
//! prompt rows need several logits passes must all give the same scores.
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::engine::{
    EngineConfig, HostModel, PlanItem, SeqOutput, SequenceParams, StepPlan,
};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SampledToken;
use thaw_tests::{cpu_engine, CpuEngine, TestModel};

/// Absolute error allowed on a logprob. The engine and the oracle compute the same logits
/// by different summation orders (chunked vs whole prefill, batched vs solo GEMMs, LoRA
/// unmerged vs merged): the oracle suite bounds that at 1e-4 normwise relative error, and the
/// test model's logits are O(1), so a logprob (a logit minus a shared log-sum-exp) moves by
/// far less than 1e-4; measured differences are a few 1e-6.
const TOL: f64 = 1e-4;

fn prompt(rng: &mut ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(3..vocab as u32))
        .collect()
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x
        .iter()
        .map(|&v| v as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// Oracle: row p (p = 1..=len) is the log-softmax of the logits after `prompt[..p]`, each
/// prefix a fresh sequence prefilled alone on `model`. Row `len` scores the first generated
/// token.
fn oracle(model: HostModel, prompt: &[u32]) -> Vec<Vec<f64>> {
    let mut e = cpu_engine(model, EngineConfig::default());
    let mut rows = vec![Vec::new()];
    for p in 1..=prompt.len() {
        e.add_sequence(
            SeqId(p as u64),
            SequenceParams {
                prompt: prompt[..p].to_vec(),
                max_new_tokens: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let o = e
            .step(&StepPlan {
                items: vec![PlanItem {
                    seq: SeqId(p as u64),
                    num_tokens: p,
                }],
                return_logits: true,
            })
            .unwrap()
            .remove(0);
        rows.push(log_softmax(o.logits.as_ref().unwrap()));
    }
    rows
}

/// Runs `params` alone with prefill chunks of `chunk` tokens (None: whole) until its first
/// output, which it returns; no earlier step may output anything.
fn first_output(
    e: &mut CpuEngine,
    id: u64,
    params: SequenceParams,
    chunk: Option<usize>,
) -> SeqOutput {
    e.add_sequence(SeqId(id), params).unwrap();
    loop {
        let pending = e.pending_tokens(SeqId(id)).unwrap();
        let n = chunk.map_or(pending, |c| c.min(pending));
        let mut out = e
            .step(&StepPlan {
                items: vec![PlanItem {
                    seq: SeqId(id),
                    num_tokens: n,
                }],
                return_logits: false,
            })
            .unwrap();
        if n < pending {
            assert!(out.is_empty(), "output before the prompt was done");
            continue;
        }
        return out.remove(0);
    }
}

/// Checks one sequence's scores against the oracle rows; returns the largest error.
fn check_scores(scored: &[SampledToken], prompt: &[u32], want: &[Vec<f64>], top: usize) -> f64 {
    assert_eq!(
        scored.len(),
        prompt.len() - 1,
        "one score per prompt token but the first"
    );
    let mut worst = 0.0f64;
    for (i, t) in scored.iter().enumerate() {
        let p = i + 1;
        assert_eq!(t.id, prompt[p], "score {i} is of the wrong token");
        let w = &want[p];
        let err = (t.logprob as f64 - w[prompt[p] as usize]).abs();
        worst = worst.max(err);
        assert!(
            err <= TOL,
            "position {p}: logprob {} vs oracle {}",
            t.logprob,
            w[prompt[p] as usize]
        );
        assert!(t.logprob <= 0.0);
        assert_eq!(t.top.len(), top, "position {p}: alternatives");
        let best = w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for (k, &(id, lp)) in t.top.iter().enumerate() {
            let err = (lp as f64 - w[id as usize]).abs();
            worst = worst.max(err);
            assert!(
                err <= TOL,
                "position {p}: alternative {id} logprob {lp} vs {}",
                w[id as usize]
            );
            if k == 0 {
                assert!(
                    (lp as f64 - best).abs() <= TOL,
                    "position {p}: top alternative is not the best"
                );
            } else {
                assert!(
                    lp <= t.top[k - 1].1,
                    "position {p}: alternatives out of order"
                );
            }
        }
    }
    worst
}

/// Whole and chunked prefills (chunks of 3 and 7) score the prompt as the oracle does, with
/// and without an adapter; the first generated token's logprob is the oracle's too.
#[test]
fn prompt_logprobs_match_the_oracle_whole_and_chunked() {
    let tm = TestModel::llama(21);
    let adapter = tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 22);
    let vocab = tm.model.config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let p = prompt(&mut rng, 20, vocab);
    let cfg = EngineConfig {
        kv_block_size: 4,
        num_kv_blocks: 64,
        ..Default::default()
    };
    for with_adapter in [false, true] {
        let mut merged = tm.model.clone();
        if with_adapter {
            merged.merge_adapter(&adapter);
        }
        let want = oracle(merged, &p);
        let mut e = cpu_engine(tm.model.clone(), cfg.clone());
        e.register_adapter(AdapterId(0), adapter.clone()).unwrap();
        let mut whole: Option<Vec<SampledToken>> = None;
        for (i, chunk) in [None, Some(3), Some(7), Some(1)].into_iter().enumerate() {
            let o = first_output(
                &mut e,
                i as u64,
                SequenceParams {
                    prompt: p.clone(),
                    adapter: with_adapter.then_some(AdapterId(0)),
                    max_new_tokens: 2,
                    ignore_eos: true,
                    prompt_logprobs: Some(3),
                    sampling: thaw_runtime::sampling::SamplingParams {
                        top_logprobs: 3,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                chunk,
            );
            let worst = check_scores(&o.prompt_logprobs, &p, &want, 3);
            eprintln!("adapter {with_adapter} chunk {chunk:?}: worst |err| {worst:e}");
            // The first generated token: greedy, and scored like the prompt tokens.
            let last = &want[p.len()];
            let best = (0..vocab)
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap();
            assert_eq!(
                o.token.id as usize, best,
                "greedy token is not the oracle's argmax"
            );
            assert!((o.token.logprob as f64 - last[best]).abs() <= TOL);
            assert_eq!(o.token.top[0].0 as usize, best);
            // Chunking changes nothing beyond summation order.
            match &whole {
                None => whole = Some(o.prompt_logprobs.clone()),
                Some(w) => {
                    for (a, b) in o.prompt_logprobs.iter().zip(w) {
                        assert_eq!(a.id, b.id);
                        assert!(
                            (a.logprob - b.logprob).abs() as f64 <= TOL,
                            "chunk {chunk:?}: {} vs whole {}",
                            a.logprob,
                            b.logprob
                        );
                    }
                }
            }
            // Later outputs carry no prompt scores; the sequence then finishes.
            let next = e
                .step(&StepPlan {
                    items: vec![PlanItem {
                        seq: SeqId(i as u64),
                        num_tokens: 1,
                    }],
                    return_logits: false,
                })
                .unwrap();
            assert!(next[0].prompt_logprobs.is_empty());
            assert!(next[0].finish.is_some());
        }
        assert_eq!(e.kv_usage().used_blocks, 0);
    }
}

/// A long prompt scored in one step next to an unscored prefill and a decode: its 99 prompt
/// rows need two logits passes (sample rows are capped at max_batch_seqs = 4 per pass, prompt
/// passes at 64 rows), and only the sequence that asked is scored. `Some(0)` returns no
/// alternatives; a one-token prompt has nothing to score.
#[test]
fn prompt_logprobs_in_mixed_batches_and_many_passes() {
    let tm = TestModel::llama(31);
    let adapter: Arc<LoraAdapter> = tm.adapter(8, &["q", "v", "down"], 32);
    let vocab = tm.model.config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    let long = prompt(&mut rng, 100, vocab);
    let other = prompt(&mut rng, 9, vocab);
    let mut merged = tm.model.clone();
    merged.merge_adapter(&adapter);
    let want = oracle(merged, &long);
    let mut e = cpu_engine(
        tm.model.clone(),
        EngineConfig {
            max_batch_seqs: 4,
            ..Default::default()
        },
    );
    e.register_adapter(AdapterId(0), adapter).unwrap();
    let params = |prompt: &[u32], adapter, scored| SequenceParams {
        prompt: prompt.to_vec(),
        adapter,
        max_new_tokens: 4,
        ignore_eos: true,
        prompt_logprobs: scored,
        ..Default::default()
    };
    // Sequence 0 decodes while 1 (scored, adapter) and 2 (unscored) prefill.
    e.add_sequence(SeqId(0), params(&other, None, Some(2)))
        .unwrap();
    let o = e
        .step(&StepPlan {
            items: vec![PlanItem {
                seq: SeqId(0),
                num_tokens: other.len(),
            }],
            return_logits: false,
        })
        .unwrap();
    assert_eq!(o[0].prompt_logprobs.len(), other.len() - 1);
    e.add_sequence(SeqId(1), params(&long, Some(AdapterId(0)), Some(0)))
        .unwrap();
    e.add_sequence(SeqId(2), params(&other, Some(AdapterId(0)), None))
        .unwrap();
    let out = e
        .step(&StepPlan {
            items: vec![
                PlanItem {
                    seq: SeqId(2),
                    num_tokens: other.len(),
                },
                PlanItem {
                    seq: SeqId(0),
                    num_tokens: 1,
                },
                PlanItem {
                    seq: SeqId(1),
                    num_tokens: long.len(),
                },
            ],
            return_logits: false,
        })
        .unwrap();
    assert_eq!(out.len(), 3);
    let by = |id: u64| out.iter().find(|o| o.seq == SeqId(id)).unwrap();
    assert!(
        by(0).prompt_logprobs.is_empty(),
        "a decode step scores nothing"
    );
    assert!(by(2).prompt_logprobs.is_empty(), "scores nobody asked for");
    let worst = check_scores(&by(1).prompt_logprobs, &long, &want, 0);
    eprintln!("mixed batch: worst |err| {worst:e}");

    e.add_sequence(SeqId(3), params(&long[..1], None, Some(5)))
        .unwrap();
    let o = first_output(&mut e, 4, params(&long[..2], None, Some(5)), None);
    assert_eq!(o.prompt_logprobs.len(), 1);
    assert_eq!(o.prompt_logprobs[0].top.len(), 5);
    let out = e
        .step(&StepPlan {
            items: vec![PlanItem {
                seq: SeqId(3),
                num_tokens: 1,
            }],
            return_logits: false,
        })
        .unwrap();
    assert!(
        out[0].prompt_logprobs.is_empty(),
        "a one-token prompt has nothing to score"
    );
}
