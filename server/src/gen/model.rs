//! `thaw gen-model`: a complete HF Llama model directory, as transformers 4.x
//! `LlamaForCausalLM.save_pretrained` + `PreTrainedTokenizerFast.save_pretrained` write it.
//!
//! ```text
//! config.json  generation_config.json  model.safetensors (or model-0000i-of-0000n + index)
//! tokenizer.json  tokenizer_config.json  special_tokens_map.json
//! ```

use std::path::Path;

use anyhow::Context;
use serde_json::{json, Value};

use super::init::{linear_std, Init, TensorSpec, EMBED_STD, LOGIT_STD, NORM_NOISE_STD};

/// Standard deviation of Qwen2's q/k/v biases: small next to the projections' unit-scale output.
const BIAS_STD: f32 = 0.1;
use super::presets::{ModelPreset, Projection, WeightDtype};
use super::tokenizer::{write_tokenizer_files, BOS_TOKEN_ID, EOS_TOKEN_ID, IM_END_TOKEN_ID};
use super::writer::{write_checkpoint, write_json, ShardPlan, DEFAULT_MAX_SHARD_BYTES};

/// The transformers release whose file layout the generated files follow.
pub const TRANSFORMERS_VERSION: &str = "4.51.3";

/// Options of [`write_model`] beyond the preset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenModelOptions {
    /// Seed of every weight (ChaCha8); the same seed gives byte-identical files.
    pub seed: u64,
    /// Weight dtype; `None` uses the preset's default.
    pub dtype: Option<WeightDtype>,
    /// Largest shard in bytes before the checkpoint is split (transformers' default 5 GB).
    pub max_shard_bytes: u64,
    /// Which HF architecture the files describe.
    pub arch: ArchOptions,
}

/// The HF architectures `gen-model` can write (same decoder, different config and tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GenArch {
    /// `LlamaForCausalLM`.
    #[default]
    Llama,
    /// `MistralForCausalLM`: adds a sliding attention window.
    Mistral,
    /// `Qwen2ForCausalLM`: q/k/v projections carry biases.
    Qwen2,
}

/// Architecture choices of a generated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArchOptions {
    pub arch: GenArch,
    /// Mistral's (or Qwen2's, with `use_sliding_window`) attention window in tokens.
    pub sliding_window: Option<usize>,
    /// Share `embed_tokens` with the output head (no `lm_head.weight` tensor).
    pub tie_word_embeddings: bool,
}

impl Default for GenModelOptions {
    fn default() -> Self {
        GenModelOptions {
            seed: 0,
            dtype: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            arch: ArchOptions::default(),
        }
    }
}

/// Every tensor of a model in HF parameter order, and how they are split into files.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPlan {
    pub tensors: Vec<TensorSpec>,
    pub shards: ShardPlan,
}

impl ModelPlan {
    /// Plans `preset` in `dtype`. Rows of `embed_tokens` and `lm_head` at or past
    /// `live_vocab` (the tokenizer's size) are zero padding, so the model never prefers a
    /// token id the tokenizer cannot decode.
    pub fn new(
        preset: &ModelPreset,
        dtype: WeightDtype,
        live_vocab: usize,
        max_shard_bytes: u64,
    ) -> Self {
        Self::for_arch(
            preset,
            dtype,
            live_vocab,
            max_shard_bytes,
            &ArchOptions::default(),
        )
    }

    /// [`ModelPlan::new`] for another architecture: Qwen2 adds q/k/v biases, a tied model
    /// has no `lm_head.weight`.
    pub fn for_arch(
        preset: &ModelPreset,
        dtype: WeightDtype,
        live_vocab: usize,
        max_shard_bytes: u64,
        arch: &ArchOptions,
    ) -> Self {
        let dims = preset.dims();
        let h = preset.hidden_size;
        let live_rows = (live_vocab < preset.vocab_size).then_some(live_vocab);
        let spec =
            |name: String, shape: Vec<usize>, init: Init| TensorSpec::new(name, shape, dtype, init);
        let norm = Init {
            mean: 1.0,
            std: NORM_NOISE_STD,
            live_rows: None,
        };

        let mut tensors = vec![spec(
            "model.embed_tokens.weight".into(),
            vec![preset.vocab_size, h],
            Init {
                live_rows,
                ..Init::normal(EMBED_STD)
            },
        )];
        for layer in 0..preset.num_hidden_layers {
            for proj in Projection::ALL {
                let (d_in, d_out) = proj.dims(&dims);
                tensors.push(spec(
                    format!(
                        "model.layers.{layer}.{}.{}.weight",
                        proj.parent(),
                        proj.hf_name()
                    ),
                    vec![d_out, d_in],
                    Init::normal(linear_std(proj, d_in, preset.num_hidden_layers)),
                ));
                if arch.arch == GenArch::Qwen2
                    && matches!(proj, Projection::Q | Projection::K | Projection::V)
                {
                    tensors.push(spec(
                        format!("model.layers.{layer}.self_attn.{}.bias", proj.hf_name()),
                        vec![d_out],
                        Init::normal(BIAS_STD),
                    ));
                }
            }
            for name in ["input_layernorm", "post_attention_layernorm"] {
                tensors.push(spec(
                    format!("model.layers.{layer}.{name}.weight"),
                    vec![h],
                    norm,
                ));
            }
        }
        tensors.push(spec("model.norm.weight".into(), vec![h], norm));
        if !arch.tie_word_embeddings {
            tensors.push(spec(
                "lm_head.weight".into(),
                vec![preset.vocab_size, h],
                Init {
                    live_rows,
                    ..Init::normal(LOGIT_STD / (h as f32).sqrt())
                },
            ));
        }
        let shards = ShardPlan::new("model", &tensors, max_shard_bytes);
        ModelPlan { tensors, shards }
    }

