//! The base model's weights in host memory, organised per layer, and their device copy.
//! Matrices keep the format they were stored in (f32/f16/bf16/ggml blocks); norms are f32.
use std::path::Path;

use crate::adapter::{LoraAdapter, LoraModule};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::{Architecture, ModelConfig, Tokenizer, Weights};
use thaw_kernels::cpu::WeightMatrix;

/// One decoder layer's weights. Linear weights are `[d_out, d_in]` (HF layout).
#[derive(Clone, Debug)]
pub struct HostLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// q, k, v, o, gate, up, down in [`LoraModule::ALL`] order.
    pub proj: [WeightMatrix; 7],
    /// q, k, v, o biases where the architecture has them.
    pub bias: [Option<Vec<f32>>; 4],
}

/// A whole Llama-family model in host memory.
#[derive(Clone, Debug)]
pub struct HostModel {
    pub config: ModelConfig,
    pub embed: WeightMatrix,
    pub layers: Vec<HostLayer>,
    pub norm: Vec<f32>,
    /// None when the embedding is tied.
    pub lm_head: Option<WeightMatrix>,
}

impl HostModel {
    /// Loads a HF model directory (config.json + safetensors), or a `.gguf` file.
    pub fn load(dir: &Path) -> Result<Self> {
        if crate::model::gguf::is_gguf_path(dir) {
            return Ok(Self::load_with_tokenizer(dir)?.0);
        }
        let config = ModelConfig::from_dir(dir)?;
        let mut w = Weights::load_dir(dir)?;
        Self::from_weights(config, &mut w)
    }

    /// Loads a model and its tokenizer from a HF directory or a `.gguf` file.
    pub fn load_with_tokenizer(path: &Path) -> Result<(Self, Tokenizer)> {
        if crate::model::gguf::is_gguf_path(path) {
            let g = crate::model::gguf::load_gguf(path)?;
            let mut w = g.weights;
            let model = Self::from_weights(g.config, &mut w)?;
            return Ok((model, g.tokenizer));
        }
        let model = Self::load(path)?;
        let tok = Tokenizer::from_dir(path, &model.config)?;
        Ok((model, tok))
    }

