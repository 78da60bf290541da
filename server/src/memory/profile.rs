//! Building the engine with its device budget measured, as vLLM does for
//! `--gpu-memory-utilization`: on a device that reports its memory (CUDA), the engine starts
//! with a KV cache of one largest prefill, runs that prefill once, shrinks the cache to a
//! block, and the memory it still holds (weights, workspaces, what the forward pass grew) comes
//! off `utilization × total`; the KV cache is then sized to the rest ([`super::budget`]). On the
//! CPU backend the budget is `--device-memory-bytes` (or the blocks override) as before.
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::SeqId;

use super::budget::{kv_adapter_budget, profiled_bytes, DeviceMemory};

/// How to size the pool when the device reports its memory.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Sizing {
    /// `--gpu-memory-utilization`.
    pub utilization: f64,
    /// Bytes of one page (one KV block over every layer), the pool's unit.
    pub page_bytes: u64,
    /// Pages one sequence of `--max-model-len` needs.
    pub min_pages: usize,
}

/// The sequence id of the first profiling prefill; the others count down from it (never a
/// request's: those count up from 1).
const PROFILE_SEQ: SeqId = SeqId(u64::MAX);

/// The prompt lengths of the profile step, as vLLM's profile run: one forward of the largest
/// step the scheduler may send, `max_batch_tokens` tokens, never beyond what the model accepts.
/// Each prompt is at most `context − 1` tokens, so that with its one sampled token it stays
/// inside the context (a sequence of `context` prompt tokens would be refused), and the tokens
/// go to the fewest such sequences (the longest attention a step can have), at most
/// `max_batch_seqs` of them. `context` must be at least 2; `max_batch_tokens` and
/// `max_batch_seqs` are raised to 1.
pub fn profile_prompts(
    max_batch_tokens: usize,
    max_batch_seqs: usize,
    context: usize,
) -> Vec<usize> {
    let per_seq = context.saturating_sub(1).max(1);
    let tokens = max_batch_tokens
        .max(1)
        .min(per_seq.saturating_mul(max_batch_seqs.max(1)));
    let n = tokens.div_ceil(per_seq);
    (0..n).map(|i| per_seq.min(tokens - i * per_seq)).collect()
}

