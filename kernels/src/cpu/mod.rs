//! The CPU reference ops: plain f32 functions over row-major slices.

mod activation;
mod attention;
mod convert;
mod expf;
mod gemm;
mod hostvec;
mod kv16;
mod lora;
mod norm;
pub mod quant;
mod rope;
mod rope_cache;
pub mod simd;
mod split_softmax;
mod sys;
#[cfg(test)]
mod testutil;

pub use activation::{add_in_place, log_softmax_in_place, softmax_in_place, swiglu, swiglu_x16};
pub use attention::{paged_attention, write_kv, KvLayout};
pub use convert::{bf16_bytes_to_f32, bytes_to_f32, f16_bytes_to_f32, FloatFormat};
pub use expf::{expf, expf_slice};
pub use gemm::{add_bias, linear, linear_scaled, matmul, matmul_scaled, GemmShape, ROW_SPLIT_MIN};
pub use hostvec::HostVec;
pub use kv16::{narrow_kv, widen_kv};
pub use lora::{
    bgmv, bgmv_expand, bgmv_shrink, merge_lora_into, sgmv, sgmv_expand, sgmv_scratch_len,
    sgmv_shrink, LoraRef, LoraSegment,
};
pub use norm::{add_rms_norm, rms_norm};
pub use quant::{
    q8_activations, q8_prompt, reset_q8_activations, set_q8_activations, set_q8_prompt, WeightData,
    WeightFormat, WeightMatrix,
};
pub use rope::{RopeScaling, RopeTable};
pub use rope_cache::RopeCache;
pub use simd::{set_simd_level, simd_level, SimdLevel};
pub use split_softmax::{merge_partials, partial_softmax, SoftmaxPartial};
pub use sys::{HugeArena, HugeSlice, HUGE_PAGE};

/// Whether the environment turns a speed-up off: `var` set to `0` (`THAW_AVX512`,
/// `THAW_HUGEPAGES`; for A/B runs of one binary).
pub fn switched_off(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v.trim() == "0")
}
