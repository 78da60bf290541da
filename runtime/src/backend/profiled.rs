//! [`Profiled`]: a backend that wraps another and, while a profile is recording, brackets
//! every compute op with two marks of the wrapped backend's [`OpClock`] (CUDA events recorded
//! on its compute stream; the wall clock on the CPU), filed under an [`OpClass`], and times
//! the host's call between them. Read after the step ([`Profiled::finish`]) the marks become
//! [`OpSample`]s for [`super::op_profile::aggregate`]: device µs per op, host µs issuing it,
//! and the device time between ops (what tells a host-bound op from a device-bound one).
//!
//! Off (the default, and whenever no profile is recording) each op costs one flag test
//! before it is handed on unchanged. On, the module groups of
//! [`Backend::linear_group_lora`] run as one [`Backend::linear`] per weight and one
//! [`Backend::lora`] per module, the trait's default composition, so that each module's
//! product and each delta are timed apart; every other op runs as the wrapped backend runs it.
//! CUDA-graph steps are not profiled (their ops are replayed, not called): profile eager steps.
use std::ops::Range;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use thaw_kernels::cpu::KvLayout;

use super::any::AnyBackend;
use super::cpu::CpuBackend;
use super::op_profile::{OpClass, OpSample};
use super::{
    graph_plan, Backend, GraphKey, GraphPhase, LinearDims, LoraBatch, LoraLoad, LoraSite,
    PagePlace, StepLayout,
};
use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::Result;
use crate::ids::LayerIdx;

/// A point in a backend's own timeline, taken between ops.
pub trait OpClock {
    type Mark: Send;
    /// Marks the point after every op queued so far (on a stream: records an event on it).
    fn mark(&mut self) -> Self::Mark;
    /// µs from `start` to `end`, once the work before `end` is done (waits for it).
    fn elapsed_us(start: &Self::Mark, end: &Self::Mark) -> Result<f64>;
}

impl OpClock for CpuBackend {
    type Mark = Instant;
    fn mark(&mut self) -> Instant {
        Instant::now()
    }
    fn elapsed_us(start: &Instant, end: &Instant) -> Result<f64> {
        Ok(end.saturating_duration_since(*start).as_secs_f64() * 1e6)
    }
}

/// A mark of [`AnyBackend`]: the wall clock on the CPU backend, an event on the CUDA one.
pub enum AnyMark {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Device(<super::cuda::CudaBackend as OpClock>::Mark),
}

impl OpClock for AnyBackend {
    type Mark = AnyMark;
    fn mark(&mut self) -> AnyMark {
        match self {
            AnyBackend::Cpu(_) => AnyMark::Host(Instant::now()),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(g) => AnyMark::Device(g.mark()),
            #[cfg(not(feature = "cuda"))]
            AnyBackend::Cuda(g) => match **g {},
        }
    }
    fn elapsed_us(start: &AnyMark, end: &AnyMark) -> Result<f64> {
        match (start, end) {
            (AnyMark::Host(a), AnyMark::Host(b)) => CpuBackend::elapsed_us(a, b),
            #[cfg(feature = "cuda")]
            (AnyMark::Device(a), AnyMark::Device(b)) => super::cuda::CudaBackend::elapsed_us(a, b),
            #[cfg(feature = "cuda")]
            _ => Err(crate::error::RuntimeError::Backend(
                "op profile: a host mark and a device mark cannot be compared".into(),
            )),
        }
    }
}

/// One timed op as recorded: its class, the marks before and after it, and the host µs its
/// call took.
type Marked<M> = (OpClass, M, M, f64);

/// What a recording profile holds.
struct Recording<M> {
    on: bool,
    marks: Vec<Marked<M>>,
}

/// `B` with its ops timed while a profile records (see the module docs).
pub struct Profiled<B: OpClock> {
    inner: B,
    // A mutex so that a profile is started and read through `&self` (the engine owns its
    // backend and lends it out shared); the ops themselves reach it with `get_mut`, no lock.
    rec: Mutex<Recording<B::Mark>>,
}

