//! The CPU backend: `thaw_kernels::cpu` ops over ordinary memory.
//!
//! The base model's products, attention and logits split over a persistent pool of compute
//! threads ([`super::cpu_par`]) while no CPU LoRA assist is in flight; while one is, the
//! engine thread computes alone and the remaining cores belong to the pinned LoRA workers.
//!
//! Weights it keeps are packed into 2 MiB transparent huge pages ([`HugeArena`]): a decode
//! step streams every weight once, and on 4 KiB pages that is a TLB miss and a prefetcher
//! restart every 4 KiB. `THAW_HUGEPAGES=0` keeps them in their loaded `Vec`s (A/B runs).
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use thaw_cpu_lora::kernel::Scratch;
use thaw_kernels::cpu::{self as k, HugeArena, KvLayout, RopeCache, RopeTable, WeightMatrix};

use super::cpu_fused;
use super::cpu_kv::{KvCacheDtype, KvData, Widened};
use super::cpu_lora_rows;
use super::cpu_par::{balance, linear_split, ComputePool, CpuThreads};
use super::{Backend, GraphPhase, LinearDims, LoraBatch, LoraKernel, LoraSite, StepLayout};
use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::Result;
use crate::ids::LayerIdx;
use crate::model::ModelConfig;
use crate::residency::{LinkModel, LoadPriority, LoraSlot};
use crate::upload::{EmulatedLink, ImageLayout, Upload, UploadPipeline};

/// A weight matrix in host memory, in its stored format (f32, f16, bf16 or ggml blocks);
/// products accumulate in f32. `w.matmul_range` computes a slice of output columns, so a
/// product can be split over threads.
#[derive(Clone, Debug)]
pub struct CpuLinear {
    pub w: WeightMatrix,
    pub bias: Option<Vec<f32>>,
    pub d_out: usize,
    pub d_in: usize,
}

/// One layer's paged K and V, in the backend's [`KvCacheDtype`].
#[derive(Clone, Debug)]
pub struct CpuKvLayer {
    pub k: KvData,
    pub v: KvData,
    pub layout: KvLayout,
}

/// The CPU backend for one model shape.
#[derive(Debug)]
pub struct CpuBackend {
    /// Every position's rotation computed once (60 calls a step ask for the same ones).
    rope: RopeCache,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    /// One attention scratch per compute thread, and its widened 16-bit cache rows.
    attn_scratch: Vec<(Vec<f32>, Widened)>,
    /// How K and V are stored ([`CpuBackend::with_kv_cache_dtype`]).
    kv_dtype: KvCacheDtype,
    /// Per step: attention work items (sequence index, its rows) and their grouping.
    attn_items: Vec<(usize, Range<usize>)>,
    attn_bounds: Vec<usize>,
    attn_out_bounds: Vec<usize>,
    par: ComputePool,
    /// Column-split products with several rows land here before they are scattered.
    par_scratch: Vec<f32>,
    /// The shrink the threads of a decode group share (see `cpu_fused`).
    fused_shrink: cpu_fused::Shared,
    /// One LoRA kernel scratch per compute thread (prompt steps split the deltas by rows,
    /// see [`cpu_lora_rows`]; the first is the engine thread's).
    fused: Vec<Scratch>,
    lora_plan: cpu_lora_rows::Plan,
    link: LinkModel,
    /// The upload pipeline, its DMA emulated at `link` (started by the first stream, or at
    /// start-up by [`CpuBackend::with_upload_arena`]).
    upload: Option<UploadPipeline<EmulatedLink>>,
    upload_arena: usize,
    /// Where uploaded weights are packed; `None` with `THAW_HUGEPAGES=0`. A mutex because
    /// uploads take `&self`; only model loading locks it.
    arena: Option<Mutex<HugeArena>>,
    /// Marks a step computing on the host while it runs (see [`Backend::step_running`]).
    step: Option<crate::upload::HostStep>,
    /// Graph emulation ([`CpuBackend::set_graph_emulation`]): the bucket of the graph step in
    /// progress, `Some(0)` between graph steps, `None` when off.
    graph_bucket: Option<usize>,
    /// The 16-bit MLP activations' emulation ([`CpuBackend::set_act16`]); `None` = f32.
    act16: Option<super::Act16Type>,
    /// The 16-bit residual stream's emulation (`cpu_residual16.rs`); `None` = f32.
    residual16: Option<super::Act16Type>,
    /// The emulated graph step's key has a LoRA rank class (what CUDA's act16 plan reads in a
    /// graph).
    graph_lora: bool,
}

