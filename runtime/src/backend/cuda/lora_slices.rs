//! Multi-slice LoRA launches (issue 29, `THAW_CUDA_LORA_SLICES`; on by default, `0` for a
//! launch pair per module): `thaw_kernels`' `lora_slices.cu`.
//!
//! With the switch on and Punica's kernels in use, [`Backend::linear_group_lora`] adds the LoRA
//! deltas of the modules sharing one input — q/k/v, gate/up — with ONE shrink launch and ONE
//! expand launch over the slices (a grid factor, [`slices_plan`]), instead of a shrink and an
//! expand per module: 4 launches a layer fewer for q/k/v + gate/up of a Llama (128 a step on
//! 32 layers). vLLM's Triton `lora_shrink` / `lora_expand` do the same with "slices".
//!
//! Each slice runs `lora_punica.cu`'s block code with the split-K plan its per-module launch
//! would use ([`slices_plan::common_split`]), so its result is bit-identical to the per-module
//! path. Where that cannot hold — the slices plan different splits (modules of different max
//! ranks), a grid past CUDA's limits (a prefill segment of more than 87,380 rows), a graph
//! capture or replay (`graph.rs` launches per module from its persistent
//! metadata), `lora.cu`'s kernels, modules of different layers or input widths — the deltas are
//! added per module as before.
//!
//! [`Backend::linear_group_lora`]: crate::backend::Backend::linear_group_lora
//! [`slices_plan`]: thaw_kernels::cuda::slices_plan
//! [`slices_plan::common_split`]: thaw_kernels::cuda::slices_plan::common_split
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::punica_plan::SplitK;
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::slices_plan::{common_split, grids, v_len, Gather};
use thaw_kernels::cuda::KernelCache;

use super::launch::{int, launch};
use super::sgmv::shrink_blocks;
use super::weights::CudaLora;
use super::{CudaBackend, CudaError};
use crate::backend::{LoraBatch, LoraKernel, LoraSite};
use crate::error::Result;

/// The sliced kernels for one weight dtype.
pub(crate) struct Slices {
    sgmv_shrink: CudaFunction,
    sgmv_expand: CudaFunction,
    bgmv_shrink: CudaFunction,
    bgmv_expand: CudaFunction,
}

impl Slices {
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |base: &str| cache.function(ctx, &format!("slices_{base}_{}", w.suffix()));
        Ok(Self {
            sgmv_shrink: f("sgmv_shrink")?,
            sgmv_expand: f("sgmv_expand")?,
            bgmv_shrink: f("bgmv_shrink")?,
            bgmv_expand: f("bgmv_expand")?,
        })
    }
}

/// Whether `sites` can share one launch pair: 1 to [`shape::PUNICA_MAX_SLICES`] modules of one
/// layer reading one input width (they share `x` and the segment metadata).
pub(crate) fn sliceable(sites: &[LoraSite]) -> bool {
    (1..=shape::PUNICA_MAX_SLICES).contains(&sites.len())
        && sites
            .windows(2)
            .all(|p| p[0].layer == p[1].layer && p[0].dims.d_in == p[1].dims.d_in)
}

/// An [i32; 3] kernel parameter (`SliceInts`): the slices' values, zero past `n`.
fn ints(vals: impl Iterator<Item = usize>, what: &str) -> [i32; shape::PUNICA_MAX_SLICES] {
    let mut out = [0i32; shape::PUNICA_MAX_SLICES];
    for (o, v) in out.iter_mut().zip(vals) {
        *o = int(v, what);
    }
    out
}

