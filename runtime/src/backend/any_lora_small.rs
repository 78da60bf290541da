//! [`AnyBackend`]'s handle on the CUDA backend's one-launch small-batch LoRA
//! (`THAW_CUDA_LORA_SMALL`, issue 29, `cuda/lora_small.rs`), for `thaw-bench gpu`'s SGMV / BGMV
//! table, which times the two Punica launches and the fused one side by side. The CPU backend
//! has no such kernel: it is never on there, and switching it is a no-op.
use super::any::AnyBackend;
use super::{LinearDims, LoraKernel};
use crate::error::Result;

impl AnyBackend {
    /// Whether the one-launch small-batch LoRA is on (never on the CPU backend).
    pub fn lora_small(&self) -> bool {
        match self {
            Self::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => g.lora_small(),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }

    /// Switches it on or off on the CUDA backend; nothing to switch on the CPU backend.
    pub fn set_lora_small(&mut self, on: bool) -> Result<()> {
        match self {
            Self::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => g.set_lora_small(on),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => {
                let _ = on;
                match **g {}
            }
        }
    }

    /// Whether a `kernel` call of `rows` rows at `max_rank` over `dims` runs as one fused launch
    /// under the current step's metadata (after a LoRA call of the step); false on the CPU.
    pub fn lora_small_serves(
        &self,
        kernel: LoraKernel,
        rows: usize,
        max_rank: usize,
        dims: LinearDims,
    ) -> bool {
        match self {
            Self::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => g.lora_small_serves(kernel, rows, max_rank, dims),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => {
                let _ = (kernel, rows, max_rank, dims);
                match **g {}
            }
        }
    }
}
