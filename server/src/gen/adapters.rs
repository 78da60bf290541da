//! `thaw gen-adapters`: random LoRA adapters for a model directory, written as PEFT 0.21
//! `save_pretrained` writes them (`adapter_config.json` + `adapter_model.safetensors`).
//!
//! Both `A` and `B` are random (PEFT would start `B` at zero), scaled so that for any input
//! `x` the delta `scale·B·A·x` has a norm of about [`DEFAULT_DELTA_REL`] times the base
//! projection's `W·x`, assuming the base was written by `gen-model` (whose per-projection
//! init scales are known). The adapter changes the output visibly without blowing it up.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{json, Value};

use super::init::{projection_gain, stream_id, Init, TensorSpec};
use super::presets::{ModelDims, Projection, WeightDtype};
use super::writer::{write_json, write_safetensors};

/// The PEFT release whose `adapter_config.json` field set is written.
pub const PEFT_VERSION: &str = "0.21.2";
/// Default `‖scale·B·A·x‖ / ‖W·x‖` per targeted projection.
pub const DEFAULT_DELTA_REL: f32 = 0.25;

/// Options of [`write_adapters`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenAdaptersOptions {
    /// Base model directory; its `config.json` gives the layer shapes.
    pub model_dir: PathBuf,
    /// Directory that receives one subdirectory per adapter.
    pub out_dir: PathBuf,
    /// Number of adapters.
    pub count: usize,
    /// Ranks, assigned round-robin: adapter `i` gets `ranks[i % ranks.len()]`.
    pub ranks: Vec<usize>,
    /// Projections every adapter targets.
    pub targets: Vec<Projection>,
    /// Seed of every adapter weight (ChaCha8).
    pub seed: u64,
    /// `lora_alpha = alpha_ratio · r`.
    pub alpha_ratio: f64,
    /// Weight dtype; `None` uses the base model's `torch_dtype`.
    pub dtype: Option<WeightDtype>,
    /// Scale by `lora_alpha/√r` (rsLoRA) instead of `lora_alpha/r`.
    pub use_rslora: bool,
    /// Target `‖Δy‖/‖y‖` per targeted projection.
    pub delta_rel: f32,
}

impl Default for GenAdaptersOptions {
    fn default() -> Self {
        GenAdaptersOptions {
            model_dir: PathBuf::new(),
            out_dir: PathBuf::new(),
            count: 8,
            ranks: vec![8, 16, 32, 64, 128],
            targets: Projection::ALL.to_vec(),
            seed: 0,
            alpha_ratio: 2.0,
            dtype: None,
            use_rslora: false,
            delta_rel: DEFAULT_DELTA_REL,
        }
    }
}

impl GenAdaptersOptions {
    /// `lora_alpha` of an adapter of rank `r`.
    pub fn lora_alpha(&self, r: usize) -> f64 {
        self.alpha_ratio * r as f64
    }

    /// The LoRA scale PEFT applies: `alpha/r`, or `alpha/√r` with rsLoRA.
    pub fn scale(&self, r: usize) -> f64 {
        let alpha = self.lora_alpha(r);
        if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        }
    }
}

/// Reads the layer shapes and `torch_dtype` (or transformers-5 `dtype`) of a HF Llama
/// `config.json`.
pub fn read_model_dims(model_dir: &Path) -> anyhow::Result<(ModelDims, Option<WeightDtype>)> {
    let path = model_dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {}; is --model a HF model directory?",
            path.display()
        )
    })?;
    let cfg: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let field = |name: &str| -> anyhow::Result<usize> {
        cfg[name]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("{}: `{name}` missing or not an integer", path.display()))
    };
    let hidden_size = field("hidden_size")?;
    let num_attention_heads = field("num_attention_heads")?;
    anyhow::ensure!(
        num_attention_heads > 0,
        "{}: num_attention_heads is 0",
        path.display()
    );
    let dims = ModelDims {
        hidden_size,
        intermediate_size: field("intermediate_size")?,
        num_hidden_layers: field("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads: field("num_key_value_heads").unwrap_or(num_attention_heads),
        head_dim: field("head_dim").unwrap_or(hidden_size / num_attention_heads),
    };
    let dtype = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| cfg[*k].as_str())
        .and_then(WeightDtype::from_torch_name);
    Ok((dims, dtype))
}

/// Name of adapter `index` with rank `r`: `adapter-007-r64`.
pub fn adapter_name(index: usize, r: usize) -> String {
    format!("adapter-{index:03}-r{r}")
}