/// The cache format a new backend starts with: `THAW_KV_CACHE_DTYPE` (`fp16`, `bf16`; for A/B
/// runs of benches that build their own backends), else f32 (`auto`).
fn kv_dtype_from_env() -> KvCacheDtype {
    let v = std::env::var("THAW_KV_CACHE_DTYPE").unwrap_or_default();
    v.parse().unwrap_or_else(|e| {
        if !v.is_empty() {
            tracing::warn!("THAW_KV_CACHE_DTYPE: {e}; keeping an f32 cache");
        }
        KvCacheDtype::Auto
    })
}

/// Whether weights go to huge pages: unless `THAW_HUGEPAGES` is `0` (read per backend).
fn hugepages_enabled() -> bool {
    !k::switched_off("THAW_HUGEPAGES")
}

impl CpuBackend {
    /// A backend computing on every core this process may run on (see [`CpuThreads`]).
    pub fn new(cfg: &ModelConfig) -> Self {
        let par = ComputePool::new(CpuThreads::default()).unwrap_or_else(|e| {
            tracing::warn!("{e}; computing on one thread");
            ComputePool::serial()
        });
        Self::with_pool(cfg, par)
    }

    /// A backend computing on `threads` (1 = the engine thread alone).
    pub fn with_threads(cfg: &ModelConfig, threads: CpuThreads) -> Result<Self> {
        Ok(Self::with_pool(cfg, ComputePool::new(threads)?))
    }

    fn with_pool(cfg: &ModelConfig, par: ComputePool) -> Self {
        Self {
            rope: RopeCache::new(RopeTable::new(
                cfg.head_dim,
                cfg.rope_theta,
                &cfg.rope_scaling,
            )),
            n_heads: cfg.num_heads,
            n_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            sliding_window: cfg.sliding_window,
            attn_scratch: (0..par.max()).map(|_| Default::default()).collect(),
            fused: (0..par.max()).map(|_| Scratch::new()).collect(),
            kv_dtype: kv_dtype_from_env(),
            attn_items: Vec::new(),
            attn_bounds: Vec::new(),
            attn_out_bounds: Vec::new(),
            par,
            par_scratch: Vec::new(),
            fused_shrink: cpu_fused::Shared::default(),
            lora_plan: Default::default(),
            link: LinkModel::default(),
            upload: None,
            upload_arena: DEFAULT_UPLOAD_ARENA,
            arena: hugepages_enabled().then(|| Mutex::new(HugeArena::new(true))),
            step: None,
            graph_bucket: None,
            act16: None,
            residual16: None,
            graph_lora: false,
        }
    }

    /// Takes part in the engine's CUDA-graph protocol without capturing anything (tests):
    /// every graph step runs eagerly on its padded shape ([`GraphPhase::Warmup`]), so the
    /// engine's padding is checked against unpadded steps where there is no GPU.
    pub fn set_graph_emulation(&mut self, on: bool) {
        self.graph_bucket = on.then_some(0);
    }

    /// Stores K and V as `dtype` (before the engine allocates its cache): 16-bit caches take
    /// half the memory and half the bytes a decode step reads (see [`super::cpu_kv`]).
    pub fn with_kv_cache_dtype(mut self, dtype: KvCacheDtype) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// Rounds the MLP's gate, up and SwiGLU activations (`cpu_act16.rs`), the attention's q, k
    /// and v (`cpu_attn16.rs`) and the residual stream (`cpu_residual16.rs`) to `ty` exactly
    /// where CUDA's `THAW_CUDA_BF16_ACT=1` stores them in 16 bits: the test oracle of that
    /// switch's numerics. `None` (the default, although CUDA's switch is on by default: the CPU
    /// backend is the f32 oracle, and only tests of the 16-bit numerics ask for them): f32.
    /// Switch it between forward passes only (each pass's `embed` rewrites the stream).
    pub fn set_act16(&mut self, ty: Option<super::Act16Type>) {
        self.act16 = ty;
        self.residual16 = ty;
    }

    /// Sets the residual stream's half of [`CpuBackend::set_act16`] alone (after it): tests
    /// that isolate the MLP half's rounding (`set_residual16(None)`) or the residual's.
    pub fn set_residual16(&mut self, ty: Option<super::Act16Type>) {
        self.residual16 = ty;
    }

    /// The type the emulated residual stream is stored in (`None`: f32).
    fn residual16(&self) -> Option<super::Act16Type> {
        super::cpu_residual16::residual16(self.residual16)
    }

    /// While an emulated graph step runs, whether its key has a LoRA rank class; `None`
    /// outside one (what the act16 plan reads in graph mode).
    pub(super) fn act16_graph(&self) -> Option<bool> {
        self.graph_bucket
            .filter(|&b| b > 0)
            .map(|_| self.graph_lora)
    }

