//! The attention output stored 16-bit as o_proj's GEMM input (issue 29, `THAW_CUDA_BF16_ACT=1`,
//! where [`attn16_plan`](crate::backend::attn16_plan::attn16_plan) says `stores_out16`).
//!
//! Every attention kernel family takes its output type as a template parameter (f32, or the
//! weight dtype): `attn_decode_K_out_W`, `attn_prefill_K_out_W` (`attention.cu`),
//! `attn_decode_reduce_out_W` (flash-decoding's reduce; its split pass writes f32 partials),
//! `attn_decode_split_ilp_K_out_W` (the occupancy decode) and, where the cache's dtype is the
//! weight dtype, `attn_prefill_tcHD_K_out_K` (tensor-core prefill; other pairs keep the f32
//! store and o_proj's cast: [`AttnOut16::serves`]) and, under the same rule, the FA prefill's
//! `attn_prefill_faHD_K_out_K` (`THAW_CUDA_PREFILL_FA=1`). They compute in f32 as before and only
//! round on the store, so each entry's output is `from_f32` of its f32 twin's, bit for bit.
//!
//! The 16-bit output goes into the backend's one 16-bit GEMM input scratch (`x16`, reserved at
//! the graphs' largest before a capture and in their fingerprint), tagged
//! ([`X16Tag`](super::fused::X16Tag)) as the cast of `ws.attn`: o_proj's `linear` over
//! `ws.attn`, the next op, reads it instead of casting. `ws.attn`'s f32 values are then not
//! written: the plan keeps f32 wherever anything would read them (a LoRA on o, the CPU-assist
//! export of o's input).
use cudarc::driver::{CudaFunction, CudaSlice};
use thaw_kernels::cuda::attn_out_names::attn_out16_names;
use thaw_kernels::cuda::KernelCache;

use super::launch::Gpu;
use super::{CudaBackend, CudaError};

/// Where an attention kernel stores its output: the f32 buffer, or the 16-bit GEMM input
/// scratch in the weight dtype (the 16-bit-output entries).
pub(crate) enum AttnOut<'a> {
    F32(&'a mut CudaSlice<f32>),
    X16(&'a mut CudaSlice<u16>),
}

impl<'a> From<&'a mut CudaSlice<f32>> for AttnOut<'a> {
    fn from(b: &'a mut CudaSlice<f32>) -> Self {
        Self::F32(b)
    }
}

impl AttnOut<'_> {
    /// The buffer's device address.
    pub fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            Self::F32(b) => gpu.p(&**b),
            Self::X16(b) => gpu.p(&**b),
        }
    }

    /// Whether the 16-bit-output entries must run.
    pub fn is16(&self) -> bool {
        matches!(self, Self::X16(_))
    }

    /// The same buffer for a shorter borrow (decode, then prefill, into one output).
    pub fn reborrow(&mut self) -> AttnOut<'_> {
        match self {
            Self::F32(b) => AttnOut::F32(b),
            Self::X16(b) => AttnOut::X16(b),
        }
    }
}

/// The 16-bit-output entries for the backend's (KV, weight) dtypes, loaded with the switch.
pub(crate) struct AttnOut16 {
    pub decode: CudaFunction,
    pub prefill: CudaFunction,
    pub reduce: CudaFunction,
    pub ilp: CudaFunction,
    /// The tensor-core prefill's, for the loaded head_dim: only where the cache's dtype is the
    /// weight dtype (six entries, not twelve).
    pub tc: Option<CudaFunction>,
    /// The FA prefill's, for the loaded head_dim, under the same rule, where it is loaded.
    pub fa: Option<CudaFunction>,
}

impl AttnOut16 {
    /// Whether every attention family the backend launches now has a 16-bit store.
    pub fn serves(&self, gpu: &Gpu) -> bool {
        // The FA prefill runs only in the tensor-core prefill's place.
        gpu.tc_prefill.is_none()
            || (self.tc.is_some() && (gpu.fa_prefill.is_none() || self.fa.is_some()))
    }
}

