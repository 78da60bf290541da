//! The engine's decode and prefill rows of `thaw-bench gpu`: one engine for the whole run
//! (the model uploaded once, every adapter registered once), sequences added and removed per
//! row.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::any::AnyBackend;
use thaw_runtime::backend::device_counts::DeviceCounts;
use thaw_runtime::backend::op_profile::OpSample;
use thaw_runtime::backend::profiled::Profiled;
use thaw_runtime::backend::{Backend, Device};
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::model::ModelConfig;
use thaw_runtime::residency::LinkModel;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions};

use super::op_profile::{profile_step, profile_steps, OpProfileRun};
use super::prefill_profile::PrefillOpRun;
use super::roofline::{decode_traffic, model_matrix_elems, prefill_flops, ElemBytes, StepTraffic};
use super::GpuArgs;

/// Which adapters a decode row's batch uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Mix {
    /// The base model only.
    Base,
    /// Every sequence on one adapter.
    One { rank: usize },
    /// Sequence `i` on adapter `i`: `n` distinct adapters.
    Distinct { n: usize, rank: usize },
}

impl Mix {
    pub fn label(self) -> String {
        match self {
            Mix::Base => "0".into(),
            Mix::One { .. } => "1".into(),
            Mix::Distinct { n, .. } => format!("{n} distinct"),
        }
    }

    pub fn rank(self) -> Option<usize> {
        match self {
            Mix::Base => None,
            Mix::One { rank } | Mix::Distinct { rank, .. } => Some(rank),
        }
    }

    /// The mixes of one batch size: base, then per rank one adapter and (batch > 1) one per
    /// sequence.
    pub fn for_batch(batch: usize, ranks: &[usize]) -> Vec<Mix> {
        let mut v = vec![Mix::Base];
        for &rank in ranks {
            v.push(Mix::One { rank });
            if batch > 1 {
                v.push(Mix::Distinct { n: batch, rank });
            }
        }
        v
    }
}

/// One decode row.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeRow {
    pub batch: usize,
    pub mix: Mix,
    /// Mean wall time of a timed step.
    pub step_ms: f64,
    pub tok_s: f64,
    /// Mean bytes a timed step reads.
    pub traffic: StepTraffic,
    /// What the backend asked of the driver over the timed steps (None on the CPU backend).
    pub counts: Option<DeviceCounts>,
    /// Timed steps (the counts' divisor).
    pub steps: usize,
}

impl DecodeRow {
    /// Achieved bandwidth: the bytes a step must read over its time.
    pub fn gbs(&self) -> f64 {
        self.traffic.total() / (self.step_ms * 1e-3) / 1e9
    }
}

/// One prefill row.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillRow {
    pub tokens: usize,
    pub ms: f64,
    pub flops: f64,
}

impl PrefillRow {
    pub fn tflops(&self) -> f64 {
        self.flops / (self.ms * 1e-3) / 1e12
    }
}

/// The model directory: --model, or the preset generated under `root` (reused when there).
pub fn model_dir(args: &GpuArgs, root: &Path) -> anyhow::Result<PathBuf> {
    if let Some(m) = &args.model {
        return Ok(m.clone());
    }
    let preset = gen::preset(&args.preset).with_context(|| {
        format!(
            "unknown preset {}; try one of {:?}",
            args.preset,
            gen::PRESET_NAMES
        )
    })?;
    let dir = root.join(format!("model-{}", args.preset));
    if !dir.join("config.json").exists() {
        gen::write_model(&preset, &dir, &GenModelOptions::default())?;
    }
    Ok(dir)
}

/// `count` adapters of `rank` on the targets, generated under `root` (reused when there).
fn adapters(
    args: &GpuArgs,
    model_dir: &Path,
    root: &Path,
    config: &ModelConfig,
    rank: usize,
    count: usize,
) -> anyhow::Result<Vec<Arc<LoraAdapter>>> {
    let targets: Vec<String> = args
        .targets
        .iter()
        .map(|t| format!("{t:?}").to_lowercase())
        .collect();
    let out = root.join(format!("gpu-adapters-r{rank}-{}", targets.join("")));
    let opts = GenAdaptersOptions {
        model_dir: model_dir.to_path_buf(),
        out_dir: out.clone(),
        count,
        ranks: vec![rank],
        targets: args.targets.clone(),
        ..Default::default()
    };
    let dirs: Vec<PathBuf> = (0..count)
        .map(|i| out.join(gen::adapter_name(i, rank)))
        .collect();
    if !dirs
        .iter()
        .all(|d| d.join("adapter_model.safetensors").exists())
    {
        gen::write_adapters(&opts)?;
    }
    dirs.iter()
        .map(|d| Ok(Arc::new(LoraAdapter::load(d, config)?)))
        .collect()
}

