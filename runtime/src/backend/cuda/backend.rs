//! [`CudaBackend`]: the [`Backend`] ops on one GPU.
//!
//! The trait's ops return `()`, so a failing launch cannot be reported where it happens: the
//! first error is kept (later ops of the step are skipped) and [`CudaBackend::check`] returns
//! it; `logits`, the one op whose output the host reads, panics with it rather than hand back
//! logits that were never computed.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use thaw_kernels::cpu::{KvLayout, RopeTable};

use super::encode::encode;
use super::gemv::GemvTake;
use super::launch::{AttnShape, EpilogueBias, Gpu};
use super::step::{AttnMeta, DevVec, LoraMeta};
use super::upload::CudaCopy;
use super::weights::{
    upload_bytes, weight_dtype, CudaLinear, CudaLora, CudaVector, LoraPlan, WeightBytes,
};
use super::{CudaError, DType};
use crate::adapter::{LoraAdapter, LoraModule};
use crate::backend::act16_plan::Act16Plan;
use crate::backend::{
    lora_sites, Backend, LinearDims, LoraBatch, LoraKernel, LoraLoad, LoraSite, PagePlace,
    StepLayout,
};
use crate::error::Result;
use crate::ids::LayerIdx;
use crate::model::ModelConfig;
use crate::residency::LoadPriority;
use crate::upload::UploadPipeline;

/// Device, dtypes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Dtype weights, norms and adapters are stored in (converted from f32 on upload).
    pub weight_dtype: DType,
    /// Dtype of the paged KV cache.
    pub kv_dtype: DType,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            ordinal: 0,
            weight_dtype: DType::Bf16,
            kv_dtype: DType::Bf16,
        }
    }
}

/// One layer's paged K and V in the KV dtype.
pub struct CudaKvLayer {
    pub(super) k: CudaSlice<u8>,
    pub(super) v: CudaSlice<u8>,
    pub layout: KvLayout,
    pub num_blocks: usize,
}

impl CudaKvLayer {
    /// Device bytes of the K (and of the V) tensor.
    pub fn tensor_bytes(&self) -> (usize, usize) {
        (self.k.len(), self.v.len())
    }
}

/// Which per-step metadata is current (reset by `embed`, the first op of every forward).
#[derive(Default)]
struct Fresh {
    positions: bool,
    attn: bool,
    lora: bool,
}

/// The CUDA backend for one model shape on one device.
pub struct CudaBackend {
    pub(super) gpu: Gpu,
    pub(super) inv_freq: CudaSlice<f32>,
    pub(super) n_heads: usize,
    pub(super) n_kv_heads: usize,
    pub(super) head_dim: usize,
    window: usize,
    fresh: Fresh,
    ids: DevVec<u32>,
    pub(super) positions: DevVec<u32>,
    pub(super) gather: DevVec<u32>,
    pub(super) attn: AttnMeta,
    pub(super) lora_meta: LoraMeta,
    pub(super) x16: Option<CudaSlice<u16>>,
    /// A grouped product's `[rows, Σ d_out]` output before its split (`group.rs`).
    pub(super) group_out: Option<CudaSlice<f32>>,
    /// Which buffer `x16` mirrors after a fused SwiGLU (`fused.rs`).
    pub(super) x16_tag: Option<super::fused::X16Tag>,
    /// The 16-bit gate and up outputs of the act16 path (`act16.rs`).
    pub(super) act16_scratch: super::act16::Act16Scratch,
    /// The 16-bit q/k/v products and their RoPE kernel (`attn16.rs`).
    pub(super) attn16: super::attn16::Attn16,
    /// Ops run so far (every trait op counts one): an [`X16Tag`](super::fused::X16Tag) serves
    /// only the op right after it.
    ops: u64,
    pub(super) lora_v: Option<CudaSlice<f32>>,
    pub(super) logits_dev: Option<CudaSlice<f32>>,
    pub(super) export_idx: DevVec<u32>,
    pub(super) merge_idx: DevVec<u32>,
    /// Host rows staged for the trait's synchronous export / merge.
    pub(super) host_rows: DevVec<f32>,
    /// Which step adapters the current LoRA metadata treats as on the device.
    lora_on_device: Vec<bool>,
    on_device_scratch: Vec<bool>,
    /// The upload pipeline every adapter goes through, `cached` ones included (see
    /// [`CudaBackend::start_upload`]); set once, on first use if not at start-up.
    pub(super) upload: OnceLock<UploadPipeline<CudaCopy>>,
    pub(super) export_counter: CudaSlice<u32>,
    /// The worker pool's exchange, registered for the engine's assist path.
    pub(super) assist_ex: Option<super::exchange::EngineExchange>,
    /// Row indices of the assist path's export / merge (reused).
    pub(super) row_list: Vec<usize>,
    pub(super) error: Option<CudaError>,
    /// CUDA graphs of decode steps (`graph.rs`).
    pub(super) graphs: super::graph::Graphs,
    /// KV layers allocated so far: a captured graph holds the KV cache's addresses.
    pub(super) kv_allocs: AtomicU64,
    /// Timing events of the op profile's marks (`op_clock.rs`).
    pub(super) marks: super::op_clock::MarkPool,
}

