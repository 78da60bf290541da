//! A Llama-family model from a GGUF file: `llama.*` metadata → [`ModelConfig`], `blk.N.*`
//! tensors → the HF names [`HostModel`](crate::engine::HostModel) takes, with llama.cpp's
//! Q/K row permutation undone.

use std::path::Path;

use thaw_kernels::cpu::{RopeScaling, WeightData, WeightFormat};

use super::reader::{GgufFile, GgufTensorInfo, GgufValue};
use super::tokenizer::tokenizer_from_gguf;
use crate::model::{Architecture, FileBytes, ModelConfig, ModelError, Tokenizer, Weights};

/// Everything a GGUF file defines: config, weights (by HF name) and tokenizer.
pub struct GgufModel {
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    /// The file's `general.name`, when set.
    pub name: Option<String>,
}

fn err(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Gguf {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

struct Meta<'a> {
    f: &'a GgufFile,
    path: &'a Path,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&GgufValue> {
        self.f.get(key)
    }

    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)?
            .ok_or_else(|| err(self.path, format!("metadata `{key}` is missing")))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .filter(|&v| v <= 1 << 24)
                .map(Some)
                .ok_or_else(|| {
                    err(
                        self.path,
                        format!("metadata `{key}` must be an integer ≤ 2^24, got {v:?}"),
                    )
                }),
        }
    }

    fn f32_or(&self, key: &str, default: f32) -> Result<f32, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|v| v as f32)
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| {
                    err(
                        self.path,
                        format!("metadata `{key}` must be a positive number, got {v:?}"),
                    )
                }),
        }
    }
}

fn config(m: &Meta<'_>) -> Result<ModelConfig, ModelError> {
    let arch = m
        .get("general.architecture")
        .and_then(GgufValue::as_str)
        .unwrap_or("");
    if arch != "llama" {
        return Err(ModelError::UnsupportedArchitecture {
            found: format!("{arch} (GGUF `general.architecture`; Thaw reads `llama` GGUF files)"),
        });
    }
    let hidden = m.usize("llama.embedding_length")?;
    let heads = m.usize("llama.attention.head_count")?;
    if heads == 0 || !hidden.is_multiple_of(heads) {
        return Err(err(
            m.path,
            format!("embedding_length {hidden} is not a multiple of head_count {heads}"),
        ));
    }
    let kv_heads = m
        .opt_usize("llama.attention.head_count_kv")?
        .unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(err(
            m.path,
            format!("head_count {heads} is not a multiple of head_count_kv {kv_heads}"),
        ));
    }
    let head_dim = m
        .opt_usize("llama.attention.key_length")?
        .unwrap_or(hidden / heads);
    if let Some(rot) = m.opt_usize("llama.rope.dimension_count")? {
        if rot != head_dim {
            return Err(err(
                m.path,
                format!("partial rotary embeddings (rope.dimension_count {rot} < head dim {head_dim}) are not supported"),
            ));
        }
    }
    if let Some(s) = m.get("llama.rope.scaling.type").and_then(GgufValue::as_str) {
        if s != "none" {
            return Err(ModelError::UnsupportedRopeScaling(format!(
                "{s} (GGUF `llama.rope.scaling.type`)"
            )));
        }
    }
    let tokens = m
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .map(<[_]>::len);
    let vocab = match (m.opt_usize("llama.vocab_size")?, tokens) {
        (Some(v), _) => v,
        (None, Some(t)) => t,
        (None, None) => {
            return Err(err(
                m.path,
                "neither `llama.vocab_size` nor `tokenizer.ggml.tokens` is set",
            ))
        }
    };
    let tied = !m.f.tensors.iter().any(|t| t.name == "output.weight");
    let id = |k: &str| {
        m.opt_usize(k)
            .map(|v| v.and_then(|v| u32::try_from(v).ok()))
    };
    Ok(ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: m.usize("llama.feed_forward_length")?,
        num_layers: m.usize("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: m.f32_or("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
        rope_theta: m.f32_or("llama.rope.freq_base", 10_000.0)?,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: m.opt_usize("llama.context_length")?.unwrap_or(2048),
        tie_word_embeddings: tied,
        attention_bias: false,
        sliding_window: None,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
    })
}