/// The tensors of one adapter, in PEFT naming:
/// `base_model.model.model.layers.{l}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`,
/// A `[r, d_in]` with σ = 1/√d_in, B `[d_out, r]` sized for the requested delta.
pub fn adapter_tensors(
    dims: &ModelDims,
    name: &str,
    r: usize,
    dtype: WeightDtype,
    opts: &GenAdaptersOptions,
) -> Vec<TensorSpec> {
    let mut targets = opts.targets.clone();
    targets.sort();
    targets.dedup();
    let scale = opts.scale(r) as f32;
    let mut out = Vec::with_capacity(2 * targets.len() * dims.num_hidden_layers);
    for layer in 0..dims.num_hidden_layers {
        for &proj in &targets {
            let (d_in, d_out) = proj.dims(dims);
            let prefix = format!(
                "base_model.model.model.layers.{layer}.{}.{}",
                proj.parent(),
                proj.hf_name()
            );
            // ‖W·x‖ ≈ g·√(d_out/d_in)·‖x‖ and ‖s·B·A·x‖ ≈ s·σ_B·√(r·d_out/d_in)·‖x‖, so
            // σ_B = rel·g / (s·√r) gives the ratio `rel` independent of the shapes.
            let gain = projection_gain(proj, dims.num_hidden_layers);
            let sigma_b = opts.delta_rel * gain / (scale * (r as f32).sqrt());
            for (suffix, shape, std) in [
                ("lora_A", vec![r, d_in], 1.0 / (d_in as f32).sqrt()),
                ("lora_B", vec![d_out, r], sigma_b),
            ] {
                let tensor_name = format!("{prefix}.{suffix}.weight");
                let mut spec = TensorSpec::new(tensor_name, shape, dtype, Init::normal(std));
                spec.stream = stream_id(&format!("{name}/{}", spec.name));
                out.push(spec);
            }
        }
    }
    out
}

/// `adapter_config.json` with PEFT 0.21's full field set.
pub fn adapter_config(base_model: &str, r: usize, opts: &GenAdaptersOptions) -> Value {
    let alpha = opts.lora_alpha(r);
    let lora_alpha = if alpha.fract() == 0.0 {
        json!(alpha as u64)
    } else {
        json!(alpha)
    };
    let mut targets = opts.targets.clone();
    targets.sort();
    targets.dedup();
    let target_modules: Vec<&str> = targets.iter().map(|t| t.hf_name()).collect();
    json!({
        "alora_invocation_tokens": null,
        "alpha_pattern": {},
        "arrow_config": null,
        "auto_mapping": {
            "base_model_class": "LlamaForCausalLM",
            "parent_library": "transformers.models.llama.modeling_llama"
        },
        "base_model_name_or_path": base_model,
        "bias": "none",
        "corda_config": null,
        "ensure_weight_tying": false,
        "eva_config": null,
        "exclude_modules": null,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": false,
        "kasa_config": null,
        "layer_replication": null,
        "layers_pattern": null,
        "layers_to_transform": null,
        "loftq_config": {},
        "lora_alpha": lora_alpha,
        "lora_bias": false,
        "lora_dropout": 0.0,
        "lora_ga_config": null,
        "megatron_config": null,
        "megatron_core": "megatron.core",
        "modules_to_save": null,
        "monteclora_config": null,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": target_modules,
        "target_parameters": null,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": null,
        "use_bdlora": null,
        "use_dora": false,
        "use_qalora": false,
        "use_rslora": opts.use_rslora,
        "velora_config": null,
    })
}

/// Writes `opts.count` adapter directories under `opts.out_dir` and returns their paths.
pub fn write_adapters(opts: &GenAdaptersOptions) -> anyhow::Result<Vec<PathBuf>> {
    anyhow::ensure!(
        !opts.ranks.is_empty(),
        "--ranks is empty; give at least one rank, e.g. --ranks 8,16"
    );
    anyhow::ensure!(
        opts.ranks.iter().all(|&r| r > 0),
        "--ranks contains 0; LoRA ranks must be at least 1"
    );
    anyhow::ensure!(
        !opts.targets.is_empty(),
        "--targets is empty; give e.g. --targets q,v"
    );
    anyhow::ensure!(
        opts.alpha_ratio > 0.0 && opts.alpha_ratio.is_finite(),
        "--alpha-ratio must be positive, got {}",
        opts.alpha_ratio
    );
    let (dims, model_dtype) = read_model_dims(&opts.model_dir)?;
    let dtype = opts.dtype.or(model_dtype).unwrap_or(WeightDtype::F32);
    let base_model = opts.model_dir.to_string_lossy();
    std::fs::create_dir_all(&opts.out_dir)
        .with_context(|| format!("creating {}", opts.out_dir.display()))?;

    let mut dirs = Vec::with_capacity(opts.count);
    for index in 0..opts.count {
        let r = opts.ranks[index % opts.ranks.len()];
        let name = adapter_name(index, r);
        let dir = opts.out_dir.join(&name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tensors = adapter_tensors(&dims, &name, r, dtype, opts);
        let refs: Vec<&TensorSpec> = tensors.iter().collect();
        write_safetensors(&dir.join("adapter_model.safetensors"), &refs, opts.seed)?;
        write_json(
            &dir.join("adapter_config.json"),
            &adapter_config(&base_model, r, opts),
        )?;
        tracing::info!(adapter = %name, rank = r, tensors = tensors.len(), "wrote adapter");
        dirs.push(dir);
    }
    Ok(dirs)
}

#[cfg(test)]
#[path = "adapters_tests.rs"]
mod tests;
