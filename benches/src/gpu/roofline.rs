//! What a step must move and compute at least, for `thaw-bench gpu`'s ratios: the bytes a
//! decode step reads (every weight once, the distinct adapters of the batch once, every
//! sequence's KV once) and the FLOPs of a prefill. Pure functions of the model's shape.
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::model::ModelConfig;

/// Bytes per element as the backend holds them.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ElemBytes {
    /// Weight matrices and norms (a mean for block formats).
    pub weight: f64,
    /// The paged K and V cache.
    pub kv: usize,
}

/// Bytes one decode step reads, by source.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct StepTraffic {
    pub weights: f64,
    pub adapters: f64,
    pub kv: f64,
}

impl StepTraffic {
    pub fn total(&self) -> f64 {
        self.weights + self.adapters + self.kv
    }
}

/// Elements of one decoder layer's seven projections.
pub fn layer_linear_params(c: &ModelConfig) -> usize {
    LoraModule::ALL
        .iter()
        .map(|&m| {
            let (i, o) = c.module_shape(m);
            i * o
        })
        .sum()
}

/// Weight elements a decode step of `rows` rows reads: every layer's projections and norms,
/// the final norm, the LM head, and `rows` rows of the embedding table.
pub fn decode_weight_elems(c: &ModelConfig, rows: usize) -> usize {
    let h = c.hidden_size;
    c.num_layers * (layer_linear_params(c) + 2 * h) + h + c.vocab_size * h + rows * h
}

/// Matrix elements the model holds: projections, embedding, and the LM head unless tied.
pub fn model_matrix_elems(c: &ModelConfig) -> usize {
    let head = if c.tie_word_embeddings { 0 } else { 1 };
    c.num_layers * layer_linear_params(c) + (1 + head) * c.vocab_size * c.hidden_size
}

/// KV bytes a decode step reads: each sequence's K and V over its context (`contexts`, the
/// lengths after this step's token is appended), every layer.
pub fn decode_kv_bytes(c: &ModelConfig, kv_elem: usize, contexts: &[usize]) -> f64 {
    let per_token = c.num_layers * c.kv_dim() * 2 * kv_elem;
    contexts.iter().map(|&n| (n * per_token) as f64).sum()
}

/// One decode step's traffic; `adapter_bytes` is the distinct adapters' bytes on the device.
pub fn decode_traffic(
    c: &ModelConfig,
    e: ElemBytes,
    contexts: &[usize],
    adapter_bytes: f64,
) -> StepTraffic {
    StepTraffic {
        weights: decode_weight_elems(c, contexts.len()) as f64 * e.weight,
        adapters: adapter_bytes,
        kv: decode_kv_bytes(c, e.kv, contexts),
    }
}

/// FLOPs of one layer's causal attention over a `tokens`-token prefill: QKᵀ and PV over the
/// `t(t+1)/2` visible pairs, every head, 2 FLOPs a multiply-add each.
pub fn prefill_attention_flops(c: &ModelConfig, tokens: usize) -> f64 {
    let t = tokens as f64;
    4.0 * (t * (t + 1.0) / 2.0) * (c.num_heads * c.head_dim) as f64
}

/// FLOPs of one sequence's prefill of `tokens` tokens: the projections (2 per weight per
/// token), causal attention (QKᵀ and PV over the `t(t+1)/2` visible pairs, 2 FLOPs a
/// multiply-add each) and one row of logits.
pub fn prefill_flops(c: &ModelConfig, tokens: usize) -> f64 {
    let t = tokens as f64;
    let proj = 2.0 * t * (c.num_layers * layer_linear_params(c)) as f64;
    let attn = c.num_layers as f64 * prefill_attention_flops(c, tokens);
    let logits = 2.0 * (c.vocab_size * c.hidden_size) as f64;
    proj + attn + logits
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn llama7b() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
            "intermediate_size":11008,"num_attention_heads":32,"num_key_value_heads":32,
            "num_hidden_layers":32,"vocab_size":32000,"rms_norm_eps":1e-5,
            "max_position_embeddings":4096}"#,
        )
        .unwrap()
    }

    /// Llama-2-7B: 6.74e9 parameters, 13.5 GB in bf16 (the issue's figure).
    #[test]
    fn llama_7b_shape_matches_the_published_parameter_count() {
        let c = llama7b();
        assert_eq!(layer_linear_params(&c), 4 * 4096 * 4096 + 3 * 4096 * 11008);
        let params = model_matrix_elems(&c) + 32 * 2 * 4096 + 4096;
        assert_eq!(params, 6_738_415_616);
        let e = ElemBytes { weight: 2.0, kv: 2 };
        let t = decode_traffic(&c, e, &[128], 0.0);
        // All but 31999 embedding rows: 13.48 GB.
        assert!((t.weights - 2.0 * (params - 31_999 * 4096) as f64).abs() < 1.0);
        // One 128-token context: 128 × 32 layers × 4096 × K,V × 2 B = 64 MiB.
        assert_eq!(t.kv, (128 * 32 * 4096 * 2 * 2) as f64);
    }

    /// 2·params·tokens dominates; attention adds 4·L·d·t(t+1)/2.
    #[test]
    fn prefill_flops_of_llama_7b() {
        let c = llama7b();
        let f = prefill_flops(&c, 2048);
        let proj = 2.0 * 2048.0 * (32 * layer_linear_params(&c)) as f64;
        let attn = 4.0 * (2048.0 * 2049.0 / 2.0) * (32 * 4096) as f64;
        assert!((f - proj - attn - 2.0 * 32000.0 * 4096.0).abs() < 1.0);
        // 26.53 TFLOP of projections + 1.10 of attention for 2,048 tokens.
        assert!((f / 1e12 - 27.63).abs() < 0.01, "{}", f / 1e12);
    }

    proptest! {
        /// More context or more adapter bytes never read less; more tokens never cost fewer
        /// FLOPs, and attention makes the cost per prompt token grow with the prompt.
        #[test]
        fn traffic_and_flops_are_monotone(ctx in proptest::collection::vec(1usize..4096, 1..64),
                                           extra in 1usize..512, t in 1usize..4096) {
            let c = llama7b();
            let e = ElemBytes { weight: 2.0, kv: 2 };
            let a = decode_traffic(&c, e, &ctx, 0.0);
            let mut longer = ctx.clone();
            longer[0] += extra;
            let b = decode_traffic(&c, e, &longer, 1e6);
            prop_assert!(b.kv > a.kv);
            prop_assert_eq!(b.weights, a.weights);
            prop_assert!(b.total() > a.total());
            let (f1, f2) = (prefill_flops(&c, t), prefill_flops(&c, t + extra));
            prop_assert!(f2 > f1);
            // Per token, less the one row of logits a prefill computes whatever its length
            // (that fixed cost shrinks per token, so at a few tokens it outweighs attention).
            let logits = 2.0 * (c.vocab_size * c.hidden_size) as f64;
            prop_assert!((f2 - logits) / (t + extra) as f64 > (f1 - logits) / t as f64);
        }
    }
}