impl Gpu {
    /// The 16-bit-output kernels (the plan only stores 16-bit where they are loaded).
    pub(super) fn out16(&self) -> Result<&AttnOut16, CudaError> {
        self.attn_out16.as_ref().ok_or_else(|| {
            CudaError::Unsupported("the 16-bit attention output kernels are not loaded".into())
        })
    }

    /// `f32` for an f32 output, else the 16-bit-output kernel `pick` selects.
    pub(super) fn attn_kernel<'a>(
        &'a self,
        out: &AttnOut<'_>,
        f32: &'a CudaFunction,
        pick: impl Fn(&'a AttnOut16) -> Option<&'a CudaFunction>,
    ) -> Result<&'a CudaFunction, CudaError> {
        if !out.is16() {
            return Ok(f32);
        }
        pick(self.out16()?).ok_or_else(|| {
            CudaError::Unsupported("no 16-bit attention output for this kernel family".into())
        })
    }
}

impl CudaBackend {
    /// Loads the 16-bit-output kernels with the switch on and 16-bit weights (after the
    /// tensor-core prefill was resolved), drops them otherwise.
    pub(super) fn load_attn_out16(&mut self) -> Result<(), CudaError> {
        let g = &self.gpu;
        // f32 weights: no 16-bit type to store in (no names).
        let names = attn_out16_names(g.kv_dtype, g.weight_dtype, self.head_dim);
        let Some(n) = names.filter(|_| g.act16.is_some()) else {
            self.gpu.attn_out16 = None;
            return Ok(());
        };
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(&g.ctx, name).map_err(CudaError::from);
        // The tensor-core prefill's only where it runs (resolved as served on this device).
        let tc = match n.tc.as_deref().filter(|_| g.tc_prefill.is_some()) {
            Some(name) => Some(f(name)?),
            None => None,
        };
        // The FA prefill's likewise, its shared-memory limit raised as its f32 entry's.
        let fa = match n.fa.as_deref().filter(|_| g.fa_prefill.is_some()) {
            Some(name) => Some(super::attn_prefill_fa::load_fa_function(
                &g.ctx,
                name,
                self.head_dim,
            )?),
            None => None,
        };
        let k = AttnOut16 {
            decode: f(&n.decode)?,
            prefill: f(&n.prefill)?,
            reduce: f(&n.reduce)?,
            ilp: f(&n.ilp)?,
            tc,
            fa,
        };
        self.gpu.attn_out16 = Some(k);
        Ok(())
    }
}

impl CudaBackend {
    /// [`Backend::attention`](crate::backend::Backend::attention) of an eager step (K/V
    /// written, then the decode and prefill families the backend has switched on) with the
    /// output stored in the weight dtype into `out` (`rows × q_dim` bit patterns): the
    /// 16-bit-output entries, for the parity tests and benchmarks. Needs the switch on and
    /// 16-bit weights; with the tensor-core prefill on, a cache of the weight dtype.
    pub fn attention_x16(
        &mut self,
        (q, k, v): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        kv: &mut super::CudaKvLayer,
        step: &crate::backend::StepLayout,
        out: &mut CudaSlice<u16>,
    ) -> crate::error::Result<()> {
        if !(self.gpu.attn_out16.as_ref()).is_some_and(|k| k.serves(&self.gpu)) {
            return Err(CudaError::Unsupported(
                "attention_x16 needs THAW_CUDA_BF16_ACT=1, 16-bit weights and a 16-bit store \
                 in every attention family switched on"
                    .into(),
            )
            .into());
        }
        let rows = step.rows();
        assert!(
            out.len() >= rows * self.n_heads * self.head_dim,
            "attention_x16: out holds fewer than rows × q_dim values"
        );
        let s = self.attn_shape(kv);
        self.attn_prepare(step, kv)?;
        let tl = kv.layout.token_len();
        (self.gpu).write_kv(k, v, &mut kv.k, &mut kv.v, &self.attn.slots(), rows, tl)?;
        self.attend(q, kv, AttnOut::X16(out), s)?;
        Ok(())
    }
}
