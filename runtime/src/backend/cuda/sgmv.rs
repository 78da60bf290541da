//! The Punica-shaped LoRA kernels (`thaw-kernels/src/cuda/lora_punica.cu`, issue 29): split-K
//! SGMV / BGMV shrink with 16-byte weight loads and an expand that sums the splits.
//!
//! The default LoRA kernels; `THAW_CUDA_LORA_IMPL=classic` (read when the backend is created,
//! see [`kernel_select`](crate::backend::kernel_select)) or [`CudaBackend::set_lora_impl`] runs
//! `lora.cu`'s instead. By default a model whose widest LoRA input is above the split-K limit
//! ([`kernel_select::PUNICA_MAX_D_IN`](crate::backend::kernel_select::PUNICA_MAX_D_IN)) keeps
//! `lora.cu`'s. The choice between SGMV and BGMV stays the engine's (`--lora-kernel`); this
//! picks how either is launched. Both implementations read the same per-step metadata
//! ([`LoraMeta`], uploaded once per step) and descriptor tables.
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::punica_plan::SplitK;
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::launch::{int, launch, Gpu};
use super::step::LoraMeta;
use super::{CudaBackend, CudaError};
use crate::backend::kernel_select::{LoraImpl, LORA_IMPL_ENV, PUNICA_MAX_D_IN};
use crate::backend::{LinearDims, LoraKernel};
use crate::error::Result;

/// The device's multiprocessors: the split planners size their grids to a few blocks per SM.
pub(super) fn sm_count(ctx: &Arc<CudaContext>) -> Result<usize, CudaError> {
    let n = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    Ok(usize::try_from(n).unwrap_or(1).max(1))
}

/// The resolved Punica-shaped kernels for one weight dtype.
pub(crate) struct Punica {
    sgmv_shrink: CudaFunction,
    sgmv_expand: CudaFunction,
    bgmv_shrink: CudaFunction,
    bgmv_expand: CudaFunction,
    sms: usize,
    max_k_chunk: usize,
}

impl Punica {
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        w: DType,
        max_k_chunk: usize,
    ) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |base: &str| {
            cache
                .function(ctx, &format!("punica_{base}_{}", w.suffix()))
                .map_err(CudaError::from)
        };
        Ok(Self {
            sgmv_shrink: f("sgmv_shrink")?,
            sgmv_expand: f("sgmv_expand")?,
            bgmv_shrink: f("bgmv_shrink")?,
            bgmv_expand: f("bgmv_expand")?,
            sms: sm_count(ctx)?,
            max_k_chunk,
        })
    }

    pub(super) fn split(&self, d_in: usize, blocks: usize) -> Result<SplitK, CudaError> {
        SplitK::plan(d_in, blocks, self.sms, self.max_k_chunk).ok_or_else(|| {
            CudaError::Unsupported(format!(
                "d_in {d_in} is above the Punica LoRA kernels' limit of {PUNICA_MAX_D_IN} (set \
                 {LORA_IMPL_ENV}=classic)"
            ))
        })
    }
}

/// Blocks of a shrink grid before splitting K.
pub(super) fn shrink_blocks(
    kernel: LoraKernel,
    meta: &LoraMeta,
    rows: usize,
    max_rank: usize,
) -> usize {
    let tiles = max_rank.div_ceil(shape::PUNICA_RANK_TILE as usize);
    match kernel {
        LoraKernel::Sgmv => {
            let chunks = meta.max_seg_rows().div_ceil(shape::PUNICA_ROWS as usize);
            meta.n_segs() * tiles * chunks
        }
        LoraKernel::Bgmv => rows * tiles,
    }
}

impl Gpu {
    /// f32 elements of LoRA scratch a (rows, max_rank, d_in) call needs with the selected
    /// kernels: `rows · max_rank`, times the split count for Punica's.
    pub(super) fn lora_v_len(
        &self,
        kernel: LoraKernel,
        meta: &LoraMeta,
        rows: usize,
        max_rank: usize,
        d_in: usize,
    ) -> Result<usize, CudaError> {
        match &self.punica {
            None => Ok(rows * max_rank),
            Some(p) => Ok(p
                .split(d_in, shrink_blocks(kernel, meta, rows, max_rank))?
                .v_len(rows, max_rank)),
        }
    }