    /// How K and V are stored.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_dtype
    }

    /// Sets the emulated host → device link adapters stream over (before the first stream).
    pub fn with_link(mut self, link: LinkModel) -> Self {
        self.link = link;
        self
    }

    /// Allocates the upload arena now, `bytes` of it (`--max-cpu-lora-bytes`), and starts
    /// the pipeline's threads; after [`CpuBackend::with_link`].
    pub fn with_upload_arena(mut self, bytes: usize) -> Result<Self> {
        self.upload_arena = bytes;
        self.upload = Some(self.start_upload()?);
        Ok(self)
    }

    fn start_upload(&self) -> Result<UploadPipeline<EmulatedLink>> {
        UploadPipeline::start(
            EmulatedLink::new(self.link),
            self.upload_arena,
            UPLOAD_LOADERS,
        )
    }

    /// The upload pipeline, if an adapter was streamed (or it was started at start-up).
    pub fn upload(&self) -> Option<&UploadPipeline<EmulatedLink>> {
        self.upload.as_ref()
    }

    /// Bytes a demand load queued now waits behind on the emulated link: demand loads queued
    /// or in flight and the layer of a prefetch in flight (prefetches yield at each layer).
    pub fn link_backlog(&self) -> u64 {
        self.upload
            .as_ref()
            .map_or(0, UploadPipeline::demand_backlog)
    }

    /// Queues `adapter` on the upload pipeline: O(layers) here (its image layout); loader
    /// threads write its bytes into the arena and the copy thread lands its layers.
    fn enqueue(&mut self, adapter: Arc<LoraAdapter>, p: LoadPriority) -> Result<Arc<LoraSlot>> {
        if self.upload.is_none() {
            self.upload = Some(self.start_upload()?);
        }
        let slot = Arc::new(LoraSlot::empty(adapter.clone()));
        let up = Upload {
            layout: ImageLayout::of(&adapter, None),
            adapter,
            dtype: None,
            dst: Arc::new(()),
            landing: slot.clone(),
        };
        self.upload.as_ref().expect("started above").submit(up, p)?;
        Ok(slot)
    }

    pub fn link(&self) -> LinkModel {
        self.link
    }

    /// Threads the next ops split over.
    pub fn compute_threads(&self) -> usize {
        self.par.active()
    }

    /// `outs[i] = x · W_iᵀ + bias_i` for few rows, the concatenated output columns of all the
    /// weights split over the pool at once (one fork/join for the group, equal bytes per
    /// thread). Each part runs `start()`, then computes its columns of each weight into a
    /// packed `[rows, width]` piece of a scratch, adds the bias and runs `then(i, cols, piece)`
    /// on the piece (`cols`: the piece's columns of weight `i`); then the pieces are
    /// scattered to `outs`.
    fn group_split<const N: usize>(
        &mut self,
        x: &[f32],
        ws: [&CpuLinear; N],
        rows: usize,
        mut outs: [&mut Vec<f32>; N],
        start: impl Fn() + Sync,
        then: impl Fn(usize, Range<usize>, &mut [f32]) + Sync,
    ) {
        let k = ws.first().map_or(0, |w| w.d_in);
        let total: usize = ws.iter().map(|w| w.d_out).sum();
        let parts = self.par.parts(rows * k * total);
        let x = &x[..rows * k];
        let scratch = &mut self.par_scratch;
        if scratch.len() < rows * total {
            scratch.resize(rows * total, 0.0);
        }
        // Part `cols` of the concatenated columns owns scratch[cols.start·rows..cols.end·rows];
        // each weight's piece `a..b` in it is packed `[rows, b − a]` from `a·rows`.
        let d_outs: [usize; N] = std::array::from_fn(|i| ws[i].d_out);
        self.par.split_mut(
            total,
            16,
            parts,
            &mut scratch[..rows * total],
            rows,
            |cols, chunk| {
                start();
                group_pieces(&d_outs, &cols, |i, off, a, b| {
                    let piece = &mut chunk[(a - cols.start) * rows..(b - cols.start) * rows];
                    ws[i].w.matmul_range(x, rows, piece, a - off..b - off);
                    if let Some(bias) = &ws[i].bias {
                        k::add_bias(piece, &bias[a - off..b - off]);
                    }
                    then(i, a - off..b - off, piece);
                });
            },
        );
        for cols in super::cpu_par::ranges(total, 16, parts) {
            group_pieces(&d_outs, &cols, |i, off, a, b| {
                let (n, len) = (d_outs[i], b - a);
                let packed = &scratch[a * rows..b * rows];
                for (r, src) in packed.chunks_exact(len).enumerate() {
                    outs[i][r * n + a - off..r * n + b - off].copy_from_slice(src);
                }
            });
        }
    }
}

/// Calls `each(i, off, a, b)` for every weight `i` of a group (output widths `d_outs`,
/// concatenated; weight `i` starts at `off`) whose columns meet `cols`, with `a..b` the
/// overlap in concatenated columns.
fn group_pieces(
    d_outs: &[usize],
    cols: &std::ops::Range<usize>,
    mut each: impl FnMut(usize, usize, usize, usize),
) {
    let mut off = 0;
    for (i, &d) in d_outs.iter().enumerate() {
        let (a, b) = (cols.start.max(off), cols.end.min(off + d));
        if a < b {
            each(i, off, a, b);
        }
        off += d;
    }
}

