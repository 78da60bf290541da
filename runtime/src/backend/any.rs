//! [`AnyBackend`]: the backend chosen at run time (`--device`), as an enum that dispatches
//! every [`Backend`] op to the CPU or the CUDA backend (candle's `Storage` over
//! `BackendStorage`). Its buffers, weights, adapters and KV layers are enums of the two
//! backends' own; one engine only ever hands a backend values it made, so a value of the
//! other variant is a bug in the caller and panics.
//!
//! Without the `cuda` feature the CUDA variants hold `NoCuda`, which has no values: every
//! match arm on them is statically unreachable, nothing panics at run time for lack of CUDA.
use std::ops::Range;
use std::sync::Arc;

use thaw_kernels::cpu::KvLayout;

use super::cpu::CpuBackend;
use super::cpu_kv::KvCacheDtype;
use super::{Backend, Device, LinearDims, LoraBatch, LoraLoad, LoraSite, PagePlace, StepLayout};
use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::Result;
use crate::ids::LayerIdx;
use crate::model::ModelConfig;
use crate::residency::LinkModel;

#[cfg(feature = "cuda")]
type Gpu = super::cuda::CudaBackend;
#[cfg(not(feature = "cuda"))]
type Gpu = super::NoCuda;

/// What the enum needs from the GPU backend beyond the trait.
pub trait GpuExtras {
    /// The host → device link adapters stream over, measured on this machine.
    fn measured_link(&self) -> LinkModel;
    /// The first error of the ops since the last check (the trait's ops return `()`).
    fn check(&mut self) -> Result<()>;
    /// Free and total bytes of the device, as the driver reports them.
    fn memory_info(&self) -> Result<(u64, u64)>;
    /// Allocates (and registers) the upload arena, `bytes`, and starts the upload pipeline.
    fn start_upload(&mut self, bytes: usize) -> Result<()>;
    /// Bytes a demand load queued now waits behind on the copy stream.
    fn link_backlog(&self) -> u64;
}

#[cfg(not(feature = "cuda"))]
impl GpuExtras for super::NoCuda {
    fn measured_link(&self) -> LinkModel {
        match *self {}
    }
    fn check(&mut self) -> Result<()> {
        match *self {}
    }
    fn memory_info(&self) -> Result<(u64, u64)> {
        match *self {}
    }
    fn start_upload(&mut self, _: usize) -> Result<()> {
        match *self {}
    }
    fn link_backlog(&self) -> u64 {
        match *self {}
    }
}

/// The host → device link a backend streams adapters over, for the cold-start cost model.
pub trait HostLink {
    /// The link's bandwidth and per-transfer latency.
    fn link(&self) -> LinkModel;
    /// Bytes queued on the link now.
    fn link_backlog(&self) -> u64;
}

impl HostLink for CpuBackend {
    fn link(&self) -> LinkModel {
        CpuBackend::link(self)
    }
    fn link_backlog(&self) -> u64 {
        CpuBackend::link_backlog(self)
    }
}

impl HostLink for AnyBackend {
    fn link(&self) -> LinkModel {
        AnyBackend::link(self)
    }
    fn link_backlog(&self) -> u64 {
        AnyBackend::link_backlog(self)
    }
}

#[cold]
fn mixed(what: &str) -> ! {
    panic!("a {what} of one backend was handed to the other (one engine, one backend)")
}