impl CudaBackend {
    /// Creates the context, compiles (or reuses) every kernel and uploads the RoPE table.
    pub fn new(model: &ModelConfig, cfg: &CudaConfig) -> Result<Self> {
        Ok(Self::try_new(model, cfg)?)
    }

    fn try_new(c: &ModelConfig, cfg: &CudaConfig) -> Result<Self, CudaError> {
        if c.head_dim > thaw_kernels::cuda::registry::shape::MAX_HEAD_DIM {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} is above the CUDA attention kernels' limit of {}",
                c.head_dim,
                thaw_kernels::cuda::registry::shape::MAX_HEAD_DIM
            )));
        }
        let gpu = Gpu::new(cfg.ordinal, cfg.weight_dtype, cfg.kv_dtype)?;
        let rope = RopeTable::new(c.head_dim, c.rope_theta, &c.rope_scaling);
        let inv_freq = gpu.stream.clone_htod(rope.inv_freq())?;
        let export_counter = gpu.stream.alloc_zeros::<u32>(1)?;
        let mut b = Self {
            inv_freq,
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.sliding_window.unwrap_or(0),
            fresh: Fresh::default(),
            ids: DevVec::new(),
            positions: DevVec::new(),
            gather: DevVec::new(),
            attn: AttnMeta::new(),
            lora_meta: LoraMeta::new(),
            x16: None,
            group_out: None,
            x16_tag: None,
            act16_scratch: Default::default(),
            attn16: Default::default(),
            ops: 0,
            lora_v: None,
            logits_dev: None,
            export_idx: DevVec::new(),
            merge_idx: DevVec::new(),
            host_rows: DevVec::new(),
            lora_on_device: Vec::new(),
            on_device_scratch: Vec::new(),
            upload: OnceLock::new(),
            export_counter,
            assist_ex: None,
            row_list: Vec::new(),
            error: None,
            graphs: Default::default(),
            kv_allocs: AtomicU64::new(0),
            marks: Default::default(),
            gpu,
        };
        b.load_kernels(c)?;
        Ok(b)
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> String {
        self.gpu
            .ctx
            .name()
            .unwrap_or_else(|e| format!("<unknown: {e}>"))
    }

    /// Copies host f32 values to a new device buffer (tests, benchmarks).
    pub fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        let g = &self.gpu;
        let mut d = g.alloc_zeros::<f32>(v.len().max(1))?;
        if !v.is_empty() {
            g.htod(v, &mut d)?;
        }
        Ok(d)
    }

    /// The first `n` values of a device buffer (synchronises the compute stream).
    pub fn download_f32(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0; n];
        if n > 0 {
            self.gpu.dtoh(&b.slice(..n), &mut out[..])?;
        }
        self.gpu.sync()?;
        Ok(out)
    }

    /// The compute stream (benchmarks time work on it with events).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// The first error since the last check, if any (ops after it were skipped).
    pub fn check(&mut self) -> Result<()> {
        match self.error.take() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Marks the per-step metadata (positions, block tables, LoRA segments) stale, so the next
    /// op that needs it rebuilds it. `embed`, the first op of every forward, does this; callers
    /// that drive single ops (tests, benchmarks) call it between steps, or the ops reuse the
    /// last step's metadata, adapter table addresses included.
    pub fn begin_step(&mut self) {
        self.fresh = Fresh::default();
    }

    /// The dtypes weights (and adapters) and the KV cache are held in on the device.
    pub fn dtypes(&self) -> (DType, DType) {
        (self.gpu.weight_dtype, self.gpu.kv_dtype)
    }

    /// Waits for all queued work.
    pub fn synchronize(&mut self) -> Result<()> {
        let r = self.gpu.sync();
        self.record(r);
        self.check()
    }

    /// Keeps the first error.
    pub(super) fn record(&mut self, r: Result<(), CudaError>) {
        if let Err(e) = r {
            tracing::error!("CUDA backend: {e}");
            self.error.get_or_insert(e);
        }
    }

    pub(super) fn failed(&self) -> bool {
        self.error.is_some()
    }

    pub(super) fn ensure_positions(&mut self, positions: &[usize]) -> Result<(), CudaError> {
        if !self.fresh.positions {
            self.positions.host.clear();
            self.positions
                .host
                .extend(positions.iter().map(|&p| p as u32));
            self.positions.upload(&self.gpu)?;
            self.fresh.positions = true;
        }
        Ok(())
    }

    pub(super) fn lora_scratch(&mut self, n: usize) -> Result<(), CudaError> {
        if self.lora_v.as_ref().is_none_or(|v| v.len() < n) {
            self.lora_v = Some(self.gpu.alloc_zeros::<f32>(n.next_power_of_two())?);
        }
        Ok(())
    }

    /// Builds the step's LoRA metadata for `layer` (at most once per layer): adapters whose
    /// layer has not landed are computed elsewhere (CPU assist) this step.
    pub(super) fn lora_meta_for(
        &mut self,
        layer: LayerIdx,
        batch: &LoraBatch<'_, CudaLora>,
    ) -> Result<(), CudaError> {
        // The set only changes at layer boundaries, so metadata is rebuilt at most per layer.
        let mut on = std::mem::take(&mut self.on_device_scratch);
        on.clear();
        on.extend((0..batch.adapters.len()).map(|i| batch.on_device(i as u32, layer)));
        if !self.fresh.lora || on != self.lora_on_device {
            self.lora_meta
                .build(&self.gpu, batch.layout, batch.adapters, &on)?;
            self.fresh.lora = true;
            std::mem::swap(&mut self.lora_on_device, &mut on);
        }
        self.on_device_scratch = on;
        Ok(())
    }

    /// The largest rank of `at` over the step's on-device adapters (after
    /// [`Self::lora_meta_for`]); 0 when none targets it.
    pub(super) fn lora_max_rank(
        &self,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, CudaLora>,
    ) -> usize {
        batch
            .adapters
            .iter()
            .zip(&self.lora_on_device)
            .filter(|(_, &on)| on)
            .map(|(a, _)| a.rank(at.0 .0, at.1))
            .max()
            .unwrap_or(0)
    }

    fn try_lora(
        &mut self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, CudaLora>,
    ) -> Result<(), CudaError> {
        if let Some(a) = self.graphs.active() {
            return self.graph_lora(a, x, y, dims, at);
        }
        self.lora_meta_for(at.0, batch)?;
        let rows = batch.layout.row_adapter.len();
        let max_rank = self.lora_max_rank(at, batch);
        if max_rank == 0 {
            return Ok(());
        }
        let slot = at.0 .0 * 7 + at.1.index();
        let v_len =
            (self.gpu).lora_v_len(batch.kernel, &self.lora_meta, rows, max_rank, dims.d_in)?;
        self.lora_scratch(v_len)?;
        let v = self.lora_v.as_mut().expect("sized above");
        let m = &self.lora_meta;
        if self.gpu.punica.is_some() {
            let k = batch.kernel;
            return (self.gpu).punica_lora(k, x, y, v, m, rows, slot, dims, max_rank);
        }
        match batch.kernel {
            LoraKernel::Sgmv => self.gpu.sgmv(
                x,
                y,
                v,
                m.seg_tables.get(),
                m.seg_rows.get(),
                (m.n_segs(), m.max_seg_rows()),
                slot,
                (dims.d_in, dims.d_out, max_rank),
            ),
            LoraKernel::Bgmv => self.gpu.bgmv(
                x,
                y,
                v,
                m.row_tables.get(),
                rows,
                slot,
                (dims.d_in, dims.d_out, max_rank),
            ),
        }
    }

    /// The attention geometry of this backend's model over cache `kv`.
    pub(super) fn attn_shape(&self, kv: &CudaKvLayer) -> AttnShape {
        AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            block_size: kv.layout.block_size,
            window: self.window,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// Builds and uploads this step's attention metadata unless it is current.
    pub(super) fn attn_prepare(
        &mut self,
        step: &StepLayout,
        kv: &CudaKvLayer,
    ) -> Result<(), CudaError> {
        if !self.fresh.attn {
            let tile_rows = self.gpu.prefill_tile_rows();
            self.attn.build(
                &self.gpu,
                step,
                (kv.layout.block_size, kv.num_blocks),
                tile_rows,
            )?;
            self.fresh.attn = true;
        }
        Ok(())
    }

    fn try_attention(
        &mut self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let s = self.attn_shape(kv);
        if let Some(a) = self.graphs.active() {
            return self.graph_attention(a, (q, k, v), kv, out, s);
        }
        self.attn_prepare(step, kv)?;
        let rows = step.rows();
        let tl = kv.layout.token_len();
        self.gpu
            .write_kv(k, v, &mut kv.k, &mut kv.v, &self.attn.slots(), rows, tl)?;
        self.attend(q, kv, out.into(), s)
    }

    /// Paged decode and prefill attention over the step's rows, whose K/V are in the cache
    /// (eager steps; metadata from [`CudaBackend::attn_prepare`]), into `out` (f32, or the
    /// 16-bit GEMM input: `attn_out.rs`).
    pub(super) fn attend(
        &mut self,
        q: &CudaSlice<f32>,
        kv: &CudaKvLayer,
        mut out: super::attn_out::AttnOut<'_>,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let a = &mut self.attn;
        let o = out.reborrow();
        if self.gpu.occupancy.is_some() {
            self.gpu.attn_decode_occupancy(q, (&kv.k, &kv.v), o, a, s)?;
        } else if self.gpu.flash.is_some() {
            self.gpu.attn_decode_split(q, (&kv.k, &kv.v), o, a, s)?;
        } else {
            self.gpu.attn_decode(
                q,
                &kv.k,
                &kv.v,
                o,
                &a.tables(),
                &a.decode(),
                a.n_decode(),
                s,
            )?;
        }
        if self.gpu.tc_prefill.is_some() {
            return self.gpu.attn_prefill_tc(
                q,
                (&kv.k, &kv.v),
                out,
                &a.tables(),
                &a.tiles(),
                a.n_tiles(),
                s,
            );
        }
        self.gpu.attn_prefill(
            q,
            &kv.k,
            &kv.v,
            out,
            &a.tables(),
            &a.tiles(),
            a.n_tiles(),
            s,
        )
    }

    pub(super) fn try_linear(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaLinear,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let gemv = (self.gpu).gemv_takes(x, &w.w.view(), rows, w.d_in, w.d_out);
        self.try_linear_by(x, w, rows, out, gemv)
    }

    /// [`CudaBackend::try_linear`] with the GEMV decision already taken (`gemv.rs`); the bias
    /// in cuBLASLt's epilogue where cuBLASLt runs the product, else by `add_bias`.
    pub(super) fn try_linear_by(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaLinear,
        rows: usize,
        out: &mut CudaSlice<f32>,
        gemv: Option<GemvTake>,
    ) -> Result<(), CudaError> {
        let eb = self.epilogue_bias(w, gemv.is_some());
        self.linear_view(x, &w.w.view(), rows, w.d_in, w.d_out, out, gemv, eb)?;
        self.add_bias_unless_fused(w, eb, rows, out)
    }

    /// The tag of `x16` after a linear read `x_len` values of `x` and wrote `out_len` of `out`:
    /// with 16-bit weights it holds their cast, which stays valid while `x` is unchanged, so
    /// only where `out` does not overlap `x` ([`super::fused::ranges_overlap`]).
    fn cast_kept(
        &self,
        x: &CudaSlice<f32>,
        x_len: usize,
        out: &CudaSlice<f32>,
        out_len: usize,
    ) -> Option<super::fused::X16Tag> {
        let (xp, op) = (self.gpu.p(x), self.gpu.p(out));
        let f = std::mem::size_of::<f32>() as u64;
        let overlap =
            super::fused::ranges_overlap((xp, x_len as u64 * f), (op, out_len as u64 * f));
        (self.gpu.weight_dtype != super::DType::F32 && self.x16.is_some() && !overlap).then_some(
            super::fused::X16Tag {
                ptr: xp,
                len: x_len,
                at: self.ops,
            },
        )
    }

    /// out = x · Wᵀ for the `[d_out, d_in]` matrix `w`: the small-batch GEMV over `x` where
    /// `gemv` says so (the caller's `Gpu::gemv_takes`, `gemv.rs`), else the input's 16-bit copy
    /// from a fused SwiGLU where its tag serves this op, else a cast of `x`; `bias` added by
    /// cuBLASLt's epilogue (made by [`CudaBackend::epilogue_bias`], so only where cuBLASLt runs
    /// the product), `None` for none.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_view(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaView<'_, u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: &mut CudaSlice<f32>,
        gemv: Option<GemvTake>,
        bias: Option<EpilogueBias>,
    ) -> Result<(), CudaError> {
        let tag = self.x16_tag.take();
        if let Some(take) = gemv {
            debug_assert!(
                bias.is_none(),
                "the GEMV goes first (lt_plan::product_path)"
            );
            return self.gpu.gemv_linear(take, x, w, out);
        }
        let served = tag.is_some_and(|t| t.serves(self.gpu.p(x), rows * d_in, self.ops));
        match (&self.x16, served) {
            (Some(x16), true) => self
                .gpu
                .linear_from_x16(x16, w, rows, d_in, d_out, out, bias),
            _ => (self.gpu).linear(x, w, rows, d_in, d_out, out, &mut self.x16, bias),
        }
    }

    fn try_logits(
        &mut self,
        x: &CudaSlice<f32>,
        head: &CudaLinear,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        if let Some(a) = self.graphs.active() {
            return self.graph_logits(a, x, head);
        }
        let n = rows * head.d_out;
        out.resize(n, 0.0);
        if n == 0 {
            return Ok(());
        }
        if self.logits_dev.as_ref().is_none_or(|l| l.len() < n) {
            self.logits_dev = Some(self.gpu.stream.alloc_zeros::<f32>(n)?);
        }
        let mut dev = self.logits_dev.take().expect("sized above");
        let r = self.try_linear(x, head, rows, &mut dev).and_then(|()| {
            self.gpu.stream.memcpy_dtoh(&dev.slice(..n), &mut out[..])?;
            self.gpu.stream.synchronize()?;
            Ok(())
        });
        self.logits_dev = Some(dev);
        r
    }
}

