//! Decode attention planned for occupancy, with keys in flight (`attention_split_ilp.cu`,
//! issue 29; on by default where served, off: `THAW_CUDA_ATTN_OCCUPANCY=0`, see
//! [`kernel_select`](crate::backend::kernel_select)). Flash-decoding's fixed plan never splits
//! a context under 2 · 256 positions, so a batch-1 decode of a few hundred tokens runs
//! `n_heads` blocks on a GPU of 132 SMs. Here the split count is
//! [`occupancy_splits`]: about two blocks per SM where the longest context allows, no chunk
//! under the floor (32 positions by default, `THAW_CUDA_SPLIT_MIN_CHUNK` sets it). Each row
//! cuts its own context into that many near-equal ranges; one split writes the output
//! directly (no scratch, no reduce: `attention.cu`'s decode over the same keys in the same
//! warps), more are merged by `attention_split.cu`'s reduce. CUDA-graph steps run it too, with the split count fixed per
//! captured bucket (planned for any context; each row uses the splits its context allows).
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::decode_plan::{occupancy_max_partials, occupancy_splits};
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::attn_out::AttnOut;
use super::flash::max_decode_ctx;
use super::launch::{int, launch, AttnShape, Gpu};
use super::step::AttnMeta;
use super::{CudaBackend, CudaError};
use crate::error::Result;

/// The resolved kernels for one KV dtype and their scratch, allocated once at its largest
/// ([`occupancy_max_partials`]): its address never changes, so CUDA graphs capture it.
pub(crate) struct OccupancyDecode {
    split: CudaFunction,
    reduce: CudaFunction,
    sms: usize,
    floor: usize,
    /// Partial outputs, [`occupancy_max_partials`] · [`shape::SPLIT_MAX_HEAD_DIM`] f32.
    acc: CudaSlice<f32>,
    /// (max, sum) pairs, [`occupancy_max_partials`] · 2 f32.
    ml: CudaSlice<f32>,
}

impl OccupancyDecode {
    pub(super) fn load(gpu: &Gpu, kv: DType, floor: usize) -> Result<Self, CudaError> {
        let ctx = &gpu.ctx;
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        let sms = super::sgmv::sm_count(ctx)?;
        let partials = occupancy_max_partials(sms);
        Ok(Self {
            split: f(&format!("attn_decode_split_ilp_{}", kv.suffix()))?,
            reduce: f("attn_decode_reduce")?,
            sms,
            floor: floor.max(1),
            acc: gpu.alloc_zeros::<f32>(partials * shape::SPLIT_MAX_HEAD_DIM)?,
            ml: gpu.alloc_zeros::<f32>(partials * 2)?,
        })
    }

    /// The scratch's address (a CUDA graph that captured it is stale if it changes).
    pub(super) fn scratch_addr(&self, gpu: &Gpu) -> u64 {
        gpu.p(&self.acc)
    }
}

impl Gpu {
    fn occupancy(&self) -> &OccupancyDecode {
        self.occupancy
            .as_ref()
            .expect("occupancy decode called without its kernels loaded")
    }

    /// Decode attention for `a`'s decode rows (eager steps): the split count planned from the
    /// longest attended context.
    pub(super) fn attn_decode_occupancy(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: AttnOut<'_>,
        a: &AttnMeta,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let od = self.occupancy();
        let n = a.n_decode();
        let max_ctx = max_decode_ctx(&a.host.decode, s.window);
        let splits = occupancy_splits(max_ctx, n * s.n_heads, od.sms, od.floor);
        let (tables, row_meta) = (a.tables(), a.decode());
        self.attn_decode_occupancy_rows(q, (kc, vc), out, (&tables, &row_meta), n, s, splits)
    }

    /// Decode attention for a CUDA graph's `n` (bucket) rows: the contexts are not known when
    /// it is captured, so the split count is planned for any context
    /// ([`occupancy_splits`] of `usize::MAX`); each row uses as many as its context allows.
    pub(super) fn attn_decode_occupancy_graph(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: AttnOut<'_>,
        meta: (&impl DevicePtr<u32>, &impl DevicePtr<u32>),
        n: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let od = self.occupancy();
        let splits = occupancy_splits(usize::MAX, n * s.n_heads, od.sms, od.floor);
        self.attn_decode_occupancy_rows(q, (kc, vc), out, meta, n, s, splits)
    }