/// An enum over the two backends' values of one associated type, with accessors that panic
/// on the other variant (see the module docs).
macro_rules! either {
    ($(#[$m:meta])* $name:ident, $assoc:ident) => {
        $(#[$m])*
        pub enum $name {
            Cpu(<CpuBackend as Backend>::$assoc),
            Cuda(<Gpu as Backend>::$assoc),
        }

        // Each type is read, written or both by the ops: not every accessor is used for each.
        #[allow(dead_code)]
        impl $name {
            fn cpu(&self) -> &<CpuBackend as Backend>::$assoc {
                match self {
                    Self::Cpu(v) => v,
                    Self::Cuda(_) => mixed(stringify!($name)),
                }
            }
            fn cpu_mut(&mut self) -> &mut <CpuBackend as Backend>::$assoc {
                match self {
                    Self::Cpu(v) => v,
                    Self::Cuda(_) => mixed(stringify!($name)),
                }
            }
            fn gpu(&self) -> &<Gpu as Backend>::$assoc {
                match self {
                    Self::Cuda(v) => v,
                    Self::Cpu(_) => mixed(stringify!($name)),
                }
            }
            fn gpu_mut(&mut self) -> &mut <Gpu as Backend>::$assoc {
                match self {
                    Self::Cuda(v) => v,
                    Self::Cpu(_) => mixed(stringify!($name)),
                }
            }
        }
    };
}

either!(
    /// An activation buffer.
    AnyBuf,
    Buf
);
either!(
    /// A weight matrix.
    AnyLinear,
    Linear
);
either!(
    /// A weight vector.
    AnyVector,
    Vector
);
either!(
    /// An adapter's device copy.
    AnyLora,
    Lora
);
either!(
    /// One layer's KV storage.
    AnyKvLayer,
    KvLayer
);

/// The CPU or the CUDA backend.
// One per engine, built once and never moved on a hot path: the size difference is harmless.
#[allow(clippy::large_enum_variant)]
pub enum AnyBackend {
    Cpu(CpuBackend),
    Cuda(Box<Gpu>),
}

impl AnyBackend {
    /// The backend for `device`: the CPU one streams adapters over the emulated `link`; the
    /// CUDA one over the machine's real link (`link` is ignored).
    pub fn new(device: &Device, model: &ModelConfig, link: LinkModel) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Self::Cpu(CpuBackend::new(model).with_link(link))),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(Self::Cuda(Box::new(super::cuda::CudaBackend::new(
                model,
                &super::cuda::CudaConfig {
                    ordinal: d.ordinal,
                    ..Default::default()
                },
            )?))),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(d) => match *d {},
        }
    }

    /// Stores K and V as `dtype` (`--kv-cache-dtype`; before the engine allocates its cache).
    /// The CUDA backend keeps its cache in bf16: `auto` and `bf16` leave it, `fp16` is an
    /// error that says so.
    pub fn with_kv_cache_dtype(self, dtype: KvCacheDtype) -> Result<Self> {
        match (self, dtype) {
            (Self::Cpu(b), d) => Ok(Self::Cpu(b.with_kv_cache_dtype(d))),
            (g @ Self::Cuda(_), KvCacheDtype::Auto | KvCacheDtype::Bf16) => Ok(g),
            (Self::Cuda(_), d) => Err(crate::error::RuntimeError::Backend(format!(
                "--kv-cache-dtype {d} is not supported on the CUDA backend, which stores KV in \
                 bf16; use auto or bf16 there"
            ))),
        }
    }

    /// Allocates the upload arena once, at start-up: `bytes` (`--max-cpu-lora-bytes`) of
    /// pinned host memory (registered with the driver on CUDA), and starts the upload
    /// pipeline's loader and copy threads.
    pub fn with_upload_arena(self, bytes: usize) -> Result<Self> {
        match self {
            Self::Cpu(b) => Ok(Self::Cpu(b.with_upload_arena(bytes)?)),
            Self::Cuda(mut g) => {
                g.start_upload(bytes)?;
                Ok(Self::Cuda(g))
            }
        }
    }

    /// The host → device link the cost model plans with: the emulated one on the CPU, the
    /// measured pinned-copy bandwidth on CUDA (measured once per call: call it once).
    pub fn link(&self) -> LinkModel {
        match self {
            Self::Cpu(b) => b.link(),
            Self::Cuda(g) => g.measured_link(),
        }
    }

    /// Bytes a demand load queued now waits behind on the link (prefetches yield to it): the
    /// upload pipeline's queue, emulated link or CUDA copy stream alike.
    pub fn link_backlog(&self) -> u64 {
        match self {
            Self::Cpu(b) => b.link_backlog(),
            Self::Cuda(g) => GpuExtras::link_backlog(&**g),
        }
    }

    /// Free and total bytes of a real device (None on the CPU backend, whose device memory
    /// is an emulated budget).
    pub fn memory_info(&self) -> Result<Option<(u64, u64)>> {
        match self {
            Self::Cpu(_) => Ok(None),
            Self::Cuda(g) => g.memory_info().map(Some),
        }
    }

    /// The first error of the ops since the last check (the CPU backend's ops cannot fail).
    pub fn check(&mut self) -> Result<()> {
        match self {
            Self::Cpu(_) => Ok(()),
            Self::Cuda(g) => g.check(),
        }
    }

    /// Waits until every queued op has run (the CPU backend's ops run when called), then
    /// [`AnyBackend::check`]s: what a benchmark's wall clock needs around device work.
    pub fn synchronize(&mut self) -> Result<()> {
        match self {
            Self::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => g.synchronize(),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }

    /// Marks the per-step device metadata stale for callers that drive single ops (a forward's
    /// `embed` does it): see `CudaBackend::begin_step`. Nothing to do on the CPU.
    pub fn begin_step(&mut self) {
        match self {
            Self::Cpu(_) => {}
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => g.begin_step(),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }

    /// Which of the CUDA backend's issue-29 kernels run, the four and the nine (None on the CPU
    /// backend).
    pub fn cuda_kernels(
        &self,
    ) -> Option<(
        super::kernel_select::KernelPlan,
        super::kernel_select::OptInPlan,
    )> {
        match self {
            Self::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => Some((g.kernel_plan(), g.opt_in_plan())),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }

    /// What this backend has asked of the driver so far (running totals; see
    /// [`DeviceCounts`](super::device_counts::DeviceCounts)); `None` on the CPU backend.
    pub fn device_counts(&self) -> Option<super::device_counts::DeviceCounts> {
        match self {
            Self::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => Some(g.device_counts()),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }

    /// Bytes per element of the weights (matrices and adapters) and of the KV cache as this
    /// backend holds them, for bandwidth accounting: the CUDA backend converts both to its
    /// configured dtypes (bf16 by default); the CPU backend keeps the model's stored format
    /// (`None`: ask the model) and an f32 KV cache.
    pub fn element_bytes(&self) -> (Option<usize>, usize) {
        match self {
            Self::Cpu(_) => (None, 4),
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => {
                let (w, kv) = g.dtypes();
                (Some(w.size()), kv.size())
            }
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(g) => match **g {},
        }
    }
}

fn cpu_loras<'a>(b: &LoraBatch<'a, AnyLora>) -> Vec<&'a <CpuBackend as Backend>::Lora> {
    b.adapters.iter().map(|a| a.cpu()).collect()
}

fn gpu_loras<'a>(b: &LoraBatch<'a, AnyLora>) -> Vec<&'a <Gpu as Backend>::Lora> {
    b.adapters.iter().map(|a| a.gpu()).collect()
}

