//! `thaw generate`: one request end to end on the CPU engine, streaming its text.
//!
//! With no `--model`, it runs on the embedded demo: a generated model and adapters written
//! once into the cache directory (see [`crate::demo`]).
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{
    Engine, EngineConfig, FinishReason, HostModel, PlanItem, SequenceParams, StepPlan,
};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::model::IncrementalDecoder;
use thaw_runtime::sampling::SamplingParams;

/// Options of one `thaw generate` run.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// HF model directory; None = the demo model.
    pub model: Option<PathBuf>,
    /// PEFT adapter directory; with the demo model and no adapter, the first demo adapter.
    pub adapter: Option<PathBuf>,
    /// Run the base model even on the demo.
    pub no_adapter: bool,
    pub prompt: String,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    /// Prefill chunk size (tokens per step).
    pub chunk: usize,
    pub lora_kernel: LoraKernel,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            model: None,
            adapter: None,
            no_adapter: false,
            prompt: "The quick brown fox".into(),
            max_tokens: 32,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            ignore_eos: false,
            chunk: 512,
            lora_kernel: LoraKernel::Sgmv,
        }
    }
}

/// What a run produced, for callers and tests.
#[derive(Clone, Debug)]
pub struct GenerateReport {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// Runs the request, writing text to `out` as it is produced.
pub fn run(opts: &GenerateOptions, out: &mut dyn Write) -> anyhow::Result<GenerateReport> {
    let (model_dir, adapter_dir) = match &opts.model {
        Some(m) => (m.clone(), opts.adapter.clone()),
        None => {
            let demo = crate::demo::ensure_demo(&crate::demo::cache_dir())?;
            let adapter = opts
                .adapter
                .clone()
                .or_else(|| demo.adapters.first().cloned());
            (demo.model, adapter)
        }
    };
    let adapter_dir = if opts.no_adapter { None } else { adapter_dir };
    let (model, tokenizer) = HostModel::load_with_tokenizer(&model_dir)
        .with_context(|| format!("loading model from {}", model_dir.display()))?;
    let prompt = tokenizer.encode(&opts.prompt, true)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens; pass a non-empty --prompt");
    }
    let adapter = adapter_dir
        .as_ref()
        .map(|d| {
            LoraAdapter::load(d, &model.config)
                .with_context(|| format!("loading adapter from {}", d.display()))
        })
        .transpose()?;
    let cfg = EngineConfig {
        max_batch_tokens: opts.chunk.max(1),
        max_batch_seqs: 1,
        num_kv_blocks: (prompt.len() + opts.max_tokens).div_ceil(16) + 1,
        lora_kernel: opts.lora_kernel,
        ..Default::default()
    };
    let backend = CpuBackend::new(&model.config);
    let mut engine = Engine::new(backend, model, cfg)?;
    let adapter_id = match adapter {
        Some(a) => {
            engine.register_adapter(AdapterId(0), Arc::new(a))?;
            Some(AdapterId(0))
        }
        None => None,
    };
    let seq = SeqId(0);
    engine.add_sequence(
        seq,
        SequenceParams {
            prompt: prompt.clone(),
            adapter: adapter_id,
            sampling: SamplingParams {
                temperature: opts.temperature,
                top_k: opts.top_k,
                top_p: opts.top_p,
                seed: opts.seed,
                top_logprobs: 0,
                logprobs: false,
            },
            max_new_tokens: opts.max_tokens,
            ignore_eos: opts.ignore_eos,
            ..Default::default()
        },
    )?;

    let mut decoder = IncrementalDecoder::new(&prompt);
    let mut tokens = Vec::new();
    let mut text = String::new();
    let start = Instant::now();
    let mut prefill_secs = None;
    loop {
        let n = engine.pending_tokens(seq)?.min(opts.chunk.max(1));
        let outputs = engine.step(&StepPlan {
            items: vec![PlanItem { seq, num_tokens: n }],
            return_logits: false,
        })?;
        let Some(o) = outputs.into_iter().next() else {
            continue;
        };
        if prefill_secs.is_none() {
            prefill_secs = Some(start.elapsed().as_secs_f64());
        }
        tokens.push(o.token.id);
        if let Some(piece) = decoder.push(&tokenizer, o.token.id)? {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            text.push_str(&piece);
        }
        if let Some(finish) = o.finish {
            let prefill_secs = prefill_secs.unwrap_or_default();
            return Ok(GenerateReport {
                prompt_tokens: prompt.len(),
                tokens,
                text,
                finish,
                prefill_secs,
                decode_secs: start.elapsed().as_secs_f64() - prefill_secs,
            });
        }
    }
}
