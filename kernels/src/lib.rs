//! Thaw's math. Owns the CPU reference ops (plain functions over slices) that the CPU backend
//! runs and every GPU kernel is tested against. Knows nothing about models, adapters, requests
//! or devices: callers pass shapes and preallocated buffers, and hot loops do not allocate
//! (ops that need scratch take a `&mut Vec<f32>` that grows once and is reused).
//!
//! Conventions: f32, row-major, HF layouts (`nn.Linear` weights are `[out, in]`, PEFT `lora_A`
//! is `[rank, in]`, `lora_B` is `[out, rank]`). Shapes the engine guarantees are checked with
//! `assert!` and a message naming the op; failures that come from loaded data are
//! [`KernelError`]s.
//!
//! | module | ops |
//! | --- | --- |
//! | `cpu::gemm` | [`cpu::linear`], [`cpu::matmul`], [`cpu::add_bias`] (AVX-512 kernels in `cpu::simd`, else matrixmultiply) |
//! | `cpu::norm`, `cpu::activation` | [`cpu::rms_norm`], [`cpu::swiglu`], softmax, residual add |
//! | `cpu::rope` | [`cpu::RopeTable`] with Llama 3 / linear scaling |
//! | `cpu::attention` | paged KV writes and causal GQA [`cpu::paged_attention`] (sliding window) |
//! | `cpu::lora` | Punica SGMV / BGMV shrink and expand, merged-weight oracle |
//! | `cpu::convert` | f16 / bf16 little-endian bytes to f32 |
//! | `cuda::registry` | every CUDA kernel source (NVRTC), its entry points, compile options |
//!
//! With the `cuda` feature, `cuda::KernelCache` compiles the registry's sources with NVRTC on
//! first use and keeps one module per (device ordinal, arch), its CUBIN stored on disk for the
//! next process (`cuda::cubin_store`); see `kernels/README.md` for CUDA 12.
//!
//! ```
//! use thaw_kernels::cpu::{linear, sgmv, GemmShape, LoraRef, LoraSegment};
//!
//! // Two rows, d_in = 3, d_out = 2: base projection, then a rank-1 LoRA on row 1 only.
//! let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let w = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0];
//! let mut y = [0.0; 4];
//! linear(&x, &w, &mut y, GemmShape { m: 2, k: 3, n: 2 }, false);
//! assert_eq!(y, [1.0, 2.0, 4.0, 5.0]);
//!
//! let lora = LoraRef { a: &[1.0, 1.0, 1.0], b: &[1.0, -1.0], rank: 1, scale: 0.5 };
//! let segments = [LoraSegment { rows: 1..2, lora }];
//! let mut scratch = Vec::new();
//! sgmv(&x, 3, &segments, &mut y, 2, &mut scratch);
//! assert_eq!(y, [1.0, 2.0, 4.0 + 7.5, 5.0 - 7.5]);
//! ```

pub mod cpu;
pub mod cuda;
mod error;

pub use error::KernelError;
