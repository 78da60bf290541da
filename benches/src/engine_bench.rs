//! `thaw-bench engine`: CPU prefill and decode throughput of the engine on a generated model
//! with 0, 1 and N distinct adapters in the batch, and the LoRA overhead ratio.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};

/// Options of `thaw-bench engine`.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineBenchArgs {
    /// Model preset to generate (tiny, small, …).
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Sequences in the batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Decode steps measured after the prefill.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// LoRA rank of every adapter.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Distinct-adapter counts to compare (0 = base model only).
    #[arg(long, value_delimiter = ',', default_value = "0,1,8")]
    pub adapters: Vec<usize>,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Where to generate the model (a temporary directory when absent).
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// A seconds-long version (tiny model) for smoke runs.
    #[arg(long)]
    pub quick: bool,
    /// Real-model mode: an HF model directory (e.g. SmolLM2-135M-Instruct) instead of a
    /// generated preset; reports batches `--batches` at `--threads`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// PEFT adapter directories for real-model mode, mixed round robin over the batch.
    #[arg(long = "lora", value_name = "DIR")]
    pub loras: Vec<PathBuf>,
    /// Batch sizes in real-model mode.
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    pub batches: Vec<usize>,
    /// CPU compute thread counts compared in real-model mode (alternated every repetition).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Decode kernels compared in real-model mode (`portable`, `avx2`; alternated like the
    /// thread counts; `avx2` falls back to portable on CPUs without it).
    #[arg(long, value_delimiter = ',', default_value = "avx2")]
    pub simd: Vec<crate::quant_bench::Simd>,
}

