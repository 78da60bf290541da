//! Small-batch LoRA in one launch (issue 29, `THAW_CUDA_LORA_SMALL=1`; off by default until a
//! GPU parity run proves it): `thaw_kernels`' `lora_fused_small.cu`.
//!
//! With the switch on and Punica's kernels in use, an SGMV or BGMV call that
//! [`lora_small_plan::plan`] serves (a decode step's few rows, small ranks) runs as ONE kernel
//! launch — every block recomputes the shrink `x · Aᵀ` for its rows and expands its tile of
//! output columns — instead of Punica's shrink and expand launches. The call reads the step's
//! segment metadata ([`LoraMeta`], uploaded once per step) and writes no scratch, so it costs
//! the host one launch and no copy. Results agree with the two-launch path to f32 summation
//! order (the kernel's header says why). Calls the plan declines, graph capture and replay
//! (`graph.rs` launches `lora.cu`'s BGMV) and the multi-slice launches (`lora_slices.rs`, which
//! take q/k/v and gate/up first when both switches are on) run as before.
//!
//! [`lora_small_plan::plan`]: thaw_kernels::cuda::lora_small_plan::plan
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::lora_small_plan::{plan, SmallCall};
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::launch::{int, launch, Gpu};
use super::sgmv::sm_count;
use super::step::LoraMeta;
use super::{CudaBackend, CudaError};
use crate::backend::{LinearDims, LoraKernel};
use crate::error::Result;

/// The fused kernels for one weight dtype, and the device's multiprocessors (the plan's tiling).
pub(crate) struct LoraSmall {
    sgmv: CudaFunction,
    bgmv: CudaFunction,
    sms: usize,
}

impl LoraSmall {
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |base: &str| cache.function(ctx, &format!("lora_small_{base}_{}", w.suffix()));
        Ok(Self {
            sgmv: f("sgmv")?,
            bgmv: f("bgmv")?,
            sms: sm_count(ctx)?,
        })
    }
}

/// The plan's facts for one call of `kernel` over `meta`'s step of `rows` rows.
pub(super) fn small_call(
    kernel: LoraKernel,
    meta: &LoraMeta,
    rows: usize,
    max_rank: usize,
    dims: LinearDims,
    (dtype, sms): (DType, usize),
) -> SmallCall {
    let units = match kernel {
        LoraKernel::Sgmv => {
            meta.n_segs() * meta.max_seg_rows().div_ceil(shape::PUNICA_ROWS as usize)
        }
        LoraKernel::Bgmv => rows,
    };
    SmallCall {
        rows,
        max_rank,
        d_in: dims.d_in,
        d_out: dims.d_out,
        dtype,
        sms,
        units,
    }
}