/// The HF name of a llama.cpp tensor name (`None` for tensors Thaw does not use).
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let module = match rest.strip_suffix(".weight")? {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}.weight"))
}

/// Undoes llama.cpp's `permute` of Q/K rows (`convert_hf_to_gguf.py`): within each head the
/// file interleaves the two rotary halves (row `2i + j` holds HF row `j·hd/2 + i`). Rows are
/// moved whole, so quantised blocks are untouched.
fn unpermute_rows(bytes: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_bytes = bytes.len() / rows;
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * half + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

fn tensor_data(format: WeightFormat, b: &[u8]) -> WeightData {
    let halves = || b.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    match format {
        WeightFormat::F32 => WeightData::F32(
            b.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        WeightFormat::F16 => WeightData::F16(halves().map(half::f16::from_bits).collect()),
        WeightFormat::BF16 => WeightData::BF16(halves().map(half::bf16::from_bits).collect()),
        q => WeightData::Quant(q, b.to_vec().into()),
    }
}

fn weights(
    path: &Path,
    f: &GgufFile,
    bytes: &[u8],
    cfg: &ModelConfig,
) -> Result<Weights, ModelError> {
    let mut w = Weights::default();
    for t in &f.tensors {
        let Some(name) = hf_name(&t.name) else {
            tracing::debug!(tensor = %t.name, "GGUF tensor not used by Thaw");
            continue;
        };
        let shape = t.shape();
        let raw = f.tensor_data(bytes, t);
        let heads = match &*t.name {
            n if n.ends_with(".attn_q.weight") => Some(cfg.num_heads),
            n if n.ends_with(".attn_k.weight") => Some(cfg.num_kv_heads),
            _ => None,
        };
        let data = match heads {
            Some(h) => {
                check_permutable(path, t, h)?;
                tensor_data(t.format, &unpermute_rows(raw, shape[0], h))
            }
            None => tensor_data(t.format, raw),
        };
        if !w.insert(name, shape, data)? {
            return Err(err(path, format!("tensor `{}` appears twice", t.name)));
        }
    }
    Ok(w)
}

pub(super) fn check_permutable(
    path: &Path,
    t: &GgufTensorInfo,
    heads: usize,
) -> Result<(), ModelError> {
    let rows = t.shape().first().copied().unwrap_or(0);
    if t.dims.len() != 2 || heads == 0 || rows == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(err(
            path,
            format!(
                "tensor `{}` has shape {:?}; expected 2-D with a positive number of rows that is a multiple of 2·{heads} heads (and heads > 0)",
                t.name,
                t.shape()
            ),
        ));
    }
    Ok(())
}

/// Reads a Llama-family GGUF file: config, weights in their stored formats, tokenizer.
pub fn load_gguf(path: &Path) -> Result<GgufModel, ModelError> {
    let bytes = FileBytes::open(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    load_gguf_bytes(&bytes, path)
}

/// [`load_gguf`] over the file's bytes (`path` only names it in errors).
pub fn load_gguf_bytes(bytes: &[u8], path: &Path) -> Result<GgufModel, ModelError> {
    let f = GgufFile::parse(bytes).map_err(|e| err(path, e.to_string()))?;
    let meta = Meta { f: &f, path };
    let config = config(&meta)?;
    let tokenizer = tokenizer_from_gguf(&f, &config).map_err(|e| match e {
        ModelError::Tokenizer { reason } => err(path, format!("tokenizer: {reason}")),
        other => other,
    })?;
    let weights = weights(path, &f, bytes, &config)?;
    Ok(GgufModel {
        config,
        weights,
        tokenizer,
        name: f
            .get("general.name")
            .and_then(GgufValue::as_str)
            .map(str::to_string),
    })
}
