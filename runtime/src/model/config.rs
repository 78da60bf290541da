//! The base model's `config.json` (+ `generation_config.json`), as written by HF transformers
//! 4.x and 5.x `save_pretrained`, reduced to what a Llama-family forward needs.

use std::path::Path;

use serde_json::Value;
use thaw_kernels::cpu::RopeScaling;

use super::error::ModelError;
use super::json::{self, Obj};
use crate::adapter::LoraModule;

/// The model families Thaw runs. They share one forward; they differ in attention biases
/// (Qwen2) and sliding windows (Mistral, Qwen2).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

impl Architecture {
    /// From `model_type` in config.json.
    pub fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// From the class name in `architectures[0]`.
    pub fn from_class_name(s: &str) -> Option<Self> {
        match s {
            "LlamaForCausalLM" => Some(Self::Llama),
            "MistralForCausalLM" => Some(Self::Mistral),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            _ => None,
        }
    }
}

/// The parts of a HF config a Llama-family forward needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (always for Qwen2 unless the config says otherwise; Llama's
    /// `attention_bias`, which also puts one on o_proj).
    pub attention_bias: bool,
    /// Mistral `sliding_window`, Qwen2 `sliding_window` when `use_sliding_window`; `None` when
    /// null or disabled.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn invalid(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Wraps a `json::` reader result with the field name.
fn field<T>(key: &str, r: Result<T, String>) -> Result<T, ModelError> {
    r.map_err(|reason| invalid(key, reason))
}

/// Reads and parses a JSON file; a missing file is `MissingFile` with `hint`.
pub(crate) fn read_json(path: &Path, hint: &str) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ModelError::MissingFile {
            path: path.to_path_buf(),
            hint: hint.to_string(),
        },
        _ => ModelError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        },
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn as_object<'a>(v: &'a Value, path: &Path) -> Result<&'a Obj, ModelError> {
    v.as_object().ok_or_else(|| ModelError::Json {
        path: path.to_path_buf(),
        reason: "expected a JSON object at the top level".into(),
    })
}

fn token_ids(key: &str, v: &Value) -> Result<Vec<u32>, ModelError> {
    field(key, json::usize_list_of(v))?
        .into_iter()
        .map(|id| {
            u32::try_from(id).map_err(|_| invalid(key, format!("token id {id} is too large")))
        })
        .collect()
}

