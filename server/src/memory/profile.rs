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

/// The sequence id of the profiling prefill (never a request's: those count up from 1).
const PROFILE_SEQ: SeqId = SeqId(u64::MAX);

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
    let tokens = cfg.max_batch_tokens.min(context).max(1);
    cfg.num_kv_blocks = tokens.div_ceil(cfg.kv_block_size.max(1)) + 1;
    let vocab = model.config.vocab_size.max(1);
    let caching = cfg.enable_prefix_caching;
    let mut engine = Engine::new(backend, model, cfg)?;
    // A measurement, not a request: nothing of it is looked up in, or left in, the cache.
    engine.set_prefix_caching(false);
    let prompt: Vec<u32> = (0..tokens).map(|i| (i % vocab) as u32).collect();
    engine.add_sequence(
        PROFILE_SEQ,
        SequenceParams {
            prompt,
            max_new_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        },
    )?;
    engine.step(&StepPlan {
        items: vec![PlanItem {
            seq: PROFILE_SEQ,
            num_tokens: tokens,
        }],
        return_logits: false,
    })?;
    // One token of one: the step finished it; remove it if it did not.
    let _ = engine.remove_sequence(PROFILE_SEQ);
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
mod tests {
    use super::*;
    use crate::gen::{preset, write_model, GenModelOptions};
    use std::cell::Cell;
    use thaw_runtime::backend::cpu::CpuBackend;

    fn tiny() -> (tempfile::TempDir, HostModel) {
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