impl CudaBackend {
    /// `outs[i] += LoRA(x)` for every site with one shrink and one expand launch. Ok(false):
    /// nothing ran, the caller adds the deltas per module (see the module docs for when).
    pub(super) fn try_lora_slices(
        &mut self,
        x: &CudaSlice<f32>,
        outs: &mut [&mut CudaSlice<f32>],
        sites: &[LoraSite],
        batch: &LoraBatch<'_, CudaLora>,
    ) -> Result<bool, CudaError> {
        assert_eq!(
            outs.len(),
            sites.len(),
            "linear_group_lora: one output per site"
        );
        let usable = self.gpu.slices.is_some() && self.gpu.punica.is_some();
        if !usable || self.graphs.active().is_some() || !sliceable(sites) {
            return Ok(false);
        }
        let layer = sites[0].layer;
        self.lora_meta_for(layer, batch)?;
        let rows = batch.layout.row_adapter.len();
        let d_in = sites[0].dims.d_in;
        // The slices some on-device adapter targets (up to 3: no allocation per layer).
        let mut live = [(0usize, 0usize); shape::PUNICA_MAX_SLICES];
        let mut n = 0;
        for (i, s) in sites.iter().enumerate() {
            let r = self.lora_max_rank((s.layer, s.module), batch);
            if r > 0 {
                live[n] = (i, r);
                n += 1;
            }
        }
        let live = &live[..n];
        if rows == 0 || live.is_empty() {
            return Ok(true);
        }
        let kernel = batch.kernel;
        let meta = &self.lora_meta;
        let p = self.gpu.punica.as_ref().expect("checked above");
        let mut plans = [SplitK {
            splits: 0,
            k_chunk: 0,
        }; shape::PUNICA_MAX_SLICES];
        for (plan, &(_, r)) in plans.iter_mut().zip(live) {
            *plan = p.split(d_in, shrink_blocks(kernel, meta, rows, r))?;
        }
        let Some(sk) = common_split(&plans[..n]) else {
            return Ok(false);
        };
        let v_stride = live.iter().map(|&(_, r)| r).max().unwrap_or(0);
        assert!(
            v_stride <= shape::PUNICA_MAX_RANK,
            "LoRA rank {v_stride} > {}",
            shape::PUNICA_MAX_RANK
        );
        assert!(
            x.len() >= rows * d_in,
            "lora slices: x smaller than {rows} rows"
        );
        for &(i, _) in live {
            assert!(
                outs[i].len() >= rows * sites[i].dims.d_out,
                "lora slices: output {i} smaller than {rows} rows"
            );
        }
        let gather = match kernel {
            LoraKernel::Sgmv => {
                let n_segs = meta.n_segs();
                let chunks = meta.max_seg_rows().div_ceil(shape::PUNICA_ROWS as usize);
                if n_segs == 0 || chunks == 0 {
                    return Ok(true);
                }
                Gather::Sgmv { n_segs, chunks }
            }
            LoraKernel::Bgmv => Gather::Bgmv { rows },
        };
        let mut d_outs = [0usize; shape::PUNICA_MAX_SLICES];
        for (d, &(i, _)) in d_outs.iter_mut().zip(live) {
            *d = sites[i].dims.d_out;
        }
        let tiles = v_stride.div_ceil(shape::PUNICA_RANK_TILE as usize);
        let Some(g) = grids(gather, tiles, sk.splits, &d_outs[..n]) else {
            return Ok(false);
        };
        self.lora_scratch(v_len(&sk, n, rows, v_stride))?;
        let slots = ints(
            live.iter()
                .map(|&(i, _)| sites[i].layer.0 * 7 + sites[i].module.index()),
            "slot",
        );
        let d_outs = ints(d_outs.into_iter(), "d_out");
        let mut ys = [0u64; shape::PUNICA_MAX_SLICES];
        for (y, &(i, _)) in ys.iter_mut().zip(live) {
            *y = self.gpu.p(&*outs[i]);
        }
        let (gpu, meta) = (&self.gpu, &self.lora_meta);
        let k = gpu.slices.as_ref().expect("checked above");
        let v = self.lora_v.as_ref().expect("sized above");
        let (xp, vp) = (gpu.p(x), gpu.p(v));
        let n_slices = int(n, "slices");
        match gather {
            Gather::Sgmv { n_segs, chunks } => {
                let (tables, seg_rows) = (meta.seg_tables.get(), meta.seg_rows.get());
                assert!(tables.len() >= n_segs && seg_rows.len() >= 2 * n_segs);
                // SAFETY: slices_sgmv_shrink_T(const float* x, float* v_parts, const u64*
                // seg_tables, const u32* seg_rows, int n_segs, SliceInts slots, int n_slices,
                // int chunks, int d_in, int k_chunk, int splits, int rows_total, int v_stride)
                // and slices_sgmv_expand_T(v_parts, SlicePtrs ys, seg_tables, seg_rows, n_segs,
                // slots, SliceInts d_outs, n_slices, chunks, splits, rows_total, v_stride);
                // SliceInts / SlicePtrs are structs of 3 int / 3 u64, passed as [i32; 3] /
                // [u64; 3] (same size and alignment). Tables, segments, x and the outputs are
                // as for `punica_lora` (checked above, per slice: each `ys` entry is a live
                // buffer of rows × d_out f32, each slot < 7 · layers of every descriptor
                // array); v holds slices × splits × rows × v_stride f32 (sized above); every
                // slice's rank ≤ v_stride; k_chunk · splits ≥ d_in (SplitK::plan).
                unsafe {
                    launch!(
                        gpu,
                        &k.sgmv_shrink,
                        g.shrink,
                        shape::PUNICA_THREADS,
                        [
                            xp,
                            vp,
                            gpu.p(tables),
                            gpu.p(seg_rows),
                            int(n_segs, "n_segs"),
                            slots,
                            n_slices,
                            int(chunks, "chunks"),
                            int(d_in, "d_in"),
                            int(sk.k_chunk, "k_chunk"),
                            int(sk.splits, "splits"),
                            int(rows, "rows"),
                            int(v_stride, "v_stride")
                        ]
                    )?;
                    launch!(
                        gpu,
                        &k.sgmv_expand,
                        g.expand,
                        shape::PUNICA_THREADS,
                        [
                            vp,
                            ys,
                            gpu.p(tables),
                            gpu.p(seg_rows),
                            int(n_segs, "n_segs"),
                            slots,
                            d_outs,
                            n_slices,
                            int(chunks, "chunks"),
                            int(sk.splits, "splits"),
                            int(rows, "rows"),
                            int(v_stride, "v_stride")
                        ]
                    )?;
                }
            }
            Gather::Bgmv { rows } => {
                let tables = meta.row_tables.get();
                assert!(tables.len() >= rows);
                // SAFETY: slices_bgmv_shrink_T(const float* x, float* v_parts, const u64*
                // row_tables, int rows, SliceInts slots, int n_slices, int d_in, int k_chunk,
                // int splits, int max_rank) and slices_bgmv_expand_T(v_parts, SlicePtrs ys,
                // row_tables, rows, slots, SliceInts d_outs, n_slices, splits, max_rank); row
                // tables are 0 or live descriptor arrays, one per row (checked); buffers and
                // the struct parameters as for SGMV above.
                unsafe {
                    launch!(
                        gpu,
                        &k.bgmv_shrink,
                        g.shrink,
                        shape::PUNICA_THREADS,
                        [
                            xp,
                            vp,
                            gpu.p(tables),
                            int(rows, "rows"),
                            slots,
                            n_slices,
                            int(d_in, "d_in"),
                            int(sk.k_chunk, "k_chunk"),
                            int(sk.splits, "splits"),
                            int(v_stride, "max_rank")
                        ]
                    )?;
                    launch!(
                        gpu,
                        &k.bgmv_expand,
                        g.expand,
                        shape::PUNICA_THREADS,
                        [
                            vp,
                            ys,
                            gpu.p(tables),
                            int(rows, "rows"),
                            slots,
                            d_outs,
                            n_slices,
                            int(sk.splits, "splits"),
                            int(v_stride, "max_rank")
                        ]
                    )?;
                }
            }
        }
        Ok(true)
    }

