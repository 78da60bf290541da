//! The model presets `thaw gen-model` knows, and the weight dtypes it can write.

use std::fmt;

/// Element type of generated weights, as written into safetensors and `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum WeightDtype {
    /// IEEE-754 single precision (`torch.float32`).
    F32,
    /// IEEE-754 half precision (`torch.float16`).
    F16,
    /// bfloat16 (`torch.bfloat16`).
    Bf16,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::Bf16 => 2,
        }
    }

    /// The safetensors dtype tag.
    pub fn safetensors(self) -> safetensors::Dtype {
        match self {
            WeightDtype::F32 => safetensors::Dtype::F32,
            WeightDtype::F16 => safetensors::Dtype::F16,
            WeightDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    /// The name transformers writes as `torch_dtype` in `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::F16 => "float16",
            WeightDtype::Bf16 => "bfloat16",
        }
    }

    /// Parses a `torch_dtype` / `dtype` value from a `config.json`.
    pub fn from_torch_name(name: &str) -> Option<Self> {
        match name {
            "float32" | "float" => Some(WeightDtype::F32),
            "float16" | "half" => Some(WeightDtype::F16),
            "bfloat16" => Some(WeightDtype::Bf16),
            _ => None,
        }
    }

    /// Encodes `values` little-endian into `out` (`out.len() == values.len() * size_bytes`).
    pub(crate) fn encode(self, values: &[f32], out: &mut [u8]) {
        debug_assert_eq!(out.len(), values.len() * self.size_bytes());
        match self {
            WeightDtype::F32 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            WeightDtype::F16 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                    o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
            }
            WeightDtype::Bf16 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                    o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                }
            }
        }
    }
}

impl fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::Bf16 => "bf16",
        })
    }
}

/// The layer shapes of a Llama-family model that generators need (from a preset or a
/// `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelDims {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
}

/// A linear projection of a Llama decoder layer; also the LoRA target names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Projection {
    #[value(name = "q", alias = "q_proj")]
    Q,
    #[value(name = "k", alias = "k_proj")]
    K,
    #[value(name = "v", alias = "v_proj")]
    V,
    #[value(name = "o", alias = "o_proj")]
    O,
    #[value(name = "gate", alias = "gate_proj")]
    Gate,
    #[value(name = "up", alias = "up_proj")]
    Up,
    #[value(name = "down", alias = "down_proj")]
    Down,
}

impl Projection {
    /// All projections in HF parameter order.
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module name in HF / PEFT (`q_proj`, ...).
    pub fn hf_name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// The submodule of a decoder layer holding it (`self_attn` or `mlp`).
    pub fn parent(self) -> &'static str {
        match self {
            Projection::Q | Projection::K | Projection::V | Projection::O => "self_attn",
            Projection::Gate | Projection::Up | Projection::Down => "mlp",
        }
    }

    /// `(in_features, out_features)`; the HF weight has shape `[out, in]`.
    pub fn dims(self, m: &ModelDims) -> (usize, usize) {
        let q = m.num_attention_heads * m.head_dim;
        let kv = m.num_key_value_heads * m.head_dim;
        match self {
            Projection::Q => (m.hidden_size, q),
            Projection::K | Projection::V => (m.hidden_size, kv),
            Projection::O => (q, m.hidden_size),
            Projection::Gate | Projection::Up => (m.hidden_size, m.intermediate_size),
            Projection::Down => (m.intermediate_size, m.hidden_size),
        }
    }
}

/// Shapes and defaults of one generated Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPreset {
    /// Name used on the command line (`--preset`).
    pub name: &'static str,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Rows of `embed_tokens` / `lm_head`; may exceed the tokenizer's vocabulary (padding).
    pub vocab_size: usize,
    /// Vocabulary the BPE trainer is asked for (special tokens included). The trainer may
    /// stop earlier when the corpus runs out of pairs; the rest of `vocab_size` is padding.
    pub tokenizer_vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Dtype written when `--dtype` is not given.
    pub default_dtype: WeightDtype,
}

impl ModelPreset {
    /// The layer shapes of this preset.
    pub fn dims(&self) -> ModelDims {
        ModelDims {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    /// Output features of `q_proj` (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Output features of `k_proj` / `v_proj` (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}

/// Names accepted by [`preset`], in size order.
pub const PRESET_NAMES: [&str; 3] = ["tiny", "small", "llama-7b-shape"];

/// Looks up a preset by its command-line name.
pub fn preset(name: &str) -> Option<ModelPreset> {
    match name {
        // Shapes of the HF-written fixture, with a larger vocabulary and context.
        "tiny" => Some(ModelPreset {
            name: "tiny",
            hidden_size: 64,
            intermediate_size: 172,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            vocab_size: 512,
            tokenizer_vocab_size: 512,
            max_position_embeddings: 512,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            default_dtype: WeightDtype::F32,
        }),
        // CPU throughput benchmarks: ~26M parameters.
        "small" => Some(ModelPreset {
            name: "small",
            hidden_size: 512,
            intermediate_size: 1408,
            num_hidden_layers: 8,
            num_attention_heads: 8,
            num_key_value_heads: 4,
            head_dim: 64,
            vocab_size: 2048,
            tokenizer_vocab_size: 2048,
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            default_dtype: WeightDtype::F32,
        }),
        // Llama-2-7B shapes; the tokenizer is small, the rest of the 32000 rows is padding.
        "llama-7b-shape" => Some(ModelPreset {
            name: "llama-7b-shape",
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            vocab_size: 32000,
            tokenizer_vocab_size: 2048,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            default_dtype: WeightDtype::Bf16,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_preset_resolves_and_is_consistent() {
        for name in PRESET_NAMES {
            let p = preset(name).expect(name);
            assert_eq!(p.name, name);
            assert_eq!(p.q_dim(), p.hidden_size, "{name}: heads * head_dim");
            assert_eq!(
                p.num_attention_heads % p.num_key_value_heads,
                0,
                "{name}: GQA"
            );
            assert!(p.tokenizer_vocab_size <= p.vocab_size, "{name}");
        }
        assert!(preset("llama-70b").is_none());
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16] {
            assert_eq!(WeightDtype::from_torch_name(d.torch_name()), Some(d));
        }
    }
}