/// Runs `$body` (a `Result<(), CudaError>`) unless an earlier op failed; keeps its error.
macro_rules! op {
    ($self:ident, $body:expr) => {{
        $self.ops += 1;
        if !$self.failed() {
            let r = $body;
            $self.record(r);
        }
    }};
}

impl CudaBackend {
    /// The LoRA half of [`Backend::linear_group_lora`]: `outs[i] += LoRA(x)` for each site, as
    /// one launch pair over the sites with `THAW_CUDA_LORA_SLICES=1` where it applies
    /// (`lora_slices.rs`), else per module. Errors are kept for [`CudaBackend::check`] as any
    /// op's are (public for the parity tests and benchmarks).
    pub fn lora_group<const N: usize>(
        &mut self,
        x: &CudaSlice<f32>,
        mut outs: [&mut CudaSlice<f32>; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, CudaLora>,
    ) {
        if self.gpu.slices.is_some() && !batch.layout.segments.is_empty() {
            let mut done = false;
            op!(self, {
                (self.try_lora_slices(x, &mut outs, &sites, batch)).map(|d| done = d)
            });
            if done || self.failed() {
                return;
            }
        }
        lora_sites(self, x, outs, sites, batch);
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Linear = CudaLinear;
    type Vector = CudaVector;
    type Lora = CudaLora;
    type KvLayer = CudaKvLayer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.alloc_zeros::<f32>(len.max(1))?)
    }