impl ModelConfig {
    /// Reads `config.json` from a HF model directory; `generation_config.json`, when present,
    /// supplies the end-of-sequence ids (it wins over config.json, as in `generate`).
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let value = read_json(
            &path,
            "a model directory needs config.json as written by transformers `save_pretrained`",
        )?;
        let mut cfg = Self::from_value(as_object(&value, &path)?)?;

        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            let gen = read_json(&gen_path, "")?;
            let gen = as_object(&gen, &gen_path)?;
            if let Some(v) = json::opt(gen, "eos_token_id") {
                cfg.eos_token_ids = token_ids("generation_config.eos_token_id", v)?;
            }
            if cfg.bos_token_id.is_none() {
                if let Some(v) = json::opt(gen, "bos_token_id") {
                    cfg.bos_token_id = token_ids("generation_config.bos_token_id", v)?
                        .first()
                        .copied();
                }
            }
        }
        Ok(cfg)
    }

    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let path = Path::new("config.json");
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::from_value(as_object(&value, path)?)
    }

    fn from_value(obj: &Obj) -> Result<Self, ModelError> {
        let architecture = architecture(obj)?;
        let required = |key: &str| -> Result<usize, ModelError> {
            match field(key, json::get_usize(obj, key))? {
                Some(0) => Err(invalid(key, "must be positive")),
                Some(v) => Ok(v),
                None => Err(invalid(key, "is required but missing")),
            }
        };
        let vocab_size = required("vocab_size")?;
        let hidden_size = required("hidden_size")?;
        let intermediate_size = required("intermediate_size")?;
        let num_layers = required("num_hidden_layers")?;
        let num_heads = required("num_attention_heads")?;
        let num_kv_heads = match field(
            "num_key_value_heads",
            json::get_usize(obj, "num_key_value_heads"),
        )? {
            Some(0) => return Err(invalid("num_key_value_heads", "must be positive")),
            Some(v) => v,
            None => num_heads,
        };
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(
                "num_key_value_heads",
                format!("({num_kv_heads}) must divide num_attention_heads ({num_heads})"),
            ));
        }
        let head_dim = match field("head_dim", json::get_usize(obj, "head_dim"))? {
            Some(0) => return Err(invalid("head_dim", "must be positive")),
            Some(v) => v,
            None if hidden_size % num_heads != 0 => {
                return Err(invalid(
                    "hidden_size",
                    format!(
                        "({hidden_size}) must be a multiple of num_attention_heads ({num_heads})"
                    ),
                ))
            }
            None => hidden_size / num_heads,
        };

        // Every weight's element count must be a number: sizes whose products overflow come
        // from a corrupt or hostile config, and would overflow the shape arithmetic later.
        for (key, product) in [
            ("num_attention_heads", num_heads.checked_mul(head_dim)),
            ("num_key_value_heads", num_kv_heads.checked_mul(head_dim)),
            ("vocab_size", vocab_size.checked_mul(hidden_size)),
            (
                "intermediate_size",
                intermediate_size.checked_mul(hidden_size),
            ),
            (
                "hidden_size",
                num_heads
                    .checked_mul(head_dim)
                    .and_then(|q| q.checked_mul(hidden_size)),
            ),
        ] {
            if product.is_none_or(|p| p > isize::MAX as usize / 8) {
                return Err(invalid(
                    key,
                    "makes a weight matrix too large to address; the config is corrupt",
                ));
            }
        }
        if let Some(act) = field("hidden_act", json::get_str(obj, "hidden_act"))? {
            if act != "silu" {
                return Err(invalid(
                    "hidden_act",
                    format!("is `{act}`; Thaw's MLP is SwiGLU (`silu`)"),
                ));
            }
        }
        if field("mlp_bias", json::get_bool(obj, "mlp_bias"))? == Some(true) {
            return Err(invalid("mlp_bias", "is true; MLP biases are not supported"));
        }
        if json::opt(obj, "quantization_config").is_some() {
            return Err(invalid(
                "quantization_config",
                "is set; quantized checkpoints are not supported — use an F32/F16/BF16 checkpoint",
            ));
        }

        let (rope_theta, rope_scaling) = rope(obj)?;
        let rms_norm_eps = finite_f32(
            "rms_norm_eps",
            field("rms_norm_eps", json::get_f64(obj, "rms_norm_eps"))?.unwrap_or(1e-6),
        )?;
        if rms_norm_eps < 0.0 {
            return Err(invalid("rms_norm_eps", "must not be negative"));
        }
        let default_max_pos = match architecture {
            Architecture::Llama => 2048,
            Architecture::Mistral => 4096 * 32,
            Architecture::Qwen2 => 32768,
        };
        let max_position_embeddings = field(
            "max_position_embeddings",
            json::get_usize(obj, "max_position_embeddings"),
        )?
        .unwrap_or(default_max_pos);
        let tie_word_embeddings = field(
            "tie_word_embeddings",
            json::get_bool(obj, "tie_word_embeddings"),
        )?
        .unwrap_or(false);
        let explicit_bias = field("attention_bias", json::get_bool(obj, "attention_bias"))?;
        let attention_bias = match architecture {
            // Qwen2's attention hard-codes bias=True on q/k/v.
            Architecture::Qwen2 => explicit_bias.unwrap_or(true),
            Architecture::Llama | Architecture::Mistral => explicit_bias.unwrap_or(false),
        };
        let window = field("sliding_window", json::get_usize(obj, "sliding_window"))?;
        let sliding_window = match architecture {
            Architecture::Llama => None,
            Architecture::Mistral => window,
            Architecture::Qwen2 => {
                if field(
                    "use_sliding_window",
                    json::get_bool(obj, "use_sliding_window"),
                )?
                .unwrap_or(false)
                {
                    window
                } else {
                    None
                }
            }
        };
        let bos_token_id = json::opt(obj, "bos_token_id")
            .map(|v| token_ids("bos_token_id", v))
            .transpose()?
            .and_then(|ids| ids.first().copied());
        let eos_token_ids = json::opt(obj, "eos_token_id")
            .map(|v| token_ids("eos_token_id", v))
            .transpose()?
            .unwrap_or_default();

        Ok(Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            attention_bias,
            sliding_window,
            bos_token_id,
            eos_token_ids,
        })
    }

    /// Width of the query projection output: `num_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key/value projection outputs: `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// (d_in, d_out) of a projection, for shape validation. HF stores the weight as
    /// `[d_out, d_in]`.
    pub fn module_shape(&self, m: LoraModule) -> (usize, usize) {
        match m {
            LoraModule::Q => (self.hidden_size, self.q_dim()),
            LoraModule::K | LoraModule::V => (self.hidden_size, self.kv_dim()),
            LoraModule::O => (self.q_dim(), self.hidden_size),
            LoraModule::Gate | LoraModule::Up => (self.hidden_size, self.intermediate_size),
            LoraModule::Down => (self.intermediate_size, self.hidden_size),
        }
    }
}

