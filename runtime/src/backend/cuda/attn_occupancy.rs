//! Decode attention planned for occupancy, with keys in flight (`attention_split_ilp.cu`,
//! issue 29; opt-in: `THAW_CUDA_ATTN_OCCUPANCY=1`, see
//! [`kernel_select`](crate::backend::kernel_select)). Flash-decoding's fixed plan never splits
//! a context under 2 · 256 positions, so a batch-1 decode of a few hundred tokens runs
//! `n_heads` blocks on a GPU of 132 SMs. Here the split count is
//! [`occupancy_splits`]: about two blocks per SM where the longest context allows, no chunk
//! under the floor (32 positions by default, `THAW_CUDA_SPLIT_MIN_CHUNK` sets it). Each row
//! cuts its own context into that many near-equal ranges; one split writes the output
//! directly (no scratch, no reduce: `attention.cu`'s decode bit for bit), more are merged by
//! `attention_split.cu`'s reduce. Eager steps only: CUDA-graph steps keep the classic kernel.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::decode_plan::occupancy_splits;
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::flash::{grow, max_decode_ctx};
use super::launch::{int, launch, AttnShape, Gpu};
use super::step::AttnMeta;
use super::{CudaBackend, CudaError};
use crate::error::Result;

/// The resolved kernels for one KV dtype.
pub(crate) struct OccupancyDecode {
    split: CudaFunction,
    reduce: CudaFunction,
    sms: usize,
    floor: usize,
}

impl OccupancyDecode {
    pub(super) fn load(ctx: &Arc<CudaContext>, kv: DType, floor: usize) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        Ok(Self {
            split: f(&format!("attn_decode_split_ilp_{}", kv.suffix()))?,
            reduce: f("attn_decode_reduce")?,
            sms: super::sgmv::sm_count(ctx)?,
            floor: floor.max(1),
        })
    }
}

impl Gpu {
    /// Decode attention for `a`'s decode rows through `attention_split_ilp.cu`; the split
    /// scratch lives in `a` (shared with flash-decoding's) and grows to the largest step.
    pub(super) fn attn_decode_occupancy(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: &mut CudaSlice<f32>,
        a: &mut AttnMeta,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let od = self
            .occupancy
            .as_ref()
            .expect("attn_decode_occupancy called without its kernels loaded");
        assert!(
            s.head_dim <= shape::SPLIT_MAX_HEAD_DIM,
            "head_dim {} > {}",
            s.head_dim,
            shape::SPLIT_MAX_HEAD_DIM
        );
        let n = a.n_decode();
        if n == 0 {
            return Ok(());
        }
        let pairs = n * s.n_heads;
        let splits = occupancy_splits(
            max_decode_ctx(&a.host.decode, s.window),
            pairs,
            od.sms,
            od.floor,
        );
        if splits > 1 {
            grow(self, &mut a.split_acc, pairs * splits * s.head_dim)?;
            grow(self, &mut a.split_ml, pairs * splits * 2)?;
        }
        // With one split the kernel writes `out` and never touches the scratch: any buffer
        // stands in for it (`out` itself when none was grown yet).
        let (acc, ml) = match (&a.split_acc, &a.split_ml) {
            (Some(acc), Some(ml)) => (self.p(acc), self.p(ml)),
            _ => (self.p(&*out), self.p(&*out)),
        };
        let (tables, row_meta) = (a.tables(), a.decode());
        assert!(row_meta.len() >= 3 * n);
        // SAFETY: attn_decode_split_ilp_T(q, kc, vc, float* part_acc, float* part_ml, float*
        // out, block_tables, row_meta, int rows, int n_heads, int n_kv_heads, int head_dim, int
        // block_size, int window, float scale, int splits) then, for splits > 1,
        // attn_decode_reduce(part_acc, part_ml, out, row_meta, int rows, int n_heads, int
        // head_dim, int splits). The metadata was built by step.rs from the StepLayout whose
        // K/V were written (table entries and rows in range, as for attn_decode); each row's
        // splits tile its own attended context (split_range), so any splits ≥ 1 is in range;
        // with splits > 1 the scratch holds rows · n_heads · splits · head_dim and · 2 f32
        // (grown above), with one split it is not accessed; blockDim = 32 · SPLIT_ILP_WARPS as
        // compiled.
        unsafe {
            launch!(
                self,
                &od.split,
                (n as u32, s.n_heads as u32, splits as u32),
                32 * shape::SPLIT_ILP_WARPS,
                [
                    self.p(q),
                    self.p(kc),
                    self.p(vc),
                    acc,
                    ml,
                    self.p(&*out),
                    self.p(&tables),
                    self.p(&row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim"),
                    int(s.block_size, "block_size"),
                    int(s.window, "window"),
                    s.scale,
                    int(splits, "splits")
                ]
            )?;
            if splits == 1 {
                return Ok(());
            }
            launch!(
                self,
                &od.reduce,
                (n as u32, s.n_heads as u32, 1),
                128,
                [
                    acc,
                    ml,
                    self.p(&*out),
                    self.p(&row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.head_dim, "head_dim"),
                    int(splits, "splits")
                ]
            )
        }
    }
}

impl CudaBackend {
    /// Switches the occupancy-planned decode attention on with chunks of at least `floor`
    /// positions, or off with `None` (tests, benchmarks); compiles on first use.
    pub fn set_attn_occupancy(&mut self, floor: Option<usize>) -> Result<()> {
        self.gpu.occupancy = match floor {
            None => None,
            Some(f) => Some(OccupancyDecode::load(&self.gpu.ctx, self.gpu.kv_dtype, f)?),
        };
        Ok(())
    }

    /// The occupancy plan's floor chunk if it is switched on.
    pub fn attn_occupancy(&self) -> Option<usize> {
        self.gpu.occupancy.as_ref().map(|o| o.floor)
    }
}