impl EngineBenchArgs {
    /// A seconds-long configuration for the test suite.
    pub fn quick() -> Self {
        Self {
            preset: "tiny".into(),
            batch: 4,
            prompt_len: 16,
            decode_steps: 4,
            rank: 8,
            adapters: vec![0, 1, 4],
            reps: 1,
            workdir: None,
            quick: true,
            model: None,
            loras: Vec::new(),
            batches: vec![1, 8, 16],
            threads: vec![1, 2],
            simd: vec![crate::quant_bench::Simd::Avx2],
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBenchRow {
    pub adapters: usize,
    pub kernel: Option<LoraKernel>,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// Runs the benchmark and returns its rows (the first is the base model).
pub fn run(args: &EngineBenchArgs) -> anyhow::Result<Vec<EngineBenchRow>> {
    let quick;
    let args = if args.quick {
        quick = EngineBenchArgs::quick();
        &quick
    } else {
        args
    };
    let tmp = tempfile::tempdir()?;
    let root = args
        .workdir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let preset = gen::preset(&args.preset).with_context(|| {
        format!(
            "unknown preset {}; try one of {:?}",
            args.preset,
            gen::PRESET_NAMES
        )
    })?;
    let model_dir = root.join("model");
    if !model_dir.join("config.json").exists() {
        gen::write_model(&preset, &model_dir, &GenModelOptions::default())?;
    }
    let model = HostModel::load(&model_dir)?;
    let max_adapters = args.adapters.iter().copied().max().unwrap_or(0);
    let adapter_dirs = if max_adapters > 0 {
        gen::write_adapters(&GenAdaptersOptions {
            model_dir: model_dir.clone(),
            out_dir: root.join("adapters"),
            count: max_adapters,
            ranks: vec![args.rank],
            targets: Projection::ALL.to_vec(),
            ..Default::default()
        })?
    } else {
        Vec::new()
    };
    let adapters = adapter_dirs
        .iter()
        .map(|d| LoraAdapter::load(d, &model.config).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;

    let mut rows = Vec::new();
    for &n in &args.adapters {
        let kernels: &[Option<LoraKernel>] = if n == 0 {
            &[None]
        } else {
            &[Some(LoraKernel::Sgmv), Some(LoraKernel::Bgmv)]
        };
        for &kernel in kernels {
            let mut best = (0.0f64, 0.0f64);
            for _ in 0..args.reps.max(1) {
                let (p, d) = measure(args, &model, &adapters[..n], kernel.unwrap_or_default())?;
                best = (best.0.max(p), best.1.max(d));
            }
            rows.push(EngineBenchRow {
                adapters: n,
                kernel,
                prefill_tok_s: best.0,
                decode_tok_s: best.1,
            });
        }
    }
    Ok(rows)
}

/// Prefill then decode `args.batch` sequences spread over `adapters` (round robin).
fn measure(
    args: &EngineBenchArgs,
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    kernel: LoraKernel,
) -> anyhow::Result<(f64, f64)> {
    let cfg = EngineConfig {
        max_batch_tokens: args.batch * args.prompt_len,
        max_batch_seqs: args.batch,
        num_kv_blocks: args.batch * (args.prompt_len + args.decode_steps + 1).div_ceil(16),
        lora_kernel: kernel,
        ..Default::default()
    };
    let mut e = Engine::new(CpuBackend::new(&model.config), model.clone(), cfg)?;
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone())?;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let vocab = model.config.vocab_size as u32;
    for s in 0..args.batch {
        e.add_sequence(
            SeqId(s as u64),
            SequenceParams {
                prompt: (0..args.prompt_len)
                    .map(|_| rng.random_range(3..vocab))
                    .collect(),
                adapter: (!adapters.is_empty()).then(|| AdapterId((s % adapters.len()) as u32)),
                max_new_tokens: args.decode_steps + 1,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    let plan = |n| StepPlan {
        items: (0..args.batch)
            .map(|s| PlanItem {
                seq: SeqId(s as u64),
                num_tokens: n,
            })
            .collect(),
        return_logits: false,
    };
    let t = Instant::now();
    e.step(&plan(args.prompt_len))?;
    let prefill = (args.batch * args.prompt_len) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..args.decode_steps {
        e.step(&plan(1))?;
    }
    let decode = (args.batch * args.decode_steps) as f64 / t.elapsed().as_secs_f64();
    Ok((prefill, decode))
}

/// The report as a Markdown table, overheads relative to the base model.
pub fn table(args: &EngineBenchArgs, rows: &[EngineBenchRow]) -> String {
    use std::fmt::Write;
    let base = rows.iter().find(|r| r.adapters == 0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "CPU backend, preset {}, batch {} × {} prompt tokens, {} decode steps, rank {} on q,k,v,o,gate,up,down",
        args.preset, args.batch, args.prompt_len, args.decode_steps, args.rank
    );
    let _ = writeln!(
        s,
        "| adapters in batch | kernel | prefill tok/s | decode tok/s | prefill LoRA overhead | decode LoRA overhead |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let over = |v: f64, b: f64| format!("{:.2}×", b / v);
        let (po, dpo) = match base {
            Some(b) if r.adapters > 0 => (
                over(r.prefill_tok_s, b.prefill_tok_s),
                over(r.decode_tok_s, b.decode_tok_s),
            ),
            _ => ("1.00×".into(), "1.00×".into()),
        };
        let k = r.kernel.map_or("-".to_string(), |k| format!("{k:?}"));
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.1} | {} | {} |",
            r.adapters, k, r.prefill_tok_s, r.decode_tok_s, po, dpo
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_engine_bench_reports_every_configuration() {
        let args = EngineBenchArgs::quick();
        let rows = run(&args).unwrap();
        // base + (SGMV, BGMV) for each non-zero adapter count.
        assert_eq!(rows.len(), 1 + 2 * 2);
        assert!(rows
            .iter()
            .all(|r| r.prefill_tok_s > 0.0 && r.decode_tok_s > 0.0));
        let t = table(&args, &rows);
        assert_eq!(
            t.lines().filter(|l| l.starts_with("| ")).count(),
            1 + rows.len()
        );
    }
}