    /// Switches the multi-slice LoRA launches on or off (tests, benchmarks). They run only
    /// with Punica's kernels ([`CudaBackend::set_lora_impl`]).
    pub fn set_lora_slices(&mut self, on: bool) -> Result<()> {
        self.gpu.slices = if on {
            Some(Slices::load(&self.gpu.ctx, self.gpu.weight_dtype)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether the multi-slice LoRA launches are on.
    pub fn lora_slices(&self) -> bool {
        self.gpu.slices.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::LoraModule;
    use crate::backend::LinearDims;
    use crate::ids::LayerIdx;

    fn site(layer: usize, module: LoraModule, d_in: usize, d_out: usize) -> LoraSite {
        LoraSite {
            layer: LayerIdx(layer),
            module,
            dims: LinearDims { d_in, d_out },
        }
    }

    #[test]
    fn qkv_and_gate_up_of_one_layer_share_a_launch_pair() {
        use LoraModule::*;
        let qkv = [
            site(3, Q, 4096, 4096),
            site(3, K, 4096, 1024),
            site(3, V, 4096, 1024),
        ];
        assert!(sliceable(&qkv));
        assert!(sliceable(&[
            site(0, Gate, 4096, 11008),
            site(0, Up, 4096, 11008)
        ]));
        assert!(sliceable(&qkv[..1]));
        assert!(!sliceable(&[]));
        // Another layer or another input width: different descriptor slots' x.
        assert!(!sliceable(&[
            site(3, Q, 4096, 4096),
            site(4, K, 4096, 1024)
        ]));
        assert!(!sliceable(&[
            site(3, Q, 4096, 4096),
            site(3, O, 2048, 4096)
        ]));
        let four = [qkv[0], qkv[1], qkv[2], qkv[0]];
        assert!(!sliceable(&four));
    }
}
