//! Few-row products and their LoRA deltas in one parallel region.
//!
//! A decode step's adapter deltas are small next to the base weights (r16 on q, k, v, o of
//! SmolLM2-135M: 1.6% of the bytes a token), yet run after each base product on the engine
//! thread alone, while the compute helper waits, they add a serial tail to every projection.
//! For steps of at most [`FUSED_MAX_ROWS`] rows the deltas are computed inside the base
//! product's column split instead:
//!
//! 1. **shrink** `t = x · Aᵀ`: split into chunks of [`CHUNK_RANKS`] rank rows that the threads
//!    claim (an atomic counter) as soon as the region starts, so `A` is read once in all;
//! 2. each thread computes its base columns, then waits for the chunks of the adapters those
//!    columns need (all claimed by then, by running threads that never wait while computing
//!    one — so the wait ends, also when the pool runs the parts one after another) and
//!    **expands** `y[:, cols] += scale · t · B[cols]ᵀ` for its own columns only.
//!
//! No extra fork/join, no serial tail. The chunks and the column expand are
//! [`lora_shrink`] / [`lora_expand`], bit for bit
//! [`lora_delta`](thaw_cpu_lora::kernel::lora_delta)'s halves, so results equal
//! the base product followed by [`Backend::lora`](super::Backend::lora) bit for bit (tested).
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::*};
use std::sync::{Arc, OnceLock};

use thaw_cpu_lora::kernel::{lora_expand, lora_shrink, LoraMat, LoraProblem, Scratch};

use super::{LoraBatch, LoraKernel, LoraSite};
use crate::adapter::LoraWeights;
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

/// Rank rows of `A` one thread claims at a time for the shared shrink.
pub(super) const CHUNK_RANKS: usize = 8;

/// Most (weight, adapter segment) pairs one op computes beside its base products; a step
/// with more (many adapters in one step) takes the base-then-LoRA path.
const MAX_JOBS: usize = 48;

thread_local! {
    /// Each compute thread's working memory for the kernel and its copy of `t` (they grow to
    /// the largest problem, then stay: no allocation per step).
    static LOCAL: RefCell<(Scratch, Vec<f32>)> = RefCell::new((Scratch::new(), Vec::new()));
}

/// One adapter's delta for one weight of the group: its rows, its factors, where its `t`
/// sits in the shared buffer and its first shrink chunk.
#[derive(Clone, Copy, Debug)]
struct Job<'a> {
    weight: usize,
    rows: (usize, usize),
    w: &'a LoraWeights,
    t_off: usize,
    chunk0: usize,
}

impl Job<'_> {
    fn chunks(&self) -> usize {
        self.w.rank.div_ceil(CHUNK_RANKS)
    }

    fn problem(&self, d_in: usize, d_out: usize) -> LoraProblem {
        LoraProblem {
            rows: self.rows.1 - self.rows.0,
            d_in,
            d_out,
            rank: self.w.rank,
            scale: self.w.scale,
        }
    }
}

/// The deltas one op computes beside its base products.
#[derive(Debug)]
pub(super) struct Plan<'a, const N: usize> {
    sites: [LoraSite; N],
    jobs: [Option<Job<'a>>; MAX_JOBS],
    n: usize,
    chunks: usize,
    t_len: usize,
}

/// The deltas of `sites` a step of `rows` rows computes beside its base products, or `None`
/// when it takes the base-then-LoRA path: another kernel than SGMV (BGMV keeps its own
/// formulation for comparisons), more than [`FUSED_MAX_ROWS`] rows, the path switched off,
/// too many (weight, segment) pairs, or no delta at all — adapters target none of the sites
/// at a landed layer (layers not landed yet get their deltas from the CPU assist, elsewhere).
pub(super) fn plan<'a, const N: usize>(
    rows: usize,
    sites: [LoraSite; N],
    batch: &LoraBatch<'a, Arc<LoraSlot>>,
) -> Option<Plan<'a, N>> {
    if batch.kernel != LoraKernel::Sgmv || rows > FUSED_MAX_ROWS || !enabled() {
        return None;
    }
    let mut p = Plan {
        sites,
        jobs: [None; MAX_JOBS],
        n: 0,
        chunks: 0,
        t_len: 0,
    };
    for (weight, s) in sites.iter().enumerate() {
        for (range, idx) in &batch.layout.segments {
            if !batch.on_device(*idx, s.layer) {
                continue;
            }
            let adapters: &'a [&'a Arc<LoraSlot>] = batch.adapters;
            let Some(w) = adapters[*idx as usize].get(s.layer.0, s.module) else {
                continue;
            };
            // Shapes were validated when the adapter was loaded; a mismatch here (never
            // expected) takes the path that reports it.
            let shapes_ok =
                w.a.numel() == w.rank * s.dims.d_in && w.b.numel() == s.dims.d_out * w.rank;
            if p.n == MAX_JOBS || w.rank == 0 || !shapes_ok {
                return None;
            }
            let job = Job {
                weight,
                rows: (range.start, range.end),
                w,
                t_off: p.t_len,
                chunk0: p.chunks,
            };
            p.chunks += job.chunks();
            p.t_len += range.len() * w.rank;
            p.jobs[p.n] = Some(job);
            p.n += 1;
        }
    }
    (p.n > 0).then_some(p)
}

