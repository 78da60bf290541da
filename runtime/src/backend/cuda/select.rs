//! Loads the issue-29 kernels a new backend runs: resolved by [`KernelPlan::resolve`] and
//! [`OptInPlan::resolve`] (pure, in [`kernel_select`](crate::backend::kernel_select)) from the
//! thirteen environment variables and the backend's shape, all on by default, logged once at
//! info level with the value that turns each off.
use thaw_kernels::cuda::decode_plan::MIN_CHUNK;
use thaw_kernels::cuda::registry::shape;
use thaw_kernels::cuda::KernelCache;

use super::argmax::DeviceArgmax;
use super::attn_occupancy::OccupancyDecode;
use super::attn_prefill_fa::FaPrefill;
use super::attn_prefill_tc::TcPrefill;
use super::flash::FlashDecode;
use super::fused::Fused;
use super::gemv::Gemv;
use super::group::Group;
use super::sgmv::Punica;
use super::wide::{RopeFold, Wide};
use super::{CudaBackend, CudaError};
use crate::adapter::LoraModule;
use crate::backend::kernel_select::{
    occupancy_floor, split_min_chunk, Choice, KernelPlan, OptInPlan, ServedShape,
    SPLIT_MIN_CHUNK_ENV,
};
use crate::model::ModelConfig;

impl CudaBackend {
    /// Resolves and loads the kernels for model `c` from the environment; an explicit request
    /// this backend cannot serve is [`CudaError::Unsupported`] with what to set.
    pub(super) fn load_kernels(&mut self, c: &ModelConfig) -> Result<(), CudaError> {
        let (ctx, kv, w) = (&self.gpu.ctx, self.gpu.kv_dtype, self.gpu.weight_dtype);
        let served = ServedShape {
            kv,
            head_dim: c.head_dim,
            max_lora_d_in: LoraModule::ALL
                .iter()
                .map(|&m| c.module_shape(m).0)
                .max()
                .unwrap_or(0),
            arch: KernelCache::arch(ctx)?,
        };
        let env = |k: &str| -> Option<String> {
            std::env::var_os(k).map(|v| v.to_string_lossy().into_owned())
        };
        let plan = KernelPlan::resolve(env, &served).map_err(CudaError::Unsupported)?;
        tracing::info!("CUDA kernels: {plan}");
        if plan.attn.is_new() {
            let var = env(SPLIT_MIN_CHUNK_ENV);
            let chunk = split_min_chunk(var.as_deref()).map_err(CudaError::Unsupported)?;
            if chunk != MIN_CHUNK {
                tracing::info!("CUDA flash-decoding: chunks of at least {chunk} positions");
            }
            self.gpu.flash = Some(FlashDecode::load(ctx, kv, chunk)?);
        }
        if plan.tc_prefill.is_new() {
            self.gpu.tc_prefill = TcPrefill::load(ctx, kv, c.head_dim)?;
            debug_assert!(self.gpu.tc_prefill.is_some(), "resolved as served");
        }
        if plan.lora.is_new() {
            self.gpu.punica = Some(Punica::load(ctx, w, shape::PUNICA_K_CHUNK)?);
        }
        if plan.fused.is_new() {
            self.gpu.fused = Some(Fused::load(ctx, w)?);
        }
        let opt_in = OptInPlan::resolve(env, c.head_dim).map_err(CudaError::Unsupported)?;
        tracing::info!("CUDA kernels, issue 29's nine and the opt-in FA prefill: {opt_in}");
        if opt_in.prefill_fa.is_new() {
            // Before the 16-bit outputs (act16 below): they load its twin where it is loaded.
            self.gpu.fa_prefill = FaPrefill::load(ctx, kv, c.head_dim)?;
            if self.gpu.fa_prefill.is_none() || self.gpu.tc_prefill.is_none() {
                tracing::info!(
                    "CUDA FA prefill: not run (it runs where the tensor-core prefill does: a \
                     bf16/f16 KV cache on compute capability 8.0+, {}=1)",
                    crate::backend::kernel_select::TC_PREFILL_ENV
                );
            }
        }
        if opt_in.group_gemm.is_new() {
            self.gpu.group = Some(Group::load(ctx)?);
        }
        if opt_in.rope_fold.is_new() {
            self.gpu.rope_fold = Some(RopeFold::load(ctx, kv)?);
        }
        if opt_in.wide.is_new() {
            self.gpu.wide = Some(Wide::load(ctx, w)?);
        }
        if opt_in.device_argmax.is_new() {
            self.gpu.argmax = Some(DeviceArgmax::load(ctx)?);
        }
        if opt_in.gemv.is_new() {
            self.gpu.gemv = Some(Gemv::load(ctx, w)?);
        }
        if opt_in.lora_slices.is_new() {
            self.gpu.slices = Some(super::lora_slices::Slices::load(ctx, w)?);
        }
        if opt_in.lora_small.is_new() {
            self.gpu.small = Some(super::lora_small::LoraSmall::load(ctx, w)?);
        }
        if opt_in.attn_occupancy.is_new() {
            let var = env(SPLIT_MIN_CHUNK_ENV);
            let floor = occupancy_floor(var.as_deref()).map_err(CudaError::Unsupported)?;
            tracing::info!("CUDA occupancy decode: chunks of at least {floor} positions");
            self.gpu.occupancy = Some(OccupancyDecode::load(&self.gpu, kv, floor)?);
        }
        if opt_in.cublaslt.is_new() {
            let lt = super::lt::Lt::new(&self.gpu)?;
            tracing::info!(
                "CUDA cuBLASLt products: {} MiB workspace",
                lt.workspace_len() >> 20
            );
            self.gpu.lt = Some(lt);
        }
        if opt_in.act16.is_new() {
            self.gpu.act16 = super::act16::Act16::load(ctx, w)?;
            if self.gpu.act16.is_none() {
                tracing::info!("CUDA activations: f32 (the weights are f32, not bf16/f16)");
            }
            self.gpu.load_residual16()?;
            self.load_attn_out16()?;
        }
        Ok(())
    }

    /// Which of the nine kernels of [`OptInPlan`] (on by default) run now (after any `set_*`
    /// call).
    pub fn opt_in_plan(&self) -> OptInPlan {
        let pick = |new: bool| if new { Choice::New } else { Choice::Classic };
        OptInPlan {
            group_gemm: pick(self.gpu.group.is_some()),
            rope_fold: pick(self.gpu.rope_fold.is_some()),
            wide: pick(self.gpu.wide.is_some()),
            device_argmax: pick(self.gpu.argmax.is_some()),
            gemv: pick(self.gpu.gemv.is_some()),
            lora_slices: pick(self.gpu.slices.is_some()),
            attn_occupancy: pick(self.gpu.occupancy.is_some()),
            cublaslt: pick(self.gpu.lt.is_some()),
            act16: pick(self.gpu.act16.is_some()),
            prefill_fa: pick(self.prefill_fa()),
            lora_small: pick(self.gpu.small.is_some()),
        }
    }

    /// Which of issue 29's kernels run now (after any `set_*` call): each is
    /// [`Choice::New`] or [`Choice::Classic`].
    pub fn kernel_plan(&self) -> KernelPlan {
        let pick = |new: bool| if new { Choice::New } else { Choice::Classic };
        KernelPlan {
            attn: pick(self.gpu.flash.is_some()),
            tc_prefill: pick(self.gpu.tc_prefill.is_some()),
            lora: pick(self.gpu.punica.is_some()),
            fused: pick(self.gpu.fused.is_some()),
        }
    }
}
