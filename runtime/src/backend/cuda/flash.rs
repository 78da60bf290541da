//! Flash-decoding launches (`thaw-kernels/src/cuda/attention_split.cu`, issue 29): each decode
//! row's context split across blocks, then a reduce. The default decode attention;
//! `THAW_CUDA_ATTN_IMPL=classic` (read when the backend is created, see
//! [`kernel_select`](crate::backend::kernel_select)) or [`CudaBackend::set_attn_impl`] runs
//! `attention.cu`'s one-block-per-head decode instead. Reads the same per-step metadata
//! ([`AttnMeta`], uploaded once per step); prefill rows are unaffected. A step whose plan
//! ([`DecodeSplit::plan`], a pure function of the longest context and of rows · heads against
//! the SM count) makes one split falls back to `attention.cu`'s kernel.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::decode_plan::DecodeSplit;
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::attn_out::AttnOut;
use super::launch::{int, launch, AttnShape, Gpu};
use super::step::AttnMeta;
use super::{CudaBackend, CudaError};
use crate::backend::kernel_select::AttnImpl;
use crate::error::Result;

/// The resolved flash-decoding kernels for one KV dtype.
pub(crate) struct FlashDecode {
    split: CudaFunction,
    reduce: CudaFunction,
    sms: usize,
    min_chunk: usize,
}

impl FlashDecode {
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        kv: DType,
        min_chunk: usize,
    ) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        Ok(Self {
            split: f(&format!("attn_decode_split_{}", kv.suffix()))?,
            reduce: f("attn_decode_reduce")?,
            sms: super::sgmv::sm_count(ctx)?,
            min_chunk: min_chunk.max(1),
        })
    }
}

/// The longest attended context among decode rows given as (table offset, position, row)
/// triples: `pos + 1` positions, at most `window` with a sliding window.
pub(super) fn max_decode_ctx(decode: &[u32], window: usize) -> usize {
    decode
        .chunks_exact(3)
        .map(|d| {
            let ctx = d[1] as usize + 1;
            if window > 0 {
                ctx.min(window)
            } else {
                ctx
            }
        })
        .max()
        .unwrap_or(0)
}

fn grow(gpu: &Gpu, buf: &mut Option<CudaSlice<f32>>, n: usize) -> Result<(), CudaError> {
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        *buf = Some(gpu.alloc_zeros::<f32>(n.max(1).next_power_of_two())?);
    }
    Ok(())
}

impl Gpu {
    /// Decode attention for `a`'s decode rows through flash-decoding; the split scratch lives
    /// in `a` and grows to the largest step.
    pub(super) fn attn_decode_split(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: AttnOut<'_>,
        a: &mut AttnMeta,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let fd = self
            .flash
            .as_ref()
            .expect("attn_decode_split called without the flash-decoding kernels loaded");
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
        let plan = DecodeSplit::plan(
            max_decode_ctx(&a.host.decode, s.window),
            pairs,
            fd.sms,
            fd.min_chunk,
        );
        if plan.splits == 1 {
            // Short contexts, or enough (row, head) pairs to fill the GPU: one block per pair
            // already, so attention.cu's kernel runs (no scratch, no reduce launch).
            let (tables, row_meta) = (a.tables(), a.decode());
            return self.attn_decode(q, kc, vc, out, &tables, &row_meta, n, s);
        }
        let (acc_len, ml_len) = plan.scratch_len(pairs, s.head_dim);
        grow(self, &mut a.split_acc, acc_len)?;
        grow(self, &mut a.split_ml, ml_len)?;
        let (acc, ml) = (
            a.split_acc.as_ref().expect("grown above"),
            a.split_ml.as_ref().expect("grown above"),
        );
        let (tables, row_meta) = (a.tables(), a.decode());
        assert!(row_meta.len() >= 3 * n);
        let reduce = self.attn_kernel(&out, &fd.reduce, |k| Some(&k.reduce))?;
        // SAFETY: attn_decode_split_T(q, kc, vc, float* part_acc, float* part_ml, block_tables,
        // row_meta, int rows, int n_heads, int n_kv_heads, int head_dim, int block_size, int
        // window, float scale, int splits, int chunk) then attn_decode_reduce(part_acc,
        // part_ml, out, row_meta, int rows, int n_heads, int head_dim, int splits), `out` of
        // the reduce entry's output type (attn_kernel picks its _out_W twin for 16 bits). The
        // metadata was built by step.rs from the StepLayout whose K/V were written (table
        // entries and rows in range, as for attn_decode); splits · chunk covers every row's
        // attended context (DecodeSplit::plan over max_decode_ctx); the scratch holds
        // rows · n_heads · splits · head_dim and · 2 f32 (grown above); blockDim = 32 ·
        // SPLIT_WARPS as compiled.
        unsafe {
            launch!(
                self,
                &fd.split,
                (n as u32, s.n_heads as u32, plan.splits as u32),
                32 * shape::SPLIT_WARPS,
                [
                    self.p(q),
                    self.p(kc),
                    self.p(vc),
                    self.p(acc),
                    self.p(ml),
                    self.p(&tables),
                    self.p(&row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim"),
                    int(s.block_size, "block_size"),
                    int(s.window, "window"),
                    s.scale,
                    int(plan.splits, "splits"),
                    int(plan.chunk, "chunk")
                ]
            )?;
            launch!(
                self,
                reduce,
                (n as u32, s.n_heads as u32, 1),
                128,
                [
                    self.p(acc),
                    self.p(ml),
                    out.ptr(self),
                    self.p(&row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.head_dim, "head_dim"),
                    int(plan.splits, "splits")
                ]
            )
        }
    }
}

impl CudaBackend {
    /// Switches the decode attention kernels (tests, benchmarks); compiles on first use.
    pub fn set_attn_impl(&mut self, imp: AttnImpl) -> Result<()> {
        self.gpu.flash = match imp {
            AttnImpl::Classic => None,
            AttnImpl::Split { min_chunk } => Some(FlashDecode::load(
                &self.gpu.ctx,
                self.gpu.kv_dtype,
                min_chunk,
            )?),
        };
        Ok(())
    }

    /// The decode attention kernels in use.
    pub fn attn_impl(&self) -> AttnImpl {
        match &self.gpu.flash {
            None => AttnImpl::Classic,
            Some(f) => AttnImpl::Split {
                min_chunk: f.min_chunk,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_context_respects_the_window() {
        let decode = [0, 30, 0, 5, 99, 1, 9, 0, 2];
        assert_eq!(max_decode_ctx(&decode, 0), 100);
        assert_eq!(max_decode_ctx(&decode, 7), 7);
        assert_eq!(max_decode_ctx(&[], 0), 0);
    }
}
