//! The ops a Llama-family forward needs, behind one trait, and its implementations.
//!
//! The engine drives a step through [`Backend`] and never touches device memory itself:
//! buffers, weights, adapter copies and KV storage are the backend's associated types. The
//! CPU backend ([`cpu::CpuBackend`]) is always built; it is the oracle GPU kernels are tested
//! against and what the demo and the tests run on.
use std::ops::Range;

use thaw_kernels::cpu::KvLayout;

use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::Result;
use crate::ids::LayerIdx;

pub mod act16_plan;
pub mod any;
mod any_lora_small;
pub mod attn16_plan;
pub mod cpu;
mod cpu_act16;
pub use cpu_act16::Act16Type;
mod cpu_attn16;
mod cpu_fused;
pub mod cpu_kv;
mod cpu_lora_rows;
pub use cpu_fused::set_fused_lora;
pub mod cpu_par;
mod cpu_pool;
mod cpu_residual16;
mod cpu_rows;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device_counts;
pub mod graph_plan;
pub mod greedy;
pub mod kernel_select;
pub mod lt_plan;
pub mod op_profile;
pub mod profiled;
pub mod residual16_plan;
pub use graph_plan::{GraphKey, GraphPhase};
#[cfg(not(feature = "cuda"))]
mod nocuda;
pub mod step_meta;

/// Which batched-LoRA formulation a step uses (Punica's SGMV or S-LoRA/CaraServe's BGMV).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum LoraKernel {
    /// Segments of contiguous rows per adapter, no padding: cost ∝ Σ rank.
    #[default]
    Sgmv,
    /// Per-row adapter index, padded to the largest rank in the step: cost ∝ rows · max rank.
    Bgmv,
}

/// One sequence's share of a step: its rows in the batch and where they sit in its context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    /// Rows of the step's activations that belong to this sequence.
    pub rows: Range<usize>,
    /// Position of the first of those rows in the sequence.
    pub start_pos: usize,
    /// Range of this sequence's block table in [`StepLayout::block_tables`].
    pub blocks: Range<usize>,
}

/// Host-side description of one step, built once per step and shared by every layer.
#[derive(Clone, Debug, Default)]
pub struct StepLayout {
    /// Token ids fed this step, one per row.
    pub token_ids: Vec<u32>,
    /// Position of each row within its sequence.
    pub positions: Vec<usize>,
    pub seqs: Vec<SeqSlice>,
    /// All block tables of the step, concatenated.
    pub block_tables: Vec<u32>,
    /// Rows whose logits are wanted (the last row of each sampling sequence).
    pub logit_rows: Vec<usize>,
}

impl StepLayout {
    pub fn rows(&self) -> usize {
        self.token_ids.len()
    }

    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.logit_rows.clear();
    }
}

/// The adapters of one step: Punica's segments (rows of one adapter are contiguous) and the
/// equivalent per-row index for BGMV. Built once per step.
#[derive(Clone, Debug, Default)]
pub struct LoraLayout {
    /// (rows, index into the step's adapter list).
    pub segments: Vec<(Range<usize>, u32)>,
    /// Per row: index into the step's adapter list, or None for base-only rows.
    pub row_adapter: Vec<Option<u32>>,
}

impl LoraLayout {
    pub fn clear(&mut self) {
        self.segments.clear();
        self.row_adapter.clear();
    }
}

/// Input and output widths of a projection.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LinearDims {
    pub d_in: usize,
    pub d_out: usize,
}

/// Where a projection's adapter deltas come from: its (layer, module) and its shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LoraSite {
    pub layer: LayerIdx,
    pub module: LoraModule,
    pub dims: LinearDims,
}

/// The adapters referenced by a step, in the order [`LoraLayout`] indexes them.
pub struct LoraBatch<'a, L> {
    pub kernel: LoraKernel,
    pub layout: &'a LoraLayout,
    pub adapters: &'a [&'a L],
    /// Per adapter: layers landed on the device when the step started. Layers at or past it
    /// are computed elsewhere (CPU assist) and must be skipped here, even if they land
    /// mid-step, so every row's delta is added exactly once.
    pub landed: &'a [usize],
}