fn architecture(obj: &Obj) -> Result<Architecture, ModelError> {
    let model_type = field("model_type", json::get_str(obj, "model_type"))?;
    if let Some(a) = model_type.and_then(Architecture::from_model_type) {
        return Ok(a);
    }
    let class = obj
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    if let Some(a) = class.and_then(Architecture::from_class_name) {
        return Ok(a);
    }
    Err(ModelError::UnsupportedArchitecture {
        found: model_type
            .or(class)
            .unwrap_or("<config.json has neither model_type nor architectures>")
            .to_string(),
    })
}

/// `rope_theta` and scaling: transformers 5 writes `rope_parameters {rope_theta, rope_type, ..}`,
/// transformers 4 a top-level `rope_theta` plus an optional `rope_scaling {type|rope_type, ..}`.
/// `v` as the f32 the model computes with; a value beyond f32's range would be infinite and
/// turn the model's outputs into NaN.
fn finite_f32(key: &str, v: f64) -> Result<f32, ModelError> {
    let f = v as f32;
    if f.is_finite() {
        Ok(f)
    } else {
        Err(invalid(
            key,
            format!("is {v}, beyond the range of f32 (about ±3.4e38)"),
        ))
    }
}

fn rope(obj: &Obj) -> Result<(f32, RopeScaling), ModelError> {
    let params = json::opt(obj, "rope_parameters")
        .map(|v| {
            v.as_object()
                .ok_or_else(|| invalid("rope_parameters", "must be an object"))
        })
        .transpose()?;
    let legacy = json::opt(obj, "rope_scaling")
        .map(|v| {
            v.as_object()
                .ok_or_else(|| invalid("rope_scaling", "must be an object or null"))
        })
        .transpose()?;

    let theta =
        match params.map(|p| field("rope_parameters.rope_theta", json::get_f64(p, "rope_theta"))) {
            Some(Ok(Some(t))) => t,
            Some(Err(e)) => return Err(e),
            _ => field("rope_theta", json::get_f64(obj, "rope_theta"))?.unwrap_or(10_000.0),
        };
    if theta.is_nan() || theta <= 0.0 || !(theta as f32).is_finite() {
        return Err(invalid(
            "rope_theta",
            format!("must be a positive number within f32's range, got {theta}"),
        ));
    }

    let kind_of = |o: &Obj| -> Result<Option<String>, ModelError> {
        let t = field("rope_type", json::get_str(o, "rope_type"))?
            .or(field("type", json::get_str(o, "type"))?);
        Ok(t.map(str::to_string))
    };
    let mut source = None;
    for o in [params, legacy].into_iter().flatten() {
        if let Some(kind) = kind_of(o)? {
            source = Some((kind, o));
            break;
        }
    }
    let Some((kind, o)) = source else {
        return Ok((theta as f32, RopeScaling::None));
    };
    let num = |key: &str| -> Result<f32, ModelError> {
        let v = field(key, json::get_f64(o, key))?
            .ok_or_else(|| invalid(key, format!("is required for rope_type `{kind}`")))?;
        finite_f32(key, v)
    };
    let scaling = match kind.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: field(
                "original_max_position_embeddings",
                json::get_usize(o, "original_max_position_embeddings"),
            )?
            .ok_or_else(|| {
                invalid(
                    "original_max_position_embeddings",
                    "is required for rope_type `llama3`",
                )
            })?,
        },
        other => return Err(ModelError::UnsupportedRopeScaling(other.to_string())),
    };
    Ok((theta as f32, scaling))
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
