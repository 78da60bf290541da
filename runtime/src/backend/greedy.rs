//! Greedy sampling as a backend op (issue 29): [`Backend::greedy_ids`] and
//! [`Backend::graph_end_ids`] bring back one token id per row instead of the row's logits, as
//! vLLM and TGI sample greedy rows on the device. At batch 32 a 32000-entry vocabulary is 4 MB of
//! f32 logits copied to the host every step, then scanned there; the ids are 128 bytes.
//!
//! The ids are [`crate::sampling::argmax`]'s, exactly (the lowest index among equal values,
//! NaNs never chosen unless the first entry is one): the engine uses them in place of
//! [`crate::sampling::Sampler::sample`] on rows whose sampler is greedy and asked for no
//! logprobs (`engine::greedy` decides). The defaults here compute the logits with
//! [`Backend::logits`] (or take them from [`Backend::graph_end`]) and scan them on the host:
//! every backend has the op, and the CPU backend runs the engine's ids path with them. The
//! CUDA backend overrides both with `argmax.cu` (`cuda/argmax.rs`, on by default, off:
//! `THAW_CUDA_DEVICE_ARGMAX=0`).
use super::Backend;
use crate::error::Result;
use crate::sampling::argmax;

/// `ids[i]` = [`argmax`] of row `i` of `logits` (`rows` rows of equal width; no rows, or
/// rows of no entries, give id 0 as [`argmax`] does).
pub fn argmax_rows(logits: &[f32], rows: usize, ids: &mut Vec<u32>) {
    ids.clear();
    if rows == 0 {
        return;
    }
    let vocab = logits.len() / rows;
    debug_assert_eq!(
        vocab * rows,
        logits.len(),
        "logits are not {rows} equal rows"
    );
    if vocab == 0 {
        ids.resize(rows, 0);
        return;
    }
    ids.extend(logits.chunks_exact(vocab).map(argmax));
}

/// [`Backend::greedy_ids`]'s default: the logits into `scratch` through [`Backend::logits`],
/// then [`argmax_rows`] on the host.
pub fn host_greedy_ids<B: Backend + ?Sized>(
    b: &mut B,
    x: &B::Buf,
    lm_head: &B::Linear,
    rows: usize,
    scratch: &mut Vec<f32>,
    ids: &mut Vec<u32>,
) {
    b.logits(x, lm_head, rows, scratch);
    argmax_rows(scratch, rows, ids);
}

/// [`Backend::graph_end_ids`]'s default: [`Backend::graph_end`] into `scratch`, then
/// [`argmax_rows`] on the host (nothing when the capture failed: the engine runs the step
/// again).
pub fn host_graph_end_ids<B: Backend + ?Sized>(
    b: &mut B,
    scratch: &mut Vec<f32>,
    ids: &mut Vec<u32>,
    rows: usize,
) -> Result<bool> {
    if !b.graph_end(scratch, rows)? {
        return Ok(false);
    }
    argmax_rows(scratch, rows, ids);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::ModelConfig;
    use crate::sampling::{Sampler, SamplerScratch, SamplingParams};

    fn config() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"model_type":"llama","hidden_size":16,"intermediate_size":32,"num_attention_heads":2,
            "num_key_value_heads":1,"num_hidden_layers":1,"vocab_size":64}"#,
        )
        .unwrap()
    }

    /// What the engine's host path picks for a row: a greedy sampler without logprobs.
    fn sampled(row: &[f32]) -> u32 {
        let mut s = Sampler::new(SamplingParams::greedy(), 0);
        s.sample(row, &mut SamplerScratch::default()).id
    }

    /// A logit: coarse values (ties), infinities, NaN, ±0, or anything.
    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            6 => (-6i32..6).prop_map(|v| v as f32 / 2.0),
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            2 => Just(f32::NEG_INFINITY),
            1 => Just(-0.0f32),
            1 => Just(f32::MIN_POSITIVE / 4.0),
            2 => prop::num::f32::ANY,
        ]
    }

    #[test]
    fn argmax_rows_edges() {
        let mut ids = vec![9];
        argmax_rows(&[], 0, &mut ids);
        assert!(ids.is_empty());
        argmax_rows(&[], 3, &mut ids);
        assert_eq!(ids, [0, 0, 0], "rows of no entries give 0, as argmax does");
        let nan = f32::NAN;
        let l = [
            1.0,
            3.0,
            3.0,
            nan,
            5.0,
            2.0,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ];
        argmax_rows(&l, 4, &mut ids);
        assert_eq!(ids, [1, 0, 0, 0]);
    }

    proptest! {
        /// Over random rows of logits (ties, ±inf, NaN first or later, ±0, subnormals), the
        /// ids are the host sampler's greedy tokens row by row.
        #[test]
        fn ids_are_the_greedy_samplers_tokens(
            rows in 1usize..6,
            vocab in 1usize..70,
            vals in prop::collection::vec(logit(), 6 * 70),
        ) {
            let l = &vals[..rows * vocab];
            let mut ids = Vec::new();
            argmax_rows(l, rows, &mut ids);
            let want: Vec<u32> = l.chunks_exact(vocab).map(sampled).collect();
            prop_assert_eq!(ids, want);
        }

        /// The trait's default on the CPU backend: the LM head's logits (an LM head with
        /// repeated rows gives exact ties, a row of NaN weights a NaN logit, a row of huge
        /// weights infinities) give the sampler's tokens, and the logits left in `scratch`
        /// are `logits`'s.
        #[test]
        fn default_greedy_ids_equal_the_sampler_on_the_cpu_backend(
            seed in 0u32..1000,
            rows in 1usize..5,
            repeat in prop::collection::vec(0usize..64, 0..8),
            nan_row in prop::option::of(0usize..64),
            huge_row in prop::option::of(0usize..64),
        ) {
            let c = config();
            let (d, vocab) = (c.hidden_size, c.vocab_size);
            let mut vals = crate::backend::test_values(seed);
            let mut w = vals(vocab * d);
            for pair in repeat.chunks_exact(2) {
                let (from, to) = (pair[0], pair[1]);
                let src: Vec<f32> = w[from * d..(from + 1) * d].to_vec();
                w[to * d..(to + 1) * d].copy_from_slice(&src);
            }
            if let Some(r) = huge_row {
                w[r * d..(r + 1) * d].iter_mut().for_each(|v| *v *= 1e38);
            }
            if let Some(r) = nan_row {
                w[r * d] = f32::NAN;
            }
            let mut b = CpuBackend::new(&c);
            let head = b.upload_linear(w, vocab, d, None).unwrap();
            let x = vals(rows * d);
            let (mut scratch, mut ids) = (Vec::new(), Vec::new());
            b.greedy_ids(&x, &head, rows, &mut scratch, &mut ids);
            let mut logits = Vec::new();
            b.logits(&x, &head, rows, &mut logits);
            prop_assert_eq!(logits.len(), rows * vocab);
            let want: Vec<u32> = logits.chunks_exact(vocab).map(sampled).collect();
            prop_assert_eq!(&ids, &want);
            prop_assert!(scratch.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