impl<'a, L> LoraBatch<'a, L> {
    /// The same step (kernel, layout, landed layers) over another view of its adapters, e.g.
    /// one backend's handles of them; `adapters` is in the same order.
    pub fn with_adapters<'b, M>(&self, adapters: &'b [&'b M]) -> LoraBatch<'b, M>
    where
        'a: 'b,
    {
        LoraBatch {
            kernel: self.kernel,
            layout: self.layout,
            adapters,
            landed: self.landed,
        }
    }

    /// Whether adapter `idx` is applied by the backend at `layer` in this step.
    pub fn on_device(&self, idx: u32, layer: LayerIdx) -> bool {
        layer.0 < self.landed[idx as usize]
    }
}

/// How an adapter goes to the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LoraLoad {
    /// Every layer, the `cached` path ([`Backend::upload_lora`]).
    Whole,
    /// Layer by layer at this priority ([`Backend::stream_lora`] / [`Backend::prefetch_lora`]).
    Stream(crate::residency::LoadPriority),
}

/// Loads `adapter` as `load` says, into memory of the backend's own (not KV blocks).
pub fn load_lora<B: Backend + ?Sized>(
    b: &mut B,
    adapter: std::sync::Arc<LoraAdapter>,
    load: LoraLoad,
) -> Result<B::Lora> {
    match load {
        LoraLoad::Whole => b.upload_lora(adapter),
        LoraLoad::Stream(crate::residency::LoadPriority::Prefetch) => b.prefetch_lora(adapter),
        LoraLoad::Stream(_) => b.stream_lora(adapter),
    }
}

/// Where the engine put an adapter's device image: a run of KV blocks (pages of the one device
/// budget) in every layer's K and V buffers. `lease` keeps the blocks from sequences until it
/// is dropped: the backend keeps it with the adapter's device copy and with every copy still
/// writing into those blocks, so they return to KV exactly once, after both are gone.
pub struct PagePlace<'a, L> {
    /// The KV cache, layer 0 first (the blocks live in these buffers).
    pub kv: Vec<&'a L>,
    pub lease: crate::kv::blocks::PageLease,
}

/// The ops of a Llama-family forward. Buffers hold f32 activations laid out row-major;
/// every op reads and writes the first `rows * width` elements of its buffers.
///
/// One buffer is the exception: the residual stream `h` that [`Backend::embed`] writes is in
/// the backend's own representation (CUDA with `THAW_CUDA_BF16_ACT=1` stores it in the weight
/// dtype, [`residual16_plan::residual16_plan`]), so only the residual ops read or write it:
/// [`Backend::embed`], [`Backend::residual_norm`], [`Backend::add_rms_norm`]'s `residual`,
/// [`Backend::residual_add`] and [`Backend::gather_residual`] (which hands f32 rows out). A
/// wrapper backend forwards each of them to its inner backend.
pub trait Backend {
    /// An activation buffer.
    type Buf;
    /// A `[d_out, d_in]` weight matrix with an optional bias (also used for the embedding table).
    type Linear;
    /// A vector of weights (norms).
    type Vector;
    /// One adapter's weights as the backend holds them.
    type Lora;
    /// One layer's K and V storage.
    type KvLayer;

