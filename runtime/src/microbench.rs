//! Inputs and accounting of the SGMV / BGMV microbenchmark, shared by the CUDA kernel example
//! (`runtime/examples/cuda_bench`, CUDA events) and `thaw-bench gpu` (any backend, wall clock),
//! so both print the same table from the same cases: deterministic values, adapters built in
//! memory, rows assigned to adapters by a popularity pattern, the step's [`LoraLayout`] and the
//! bytes a call must move. Nothing here times anything: the caller passes its clock.
use std::sync::Arc;

use safetensors::tensor::{Dtype, TensorView};

use crate::adapter::{AdapterConfig, LoraAdapter, LoraModule};
use crate::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout};
use crate::error::{Result, RuntimeError};
use crate::ids::LayerIdx;
use crate::model::ModelConfig;

/// Cheap deterministic values in [-0.01, 0.01) (an LCG): generating hundreds of MB with `rand`
/// is slower than the benchmarks that use them.
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02
        })
        .collect()
}

/// A PEFT adapter of `rank` on `targets` of every layer of `c` (alpha `2·rank`, f32 factors
/// from [`fill`]), built in memory.
pub fn synthetic_adapter(
    c: &ModelConfig,
    rank: usize,
    targets: &[LoraModule],
    seed: u64,
) -> Result<Arc<LoraAdapter>> {
    let names: Vec<String> = targets
        .iter()
        .map(|m| format!("\"{}\"", m.hf_name()))
        .collect();
    let cfg = AdapterConfig::from_json(&format!(
        r#"{{"r":{rank},"lora_alpha":{},"target_modules":[{}]}}"#,
        2 * rank,
        names.join(",")
    ))?;
    let le = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut bufs = Vec::new();
    for l in 0..c.num_layers {
        for &m in targets {
            let (d_in, d_out) = c.module_shape(m);
            let p = format!("base_model.model.{}", m.module_path(l));
            let a = le(fill(rank * d_in, seed + l as u64 * 7 + m.index() as u64));
            let b = le(fill(d_out * rank, seed + 1000 + l as u64));
            bufs.push((format!("{p}.lora_A.weight"), vec![rank, d_in], a));
            bufs.push((format!("{p}.lora_B.weight"), vec![d_out, rank], b));
        }
    }
    let bad = |e: safetensors::SafeTensorError| RuntimeError::Backend(e.to_string());
    let views: Vec<(String, TensorView<'_>)> = bufs
        .iter()
        .map(|(n, s, d)| {
            Ok((
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), d).map_err(bad)?,
            ))
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, None).map_err(bad)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(bad)?;
    Ok(Arc::new(LoraAdapter::from_parts(cfg, &st, c)?))
}

/// How a batch's rows pick adapters from a pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Popularity {
    /// Row `i` uses adapter `i mod pool`.
    Distinct,
    /// Uniformly random adapters.
    Uniform,
    /// Zipf-like (α ≈ 1.5): a few adapters take most rows.
    Skewed,
    /// Every row uses adapter 0.
    Identical,
}

impl Popularity {
    pub const ALL: [Popularity; 4] = [
        Popularity::Distinct,
        Popularity::Uniform,
        Popularity::Skewed,
        Popularity::Identical,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Popularity::Distinct => "distinct",
            Popularity::Uniform => "uniform",
            Popularity::Skewed => "skewed",
            Popularity::Identical => "identical",
        }
    }
}

/// Row → adapter index (`< pool`) for `batch` rows, sorted so rows of one adapter are
/// contiguous (Punica's segments).
pub fn assign_rows(p: Popularity, batch: usize, pool: usize, seed: u64) -> Vec<u32> {
    let pool = pool.max(1);
    let r = fill(batch, seed);
    let mut v: Vec<u32> = (0..batch)
        .map(|i| match p {
            Popularity::Distinct => (i % pool) as u32,
            Popularity::Identical => 0,
            Popularity::Uniform => {
                (((r[i] + 0.01) / 0.02) * pool as f32).clamp(0.0, pool as f32 - 1.0) as u32
            }
            // Inverse CDF of a power law on (0, 1].
            Popularity::Skewed => {
                let u = ((r[i] + 0.01) / 0.02).clamp(1e-6, 1.0);
                ((u.powf(-2.0) - 1.0) as usize).min(pool - 1) as u32
            }
        })
        .collect();
    v.sort_unstable();
    v
}

