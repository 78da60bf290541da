//! Few-row products and their LoRA deltas in one parallel region.
//!
//! A decode step's adapter deltas are small next to the base weights (r16 on q, k, v, o of
//! SmolLM2-135M: 1.6% of the bytes a token), yet run after each base product on the engine
//! thread alone, while the compute helper waits, they cost ~9% of the step. For steps of at
//! most [`FUSED_MAX_ROWS`] rows, each thread of the base product's column split therefore
//! also adds the deltas of *its own* output columns, right after computing them: it computes
//! `t = x · Aᵀ` (rank values a row; `A` is small, so every thread whose columns need it
//! computes it) and adds `scale · t · B[cols]ᵀ`. No extra fork/join, no serial tail.
//!
//! The delta of a column range is [`lora_delta`] on the rows of `B` for those columns (its
//! `d_out` is the range's width): the same shrink, and an expand whose every output sums the
//! same terms in the same order wherever the column sits. So the result is bit for bit what
//! the base product followed by [`Backend::lora`](super::Backend::lora) gives (tested).
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use thaw_cpu_lora::kernel::{lora_delta, LoraMat, LoraProblem, Scratch};

use super::{LoraBatch, LoraKernel, LoraSite};
use crate::residency::LoraSlot;

/// Most rows a step may have for its deltas to be computed beside the base products (the
/// row count up to which a group of products splits by output columns).
pub(super) const FUSED_MAX_ROWS: usize = 16;

/// Turned off for this process by [`set_fused_lora`].
static OFF: AtomicBool = AtomicBool::new(false);

/// Computes decode deltas beside the base products (`true`, the default) or after them on
/// the engine thread, as before (`false`; `THAW_FUSED_LORA=0` does the same for a whole
/// process). Results are bit-identical either way: this exists for A/B runs that switch
/// step by step in one process.
pub fn set_fused_lora(on: bool) {
    OFF.store(!on, Relaxed);
}

fn enabled() -> bool {
    static ENV_OFF: OnceLock<bool> = OnceLock::new();
    !OFF.load(Relaxed)
        && !*ENV_OFF.get_or_init(|| thaw_kernels::cpu::switched_off("THAW_FUSED_LORA"))
}

thread_local! {
    /// Each compute thread's working memory for the delta kernel (grows to the largest
    /// problem, then stays: no allocation per step).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
}

/// Whether a step of `rows` rows gets the deltas of `sites` beside its base products: the
/// SGMV kernel (BGMV keeps its own formulation for comparisons), few rows, and at least one
/// adapter applied by the backend at one of the sites (layers not landed yet get their
/// deltas from the CPU assist, elsewhere).
pub(super) fn applies<const N: usize>(
    rows: usize,
    sites: &[LoraSite; N],
    batch: &LoraBatch<'_, Arc<LoraSlot>>,
) -> bool {
    batch.kernel == LoraKernel::Sgmv
        && rows <= FUSED_MAX_ROWS
        && enabled()
        && batch.layout.segments.iter().any(|(_, idx)| {
            sites.iter().any(|s| {
                batch.on_device(*idx, s.layer)
                    && batch.adapters[*idx as usize]
                        .get(s.layer.0, s.module)
                        .is_some()
            })
        })
}