    /// Assembles the model from loaded tensors, checking every name and shape.
    pub fn from_weights(config: ModelConfig, w: &mut Weights) -> Result<Self> {
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed = w.take_matrix("model.embed_tokens.weight", v, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let proj = LoraModule::ALL.map(|m| {
                let (d_in, d_out) = c.module_shape(m);
                w.take_matrix(
                    &format!("{p}.{}.{}.weight", m.parent(), m.hf_name()),
                    d_out,
                    d_in,
                )
            });
            let [q, k, vv, o, g, u, d] = proj;
            // Qwen2 biases q, k and v; Llama's `attention_bias` biases o as well.
            let mut bias = |m: LoraModule| -> Result<Option<Vec<f32>>> {
                let biased = c.attention_bias
                    && (m != LoraModule::O || c.architecture != Architecture::Qwen2)
                    && m.parent() == "self_attn";
                if !biased {
                    return Ok(None);
                }
                let (_, d_out) = c.module_shape(m);
                let name = format!("{p}.self_attn.{}.bias", m.hf_name());
                Ok(Some(w.take(&name, &[d_out])?.data))
            };
            let bias = [
                bias(LoraModule::Q)?,
                bias(LoraModule::K)?,
                bias(LoraModule::V)?,
                bias(LoraModule::O)?,
            ];
            layers.push(HostLayer {
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?.data,
                post_norm: w
                    .take(&format!("{p}.post_attention_layernorm.weight"), &[h])?
                    .data,
                proj: [q?, k?, vv?, o?, g?, u?, d?],
                bias,
            });
        }
        let norm = w.take("model.norm.weight", &[h])?.data;
        let lm_head = if c.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.take_matrix("lm_head.weight", v, h)?)
        };
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Re-encodes every matrix in `format` (e.g. F32 to serve a quantised file dequantised,
    /// the oracle its quantised path is checked against).
    pub fn convert_weights(&mut self, format: thaw_kernels::cpu::WeightFormat) -> Result<()> {
        let conv = |m: &mut WeightMatrix| -> Result<()> {
            *m = m.convert(format)?;
            Ok(())
        };
        conv(&mut self.embed)?;
        if let Some(h) = &mut self.lm_head {
            conv(h)?;
        }
        for l in &mut self.layers {
            for p in &mut l.proj {
                conv(p)?;
            }
        }
        Ok(())
    }

    /// The weight formats of the layers' projections by share of their elements (e.g.
    /// `Q4_1 75% + Q4_K 25%`), or the one format: how a GGUF from `llama-quantize` (which
    /// keeps some tensors at another type) is labelled in reports.
    pub fn format_mix(&self) -> String {
        use thaw_kernels::cpu::WeightFormat;
        let mut by: Vec<(WeightFormat, usize)> = Vec::new();
        for w in self.layers.iter().flat_map(|l| l.proj.iter()) {
            match by.iter_mut().find(|(f, _)| *f == w.format()) {
                Some((_, n)) => *n += w.rows() * w.cols(),
                None => by.push((w.format(), w.rows() * w.cols())),
            }
        }
        by.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        if by.len() == 1 {
            return by[0].0.name().to_string();
        }
        let total: usize = by.iter().map(|(_, n)| n).sum();
        by.iter()
            .map(|(f, n)| format!("{} {:.0}%", f.name(), 100.0 * *n as f64 / total as f64))
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// Bytes the matrices take in memory as stored.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| l.proj.iter())
            .map(WeightMatrix::storage_bytes)
            .sum();
        layers + self.embed.storage_bytes() + self.lm_head.as_ref().map_or(0, |h| h.storage_bytes())
    }

    /// Folds an adapter into the base weights: W ← W + scale·B·A for every targeted module.
    /// The merged model is the oracle the multi-LoRA path is checked against.
    pub fn merge_adapter(&mut self, adapter: &LoraAdapter) {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for m in LoraModule::ALL {
                if let Some(l) = adapter.get(i, m) {
                    let (d_in, d_out) = self.config.module_shape(m);
                    // The stored values, widened exactly: the oracle sees what kernels read.
                    let (a, b) = (l.a.to_f32(), l.b.to_f32());
                    let lora = thaw_kernels::cpu::LoraRef {
                        a: &a,
                        b: &b,
                        rank: l.rank,
                        scale: l.scale,
                    };
                    thaw_kernels::cpu::merge_lora_into(
                        layer.proj[m.index()].make_f32(),
                        lora,
                        d_in,
                        d_out,
                    );
                }
            }
        }
    }
}

/// A layer's weights on the backend.
pub(crate) struct DeviceLayer<B: Backend> {
    pub input_norm: B::Vector,
    pub post_norm: B::Vector,
    pub proj: Vec<B::Linear>,
}

/// The model's weights on the backend.
pub(crate) struct DeviceModel<B: Backend> {
    pub embed: B::Linear,
    pub layers: Vec<DeviceLayer<B>>,
    pub norm: B::Vector,
    pub lm_head: Option<B::Linear>,
}

impl<B: Backend> DeviceModel<B> {
    pub fn upload(backend: &B, m: HostModel) -> Result<Self> {
        let lin = |t: WeightMatrix, bias: Option<Vec<f32>>| backend.upload_weight(t, bias);
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in m.layers {
            let [qb, kb, vb, ob] = l.bias;
            let [q, k, v, o, gate, up, down] = l.proj;
            // q/k/v and gate/up share their input: a backend may place each group as one
            // matrix (`Backend::upload_weight_group`); `proj` keeps LoraModule::ALL order.
            let mut proj = backend.upload_weight_group(vec![(q, qb), (k, kb), (v, vb)])?;
            proj.push(lin(o, ob)?);
            proj.extend(backend.upload_weight_group(vec![(gate, None), (up, None)])?);
            proj.push(lin(down, None)?);
            layers.push(DeviceLayer {
                input_norm: backend.upload_vector(l.input_norm)?,
                post_norm: backend.upload_vector(l.post_norm)?,
                proj,
            });
        }
        Ok(Self {
            embed: lin(m.embed, None)?,
            layers,
            norm: backend.upload_vector(m.norm)?,
            lm_head: m.lm_head.map(|t| lin(t, None)).transpose()?,
        })
    }
}
