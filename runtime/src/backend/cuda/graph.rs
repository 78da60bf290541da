//! CUDA graphs for decode steps (issue 29): capture per (batch-size bucket, LoRA rank class),
//! replay, and the persistent metadata buffer the captured kernels read. What runs as a graph,
//! the padding and the buffer's layout are `backend::graph_plan` (pure, tested on the CPU);
//! this file only copies, captures and launches.
//!
//! A graph step: [`CudaBackend::try_graph_begin`] writes the padded step's metadata (token ids,
//! positions, KV slots, decode rows, block tables, BGMV row tables, logit rows) into one host
//! buffer and copies the words it uses to the one device buffer every graph reads, with one
//! async copy on the compute stream. Then, by the key's phase:
//! - warm-up: the engine's forward runs eagerly, its ops reading that buffer (first-use work
//!   — cuBLAS heuristics, lazily loaded kernels — happens outside any capture);
//! - capture: the stream is captured (thread-local mode: the copy thread's CUDA calls go on)
//!   while the forward runs; [`CudaBackend::try_graph_end`] instantiates and launches it;
//! - replay: the graph is launched; no op of the forward runs on the host.
//!
//! Inside a graph the ops take fixed shapes: `bucket` rows, the classic decode attention
//! (flash-decoding picks its split count from the step's context lengths on the host, so it
//! stays eager-only) or, with `THAW_CUDA_ATTN_OCCUPANCY=1`, `attention_split_ilp.cu` with a
//! split count fixed per bucket (each row uses the splits its context allows, the others
//! write a neutral partial; its scratch is allocated once at its largest), and BGMV for LoRA with the key's rank class (the kernels read each
//! row's rank and descriptor from device memory). With `THAW_CUDA_BF16_ACT=1` the MLP's
//! gate/up and SwiGLU run 16-bit inside a graph whose key has no LoRA rank class (`act16_plan`
//! reads only the key there; a key with one keeps f32: its gate/up deltas on the 16-bit path
//! would move more bytes than f32); so do the attention's q/k/v products and RoPE
//! (`attn16_plan`, the same rule). Scratch buffers the graph writes (the 16-bit activation
//! copy, the 16-bit gate/up and q/k/v products, the LoRA intermediate, the logits) are
//! reserved at their largest before the first capture; a captured graph records their
//! addresses and those of the KV cache, and is dropped (recaptured on its next use) if any of
//! them moved since.
use std::collections::HashMap;
use std::sync::atomic::Ordering;

use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaView};

use super::launch::AttnShape;
use super::weights::{CudaLinear, CudaLora};
use super::wide::FoldShape;
use super::{CudaBackend, CudaError, CudaKvLayer};
use crate::adapter::LoraModule;
use crate::backend::graph_plan::{
    after_phase, next_phase, GraphKey, GraphMetaLayout, GraphPhase, GraphSizing, KeyState,
};
use crate::backend::step_meta::{AttnHost, LoraHost};
use crate::backend::{LinearDims, LoraBatch, StepLayout};
use crate::ids::LayerIdx;
use thaw_kernels::cuda::registry::{shape, DType};

/// A captured, instantiated graph.
struct SendGraph(CudaGraph);

// SAFETY: a CUDA graph and its executable may be used from any thread as long as calls on them
// are serialised (CUDA's graph thread-safety rules); this one is owned by one `CudaBackend`,
// whose every use takes `&mut self`, so no two threads touch it at once.
unsafe impl Send for SendGraph {}

/// Addresses a captured graph baked in that the backend may reallocate: the 16-bit activation
/// copy, the LoRA intermediate, the logits buffer, the KV allocation count, and the grouped
/// product's scratch (`group.rs`), the occupancy decode's scratch (`attn_occupancy.rs`), the
/// 16-bit gate and up products (`act16.rs`) and q/k/v products (`attn16.rs`), 0 with their
/// switch off.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Fingerprint([u64; 11]);

/// The step being run as a graph.
#[derive(Copy, Clone, Debug)]
pub(super) struct Active {
    pub key: GraphKey,
    pub phase: GraphPhase,
    pub layout: GraphMetaLayout,
}