impl<B: Backend + OpClock> Profiled<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            rec: Mutex::new(Recording {
                on: false,
                marks: Vec::new(),
            }),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Starts recording: every op from now until [`Profiled::finish`] is timed.
    pub fn start(&self) {
        let mut r = self.rec.lock().unwrap_or_else(PoisonError::into_inner);
        r.on = true;
        r.marks.clear();
    }

    /// Stops recording and returns the ops timed since [`Profiled::start`], in call order
    /// (waits for the device to reach the last mark). Each sample's gap is measured from the
    /// previous op's end mark to its start mark (0 for the first).
    pub fn finish(&self) -> Result<Vec<OpSample>> {
        let marks = {
            let mut r = self.rec.lock().unwrap_or_else(PoisonError::into_inner);
            r.on = false;
            std::mem::take(&mut r.marks)
        };
        let mut prev: Option<&B::Mark> = None;
        marks
            .iter()
            .map(|(class, a, b, host_us)| {
                let gap_us = match prev {
                    Some(p) => B::elapsed_us(p, a)?,
                    None => 0.0,
                };
                prev = Some(b);
                Ok(OpSample {
                    class: *class,
                    us: B::elapsed_us(a, b)?,
                    host_us: *host_us,
                    gap_us,
                })
            })
            .collect()
    }

    fn recording(&mut self) -> bool {
        self.rec
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .on
    }

    /// Runs `f` on the wrapped backend, between two marks while recording.
    fn timed<R>(&mut self, class: OpClass, f: impl FnOnce(&mut B) -> R) -> R {
        if !self.recording() {
            return f(&mut self.inner);
        }
        let a = self.inner.mark();
        let t0 = Instant::now();
        let r = f(&mut self.inner);
        let host_us = t0.elapsed().as_secs_f64() * 1e6;
        let b = self.inner.mark();
        let rec = self.rec.get_mut().unwrap_or_else(PoisonError::into_inner);
        rec.marks.push((class, a, b, host_us));
        r
    }
}

