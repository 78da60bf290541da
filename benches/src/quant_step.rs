//! `thaw-bench weight-formats --model PATH…`: the whole engine (in process, no HTTP) on a
//! real model in each stored precision, batches of 1, 8 and 16 sequences with the adapters
//! mixed round robin: prefill and decode tok/s, the workload's tok/s (output tokens over
//! prefill + decode time, what `benches/peers/side_by_side.py` reports over HTTP) and each
//! batch's workload tok/s over batch 1's. Models alternate within every round (so a noisy
//! neighbour hits them alike); the median round is reported.
//!
//! Each `--model` is a HF directory or a GGUF file, measured as stored; `--convert` adds the
//! first HF model re-encoded by Thaw's quantiser (f16, bf16, q8_0, q4_0, q4_1; K-quants come
//! from llama.cpp's `llama-quantize` as GGUF files).
use std::path::PathBuf;
use std::sync::Arc;

use thaw_kernels::cpu::{SimdLevel, WeightFormat};
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::engine::HostModel;

use crate::engine_real::{measure, RealArgs};
use crate::quant_bench::WeightFormatsArgs;

/// One model as measured: its label, weights and adapters.
struct Subject {
    label: String,
    model: HostModel,
    adapters: Vec<Arc<LoraAdapter>>,
}

fn parse_format(s: &str) -> anyhow::Result<WeightFormat> {
    WeightFormat::ALL
        .into_iter()
        .find(|f| f.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| {
            anyhow::anyhow!("--convert {s}: not a weight format (f32, f16, bf16, q8_0, q4_0, q4_1)")
        })
}

fn subjects(a: &WeightFormatsArgs) -> anyhow::Result<Vec<Subject>> {
    let mut out = Vec::new();
    for path in &a.model {
        let model = HostModel::load(path)?;
        let adapters = a
            .lora
            .iter()
            .map(|d| LoraAdapter::load(d, &model.config).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        if out.is_empty() && !thaw_runtime::model::gguf::is_gguf_path(path) {
            for f in &a.convert {
                let mut m = model.clone();
                m.convert_weights(parse_format(f)?)?;
                out.push(Subject {
                    label: format!("{name} → {}", m.format_mix()),
                    model: m,
                    adapters: adapters.clone(),
                });
            }
        }
        out.push(Subject {
            label: format!("{name} ({})", model.format_mix()),
            model,
            adapters,
        });
    }
    Ok(out)
}

/// One (model, batch) cell: medians over the rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRow {
    pub model: String,
    pub batch: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Output tokens over prefill + decode time.
    pub workload_tok_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every (model, batch) cell `rounds` times, models alternating within a round.
pub fn run(a: &WeightFormatsArgs) -> anyhow::Result<Vec<StepRow>> {
    let subjects = subjects(a)?;
    let mut got = vec![vec![(Vec::new(), Vec::new(), Vec::new()); a.batches.len()]; subjects.len()];
    let real = |batch: usize| RealArgs {
        model: PathBuf::new(),
        loras: Vec::new(),
        batches: vec![batch],
        threads: vec![a.threads],
        simd: vec![SimdLevel::Avx2],
        prompt_len: a.prompt_len,
        decode_steps: a.decode_steps,
        reps: 1,
    };
    for round in 0..a.rounds.max(1) {
        for (bi, &b) in a.batches.iter().enumerate() {
            // The order flips every round.
            let order: Vec<usize> = if round % 2 == 0 {
                (0..subjects.len()).collect()
            } else {
                (0..subjects.len()).rev().collect()
            };
            for si in order {
                let s = &subjects[si];
                let r = real(b);
                let (p, d) = measure(&r, &s.model, &s.adapters, b, a.threads, round as u64)?;
                let secs = (b * a.prompt_len) as f64 / p + (b * a.decode_steps) as f64 / d;
                // Each cell as it lands (stderr), so a run stopped early still says something.
                eprintln!(
                    "round {round}: {} batch {b}: prefill {p:.0} tok/s, decode {d:.1} tok/s",
                    s.label
                );
                let cell = &mut got[si][bi];
                cell.0.push(p);
                cell.1.push(d);
                cell.2.push((b * a.decode_steps) as f64 / secs);
            }
        }
    }
    let mut rows = Vec::new();
    for (s, cells) in subjects.iter().zip(got) {
        for (&b, (p, d, w)) in a.batches.iter().zip(cells) {
            rows.push(StepRow {
                model: s.label.clone(),
                batch: b,
                prefill_tok_s: median(p),
                decode_tok_s: median(d),
                workload_tok_s: median(w),
            });
        }
    }
    Ok(rows)
}

/// The report: one row per (model, batch), each batch's workload tok/s over the model's
/// batch-1 row.
pub fn table(a: &WeightFormatsArgs, rows: &[StepRow]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "CPU backend, {} thread(s), {} adapter(s) mixed round robin, {} prompt tokens and {} \
         decode steps per sequence, median of {} round(s); workload tok/s = output tokens / \
         (prefill + decode time)",
        a.threads,
        a.lora.len(),
        a.prompt_len,
        a.decode_steps,
        a.rounds.max(1)
    );
    let _ = writeln!(
        s,
        "| weights | batch | prefill tok/s | decode tok/s | workload tok/s | vs batch {} |",
        a.batches.first().copied().unwrap_or(1)
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let base = rows
            .iter()
            .find(|o| o.model == r.model)
            .map_or(r.workload_tok_s, |o| o.workload_tok_s);
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.1} | {:.1} | {:.2}× |",
            r.model,
            r.batch,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.workload_tok_s,
            r.workload_tok_s / base
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_real::tiny_model_with_adapters;

    /// The model mode measures the model as stored and each `--convert` format, every batch,
    /// and labels rows by the weights' format.
    #[test]
    fn model_mode_reports_every_format_and_batch() {
        let tmp = tempfile::tempdir().unwrap();
        let (model, lora) = tiny_model_with_adapters(tmp.path(), &[4, 8], &[0, 2]);
        let a = WeightFormatsArgs {
            model: vec![model],
            lora,
            // (The tiny model's 172-wide rows take no 32-value blocks: float formats only.)
            convert: vec!["bf16".into(), "F16".into()],
            batches: vec![1, 3],
            prompt_len: 8,
            decode_steps: 2,
            threads: 1,
            rounds: 1,
            ..WeightFormatsArgs::default()
        };
        let rows = run(&a).unwrap();
        let cells: Vec<_> = rows.iter().map(|r| (r.model.clone(), r.batch)).collect();
        assert_eq!(cells.len(), 6, "{cells:?}");
        assert!(
            cells[0].0.ends_with("→ BF16") && cells[2].0.ends_with("→ F16"),
            "{cells:?}"
        );
        assert!(cells[4].0.ends_with("(F32)"), "{cells:?}");
        assert!(rows
            .iter()
            .all(|r| r.workload_tok_s > 0.0 && r.decode_tok_s > 0.0));
        let t = table(&a, &rows);
        assert_eq!(t.lines().filter(|l| l.starts_with("| ")).count(), 7, "{t}");
        let e = parse_format("q4_2").unwrap_err().to_string();
        assert!(e.contains("not a weight format"), "{e}");
    }
}
