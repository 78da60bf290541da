//! Prefill attention FlashAttention-2 style (`thaw-kernels/src/cuda/attention_prefill_fa.cu`,
//! issue 29), opt-in: `THAW_CUDA_PREFILL_FA=1` (read when the backend is created, see
//! [`OptInPlan`](crate::backend::kernel_select::OptInPlan)) or
//! [`CudaBackend::set_prefill_fa`]. It runs in place of the tensor-core prefill
//! (`attn_prefill_tc.rs`) wherever that one runs, over the same step metadata (tiles of
//! [`prefill_fa_plan::Q_TILE`] rows); a launch its plan ([`prefill_fa_plan::plan`]) declines
//! keeps the tensor-core kernel. Each launch's shape is a pure function of the head counts and
//! the tile count (and [`HeadSharing`], `Auto` but in benchmarks and tests); nothing is
//! allocated per step.
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::prefill_fa_plan::{self, FaLaunch, HeadSharing};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::attn_out::AttnOut;
use super::launch::{AttnShape, Gpu, PrefillKernel};
use super::{CudaBackend, CudaError};
use crate::backend::kernel_select::tc_prefill_unserved;
use crate::error::Result;

/// The resolved FA prefill kernel for one (KV dtype, head_dim).
pub(crate) struct FaPrefill {
    func: CudaFunction,
    head_dim: usize,
    /// How many query heads a block serves ([`HeadSharing::Auto`] but in benchmarks and tests).
    sharing: HeadSharing,
}

impl FaPrefill {
    /// The kernel for `kv` and `head_dim` on `ctx`'s device, or `None` where it does not serve
    /// them (the tensor-core prefill's rule, [`tc_prefill_unserved`]: it needs sm_80's cp.async
    /// and ldmatrix as well as the 16-bit mma).
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        kv: DType,
        head_dim: usize,
    ) -> Result<Option<Self>, CudaError> {
        let arch = KernelCache::arch(ctx)?;
        if tc_prefill_unserved(kv, head_dim, arch).is_some() {
            return Ok(None);
        }
        let Some(name) = prefill_fa_plan::entry_point(kv, head_dim) else {
            return Ok(None);
        };
        let func = load_fa_function(ctx, &name, head_dim)?;
        Ok(Some(Self {
            func,
            head_dim,
            sharing: HeadSharing::Auto,
        }))
    }
}

/// Loads FA entry `name` (f32 or 16-bit output) for heads of `head_dim`, with its dynamic
/// shared-memory limit raised where [`prefill_fa_plan::needs_smem_opt_in`] (head_dim 128: two
/// 64-key stages of K and V, 68 KiB, above the 48 KiB a launch gets by default).
pub(super) fn load_fa_function(
    ctx: &Arc<CudaContext>,
    name: &str,
    head_dim: usize,
) -> Result<CudaFunction, CudaError> {
    let func = KernelCache::global()
        .function(ctx, name)
        .map_err(CudaError::from)?;
    if prefill_fa_plan::needs_smem_opt_in(head_dim) {
        let bytes = prefill_fa_plan::smem_bytes(head_dim);
        func.set_attribute(
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
    }
    Ok(func)
}

impl Gpu {
    /// Prefill attention over `n_tiles` tiles through the FA kernel, if it is loaded and its
    /// plan takes the launch: `Ok(false)` otherwise (the caller runs the tensor-core kernel).
    /// Same arguments as [`Gpu::attn_prefill_tc`], whose metadata it reads.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_prefill_fa(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: &mut AttnOut<'_>,
        tables: &impl DevicePtr<u32>,
        tiles: &impl DevicePtr<u32>,
        n_tiles: usize,
        s: AttnShape,
    ) -> Result<bool, CudaError> {
        let Some(fa) = self.fa_prefill.as_ref() else {
            return Ok(false);
        };
        let launch = FaLaunch {
            head_dim: s.head_dim,
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            n_tiles,
            sharing: fa.sharing,
        };
        let Some(plan) = prefill_fa_plan::plan(&launch) else {
            return Ok(false);
        };
        assert_eq!(
            s.head_dim, fa.head_dim,
            "the kernel was loaded for another head_dim"
        );
        // 16-byte cp.async chunks: the caches start 16-byte aligned (rows are head_dim · 2
        // bytes, a multiple of 16 for the head dims served); float2 Q loads need 8.
        assert!(
            self.p(kc).is_multiple_of(16) && self.p(vc).is_multiple_of(16),
            "KV cache not 16-byte aligned"
        );
        assert!(self.p(q).is_multiple_of(8), "queries not 8-byte aligned");
        let k = PrefillKernel {
            func: self.attn_kernel(out, &fa.func, |k| k.fa.as_ref())?,
            block: plan.threads,
            grid_y: plan.grid.1,
            smem: plan.smem,
        };
        debug_assert_eq!(plan.grid.0 as usize, n_tiles);
        // SAFETY: attn_prefill_faHD_T (or its _out_T twin, loaded for the same head_dim by
        // load_fa_function, for a 16-bit `out`) has attn_prefill_T's signature
        // (attention_prefill_fa.cu). The plan's block (4 warps per head, at most
        // THAW_FA_MAX_WARPS, its launch bounds) and grid y (KV heads · group / heads per block,
        // which the kernel decodes with the same group) come from prefill_fa_plan::plan, whose
        // heads per block divide the group; its dynamic shared memory is smem_bytes(head_dim),
        // within the limit load_fa_function set. Tiles are cut to Q_TILE rows, the tensor-core
        // kernel's tile (prefill_tile_rows, as this runs only where that kernel is loaded);
        // head_dim equals its HD (asserted; it traps otherwise) and the caches are 16-byte
        // aligned (asserted) for its cp.async chunks.
        unsafe {
            self.launch_prefill(k, q, (kc, vc), out.reborrow(), (tables, tiles, n_tiles), s)?;
        }
        Ok(true)
    }
}

impl CudaBackend {
    /// Switches prefill attention to the FA kernel (`on`) or back to the tensor-core one
    /// (tests, benchmarks); compiles on first use. Returns whether the FA kernel now runs:
    /// `false` with `on` where the tensor-core prefill does not run (an f32 cache, another
    /// head_dim, a device below sm_80, or [`CudaBackend::set_tc_prefill`] off).
    pub fn set_prefill_fa(&mut self, on: bool) -> Result<bool> {
        self.gpu.fa_prefill = if on {
            FaPrefill::load(&self.gpu.ctx, self.gpu.kv_dtype, self.head_dim)?
        } else {
            None
        };
        // The 16-bit-output twin follows (`attn_out.rs`).
        self.load_attn_out16()?;
        Ok(self.prefill_fa())
    }

    /// How many query heads one FA block serves from now on ([`HeadSharing::Auto`] when it
    /// is switched on): benchmarks compare one head a block against the plan's choice, tests
    /// force the shared path at short prompts. Returns whether the FA kernel is loaded.
    pub fn set_prefill_fa_sharing(&mut self, sharing: HeadSharing) -> bool {
        match self.gpu.fa_prefill.as_mut() {
            Some(fa) => {
                fa.sharing = sharing;
                true
            }
            None => false,
        }
    }

    /// Whether prefill attention runs on the FA kernel (where its plan takes the launch).
    pub fn prefill_fa(&self) -> bool {
        self.gpu.fa_prefill.is_some() && self.gpu.tc_prefill.is_some()
    }
}