impl Backend for AnyBackend {
    type Buf = AnyBuf;
    type Linear = AnyLinear;
    type Vector = AnyVector;
    type Lora = AnyLora;
    type KvLayer = AnyKvLayer;

    fn name(&self) -> &'static str {
        match self {
            Self::Cpu(b) => b.name(),
            Self::Cuda(g) => g.name(),
        }
    }

    fn alloc(&self, len: usize) -> Result<AnyBuf> {
        Ok(match self {
            Self::Cpu(b) => AnyBuf::Cpu(b.alloc(len)?),
            Self::Cuda(g) => AnyBuf::Cuda(g.alloc(len)?),
        })
    }

    fn upload_linear(
        &self,
        w: Vec<f32>,
        d_out: usize,
        d_in: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<AnyLinear> {
        Ok(match self {
            Self::Cpu(b) => AnyLinear::Cpu(b.upload_linear(w, d_out, d_in, bias)?),
            Self::Cuda(g) => AnyLinear::Cuda(g.upload_linear(w, d_out, d_in, bias)?),
        })
    }

    fn upload_weight(
        &self,
        w: thaw_kernels::cpu::WeightMatrix,
        bias: Option<Vec<f32>>,
    ) -> Result<AnyLinear> {
        Ok(match self {
            Self::Cpu(b) => AnyLinear::Cpu(b.upload_weight(w, bias)?),
            Self::Cuda(g) => AnyLinear::Cuda(g.upload_weight(w, bias)?),
        })
    }

    fn upload_weight_group(
        &self,
        ws: Vec<(thaw_kernels::cpu::WeightMatrix, Option<Vec<f32>>)>,
    ) -> Result<Vec<AnyLinear>> {
        Ok(match self {
            Self::Cpu(b) => b
                .upload_weight_group(ws)?
                .into_iter()
                .map(AnyLinear::Cpu)
                .collect(),
            Self::Cuda(g) => g
                .upload_weight_group(ws)?
                .into_iter()
                .map(AnyLinear::Cuda)
                .collect(),
        })
    }

    fn upload_vector(&self, v: Vec<f32>) -> Result<AnyVector> {
        Ok(match self {
            Self::Cpu(b) => AnyVector::Cpu(b.upload_vector(v)?),
            Self::Cuda(g) => AnyVector::Cuda(g.upload_vector(v)?),
        })
    }

    fn upload_lora(&self, adapter: Arc<LoraAdapter>) -> Result<AnyLora> {
        Ok(match self {
            Self::Cpu(b) => AnyLora::Cpu(b.upload_lora(adapter)?),
            Self::Cuda(g) => AnyLora::Cuda(g.upload_lora(adapter)?),
        })
    }

    fn stream_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<AnyLora> {
        Ok(match self {
            Self::Cpu(b) => AnyLora::Cpu(b.stream_lora(adapter)?),
            Self::Cuda(g) => AnyLora::Cuda(g.stream_lora(adapter)?),
        })
    }

    fn prefetch_lora(&mut self, adapter: Arc<LoraAdapter>) -> Result<AnyLora> {
        Ok(match self {
            Self::Cpu(b) => AnyLora::Cpu(b.prefetch_lora(adapter)?),
            Self::Cuda(g) => AnyLora::Cuda(g.prefetch_lora(adapter)?),
        })
    }

    fn promote_lora(&mut self, lora: &AnyLora) {
        match self {
            Self::Cpu(b) => b.promote_lora(lora.cpu()),
            Self::Cuda(g) => g.promote_lora(lora.gpu()),
        }
    }

    fn landed_layers(&self, lora: &AnyLora) -> usize {
        match self {
            Self::Cpu(b) => b.landed_layers(lora.cpu()),
            Self::Cuda(g) => g.landed_layers(lora.gpu()),
        }
    }

    fn lora_failure(&self, lora: &AnyLora) -> Option<String> {
        match self {
            Self::Cpu(b) => b.lora_failure(lora.cpu()),
            Self::Cuda(g) => g.lora_failure(lora.gpu()),
        }
    }

    fn lora_pages(&self, adapter: &LoraAdapter, layout: KvLayout) -> Option<usize> {
        match self {
            Self::Cpu(b) => b.lora_pages(adapter, layout),
            Self::Cuda(g) => g.lora_pages(adapter, layout),
        }
    }

    fn load_lora_paged(
        &mut self,
        adapter: Arc<LoraAdapter>,
        load: LoraLoad,
        place: PagePlace<'_, AnyKvLayer>,
    ) -> Result<AnyLora> {
        let PagePlace { kv, lease } = place;
        Ok(match self {
            Self::Cpu(b) => {
                let kv = kv.into_iter().map(AnyKvLayer::cpu).collect();
                AnyLora::Cpu(b.load_lora_paged(adapter, load, PagePlace { kv, lease })?)
            }
            Self::Cuda(g) => {
                let kv = kv.into_iter().map(AnyKvLayer::gpu).collect();
                AnyLora::Cuda(g.load_lora_paged(adapter, load, PagePlace { kv, lease })?)
            }
        })
    }

    fn alloc_kv_layer(&self, layout: KvLayout, num_blocks: usize) -> Result<AnyKvLayer> {
        Ok(match self {
            Self::Cpu(b) => AnyKvLayer::Cpu(b.alloc_kv_layer(layout, num_blocks)?),
            Self::Cuda(g) => AnyKvLayer::Cuda(g.alloc_kv_layer(layout, num_blocks)?),
        })
    }

    fn embed(&mut self, table: &AnyLinear, ids: &[u32], out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.embed(table.cpu(), ids, out.cpu_mut()),
            Self::Cuda(g) => g.embed(table.gpu(), ids, out.gpu_mut()),
        }
    }

    fn rms_norm(&mut self, x: &AnyBuf, w: &AnyVector, eps: f32, rows: usize, out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.rms_norm(x.cpu(), w.cpu(), eps, rows, out.cpu_mut()),
            Self::Cuda(g) => g.rms_norm(x.gpu(), w.gpu(), eps, rows, out.gpu_mut()),
        }
    }

    fn residual_norm(
        &mut self,
        h: &AnyBuf,
        w: &AnyVector,
        eps: f32,
        rows: usize,
        out: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => b.residual_norm(h.cpu(), w.cpu(), eps, rows, out.cpu_mut()),
            Self::Cuda(g) => g.residual_norm(h.gpu(), w.gpu(), eps, rows, out.gpu_mut()),
        }
    }

    fn residual_add(&mut self, h: &mut AnyBuf, x: &AnyBuf, len: usize) {
        match self {
            Self::Cpu(b) => b.residual_add(h.cpu_mut(), x.cpu(), len),
            Self::Cuda(g) => g.residual_add(h.gpu_mut(), x.gpu(), len),
        }
    }

    fn gather_residual(&mut self, h: &AnyBuf, width: usize, rows: &[usize], out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.gather_residual(h.cpu(), width, rows, out.cpu_mut()),
            Self::Cuda(g) => g.gather_residual(h.gpu(), width, rows, out.gpu_mut()),
        }
    }

    fn linear(&mut self, x: &AnyBuf, w: &AnyLinear, rows: usize, out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.linear(x.cpu(), w.cpu(), rows, out.cpu_mut()),
            Self::Cuda(g) => g.linear(x.gpu(), w.gpu(), rows, out.gpu_mut()),
        }
    }

    fn linear_group<const N: usize>(
        &mut self,
        x: &AnyBuf,
        ws: [&AnyLinear; N],
        rows: usize,
        outs: [&mut AnyBuf; N],
    ) {
        match self {
            Self::Cpu(b) => b.linear_group(
                x.cpu(),
                ws.map(|w| w.cpu()),
                rows,
                outs.map(|o| o.cpu_mut()),
            ),
            Self::Cuda(g) => g.linear_group(
                x.gpu(),
                ws.map(|w| w.gpu()),
                rows,
                outs.map(|o| o.gpu_mut()),
            ),
        }
    }

    fn linear_group_lora<const N: usize>(
        &mut self,
        x: &AnyBuf,
        ws: [&AnyLinear; N],
        rows: usize,
        outs: [&mut AnyBuf; N],
        sites: [LoraSite; N],
        batch: &LoraBatch<'_, AnyLora>,
    ) {
        match self {
            Self::Cpu(b) => {
                let adapters = cpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, outs) = (ws.map(|w| w.cpu()), outs.map(|o| o.cpu_mut()));
                b.linear_group_lora(x.cpu(), ws, rows, outs, sites, &inner);
            }
            Self::Cuda(g) => {
                let adapters = gpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, outs) = (ws.map(|w| w.gpu()), outs.map(|o| o.gpu_mut()));
                g.linear_group_lora(x.gpu(), ws, rows, outs, sites, &inner);
            }
        }
    }

    fn lora(
        &mut self,
        x: &AnyBuf,
        y: &mut AnyBuf,
        dims: LinearDims,
        at: (LayerIdx, LoraModule),
        batch: &LoraBatch<'_, AnyLora>,
    ) {
        match self {
            Self::Cpu(b) => {
                let adapters = cpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                b.lora(x.cpu(), y.cpu_mut(), dims, at, &inner);
            }
            Self::Cuda(g) => {
                let adapters = gpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                g.lora(x.gpu(), y.gpu_mut(), dims, at, &inner);
            }
        }
    }

    fn kv_elem_bytes(&self) -> usize {
        match self {
            Self::Cpu(b) => b.kv_elem_bytes(),
            Self::Cuda(g) => g.kv_elem_bytes(),
        }
    }

    fn rebind_lora(&mut self, old: &Arc<LoraAdapter>, new: &Arc<LoraAdapter>) {
        match self {
            Self::Cpu(b) => b.rebind_lora(old, new),
            Self::Cuda(g) => g.rebind_lora(old, new),
        }
    }

    fn stage_lora(&mut self, adapter: &Arc<LoraAdapter>, layout: KvLayout) -> usize {
        match self {
            Self::Cpu(b) => b.stage_lora(adapter, layout),
            Self::Cuda(g) => g.stage_lora(adapter, layout),
        }
    }

    fn upload_arena(&self) -> Option<crate::upload::ArenaUsage> {
        match self {
            Self::Cpu(b) => b.upload_arena(),
            Self::Cuda(g) => g.upload_arena(),
        }
    }

    fn lora_dtype(&self) -> Option<crate::adapter::WeightDtype> {
        match self {
            Self::Cpu(b) => b.lora_dtype(),
            Self::Cuda(g) => g.lora_dtype(),
        }
    }

    fn set_cpu_assist(&mut self, in_flight: bool) {
        match self {
            Self::Cpu(b) => b.set_cpu_assist(in_flight),
            Self::Cuda(g) => g.set_cpu_assist(in_flight),
        }
    }

    fn step_running(&mut self, running: bool) {
        match self {
            Self::Cpu(b) => b.step_running(running),
            Self::Cuda(g) => g.step_running(running),
        }
    }

    unsafe fn map_assist_exchange(&mut self, ex: &thaw_ipc::Exchange) -> Result<bool> {
        match self {
            // SAFETY: the caller's contract, forwarded.
            Self::Cpu(b) => unsafe { b.map_assist_exchange(ex) },
            // SAFETY: the caller's contract, forwarded.
            Self::Cuda(g) => unsafe { g.map_assist_exchange(ex) },
        }
    }

    fn unmap_assist_exchange(&mut self) {
        match self {
            Self::Cpu(b) => b.unmap_assist_exchange(),
            Self::Cuda(g) => g.unmap_assist_exchange(),
        }
    }

    fn export_rows_device(
        &mut self,
        x: &AnyBuf,
        width: usize,
        rows: &[Range<usize>],
        seq: thaw_ipc::StepSeq,
    ) -> Result<()> {
        match self {
            Self::Cpu(b) => b.export_rows_device(x.cpu(), width, rows, seq),
            Self::Cuda(g) => g.export_rows_device(x.gpu(), width, rows, seq),
        }
    }

    fn wait_workers_device(
        &mut self,
        seq: thaw_ipc::StepSeq,
        workers: &[thaw_ipc::WorkerId],
    ) -> Result<()> {
        match self {
            Self::Cpu(b) => b.wait_workers_device(seq, workers),
            Self::Cuda(g) => g.wait_workers_device(seq, workers),
        }
    }

    fn merge_rows_device(
        &mut self,
        y: &mut AnyBuf,
        width: usize,
        module: LoraModule,
        rows: &[Range<usize>],
        first: usize,
    ) -> Result<()> {
        match self {
            Self::Cpu(b) => b.merge_rows_device(y.cpu_mut(), width, module, rows, first),
            Self::Cuda(g) => g.merge_rows_device(y.gpu_mut(), width, module, rows, first),
        }
    }

    fn supports_graphs(&self) -> bool {
        match self {
            Self::Cpu(b) => b.supports_graphs(),
            Self::Cuda(g) => g.supports_graphs(),
        }
    }

    fn graph_begin(
        &mut self,
        key: super::GraphKey,
        step: &StepLayout,
        lora: &LoraBatch<'_, AnyLora>,
        sizing: &super::graph_plan::GraphSizing,
    ) -> Result<Option<super::GraphPhase>> {
        match self {
            Self::Cpu(b) => {
                let adapters = cpu_loras(lora);
                b.graph_begin(key, step, &lora.with_adapters(&adapters), sizing)
            }
            Self::Cuda(g) => {
                let adapters = gpu_loras(lora);
                g.graph_begin(key, step, &lora.with_adapters(&adapters), sizing)
            }
        }
    }

    fn graph_end(&mut self, out: &mut Vec<f32>, rows: usize) -> Result<bool> {
        match self {
            Self::Cpu(b) => b.graph_end(out, rows),
            Self::Cuda(g) => g.graph_end(out, rows),
        }
    }

    fn graph_end_ids(
        &mut self,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        rows: usize,
    ) -> Result<bool> {
        match self {
            Self::Cpu(b) => b.graph_end_ids(scratch, ids, rows),
            Self::Cuda(g) => g.graph_end_ids(scratch, ids, rows),
        }
    }

    fn graph_reset(&mut self) {
        match self {
            Self::Cpu(b) => b.graph_reset(),
            Self::Cuda(g) => g.graph_reset(),
        }
    }

    fn rope(&mut self, x: &mut AnyBuf, positions: &[usize], n_heads: usize) {
        match self {
            Self::Cpu(b) => b.rope(x.cpu_mut(), positions, n_heads),
            Self::Cuda(g) => g.rope(x.gpu_mut(), positions, n_heads),
        }
    }

    fn rope_attention(
        &mut self,
        (q, k, v): (&mut AnyBuf, &mut AnyBuf, &AnyBuf),
        heads: (usize, usize),
        kv: &mut AnyKvLayer,
        step: &StepLayout,
        out: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => b.rope_attention(
                (q.cpu_mut(), k.cpu_mut(), v.cpu()),
                heads,
                kv.cpu_mut(),
                step,
                out.cpu_mut(),
            ),
            Self::Cuda(g) => g.rope_attention(
                (q.gpu_mut(), k.gpu_mut(), v.gpu()),
                heads,
                kv.gpu_mut(),
                step,
                out.gpu_mut(),
            ),
        }
    }

    fn folds_rope(&self) -> bool {
        match self {
            Self::Cpu(b) => b.folds_rope(),
            Self::Cuda(g) => g.folds_rope(),
        }
    }

    fn qkv_attention(
        &mut self,
        x: &AnyBuf,
        ws: [&AnyLinear; 3],
        qkv: [&mut AnyBuf; 3],
        sites: [LoraSite; 3],
        batch: &LoraBatch<'_, AnyLora>,
        heads: (usize, usize),
        kv: &mut AnyKvLayer,
        step: &StepLayout,
        out: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => {
                let adapters = cpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, qkv) = (ws.map(|w| w.cpu()), qkv.map(|o| o.cpu_mut()));
                let (kv, out) = (kv.cpu_mut(), out.cpu_mut());
                b.qkv_attention(x.cpu(), ws, qkv, sites, &inner, heads, kv, step, out);
            }
            Self::Cuda(g) => {
                let adapters = gpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, qkv) = (ws.map(|w| w.gpu()), qkv.map(|o| o.gpu_mut()));
                let (kv, out) = (kv.gpu_mut(), out.gpu_mut());
                g.qkv_attention(x.gpu(), ws, qkv, sites, &inner, heads, kv, step, out);
            }
        }
    }

    fn fuses_qkv_attention(&self) -> bool {
        match self {
            Self::Cpu(b) => b.fuses_qkv_attention(),
            Self::Cuda(g) => g.fuses_qkv_attention(),
        }
    }

    fn attention(
        &mut self,
        q: &AnyBuf,
        k: &AnyBuf,
        v: &AnyBuf,
        kv: &mut AnyKvLayer,
        step: &StepLayout,
        out: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => {
                b.attention(q.cpu(), k.cpu(), v.cpu(), kv.cpu_mut(), step, out.cpu_mut())
            }
            Self::Cuda(g) => {
                g.attention(q.gpu(), k.gpu(), v.gpu(), kv.gpu_mut(), step, out.gpu_mut())
            }
        }
    }

    fn add_rms_norm(
        &mut self,
        residual: &mut AnyBuf,
        x: &AnyBuf,
        w: &AnyVector,
        eps: f32,
        rows: usize,
        width: usize,
        out: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => b.add_rms_norm(
                residual.cpu_mut(),
                x.cpu(),
                w.cpu(),
                eps,
                rows,
                width,
                out.cpu_mut(),
            ),
            Self::Cuda(g) => g.add_rms_norm(
                residual.gpu_mut(),
                x.gpu(),
                w.gpu(),
                eps,
                rows,
                width,
                out.gpu_mut(),
            ),
        }
    }

    fn gated_mlp_in(
        &mut self,
        x: &AnyBuf,
        ws: [&AnyLinear; 2],
        rows: usize,
        outs: [&mut AnyBuf; 2],
        sites: [LoraSite; 2],
        batch: &LoraBatch<'_, AnyLora>,
        act: &mut AnyBuf,
    ) {
        match self {
            Self::Cpu(b) => {
                let adapters = cpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, outs) = (ws.map(|w| w.cpu()), outs.map(|o| o.cpu_mut()));
                b.gated_mlp_in(x.cpu(), ws, rows, outs, sites, &inner, act.cpu_mut());
            }
            Self::Cuda(g) => {
                let adapters = gpu_loras(batch);
                let inner = batch.with_adapters(&adapters);
                let (ws, outs) = (ws.map(|w| w.gpu()), outs.map(|o| o.gpu_mut()));
                g.gated_mlp_in(x.gpu(), ws, rows, outs, sites, &inner, act.gpu_mut());
            }
        }
    }

    fn fuses_gated_mlp(&self) -> bool {
        match self {
            Self::Cpu(b) => b.fuses_gated_mlp(),
            Self::Cuda(g) => g.fuses_gated_mlp(),
        }
    }

    fn swiglu(&mut self, gate: &AnyBuf, up: &AnyBuf, len: usize, out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.swiglu(gate.cpu(), up.cpu(), len, out.cpu_mut()),
            Self::Cuda(g) => g.swiglu(gate.gpu(), up.gpu(), len, out.gpu_mut()),
        }
    }

    fn add(&mut self, y: &mut AnyBuf, x: &AnyBuf, len: usize) {
        match self {
            Self::Cpu(b) => b.add(y.cpu_mut(), x.cpu(), len),
            Self::Cuda(g) => g.add(y.gpu_mut(), x.gpu(), len),
        }
    }

    fn gather_rows(&mut self, x: &AnyBuf, width: usize, rows: &[usize], out: &mut AnyBuf) {
        match self {
            Self::Cpu(b) => b.gather_rows(x.cpu(), width, rows, out.cpu_mut()),
            Self::Cuda(g) => g.gather_rows(x.gpu(), width, rows, out.gpu_mut()),
        }
    }

    fn export_rows(
        &mut self,
        x: &AnyBuf,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    ) {
        match self {
            Self::Cpu(b) => b.export_rows(x.cpu(), width, rows, dst, stride),
            Self::Cuda(g) => g.export_rows(x.gpu(), width, rows, dst, stride),
        }
    }

    fn merge_rows(
        &mut self,
        y: &mut AnyBuf,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    ) {
        match self {
            Self::Cpu(b) => b.merge_rows(y.cpu_mut(), width, rows, src, stride),
            Self::Cuda(g) => g.merge_rows(y.gpu_mut(), width, rows, src, stride),
        }
    }

    fn logits(&mut self, x: &AnyBuf, lm_head: &AnyLinear, rows: usize, out: &mut Vec<f32>) {
        match self {
            Self::Cpu(b) => b.logits(x.cpu(), lm_head.cpu(), rows, out),
            Self::Cuda(g) => g.logits(x.gpu(), lm_head.gpu(), rows, out),
        }
    }

    fn greedy_ids(
        &mut self,
        x: &AnyBuf,
        lm_head: &AnyLinear,
        rows: usize,
        scratch: &mut Vec<f32>,
        ids: &mut Vec<u32>,
    ) {
        match self {
            Self::Cpu(b) => b.greedy_ids(x.cpu(), lm_head.cpu(), rows, scratch, ids),
            Self::Cuda(g) => g.greedy_ids(x.gpu(), lm_head.gpu(), rows, scratch, ids),
        }
    }
}