    /// Launches `attention_split_ilp.cu` over `n` decode rows described by (block tables, row
    /// metadata) with `splits` splits, then (if `splits > 1`) the reduce.
    #[allow(clippy::too_many_arguments)]
    fn attn_decode_occupancy_rows(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: AttnOut<'_>,
        (tables, row_meta): (&impl DevicePtr<u32>, &impl DevicePtr<u32>),
        n: usize,
        s: AttnShape,
        splits: usize,
    ) -> Result<(), CudaError> {
        let od = self.occupancy();
        let split = self.attn_kernel(&out, &od.split, |k| Some(&k.ilp))?;
        let reduce = self.attn_kernel(&out, &od.reduce, |k| Some(&k.reduce))?;
        assert!(
            s.head_dim <= shape::SPLIT_MAX_HEAD_DIM,
            "head_dim {} > {}",
            s.head_dim,
            shape::SPLIT_MAX_HEAD_DIM
        );
        assert!(row_meta.len() >= 3 * n);
        if n == 0 {
            return Ok(());
        }
        assert!(
            splits == 1 || n * s.n_heads * splits <= occupancy_max_partials(od.sms),
            "{splits} splits of {n} rows · {} heads outgrow the scratch",
            s.n_heads
        );
        // SAFETY: attn_decode_split_ilp_T(q, kc, vc, float* part_acc, float* part_ml, float*
        // out, block_tables, row_meta, int rows, int n_heads, int n_kv_heads, int head_dim, int
        // block_size, int window, float scale, int splits, int min_chunk) then, for splits > 1,
        // attn_decode_reduce(part_acc, part_ml, out, row_meta, int rows, int n_heads, int
        // head_dim, int splits). The metadata was built by step.rs (eager) or graph_plan (a
        // graph's padded rows are valid decode rows) from the StepLayout whose K/V were
        // written (table entries and rows in range, as for attn_decode); each row's used
        // splits tile its own attended context (row_splits, split_range), so any splits ≥ 1 is
        // in range; with splits > 1 the scratch holds rows · n_heads · splits partials of up
        // to SPLIT_MAX_HEAD_DIM and 2 f32 (asserted above against its fixed size), with one
        // split it is not accessed; blockDim = 32 · SPLIT_ILP_WARPS as compiled; `out` is of
        // both entries' output type (attn_kernel picks the _out_W twins for 16 bits).
        unsafe {
            launch!(
                self,
                split,
                (n as u32, s.n_heads as u32, splits as u32),
                32 * shape::SPLIT_ILP_WARPS,
                [
                    self.p(q),
                    self.p(kc),
                    self.p(vc),
                    self.p(&od.acc),
                    self.p(&od.ml),
                    out.ptr(self),
                    self.p(tables),
                    self.p(row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim"),
                    int(s.block_size, "block_size"),
                    int(s.window, "window"),
                    s.scale,
                    int(splits, "splits"),
                    int(od.floor, "min_chunk")
                ]
            )?;
            if splits == 1 {
                return Ok(());
            }
            launch!(
                self,
                reduce,
                (n as u32, s.n_heads as u32, 1),
                128,
                [
                    self.p(&od.acc),
                    self.p(&od.ml),
                    out.ptr(self),
                    self.p(row_meta),
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
    /// positions, or off with `None` (tests, benchmarks); compiles on first use. Captured CUDA
    /// graphs recorded the kernels they launch: switch before the first graph step.
    pub fn set_attn_occupancy(&mut self, floor: Option<usize>) -> Result<()> {
        self.gpu.occupancy = match floor {
            None => None,
            Some(f) => Some(OccupancyDecode::load(&self.gpu, self.gpu.kv_dtype, f)?),
        };
        Ok(())
    }

    /// The occupancy plan's floor chunk if it is switched on.
    pub fn attn_occupancy(&self) -> Option<usize> {
        self.gpu.occupancy.as_ref().map(|o| o.floor)
    }
}
