//! Weights kept in their stored precision: f32, f16, bf16 and the ggml block-quantised types
//! (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, with the block layouts ggml defines), and `y = x·Wᵀ` over
//! them with f32 accumulation.
//!
//! A [`WeightMatrix`] is `[rows, cols]` row-major (HF `nn.Linear` layout, one output per row);
//! quantised rows are whole blocks. [`WeightMatrix::matmul_range`] computes a slice of output
//! columns so callers can split one product over threads.

mod blocks;
mod format;
mod matrix;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_batch;

pub(crate) use blocks::dequantize_block;
pub use blocks::{dequantize_blocks, quantize_blocks};
pub use format::WeightFormat;
pub use matrix::{
    q8_activations, q8_prompt, reset_q8_activations, set_q8_activations, set_q8_prompt, WeightData,
    WeightMatrix,
};
