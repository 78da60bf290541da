//! The CUDA backend (feature `cuda`): the [`Backend`](super::Backend) ops as NVRTC-compiled
//! kernels from `thaw_kernels::cuda` plus cuBLAS GEMMs, on one compute stream; CPU-assist
//! export / merge against the mapped exchange segment; layer-wise adapter streaming through
//! the upload pipeline ([`crate::upload`]) on a copy stream of its own.
//!
//! cudarc loads libcuda, libnvrtc, libcublas (and libcublasLt, when asked for) at run time, so this builds with no CUDA
//! installed; [`cuda_available`] checks for the driver before any CUDA call (cudarc panics on
//! a missing library otherwise).
//!
//! | file | job |
//! | --- | --- |
//! | `act16.rs` | gate/up outputs and SwiGLU in 16 bits, f32 accumulation, down reading the 16-bit SwiGLU output (default; off: `THAW_CUDA_BF16_ACT=0`; per step: [`act16_plan`](crate::backend::act16_plan::act16_plan)) |
//! | `attn16.rs` | q/k/v outputs in 16 bits, f32 accumulation, RoPE from them into the KV cache and the f32 q the attention kernels read (default; off: the same `THAW_CUDA_BF16_ACT=0`; per step: [`attn16_plan`](crate::backend::attn16_plan::attn16_plan)) |
//! | `attn_out.rs` | the attention kernels' output stored in 16 bits as o_proj's GEMM input, tagged as `ws.attn`'s cast (with `attn16.rs`; per step: `stores_out16` of [`attn16_plan`](crate::backend::attn16_plan::attn16_plan)) |
//! | `argmax.rs` | greedy token ids on the device, the ids' copy instead of the logits' (default; off: `THAW_CUDA_DEVICE_ARGMAX=0`) |
//! | `attn_occupancy.rs` | decode attention split for occupancy, 4 keys' loads in flight a warp (default; off: `THAW_CUDA_ATTN_OCCUPANCY=0`; floor chunk `THAW_CUDA_SPLIT_MIN_CHUNK`, default 32) |
//! | `attn_prefill_tc.rs` | prefill attention on the tensor cores (default where served; off: `THAW_CUDA_TC_PREFILL=0`) |
//! | `attn_prefill_fa.rs` | the same FlashAttention-2 style, in its place (opt-in: `THAW_CUDA_PREFILL_FA=1`) |
//! | `flash.rs` | flash-decoding launches (default; off: `THAW_CUDA_ATTN_IMPL=classic`; shortest chunk: `THAW_CUDA_SPLIT_MIN_CHUNK`, default 256) |
//! | `fused.rs` | fused add + RMSNorm and SwiGLU + cast (default; off: `THAW_CUDA_FUSED=0`) |
//! | `gemv.rs` | products of few rows (1–2, or 3–4 of q/k/v/o's size: `gemv_pays`) over 16-bit weights as a GEMV over f32 activations, no cast, no cuBLAS (default; off: `THAW_CUDA_GEMV=0`) |
//! | `graph.rs` | CUDA graphs of decode steps: capture, replay, the persistent metadata buffer |
//! | `group.rs` | q/k/v and gate/up placed as one matrix at load and run as one product (default; off: `THAW_CUDA_GROUP_GEMM=0`) |
//! | `wide.rs` | wide RMSNorm / add + RMSNorm / RoPE (default; off: `THAW_CUDA_WIDE_NORM=0`), RoPE folded into the KV write (default; off: `THAW_CUDA_ROPE_FOLD=0`) |
//! | `residual16.rs` | the residual stream between layers in the weight dtype: 16-bit embed copy, add + RMSNorm of the rounded sum, last add, widening final gather (with 16-bit weights by default; off with `THAW_CUDA_BF16_ACT=0`; [`residual16_plan`](crate::backend::residual16_plan::residual16_plan)) |
//! | `launch.rs` | every raw CUDA call: launches, cuBLAS, stream waits, host registration |
//! | `lt.rs` | products through cuBLASLt with a cached heuristic algorithm per shape bucket, the bias in its epilogue (default; off: `THAW_CUDA_CUBLASLT=0`); its raw cuBLASLt calls |
//! | `op_clock.rs` | events on the compute stream that time each op of a profiled step (`thaw-bench gpu --op-profile`) |
//! | `backend.rs` | [`CudaBackend`]: the trait ops |
//! | `host_rows.rs` | the CPU-assist exchange's host path: rows exported to the host and deltas merged back through a device row index |
//! | `lora_stream.rs` | adapters queued on the upload pipeline (own allocation or paged into KV blocks), the pipeline's start, waits on layers landing |
//! | `counters.rs` | running counts of launches, allocations, copies and synchronisations ([`CudaBackend::device_counts`]) |
//! | `select.rs` | resolves and loads the issue-29 kernels a new backend runs, logs the choice |
//! | `sgmv.rs` | the Punica-shaped SGMV / BGMV launches (default where served; off: `THAW_CUDA_LORA_IMPL=classic`) |
//! | `lora_slices.rs` | the LoRA of q/k/v and of gate/up as one shrink + expand launch pair over slices, bit-identical to per module (default; off: `THAW_CUDA_LORA_SLICES=0`) |
//! | `lora_small.rs` | SGMV / BGMV of few rows as one fused launch, every block recomputing the shrink for its rows (opt-in: `THAW_CUDA_LORA_SMALL=1`) |
//! | `step.rs` | per-step device metadata (slots, block tables, segments), uploaded once per step |
//! | `weights.rs` | weights, norms and LoRA descriptor tables on the device |
//! | `exchange.rs` | fused export and stream-waited merge (CPU assist) |
//! | `upload.rs` | the upload pipeline's copy device: registered arena, copy stream, events |
//!
//! Issue 29's thirteen kernels are the defaults; which run is resolved once, when a backend is
//! created, by [`KernelPlan::resolve`](crate::backend::kernel_select::KernelPlan::resolve) (pure,
//! unit-tested on the CPU) and logged at info level. Unset (or empty, or `auto`), a variable
//! picks the new kernel where it serves the backend and the classic one where it does not (an
//! f32 KV cache, a head_dim other than 32/64/128 or a device below compute capability 8.0 for
//! the tensor-core prefill); its off value always picks the classic one; an explicit on value
//! the backend cannot serve is an error that says what to set. Tests and benchmarks switch at
//! run time with `set_attn_impl`, `set_tc_prefill`, `set_lora_impl` and `set_fused`, and the
//! nine of [`OptInPlan`] (opt-in until session 24's H200 parity run proved them; `0` turns each
//! off) with `set_group_gemm`, `set_rope_fold`, `set_wide`, `set_gemv`, `set_device_argmax`,
//! `set_lora_slices`, `set_attn_occupancy`, `set_cublaslt` and `set_act16`. Two more are opt-in
//! (off unless `1`) until a GPU parity run proves them: the FlashAttention-2-style prefill,
//! `set_prefill_fa`, and the one-launch small-batch LoRA, `set_lora_small`. A test of a classic kernel, or of one kernel against the path it replaces,
//! sets the switches it depends on explicitly rather than trusting the defaults.
mod act16;
mod argmax;
mod attn16;
mod attn_occupancy;
mod attn_out;
mod attn_prefill_fa;
mod attn_prefill_tc;
mod backend;
mod counters;
mod encode;
mod exchange;
mod flash;
mod fused;
mod gemv;
mod graph;
mod group;
mod host_rows;
mod launch;
mod link;
mod lora_slices;
mod lora_small;
mod lora_stream;
mod lt;
mod op_clock;
mod residual16;
mod select;
mod sgmv;
mod step;
mod upload;
mod weights;
mod wide;

