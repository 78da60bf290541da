//! `thaw-bench engine --model DIR --lora DIR…`: the engine on a real model (e.g. SmolLM2-135M
//! saved by transformers) with real PEFT adapters, in-process (no HTTP): prefill and decode
//! tok/s for batches of 1, 8 and 16 sequences with the adapters mixed (round robin), at each
//! CPU thread count asked for. Thread counts alternate within every repetition (so a noisy
//! neighbour hits them alike) and the median is reported.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_kernels::cpu::{set_simd_level, SimdLevel};
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cpu_par::CpuThreads;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};

/// What one real-model run measures.
#[derive(Clone, Debug)]
pub struct RealArgs {
    pub model: PathBuf,
    pub loras: Vec<PathBuf>,
    pub batches: Vec<usize>,
    pub threads: Vec<usize>,
    /// Decode kernel levels compared (each cell runs at each).
    pub simd: Vec<SimdLevel>,
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub reps: usize,
}

/// One (batch, threads) cell: medians over the repetitions.
#[derive(Clone, Debug, PartialEq)]
pub struct RealRow {
    pub batch: usize,
    pub threads: usize,
    pub simd: SimdLevel,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every (batch, threads) cell `reps` times, interleaved.
pub fn run(a: &RealArgs) -> anyhow::Result<Vec<RealRow>> {
    let model = HostModel::load(&a.model)?;
    let adapters = a
        .loras
        .iter()
        .map(|d| LoraAdapter::load(d, &model.config).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let levels = if a.simd.is_empty() {
        vec![SimdLevel::Avx2]
    } else {
        a.simd.clone()
    };
    let cells: Vec<(usize, usize, SimdLevel)> = a
        .batches
        .iter()
        .flat_map(|&b| {
            let levels = &levels;
            a.threads
                .iter()
                .flat_map(move |&t| levels.iter().map(move |&l| (b, t, l)))
        })
        .collect();
    let mut got = vec![(Vec::new(), Vec::new(), SimdLevel::Portable); cells.len()];
    for rep in 0..a.reps.max(1) {
        for (i, &(b, t, l)) in cells.iter().enumerate() {
            // The level in effect (AVX2 asked on a CPU without it runs portable).
            got[i].2 = set_simd_level(l);
            let (p, d) = measure(a, &model, &adapters, b, t, rep as u64)?;
            got[i].0.push(p);
            got[i].1.push(d);
        }
    }
    set_simd_level(SimdLevel::Avx2);
    Ok(cells
        .into_iter()
        .zip(got)
        .map(|((batch, threads, _), (p, d, simd))| RealRow {
            batch,
            threads,
            simd,
            prefill_tok_s: median(p),
            decode_tok_s: median(d),
        })
        .collect())
}

pub(crate) fn measure(
    a: &RealArgs,
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    batch: usize,
    threads: usize,
    seed: u64,
) -> anyhow::Result<(f64, f64)> {
    let cfg = EngineConfig {
        max_batch_tokens: batch * a.prompt_len,
        max_batch_seqs: batch,
        num_kv_blocks: batch * (a.prompt_len + a.decode_steps + 1).div_ceil(16),
        ..Default::default()
    };
    let t = CpuThreads {
        threads,
        ..CpuThreads::default()
    };
    let backend = CpuBackend::with_threads(&model.config, t)?;
    let mut e = Engine::new(backend, model.clone(), cfg)?;
    for (i, ad) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), ad.clone())?;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config.vocab_size as u32;
    for s in 0..batch {
        e.add_sequence(
            SeqId(s as u64),
            SequenceParams {
                prompt: (0..a.prompt_len)
                    .map(|_| rng.random_range(100..vocab))
                    .collect(),
                adapter: (!adapters.is_empty()).then(|| AdapterId((s % adapters.len()) as u32)),
                max_new_tokens: a.decode_steps + 1,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    let plan = |n| StepPlan {
        items: (0..batch)
            .map(|s| PlanItem {
                seq: SeqId(s as u64),
                num_tokens: n,
            })
            .collect(),
        return_logits: false,
    };
    let t0 = Instant::now();
    e.step(&plan(a.prompt_len))?;
    let prefill = (batch * a.prompt_len) as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for _ in 0..a.decode_steps {
        e.step(&plan(1))?;
    }
    let decode = (batch * a.decode_steps) as f64 / t0.elapsed().as_secs_f64();
    Ok((prefill, decode))
}

/// The report: one row per (batch, threads), decode speed-up over the first thread count.
pub fn table(a: &RealArgs, rows: &[RealRow]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "CPU backend, model {}, {} adapter(s) mixed round robin, {} prompt tokens, {} decode \
         steps, median of {}",
        a.model.display(),
        a.loras.len(),
        a.prompt_len,
        a.decode_steps,
        a.reps.max(1)
    );
    let _ = writeln!(
        s,
        "| batch | threads | kernels | prefill tok/s | decode tok/s | decode vs first row of the batch |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let base = rows
            .iter()
            .find(|o| o.batch == r.batch)
            .map_or(r.decode_tok_s, |o| o.decode_tok_s);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {:.1} | {:.2}× |",
            r.batch,
            r.threads,
            r.simd.name(),
            r.prefill_tok_s,
            r.decode_tok_s,
            r.decode_tok_s / base
        );
    }
    s
}

/// A generated tiny HF model under `dir/model` and one PEFT adapter per rank in `ranks` under
/// `dir/adapters`, targeting `targets` (indices into [`Projection::ALL`]): what the real-model
/// benches' tests run on.
#[cfg(test)]
pub(crate) fn tiny_model_with_adapters(
    dir: &std::path::Path,
    ranks: &[usize],
    targets: &[usize],
) -> (PathBuf, Vec<PathBuf>) {
    use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
    let model = dir.join("model");
    gen::write_model(
        &gen::preset("tiny").unwrap(),
        &model,
        &GenModelOptions::default(),
    )
    .unwrap();
    let loras = gen::write_adapters(&GenAdaptersOptions {
        model_dir: model.clone(),
        out_dir: dir.join("adapters"),
        count: ranks.len(),
        ranks: ranks.to_vec(),
        targets: targets.iter().map(|&t| Projection::ALL[t]).collect(),
        ..Default::default()
    })
    .unwrap();
    (model, loras)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real-model mode runs on any HF directory: a generated tiny one here.
    #[test]
    fn real_mode_reports_every_batch_and_thread_count() {
        let tmp = tempfile::tempdir().unwrap();
        let (model, loras) = tiny_model_with_adapters(tmp.path(), &[4, 8], &[0, 2]);
        let a = RealArgs {
            model,
            loras,
            batches: vec![1, 3],
            threads: vec![1, 2],
            simd: vec![SimdLevel::Avx2],
            prompt_len: 8,
            decode_steps: 2,
            reps: 1,
        };
        let rows = run(&a).unwrap();
        let cells: Vec<_> = rows.iter().map(|r| (r.batch, r.threads)).collect();
        assert_eq!(cells, [(1, 1), (1, 2), (3, 1), (3, 2)]);
        assert!(rows
            .iter()
            .all(|r| r.prefill_tok_s > 0.0 && r.decode_tok_s > 0.0));
        assert_eq!(
            table(&a, &rows)
                .lines()
                .filter(|l| l.starts_with("| "))
                .count(),
            5
        );
    }
}