    fn name(&self) -> &'static str;
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// `w` is `[d_out, d_in]` row-major.
    fn upload_linear(
        &self,
        w: Vec<f32>,
        d_out: usize,
        d_in: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<Self::Linear>;
    /// A weight in its stored format. Backends that compute in another format widen it
    /// (the default); the CPU backend keeps f16/bf16/ggml blocks as they are.
    fn upload_weight(
        &self,
        w: thaw_kernels::cpu::WeightMatrix,
        bias: Option<Vec<f32>>,
    ) -> Result<Self::Linear> {
        let (d_out, d_in) = (w.rows(), w.cols());
        self.upload_linear(w.into_f32(), d_out, d_in, bias)
    }
    /// Weights that share their input (q/k/v, gate/up), each with its bias, in the order
    /// [`Backend::linear_group`] will take them: a backend may place them as one matrix so the
    /// group runs as one product (CUDA does with `THAW_CUDA_GROUP_GEMM=1`). Each returned
    /// weight is what [`Backend::upload_weight`] would give for its matrix; the default
    /// uploads each that way.
    fn upload_weight_group(
        &self,
        ws: Vec<(thaw_kernels::cpu::WeightMatrix, Option<Vec<f32>>)>,
    ) -> Result<Vec<Self::Linear>> {
        ws.into_iter()
            .map(|(w, b)| self.upload_weight(w, b))
            .collect()
    }
    fn upload_vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    /// A device copy of `adapter` with every layer resident.
    fn upload_lora(&self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora>;
    /// A device slot for `adapter` that its copy engine fills layer by layer, layer 0 first.
    fn stream_lora(&mut self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora>;
    /// [`Backend::stream_lora`] for an adapter a *waiting* request will need: its copy yields
    /// the link to every demand load, layer by layer. A backend whose copy engine does not
    /// reorder transfers streams it like any other (the default).
    fn prefetch_lora(&mut self, adapter: std::sync::Arc<LoraAdapter>) -> Result<Self::Lora> {
        self.stream_lora(adapter)
    }
    /// The request of a prefetched `lora` is about to run: its copy goes ahead of the
    /// prefetches still queued. A no-op where nothing is reordered (the default).
    fn promote_lora(&mut self, lora: &Self::Lora) {
        let _ = lora;
    }
    /// Layers of `lora` on the device now (`0..n` are usable).
    fn landed_layers(&self, lora: &Self::Lora) -> usize;
    /// Why `lora`'s upload failed, if it did (a layer read from its file failed its check, or
    /// a copy failed): it never lands, and its requests fail with this.
    fn lora_failure(&self, lora: &Self::Lora) -> Option<String>;
    /// Pages of the device budget (KV blocks of `layout`, every layer) `adapter`'s image takes
    /// when placed in the KV cache's own memory, or `None` where this backend keeps adapters
    /// outside it (the default: the CPU backend's "device memory" is host memory).
    fn lora_pages(&self, adapter: &LoraAdapter, layout: KvLayout) -> Option<usize> {
        let _ = (adapter, layout);
        None
    }
    /// Loads `adapter` into the run of KV blocks `place` holds (as many as
    /// [`Backend::lora_pages`] said), as `load` says. Only called where `lora_pages` is
    /// `Some`; the default gives the pages back and loads the adapter as usual.
    fn load_lora_paged(
        &mut self,
        adapter: std::sync::Arc<LoraAdapter>,
        load: LoraLoad,
        place: PagePlace<'_, Self::KvLayer>,
    ) -> Result<Self::Lora> {
        drop(place);
        load_lora(self, adapter, load)
    }
    /// `adapter` entered the host tier: where adapters go to the device through the upload
    /// pipeline, its device image (as it would be placed in KV blocks of `layout`) is written
    /// into the pinned arena now, by the loader threads behind every load, and kept while the
    /// adapter lives, so a later load only copies. Returns the arena bytes the image holds;
    /// 0 where nothing is uploaded (the default) or the image was not staged.
    fn stage_lora(&mut self, adapter: &std::sync::Arc<LoraAdapter>, layout: KvLayout) -> usize {
        let _ = (adapter, layout);
        0
    }
    /// `new` (the same bytes, held in memory) replaced `old` (read from its mapped file) as an
    /// adapter's host copy: the upload arena keeps `old`'s images for `new`, so they are not
    /// encoded again. A no-op where nothing is uploaded (the default).
    fn rebind_lora(
        &mut self,
        old: &std::sync::Arc<LoraAdapter>,
        new: &std::sync::Arc<LoraAdapter>,
    ) {
        let _ = (old, new);
    }
    /// The upload arena's bytes by use and the pipeline's encode work, once it is started.
    fn upload_arena(&self) -> Option<crate::upload::ArenaUsage> {
        None
    }
    /// The one dtype this backend computes adapters from, if it reads only one (the CUDA
    /// kernels read the weight dtype): loader threads convert adapters stored otherwise once,
    /// off the engine thread. `None` (the default): every stored dtype is read in place.
    fn lora_dtype(&self) -> Option<crate::adapter::WeightDtype> {
        None
    }
    /// Bytes of one element of the paged KV cache this backend allocates (f32 on the CPU,
    /// the KV dtype on CUDA): what a page of the device budget (one KV block of every layer)
    /// is sized by.
    fn kv_elem_bytes(&self) -> usize;
    fn alloc_kv_layer(&self, layout: KvLayout, num_blocks: usize) -> Result<Self::KvLayer>;

    /// `out[r] = table[ids[r]]`: the residual stream `out` in the backend's representation.
    fn embed(&mut self, table: &Self::Linear, ids: &[u32], out: &mut Self::Buf);
    /// [`Backend::rms_norm`] of the residual stream `h` (layer 0's input norm) into the f32
    /// `out`. The default reads `h` as f32.
    fn residual_norm(
        &mut self,
        h: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) {
        self.rms_norm(h, w, eps, rows, out);
    }
    /// `h += x` over `len` elements of the residual stream (the last layer's add). The default
    /// is [`Backend::add`].
    fn residual_add(&mut self, h: &mut Self::Buf, x: &Self::Buf, len: usize) {
        self.add(h, x, len);
    }
    /// `out[i] = h[rows[i]]` in f32, rows of `width` elements of the residual stream (before
    /// the final norm). The default is [`Backend::gather_rows`].
    fn gather_residual(
        &mut self,
        h: &Self::Buf,
        width: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) {
        self.gather_rows(h, width, rows, out);
    }
    fn rms_norm(
        &mut self,
        x: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    );
    /// out = x · Wᵀ + bias.
    fn linear(&mut self, x: &Self::Buf, w: &Self::Linear, rows: usize, out: &mut Self::Buf);
    /// `outs[i] = x · W_iᵀ + bias_i` for weights that share their input (q/k/v, gate/up),
    /// as one op a backend may split over its threads at once; each output equals what
    /// [`Backend::linear`] gives. The default runs `linear` on each.
    fn linear_group<const N: usize>(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; N],
        rows: usize,
        outs: [&mut Self::Buf; N],
    ) {
        for (w, o) in ws.into_iter().zip(outs) {
            self.linear(x, w, rows, o);
        }
    }
    /// [`Backend::linear_group`], then `outs[i] += LoRA(x)` for every row whose adapter
    /// targets `sites[i]` — as one op, so a backend may compute the deltas of few-row steps
    /// beside the base products, on the same threads (the CPU backend does). The default runs
    /// `linear_group`, then [`Backend::lora`] on each output.
    fn linear_group_lora<const N: usize>(
        &mut self,
        x: &Self::Buf,
        ws: [&Self::Linear; N],
        rows: usize,
        mut outs: [&mut Self::Buf; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, Self::Lora>,
    ) {
        self.linear_group(x, ws, rows, outs.each_mut().map(|o| &mut **o));
        lora_sites(self, x, outs, sites, batch);
    }
    /// y += LoRA(x) for every row whose adapter targets (layer, module).
    fn lora(
        &mut self,
        x: &Self::Buf,
        y: &mut Self::Buf,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, Self::Lora>,
    );
    /// Rotary embedding in place on `[rows, n_heads, head_dim]`.
    fn rope(&mut self, x: &mut Self::Buf, positions: &[usize], n_heads: usize);
    /// Writes this step's K/V into the paged cache, then causal (GQA) attention for every
    /// sequence. Head counts, head size and sliding window come from the model the backend
    /// was built for.
    fn attention(
        &mut self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Self::Buf,
    );
    /// [`Backend::rope`] on `q` (`heads.0` heads) and on `k` (`heads.1`), then
    /// [`Backend::attention`], as one op: a backend may rotate q and k inside the kernel that
    /// writes K/V to the paged cache (CUDA does with `THAW_CUDA_ROPE_FOLD=1`). q and k are left
    /// rotated, as the three ops leave them. The default runs the three.
    fn rope_attention(
        &mut self,
        (q, k, v): (&mut Self::Buf, &mut Self::Buf, &Self::Buf),
        heads: (usize, usize),
        kv: &mut Self::KvLayer,
        step: &StepLayout,
        out: &mut Self::Buf,
    ) {
        rope_then_attention(self, (q, k, v), heads, kv, step, out);
    }
    /// Whether [`Backend::rope_attention`] runs as one op rather than the three (a profile
    /// then times it as one).
    fn folds_rope(&self) -> bool {
        false
    }
    /// The attention block's input half as one op: `[q, k, v] = x · [W_q, W_k, W_v]ᵀ` plus
    /// every adapter's delta ([`Backend::linear_group_lora`] over `sites`, `step.rows()` rows),
    /// then [`Backend::rope_attention`] into `out`. `q`, `k`, `v` are scratch: only `out` is
    /// read afterwards (by o_proj). A backend may keep q, k and v in 16 bits (CUDA with
    /// `THAW_CUDA_BF16_ACT=1`, [`attn16_plan::attn16_plan`]); the default runs the two ops.
    /// Where no adapter of the step targets o at this layer, a backend may also keep `out`
    /// only as o_proj's 16-bit GEMM input (CUDA: `stores_out16`, `cuda/attn_out.rs`), leaving
    /// its f32 values unwritten: the caller's next op must then be o_proj's product over `out`
    /// (`forward.rs` does exactly that).
    #[allow(clippy::too_many_arguments)]
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
        qkv_then_rope_attention(self, x, ws, qkv, sites, batch, heads, kv, step, out);
    }
    /// Whether [`Backend::qkv_attention`] may run as one op rather than the products and
    /// [`Backend::rope_attention`] (a profile then times it as one).
    fn fuses_qkv_attention(&self) -> bool {
        false
    }
    /// `residual += x`, then `out = rms_norm(residual)` with `w`, over `rows` rows of `width`:
    /// the residual stream's add and the next block's norm as one op, which a backend may fuse
    /// (CUDA does by default; `THAW_CUDA_FUSED=0` turns it off). `residual` is the residual
    /// stream in the backend's representation (a 16-bit one holds the rounded sum, which the
    /// norm then reads). The default runs [`Backend::add`] then [`Backend::rms_norm`].
    #[allow(clippy::too_many_arguments)]
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
        self.add(residual, x, rows * width);
        self.rms_norm(residual, w, eps, rows, out);
    }
    /// The MLP block's input half as one op: `[gate, up] = x · [W_gate, W_up]ᵀ` plus every
    /// adapter's delta ([`Backend::linear_group_lora`] over `sites`), then
    /// `act = silu(gate) · up` ([`Backend::swiglu`]) over `rows × sites[0].dims.d_out`
    /// elements. `gate` and `up` are scratch: only `act` is read afterwards (by down). A
    /// backend may keep the intermediate activations in 16 bits (CUDA with
    /// `THAW_CUDA_BF16_ACT=1`, [`act16_plan::act16_plan`]); the default runs the two ops.
    #[allow(clippy::too_many_arguments)]
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
        gate_up_then_swiglu(self, x, ws, rows, outs, sites, batch, act);
    }
    /// Whether [`Backend::gated_mlp_in`] may run as one op rather than the two (a profile then
    /// times it as one).
    fn fuses_gated_mlp(&self) -> bool {
        false
    }
    /// out = silu(gate) * up over `len` elements.
    fn swiglu(&mut self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf);
    /// y += x over `len` elements.
    fn add(&mut self, y: &mut Self::Buf, x: &Self::Buf, len: usize);
    /// `out[i] = x[rows[i]]` for rows of `width` elements.
    fn gather_rows(&mut self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf);
    /// Copies rows `rows` (each of `width` elements) of `x`, in order, into the host exchange
    /// buffer `dst`, whose rows are `stride ≥ width` apart — the CPU-assist export (on CUDA:
    /// the fused copy-and-signal kernel).
    fn export_rows(
        &mut self,
        x: &Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    );
    /// Adds host deltas `src` (rows in the order of `rows`, `stride ≥ width` apart) into rows
    /// `rows` of `y`.
    fn merge_rows(
        &mut self,
        y: &mut Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    );
    /// Host copy of logits = x · lm_headᵀ for `rows` rows: `[rows, vocab]`.
    fn logits(&mut self, x: &Self::Buf, lm_head: &Self::Linear, rows: usize, out: &mut Vec<f32>);
    /// Greedy token ids of `rows` rows of x · lm_headᵀ: `ids[i]` is row `i`'s
    /// [`crate::sampling::argmax`] (the lowest index among equal values; NaNs never chosen
    /// unless first), and only the ids need come back to the host ([`greedy`]). `scratch` is
    /// the backend's to use (the default leaves the logits in it). The default:
    /// [`Backend::logits`] into `scratch`, then the argmax on the host.
    fn greedy_ids(
        &mut self,
        x: &Self::Buf,
        lm_head: &Self::Linear,
        rows: usize,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
    ) {
        greedy::host_greedy_ids(self, x, lm_head, rows, scratch, ids);
    }
    /// Whether CPU LoRA workers compute beside the next steps (their cores are taken): the
    /// CPU backend then computes on the engine thread alone, and on every core otherwise.
    fn set_cpu_assist(&mut self, _in_flight: bool) {}