/// Every graph of one backend and the buffer they read.
#[derive(Default)]
pub(super) struct Graphs {
    sizing: Option<GraphSizing>,
    meta_host: Vec<u32>,
    meta_dev: Option<CudaSlice<u32>>,
    attn: AttnHost,
    lora: LoraHost,
    states: HashMap<GraphKey, KeyState>,
    captured: HashMap<GraphKey, (SendGraph, Fingerprint)>,
    /// Logits per row, seen by the last graph-mode logits op (a replay runs none).
    pub(super) vocab: usize,
    pub active: Option<Active>,
}

impl Graphs {
    /// The step being run as a graph, if any.
    pub fn active(&self) -> Option<Active> {
        self.active
    }

    /// The persistent metadata buffer (allocated by the first graph step).
    pub(super) fn meta(&self) -> Result<&CudaSlice<u32>, CudaError> {
        self.meta_dev
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("graph metadata used before it was set".into()))
    }
}

impl CudaBackend {
    fn fingerprint(&self) -> Fingerprint {
        let p = |o: Option<u64>| o.unwrap_or(0);
        Fingerprint([
            p(self.x16.as_ref().map(|b| self.gpu.p(b))),
            p(self.lora_v.as_ref().map(|b| self.gpu.p(b))),
            p(self.logits_dev.as_ref().map(|b| self.gpu.p(b))),
            self.kv_allocs.load(Ordering::Relaxed),
            p(self.group_out.as_ref().map(|b| self.gpu.p(b))),
            p(self
                .gpu
                .occupancy
                .as_ref()
                .map(|o| o.scratch_addr(&self.gpu))),
            self.act16_addrs()[0],
            self.act16_addrs()[1],
            self.attn16_addrs()[0],
            self.attn16_addrs()[1],
            self.attn16_addrs()[2],
        ])
    }

    /// Sizes the graphs' buffers for `sizing` (once; again, dropping every graph, if it
    /// changed) and reserves the scratch buffers at their largest.
    fn graph_prepare(&mut self, sizing: &GraphSizing) -> Result<(), CudaError> {
        if self.graphs.sizing.as_ref() == Some(sizing) {
            return Ok(());
        }
        self.graph_drop_all();
        let s = &self.gpu;
        self.graphs.meta_host = vec![0; sizing.meta.len];
        self.graphs.meta_dev = Some(s.alloc_zeros::<u32>(sizing.meta.len.max(1))?);
        if self.gpu.weight_dtype != DType::F32
            && self.x16.as_ref().is_none_or(|b| b.len() < sizing.x_elems)
        {
            self.x16 = Some(s.alloc_zeros::<u16>(sizing.x_elems.max(1))?);
        }
        if self
            .lora_v
            .as_ref()
            .is_none_or(|b| b.len() < sizing.lora_v_elems)
        {
            self.lora_v = Some(s.alloc_zeros::<f32>(sizing.lora_v_elems.max(1))?);
        }
        if self
            .logits_dev
            .as_ref()
            .is_none_or(|b| b.len() < sizing.logit_elems)
        {
            self.logits_dev = Some(s.alloc_zeros::<f32>(sizing.logit_elems.max(1))?);
        }
        self.graphs.sizing = Some(sizing.clone());
        Ok(())
    }

    /// Drops every graph and forgets every key's lifecycle.
    pub(super) fn graph_drop_all(&mut self) {
        self.graphs.captured.clear();
        self.graphs.states.clear();
        self.graphs.active = None;
    }