impl Gpu {
    /// `y += scale · x · Aᵀ · Bᵀ` per segment / row of `meta` for descriptor slot `slot` as one
    /// launch, where the switch is on and the plan serves the call. Ok(false): nothing ran, the
    /// caller runs the two-launch path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_lora_small(
        &self,
        kernel: LoraKernel,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        meta: &LoraMeta,
        rows: usize,
        slot: usize,
        dims: LinearDims,
        max_rank: usize,
    ) -> Result<bool, CudaError> {
        let Some(small) = &self.small else {
            return Ok(false);
        };
        let call = small_call(
            kernel,
            meta,
            rows,
            max_rank,
            dims,
            (self.weight_dtype, small.sms),
        );
        let Some(grid) = plan(&call) else {
            return Ok(false);
        };
        let (d_in, d_out) = (dims.d_in, dims.d_out);
        // The kernel's shared v holds PUNICA_MAX_RANK columns (the plan's limit is lower).
        assert!(max_rank <= shape::PUNICA_MAX_RANK, "LoRA rank {max_rank}");
        assert!(
            x.len() >= rows * d_in && y.len() >= rows * d_out,
            "try_lora_small: x or y smaller than {rows} rows"
        );
        let tiles = grid.tiles as u32;
        match kernel {
            LoraKernel::Sgmv => {
                let n_segs = meta.n_segs();
                let chunks = meta.max_seg_rows().div_ceil(shape::PUNICA_ROWS as usize) as u32;
                let (tables, seg_rows) = (meta.seg_tables.get(), meta.seg_rows.get());
                assert!(tables.len() >= n_segs && seg_rows.len() >= 2 * n_segs);
                // SAFETY: lora_small_sgmv_T(const float* x, float* y, const u64* seg_tables,
                // const u32* seg_rows, int n_segs, int slot, int d_in, int d_out, int cols).
                // Each table is a live CudaLora descriptor array with more than `slot` entries
                // whose A / B point at [rank, d_in] / [d_out, rank] weights of this dtype, rank
                // ≤ max_rank ≤ PUNICA_MAX_RANK (the kernel's shared v; checked above);
                // segments lie in 0..rows (step.rs builds them from the step) and the grid's z
                // covers the longest in PUNICA_ROWS chunks; x, y hold rows × d_in / d_out f32
                // (checked above); d_in ≥ 1 (the plan), so every block's v is written before
                // it is read; tiles × cols ≥ d_out and the kernel clips its last tile.
                unsafe {
                    launch!(
                        self,
                        &small.sgmv,
                        (n_segs as u32, tiles, chunks),
                        shape::PUNICA_THREADS,
                        [
                            self.p(x),
                            self.p(y),
                            self.p(tables),
                            self.p(seg_rows),
                            int(n_segs, "n_segs"),
                            int(slot, "slot"),
                            int(d_in, "d_in"),
                            int(d_out, "d_out"),
                            int(grid.cols, "cols")
                        ]
                    )?;
                }
            }
            LoraKernel::Bgmv => {
                let tables = meta.row_tables.get();
                assert!(tables.len() >= rows);
                // SAFETY: lora_small_bgmv_T(const float* x, float* y, const u64* row_tables,
                // int rows, int slot, int d_in, int d_out, int cols); row tables are 0 or live
                // descriptor arrays as for SGMV, one per row (checked), buffers and ranks as
                // for SGMV (checked above).
                unsafe {
                    launch!(
                        self,
                        &small.bgmv,
                        (rows as u32, tiles, 1),
                        shape::PUNICA_THREADS,
                        [
                            self.p(x),
                            self.p(y),
                            self.p(tables),
                            int(rows, "rows"),
                            int(slot, "slot"),
                            int(d_in, "d_in"),
                            int(d_out, "d_out"),
                            int(grid.cols, "cols")
                        ]
                    )?;
                }
            }
        }
        Ok(true)
    }
}

impl CudaBackend {
    /// Switches the one-launch small-batch LoRA on or off (tests, benchmarks). It runs only
    /// with Punica's kernels ([`CudaBackend::set_lora_impl`]) and where its plan serves a call.
    pub fn set_lora_small(&mut self, on: bool) -> Result<()> {
        self.gpu.small = if on {
            Some(LoraSmall::load(&self.gpu.ctx, self.gpu.weight_dtype)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether the one-launch small-batch LoRA is on.
    pub fn lora_small(&self) -> bool {
        self.gpu.small.is_some()
    }

    /// Whether a `kernel` call of `rows` rows at `max_rank` over `dims` would run as one fused
    /// launch under this step's metadata (tests and benchmarks label their rows with it): the
    /// switch on, Punica's kernels in use and the plan serving it. Call after a LoRA call of
    /// the step, so the metadata is current.
    pub fn lora_small_serves(
        &self,
        kernel: LoraKernel,
        rows: usize,
        max_rank: usize,
        dims: LinearDims,
    ) -> bool {
        let (Some(small), Some(_)) = (&self.gpu.small, &self.gpu.punica) else {
            return false;
        };
        let facts = (self.gpu.weight_dtype, small.sms);
        plan(&small_call(
            kernel,
            &self.lora_meta,
            rows,
            max_rank,
            dims,
            facts,
        ))
        .is_some()
    }
}