    /// The engine calls it with `true` before a step's forward and `false` after. A backend
    /// that computes on the host marks the step ([`crate::upload::host_step`]) so that host
    /// work proportional to adapters' bytes (loading, filling) keeps to its share meanwhile;
    /// a GPU computes from its own memory and marks nothing.
    fn step_running(&mut self, _running: bool) {}

    /// Registers the CPU workers' exchange `ex` with the device so that the assist path's
    /// export and merge are device work queued on the stream (DESIGN §4): the fused
    /// copy-and-signal ([`Backend::export_rows_device`]) and a merge the stream holds until
    /// the workers publish ([`Backend::wait_workers_device`], [`Backend::merge_rows_device`]);
    /// the host never synchronises the stream. Returns whether this backend does so; the
    /// default (the CPU backend) copies rows on the host with [`Backend::export_rows`] and
    /// [`Backend::merge_rows`].
    ///
    /// # Safety
    /// `ex`'s segment must stay mapped until [`Backend::unmap_assist_exchange`] is called or
    /// the backend is dropped.
    unsafe fn map_assist_exchange(&mut self, ex: &thaw_ipc::Exchange) -> Result<bool> {
        let _ = ex;
        Ok(false)
    }
    /// Drops the registration of [`Backend::map_assist_exchange`] once the device is idle.
    fn unmap_assist_exchange(&mut self) {}
    /// Queues the export of rows `rows` of `x` (`width` wide), packed in order, into input 0
    /// of the mapped exchange, then `seq` into its sequence word: the workers start.
    fn export_rows_device(
        &mut self,
        x: &Self::Buf,
        width: usize,
        rows: &[Range<usize>],
        seq: thaw_ipc::StepSeq,
    ) -> Result<()> {
        let _ = (x, width, rows, seq);
        Err(no_device_exchange())
    }
    /// Queues a wait of the stream until every worker of `workers` has published step `seq`.
    fn wait_workers_device(
        &mut self,
        seq: thaw_ipc::StepSeq,
        workers: &[thaw_ipc::WorkerId],
    ) -> Result<()> {
        let _ = (seq, workers);
        Err(no_device_exchange())
    }
    /// Whether decode steps can run as captured graphs ([`graph_plan`]; CUDA graphs). The
    /// default (the CPU backend): no, and the engine never calls the `graph_*` ops.
    fn supports_graphs(&self) -> bool {
        false
    }
    /// Starts a graph step for `key` over `step`, already padded to `key.bucket` rows
    /// ([`graph_plan::pad_step`]): writes the step's metadata into the persistent buffer every
    /// graph reads, with one host → device copy. Returns the phase ([`graph_plan::next_phase`]):
    /// after [`GraphPhase::Replay`] the graph has been launched and the engine runs no forward;
    /// otherwise the engine runs the forward (whose ops then read the persistent metadata, and
    /// under [`GraphPhase::Capture`] are recorded instead of run) and calls
    /// [`Backend::graph_end`]. `None`: this key's capture failed before; run the step eagerly.
    fn graph_begin(
        &mut self,
        key: GraphKey,
        step: &StepLayout,
        lora: &LoraBatch<'_, Self::Lora>,
        sizing: &graph_plan::GraphSizing,
    ) -> Result<Option<GraphPhase>> {
        let _ = (key, step, lora, sizing);
        Ok(None)
    }
    /// Ends the graph step [`Backend::graph_begin`] started: launches a graph just captured,
    /// then copies the logits of the first `rows` rows (the real ones) into `out`. Returns
    /// `false` when the capture failed: the key is then eager for good and the engine runs the
    /// forward once more (eagerly, on the same padded step) and calls this again.
    fn graph_end(&mut self, out: &mut Vec<f32>, rows: usize) -> Result<bool> {
        let _ = (out, rows);
        Ok(true)
    }
    /// [`Backend::graph_end`] for a step whose sampling rows are all greedy: the first `rows`
    /// rows' [`Backend::greedy_ids`] into `ids` instead of their logits. `scratch` as there.
    /// The default: `graph_end` into `scratch`, then the argmax on the host.
    fn graph_end_ids(
        &mut self,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        rows: usize,
    ) -> Result<bool> {
        greedy::host_graph_end_ids(self, scratch, ids, rows)
    }
    /// Drops every captured graph and the persistent buffers' contents (graphs switched off).
    fn graph_reset(&mut self) {}
    /// Queues the addition of `module`'s exchange deltas, packed rows `first..`, into rows
    /// `rows` of `y` (after [`Backend::wait_workers_device`] for their step).
    fn merge_rows_device(
        &mut self,
        y: &mut Self::Buf,
        width: usize,
        module: LoraModule,
        rows: &[Range<usize>],
        first: usize,
    ) -> Result<()> {
        let _ = (y, width, module, rows, first);
        Err(no_device_exchange())
    }
}