    /// Number of parameters.
    pub fn num_params(&self) -> u64 {
        self.tensors.iter().map(|t| t.numel() as u64).sum()
    }
}

/// `config.json` as transformers 4.x writes it for `LlamaForCausalLM`.
pub fn model_config(preset: &ModelPreset, dtype: WeightDtype) -> Value {
    model_config_for(preset, dtype, &ArchOptions::default())
}

/// `config.json` for the architecture in `arch`.
pub fn model_config_for(preset: &ModelPreset, dtype: WeightDtype, arch: &ArchOptions) -> Value {
    let mut cfg = llama_config(preset, dtype);
    let obj = cfg.as_object_mut().expect("config is an object");
    obj.insert(
        "tie_word_embeddings".into(),
        json!(arch.tie_word_embeddings),
    );
    match arch.arch {
        GenArch::Llama => {}
        GenArch::Mistral => {
            for k in [
                "attention_bias",
                "mlp_bias",
                "pretraining_tp",
                "rope_scaling",
            ] {
                obj.remove(k);
            }
            obj.insert("architectures".into(), json!(["MistralForCausalLM"]));
            obj.insert("model_type".into(), json!("mistral"));
            obj.insert("sliding_window".into(), json!(arch.sliding_window));
        }
        GenArch::Qwen2 => {
            for k in ["attention_bias", "mlp_bias", "pretraining_tp", "head_dim"] {
                obj.remove(k);
            }
            obj.insert("architectures".into(), json!(["Qwen2ForCausalLM"]));
            obj.insert("model_type".into(), json!("qwen2"));
            obj.insert(
                "use_sliding_window".into(),
                json!(arch.sliding_window.is_some()),
            );
            obj.insert("sliding_window".into(), json!(arch.sliding_window));
            obj.insert("max_window_layers".into(), json!(0));
        }
    }
    cfg
}

fn llama_config(preset: &ModelPreset, dtype: WeightDtype) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": null,
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": false,
        "torch_dtype": dtype.torch_name(),
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": true,
        "vocab_size": preset.vocab_size,
    })
}

/// `generation_config.json`: stop on `</s>` and on the ChatML turn end `<|im_end|>`.
pub fn generation_config() -> Value {
    json!({
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
        "transformers_version": TRANSFORMERS_VERSION,
    })
}

/// Writes a complete model directory for `preset` into `out` (created if missing; weight
/// files of an earlier run are replaced). Weights are generated while they are written, one
/// tensor at a time, so memory stays at the size of the largest tensor.
pub fn write_model(preset: &ModelPreset, out: &Path, opts: &GenModelOptions) -> anyhow::Result<()> {
    let dtype = opts.dtype.unwrap_or(preset.default_dtype);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    remove_stale_weights(out)?;

    let live_vocab = write_tokenizer_files(
        out,
        preset.tokenizer_vocab_size,
        preset.max_position_embeddings,
    )?;
    anyhow::ensure!(
        live_vocab <= preset.vocab_size,
        "tokenizer has {live_vocab} tokens but preset `{}` has vocab_size {}",
        preset.name,
        preset.vocab_size
    );
    if opts.arch.arch == GenArch::Qwen2 {
        anyhow::ensure!(
            preset.head_dim * preset.num_attention_heads == preset.hidden_size,
            "Qwen2 derives head_dim from hidden_size / num_attention_heads; preset `{}` does not satisfy it",
            preset.name
        );
    }
    let plan = ModelPlan::for_arch(preset, dtype, live_vocab, opts.max_shard_bytes, &opts.arch);
    tracing::info!(
        preset = preset.name,
        %dtype,
        params = plan.num_params(),
        bytes = plan.shards.total_bytes,
        shards = plan.shards.shards.len(),
        tokenizer_vocab = live_vocab,
        "generating model"
    );
    write_checkpoint(out, "model", &plan.tensors, &plan.shards, opts.seed)?;
    write_json(&out.join("generation_config.json"), &generation_config())?;
    // Last, so a directory with a config.json is a complete one.
    write_json(
        &out.join("config.json"),
        &model_config_for(preset, dtype, &opts.arch),
    )?;
    Ok(())
}

fn remove_stale_weights(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let stale = name == "model.safetensors"
            || name == "model.safetensors.index.json"
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if stale {
            std::fs::remove_file(entry.path())
                .with_context(|| format!("removing stale {}", entry.path().display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