/// What [`run`] measured.
pub struct Measured {
    pub decode: Vec<DecodeRow>,
    /// The decode rows with CUDA graphs (`--cuda-graphs`).
    pub graph_decode: Vec<DecodeRow>,
    pub prefill: Vec<PrefillRow>,
    /// The eager decode rows' profiled steps (`--op-profile`).
    pub op_profiles: Vec<OpProfileRun>,
    /// The prefill lengths' profiled steps (`--op-profile`).
    pub prefill_op_profiles: Vec<PrefillOpRun>,
}

/// Runs the decode rows (eager, then with CUDA graphs when `--cuda-graphs` and the backend
/// has them), then the prefill rows (each length's profiled prefills after its timed ones with
/// `--op-profile`), on one engine.
pub fn run(
    args: &GpuArgs,
    device: &Device,
    model_dir: &Path,
    root: &Path,
) -> anyhow::Result<Measured> {
    let host = HostModel::load(model_dir)?;
    let config = host.config.clone();
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let max_prefill = args.prefill_tokens.iter().copied().max().unwrap_or(0);
    let backend = AnyBackend::new(device, &config, LinkModel::default())?;
    let (dev_weight, kv_elem) = backend.element_bytes();
    let weight_elem = dev_weight.map_or_else(
        || host.weight_bytes() as f64 / model_matrix_elems(&config) as f64,
        |w| w as f64,
    );
    let e = ElemBytes {
        weight: weight_elem,
        kv: kv_elem,
    };
    let block = 16;
    let per_seq = args.prompt_len + args.decode_steps + args.profiled_steps() + 4;
    // Adapter ids: rank index × max_batch + i.
    let by_rank = args
        .ranks
        .iter()
        .map(|&rank| adapters(args, model_dir, root, &config, rank, max_batch))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Where the backend places adapter images in KV blocks (CUDA), the pool holds them too.
    let layout = thaw_kernels::cpu::KvLayout {
        block_size: block,
        num_kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
    };
    let adapter_pages: usize = by_rank
        .iter()
        .flatten()
        .map(|a| backend.lora_pages(a, layout).unwrap_or(0))
        .sum();
    let cfg = EngineConfig {
        kv_block_size: block,
        // One block more with --cuda-graphs: graph steps' padding rows write their KV into it.
        num_kv_blocks: (max_batch * per_seq.div_ceil(block)).max((max_prefill + 2).div_ceil(block))
            + adapter_pages
            + usize::from(args.cuda_graphs),
        max_batch_tokens: max_prefill.max(args.prompt_len).max(max_batch),
        max_batch_seqs: max_batch,
        max_context: Some(per_seq.max(max_prefill + 2)),
        ..Default::default()
    };
    // Wrapped so that `--op-profile` can time the ops of some steps; off, each op costs a
    // flag test.
    let mut engine = Engine::new(Profiled::new(backend), host, cfg)?;
    for (ri, list) in by_rank.iter().enumerate() {
        for (i, a) in list.iter().enumerate() {
            engine.register_adapter(AdapterId((ri * max_batch + i) as u32), a.clone())?;
        }
    }
    // Resident before any row is timed (a layer still streaming would be CPU-assisted).
    engine.wait_adapters_landed(std::time::Duration::from_secs(120))?;
    // As the device holds them: converted to the weight dtype (CUDA) or as stored (CPU).
    let adapter_bytes = |a: &LoraAdapter| match dev_weight {
        Some(w) => a
            .iter()
            .map(|(_, _, l)| ((l.a.numel() + l.b.numel()) * w) as f64)
            .sum::<f64>(),
        None => a.size_bytes() as f64,
    };
    let mut next_seq = 0u64;
    // Warm-up: first-use compilation, cuBLAS handles, allocator.
    decode_row(
        &mut engine,
        args,
        1,
        Mix::Base,
        &config,
        e,
        &|_| 0.0,
        &mut next_seq,
        None,
    )?;
    let mut decode = Vec::new();
    let mut graph_decode = Vec::new();
    let mut op_profiles = Vec::new();
    // Eager first; then, with graphs on (the first two decode steps of each row, its untimed
    // warm-up, warm up and capture its graph), the same rows again.
    let has_graphs = args.cuda_graphs && engine.set_cuda_graphs(true);
    for graphs in [false, true] {
        if graphs && !has_graphs {
            break;
        }
        engine.set_cuda_graphs(graphs);
        let rows = if graphs {
            &mut graph_decode
        } else {
            &mut decode
        };
        for &batch in &args.batches {
            for mix in Mix::for_batch(batch, &args.ranks) {
                let ri = mix
                    .rank()
                    .and_then(|r| args.ranks.iter().position(|&x| x == r));
                let bytes_of = |a: u32| {
                    ri.map_or(0.0, |ri| {
                        adapter_bytes(&by_rank[ri][a as usize - ri * max_batch])
                    })
                };
                rows.push(decode_row(
                    &mut engine,
                    args,
                    batch,
                    mix,
                    &config,
                    e,
                    &|a| bytes_of(a),
                    &mut next_seq,
                    // Eager rows only: a graph step's ops are replayed, not called.
                    (args.op_profile && !graphs).then_some(&mut op_profiles),
                )?);
            }
        }
    }
    engine.set_cuda_graphs(false);
    let mut prefill = Vec::new();
    let mut prefill_op_profiles = Vec::new();
    for &tokens in &args.prefill_tokens {
        let mut t = Vec::new();
        for rep in 0..=args.reps.max(1) {
            let (us, _) = prefill_step(&mut engine, &config, tokens, &mut next_seq, false)?;
            if rep > 0 {
                t.push(us / 1e3);
            }
        }
        t.sort_by(f64::total_cmp);
        prefill.push(PrefillRow {
            tokens,
            ms: t[t.len() / 2],
            flops: prefill_flops(&config, tokens),
        });
        // After the timed ones: each profiled prefill a fresh sequence.
        let steps = args.profiled_steps();
        if steps > 0 {
            let (mut wall, mut samples) = (0.0, Vec::new());
            for _ in 0..steps {
                let (us, s) = prefill_step(&mut engine, &config, tokens, &mut next_seq, true)?;
                wall += us;
                samples.extend(s);
            }
            prefill_op_profiles.push(PrefillOpRun {
                tokens,
                steps,
                step_us: wall / steps as f64,
                samples,
                act_elem: e.kv as f64,
            });
        }
    }
    Ok(Measured {
        decode,
        graph_decode,
        prefill,
        op_profiles,
        prefill_op_profiles,
    })
}