    fn upload_linear(
        &self,
        w: Vec<f32>,
        d_out: usize,
        d_in: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<CudaLinear> {
        assert_eq!(w.len(), d_out * d_in, "linear weight is not [d_out, d_in]");
        let dt = self.gpu.weight_dtype;
        let s = &self.gpu.stream;
        Ok(CudaLinear {
            w: WeightBytes::own(upload_bytes(s, &encode(&w, dt))?),
            bias32: self.lt_bias(bias.as_deref())?,
            bias: bias.map(|b| upload_bytes(s, &encode(&b, dt))).transpose()?,
            d_out,
            d_in,
        })
    }

    /// A weight stored in the compute dtype (a bf16 checkpoint on a bf16 backend) goes to the
    /// device as its bytes: no f32 copy of the model on the host, no conversion pass. A 7B
    /// bf16 model otherwise widened 13.5 GB to 27 GB of f32 and narrowed it back at start-up.
    fn upload_weight(
        &self,
        w: thaw_kernels::cpu::WeightMatrix,
        bias: Option<Vec<f32>>,
    ) -> Result<CudaLinear> {
        let (d_out, d_in) = (w.rows(), w.cols());
        let dt = self.gpu.weight_dtype;
        let Some(bytes) = super::weights::stored_bytes(&w, dt) else {
            return self.upload_linear(w.into_f32(), d_out, d_in, bias);
        };
        let s = &self.gpu.stream;
        Ok(CudaLinear {
            w: WeightBytes::own(upload_bytes(s, bytes)?),
            bias32: self.lt_bias(bias.as_deref())?,
            bias: bias.map(|b| upload_bytes(s, &encode(&b, dt))).transpose()?,
            d_out,
            d_in,
        })
    }

    fn upload_weight_group(
        &self,
        ws: Vec<(thaw_kernels::cpu::WeightMatrix, Option<Vec<f32>>)>,
    ) -> Result<Vec<CudaLinear>> {
        self.try_upload_group(ws)
    }

    fn upload_vector(&self, v: Vec<f32>) -> Result<CudaVector> {
        Ok(CudaVector {
            len: v.len(),
            v: upload_bytes(&self.gpu.stream, &encode(&v, self.gpu.weight_dtype))?,
        })
    }

    /// The `cached` path: the same pipeline as a streamed adapter, at demand priority. The
    /// adapter's layers land asynchronously; the `cached` policy holds its requests until they
    /// have (and [`CudaBackend::wait_landed`] waits for them in tests).
    fn upload_lora(&self, adapter: Arc<LoraAdapter>) -> Result<CudaLora> {
        self.try_stream_lora(&adapter, LoadPriority::Demand, None)
    }

    fn stream_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<CudaLora> {
        self.try_stream_lora(&adapter, LoadPriority::Demand, None)
    }

    fn prefetch_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<CudaLora> {
        self.try_stream_lora(&adapter, LoadPriority::Prefetch, None)
    }

    /// Adapter images live in the KV cache's blocks (the one device budget), not in
    /// allocations of their own; `None` (an allocation of its own) only where the KV block's
    /// bytes are off the 256-byte grid.
    fn lora_pages(&self, adapter: &LoraAdapter, layout: KvLayout) -> Option<usize> {
        let dt = weight_dtype(self.gpu.weight_dtype);
        LoraPlan::of_paged(adapter, Some(dt), self.kv_chunk(layout)).map(|(n, _)| n)
    }

    fn load_lora_paged(
        &mut self,
        adapter: Arc<LoraAdapter>,
        load: LoraLoad,
        place: PagePlace<'_, CudaKvLayer>,
    ) -> Result<CudaLora> {
        // `cached` (Whole) goes through the same pipeline at demand priority.
        let class = match load {
            LoraLoad::Whole => LoadPriority::Demand,
            LoraLoad::Stream(c) => c,
        };
        self.try_stream_lora(&adapter, class, Some(place))
    }

    fn promote_lora(&mut self, lora: &CudaLora) {
        if let (Some(u), Some(l)) = (self.upload.get(), &lora.landing) {
            u.promote(l);
        }
    }

    fn landed_layers(&self, lora: &CudaLora) -> usize {
        lora.landed_layers()
    }

    fn lora_failure(&self, lora: &CudaLora) -> Option<String> {
        lora.landing
            .as_ref()
            .and_then(|l| l.failure())
            .map(str::to_string)
    }

    fn rebind_lora(&mut self, old: &Arc<LoraAdapter>, new: &Arc<LoraAdapter>) {
        if let Some(u) = self.upload.get() {
            u.rebind(old, new);
        }
    }

    fn stage_lora(&mut self, adapter: &Arc<LoraAdapter>, layout: KvLayout) -> usize {
        // The image the engine's paged load of it would copy (`paged_dst`), so that load
        // finds it complete and only copies.
        let dt = weight_dtype(self.gpu.weight_dtype);
        let Some((_, plan)) = LoraPlan::of_paged(adapter, Some(dt), self.kv_chunk(layout)) else {
            return 0;
        };
        match self.upload() {
            Ok(p) => p.stage(adapter, &plan, Some(dt)),
            Err(e) => {
                tracing::warn!("adapter upload pipeline: {e}");
                0
            }
        }
    }

    fn upload_arena(&self) -> Option<crate::upload::ArenaUsage> {
        self.upload.get().map(UploadPipeline::arena_usage)
    }

    fn lora_dtype(&self) -> Option<crate::adapter::WeightDtype> {
        Some(super::weights::weight_dtype(self.gpu.weight_dtype))
    }

    fn kv_elem_bytes(&self) -> usize {
        self.gpu.kv_dtype.size()
    }

    fn alloc_kv_layer(&self, layout: KvLayout, num_blocks: usize) -> Result<CudaKvLayer> {
        let bytes = (layout.block_len() * num_blocks * self.kv_elem_bytes()).max(1);
        self.kv_allocs.fetch_add(1, Ordering::Relaxed);
        let g = &self.gpu;
        Ok(CudaKvLayer {
            k: g.alloc_zeros::<u8>(bytes)?,
            v: g.alloc_zeros::<u8>(bytes)?,
            layout,
            num_blocks,
        })
    }

    fn embed(&mut self, table: &CudaLinear, ids: &[u32], out: &mut CudaSlice<f32>) {
        // The first op of every forward: the step's metadata is stale from here on.
        self.begin_step();
        if let Some(a) = self.graphs.active() {
            op!(self, self.graph_embed(a, table, out));
            return;
        }
        op!(self, {
            self.ids.host.clear();
            self.ids.host.extend_from_slice(ids);
            self.ids.upload(&self.gpu).and_then(|()| {
                (self.gpu).embed_residual(
                    &table.w.view(),
                    self.ids.get(),
                    out,
                    ids.len(),
                    table.d_in,
                )
            })
        });
    }

    fn rms_norm(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaVector,
        eps: f32,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        op!(self, {
            match (self.gpu).norm_wide(None, x, &w.v, out, None, rows, w.len, eps) {
                Ok(false) => self.gpu.rms_norm(x, &w.v, out, rows, w.len, eps),
                r => r.map(drop),
            }
        });
    }

    /// With 16-bit weights the input's cast stays in `x16` after the product; the next op, if
    /// it is a linear over the same input (k and v after q, up after gate), reads it instead
    /// of casting again (`X16Tag`, `fused.rs`): the same bits, one launch fewer.
    fn linear(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaLinear,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        // A product the small-batch GEMV takes reads `x` itself and leaves `x16` as it was:
        // no cast to keep.
        let gemv = (self.gpu).gemv_takes(x, &w.w.view(), rows, w.d_in, w.d_out);
        op!(self, self.try_linear_by(x, w, rows, out, gemv));
        if !self.failed() && gemv.is_none() {
            self.x16_tag = self.cast_kept(x, rows * w.d_in, out, rows * w.d_out);
        }
    }

    /// With `THAW_CUDA_GROUP_GEMM=1`, one op: one input cast and, for a group placed as one
    /// matrix and a step of few rows, one product (`group.rs`).
    fn linear_group<const N: usize>(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; N],
        rows: usize,
        mut outs: [&mut CudaSlice<f32>; N],
    ) {
        if self.gpu.group.is_none() || N < 2 {
            for (w, o) in ws.into_iter().zip(outs) {
                self.linear(x, w, rows, o);
            }
            return;
        }
        op!(self, self.try_linear_group(x, &ws, rows, &mut outs));
    }