/// The distinct adapters of sorted `rows` (in order) and the step layout indexing them.
pub fn layout_of(rows: &[u32]) -> (Vec<u32>, LoraLayout) {
    let mut used: Vec<u32> = rows.to_vec();
    used.dedup();
    let mut layout = LoraLayout::default();
    let mut start = 0;
    for (k, &a) in used.iter().enumerate() {
        let len = rows[start..].iter().take_while(|&&r| r == a).count();
        layout.segments.push((start..start + len, k as u32));
        start += len;
    }
    layout.row_adapter = rows
        .iter()
        .map(|&a| used.iter().position(|&u| u == a).map(|k| k as u32))
        .collect();
    (used, layout)
}

/// Bytes per element as a backend holds them: adapter weights and activations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ElemSizes {
    pub adapter: usize,
    pub act: usize,
}

/// A caller's clock: `clock(backend, call)` returns µs per `call`.
pub type Clock<'a, B> = dyn FnMut(&mut B, &mut dyn FnMut(&mut B)) -> Result<f64> + 'a;

/// One SGMV / BGMV call of the table: one projection of one layer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LoraCase {
    pub kernel: LoraKernel,
    pub rank: usize,
    pub batch: usize,
    pub popularity: Popularity,
    pub dims: LinearDims,
}

impl LoraCase {
    /// Bytes one call must move at least: each distinct adapter's A and B once, x read, y
    /// read and written.
    pub fn bytes(&self, distinct: usize, e: ElemSizes) -> usize {
        let LinearDims { d_in, d_out } = self.dims;
        distinct * self.rank * (d_in + d_out) * e.adapter + self.batch * (d_in + 2 * d_out) * e.act
    }
}

/// What one case measured.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraCaseResult {
    pub case: LoraCase,
    pub distinct: usize,
    pub us: f64,
    pub bytes: usize,
}

impl LoraCaseResult {
    pub fn gbs(&self) -> f64 {
        self.bytes as f64 / self.us / 1e3
    }

    /// `| impl | kernel | rank | batch | popularity | µs | GB/s | % of peak |`.
    pub fn markdown_row(&self, imp: &str, peak_gbs: f64) -> String {
        let c = &self.case;
        format!(
            "| {imp} | {:?} | {} | {} | {} | {:.1} | {:.0} | {:.0}% |",
            c.kernel,
            c.rank,
            c.batch,
            c.popularity.name(),
            self.us,
            self.gbs(),
            self.gbs() / peak_gbs * 100.0
        )
    }
}

/// The header of [`LoraCaseResult::markdown_row`]'s table.
pub const LORA_TABLE_HEADER: &str = "| impl | kernel | rank | batch | popularity | µs | GB/s | % of copy peak |\n|---|---|---|---|---|---|---|---|";