/// The error of the device-exchange ops on a backend that maps none.
fn no_device_exchange() -> crate::error::RuntimeError {
    crate::error::RuntimeError::Backend(
        "this backend has no device-mapped CPU-assist exchange; use export_rows / merge_rows"
            .into(),
    )
}

/// Which device `--device` asks for.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    /// CUDA when built with the `cuda` feature and a GPU is present, else CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            _ => Err(format!("unknown device `{s}`; expected auto, cpu or cuda")),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        })
    }
}

/// Stands in for `cuda::CudaDevice` when the `cuda` feature is off: it has no values, so
/// [`Device::Cuda`] cannot be constructed and matching it is statically unreachable.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoCuda {}

#[cfg(feature = "cuda")]
pub use cuda::CudaDevice;
/// The CUDA device type of this build ([`NoCuda`] without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub type CudaDevice = NoCuda;

/// The device a [`DeviceKind`] resolved to; the caller builds the matching backend
/// (`CpuBackend`, or `cuda::CudaBackend` for the device's ordinal).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(CudaDevice),
}

/// Whether the CUDA backend can run here: built with `cuda` and libcuda loads and reports a
/// device. Checks for the library before any CUDA call, so it never panics.
pub fn cuda_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::cuda_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

impl DeviceKind {
    /// Picks the device: `Cuda` fails with a message saying what to do when it cannot be used;
    /// `Auto` falls back to the CPU.
    pub fn resolve(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Auto if !cuda_available() => Ok(Device::Cpu),
            Self::Auto | Self::Cuda => {
                #[cfg(feature = "cuda")]
                {
                    Ok(Device::Cuda(cuda::probe(0)?))
                }
                #[cfg(not(feature = "cuda"))]
                {
                    Err(crate::error::RuntimeError::Backend(
                        "--device cuda, but this thaw was built without the `cuda` feature; \
                         rebuild with `cargo build --release --features cuda` or use --device cpu"
                            .into(),
                    ))
                }
            }
        }
    }
}

