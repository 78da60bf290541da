//! q/k/v (and gate/up) as one product (issue 29, `THAW_CUDA_GROUP_GEMM`; on by default, `0`
//! for one product per module).
//!
//! At load ([`Backend::upload_weight_group`]) the matrices of a group that share their input
//! are placed back to back in one allocation, so the group is one `[Σ d_out, d_in]` matrix
//! (GQA-aware: k and v may be narrower than q). [`Backend::linear_group`] then casts the input
//! once and runs one GEMM into a `[rows, Σ d_out]` scratch, split into the modules' buffers by
//! one kernel (`split_cols3_f32`). Each module's output equals its own product's up to cuBLAS's
//! choice of kernel for the wider shape (another f32 summation order). LoRA deltas are then
//! added per module into its buffer, as before (the trait's `linear_group_lora`).
//!
//! Why: at batch 1 on an H200 the 4096×4096 q/k/v products ran at 59–63% of the copy roofline
//! against 96–102% for the 11008-wide gate/up/down (`cuda-h100.md` §8): each paid its own input
//! cast and its own GEMM launch and tail for 32 MB of weights.
//!
//! With `THAW_CUDA_CUBLASLT=1` the one product runs through cuBLASLt like any other (`lt.rs`,
//! default epilogue: a group placed as one matrix has no biases); per-module products of a
//! group with biases (Qwen2's q/k/v) take the bias epilogue.
//!
//! A group placed separately (the switch off at load, a bias, another input width), or a step
//! of more rows than [`GROUP_GEMM_MAX_ROWS`] (prefill: the product is compute-bound and the
//! split's copy would grow with the rows), still casts its input once with the switch on, then
//! runs one GEMM per module.
//!
//! [`GROUP_GEMM_MAX_ROWS`]: crate::backend::kernel_select::GROUP_GEMM_MAX_ROWS
//!
//! [`Backend::upload_weight_group`]: crate::backend::Backend::upload_weight_group
//! [`Backend::linear_group`]: crate::backend::Backend::linear_group
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cpu::WeightMatrix;
use thaw_kernels::cuda::KernelCache;

use super::encode::encode;
use super::weights::{stored_bytes, CudaLinear, WeightBytes};
use super::{CudaBackend, CudaError, DType};
use crate::backend::graph_plan::GraphPhase;
use crate::backend::kernel_select::group_as_one_product;
use crate::error::Result;

/// The split kernel of a grouped product.
pub(crate) struct Group {
    split: CudaFunction,
}

impl Group {
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        Ok(Self {
            split: KernelCache::global().function(ctx, "split_cols3_f32")?,
        })
    }
}

/// Whether matrices `ws` form one product: two or three, back to back in one allocation, of one
/// input width, without biases.
pub(super) fn one_matrix(ws: &[&CudaLinear]) -> bool {
    matches!(ws.len(), 2 | 3)
        && ws.iter().all(|w| w.bias.is_none())
        && ws
            .windows(2)
            .all(|p| p[0].d_in == p[1].d_in && p[0].w.followed_by(&p[1].w))
}

impl CudaBackend {
    /// [`Backend::upload_weight_group`](crate::backend::Backend::upload_weight_group): one
    /// allocation for the group where it can be one product and the switch is on, else each
    /// matrix as `upload_weight` places it.
    pub(super) fn try_upload_group(
        &self,
        ws: Vec<(WeightMatrix, Option<Vec<f32>>)>,
    ) -> Result<Vec<CudaLinear>> {
        use crate::backend::Backend;
        let groupable = self.gpu.group.is_some()
            && matches!(ws.len(), 2 | 3)
            && ws.iter().all(|(_, b)| b.is_none())
            && ws.windows(2).all(|p| p[0].0.cols() == p[1].0.cols());
        if !groupable {
            return ws
                .into_iter()
                .map(|(w, b)| self.upload_weight(w, b))
                .collect();
        }
        let dt = self.gpu.weight_dtype;
        let s = &self.gpu.stream;
        let sizes: Vec<usize> = ws
            .iter()
            .map(|(w, _)| w.rows() * w.cols() * dt.size())
            .collect();
        let total: usize = sizes.iter().sum();
        let mut buf = s.alloc_zeros::<u8>(total.max(1)).map_err(CudaError::from)?;
        let mut at = 0;
        let mut ranges = Vec::with_capacity(ws.len());
        for ((w, _), n) in ws.iter().zip(&sizes) {
            let mut dst = buf.slice_mut(at..at + n);
            let r = match stored_bytes(w, dt) {
                Some(bytes) => s.memcpy_htod(bytes, &mut dst),
                None => s.memcpy_htod(&encode(&w.to_f32(), dt)[..], &mut dst),
            };
            r.map_err(CudaError::from)?;
            ranges.push(at..at + n);
            at += n;
        }
        let buf = Arc::new(buf);
        Ok(ws
            .iter()
            .zip(ranges)
            .map(|((w, _), r)| CudaLinear {
                w: WeightBytes::shared(&buf, r),
                bias: None,
                bias32: None,
                d_out: w.rows(),
                d_in: w.cols(),
            })
            .collect())
    }

