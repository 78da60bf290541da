//! Start-up measurement of the performance model's inputs (the LoRA kernels' terms start at
//! the model's priors and are learned from served steps).
use crate::perf::PerfModel;

/// Measures the cost model's inputs on `engine`: device time per layer from a throwaway
/// sequence's prefill and decode steps, CPU LoRA throughput from the worker pool's profile
/// (or, with no pool, from timing the kernel on the engine thread), the link from the backend.
pub fn calibrate<B>(engine: &mut thaw_runtime::engine::Engine<B>) -> thaw_runtime::Result<PerfModel>
where
    B: thaw_runtime::backend::Backend + thaw_runtime::backend::any::HostLink,
{
    // The same prompt runs three times: each must be computed, not found in the prefix cache.
    let caching = engine.engine_config().enable_prefix_caching;
    engine.set_prefix_caching(false);
    let measured = measure(engine);
    engine.set_prefix_caching(caching);
    measured
}

fn measure<B>(engine: &mut thaw_runtime::engine::Engine<B>) -> thaw_runtime::Result<PerfModel>
where
    B: thaw_runtime::backend::Backend + thaw_runtime::backend::any::HostLink,
{
    use std::time::Instant;
    use thaw_runtime::engine::{PlanItem, SequenceParams, StepPlan};
    use thaw_runtime::ids::SeqId;

    let c = engine.model_config().clone();
    // A prefill of `big` tokens and one decode step: `big + 2` must fit the context. In a
    // context too short for both (2 tokens), the decode step is the prefill of one.
    let context = engine.max_context();
    let big = 64
        .min(engine.engine_config().max_batch_tokens)
        .min(context.saturating_sub(2))
        .max(1);
    let new_tokens = if big + 2 <= context { 2 } else { 1 };
    let seq = SeqId(u64::MAX);
    let time_step =
        |n: usize, e: &mut thaw_runtime::engine::Engine<_>| -> thaw_runtime::Result<f64> {
            let t = Instant::now();
            e.step(&StepPlan {
                items: vec![PlanItem { seq, num_tokens: n }],
                return_logits: false,
            })?;
            Ok(t.elapsed().as_secs_f64())
        };
    let mut samples = Vec::new();
    for _ in 0..3 {
        engine.add_sequence(
            seq,
            SequenceParams {
                prompt: (0..big as u32)
                    .map(|i| 3 + i % (c.vocab_size as u32 - 3))
                    .collect(),
                max_new_tokens: new_tokens,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
        let prefill = time_step(big, engine)?;
        let decode = if new_tokens == 2 {
            time_step(1, engine)?
        } else {
            prefill
        };
        let _ = engine.remove_sequence(seq);
        samples.push((prefill, decode));
    }
    // Median of each, then a line through (1, decode) and (big, prefill).
    let mut p: Vec<f64> = samples.iter().map(|s| s.0).collect();
    let mut d: Vec<f64> = samples.iter().map(|s| s.1).collect();
    p.sort_by(f64::total_cmp);
    d.sort_by(f64::total_cmp);
    let layers = c.num_layers.max(1) as f64;
    let (p, d) = (p[1] / layers, d[1] / layers);
    let per_token = ((p - d) / (big as f64 - 1.0).max(1.0)).max(1e-9);
    let base = (d - per_token).max(0.0);
    let (cpu_flops, cpu_overlaps) = match engine.pool() {
        Some(pool) => (
            (0..pool.n_workers())
                .map(|w| pool.profile().gflops(w))
                .sum::<f64>()
                * 1e9,
            true,
        ),
        None => (inline_lora_flops(c.hidden_size), false),
    };
    // Prior of the GPU-LoRA terms: one rank unit of one row costs 2·(d_in + d_out) FLOP per
    // targeted projection; four projections of `hidden` width at the engine thread's rate.
    let lora_rank_row = 16.0 * c.hidden_size as f64 / inline_lora_flops(c.hidden_size);
    Ok(PerfModel {
        layer_base_s: base,
        layer_per_token_s: per_token,
        num_layers: c.num_layers,
        cpu_flops,
        cpu_overlaps,
        link: engine.backend().link(),
        // The CUDA backend computes in bf16 from the f32 host copy; the CPU backend in f32.
        host_encode_bytes_per_s: encode_rate(engine.backend_name() == "cuda"),
        // Workers read a disk-tier adapter from its mapped file (a host-store file entry) as
        // soon as it is registered, without waiting for the read into the host tier.
        assist_reads_disk: engine.pool().is_some(),
        file_read_bytes_per_s: file_read_rate(),
        // A few doorbell round trips per layer until assisted steps are measured.
        assist_layer_overhead_s: if cpu_overlaps { 100e-6 } else { 0.0 },
        alpha: 0.1,
        lora_sgmv_s: lora_rank_row,
        lora_bgmv_s: lora_rank_row,
        ..Default::default()
    })
}

/// Bytes of f32 adapter weights per second this thread encodes into the bytes a copy sends:
/// to bf16 when `to_bf16`, else as they are (a copy), into a buffer written before (as a
/// pinned arena would be), best of three passes over 16 MiB.
fn encode_rate(to_bf16: bool) -> f64 {
    use std::time::Instant;
    let n = 4 << 20;
    let src: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1009) as f32 / 1009.0 - 0.5)
        .collect();
    let mut dst = vec![0u8; n * if to_bf16 { 2 } else { 4 }];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        if to_bf16 {
            for (d, &x) in dst.chunks_exact_mut(2).zip(&src) {
                d.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        } else {
            for (d, &x) in dst.chunks_exact_mut(4).zip(&src) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 4) as f64 / best.max(1e-9)
}

/// Bytes per second this process reads a file whose pages are in the page cache (as the CPU
/// workers read a disk-tier adapter's file): a 16 MiB file written to the temporary
/// directory, best of three reads; 0 (unmeasured) if it cannot be written.
fn file_read_rate() -> f64 {
    use std::io::{Read, Seek, Write};
    use std::time::Instant;
    let n = 16usize << 20;
    let path = std::env::temp_dir().join(format!(
        "thaw-calibrate-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let measure = || -> std::io::Result<f64> {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)?;
        let data: Vec<u8> = (0..n).map(|i| (i * 7919 % 251) as u8).collect();
        f.write_all(&data)?;
        let mut buf = vec![0u8; n];
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            f.rewind()?;
            let t = Instant::now();
            f.read_exact(&mut buf)?;
            std::hint::black_box(&mut buf);
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(n as f64 / best.max(1e-9))
    };
    let rate = measure().unwrap_or(0.0);
    let _ = std::fs::remove_file(&path);
    rate
}

/// FLOP/s of the LoRA kernel on this thread for a rank-16, 32-row problem of `hidden` width.
fn inline_lora_flops(hidden: usize) -> f64 {
    use std::time::Instant;
    use thaw_kernels::cpu::{sgmv, LoraRef, LoraSegment};
    let (rows, rank) = (32usize, 16usize);
    let x: Vec<f32> = (0..rows * hidden)
        .map(|i| ((i * 7919) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let a: Vec<f32> = (0..rank * hidden)
        .map(|i| ((i * 104729) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let b = a.clone();
    let mut y = vec![0.0f32; rows * hidden];
    let mut scratch = Vec::new();
    let seg = LoraSegment {
        rows: 0..rows,
        lora: LoraRef {
            a: &a,
            b: &b,
            rank,
            scale: 1.0,
        },
    };
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        sgmv(
            &x,
            hidden,
            std::slice::from_ref(&seg),
            &mut y,
            hidden,
            &mut scratch,
        );
    }
    let flops = 2.0 * rows as f64 * rank as f64 * 2.0 * hidden as f64 * reps as f64;
    flops / t.elapsed().as_secs_f64().max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use thaw_runtime::backend::cpu::CpuBackend;
    use thaw_runtime::engine::{Engine, EngineConfig};

    /// Calibration runs at every context a server accepts (its prefill and decode fit even in
    /// the shortest), measures finite, positive costs, and leaves no sequence behind.
    #[test]
    fn calibrates_at_every_context_and_batch() {
        let (_dir, model) = crate::memory::profile::tests::tiny();
        for (max_context, max_batch_tokens) in
            [(Some(2), 64), (Some(3), 64), (None, 1), (None, 2048)]
        {
            let cfg = EngineConfig {
                max_context,
                max_batch_tokens,
                ..EngineConfig::default()
            };
            let mut engine =
                Engine::new(CpuBackend::new(&model.config), model.clone(), cfg).unwrap();
            let m = calibrate(&mut engine)
                .unwrap_or_else(|e| panic!("{max_context:?}, {max_batch_tokens}: {e}"));
            assert!(
                m.layer_per_token_s.is_finite() && m.layer_per_token_s > 0.0,
                "{m:?}"
            );
            assert!(m.layer_base_s.is_finite() && m.layer_base_s >= 0.0, "{m:?}");
            assert!(m.host_encode_bytes_per_s > 0.0, "{m:?}");
            assert!(m.file_read_bytes_per_s > 0.0, "{m:?}");
            // No worker pool: CPU assist of a disk-tier adapter waits for the host tier.
            assert!(!m.assist_reads_disk, "{m:?}");
            assert_eq!(engine.kv_usage().used_blocks, 0);
        }
    }
}