/// Deterministic values in [-0.5, 0.5) for the backends' tests: `n` per call, from a 32-bit
/// LCG seeded with `seed`.
#[cfg(test)]
pub(crate) fn test_values(mut seed: u32) -> impl FnMut(usize) -> Vec<f32> {
    move |n| {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }
}

/// A rank-`r` adapter on `targets` of every layer of `c`, random f32 factors from
/// [`test_values`] (`seed`), alpha `3r`; for the backends' tests.
#[cfg(test)]
pub(crate) fn test_adapter(
    c: &crate::model::ModelConfig,
    r: usize,
    targets: &[LoraModule],
    seed: u32,
) -> LoraAdapter {
    use safetensors::{tensor::TensorView, Dtype, SafeTensors};
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
    let config = crate::adapter::AdapterConfig::from_json(&json).unwrap();
    LoraAdapter::from_parts(config, &st, c).unwrap()
}

#[cfg(test)]
#[path = "stored_dtype_tests.rs"]
mod stored_dtype_tests;

/// The LoRA half of [`Backend::linear_group_lora`]'s default: `outs[i] += LoRA(x)` through
/// [`Backend::lora`] for each site (nothing when no row has an adapter). Shared with wrappers
/// that time the base products their own way ([`profiled::Profiled`]).
pub(crate) fn lora_sites<B: Backend + ?Sized, const N: usize>(
    b: &mut B,
    x: &B::Buf,
    outs: [&mut B::Buf; N],
    sites: [LoraSite; N],
    batch: &LoraBatch<'_, B::Lora>,
) {
    if batch.layout.segments.is_empty() {
        return;
    }
    for (o, s) in outs.into_iter().zip(sites) {
        b.lora(x, o, s.dims, (s.layer, s.module), batch);
    }
}