    /// [`Backend::linear_group`](crate::backend::Backend::linear_group) with the switch on:
    /// one product where `ws` are one matrix and the step has few rows (and, in a graph
    /// capture, the scratch is already large enough), else one input cast and a product per
    /// module.
    pub(super) fn try_linear_group(
        &mut self,
        x: &CudaSlice<f32>,
        ws: &[&CudaLinear],
        rows: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), CudaError> {
        assert_eq!(ws.len(), outs.len(), "linear_group: one output per weight");
        let total: usize = ws.iter().map(|w| w.d_out).sum();
        let n = rows * total;
        let capturing = self
            .graphs
            .active()
            .is_some_and(|a| a.phase == GraphPhase::Capture);
        let fits = self.group_out.as_ref().is_some_and(|b| b.len() >= n);
        let split = self.gpu.group.as_ref().map(|g| g.split.clone());
        let one = one_matrix(ws) && group_as_one_product(rows);
        if let (Some(split), true, true) = (split, one, fits || !capturing) {
            if !fits {
                // Grown outside a capture only (a graph bakes the address in: `graph.rs`'s
                // fingerprint drops graphs captured on an older scratch).
                let len = n.max(1).next_power_of_two();
                self.group_out = Some(self.gpu.alloc_zeros::<f32>(len)?);
            }
            let mut scratch = self.group_out.take().expect("sized above");
            let last = ws.last().expect("two or three weights");
            let w = ws[0].w.through(&last.w);
            let gemv = (self.gpu).gemv_takes(x, &w, rows, ws[0].d_in, total);
            let r = self
                .linear_view(x, &w, rows, ws[0].d_in, total, &mut scratch, gemv, None)
                .and_then(|()| {
                    // Two or three modules (split_cols checks): no host allocation per layer.
                    let mut widths = [0usize; 3];
                    for (d, w) in widths.iter_mut().zip(ws) {
                        *d = w.d_out;
                    }
                    let widths = &widths[..ws.len().min(3)];
                    self.gpu.split_cols(&split, &scratch, rows, outs, widths)
                });
            self.group_out = Some(scratch);
            return r;
        }
        // One cast of x for every product: the first that takes cuBLAS casts it into `x16`, the
        // rest read it. A product the small-batch GEMV takes (`gemv.rs`) reads x itself and
        // casts nothing.
        let mut cast = false;
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            let gemv = self.gpu.gemv_takes(x, &w.w.view(), rows, w.d_in, w.d_out);
            match (&self.x16, cast && gemv.is_none()) {
                (Some(x16), true) => {
                    let eb = self.epilogue_bias(w, false);
                    let view = w.w.view();
                    (self.gpu).linear_from_x16(x16, &view, rows, w.d_in, w.d_out, o, eb)?;
                    self.add_bias_unless_fused(w, eb, rows, o)?;
                }
                _ => {
                    self.try_linear_by(x, w, rows, o, gemv)?;
                    cast |= gemv.is_none() && self.gpu.weight_dtype != DType::F32;
                }
            }
        }
        Ok(())
    }

    /// Switches grouped products on or off (tests, benchmarks). Groups are placed as one
    /// matrix at load only while it is on, so a test turns it on before the model is loaded.
    pub fn set_group_gemm(&mut self, on: bool) -> Result<()> {
        self.gpu.group = if on {
            Some(Group::load(&self.gpu.ctx)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether `ws` were placed as one matrix, so that a group of them runs as one product
    /// (tests of the layout [`Backend::upload_weight_group`] chose).
    ///
    /// [`Backend::upload_weight_group`]: crate::backend::Backend::upload_weight_group
    pub fn placed_as_one(ws: &[&CudaLinear]) -> bool {
        one_matrix(ws)
    }

    /// Whether grouped products run.
    pub fn group_gemm(&self) -> bool {
        self.gpu.group.is_some()
    }
}