pub use super::kernel_select::{
    AttnImpl, KernelPlan, LoraImpl, OptInPlan, ACT16_ENV, ATTN_IMPL_ENV, ATTN_OCCUPANCY_ENV,
    CUBLASLT_ENV, DEVICE_ARGMAX_ENV, FUSED_ENV, GEMV_ENV, GROUP_GEMM_ENV, LORA_IMPL_ENV,
    LORA_SLICES_ENV, LORA_SMALL_ENV, PREFILL_FA_ENV, ROPE_FOLD_ENV, SPLIT_MIN_CHUNK_ENV,
    TC_PREFILL_ENV, WIDE_ENV,
};
pub use backend::{CudaBackend, CudaConfig, CudaKvLayer};
pub use exchange::MappedExchange;
pub use thaw_kernels::cuda::registry::DType;
pub use upload::{CudaCopy, LayerLanding};
pub use weights::{CudaLinear, CudaLora, CudaVector};

use crate::error::RuntimeError;

/// A failure of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "the CUDA driver (libcuda) was not found; run on a machine with an NVIDIA driver or \
         use --device cpu"
    )]
    NoDriver,
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS call failed: {0:?}")]
    Blas(cudarc::cublas::result::CublasError),
    #[error(transparent)]
    Compile(#[from] thaw_kernels::cuda::CompileError),
    #[error("{0}")]
    Unsupported(String),
    /// cuBLASLt's heuristic found no algorithm for a product's descriptors (`lt.rs`).
    #[error(
        "cuBLASLt found no algorithm for a product; set THAW_CUDA_CUBLASLT=0 to run products \
         through cublasGemmEx"
    )]
    LtNoAlgorithm,
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(e)
    }
}

impl From<CudaError> for RuntimeError {
    fn from(e: CudaError) -> Self {
        RuntimeError::Backend(e.to_string())
    }
}

/// A usable NVIDIA GPU, as found by [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0).
    pub compute_capability: (i32, i32),
}

/// Whether libcuda can be loaded and reports at least one device. Never panics.
pub fn cuda_available() -> bool {
    // SAFETY: only probes for the shared library (dlopen); no CUDA function is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::result::init().is_ok()
        && cudarc::driver::CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// The first device, or why there is none.
pub fn probe(ordinal: usize) -> Result<CudaDevice, CudaError> {
    if !cuda_available() {
        return Err(CudaError::NoDriver);
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)?;
    Ok(CudaDevice {
        ordinal,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
    })
}