/// Adds every adapter's delta for `site` to output columns `cols` of its weight: `piece` is
/// those columns packed `[rows, cols.len()]` (the base product, bias included); `x` is the
/// step's `[rows, d_in]` input.
pub(super) fn add_deltas(
    x: &[f32],
    piece: &mut [f32],
    cols: Range<usize>,
    site: LoraSite,
    batch: &LoraBatch<'_, Arc<LoraSlot>>,
) {
    let (d_in, n) = (site.dims.d_in, cols.len());
    for (range, idx) in &batch.layout.segments {
        if !batch.on_device(*idx, site.layer) {
            continue;
        }
        let Some(w) = batch.adapters[*idx as usize].get(site.layer.0, site.module) else {
            continue;
        };
        let p = LoraProblem {
            rows: range.len(),
            d_in,
            d_out: n,
            rank: w.rank,
            scale: w.scale,
        };
        // `B` is `[d_out, rank]`: the rows of these columns are one contiguous slice.
        let b = &w.b[cols.start * w.rank..cols.end * w.rank];
        SCRATCH
            .with_borrow_mut(|s| {
                lora_delta(
                    &p,
                    &x[range.start * d_in..range.end * d_in],
                    LoraMat::from_f32(&w.a),
                    LoraMat::from_f32(b),
                    &mut piece[range.start * n..range.end * n],
                    true,
                    s,
                )
            })
            .expect("LoRA shapes were validated when the adapter was loaded");
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};

    use super::*;
    use crate::adapter::{AdapterConfig, LoraAdapter, LoraModule};
    use crate::backend::cpu::{CpuBackend, CpuLinear};
    use crate::backend::cpu_par::CpuThreads;
    use crate::backend::{test_values, Backend, LinearDims, LoraLayout};
    use crate::ids::LayerIdx;
    use crate::model::{fixtures, ModelConfig};

    /// A rank-`r` adapter on `targets` of every layer, random factors.
    fn adapter(c: &ModelConfig, r: usize, targets: &[LoraModule], seed: u32) -> Arc<LoraSlot> {
        let names: Vec<String> = targets
            .iter()
            .map(|m| format!("\"{}\"", m.hf_name()))
            .collect();
        let json = format!(
            r#"{{"r":{r},"lora_alpha":{},"target_modules":[{}]}}"#,
            3 * r,
            names.join(",")
        );
        let mut rnd = test_values(seed);
        let bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let mut bufs = Vec::new();
        for l in 0..c.num_layers {
            for &m in targets {
                let (d_in, d_out) = c.module_shape(m);
                let p = format!("base_model.model.{}", m.module_path(l));
                bufs.push((
                    format!("{p}.lora_A.weight"),
                    vec![r, d_in],
                    bytes(rnd(r * d_in)),
                ));
                bufs.push((
                    format!("{p}.lora_B.weight"),
                    vec![d_out, r],
                    bytes(rnd(d_out * r)),
                ));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = bufs
            .iter()
            .map(|(n, s, d)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
                )
            })
            .collect();
        let st = safetensors::serialize(views, None).unwrap();
        let st = SafeTensors::deserialize(&st).unwrap();
        let config = AdapterConfig::from_json(&json).unwrap();
        let a = LoraAdapter::from_parts(config, &st, c).unwrap();
        Arc::new(LoraSlot::resident(Arc::new(a)))
    }

    /// Segments (maximal runs of one adapter) and per-row indices for `row_adapter`.
    fn layout(row_adapter: &[Option<u32>]) -> LoraLayout {
        let mut l = LoraLayout {
            row_adapter: row_adapter.to_vec(),
            ..LoraLayout::default()
        };
        let mut r = 0;
        while r < row_adapter.len() {
            let len = row_adapter[r..]
                .iter()
                .take_while(|&&i| i == row_adapter[r])
                .count();
            if let Some(i) = row_adapter[r] {
                l.segments.push((r..r + len, i));
            }
            r += len;
        }
        l
    }

    /// The fused group against its definition: base products, then [`Backend::lora`]
    /// (`lora_delta` over each output's full width) on one thread. Returns whether any
    /// delta was added (so the comparison is not vacuous).
    #[allow(clippy::too_many_arguments)]
    fn check_group<const N: usize>(
        c: &ModelConfig,
        threads: usize,
        ws: [&CpuLinear; N],
        modules: [LoraModule; N],
        layer: usize,
        rows: usize,
        batch: &LoraBatch<'_, Arc<LoraSlot>>,
        seed: u32,
    ) -> bool {
        let mut one = CpuBackend::with_threads(c, CpuThreads::unpinned(1)).unwrap();
        let par = CpuThreads {
            min_part_work: 1,
            ..CpuThreads::unpinned(threads)
        };
        let mut many = CpuBackend::with_threads(c, par).unwrap();
        let k = ws[0].d_in;
        let x = test_values(seed)(rows * k);
        let sites = modules.map(|module| LoraSite {
            layer: LayerIdx(layer),
            module,
            dims: LinearDims {
                d_in: k,
                d_out: c.module_shape(module).1,
            },
        });
        let mut base: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; rows * w.d_out]).collect();
        let mut want = base.clone();
        for i in 0..N {
            one.linear(&x, ws[i], rows, &mut base[i]);
            want[i].clone_from(&base[i]);
            one.lora(
                &x,
                &mut want[i],
                sites[i].dims,
                (sites[i].layer, modules[i]),
                batch,
            );
        }
        let mut got: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; rows * w.d_out]).collect();
        let mut outs = got.iter_mut();
        let outs: [&mut Vec<f32>; N] = std::array::from_fn(|_| outs.next().unwrap());
        many.linear_group_lora(&x, ws, rows, outs, sites, batch);
        for i in 0..N {
            let same = got[i]
                .iter()
                .zip(&want[i])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{:?}: {threads} threads, {rows} rows", modules[i]);
        }
        base != want
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Deltas added inside the column split equal, bit for bit, the base products followed
        /// by `lora_delta` over whole outputs — for 1–3 threads, 1–16 rows, adapters of rank 4
        /// (fewer than the rows: the kernel's transpose path), 16 and 48 (its in-place path)
        /// mixed in any row order with base-only rows, layers not landed yet (no delta: the
        /// CPU assist adds those), groups whose adapters target only some weights, and a bias.
        #[test]
        fn fused_deltas_equal_base_then_lora_delta(
            threads in 1usize..4,
            picks in proptest::collection::vec(0u32..4, 1..=FUSED_MAX_ROWS),
            landed in proptest::collection::vec(0usize..3, 3),
            layer in 0usize..2,
            seed in 0u32..1000,
        ) {
            use LoraModule::*;
            let c = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
            let slots = [
                adapter(&c, 4, &[Q, V], 1),
                adapter(&c, 16, &LoraModule::ALL, 2),
                adapter(&c, 48, &[K, O, Gate, Down], 3),
            ];
            let adapters: Vec<&Arc<LoraSlot>> = slots.iter().collect();
            let row_adapter: Vec<Option<u32>> =
                picks.iter().map(|&p| (p < 3).then_some(p)).collect();
            let layout = layout(&row_adapter);
            let batch = LoraBatch {
                kernel: LoraKernel::Sgmv,
                layout: &layout,
                adapters: &adapters,
                landed: &landed,
            };
            let rows = picks.len();
            let one = CpuBackend::with_threads(&c, CpuThreads::unpinned(1)).unwrap();
            let mut rnd = test_values(seed + 7);
            let mut lin = |m: LoraModule, bias: bool| {
                let (d_in, d_out) = c.module_shape(m);
                let b = bias.then(|| rnd(d_out));
                one.upload_linear(rnd(d_out * d_in), d_out, d_in, b).unwrap()
            };
            let (q, k, v, o) = (lin(Q, false), lin(K, true), lin(V, false), lin(O, false));
            let (g, u, d) = (lin(Gate, false), lin(Up, false), lin(Down, false));
            let s = seed + 1;
            let mut any = check_group(&c, threads, [&q, &k, &v], [Q, K, V], layer, rows, &batch, s);
            any |= check_group(&c, threads, [&o], [O], layer, rows, &batch, s);
            any |= check_group(&c, threads, [&g, &u], [Gate, Up], layer, rows, &batch, s);
            any |= check_group(&c, threads, [&d], [Down], layer, rows, &batch, s);
            let applied = layout.segments.iter().any(|(_, i)| landed[*i as usize] > layer);
            prop_assert_eq!(any, applied, "deltas added exactly when an adapter is on the device");
        }
    }

    /// The few-rows decision: SGMV only, at most [`FUSED_MAX_ROWS`] rows, and only when an
    /// adapter of the step targets one of the sites at a landed layer.
    #[test]
    fn applies_only_to_few_rows_with_a_landed_target() {
        use LoraModule::*;
        let c = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let slot = adapter(&c, 4, &[Q, V], 9);
        let adapters = [&slot];
        let site = |module| LoraSite {
            layer: LayerIdx(1),
            module,
            dims: LinearDims {
                d_in: 64,
                d_out: 64,
            },
        };
        let few = layout(&[Some(0), None]);
        let many = layout(&vec![Some(0); FUSED_MAX_ROWS + 1]);
        let batch = |layout, kernel, landed| LoraBatch {
            kernel,
            layout,
            adapters: &adapters,
            landed,
        };
        let sgmv = LoraKernel::Sgmv;
        // On unless this process runs with THAW_FUSED_LORA=0.
        let on = enabled();
        assert_eq!(applies(2, &[site(Q)], &batch(&few, sgmv, &[2])), on);
        assert_eq!(
            applies(2, &[site(K), site(V)], &batch(&few, sgmv, &[2])),
            on
        );
        assert!(!applies(2, &[site(K), site(O)], &batch(&few, sgmv, &[2])));
        assert!(
            !applies(2, &[site(Q)], &batch(&few, sgmv, &[1])),
            "layer 1 not landed"
        );
        assert!(!applies(
            2,
            &[site(Q)],
            &batch(&few, LoraKernel::Bgmv, &[2])
        ));
        let rows = FUSED_MAX_ROWS + 1;
        assert!(!applies(rows, &[site(Q)], &batch(&many, sgmv, &[2])));
        assert!(!applies(
            1,
            &[site(Q)],
            &batch(&layout(&[None]), sgmv, &[2])
        ));
    }
}