/// The shrink shared by the threads of one op: `t` of every job, the next unclaimed chunk,
/// and per job the chunks done. Kept by the backend, reset per op.
#[derive(Debug, Default)]
pub(super) struct Shared {
    t: Vec<AtomicU32>,
    next: AtomicUsize,
    done: Vec<AtomicUsize>,
}

impl Shared {
    /// Ready for `plan` (called with exclusive access, before the parallel region).
    pub(super) fn reset<const N: usize>(&mut self, plan: &Plan<'_, N>) {
        if self.t.len() < plan.t_len {
            self.t.resize_with(plan.t_len, || AtomicU32::new(0));
        }
        if self.done.len() < plan.n {
            self.done.resize_with(MAX_JOBS, || AtomicUsize::new(0));
        }
        *self.next.get_mut() = 0;
        for d in &mut self.done[..plan.n] {
            *d.get_mut() = 0;
        }
    }

    /// Claims and computes shrink chunks until none is left (each part calls it first).
    pub(super) fn claim<const N: usize>(&self, plan: &Plan<'_, N>, x: &[f32]) {
        loop {
            let c = self.next.fetch_add(1, Relaxed);
            if c >= plan.chunks {
                return;
            }
            let (j, job) = plan.jobs[..plan.n]
                .iter()
                .flatten()
                .enumerate()
                .find(|(_, job)| c < job.chunk0 + job.chunks())
                .expect("chunk numbers end with the last job's");
            let d_in = plan.sites[job.weight].dims.d_in;
            let p = job.problem(d_in, 0);
            let (r0, r1) = job.rows;
            let k0 = (c - job.chunk0) * CHUNK_RANKS;
            let ranks = k0..(k0 + CHUNK_RANKS).min(job.w.rank);
            LOCAL.with_borrow_mut(|(s, t)| {
                let t = grow(t, p.rows * ranks.len());
                lora_shrink(
                    &p,
                    &x[r0 * d_in..r1 * d_in],
                    job.w.a.mat(),
                    ranks.clone(),
                    t,
                    s,
                )
                .expect("shapes were checked by the plan");
                let w = ranks.len();
                for (i, row) in t.chunks_exact(w).enumerate() {
                    let dst = &self.t[job.t_off + i * job.w.rank + ranks.start..][..w];
                    for (d, v) in dst.iter().zip(row) {
                        d.store(v.to_bits(), Relaxed);
                    }
                }
            });
            // Publishes the stores above to the thread that sees the count complete.
            self.done[j].fetch_add(1, Release);
        }
    }