/// Arena of a pipeline started without [`CpuBackend::with_upload_arena`]: the default
/// `--max-cpu-lora-bytes` (anonymous memory, committed only as adapters fill it).
const DEFAULT_UPLOAD_ARENA: usize = 4 << 30;

/// Loader threads of the CPU backend's upload pipeline.
const UPLOAD_LOADERS: usize = 1;

/// Most rows [`CpuBackend::linear_group`] splits as one op (decode steps); prompt chunks run
/// each weight on its own (few, long ops).
const GROUP_MAX_ROWS: usize = 16;

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Linear = CpuLinear;
    type Vector = Vec<f32>;
    type Lora = Arc<LoraSlot>;
    type KvLayer = CpuKvLayer;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn upload_linear(
        &self,
        w: Vec<f32>,
        d_out: usize,
        d_in: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<CpuLinear> {
        assert_eq!(w.len(), d_out * d_in, "linear weight is not [d_out, d_in]");
        self.upload_weight(WeightMatrix::from_f32(w, d_out, d_in), bias)
    }

    fn upload_weight(&self, mut w: WeightMatrix, bias: Option<Vec<f32>>) -> Result<CpuLinear> {
        if let Some(arena) = &self.arena {
            let mut arena = arena.lock().unwrap_or_else(PoisonError::into_inner);
            if let Err(e) = w.pack_into(&mut arena) {
                // The weight computes the same from its Vec, on 4 KiB pages.
                tracing::warn!("could not map huge-page memory for a weight ({e}); keeping it on ordinary pages");
            }
        }
        Ok(CpuLinear {
            d_out: w.rows(),
            d_in: w.cols(),
            w,
            bias,
        })
    }

    fn upload_vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }

    fn upload_lora(&self, adapter: Arc<LoraAdapter>) -> Result<Arc<LoraSlot>> {
        Ok(Arc::new(LoraSlot::resident(adapter)))
    }

    fn stream_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<Arc<LoraSlot>> {
        self.enqueue(adapter, LoadPriority::Demand)
    }

    fn prefetch_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<Arc<LoraSlot>> {
        self.enqueue(adapter, LoadPriority::Prefetch)
    }

    fn promote_lora(&mut self, lora: &Arc<LoraSlot>) {
        if let Some(u) = &self.upload {
            u.promote(lora);
        }
    }

    fn landed_layers(&self, lora: &Arc<LoraSlot>) -> usize {
        lora.landed()
    }

    fn lora_failure(&self, lora: &Arc<LoraSlot>) -> Option<String> {
        lora.failure().map(str::to_string)
    }

    fn rebind_lora(&mut self, old: &Arc<LoraAdapter>, new: &Arc<LoraAdapter>) {
        if let Some(u) = &self.upload {
            u.rebind(old, new);
        }
    }

    fn stage_lora(&mut self, adapter: &Arc<LoraAdapter>, _layout: KvLayout) -> usize {
        if self.upload.is_none() {
            match self.start_upload() {
                Ok(p) => self.upload = Some(p),
                Err(e) => {
                    tracing::warn!("adapter upload pipeline: {e}");
                    return 0;
                }
            }
        }
        self.upload.as_ref().map_or(0, |u| {
            u.stage(adapter, &ImageLayout::of(adapter, None), None)
        })
    }

    fn upload_arena(&self) -> Option<crate::upload::ArenaUsage> {
        self.upload.as_ref().map(UploadPipeline::arena_usage)
    }

    fn kv_elem_bytes(&self) -> usize {
        self.kv_dtype.cpu_format().size()
    }

    fn alloc_kv_layer(&self, layout: KvLayout, num_blocks: usize) -> Result<CpuKvLayer> {
        let (len, f) = (layout.block_len() * num_blocks, self.kv_dtype.cpu_format());
        Ok(CpuKvLayer {
            k: KvData::zeros(f, len),
            v: KvData::zeros(f, len),
            layout,
        })
    }

    /// With [`CpuBackend::set_act16`] on, every residual op rounds `h` where CUDA stores it
    /// in 16 bits (`cpu_residual16.rs`).
    fn embed(&mut self, table: &CpuLinear, ids: &[u32], out: &mut Vec<f32>) {
        super::cpu_residual16::embed(self.residual16(), table, ids, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &mut self,
        h: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        rows: usize,
        width: usize,
        out: &mut Vec<f32>,
    ) {
        let ty = self.residual16();
        super::cpu_residual16::add_rms_norm(self, ty, h, x, w, eps, (rows, width), out);
    }

    fn residual_add(&mut self, h: &mut Vec<f32>, x: &Vec<f32>, len: usize) {
        super::cpu_residual16::residual_add(self, self.residual16(), h, x, len);
    }

    fn rms_norm(&mut self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, rows: usize, out: &mut Vec<f32>) {
        super::cpu_rows::rms_norm(&self.par, x, w, eps, rows, out);
    }

    fn linear(&mut self, x: &Vec<f32>, w: &CpuLinear, rows: usize, out: &mut Vec<f32>) {
        let y = &mut out[..rows * w.d_out];
        let (kk, ww) = (w.d_in, &w.w);
        let dims = (rows, kk, w.d_out);
        linear_split(
            &self.par,
            &mut self.par_scratch,
            &x[..rows * kk],
            dims,
            y,
            |x, m, cols, o| ww.matmul_range(x, m, o, cols),
        );
        if let Some(b) = &w.bias {
            k::add_bias(y, b);
        }
    }

    /// Decode-sized groups (≤ `GROUP_MAX_ROWS` rows) split the concatenated output columns
    /// of all the weights over the pool at once (one fork/join instead of one per weight,
    /// equal bytes per thread), through a packed scratch then scattered; every column is
    /// computed by the same `matmul_range` arithmetic as [`Backend::linear`], so outputs are
    /// bit-identical to it.
    fn linear_group<const N: usize>(
        &mut self,
        x: &Vec<f32>,
        ws: [&CpuLinear; N],
        rows: usize,
        outs: [&mut Vec<f32>; N],
    ) {
        let k = ws.first().map_or(0, |w| w.d_in);
        let total: usize = ws.iter().map(|w| w.d_out).sum();
        let parts = self.par.parts(rows * k * total);
        if rows > GROUP_MAX_ROWS || parts == 1 || ws.iter().any(|w| w.d_in != k) {
            for (w, o) in ws.into_iter().zip(outs) {
                self.linear(x, w, rows, o);
            }
            return;
        }
        self.group_split(x, ws, rows, outs, || {}, |_, _, _| {});
    }

    /// Steps of at most `cpu_fused::FUSED_MAX_ROWS` rows split over several threads add
    /// their adapters' deltas inside the group's column split: the threads share one shrink
    /// and each expands the columns it just computed (see `cpu_fused`), bit for bit what
    /// the base products followed by [`Backend::lora`] give. Other steps take that sequence.
    fn linear_group_lora<const N: usize>(
        &mut self,
        x: &Vec<f32>,
        ws: [&CpuLinear; N],
        rows: usize,
        mut outs: [&mut Vec<f32>; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, Arc<LoraSlot>>,
    ) {
        let k = ws.first().map_or(0, |w| w.d_in);
        let shapes_agree = ws.iter().zip(&sites).all(|(w, s)| {
            w.d_in == k
                && s.dims
                    == (LinearDims {
                        d_in: w.d_in,
                        d_out: w.d_out,
                    })
        });
        // On one thread the split buys nothing and its scratch, scatter and chunked shrink
        // cost more than the serial tail (quiet A/B: +0.15 ms a decode step).
        let total: usize = ws.iter().map(|w| w.d_out).sum();
        let parallel = self.par.parts(rows * k * total) > 1;
        let plan = cpu_fused::plan(rows, sites, batch).filter(|_| shapes_agree && parallel);
        if let Some(plan) = plan {
            let mut shared = std::mem::take(&mut self.fused_shrink);
            shared.reset(&plan);
            let x_rows = &x[..rows * k];
            let (sh, pl) = (&shared, &plan);
            self.group_split(
                x,
                ws,
                rows,
                outs,
                || sh.claim(pl, x_rows),
                |i, cols, piece| sh.expand(pl, i, cols, piece),
            );
            self.fused_shrink = shared;
            return;
        }
        if N == 1 {
            // As the forward ran a lone projection before groups took adapters along.
            self.linear(x, ws[0], rows, outs[0]);
        } else {
            self.linear_group(x, ws, rows, outs.each_mut().map(|o| &mut **o));
        }
        if batch.layout.segments.is_empty() {
            return;
        }
        for (o, s) in outs.into_iter().zip(sites) {
            self.lora(x, o, s.dims, (s.layer, s.module), batch);
        }
    }

    fn lora(
        &mut self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, Arc<LoraSlot>>,
    ) {
        let rows = batch.layout.row_adapter.len();
        let x = &x[..rows * dims.d_in];
        let y = &mut y[..rows * dims.d_out];
        let usable = |idx: u32| {
            batch.on_device(idx, at.0) && batch.adapters[idx as usize].get(at.0 .0, at.1).is_some()
        };
        let jobs = &mut self.lora_plan.jobs;
        jobs.clear();
        match batch.kernel {
            LoraKernel::Sgmv => {
                // One fused shrink+expand per segment (thaw-cpu-lora's kernel streams A and B
                // once without packing them, so a one-row decode segment costs what its
                // weights cost to read).
                for (range, idx) in &batch.layout.segments {
                    if usable(*idx) {
                        jobs.push((range.clone(), *idx));
                    }
                }
            }
            LoraKernel::Bgmv => {
                // One kernel call per run of rows with the same adapter index, as BGMV runs
                // each run of equal indices as one GEMM; the weights are read in their stored
                // dtype, as on the SGMV path.
                let mut start = 0;
                let idx = &batch.layout.row_adapter;
                while start < idx.len() {
                    let first = idx[start];
                    let len = idx[start..].iter().take_while(|&&i| i == first).count();
                    let run = start..start + len;
                    start += len;
                    if let Some(i) = first.filter(|&i| usable(i)) {
                        jobs.push((run, i));
                    }
                }
            }
        }
        // Prompt steps split the runs' rows over the pool (bit for bit the serial calls).
        let get = |i: u32| {
            batch.adapters[i as usize]
                .get(at.0 .0, at.1)
                .expect("only adapters with factors for this module are planned")
        };
        cpu_lora_rows::apply(
            &self.par,
            &mut self.fused,
            &mut self.lora_plan,
            (x, y),
            dims,
            get,
        );
    }

    fn rope(&mut self, x: &mut Vec<f32>, positions: &[usize], n_heads: usize) {
        let dims = (n_heads, self.head_dim);
        super::cpu_rows::rope(&self.par, &mut self.rope, x, positions, dims);
    }

    fn attention(
        &mut self,
        q: &Vec<f32>,
        k_new: &Vec<f32>,
        v_new: &Vec<f32>,
        kv: &mut CpuKvLayer,
        step: &StepLayout,
        out: &mut Vec<f32>,
    ) {
        let qw = self.n_heads * self.head_dim;
        let kw = self.n_kv_heads * self.head_dim;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        // New K/V first (one sequence's writes can land anywhere in the cache), then the
        // attention of every sequence reads the cache while writing only its own rows of `out`.
        self.attn_items.clear();
        let mut tiled = true;
        for (i, s) in step.seqs.iter().enumerate() {
            tiled &= s.rows.start == self.attn_items.last().map_or(0, |it| it.1.end);
            let table = &step.block_tables[s.blocks.clone()];
            let (r0, r1) = (s.rows.start, s.rows.end);
            super::cpu_kv::write(
                (&mut kv.k, &mut kv.v),
                kv.layout,
                table,
                s.start_pos,
                &k_new[r0 * kw..r1 * kw],
                &v_new[r0 * kw..r1 * kw],
            );
            // Long prefill chunks split by query rows so one sequence can use every thread.
            let chunk = s.rows.len().div_ceil(self.par.active()).max(1);
            let mut r = r0;
            while r < r1 {
                self.attn_items.push((i, r..(r + chunk).min(r1)));
                r += chunk;
            }
        }
        // Cost of a query row: the keys it reads.
        let cost = |&(i, ref r): &(usize, Range<usize>)| {
            let s = &step.seqs[i];
            let ctx = s.start_pos + (r.end - s.rows.start);
            (r.len() * ctx) as u64
        };
        let work: u64 = self.attn_items.iter().map(cost).sum::<u64>() * qw as u64;
        // Rows not in sequence order (a hand-built layout) cannot be split into owned slices.
        let parts = if tiled {
            self.par.parts(work as usize)
        } else {
            1
        };
        balance(
            self.attn_items.iter().map(cost),
            parts,
            &mut self.attn_bounds,
        );
        // Items are in row order and tile the step's rows, so each group owns a slice of out.
        self.attn_out_bounds.clear();
        let items = &self.attn_items;
        self.attn_out_bounds
            .extend(self.attn_bounds.iter().map(|&b| match items.get(b) {
                Some(it) if tiled => it.1.start * qw,
                _ if tiled => step.rows() * qw,
                // One group over all of `out`, rows at their own offsets.
                _ if b == 0 => 0,
                _ => out.len(),
            }));
        let (n_heads, window) = (self.n_heads, self.sliding_window);
        let (caches, layout) = ((&kv.k, &kv.v), kv.layout);
        let item_bounds = &self.attn_bounds;
        let base = &self.attn_out_bounds;
        self.attn_scratch.iter_mut().for_each(|s| s.1.reset());
        self.par.groups_mut(
            &mut out[..],
            base,
            &mut self.attn_scratch,
            |g, chunk, (scratch, wide)| {
                for (i, r) in &items[item_bounds[g]..item_bounds[g + 1]] {
                    let s = &step.seqs[*i];
                    let o0 = r.start * qw - base[g];
                    let table = &step.block_tables[s.blocks.clone()];
                    let (kc, vc, table) = match caches {
                        (KvData::F32(kc), KvData::F32(vc)) => (&kc[..], &vc[..], table),
                        _ => wide.load(*i, caches, layout, table, s.start_pos + s.rows.len()),
                    };
                    k::paged_attention(
                        &q[r.start * qw..r.end * qw],
                        kc,
                        vc,
                        layout,
                        table,
                        s.start_pos + (r.start - s.rows.start),
                        n_heads,
                        scale,
                        window,
                        &mut chunk[o0..o0 + r.len() * qw],
                        scratch,
                    );
                }
            },
        );
    }

    fn qkv_attention(
        &mut self,
        x: &Vec<f32>,
        ws: [&CpuLinear; 3],
        qkv: [&mut Vec<f32>; 3],
        sites: [LoraSite; 3],
        batch: &LoraBatch<'_, Arc<LoraSlot>>,
        heads: (usize, usize),
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Vec<f32>,
    ) {
        use super::cpu_attn16::qkv_attention;
        match self.act16 {
            Some(ty) => qkv_attention(self, ty, x, ws, qkv, sites, batch, heads, kv, step, out),
            None => {
                super::qkv_then_rope_attention(self, x, ws, qkv, sites, batch, heads, kv, step, out)
            }
        }
    }

    fn gated_mlp_in(
        &mut self,
        x: &Vec<f32>,
        ws: [&CpuLinear; 2],
        rows: usize,
        outs: [&mut Vec<f32>; 2],
        sites: [LoraSite; 2],
        batch: &LoraBatch<'_, Arc<LoraSlot>>,
        act: &mut Vec<f32>,
    ) {
        match self.act16 {
            Some(ty) => {
                super::cpu_act16::gated_mlp_in(self, ty, x, ws, rows, outs, sites, batch, act)
            }
            None => super::gate_up_then_swiglu(self, x, ws, rows, outs, sites, batch, act),
        }
    }

    fn swiglu(&mut self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        super::cpu_rows::swiglu(&self.par, gate, up, len, out);
    }

    fn add(&mut self, y: &mut Vec<f32>, x: &Vec<f32>, len: usize) {
        super::cpu_rows::add(&self.par, y, x, len);
    }

    fn gather_rows(&mut self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) {
        for (i, &r) in rows.iter().enumerate() {
            out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
    }

    fn export_rows(
        &mut self,
        x: &Vec<f32>,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    ) {
        let src = rows
            .iter()
            .flat_map(|r| x[r.start * width..r.end * width].chunks_exact(width));
        for (d, s) in dst.chunks_mut(stride).zip(src) {
            d[..width].copy_from_slice(s);
        }
    }

    fn merge_rows(
        &mut self,
        y: &mut Vec<f32>,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    ) {
        let mut at = 0;
        for r in rows {
            for row in y[r.start * width..r.end * width].chunks_exact_mut(width) {
                k::add_in_place(row, &src[at..at + width]);
                at += stride;
            }
        }
    }

    fn logits(&mut self, x: &Vec<f32>, lm_head: &CpuLinear, rows: usize, out: &mut Vec<f32>) {
        out.resize(rows * lm_head.d_out, 0.0);
        self.linear(x, lm_head, rows, out);
    }

    fn supports_graphs(&self) -> bool {
        self.graph_bucket.is_some()
    }

    fn graph_begin(
        &mut self,
        key: super::GraphKey,
        _step: &StepLayout,
        _lora: &LoraBatch<'_, Arc<LoraSlot>>,
        _sizing: &super::graph_plan::GraphSizing,
    ) -> Result<Option<GraphPhase>> {
        let phase = self.graph_bucket.as_mut().map(|b| {
            *b = key.bucket;
            GraphPhase::Warmup
        });
        self.graph_lora = phase.is_some() && key.lora_rank > 0;
        Ok(phase)
    }

    /// The padded step's logits, less the padding rows'.
    fn graph_end(&mut self, out: &mut Vec<f32>, rows: usize) -> Result<bool> {
        if let Some(b) = self.graph_bucket.as_mut().filter(|b| **b > 0) {
            out.truncate(out.len() / *b * rows);
            *b = 0;
        }
        self.graph_lora = false;
        Ok(true)
    }

    fn set_cpu_assist(&mut self, in_flight: bool) {
        self.par
            .set_active(if in_flight { 1 } else { self.par.max() });
    }

    fn step_running(&mut self, running: bool) {
        // The host is this backend's device: the upload pipeline's loader and the host-store
        // fill keep to their share of the host while the step computes (`upload::pace`).
        match (running, self.step.is_some()) {
            (true, false) => self.step = Some(crate::upload::host_step()),
            (false, true) => self.step = None,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    /// Rows exported into (and merged from) a buffer with a wider stride land exactly where
    /// the packed layout would put them, and the padding is left alone.
    #[test]
    fn strided_export_and_merge_match_packed() {
        let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let mut b = CpuBackend::new(&cfg);
        let (w, stride) = (3, 5);
        let x: Vec<f32> = (0..8 * w).map(|i| i as f32).collect();
        let rows = [1..3, 5..6];
        let mut packed = vec![0.0; 3 * w];
        b.export_rows(&x, w, &rows, &mut packed, w);
        let mut wide = vec![-1.0; 2 * stride + w];
        b.export_rows(&x, w, &rows, &mut wide, stride);
        for r in 0..3 {
            assert_eq!(wide[r * stride..r * stride + w], packed[r * w..(r + 1) * w]);
        }
        assert_eq!(wide[w..stride], [-1.0, -1.0]);
        let mut y_packed = vec![0.5; 8 * w];
        let mut y_wide = y_packed.clone();
        b.merge_rows(&mut y_packed, w, &rows, &packed, w);
        b.merge_rows(&mut y_wide, w, &rows, &wide, stride);
        assert_eq!(y_wide, y_packed);
        assert_eq!(y_packed[w], x[w] + 0.5);
        assert_eq!(y_packed[0], 0.5);
    }

    /// A group of weights sharing an input, split as one op over 2 and 3 threads, gives
    /// every output bit for bit as separate `linear` calls do on one thread, for decode
    /// rows and small batches, f32 and Q4_1 weights, widths that do not fall on the split's
    /// 16-column alignment, and biases.
    #[test]
    fn linear_group_equals_separate_linears() {
        use thaw_kernels::cpu::{WeightFormat, WeightMatrix};
        let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let mut rnd = crate::backend::test_values(11);
        let k = 64;
        let mut one = CpuBackend::new(&cfg);
        for format in [WeightFormat::F32, WeightFormat::Q4_1] {
            let ws: Vec<CpuLinear> = [(96, false), (40, true), (24, false)]
                .iter()
                .map(|&(n, bias)| {
                    let w = WeightMatrix::from_f32(rnd(n * k), n, k)
                        .convert(format)
                        .unwrap();
                    let b = bias.then(|| rnd(n));
                    one.upload_weight(w, b).unwrap()
                })
                .collect();
            for threads in [2, 3] {
                let par = CpuThreads {
                    min_part_work: 1,
                    ..CpuThreads::unpinned(threads)
                };
                let mut many = CpuBackend::with_threads(&cfg, par).unwrap();
                for rows in [1, 3, 16] {
                    let x = rnd(rows * k);
                    let want: Vec<Vec<f32>> = ws
                        .iter()
                        .map(|w| {
                            let mut o = vec![0.0; rows * w.d_out];
                            one.linear(&x, w, rows, &mut o);
                            o
                        })
                        .collect();
                    let mut got: Vec<Vec<f32>> =
                        ws.iter().map(|w| vec![f32::NAN; rows * w.d_out]).collect();
                    let [g0, g1, g2] = &mut got[..] else {
                        unreachable!()
                    };
                    many.linear_group(&x, [&ws[0], &ws[1], &ws[2]], rows, [g0, g1, g2]);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{format:?} weight {i}, {threads} threads, {rows} rows"
                        );
                    }
                }
            }
        }
    }

    /// Uploaded weights are packed into the huge-page arena (unless `THAW_HUGEPAGES=0`), and
    /// every format computes bit for bit what the same matrix computes from its `Vec`, for a
    /// decode row and a prompt chunk.
    #[test]
    fn packed_weights_compute_what_their_vecs_compute() {
        use thaw_kernels::cpu::{WeightFormat, WeightMatrix};
        let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let mut rnd = crate::backend::test_values(23);
        let (n, k) = (72, 64);
        let mut b = CpuBackend::new(&cfg);
        let formats = [
            WeightFormat::F32,
            WeightFormat::F16,
            WeightFormat::BF16,
            WeightFormat::Q8_0,
            WeightFormat::Q4_1,
        ];
        for format in formats {
            let w = WeightMatrix::from_f32(rnd(n * k), n, k)
                .convert(format)
                .unwrap();
            let heap = w.clone();
            let up = b.upload_weight(w, None).unwrap();
            assert_eq!(up.w.is_packed(), hugepages_enabled(), "{format:?}");
            assert!(!heap.is_packed());
            assert_eq!(up.w, heap, "{format:?}: packing changed the elements");
            for rows in [1, 40] {
                let x = rnd(rows * k);
                let mut got = vec![f32::NAN; rows * n];
                b.linear(&x, &up, rows, &mut got);
                let mut want = vec![f32::NAN; rows * n];
                heap.matmul(&x, rows, &mut want);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, c)| a.to_bits() == c.to_bits());
                assert!(same, "{format:?}, {rows} rows");
            }
        }
    }
}