/// One prefill of a fresh `tokens`-token sequence, then its removal: the step's wall µs and,
/// `profiled`, its timed ops.
fn prefill_step(
    engine: &mut Engine<Profiled<AnyBackend>>,
    config: &ModelConfig,
    tokens: usize,
    next_seq: &mut u64,
    profiled: bool,
) -> anyhow::Result<(f64, Vec<OpSample>)> {
    let seq = SeqId(*next_seq);
    *next_seq += 1;
    engine.add_sequence(
        seq,
        SequenceParams {
            prompt: prompt(config, tokens, seq.0),
            max_new_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        },
    )?;
    let step = plan(&[seq], tokens);
    let r = if profiled {
        profile_step(engine, &step)
    } else {
        let t0 = Instant::now();
        engine
            .step(&step)
            .map(|_| (t0.elapsed().as_secs_f64() * 1e6, Vec::new()))
            .map_err(Into::into)
    };
    let _ = engine.remove_sequence(seq);
    r
}

fn prompt(c: &ModelConfig, len: usize, seed: u64) -> Vec<u32> {
    let v = c.vocab_size as u64;
    (0..len as u64)
        .map(|i| (3 + (seed * 7919 + i * 104_729) % (v - 3)) as u32)
        .collect()
}

fn plan(seqs: &[SeqId], n: usize) -> StepPlan {
    StepPlan {
        items: seqs
            .iter()
            .map(|&seq| PlanItem { seq, num_tokens: n })
            .collect(),
        return_logits: false,
    }
}