/// [`Backend::gated_mlp_in`]'s default: [`Backend::linear_group_lora`], then
/// [`Backend::swiglu`] (also the CUDA backend's f32 path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gate_up_then_swiglu<B: Backend + ?Sized>(
    b: &mut B,
    x: &B::Buf,
    ws: [&B::Linear; 2],
    rows: usize,
    [gate, up]: [&mut B::Buf; 2],
    sites: [LoraSite; 2],
    batch: &LoraBatch<'_, B::Lora>,
    act: &mut B::Buf,
) {
    b.linear_group_lora(x, ws, rows, [&mut *gate, &mut *up], sites, batch);
    b.swiglu(gate, up, rows * sites[0].dims.d_out, act);
}

/// [`Backend::rope_attention`]'s default: RoPE on q (`heads.0` heads) and k (`heads.1`), then
/// attention, as three ops.
pub(crate) fn rope_then_attention<B: Backend + ?Sized>(
    b: &mut B,
    (q, k, v): (&mut B::Buf, &mut B::Buf, &B::Buf),
    heads: (usize, usize),
    kv: &mut B::KvLayer,
    step: &StepLayout,
    out: &mut B::Buf,
) {
    b.rope(q, &step.positions, heads.0);
    b.rope(k, &step.positions, heads.1);
    b.attention(q, k, v, kv, step, out);
}

/// [`Backend::qkv_attention`]'s default: [`Backend::linear_group_lora`], then
/// [`Backend::rope_attention`] (also the CUDA backend's f32 path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_then_rope_attention<B: Backend + ?Sized>(
    b: &mut B,
    x: &B::Buf,
    ws: [&B::Linear; 3],
    [q, k, v]: [&mut B::Buf; 3],
    sites: [LoraSite; 3],
    batch: &LoraBatch<'_, B::Lora>,
    heads: (usize, usize),
    kv: &mut B::KvLayer,
    step: &StepLayout,
    out: &mut B::Buf,
) {
    let rows = step.rows();
    b.linear_group_lora(x, ws, rows, [&mut *q, &mut *k, &mut *v], sites, batch);
    b.rope_attention((q, k, v), heads, kv, step, out);
}