impl<B: Backend + OpClock> Backend for Profiled<B> {
    type Buf = B::Buf;
    type Linear = B::Linear;
    type Vector = B::Vector;
    type Lora = B::Lora;
    type KvLayer = B::KvLayer;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        self.inner.alloc(len)
    }
    fn upload_linear(
        &self,
        w: Vec<f32>,
        d_out: usize,
        d_in: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<Self::Linear> {
        self.inner.upload_linear(w, d_out, d_in, bias)
    }
    fn upload_weight(
        &self,
        w: thaw_kernels::cpu::WeightMatrix,
        bias: Option<Vec<f32>>,
    ) -> Result<Self::Linear> {
        self.inner.upload_weight(w, bias)
    }
    fn upload_weight_group(
        &self,
        ws: Vec<(thaw_kernels::cpu::WeightMatrix, Option<Vec<f32>>)>,
    ) -> Result<Vec<Self::Linear>> {
        self.inner.upload_weight_group(ws)
    }
    fn upload_vector(&self, v: Vec<f32>) -> Result<Self::Vector> {
        self.inner.upload_vector(v)
    }
    fn upload_lora(&self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora> {
        self.inner.upload_lora(adapter)
    }
    fn stream_lora(&mut self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora> {
        self.inner.stream_lora(adapter)
    }
    fn prefetch_lora(&mut self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora> {
        self.inner.prefetch_lora(adapter)
    }
    fn promote_lora(&mut self, lora: &Self::Lora) {
        self.inner.promote_lora(lora)
    }
    fn landed_layers(&self, lora: &Self::Lora) -> usize {
        self.inner.landed_layers(lora)
    }
    fn lora_failure(&self, lora: &Self::Lora) -> Option<String> {
        self.inner.lora_failure(lora)
    }
    fn lora_pages(&self, adapter: &LoraAdapter, layout: KvLayout) -> Option<usize> {
        self.inner.lora_pages(adapter, layout)
    }
    fn load_lora_paged(
        &mut self,
        adapter: std::sync::Arc<LoraAdapter>,
        load: LoraLoad,
        place: PagePlace<'_, Self::KvLayer>,
    ) -> Result<Self::Lora> {
        self.inner.load_lora_paged(adapter, load, place)
    }
    fn stage_lora(&mut self, adapter: &std::sync::Arc<LoraAdapter>, layout: KvLayout) -> usize {
        self.inner.stage_lora(adapter, layout)
    }
    fn rebind_lora(
        &mut self,
        old: &std::sync::Arc<LoraAdapter>,
        new: &std::sync::Arc<LoraAdapter>,
    ) {
        self.inner.rebind_lora(old, new)
    }
    fn upload_arena(&self) -> Option<crate::upload::ArenaUsage> {
        self.inner.upload_arena()
    }
    fn lora_dtype(&self) -> Option<crate::adapter::WeightDtype> {
        self.inner.lora_dtype()
    }
    fn kv_elem_bytes(&self) -> usize {
        self.inner.kv_elem_bytes()
    }
    fn alloc_kv_layer(&self, layout: KvLayout, num_blocks: usize) -> Result<Self::KvLayer> {
        self.inner.alloc_kv_layer(layout, num_blocks)
    }

    fn embed(&mut self, table: &Self::Linear, ids: &[u32], out: &mut Self::Buf) {
        self.timed(OpClass::Embed, |b| b.embed(table, ids, out))
    }
    fn rms_norm(
        &mut self,
        x: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) {
        self.timed(OpClass::RmsNorm, |b| b.rms_norm(x, w, eps, rows, out))
    }
    fn residual_norm(
        &mut self,
        h: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) {
        self.timed(OpClass::RmsNorm, |b| b.residual_norm(h, w, eps, rows, out))
    }
    fn residual_add(&mut self, h: &mut Self::Buf, x: &Self::Buf, len: usize) {
        self.timed(OpClass::ResidualAdd, |b| b.residual_add(h, x, len))
    }
    fn gather_residual(
        &mut self,
        h: &Self::Buf,
        width: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) {
        self.timed(OpClass::Gather, |b| b.gather_residual(h, width, rows, out))
    }
    fn linear(&mut self, x: &Self::Buf, w: &Self::Linear, rows: usize, out: &mut Self::Buf) {
        self.timed(OpClass::LinearOther, |b| b.linear(x, w, rows, out))
    }
    fn linear_group<const N: usize>(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; N],
        rows: usize,
        outs: [&mut Self::Buf; N],
    ) {
        if !self.recording() {
            return self.inner.linear_group(x, ws, rows, outs);
        }
        for (w, o) in ws.into_iter().zip(outs) {
            self.linear(x, w, rows, o);
        }
    }
    fn linear_group_lora<const N: usize>(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; N],
        rows: usize,
        mut outs: [&mut Self::Buf; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, Self::Lora>,
    ) {
        if !self.recording() {
            return self
                .inner
                .linear_group_lora(x, ws, rows, outs, sites, batch);
        }
        for ((w, o), s) in ws.into_iter().zip(outs.iter_mut()).zip(&sites) {
            let o: &mut Self::Buf = o;
            self.timed(OpClass::Linear(s.module), |b| b.linear(x, w, rows, o));
        }
        super::lora_sites(self, x, outs, sites, batch);
    }
    fn lora(
        &mut self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, Self::Lora>,
    ) {
        self.timed(OpClass::Lora, |b| b.lora(x, y, dims, at, batch))
    }
    fn rope(&mut self, x: &mut Self::Buf, positions: &[usize], n_heads: usize) {
        self.timed(OpClass::Rope, |b| b.rope(x, positions, n_heads))
    }
    /// Timed as one attention op where the backend folds RoPE into it; as the three ops,
    /// each timed, where it does not.
    fn rope_attention(
        &mut self,
        (q, k, v): (&mut Self::Buf, &mut Self::Buf, &Self::Buf),
        heads: (usize, usize),
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Self::Buf,
    ) {
        if !self.inner.folds_rope() {
            return super::rope_then_attention(self, (q, k, v), heads, kv, step, out);
        }
        self.timed(OpClass::Attention, |b| {
            b.rope_attention((q, k, v), heads, kv, step, out)
        })
    }
    fn folds_rope(&self) -> bool {
        self.inner.folds_rope()
    }
    /// Timed as one op where the backend runs it as one (CUDA with `THAW_CUDA_BF16_ACT=1`);
    /// as the products and `rope_attention`, each timed, where it does not.
    fn qkv_attention(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; 3],
        qkv: [&mut Self::Buf; 3],
        sites: [LoraSite; 3],
        batch: &LoraBatch<'_, Self::Lora>,
        heads: (usize, usize),
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Self::Buf,
    ) {
        if !self.recording() {
            return (self.inner).qkv_attention(x, ws, qkv, sites, batch, heads, kv, step, out);
        }
        if !self.inner.fuses_qkv_attention() {
            return super::qkv_then_rope_attention(
                self, x, ws, qkv, sites, batch, heads, kv, step, out,
            );
        }
        self.timed(OpClass::QkvAttention, |b| {
            b.qkv_attention(x, ws, qkv, sites, batch, heads, kv, step, out)
        })
    }
    fn fuses_qkv_attention(&self) -> bool {
        self.inner.fuses_qkv_attention()
    }
    fn attention(
        &mut self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Self::Buf,
    ) {
        self.timed(OpClass::Attention, |b| b.attention(q, k, v, kv, step, out))
    }
    fn add_rms_norm(
        &mut self,
        residual: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        width: usize,
        out: &mut Self::Buf,
    ) {
        self.timed(OpClass::AddRmsNorm, |b| {
            b.add_rms_norm(residual, x, w, eps, rows, width, out)
        })
    }
    fn gated_mlp_in(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; 2],
        rows: usize,
        outs: [&mut Self::Buf; 2],
        sites: [LoraSite; 2],
        batch: &LoraBatch<'_, Self::Lora>,
        act: &mut Self::Buf,
    ) {
        if !self.recording() {
            return self
                .inner
                .gated_mlp_in(x, ws, rows, outs, sites, batch, act);
        }
        if !self.inner.fuses_gated_mlp() {
            return super::gate_up_then_swiglu(self, x, ws, rows, outs, sites, batch, act);
        }
        self.timed(OpClass::GatedMlp, |b| {
            b.gated_mlp_in(x, ws, rows, outs, sites, batch, act)
        })
    }
    fn fuses_gated_mlp(&self) -> bool {
        self.inner.fuses_gated_mlp()
    }
    fn swiglu(&mut self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf) {
        self.timed(OpClass::Swiglu, |b| b.swiglu(gate, up, len, out))
    }
    fn add(&mut self, y: &mut Self::Buf, x: &Self::Buf, len: usize) {
        self.timed(OpClass::ResidualAdd, |b| b.add(y, x, len))
    }
    fn gather_rows(&mut self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf) {
        self.timed(OpClass::Gather, |b| b.gather_rows(x, width, rows, out))
    }
    fn export_rows(
        &mut self,
        x: &Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    ) {
        self.timed(OpClass::Assist, |b| {
            b.export_rows(x, width, rows, dst, stride)
        })
    }
    fn merge_rows(
        &mut self,
        y: &mut Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    ) {
        self.timed(OpClass::Assist, |b| {
            b.merge_rows(y, width, rows, src, stride)
        })
    }
    fn logits(&mut self, x: &Self::Buf, lm_head: &Self::Linear, rows: usize, out: &mut Vec<f32>) {
        self.timed(OpClass::LmHeadLogits, |b| b.logits(x, lm_head, rows, out))
    }
    fn greedy_ids(
        &mut self,
        x: &Self::Buf,
        lm_head: &Self::Linear,
        rows: usize,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
    ) {
        self.timed(OpClass::LmHeadIds, |b| {
            b.greedy_ids(x, lm_head, rows, scratch, ids)
        })
    }
    fn set_cpu_assist(&mut self, in_flight: bool) {
        self.inner.set_cpu_assist(in_flight)
    }
    fn step_running(&mut self, running: bool) {
        self.inner.step_running(running)
    }
    unsafe fn map_assist_exchange(&mut self, ex: &thaw_ipc::Exchange) -> Result<bool> {
        // SAFETY: our caller promised that `ex` stays mapped until `unmap_assist_exchange` or
        // until this backend (and with it `inner`) is dropped; both reach `inner` as they
        // reach us.
        unsafe { self.inner.map_assist_exchange(ex) }
    }
    fn unmap_assist_exchange(&mut self) {
        self.inner.unmap_assist_exchange()
    }
    fn export_rows_device(
        &mut self,
        x: &Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        seq: thaw_ipc::StepSeq,
    ) -> Result<()> {
        self.timed(OpClass::Assist, |b| {
            b.export_rows_device(x, width, rows, seq)
        })
    }
    fn wait_workers_device(
        &mut self,
        seq: thaw_ipc::StepSeq,
        workers: &[thaw_ipc::WorkerId],
    ) -> Result<()> {
        self.timed(OpClass::Assist, |b| b.wait_workers_device(seq, workers))
    }
    fn supports_graphs(&self) -> bool {
        self.inner.supports_graphs()
    }
    fn graph_begin(
        &mut self,
        key: GraphKey,
        step: &StepLayout,
        lora: &LoraBatch<'_, Self::Lora>,
        sizing: &graph_plan::GraphSizing,
    ) -> Result<Option<GraphPhase>> {
        self.inner.graph_begin(key, step, lora, sizing)
    }
    fn graph_end(&mut self, out: &mut Vec<f32>, rows: usize) -> Result<bool> {
        self.inner.graph_end(out, rows)
    }
    fn graph_end_ids(
        &mut self,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        rows: usize,
    ) -> Result<bool> {
        self.inner.graph_end_ids(scratch, ids, rows)
    }
    fn graph_reset(&mut self) {
        self.inner.graph_reset()
    }
    fn merge_rows_device(
        &mut self,
        y: &mut Self::Buf,
        width: usize,
        module: LoraModule,
        rows: &[Range<usize>],
        first: usize,
    ) -> Result<()> {
        self.timed(OpClass::Assist, |b| {
            b.merge_rows_device(y, width, module, rows, first)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_values;
    use crate::model::ModelConfig;

    fn config() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_attention_heads":4,
            "num_key_value_heads":2,"num_hidden_layers":1,"vocab_size":32}"#,
        )
        .unwrap()
    }

    /// Recording splits a q/k/v group into one timed linear per module and gives the
    /// products the wrapped backend gives; outside a recording nothing is timed.
    #[test]
    fn records_one_linear_per_module_and_computes_the_same() {
        let c = config();
        let mut vals = test_values(7);
        let mut plain = CpuBackend::new(&c);
        let mut prof = Profiled::new(CpuBackend::new(&c));
        let (rows, d_in, d_out) = (3, 64, 16);
        let ws: Vec<_> = (0..3)
            .map(|_| {
                plain
                    .upload_linear(vals(d_out * d_in), d_out, d_in, None)
                    .unwrap()
            })
            .collect();
        let x = vals(rows * d_in);
        let [mut a0, mut a1, mut a2, mut b0, mut b1, mut b2] =
            std::array::from_fn(|_| vec![0.0f32; rows * d_out]);
        let w3 = [&ws[0], &ws[1], &ws[2]];
        plain.linear_group(&x, w3, rows, [&mut a0, &mut a1, &mut a2]);
        prof.linear_group(&x, w3, rows, [&mut b0, &mut b1, &mut b2]);
        assert!(prof.finish().unwrap().is_empty(), "nothing timed when off");
        assert_eq!([&a0, &a1, &a2], [&b0, &b1, &b2]);
        prof.start();
        let sites = [LoraModule::Q, LoraModule::K, LoraModule::V].map(|module| LoraSite {
            layer: LayerIdx(0),
            module,
            dims: LinearDims { d_in, d_out },
        });
        let none: Vec<&<CpuBackend as Backend>::Lora> = Vec::new();
        let layout = super::super::LoraLayout::default();
        let batch = LoraBatch {
            kernel: Default::default(),
            layout: &layout,
            adapters: &none,
            landed: &[],
        };
        let outs = [&mut b0, &mut b1, &mut b2];
        prof.linear_group_lora(&x, w3, rows, outs, sites, &batch);
        let s = prof.finish().unwrap();
        let classes: Vec<OpClass> = s.iter().map(|s| s.class).collect();
        assert_eq!(
            classes,
            [LoraModule::Q, LoraModule::K, LoraModule::V].map(OpClass::Linear),
            "no adapter rows: no lora op"
        );
        assert!(s.iter().all(|s| s.us.is_finite() && s.us >= 0.0));
        // On the CPU both clocks are the wall clock: the host call lies inside its marks, the
        // first op has no gap before it, and the others' gaps are the time between marks.
        assert!(s
            .iter()
            .all(|s| s.host_us >= 0.0 && s.host_us <= s.us + 1e-3));
        assert_eq!(s[0].gap_us, 0.0);
        assert!(s.iter().all(|s| s.gap_us.is_finite() && s.gap_us >= 0.0));
        assert_eq!([&a0, &a1, &a2], [&b0, &b1, &b2]);
        assert!(
            prof.finish().unwrap().is_empty(),
            "finish stops the recording"
        );
    }

    /// A backend that runs `gated_mlp_in` as its two ops (the CPU) is timed per op: gate, up,
    /// SwiGLU; the result is the wrapped backend's.
    #[test]
    fn an_unfused_gated_mlp_is_timed_as_its_ops() {
        let c = config();
        let mut vals = test_values(11);
        let mut plain = CpuBackend::new(&c);
        let mut prof = Profiled::new(CpuBackend::new(&c));
        assert!(!prof.fuses_gated_mlp());
        let (rows, d_in, inter) = (2, 64, 128);
        let ws: Vec<_> = (0..2)
            .map(|_| (plain.upload_linear(vals(inter * d_in), inter, d_in, None)).unwrap())
            .collect();
        let x = vals(rows * d_in);
        let sites = [LoraModule::Gate, LoraModule::Up].map(|module| LoraSite {
            layer: LayerIdx(0),
            module,
            dims: LinearDims { d_in, d_out: inter },
        });
        let none: Vec<&<CpuBackend as Backend>::Lora> = Vec::new();
        let layout = super::super::LoraLayout::default();
        let batch = LoraBatch {
            kernel: Default::default(),
            layout: &layout,
            adapters: &none,
            landed: &[],
        };
        let [mut g0, mut u0, mut a0, mut g1, mut u1, mut a1] =
            std::array::from_fn(|_| vec![0.0f32; rows * inter]);
        let w2 = [&ws[0], &ws[1]];
        plain.gated_mlp_in(&x, w2, rows, [&mut g0, &mut u0], sites, &batch, &mut a0);
        prof.start();
        prof.gated_mlp_in(&x, w2, rows, [&mut g1, &mut u1], sites, &batch, &mut a1);
        let classes: Vec<OpClass> = prof.finish().unwrap().iter().map(|s| s.class).collect();
        assert_eq!(
            classes,
            [
                OpClass::Linear(LoraModule::Gate),
                OpClass::Linear(LoraModule::Up),
                OpClass::Swiglu
            ]
        );
        assert_eq!(a0, a1);
        assert!(a0.iter().any(|&v| v != 0.0));
    }
}