    /// Adds every job's delta for weight `i` to its output columns `cols`: `piece` holds them
    /// packed `[rows, cols.len()]` (the base product, bias included). Waits for the job's
    /// shrink chunks first (see the module note for why the wait ends).
    pub(super) fn expand<const N: usize>(
        &self,
        plan: &Plan<'_, N>,
        i: usize,
        cols: Range<usize>,
        piece: &mut [f32],
    ) {
        let n = cols.len();
        let jobs = plan.jobs[..plan.n].iter().flatten().enumerate();
        for (j, job) in jobs.filter(|(_, job)| job.weight == i) {
            while self.done[j].load(Acquire) < job.chunks() {
                std::hint::spin_loop();
            }
            let p = job.problem(plan.sites[i].dims.d_in, n);
            let len = p.rows * p.rank;
            // `B` is `[d_out, rank]`: the rows of these columns are one contiguous slice.
            let bm = job.w.b.mat();
            let es = bm.dtype.size();
            let b = LoraMat {
                dtype: bm.dtype,
                bytes: &bm.bytes[cols.start * p.rank * es..cols.end * p.rank * es],
            };
            let (r0, r1) = job.rows;
            LOCAL.with_borrow_mut(|(s, t)| {
                let t = grow(t, len);
                for (d, v) in t.iter_mut().zip(&self.t[job.t_off..job.t_off + len]) {
                    *d = f32::from_bits(v.load(Relaxed));
                }
                let out = &mut piece[r0 * n..r1 * n];
                lora_expand(&p, t, b, out, true, s).expect("shapes were checked by the plan");
            });
        }
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::adapter::{LoraModule, WeightDtype};
    use crate::backend::cpu::{CpuBackend, CpuLinear};
    use crate::backend::cpu_par::CpuThreads;
    use crate::backend::{test_adapter, test_values, Backend, LinearDims, LoraLayout};
    use crate::ids::LayerIdx;
    use crate::model::{fixtures, ModelConfig};

    /// A rank-`r` adapter on `targets` of every layer, random factors, stored in `dtype`.
    fn adapter(
        c: &ModelConfig,
        r: usize,
        targets: &[LoraModule],
        seed: u32,
        dtype: WeightDtype,
    ) -> Arc<LoraSlot> {
        let a = test_adapter(c, r, targets, seed).into_dtype(dtype);
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
        /// (fewer than the rows: the kernel's transpose path), 16 and 48 (its in-place path),
        /// stored as f32, bf16 and f16 (column slices of a 2-byte `B` included), mixed in any row order with base-only rows, layers not landed yet (no delta: the
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
                adapter(&c, 4, &[Q, V], 1, WeightDtype::F32),
                adapter(&c, 16, &LoraModule::ALL, 2, WeightDtype::Bf16),
                adapter(&c, 48, &[K, O, Gate, Down], 3, WeightDtype::F16),
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
    /// adapter of the step targets one of the sites at a landed layer; the plan has a job per
    /// (weight, segment) with a delta and a chunk per [`CHUNK_RANKS`] rank rows.
    #[test]
    fn plan_only_few_rows_with_a_landed_target() {
        use LoraModule::*;
        let c = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let f32 = WeightDtype::F32;
        let (r4, r16) = (
            adapter(&c, 4, &[Q, V], 9, f32),
            adapter(&c, 16, &[V], 8, f32),
        );
        let adapters = [&r4, &r16];
        let site = |module| LoraSite {
            layer: LayerIdx(1),
            module,
            dims: {
                let (d_in, d_out) = c.module_shape(module);
                LinearDims { d_in, d_out }
            },
        };
        let few = layout(&[Some(0), None, Some(1), Some(0)]);
        let many = layout(&[Some(0); FUSED_MAX_ROWS + 1]);
        let batch = |layout, kernel, landed| LoraBatch {
            kernel,
            layout,
            adapters: &adapters,
            landed,
        };
        let sgmv = LoraKernel::Sgmv;
        // On unless this process runs with THAW_FUSED_LORA=0.
        if !enabled() {
            assert!(plan(4, [site(Q)], &batch(&few, sgmv, &[2, 2])).is_none());
            return;
        }
        let p = plan(4, [site(Q), site(K), site(V)], &batch(&few, sgmv, &[2, 2])).unwrap();
        // q: the two r4 segments; v: r4 twice and r16 once. One chunk per r4, two per r16.
        assert_eq!(p.n, 5);
        assert_eq!(p.chunks, 4 + 2);
        assert_eq!(p.t_len, 4 * (1 + 1 + 1 + 1) + 16);
        // r4 has landed layer 0 only: no delta for q at layer 1; v keeps r16's.
        assert!(plan(4, [site(Q)], &batch(&few, sgmv, &[1, 2])).is_none());
        let p = plan(4, [site(Q), site(V)], &batch(&few, sgmv, &[1, 2])).unwrap();
        assert_eq!((p.n, p.chunks), (1, 2));
        assert!(plan(4, [site(K), site(O)], &batch(&few, sgmv, &[2, 2])).is_none());
        assert!(plan(4, [site(Q)], &batch(&few, LoraKernel::Bgmv, &[2, 2])).is_none());
        let rows = FUSED_MAX_ROWS + 1;
        assert!(plan(rows, [site(Q)], &batch(&many, sgmv, &[2, 2])).is_none());
        assert!(plan(1, [site(Q)], &batch(&layout(&[None]), sgmv, &[2, 2])).is_none());
    }
}