/// Builds the engine. With `sizing` and a device whose memory `probe` reports, the KV cache is
/// measured and sized as the module docs say, and the returned page count is that budget;
/// otherwise the engine keeps `cfg.num_kv_blocks`, which is returned.
pub fn build_engine<B: Backend>(
    backend: B,
    model: HostModel,
    mut cfg: EngineConfig,
    sizing: Option<Sizing>,
    probe: impl Fn(&B) -> thaw_runtime::error::Result<Option<DeviceMemory>>,
) -> anyhow::Result<(Engine<B>, usize)> {
    let before = match sizing {
        Some(_) => probe(&backend)?,
        None => None,
    };
    let (Some(s), Some(before)) = (sizing, before) else {
        let blocks = cfg.num_kv_blocks;
        return Ok((Engine::new(backend, model, cfg)?, blocks));
    };
    let context = cfg
        .max_context
        .unwrap_or(model.config.max_position_embeddings)
        .min(model.config.max_position_embeddings);
    anyhow::ensure!(
        context >= 2,
        "--max-model-len {context} leaves no room for a prompt token and a generated one; \
         use at least 2"
    );
    let prompts = profile_prompts(cfg.max_batch_tokens, cfg.max_batch_seqs, context);
    let block = cfg.kv_block_size.max(1);
    cfg.num_kv_blocks = prompts.iter().map(|l| l.div_ceil(block)).sum::<usize>() + 1;
    let vocab = model.config.vocab_size.max(1);
    let caching = cfg.enable_prefix_caching;
    let mut engine = Engine::new(backend, model, cfg)?;
    // A measurement, not a request: nothing of it is looked up in, or left in, the cache.
    engine.set_prefix_caching(false);
    let seqs: Vec<SeqId> = (0..prompts.len() as u64)
        .map(|i| SeqId(PROFILE_SEQ.0 - i))
        .collect();
    for (&seq, &len) in seqs.iter().zip(&prompts) {
        engine.add_sequence(
            seq,
            SequenceParams {
                prompt: (0..len).map(|i| (i % vocab) as u32).collect(),
                max_new_tokens: 1,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    tracing::debug!(
        tokens = prompts.iter().sum::<usize>(),
        sequences = prompts.len(),
        "memory profile: one forward of the largest step"
    );
    engine.step(&StepPlan {
        items: seqs
            .iter()
            .zip(&prompts)
            .map(|(&seq, &num_tokens)| PlanItem { seq, num_tokens })
            .collect(),
        return_logits: false,
    })?;
    // One token each: the step finished them; remove any it did not.
    for seq in seqs {
        let _ = engine.remove_sequence(seq);
    }
    engine.resize_kv(1)?;
    let after = probe(engine.backend())?.unwrap_or(before);
    let used = profiled_bytes(before, after, s.page_bytes);
    let budget = kv_adapter_budget(
        s.utilization,
        before,
        used,
        s.min_pages as u64 * s.page_bytes,
    )?;
    let pages = (budget / s.page_bytes.max(1)) as usize;
    tracing::info!(
        total = before.total,
        free = before.free,
        used,
        budget,
        pages,
        utilization = s.utilization,
        "device budget from the memory profile"
    );
    engine.resize_kv(pages)?;
    engine.set_prefix_caching(caching);
    Ok((engine, pages))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gen::{preset, write_model, GenModelOptions};
    use std::cell::Cell;
    use thaw_runtime::backend::cpu::CpuBackend;

    /// The tiny preset written to a temporary directory and loaded.
    pub(crate) fn tiny() -> (tempfile::TempDir, HostModel) {
        let dir = tempfile::tempdir().unwrap();
        write_model(
            &preset("tiny").unwrap(),
            dir.path(),
            &GenModelOptions::default(),
        )
        .unwrap();
        let m = HostModel::load(dir.path()).unwrap();
        (dir, m)
    }

    fn cfg() -> EngineConfig {
        EngineConfig {
            num_kv_blocks: 7,
            max_batch_tokens: 64,
            ..Default::default()
        }
    }

    /// The CPU backend with a pretend device: `used` bytes gone between the two probes.
    #[test]
    fn sizes_the_cache_from_the_profile_and_serves_with_it() {
        let (_d, model) = tiny();
        let backend = CpuBackend::new(&model.config);
        let page = 4096u64;
        let calls = Cell::new(0);
        let used = 300 * page + 123;
        let probe = |_: &CpuBackend| {
            calls.set(calls.get() + 1);
            let free = if calls.get() == 1 {
                1000 * page
            } else {
                // The profile's one remaining KV block is not the model's.
                1000 * page - used - page
            };
            Ok(Some(DeviceMemory {
                free,
                total: 1000 * page,
            }))
        };
        let sizing = Sizing {
            utilization: 0.5,
            page_bytes: page,
            min_pages: 4,
        };
        let (mut engine, pages) = build_engine(backend, model, cfg(), Some(sizing), probe).unwrap();
        assert_eq!(calls.get(), 2);
        // floor((500 pages − used) / page) = 500 − 301.
        assert_eq!(pages, 199);
        assert_eq!(engine.kv_usage().total_blocks, 199);
        assert_eq!(
            engine.kv_usage().used_blocks,
            0,
            "the profile freed its blocks"
        );
        // The resized cache serves.
        engine
            .add_sequence(
                SeqId(1),
                SequenceParams {
                    prompt: vec![1, 2, 3],
                    max_new_tokens: 2,
                    ..Default::default()
                },
            )
            .unwrap();
        let out = engine
            .step(&StepPlan {
                items: vec![PlanItem {
                    seq: SeqId(1),
                    num_tokens: 3,
                }],
                return_logits: false,
            })
            .unwrap();
        assert_eq!(out.len(), 1);
    }

    /// A device of 1000 pages on which the model and the profile take `used` pages.
    fn fake_device(
        page: u64,
        used: u64,
    ) -> impl Fn(&CpuBackend) -> thaw_runtime::Result<Option<DeviceMemory>> {
        let calls = Cell::new(0u32);
        move |_: &CpuBackend| {
            calls.set(calls.get() + 1);
            let gone = if calls.get() == 1 {
                0
            } else {
                (used + 1) * page
            };
            Ok(Some(DeviceMemory {
                free: 1000 * page - gone,
                total: 1000 * page,
            }))
        }
    }

    /// The flag combinations users pass (the tiny model's context is 512): `--max-model-len`
    /// below, equal to and above `--max-num-batched-tokens`, and vLLM's defaults (no
    /// `--max-model-len`, so the model's context, with 2048 batched tokens above it). Each
    /// sizes its cache from the profile and then serves a sequence of the full context.
    #[test]
    fn sizes_for_every_model_len_and_batch_combination() {
        let defaults = EngineConfig::default();
        for (max_context, max_batch_tokens) in [
            (Some(256), 512),
            (Some(256), 256),
            (Some(512), 512),
            (Some(512), 128),
            (Some(2), 2048),
            (None, defaults.max_batch_tokens),
            (Some(100), defaults.max_batch_tokens),
        ] {
            let (_d, model) = tiny();
            let backend = CpuBackend::new(&model.config);
            let page = 4096u64;
            let cfg = EngineConfig {
                max_context,
                max_batch_tokens,
                ..EngineConfig::default()
            };
            let context = max_context.unwrap_or(512);
            let sizing = Sizing {
                utilization: 0.9,
                page_bytes: page,
                min_pages: context.div_ceil(cfg.kv_block_size),
            };
            let case = format!("--max-model-len {max_context:?}, batched {max_batch_tokens}");
            let (mut engine, pages) =
                build_engine(backend, model, cfg, Some(sizing), fake_device(page, 200))
                    .unwrap_or_else(|e| panic!("{case}: {e:#}"));
            // floor(0.9 × 1000 pages) less the 200 the model and the profile took.
            assert_eq!(pages, 700, "{case}");
            assert_eq!(
                engine.kv_usage().used_blocks,
                0,
                "{case}: the profile freed its blocks"
            );
            // A request of the whole context, prefilled in chunks of the step's budget.
            engine
                .add_sequence(
                    SeqId(1),
                    SequenceParams {
                        prompt: (0..context as u32 - 1).map(|t| 3 + t % 500).collect(),
                        max_new_tokens: 1,
                        ..Default::default()
                    },
                )
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            let mut left = context - 1;
            while left > 0 {
                let n = left.min(max_batch_tokens);
                engine
                    .step(&StepPlan {
                        items: vec![PlanItem {
                            seq: SeqId(1),
                            num_tokens: n,
                        }],
                        return_logits: false,
                    })
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                left -= n;
            }
        }
    }

    #[test]
    fn a_context_of_one_token_is_refused_with_what_to_do() {
        let (_d, model) = tiny();
        let backend = CpuBackend::new(&model.config);
        let cfg = EngineConfig {
            max_context: Some(1),
            ..EngineConfig::default()
        };
        let sizing = Sizing {
            utilization: 0.9,
            page_bytes: 4096,
            min_pages: 1,
        };
        let e = build_engine(backend, model, cfg, Some(sizing), fake_device(4096, 10))
            .err()
            .unwrap();
        assert!(e.to_string().contains("use at least 2"), "{e}");
    }

    proptest::proptest! {
        /// The profile step is what the engine accepts and as large as the scheduler may send:
        /// every prompt plus its sampled token fits the context, no more sequences than a step
        /// holds, and the tokens are the step budget unless those sequences cannot hold it.
        #[test]
        fn profile_is_the_largest_step_the_model_accepts(
            tokens in 1usize..20_000,
            seqs in 1usize..300,
            context in 2usize..10_000,
        ) {
            let p = profile_prompts(tokens, seqs, context);
            proptest::prop_assert!(!p.is_empty() && p.len() <= seqs);
            proptest::prop_assert!(p.iter().all(|&l| l >= 1 && l < context), "{p:?}");
            let total: usize = p.iter().sum();
            proptest::prop_assert_eq!(total, tokens.min(seqs * (context - 1)));
            // The fewest sequences: all but the last are full.
            proptest::prop_assert!(p[..p.len() - 1].iter().all(|&l| l == context - 1));
        }
    }

    #[test]
    fn cpu_keeps_its_blocks_and_a_full_device_is_an_error() {
        let (_d, model) = tiny();
        let backend = CpuBackend::new(&model.config);
        let sizing = Sizing {
            utilization: 0.9,
            page_bytes: 4096,
            min_pages: 4,
        };
        let (engine, pages) =
            build_engine(backend, model, cfg(), Some(sizing), |_| Ok(None)).unwrap();
        assert_eq!((pages, engine.kv_usage().total_blocks), (7, 7));

        let (_d, model) = tiny();
        let backend = CpuBackend::new(&model.config);
        // Another process holds most of the device.
        let busy = |_: &CpuBackend| {
            Ok(Some(DeviceMemory {
                free: 100 << 20,
                total: 1 << 30,
            }))
        };
        let e = build_engine(backend, model, cfg(), Some(sizing), busy)
            .err()
            .unwrap();
        assert!(e.to_string().contains("--gpu-memory-utilization"), "{e}");
    }
}
