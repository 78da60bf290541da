//! The CUDA backend (feature `cuda`): the [`Backend`](super::Backend) ops as NVRTC-compiled
//! kernels from `thaw_kernels::cuda` plus cuBLAS GEMMs, on one compute stream; CPU-assist
//! export / merge against the mapped exchange segment; layer-wise adapter streaming through
//! the upload pipeline ([`crate::upload`]) on a copy stream of its own.
//!
//! cudarc loads libcuda, libnvrtc and libcublas at run time, so this builds with no CUDA
//! installed; [`cuda_available`] checks for the driver before any CUDA call (cudarc panics on
//! a missing library otherwise).
//!
//! | file | job |
//! | --- | --- |
//! | `attn_prefill_tc.rs` | prefill attention on the tensor cores (opt-in: `THAW_CUDA_TC_PREFILL=1`) |
//! | `flash.rs` | flash-decoding launches (opt-in: `THAW_CUDA_ATTN_IMPL=split`) |
//! | `fused.rs` | fused add + RMSNorm and SwiGLU + cast (opt-in: `THAW_CUDA_FUSED=1`) |
//! | `graph.rs` | CUDA graphs of decode steps: capture, replay, the persistent metadata buffer |
//! | `launch.rs` | every raw CUDA call: launches, cuBLAS, stream waits, host registration |
//! | `backend.rs` | [`CudaBackend`]: the trait ops |
//! | `sgmv.rs` | the Punica-shaped SGMV / BGMV launches (opt-in: `THAW_CUDA_LORA_IMPL=punica`) |
//! | `step.rs` | per-step device metadata (slots, block tables, segments), uploaded once per step |
//! | `weights.rs` | weights, norms and LoRA descriptor tables on the device |
//! | `exchange.rs` | fused export and stream-waited merge (CPU assist) |
//! | `upload.rs` | the upload pipeline's copy device: registered arena, copy stream, events |
mod attn_prefill_tc;
mod backend;
mod encode;
mod exchange;
mod flash;
mod fused;
mod graph;
mod launch;
mod link;
mod sgmv;
mod step;
mod upload;
mod weights;

pub use attn_prefill_tc::{parse_switch, TC_PREFILL_ENV};
pub use backend::{CudaBackend, CudaConfig, CudaKvLayer};
pub use exchange::MappedExchange;
pub use flash::{AttnImpl, ATTN_IMPL_ENV};
pub use fused::{parse_fused, FUSED_ENV};
pub use sgmv::{LoraImpl, LORA_IMPL_ENV};
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
