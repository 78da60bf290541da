//! The base model's weights in host memory (f32), organised per layer, and their device copy.
use std::path::Path;

use crate::adapter::{LoraAdapter, LoraModule};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::{Architecture, ModelConfig, TensorF32, Weights};

/// One decoder layer's weights. Linear weights are `[d_out, d_in]` (HF layout).
#[derive(Clone, Debug)]
pub struct HostLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// q, k, v, o, gate, up, down in [`LoraModule::ALL`] order.
    pub proj: [TensorF32; 7],
    /// q, k, v, o biases where the architecture has them.
    pub bias: [Option<Vec<f32>>; 4],
}

/// A whole Llama-family model in host memory.
#[derive(Clone, Debug)]
pub struct HostModel {
    pub config: ModelConfig,
    pub embed: TensorF32,
    pub layers: Vec<HostLayer>,
    pub norm: Vec<f32>,
    /// None when the embedding is tied.
    pub lm_head: Option<TensorF32>,
}

impl HostModel {
    /// Loads a HF model directory (config.json + safetensors).
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut w = Weights::load_dir(dir)?;
        Self::from_weights(config, &mut w)
    }

    /// Assembles the model from loaded tensors, checking every name and shape.
    pub fn from_weights(config: ModelConfig, w: &mut Weights) -> Result<Self> {
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed = w.take("model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let proj = LoraModule::ALL.map(|m| {
                let (d_in, d_out) = c.module_shape(m);
                w.take(
                    &format!("{p}.{}.{}.weight", m.parent(), m.hf_name()),
                    &[d_out, d_in],
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
            Some(w.take("lm_head.weight", &[v, h])?)
        };
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Folds an adapter into the base weights: W ← W + scale·B·A for every targeted module.
    /// The merged model is the oracle the multi-LoRA path is checked against.
    pub fn merge_adapter(&mut self, adapter: &LoraAdapter) {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for m in LoraModule::ALL {
                if let Some(l) = adapter.get(i, m) {
                    let (d_in, d_out) = self.config.module_shape(m);
                    let lora = thaw_kernels::cpu::LoraRef {
                        a: &l.a,
                        b: &l.b,
                        rank: l.rank,
                        scale: l.scale,
                    };
                    thaw_kernels::cpu::merge_lora_into(
                        &mut layer.proj[m.index()].data,
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
        let lin = |t: TensorF32, bias: Option<Vec<f32>>| {
            let (d_out, d_in) = (t.shape[0], t.shape[1]);
            backend.upload_linear(t.data, d_out, d_in, bias)
        };
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in m.layers {
            let mut biases = l.bias;
            let mut proj = Vec::with_capacity(7);
            for (i, t) in l.proj.into_iter().enumerate() {
                let bias = biases.get_mut(i).and_then(Option::take);
                proj.push(lin(t, bias)?);
            }
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
