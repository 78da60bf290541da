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
}

impl Default for GenModelOptions {
    fn default() -> Self {
        GenModelOptions {
            seed: 0,
            dtype: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
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
        tensors.push(spec(
            "lm_head.weight".into(),
            vec![preset.vocab_size, h],
            Init {
                live_rows,
                ..Init::normal(LOGIT_STD / (h as f32).sqrt())
            },
        ));
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
    let plan = ModelPlan::new(preset, dtype, live_vocab, opts.max_shard_bytes);
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
    write_json(&out.join("config.json"), &model_config(preset, dtype))?;
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
