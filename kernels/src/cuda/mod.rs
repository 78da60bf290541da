//! Thaw's CUDA kernels: CUDA C sources embedded with `include_str!` and listed once in
//! [`registry`], compiled by NVRTC on first use. The registry is always built (the NVRTC CI test
//! reads it without the `cuda` feature); the compile cache (`KernelCache`) needs the `cuda`
//! feature (cudarc, dynamically loaded: it builds with no CUDA installed).
//!
//! | source | kernels | CPU twin |
//! | --- | --- | --- |
//! | `elementwise.cu` | embedding gather, bias, residual add, SwiGLU (and SwiGLU + 16-bit cast, fused by default; `THAW_CUDA_FUSED=0` off), row gather, f32→16-bit cast | `cpu::{swiglu, swiglu_x16, add_in_place, add_bias}` |
//! | `norm.cu` | RMSNorm, residual add + RMSNorm (fused by default, with the next GEMM's 16-bit input beside its f32 output; `THAW_CUDA_FUSED=0` off) | `cpu::{rms_norm, add_rms_norm}` |
//! | `rope.cu` | RoPE (rotate-half, host `inv_freq` table) | `cpu::RopeTable::apply` |
//! | `attention.cu` | paged KV write, decode and tiled prefill attention (GQA, sliding window); `_out_bf16`/`_out_f16` entries store the output in the weight dtype (`THAW_CUDA_BF16_ACT`) | `cpu::{write_kv, paged_attention}` |
//! | `attention_split.cu` | flash-decoding: decode attention split across blocks ([`decode_plan`]) + reduce (its `_out_bf16`/`_out_f16` twins store 16 bits) | `cpu::paged_attention` |
//! | `wide.cu` | issue 29, defaults (`0` turns each off): RMSNorm and add + RMSNorm with a wide block per row (`THAW_CUDA_WIDE_NORM`), RoPE a thread per (head, pair), RoPE folded into the KV write (`THAW_CUDA_ROPE_FOLD`), a grouped product's split (`THAW_CUDA_GROUP_GEMM`) | `cpu::{rms_norm, add_rms_norm, RopeTable::apply, write_kv}` |
//! | `attention_prefill_tc.cu` | prefill attention on the tensor cores (mma.sync, bf16/f16 cache, head_dim 32/64/128; [`prefill_tc_plan`]); `_out_T` entries store the output in the cache's dtype | `cpu::paged_attention` |
//! | `attention_prefill_fa.cu` | opt-in (issue 29, `THAW_CUDA_PREFILL_FA=1`): the same prefill FlashAttention-2 style: GQA heads share cp.async double-buffered K/V tiles read with ldmatrix ([`prefill_fa_plan`]); `_out_T` entries as the TC kernel's | `cpu::paged_attention` |
//! | `gemv.cu` | issue 29, a default (`THAW_CUDA_GEMV=0` off): y = x · Wᵀ for at most 8 rows (the runtime sends it 1–4: `gemv_pays`), f32 x read directly, 16-byte loads of bf16/f16 W | `cpu::linear` |
//! | `lora.cu` | SGMV / BGMV shrink and expand | `cpu::{sgmv_*, bgmv_*}` |
//! | `lora_punica.cu` | SGMV / BGMV in Punica's shape: split-K shrink ([`punica_plan`]), vector loads | `cpu::{sgmv_*, bgmv_*}` |
//! | `lora_slices.cu` | issue 29, a default (`THAW_CUDA_LORA_SLICES=0` off): q/k/v (gate/up) LoRA as one shrink + one expand launch, a grid factor over the slices ([`slices_plan`]) | `cpu::{sgmv_*, bgmv_*}` per module |
//! | `lora_fused_small.cu` | opt-in (issue 29, `THAW_CUDA_LORA_SMALL=1`): SGMV / BGMV of few rows as ONE launch, every block recomputing the shrink for its rows then expanding its column tile ([`lora_small_plan`]) | `cpu::{sgmv_*, bgmv_*}` |
//! | `argmax.cu` | issue 29, a default (`THAW_CUDA_DEVICE_ARGMAX=0` off): greedy token ids, one block per row, a (value, index) tree reduction | `thaw_runtime::sampling::argmax` |
//! | `residual16.cu` | issue 29, a default with 16-bit weights (`THAW_CUDA_BF16_ACT=0` off): the residual stream between layers in the weight dtype: embed copy, add + RMSNorm of the rounded sum, the last add, the widening final gather | runtime `cpu_residual16` (add, round, `cpu::rms_norm`) |
//! | `exchange.cu` | fused export (copy + fence + sequence word), merge of CPU deltas | CPU backend copy + `Exchange::post_step` |

pub mod attn_out_names;
pub mod cubin_store;
pub mod decode_plan;
pub mod lora_small_plan;
pub mod prefill_fa_plan;
pub mod prefill_tc_plan;
pub mod punica_plan;
pub mod registry;
pub mod slices_plan;
#[cfg(test)]
mod tile_oracle;

#[cfg(feature = "cuda")]
mod cache;

#[cfg(feature = "cuda")]
pub use cache::{CompileError, KernelCache};