/// Runs one case: `adapters` are the pool (all of `case.rank`, targeting q of layer 0), `x` and
/// `y` hold at least `case.batch` rows of `dims`. `time(backend, call)` returns µs per call
/// (it warms up first; a CUDA caller calls `begin_step` so the warm-up uploads this layout's
/// segment metadata, as the engine does once a step).
pub fn run_lora_case<B: Backend>(
    b: &mut B,
    x: &B::Buf,
    y: &mut B::Buf,
    adapters: &[B::Lora],
    case: LoraCase,
    e: ElemSizes,
    time: &mut Clock<'_, B>,
) -> Result<LoraCaseResult> {
    let seed = case.batch as u64 * 31 + case.rank as u64;
    let rows = assign_rows(case.popularity, case.batch, adapters.len(), seed);
    let (used, layout) = layout_of(&rows);
    let refs: Vec<&B::Lora> = used.iter().map(|&i| &adapters[i as usize]).collect();
    let landed = vec![usize::MAX; refs.len()];
    let us = time(b, &mut |b: &mut B| {
        let batch = LoraBatch {
            kernel: case.kernel,
            layout: &layout,
            adapters: &refs,
            landed: &landed,
        };
        b.lora(x, y, case.dims, (LayerIdx(0), LoraModule::Q), &batch);
    })?;
    Ok(LoraCaseResult {
        case,
        distinct: used.len(),
        us,
        bytes: case.bytes(used.len(), e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Rows are sorted, in the pool, and the layout's segments tile the batch with each
        /// adapter once, in order, agreeing with the per-row index.
        #[test]
        fn layout_tiles_the_batch(batch in 1usize..80, pool in 1usize..70, p in 0usize..4, seed in 0u64..1000) {
            let rows = assign_rows(Popularity::ALL[p], batch, pool, seed);
            prop_assert_eq!(rows.len(), batch);
            prop_assert!(rows.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(rows.iter().all(|&r| (r as usize) < pool));
            let (used, layout) = layout_of(&rows);
            let mut next = 0;
            for (k, (range, idx)) in layout.segments.iter().enumerate() {
                prop_assert_eq!(range.start, next);
                prop_assert!(range.end > range.start);
                prop_assert_eq!(*idx as usize, k);
                for r in range.clone() {
                    prop_assert_eq!(rows[r], used[k]);
                    prop_assert_eq!(layout.row_adapter[r], Some(k as u32));
                }
                next = range.end;
            }
            prop_assert_eq!(next, batch);
        }
    }

    #[test]
    fn popularity_patterns_use_the_expected_adapters() {
        assert_eq!(
            assign_rows(Popularity::Distinct, 6, 4, 1),
            vec![0, 0, 1, 1, 2, 3]
        );
        assert_eq!(assign_rows(Popularity::Identical, 5, 9, 1), vec![0; 5]);
        let skewed = assign_rows(Popularity::Skewed, 64, 64, 3);
        let (used, _) = layout_of(&skewed);
        assert!(used.len() < 64, "skewed popularity reuses adapters");
    }

    #[test]
    fn case_bytes_count_adapters_once_and_rows_each() {
        let c = LoraCase {
            kernel: LoraKernel::Sgmv,
            rank: 16,
            batch: 8,
            popularity: Popularity::Distinct,
            dims: LinearDims {
                d_in: 4096,
                d_out: 1024,
            },
        };
        // 3 adapters × 16 × 5120 × 2 B + 8 rows × (4096 + 2048) × 4 B.
        assert_eq!(
            c.bytes(3, ElemSizes { adapter: 2, act: 4 }),
            3 * 16 * 5120 * 2 + 8 * 6144 * 4
        );
    }

    /// The CPU backend runs a case end to end and the clock's figure comes back.
    #[test]
    fn a_case_runs_on_the_cpu_backend() {
        use crate::backend::cpu::CpuBackend;
        let c = ModelConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,
            "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "num_hidden_layers":1,"vocab_size":32,"rms_norm_eps":1e-5,"max_position_embeddings":64}"#,
        )
        .unwrap();
        let mut b = CpuBackend::new(&c);
        let adapters: Vec<_> = (0..3)
            .map(|i| b.upload_lora(synthetic_adapter(&c, 4, &[LoraModule::Q], i).unwrap()))
            .collect::<Result<_>>()
            .unwrap();
        let x = b.alloc(8 * 64).unwrap();
        let mut y = b.alloc(8 * 64).unwrap();
        let case = LoraCase {
            kernel: LoraKernel::Bgmv,
            rank: 4,
            batch: 8,
            popularity: Popularity::Distinct,
            dims: LinearDims {
                d_in: 64,
                d_out: 64,
            },
        };
        let mut calls = 0;
        let e = ElemSizes { adapter: 4, act: 4 };
        let r = run_lora_case(&mut b, &x, &mut y, &adapters, case, e, &mut |b, f| {
            f(b);
            f(b);
            calls += 2;
            Ok(2.5)
        })
        .unwrap();
        assert_eq!(calls, 2);
        assert_eq!(r.distinct, 3);
        assert_eq!(r.us, 2.5);
        assert_eq!(r.bytes, case.bytes(3, e));
        assert!(r
            .markdown_row("cpu", 100.0)
            .starts_with("| cpu | Bgmv | 4 | 8 | distinct |"));
    }
}