/// Prefills `batch` sequences (in steps of at most the engine's token budget), runs 2
/// warm-up decode steps, then times `args.decode_steps` steps; with `profiles`, then runs
/// `args.op_profile_steps` more with every op timed.
#[allow(clippy::too_many_arguments)]
fn decode_row(
    engine: &mut Engine<Profiled<AnyBackend>>,
    args: &GpuArgs,
    batch: usize,
    mix: Mix,
    c: &ModelConfig,
    e: ElemBytes,
    adapter_bytes: &dyn Fn(u32) -> f64,
    next_seq: &mut u64,
    profiles: Option<&mut Vec<OpProfileRun>>,
) -> anyhow::Result<DecodeRow> {
    let ri = mix.rank().map(|r| args.ranks.iter().position(|&x| x == r));
    let base_id = |ri: usize| ri * args.batches.iter().copied().max().unwrap_or(1);
    let adapter_of = |s: usize| -> Option<u32> {
        match (mix, ri.flatten()) {
            (Mix::Base, _) | (_, None) => None,
            (Mix::One { .. }, Some(ri)) => Some(base_id(ri) as u32),
            (Mix::Distinct { .. }, Some(ri)) => Some((base_id(ri) + s) as u32),
        }
    };
    let seqs: Vec<SeqId> = (0..batch).map(|i| SeqId(*next_seq + i as u64)).collect();
    *next_seq += batch as u64;
    for (s, &id) in seqs.iter().enumerate() {
        engine.add_sequence(
            id,
            SequenceParams {
                prompt: prompt(c, args.prompt_len, id.0),
                adapter: adapter_of(s).map(AdapterId),
                max_new_tokens: args.decode_steps + args.profiled_steps() + 4,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    let budget = engine.engine_config().max_batch_tokens;
    let per_step = (budget / args.prompt_len).max(1);
    for chunk in seqs.chunks(per_step) {
        engine.step(&plan(chunk, args.prompt_len))?;
    }
    for _ in 0..2 {
        engine.step(&plan(&seqs, 1))?;
    }
    let mut distinct: Vec<u32> = (0..batch).filter_map(adapter_of).collect();
    distinct.dedup();
    let adapters: f64 = distinct.iter().map(|&a| adapter_bytes(a)).sum();
    let step_plan = plan(&seqs, 1);
    let counts0 = engine.backend().inner().device_counts();
    let t0 = Instant::now();
    for _ in 0..args.decode_steps {
        engine.step(&step_plan)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let counts = engine
        .backend()
        .inner()
        .device_counts()
        .zip(counts0)
        .map(|(end, start)| end.since(&start));
    if let Some(out) = profiles {
        let steps = args.op_profile_steps.max(1);
        let (step_us, samples) = profile_steps(engine, &step_plan, steps)?;
        out.push(OpProfileRun {
            batch,
            mix,
            steps,
            step_us,
            samples,
            weight_elem: e.weight,
        });
    }
    let mut traffic = StepTraffic::default();
    for step in 0..args.decode_steps {
        // The prompt, the first sampled token, 2 warm-up tokens, then this step's.
        let ctx = vec![args.prompt_len + 3 + step; batch];
        let t = decode_traffic(c, e, &ctx, adapters);
        traffic.weights += t.weights;
        traffic.adapters += t.adapters;
        traffic.kv += t.kv;
    }
    for id in seqs {
        let _ = engine.remove_sequence(id);
    }
    let n = args.decode_steps as f64;
    Ok(DecodeRow {
        batch,
        mix,
        step_ms: secs * 1e3 / n,
        tok_s: (batch * args.decode_steps) as f64 / secs,
        traffic: StepTraffic {
            weights: traffic.weights / n,
            adapters: traffic.adapters / n,
            kv: traffic.kv / n,
        },
        counts,
        steps: args.decode_steps,
    })
}
