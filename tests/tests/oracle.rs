//! The engine against its oracles (DESIGN §9): merged weights, full recompute, solo runs.
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_tests::{cpu_engine, rel_err, step_all_pending, TestModel};

/// Relative error allowed between two f32 computations of the same logits by different
/// summation orders (batched vs solo GEMMs, LoRA unmerged vs merged): f32 has ~6e-8 unit
/// roundoff, a few hundred accumulations per dot product over a handful of layers stay well
/// below 1e-4 (normwise).
const TOL: f64 = 1e-4;

fn prompt(rng: &mut ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(3..vocab as u32))
        .collect()
}

/// Logits of `prompt` run alone (one prefill) on `model`, then of one decode token.
fn solo_logits(model: HostModel, prompt: &[u32], next: u32) -> (Vec<f32>, Vec<f32>) {
    let mut e = cpu_engine(model, EngineConfig::default());
    e.add_sequence(
        SeqId(0),
        SequenceParams {
            prompt: prompt.to_vec(),
            max_new_tokens: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let step = |e: &mut thaw_tests::CpuEngine, n| {
        let plan = StepPlan {
            items: vec![PlanItem {
                seq: SeqId(0),
                num_tokens: n,
            }],
            return_logits: true,
        };
        e.step(&plan).unwrap().remove(0)
    };
    let first = step(&mut e, prompt.len());
    assert_eq!(
        first.token.id, next,
        "solo greedy token differs from batched"
    );
    let second = step(&mut e, 1);
    (first.logits.unwrap(), second.logits.unwrap())
}

fn merged_weight_oracle(kernel: LoraKernel) {
    let tm = TestModel::llama(1);
    // Four adapters of ranks 8..128 with different target sets.
    let specs: [(usize, &[&str]); 4] = [
        (8, &["q", "v"]),
        (16, &["q", "k", "v", "o", "gate", "up", "down"]),
        (64, &["o", "down"]),
        (128, &["k", "gate", "up"]),
    ];
    let adapters: Vec<Arc<LoraAdapter>> = specs
        .iter()
        .enumerate()
        .map(|(i, (r, t))| tm.adapter(*r, t, 100 + i as u64))
        .collect();
    let mut engine = cpu_engine(
        tm.model.clone(),
        EngineConfig {
            lora_kernel: kernel,
            ..Default::default()
        },
    );
    for (i, a) in adapters.iter().enumerate() {
        engine
            .register_adapter(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    // 10 sequences: two per adapter, interleaved so the engine must regroup them, plus two
    // base-only sequences.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let vocab = tm.model.config.vocab_size;
    let who: Vec<Option<usize>> = vec![
        Some(0),
        Some(1),
        None,
        Some(2),
        Some(3),
        Some(0),
        Some(2),
        None,
        Some(1),
        Some(3),
    ];
    let prompts: Vec<Vec<u32>> = who
        .iter()
        .enumerate()
        .map(|(i, _)| prompt(&mut rng, 3 + 2 * i, vocab))
        .collect();
    for (i, (a, p)) in who.iter().zip(&prompts).enumerate() {
        engine
            .add_sequence(
                SeqId(i as u64),
                SequenceParams {
                    prompt: p.clone(),
                    adapter: a.map(|a| AdapterId(a as u32)),
                    max_new_tokens: 4,
                    ..Default::default()
                },
            )
            .unwrap();
    }
    let plan = StepPlan {
        items: (0..who.len())
            .map(|i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: prompts[i].len(),
            })
            .collect(),
        return_logits: true,
    };
    let prefill = engine.step(&plan).unwrap();
    assert_eq!(prefill.len(), who.len());
    // Then one decode step for all of them, mixed adapters again.
    let plan = StepPlan {
        items: (0..who.len())
            .map(|i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: 1,
            })
            .collect(),
        return_logits: true,
    };
    let decode = engine.step(&plan).unwrap();
    for (i, a) in who.iter().enumerate() {
        let mut merged = tm.model.clone();
        if let Some(a) = a {
            merged.merge_adapter(&adapters[*a]);
        }
        let p = prefill.iter().find(|o| o.seq == SeqId(i as u64)).unwrap();
        let d = decode.iter().find(|o| o.seq == SeqId(i as u64)).unwrap();
        let (want_p, want_d) = solo_logits(merged, &prompts[i], p.token.id);
        let ep = rel_err(p.logits.as_ref().unwrap(), &want_p);
        let ed = rel_err(d.logits.as_ref().unwrap(), &want_d);
        assert!(ep <= TOL, "seq {i} ({a:?}) prefill logits rel err {ep:e}");
        assert!(ed <= TOL, "seq {i} ({a:?}) decode logits rel err {ed:e}");
        // The adapter must matter: logits differ from the base model's.
        if a.is_some() {
            let (base_p, _) = solo_logits_free(tm.model.clone(), &prompts[i]);
            assert!(
                rel_err(&want_p, &base_p) > 1e-3,
                "adapter {a:?} changes nothing"
            );
        }
    }
}

fn solo_logits_free(model: HostModel, prompt: &[u32]) -> (Vec<f32>, u32) {
    let mut e = cpu_engine(model, EngineConfig::default());
    e.add_sequence(
        SeqId(0),
        SequenceParams {
            prompt: prompt.to_vec(),
            ..Default::default()
        },
    )
    .unwrap();
    let o = step_all_pending(&mut e, SeqId(0), true).remove(0);
    (o.logits.unwrap(), o.token.id)
}

#[test]
fn merged_weight_oracle_sgmv() {
    merged_weight_oracle(LoraKernel::Sgmv);
}

#[test]
fn merged_weight_oracle_bgmv() {
    merged_weight_oracle(LoraKernel::Bgmv);
}

/// 64 greedy tokens through the paged cache equal a full recompute at every step, for several
/// prefill chunk sizes, with blocks of 4 slots so the sequence crosses many block boundaries.
#[test]
fn kv_cache_matches_full_recompute() {
    let tm = TestModel::llama(2);
    let adapter = tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 5);
    let vocab = tm.model.config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let p = prompt(&mut rng, 13, vocab);
    let cfg = EngineConfig {
        kv_block_size: 4,
        num_kv_blocks: 64,
        ..Default::default()
    };
    let mut reference: Option<Vec<u32>> = None;
    for chunk in [1usize, 3, 7, 13] {
        let mut e = cpu_engine(tm.model.clone(), cfg.clone());
        e.register_adapter(AdapterId(0), adapter.clone()).unwrap();
        let mut full = cpu_engine(tm.model.clone(), cfg.clone());
        full.register_adapter(AdapterId(0), adapter.clone())
            .unwrap();
        let params = |prompt: Vec<u32>, n| SequenceParams {
            prompt,
            adapter: Some(AdapterId(0)),
            max_new_tokens: n,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_sequence(SeqId(0), params(p.clone(), 64)).unwrap();
        let mut tokens = p.clone();
        let mut generated = Vec::new();
        let mut recompute_id = 1;
        while generated.len() < 64 {
            let pending = e.pending_tokens(SeqId(0)).unwrap();
            let n = pending.min(chunk);
            let out = e
                .step(&StepPlan {
                    items: vec![PlanItem {
                        seq: SeqId(0),
                        num_tokens: n,
                    }],
                    return_logits: true,
                })
                .unwrap();
            if n < pending {
                assert!(out.is_empty(), "sampled before the prompt was done");
                continue;
            }
            let o = &out[0];
            // Full recompute: a fresh sequence over every token so far, one prefill.
            full.add_sequence(SeqId(recompute_id), params(tokens.clone(), 1))
                .unwrap();
            let f = full
                .step(&StepPlan {
                    items: vec![PlanItem {
                        seq: SeqId(recompute_id),
                        num_tokens: tokens.len(),
                    }],
                    return_logits: true,
                })
                .unwrap()
                .remove(0);
            recompute_id += 1;
            assert_eq!(
                o.token.id,
                f.token.id,
                "chunk {chunk}: token {} differs",
                generated.len()
            );
            let err = rel_err(o.logits.as_ref().unwrap(), f.logits.as_ref().unwrap());
            assert!(
                err <= TOL,
                "chunk {chunk} step {}: rel err {err:e}",
                generated.len()
            );
            tokens.push(o.token.id);
            generated.push(o.token.id);
        }
        assert_eq!(e.num_sequences(), 0, "a finished sequence is retired");
        assert_eq!(
            e.kv_usage().used_blocks,
            0,
            "a finished sequence frees its KV"
        );
        assert!(
            generated
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len()
                > 4,
            "degenerate generation: {generated:?}"
        );
        match &reference {
            None => reference = Some(generated),
            Some(r) => assert_eq!(r, &generated, "chunk size {chunk} changed the tokens"),
        }
    }
}

/// Runs sequences through a tiny continuous-batching loop: sequence i joins at step 2i, prefill
/// in chunks of 5 next to everyone else's decode; returns each sequence's tokens.
fn run_batched(
    tm: &TestModel,
    reqs: &[SequenceParams],
    adapters: &[Arc<LoraAdapter>],
) -> Vec<Vec<u32>> {
    let mut e = cpu_engine(tm.model.clone(), EngineConfig::default());
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone()).unwrap();
    }
    let mut out = vec![Vec::new(); reqs.len()];
    let mut live: Vec<usize> = Vec::new();
    let mut step = 0;
    while step < 2 * reqs.len() || !live.is_empty() {
        if step % 2 == 0 && step / 2 < reqs.len() {
            let i = step / 2;
            e.add_sequence(SeqId(i as u64), reqs[i].clone()).unwrap();
            live.push(i);
        }
        let items = live
            .iter()
            .map(|&i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: e.pending_tokens(SeqId(i as u64)).unwrap().min(5),
            })
            .collect();
        for o in e
            .step(&StepPlan {
                items,
                return_logits: false,
            })
            .unwrap()
        {
            let i = o.seq.0 as usize;
            out[i].push(o.token.id);
            if o.finish.is_some() {
                live.retain(|&x| x != i);
            }
        }
        step += 1;
    }
    assert_eq!(e.kv_usage().used_blocks, 0);
    out
}

#[test]
fn continuous_batching_matches_solo_runs() {
    let tm = TestModel::llama(3);
    let adapters = vec![
        tm.adapter(8, &["q", "v"], 11),
        tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 12),
    ];
    let vocab = tm.model.config.vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let reqs: Vec<SequenceParams> = (0..6)
        .map(|i| SequenceParams {
            prompt: prompt(&mut rng, 4 + 3 * i, vocab),
            adapter: [None, Some(AdapterId(0)), Some(AdapterId(1))][i % 3],
            max_new_tokens: 3 + 2 * i,
            ignore_eos: true,
            sampling: if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_k: 20,
                    top_p: 0.9,
                    seed: Some(1000 + i as u64),
                    top_logprobs: 0,
                    logprobs: false,
                }
            },
            ..Default::default()
        })
        .collect();
    let batched = run_batched(&tm, &reqs, &adapters);
    for (i, r) in reqs.iter().enumerate() {
        let solo = run_batched(&tm, std::slice::from_ref(r), &adapters);
        assert_eq!(batched[i], solo[0], "sequence {i} differs when batched");
        assert_eq!(batched[i].len(), r.max_new_tokens);
    }
}
