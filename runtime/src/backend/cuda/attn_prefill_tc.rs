//! Prefill attention on the tensor cores (`thaw-kernels/src/cuda/attention_prefill_tc.cu`,
//! issue 29). The default prefill attention wherever it serves the backend: a bf16 or f16 KV
//! cache with heads of 32, 64 or 128 ([`prefill_tc_plan::entry_point`]) on a device of compute
//! capability 8.0 or newer ([`tc_prefill_unserved`]); elsewhere `attention.cu`'s prefill runs,
//! which [`CudaBackend::tc_prefill`] reports. `THAW_CUDA_TC_PREFILL=0` (read when the backend
//! is created, see [`kernel_select`](crate::backend::kernel_select)) or
//! [`CudaBackend::set_tc_prefill`] turns it off. The step metadata's prefill tiles are cut to
//! the kernel's query tile ([`prefill_tc_plan::tile_rows`]); decode rows are unaffected. With
//! `THAW_CUDA_PREFILL_FA=1` the FlashAttention-2-style kernel (`attn_prefill_fa.rs`) runs in
//! this one's place over the same metadata, where its plan takes the launch.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::prefill_tc_plan::{self, WARPS};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::attn_out::AttnOut;
use super::launch::{AttnShape, Gpu, PrefillKernel};
use super::{CudaBackend, CudaError};
use crate::backend::kernel_select::tc_prefill_unserved;
use crate::error::Result;

/// The resolved tensor-core prefill kernel for one (KV dtype, head_dim).
pub(crate) struct TcPrefill {
    func: CudaFunction,
    head_dim: usize,
}

impl TcPrefill {
    /// The kernel for `kv` and `head_dim` on `ctx`'s device, or `None` when the tensor-core
    /// kernel does not serve them ([`tc_prefill_unserved`]).
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        kv: DType,
        head_dim: usize,
    ) -> Result<Option<Self>, CudaError> {
        let arch = KernelCache::arch(ctx)?;
        if tc_prefill_unserved(kv, head_dim, arch).is_some() {
            return Ok(None);
        }
        let Some(name) = prefill_tc_plan::entry_point(kv, head_dim) else {
            return Ok(None);
        };
        let func = KernelCache::global()
            .function(ctx, &name)
            .map_err(CudaError::from)?;
        Ok(Some(Self { func, head_dim }))
    }
}

impl Gpu {
    /// Rows per prefill tile the step metadata is cut into for the prefill kernel in use.
    pub(super) fn prefill_tile_rows(&self) -> usize {
        prefill_tc_plan::tile_rows(self.tc_prefill.is_some())
    }

    /// Prefill attention over `n_tiles` tiles (4 u32 each, ≤ [`prefill_tc_plan::Q_TILE`] rows) on the tensor
    /// cores; same arguments as [`Gpu::attn_prefill`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_prefill_tc(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        mut out: AttnOut<'_>,
        tables: &impl DevicePtr<u32>,
        tiles: &impl DevicePtr<u32>,
        n_tiles: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        // THAW_CUDA_PREFILL_FA: the FA kernel in this one's place where it takes the launch.
        if self.attn_prefill_fa(q, (kc, vc), &mut out, tables, tiles, n_tiles, s)? {
            return Ok(());
        }
        let tc = self
            .tc_prefill
            .as_ref()
            .expect("attn_prefill_tc called without the tensor-core kernel loaded");
        assert_eq!(
            s.head_dim, tc.head_dim,
            "the kernel was loaded for another head_dim"
        );
        // 16-byte K/V loads: the caches start 16-byte aligned (rows are head_dim · 2 bytes, a
        // multiple of 16 for the head dims served).
        assert!(
            self.p(kc).is_multiple_of(16) && self.p(vc).is_multiple_of(16),
            "KV cache not 16-byte aligned"
        );
        let k = PrefillKernel {
            func: self.attn_kernel(&out, &tc.func, |k| k.tc.as_ref())?,
            block: 32 * WARPS as u32,
            grid_y: s.n_heads as u32,
            smem: 0,
        };
        // SAFETY: attn_prefill_tcHD_T (or its _out_T twin, loaded for the same head_dim, for a
        // 16-bit `out`) has attn_prefill_T's signature (attention_prefill_tc.cu)
        // and is compiled for blockDim 32 · WARPS with a static shared-memory tile of Q_TILE
        // query rows, the tile size step.rs cuts with while this kernel is loaded
        // (prefill_tile_rows); head_dim equals its HD (asserted above; the kernel traps
        // otherwise) and the caches are 16-byte aligned (asserted) for its uint4 loads.
        unsafe { self.launch_prefill(k, q, (kc, vc), out, (tables, tiles, n_tiles), s) }
    }
}

impl CudaBackend {
    /// Switches prefill attention to the tensor-core kernel (`on`) or back (tests,
    /// benchmarks); compiles on first use. Returns whether the tensor-core kernel now runs:
    /// `false` with `on` when it does not serve this backend's KV dtype, head_dim or device.
    pub fn set_tc_prefill(&mut self, on: bool) -> Result<bool> {
        self.gpu.tc_prefill = if on {
            TcPrefill::load(&self.gpu.ctx, self.gpu.kv_dtype, self.head_dim)?
        } else {
            None
        };
        // The 16-bit-output twin follows (`attn_out.rs`).
        self.load_attn_out16()?;
        // The next step rebuilds its metadata with the new tile size.
        self.begin_step();
        Ok(self.tc_prefill())
    }

    /// Whether prefill attention runs on the tensor-core kernel.
    pub fn tc_prefill(&self) -> bool {
        self.gpu.tc_prefill.is_some()
    }
}