    /// With `THAW_CUDA_LORA_SLICES=1`, the sites' LoRA deltas as one launch pair
    /// (`lora_slices.rs`) where it applies; per module otherwise.
    fn linear_group_lora<const N: usize>(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; N],
        rows: usize,
        mut outs: [&mut CudaSlice<f32>; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, CudaLora>,
    ) {
        self.linear_group(x, ws, rows, outs.each_mut().map(|o| &mut **o));
        self.lora_group(x, outs, sites, batch);
    }

    fn lora(
        &mut self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, CudaLora>,
    ) {
        op!(self, self.try_lora(x, y, dims, at, batch));
    }

    fn rope(&mut self, x: &mut CudaSlice<f32>, positions: &[usize], n_heads: usize) {
        if let Some(a) = self.graphs.active() {
            op!(self, self.graph_rope(a, x, n_heads));
            return;
        }
        op!(self, {
            self.ensure_positions(positions).and_then(|()| {
                let (pos, inv) = (self.positions.get(), &self.inv_freq);
                let shape = (positions.len(), n_heads, self.head_dim);
                match self.gpu.rope_wide(x, pos, inv, shape) {
                    Ok(false) => (self.gpu).rope(x, pos, inv, shape.0, n_heads, self.head_dim),
                    r => r.map(drop),
                }
            })
        });
    }