    /// SGMV or BGMV through Punica's kernels: `y += scale · x · Aᵀ · Bᵀ` per segment / row of
    /// `meta`, for descriptor slot `slot`. `v` holds [`Gpu::lora_v_len`] f32.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn punica_lora(
        &self,
        kernel: LoraKernel,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        meta: &LoraMeta,
        rows: usize,
        slot: usize,
        dims: LinearDims,
        max_rank: usize,
    ) -> Result<(), CudaError> {
        let p = self
            .punica
            .as_ref()
            .expect("punica_lora called without the Punica kernels loaded");
        let (d_in, d_out) = (dims.d_in, dims.d_out);
        assert!(
            max_rank <= shape::PUNICA_MAX_RANK,
            "LoRA rank {max_rank} > {}",
            shape::PUNICA_MAX_RANK
        );
        assert!(
            x.len() >= rows * d_in && y.len() >= rows * d_out,
            "punica_lora: x or y smaller than {rows} rows"
        );
        if rows == 0 || max_rank == 0 {
            return Ok(());
        }
        // THAW_CUDA_LORA_SMALL: one fused launch where its plan serves the call.
        if self.try_lora_small(kernel, x, y, meta, rows, slot, dims, max_rank)? {
            return Ok(());
        }
        let sk = p.split(d_in, shrink_blocks(kernel, meta, rows, max_rank))?;
        assert!(
            v.len() >= sk.v_len(rows, max_rank),
            "punica_lora: scratch holds {} f32, the split needs {}",
            v.len(),
            sk.v_len(rows, max_rank)
        );
        let tiles = (max_rank as u32).div_ceil(shape::PUNICA_RANK_TILE);
        let cols = (d_out as u32).div_ceil(shape::PUNICA_EXPAND_COLS);
        let splits = sk.splits as u32;
        match kernel {
            LoraKernel::Sgmv => {
                let n_segs = meta.n_segs();
                let chunks = (meta.max_seg_rows() as u32).div_ceil(shape::PUNICA_ROWS);
                if n_segs == 0 || chunks == 0 {
                    return Ok(());
                }
                let (tables, seg_rows) = (meta.seg_tables.get(), meta.seg_rows.get());
                assert!(tables.len() >= n_segs && seg_rows.len() >= 2 * n_segs);
                // SAFETY: punica_sgmv_shrink_T(const float* x, float* v_parts, const u64*
                // seg_tables, const u32* seg_rows, int n_segs, int slot, int d_in, int k_chunk,
                // int splits, int rows_total, int v_stride) and punica_sgmv_expand_T(v_parts, y,
                // seg_tables, seg_rows, n_segs, slot, d_out, splits, rows_total, v_stride). Each
                // table is a live CudaLora descriptor array with more than `slot` entries whose
                // A / B point at [rank, d_in] / [d_out, rank] weights, rank ≤ max_rank (the
                // caller's max over the step's on-device adapters); segments lie in 0..rows
                // (step.rs builds them from the step); x, y hold rows × d_in / d_out and v
                // holds splits × rows × max_rank f32 (checked above); k_chunk · splits ≥ d_in
                // with k_chunk ≤ PUNICA_K_CHUNK (SplitK::plan).
                unsafe {
                    launch!(
                        self,
                        &p.sgmv_shrink,
                        (n_segs as u32, tiles * splits, chunks),
                        shape::PUNICA_THREADS,
                        [
                            self.p(x),
                            self.p(v),
                            self.p(tables),
                            self.p(seg_rows),
                            int(n_segs, "n_segs"),
                            int(slot, "slot"),
                            int(d_in, "d_in"),
                            int(sk.k_chunk, "k_chunk"),
                            int(sk.splits, "splits"),
                            int(rows, "rows"),
                            int(max_rank, "v_stride")
                        ]
                    )?;
                    launch!(
                        self,
                        &p.sgmv_expand,
                        (n_segs as u32, cols, chunks),
                        shape::PUNICA_THREADS,
                        [
                            self.p(v),
                            self.p(y),
                            self.p(tables),
                            self.p(seg_rows),
                            int(n_segs, "n_segs"),
                            int(slot, "slot"),
                            int(d_out, "d_out"),
                            int(sk.splits, "splits"),
                            int(rows, "rows"),
                            int(max_rank, "v_stride")
                        ]
                    )
                }
            }
            LoraKernel::Bgmv => {
                let tables = meta.row_tables.get();
                assert!(tables.len() >= rows);
                // SAFETY: punica_bgmv_shrink_T(const float* x, float* v_parts, const u64*
                // row_tables, int rows, int slot, int d_in, int k_chunk, int splits, int
                // max_rank) and punica_bgmv_expand_T(v_parts, y, row_tables, rows, slot, d_out,
                // splits, max_rank); row tables are 0 or live descriptor arrays as for SGMV,
                // one per row (checked), buffers sized as for SGMV (checked above).
                unsafe {
                    launch!(
                        self,
                        &p.bgmv_shrink,
                        (rows as u32, tiles * splits, 1),
                        shape::PUNICA_THREADS,
                        [
                            self.p(x),
                            self.p(v),
                            self.p(tables),
                            int(rows, "rows"),
                            int(slot, "slot"),
                            int(d_in, "d_in"),
                            int(sk.k_chunk, "k_chunk"),
                            int(sk.splits, "splits"),
                            int(max_rank, "max_rank")
                        ]
                    )?;
                    launch!(
                        self,
                        &p.bgmv_expand,
                        (rows as u32, cols, 1),
                        shape::PUNICA_THREADS,
                        [
                            self.p(v),
                            self.p(y),
                            self.p(tables),
                            int(rows, "rows"),
                            int(slot, "slot"),
                            int(d_out, "d_out"),
                            int(sk.splits, "splits"),
                            int(max_rank, "max_rank")
                        ]
                    )
                }
            }
        }
    }
}

impl CudaBackend {
    /// Switches the LoRA kernels (tests, benchmarks); compiles Punica's on first use.
    pub fn set_lora_impl(&mut self, imp: LoraImpl) -> Result<()> {
        self.gpu.punica = match imp {
            LoraImpl::Classic => None,
            LoraImpl::Punica { max_k_chunk } => Some(Punica::load(
                &self.gpu.ctx,
                self.gpu.weight_dtype,
                max_k_chunk,
            )?),
        };
        Ok(())
    }

    /// The LoRA kernels in use.
    pub fn lora_impl(&self) -> LoraImpl {
        match &self.gpu.punica {
            None => LoraImpl::Classic,
            Some(p) => LoraImpl::Punica {
                max_k_chunk: p.max_k_chunk,
            },
        }
    }
}