    /// [`Backend::graph_begin`](crate::backend::Backend::graph_begin) on the CUDA backend.
    pub(super) fn try_graph_begin(
        &mut self,
        key: GraphKey,
        step: &StepLayout,
        lora: &LoraBatch<'_, CudaLora>,
        sizing: &GraphSizing,
    ) -> Result<Option<GraphPhase>, CudaError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.graphs.active = None;
        self.graph_prepare(sizing)?;
        // With THAW_CUDA_BF16_ACT=1 the MLP runs 16-bit in graphs too: its products' scratch
        // at the largest step before any capture (switched on after `graph_prepare` included).
        self.act16_reserve(sizing.x_elems)?;
        // And the attention's 16-bit q/k/v (`attn16.rs`; x_elems covers rows × q_dim).
        self.attn16_reserve(sizing.x_elems)?;
        if self.graphs.states.get(&key) == Some(&KeyState::Captured) {
            let fp = self.fingerprint();
            if self.graphs.captured.get(&key).is_none_or(|(_, f)| *f != fp) {
                // A buffer it writes moved (an eager step outgrew a reservation, or the KV
                // cache was reallocated): capture again, on the buffers as they are now.
                tracing::debug!(bucket = key.bucket, "CUDA graph buffers moved; recapturing");
                self.graphs.captured.remove(&key);
                self.graphs.states.insert(key, KeyState::WarmedUp);
            }
        }
        let Some(phase) = next_phase(self.graphs.states.get(&key).copied()) else {
            return Ok(None);
        };
        // Eager steps after this one rebuild their own metadata.
        self.begin_step();
        // The metadata, as the eager path would build it, into the one persistent buffer.
        let g = &mut self.graphs;
        g.attn
            .build(step, sizing.block_size, sizing.num_blocks, shape::PREFILL_Q);
        g.lora
            .build(lora.layout, |i| Some(lora.adapters[i as usize].table_addr));
        let layout = sizing.meta;
        let used = layout
            .fill(step, &g.attn, &g.lora, &mut g.meta_host)
            .map_err(|e| CudaError::Unsupported(format!("CUDA graph step: {e}")))?;
        let dev = g.meta_dev.as_mut().expect("allocated by graph_prepare");
        // Pageable source: the copy has read it when the call returns, so the next step may
        // rewrite it; on the device it is ordered before this step's kernels (one stream).
        (self.gpu).htod(&g.meta_host[..used], &mut dev.slice_mut(..used))?;
        g.active = Some(Active { key, phase, layout });
        match phase {
            GraphPhase::Warmup => {}
            GraphPhase::Replay => {
                let (graph, _) = g.captured.get(&key).expect("a captured key has its graph");
                self.gpu.counters.graph_launch();
                graph.0.launch()?;
            }
            GraphPhase::Capture => {
                // Thread-local: only this thread's unsafe calls would break the capture; the
                // upload pipeline's copy thread keeps using its own stream meanwhile.
                self.gpu
                    .stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            }
        }
        Ok(Some(phase))
    }

    /// [`Backend::graph_end`](crate::backend::Backend::graph_end) on the CUDA backend.
    pub(super) fn try_graph_end(
        &mut self,
        out: &mut Vec<f32>,
        rows: usize,
    ) -> Result<bool, CudaError> {
        if !self.try_graph_finish()? {
            return Ok(false);
        }
        let n = rows * self.graphs.vocab;
        out.resize(n, 0.0);
        if n > 0 {
            let dev = self.logits_dev.as_ref().expect("reserved by graph_prepare");
            self.gpu.dtoh(&dev.slice(..n), &mut out[..])?;
        }
        self.gpu.sync()?;
        Ok(true)
    }

    /// The graph half of ending a graph step: launches a graph just captured and records the
    /// key's state. `false` when the capture failed (the engine reruns the step eagerly);
    /// `true` once the step's work, ending in the LM head into the logits buffer, is queued.
    pub(super) fn try_graph_finish(&mut self) -> Result<bool, CudaError> {
        let Some(a) = self.graphs.active.take() else {
            return Err(CudaError::Unsupported(
                "graph_end without a graph step in progress".into(),
            ));
        };
        match a.phase {
            GraphPhase::Capture => {
                let fp = self.fingerprint();
                let captured = self
                    .gpu
                    .stream
                    .end_capture(sys::CUgraphInstantiate_flags(0));
                let op_error = self.error.take();
                match (captured, op_error) {
                    (Ok(Some(graph)), None) => {
                        self.gpu.counters.graph_launch();
                        graph.launch()?;
                        self.graphs.captured.insert(a.key, (SendGraph(graph), fp));
                        self.graphs.states.insert(a.key, after_phase(a.phase, true));
                    }
                    (r, e) => {
                        let why = match (&r, &e) {
                            (_, Some(e)) => e.to_string(),
                            (Err(e), None) => e.to_string(),
                            (Ok(_), None) => "the capture recorded nothing".into(),
                        };
                        tracing::warn!(bucket = a.key.bucket, "CUDA graph capture failed: {why}");
                        self.graphs
                            .states
                            .insert(a.key, after_phase(a.phase, false));
                        // The engine reruns the step eagerly on the same metadata.
                        self.graphs.active = Some(Active {
                            phase: GraphPhase::Warmup,
                            ..a
                        });
                        return Ok(false);
                    }
                }
            }
            GraphPhase::Warmup => {
                if self.graphs.states.get(&a.key) != Some(&KeyState::Failed) {
                    self.graphs.states.insert(a.key, after_phase(a.phase, true));
                }
            }
            GraphPhase::Replay => {}
        }
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        Ok(true)
    }

    /// Graph-mode embed: token ids from the persistent buffer.
    pub(super) fn graph_embed(
        &self,
        a: Active,
        table: &CudaLinear,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (l, n) = (a.layout, a.key.bucket);
        let ids = self.graphs.meta()?.slice(l.tokens..l.tokens + n);
        (self.gpu).embed_residual(&table.w.view(), &ids, out, n, table.d_in)
    }

    /// Graph-mode RoPE: positions from the persistent buffer.
    pub(super) fn graph_rope(
        &self,
        a: Active,
        x: &mut CudaSlice<f32>,
        n_heads: usize,
    ) -> Result<(), CudaError> {
        let (l, n) = (a.layout, a.key.bucket);
        let pos = self.graphs.meta()?.slice(l.positions..l.positions + n);
        match (self.gpu).rope_wide(x, &pos, &self.inv_freq, (n, n_heads, self.head_dim)) {
            Ok(false) => (self.gpu).rope(x, &pos, &self.inv_freq, n, n_heads, self.head_dim),
            r => r.map(drop),
        }
    }

    /// Graph-mode attention with RoPE folded into the KV write (`wide.rs`): positions, slots,
    /// block tables and decode rows from the persistent buffer.
    pub(super) fn graph_rope_attention(
        &self,
        a: Active,
        (q, k, v): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &CudaSlice<f32>),
        kv: &mut CudaKvLayer,
        out: &mut CudaSlice<f32>,
        s: AttnShape,
        fold: FoldShape,
    ) -> Result<(), CudaError> {
        let (l, n) = (a.layout, a.key.bucket);
        let meta = self.graphs.meta()?;
        let slots = meta.slice(l.slots..l.slots + n);
        let pos = meta.slice(l.positions..l.positions + n);
        let tables = meta.slice(l.tables..l.len);
        let decode = meta.slice(l.decode..l.decode + 3 * n);
        let fold = FoldShape { rows: n, ..fold };
        let caches = (&mut kv.k, &mut kv.v);
        (self.gpu).write_kv_rope(
            (&mut *q, &mut *k, v),
            caches,
            &slots,
            &pos,
            &self.inv_freq,
            fold,
        )?;
        self.graph_decode(q, kv, out.into(), (&tables, &decode), n, s)
    }

    /// A graph's decode attention: the occupancy kernels if switched on (splits fixed for the
    /// bucket), else `attention.cu`'s (one launch shape for any context length).
    pub(super) fn graph_decode(
        &self,
        q: &CudaSlice<f32>,
        kv: &CudaKvLayer,
        out: super::attn_out::AttnOut<'_>,
        meta: (&CudaView<'_, u32>, &CudaView<'_, u32>),
        n: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        if self.gpu.occupancy.is_some() {
            let caches = (&kv.k, &kv.v);
            return (self.gpu).attn_decode_occupancy_graph(q, caches, out, meta, n, s);
        }
        (self.gpu).attn_decode(q, &kv.k, &kv.v, out, meta.0, meta.1, n, s)
    }

    /// Graph-mode attention: KV slots, block tables and decode rows from the persistent buffer;
    /// the classic decode kernel (one launch shape for any context length).
    pub(super) fn graph_attention(
        &self,
        a: Active,
        (q, k, v): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        kv: &mut CudaKvLayer,
        out: &mut CudaSlice<f32>,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let (l, n) = (a.layout, a.key.bucket);
        let meta = self.graphs.meta()?;
        let slots = meta.slice(l.slots..l.slots + n);
        let tables = meta.slice(l.tables..l.len);
        let decode = meta.slice(l.decode..l.decode + 3 * n);
        let tl = kv.layout.token_len();
        (self.gpu).write_kv(k, v, &mut kv.k, &mut kv.v, &slots, n, tl)?;
        self.graph_decode(q, kv, out.into(), (&tables, &decode), n, s)
    }

    /// Graph-mode LoRA: BGMV over every row with the key's rank class; rows without an
    /// adapter, or whose adapter does not target this module, get nothing.
    pub(super) fn graph_lora(
        &mut self,
        a: Active,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
    ) -> Result<(), CudaError> {
        let (l, n, rank) = (a.layout, a.key.bucket, a.key.lora_rank);
        if rank == 0 {
            return Ok(());
        }
        let meta = self
            .graphs
            .meta_dev
            .as_ref()
            .expect("allocated by graph_prepare");
        // SAFETY: the region holds `2 · bucket` u32 written as little-endian halves of `bucket`
        // u64 (GraphMetaLayout::fill), starts at word 0 of a 256-byte aligned allocation
        // (`row_tables` is 0, so 8-byte aligned), and every bit pattern is a valid u64.
        let tables = unsafe {
            meta.slice(l.row_tables..l.row_tables + 2 * n)
                .transmute::<u64>(n)
        }
        .ok_or_else(|| CudaError::Unsupported("graph row tables out of range".into()))?;
        let v = self.lora_v.as_mut().expect("reserved by graph_prepare");
        if v.len() < n * rank {
            return Err(CudaError::Unsupported(format!(
                "the LoRA scratch holds {} f32, a graph of {n} rows at rank {rank} needs {}",
                v.len(),
                n * rank
            )));
        }
        let slot = at.0 .0 * 7 + at.1.index();
        (self.gpu).bgmv(x, y, v, &tables, n, slot, (dims.d_in, dims.d_out, rank))
    }

    /// Graph-mode row gather: the logit rows (every row) from the persistent buffer (with
    /// `h16`, of the 16-bit residual, `residual16.rs`).
    pub(super) fn graph_gather(
        &self,
        a: Active,
        x: &CudaSlice<f32>,
        width: usize,
        out: &mut CudaSlice<f32>,
        h16: bool,
    ) -> Result<(), CudaError> {
        let (l, n) = (a.layout, a.key.bucket);
        let rows = self.graphs.meta()?.slice(l.logit_rows..l.logit_rows + n);
        (self.gpu).gather_rows_as(x, &rows, (n, width), out, h16)
    }

    /// Graph-mode logits: the LM head into the reserved logits buffer; the copy to the host
    /// is `try_graph_end`'s, after the graph ran.
    pub(super) fn graph_logits(
        &mut self,
        a: Active,
        x: &CudaSlice<f32>,
        head: &CudaLinear,
    ) -> Result<(), CudaError> {
        let n = a.key.bucket;
        let mut dev = self.logits_dev.take().expect("reserved by graph_prepare");
        let r = if dev.len() < n * head.d_out {
            Err(CudaError::Unsupported(format!(
                "the logits buffer holds {} f32, a graph of {n} rows needs {}",
                dev.len(),
                n * head.d_out
            )))
        } else {
            self.graphs.vocab = head.d_out;
            self.try_linear(x, head, n, &mut dev)
        };
        self.logits_dev = Some(dev);
        r
    }
}