    fn rope_attention(
        &mut self,
        (q, k, v): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &CudaSlice<f32>),
        heads: (usize, usize),
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        out: &mut CudaSlice<f32>,
    ) {
        if self.gpu.rope_fold.is_none() {
            self.rope(q, &step.positions, heads.0);
            self.rope(k, &step.positions, heads.1);
            self.attention(q, k, v, kv, step, out);
            return;
        }
        op!(
            self,
            self.try_rope_attention((q, k, v), heads, kv, step, out)
        );
    }

    fn folds_rope(&self) -> bool {
        self.gpu.rope_fold.is_some()
    }

    fn attention(
        &mut self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        out: &mut CudaSlice<f32>,
    ) {
        op!(self, self.try_attention(q, k, v, kv, step, out));
    }

    /// With `THAW_CUDA_BF16_ACT=1`, q/k/v stored 16-bit and RoPE'd into the KV cache and the
    /// f32 q where the step's plan serves (`attn16.rs`; CUDA graphs without a LoRA rank class
    /// included); the products and `rope_attention` in f32 otherwise (`attn16_plan`).
    fn qkv_attention(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; 3],
        [q, k, v]: [&mut CudaSlice<f32>; 3],
        sites: [LoraSite; 3],
        batch: &LoraBatch<'_, CudaLora>,
        heads: (usize, usize),
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        out: &mut CudaSlice<f32>,
    ) {
        let plan = self.attn16_plan_for(ws, step.rows(), &sites, heads, batch);
        if plan.rounds_qkv() {
            let out16 = plan.stores_out16();
            op!(self, {
                let at = self.ops;
                let len = step.rows() * heads.0 * self.head_dim;
                let r = self.try_qkv_attention16(x, ws, heads, kv, step, (q, out), (at, out16));
                if r.is_ok() && out16 {
                    // `x16` holds the attention output in the weight dtype and `out` was not
                    // written: the next op, o_proj over `out`, reads the scratch (`attn_out.rs`).
                    self.x16_tag = Some(super::fused::X16Tag {
                        ptr: self.gpu.p(out),
                        len,
                        at,
                    });
                }
                r
            });
            return;
        }
        let qkv = [q, k, v];
        crate::backend::qkv_then_rope_attention(
            self, x, ws, qkv, sites, batch, heads, kv, step, out,
        );
    }

    fn fuses_qkv_attention(&self) -> bool {
        self.gpu.act16.is_some()
    }

    /// With `THAW_CUDA_BF16_ACT=1`, gate/up and SwiGLU in 16 bits where the step's plan
    /// serves (`act16.rs`; CUDA graphs without a LoRA rank class included); the two ops in f32
    /// otherwise (LoRA on gate/up among them: more bytes, `act16_plan`).
    fn gated_mlp_in(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; 2],
        rows: usize,
        outs: [&mut CudaSlice<f32>; 2],
        sites: [LoraSite; 2],
        batch: &LoraBatch<'_, CudaLora>,
        act: &mut CudaSlice<f32>,
    ) {
        match self.act16_plan_for(ws, rows, &sites, batch) {
            Act16Plan::Act16 { f32_copy } => op!(self, {
                let at = self.ops;
                self.try_gated_mlp_act16(x, ws, rows, f32_copy, act, at)
            }),
            Act16Plan::F32(_) => {
                crate::backend::gate_up_then_swiglu(self, x, ws, rows, outs, sites, batch, act)
            }
        }
    }

    fn fuses_gated_mlp(&self) -> bool {
        self.gpu.act16.is_some()
    }

    fn swiglu(
        &mut self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) {
        op!(self, {
            if self.gpu.fuses_swiglu() {
                let r = self.gpu.swiglu_x16(gate, up, out, &mut self.x16, len);
                if r.is_ok() {
                    self.x16_tag = Some(super::fused::X16Tag {
                        ptr: self.gpu.p(out),
                        len,
                        at: self.ops,
                    });
                }
                r
            } else {
                self.gpu.swiglu(gate, up, out, len)
            }
        });
    }

    fn add_rms_norm(
        &mut self,
        residual: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaVector,
        eps: f32,
        rows: usize,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.residual16() {
            op!(self, {
                let at = self.ops;
                self.try_add_rms_norm_h16(residual, x, w, eps, rows, out, at)
            });
            return;
        }
        if self.gpu.fused.is_none() {
            self.add(residual, x, rows * width);
            self.rms_norm(residual, w, eps, rows, out);
            return;
        }
        debug_assert_eq!(w.len, width, "add_rms_norm: norm width");
        op!(self, {
            let wide16 = self.gpu.wide_norm_x16();
            let x16 = wide16.then_some(&mut self.x16);
            let (h, v) = (&mut *residual, &w.v);
            let r = match (self.gpu).norm_wide(Some(h), x, v, out, x16, rows, w.len, eps) {
                Ok(false) => {
                    let fused16 = self.gpu.fuses_norm_x16();
                    let x16 = fused16.then_some(&mut self.x16);
                    (self.gpu)
                        .add_rms_norm(residual, x, v, out, x16, rows, w.len, eps)
                        .map(|()| fused16)
                }
                r => r.map(|ran| ran && wide16),
            };
            if let Ok(true) = r {
                // `x16` holds `out` in the weight dtype: the next op, a projection over `out`,
                // reads it instead of casting.
                self.x16_tag = Some(super::fused::X16Tag {
                    ptr: self.gpu.p(out),
                    len: rows * w.len,
                    at: self.ops,
                });
            }
            r.map(drop)
        });
    }

    fn add(&mut self, y: &mut CudaSlice<f32>, x: &CudaSlice<f32>, len: usize) {
        op!(self, self.gpu.residual_add(y, x, len));
    }

    fn gather_rows(
        &mut self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[usize],
        out: &mut CudaSlice<f32>,
    ) {
        assert!(
            rows.iter().all(|&r| (r + 1) * width <= x.len()),
            "gather_rows: a row lies outside x"
        );
        op!(self, self.try_gather(x, width, rows, out, false));
    }

    /// With the 16-bit residual (`residual16.rs`), its norm.
    fn residual_norm(
        &mut self,
        h: &CudaSlice<f32>,
        w: &CudaVector,
        eps: f32,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if !self.residual16() {
            return self.rms_norm(h, w, eps, rows, out);
        }
        op!(
            self,
            (self.gpu).rms_norm_h16(h, &w.v, out, (rows, w.len), eps)
        );
    }

    /// With the 16-bit residual, the sum rounded to it.
    fn residual_add(&mut self, h: &mut CudaSlice<f32>, x: &CudaSlice<f32>, len: usize) {
        if !self.residual16() {
            return self.add(h, x, len);
        }
        op!(self, self.gpu.residual_add_h16(h, x, len));
    }

    /// With the 16-bit residual, its rows widened to f32.
    fn gather_residual(
        &mut self,
        h: &CudaSlice<f32>,
        width: usize,
        rows: &[usize],
        out: &mut CudaSlice<f32>,
    ) {
        assert!(
            rows.iter().all(|&r| (r + 1) * width <= h.len()),
            "gather_residual: a row lies outside h"
        );
        let h16 = self.residual16();
        op!(self, self.try_gather(h, width, rows, out, h16));
    }

    fn export_rows(
        &mut self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    ) {
        op!(self, self.try_export_host(x, width, rows, dst, stride));
    }

    fn merge_rows(
        &mut self,
        y: &mut CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    ) {
        op!(self, self.try_merge_host(y, width, rows, src, stride));
    }

    unsafe fn map_assist_exchange(&mut self, ex: &thaw_ipc::Exchange) -> Result<bool> {
        // SAFETY: the caller keeps `ex` mapped until unmap_assist_exchange or our drop.
        unsafe { self.attach_exchange(ex) }?;
        Ok(true)
    }

    fn unmap_assist_exchange(&mut self) {
        self.assist_ex = None;
    }

    fn export_rows_device(
        &mut self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        seq: thaw_ipc::StepSeq,
    ) -> Result<()> {
        self.export_rows_engine(x, width, rows, seq)
    }

    fn wait_workers_device(
        &mut self,
        seq: thaw_ipc::StepSeq,
        workers: &[thaw_ipc::WorkerId],
    ) -> Result<()> {
        self.wait_workers_engine(seq, workers)
    }

    fn merge_rows_device(
        &mut self,
        y: &mut CudaSlice<f32>,
        width: usize,
        module: LoraModule,
        rows: &[Range<usize>],
        first: usize,
    ) -> Result<()> {
        self.merge_rows_engine(y, width, module, rows, first)
    }

    fn supports_graphs(&self) -> bool {
        true
    }

    fn graph_begin(
        &mut self,
        key: crate::backend::GraphKey,
        step: &StepLayout,
        lora: &LoraBatch<'_, CudaLora>,
        sizing: &crate::backend::graph_plan::GraphSizing,
    ) -> Result<Option<crate::backend::GraphPhase>> {
        let r = self.try_graph_begin(key, step, lora, sizing);
        if r.is_err() {
            self.graphs.active = None;
        }
        Ok(r?)
    }

    fn graph_end(&mut self, out: &mut Vec<f32>, rows: usize) -> Result<bool> {
        Ok(self.try_graph_end(out, rows)?)
    }

    fn graph_end_ids(
        &mut self,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        rows: usize,
    ) -> Result<bool> {
        if !self.device_argmax() {
            return crate::backend::greedy::host_graph_end_ids(self, scratch, ids, rows);
        }
        Ok(self.try_graph_end_ids(ids, rows)?)
    }

    fn graph_reset(&mut self) {
        self.graph_drop_all();
    }

    fn logits(
        &mut self,
        x: &CudaSlice<f32>,
        lm_head: &CudaLinear,
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        op!(self, self.try_logits(x, lm_head, rows, out));
        self.check_sampling_op();
    }

    fn greedy_ids(
        &mut self,
        x: &CudaSlice<f32>,
        lm_head: &CudaLinear,
        rows: usize,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
    ) {
        if !self.device_argmax() {
            return crate::backend::greedy::host_greedy_ids(self, x, lm_head, rows, scratch, ids);
        }
        op!(self, self.try_greedy_ids(x, lm_head, rows, ids));
        self.check_sampling_op();
    }
}

impl CudaBackend {
    /// After the op that brings a step's logits or ids to the host: panics with the step's
    /// error, if it had one, outside a graph step (whose errors surface in `graph_end`).
    fn check_sampling_op(&self) {
        if self.graphs.active().is_some() {
            // A graph step's errors (a failed capture among them) surface in `graph_end`.
            return;
        }
        if let Some(e) = &self.error {
            // The trait cannot return this; logits never computed must not be sampled from.
            panic!("CUDA backend failed during this step: {e}");
        }
    }
}
