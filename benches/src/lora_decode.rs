//! `thaw-bench lora-decode --model DIR --lora DIR`: what an adapter costs a one-sequence decode
//! step on the CPU backend, in one process, step by step. Three sequences with the same prompt
//! decode in turn — the base model; the adapter with its deltas computed beside the base
//! products (the default); the same adapter with its deltas after them on the engine thread
//! (the path before, [`set_fused_lora`]`(false)`) — rotating which goes first every round. A
//! round takes tens of milliseconds, so the VM's slower swings hit the three alike and the
//! per-round differences are paired.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cpu_par::CpuThreads;
use thaw_runtime::backend::set_fused_lora;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};

/// Options of `thaw-bench lora-decode`.
#[derive(clap::Args, Clone, Debug)]
pub struct LoraDecodeArgs {
    /// HF model directory (e.g. SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory.
    #[arg(long)]
    pub lora: PathBuf,
    /// CPU compute threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Prompt tokens of each sequence (prefilled before the timed steps).
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Rounds of three timed decode steps.
    #[arg(long, default_value_t = 200)]
    pub rounds: usize,
}

const NAMES: [&str; 3] = ["base model", "adapter, fused", "adapter, after"];

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the rounds; returns the step times (ms) of each configuration, round by round.
pub fn run(a: &LoraDecodeArgs) -> anyhow::Result<[Vec<f64>; 3]> {
    let model = HostModel::load(&a.model)?;
    let adapter = Arc::new(LoraAdapter::load(&a.lora, &model.config)?);
    let warm = 4;
    let cfg = EngineConfig {
        max_batch_tokens: a.prompt_len.max(1),
        max_batch_seqs: 3,
        num_kv_blocks: 3 * (a.prompt_len + a.rounds + warm + 2).div_ceil(16),
        ..Default::default()
    };
    let t = CpuThreads {
        threads: a.threads,
        ..CpuThreads::default()
    };
    let backend = CpuBackend::with_threads(&model.config, t)?;
    let mut e = Engine::new(backend, model.clone(), cfg)?;
    e.register_adapter(AdapterId(0), adapter)?;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt_len)
        .map(|_| rng.random_range(100..vocab))
        .collect();
    for s in 0..3u64 {
        e.add_sequence(
            SeqId(s),
            SequenceParams {
                prompt: prompt.clone(),
                adapter: (s > 0).then_some(AdapterId(0)),
                max_new_tokens: a.rounds + warm + 2,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    let one = |s: usize, n: usize| StepPlan {
        items: vec![PlanItem {
            seq: SeqId(s as u64),
            num_tokens: n,
        }],
        return_logits: false,
    };
    for s in 0..3 {
        e.step(&one(s, a.prompt_len))?;
        for _ in 0..warm {
            e.step(&one(s, 1))?;
        }
    }
    let mut ms: [Vec<f64>; 3] = Default::default();
    for r in 0..a.rounds {
        for j in 0..3 {
            let c = (j + r) % 3;
            set_fused_lora(c != 2);
            let t0 = Instant::now();
            e.step(&one(c, 1))?;
            ms[c].push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    set_fused_lora(true);
    Ok(ms)
}

/// Medians per configuration, and the paired per-round differences.
pub fn table(a: &LoraDecodeArgs, ms: &[Vec<f64>; 3]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "CPU backend, model {}, adapter {}, {} threads, {}-token prompt, {} rounds of 3 one-sequence decode steps",
        a.model.display(),
        a.lora.display(),
        a.threads,
        a.prompt_len,
        a.rounds
    );
    let _ = writeln!(s, "| step | median ms | P10 ms | P90 ms |");
    let _ = writeln!(s, "|---|---|---|---|");
    for (name, v) in NAMES.iter().zip(ms) {
        let mut w = v.clone();
        w.sort_by(f64::total_cmp);
        let q = |f: f64| w[((w.len() - 1) as f64 * f) as usize];
        let _ = writeln!(
            s,
            "| {name} | {:.2} | {:.2} | {:.2} |",
            q(0.5),
            q(0.1),
            q(0.9)
        );
    }
    let _ = writeln!(
        s,
        "\n| paired per round | median ms | rounds where positive |"
    );
    let _ = writeln!(s, "|---|---|---|");
    for (x, y) in [(1, 0), (2, 0), (2, 1)] {
        let d: Vec<f64> = ms[x].iter().zip(&ms[y]).map(|(p, q)| p - q).collect();
        let pos = d.iter().filter(|&&v| v > 0.0).count();
        let _ = writeln!(
            s,
            "| {} − {} | {:+.3} | {pos}/{} |",
            NAMES[x],
            NAMES[y],
            median(&d),
            d.len()
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_real::tiny_model_with_adapters;

    /// Every configuration gets one timed step a round, and the table has a row for each
    /// configuration and each paired difference.
    #[test]
    fn every_configuration_steps_once_a_round() {
        let tmp = tempfile::tempdir().unwrap();
        let (model, loras) = tiny_model_with_adapters(tmp.path(), &[8], &[0, 3]);
        let a = LoraDecodeArgs {
            model,
            lora: loras[0].clone(),
            threads: 2,
            prompt_len: 8,
            rounds: 5,
        };
        let ms = run(&a).unwrap();
        assert!(ms
            .iter()
            .all(|v| v.len() == 5 && v.iter().all(|&t| t > 0.0)));
        let rows = table(&a, &ms)
            .lines()
            .filter(|l| l.starts_with("| "))
            .count();
        assert_eq!(rows, 2 + 3 + 3);
    }
}
