//! Prefill attention on the tensor cores (`thaw-kernels/src/cuda/attention_prefill_tc.cu`,
//! issue 29). Opt-in until a GPU run verifies it: `THAW_CUDA_TC_PREFILL=1` (read when the
//! backend is created) or [`CudaBackend::set_tc_prefill`]; `attention.cu`'s prefill stays the
//! default. It serves a bf16 or f16 KV cache with heads of 32, 64 or 128
//! ([`prefill_tc_plan::entry_point`]); for any other shape the switch is accepted and the
//! classic kernel keeps running (eager fallback), which [`CudaBackend::tc_prefill`] reports.
//! The step metadata's prefill tiles are cut to the kernel's query tile
//! ([`prefill_tc_plan::tile_rows`]); decode rows are unaffected.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::prefill_tc_plan::{self, WARPS};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::launch::{AttnShape, Gpu, PrefillKernel};
use super::{CudaBackend, CudaError};
use crate::error::Result;

/// The environment variable that turns the tensor-core prefill on: `1` (or `true`, `on`); `0`
/// or unset keeps `attention.cu`'s prefill.
pub const TC_PREFILL_ENV: &str = "THAW_CUDA_TC_PREFILL";

/// Parses an on/off switch read from the environment variable `env`; `on` says what 1 does.
pub fn parse_switch(env: &str, on: &str, s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "off" | "no" => Ok(false),
        "1" | "true" | "on" | "yes" => Ok(true),
        other => Err(format!(
            "{env}={other:?} is not a switch; use 1 to {on}, or 0"
        )),
    }
}

/// The resolved tensor-core prefill kernel for one (KV dtype, head_dim).
pub(crate) struct TcPrefill {
    func: CudaFunction,
    head_dim: usize,
}

impl TcPrefill {
    /// The kernel for `kv` and `head_dim`, or `None` when the tensor-core kernel does not serve
    /// that shape.
    fn load(ctx: &Arc<CudaContext>, kv: DType, head_dim: usize) -> Result<Option<Self>, CudaError> {
        let Some(name) = prefill_tc_plan::entry_point(kv, head_dim) else {
            return Ok(None);
        };
        let func = KernelCache::global()
            .function(ctx, &name)
            .map_err(CudaError::from)?;
        Ok(Some(Self { func, head_dim }))
    }

    /// The kernel [`TC_PREFILL_ENV`] asks for, if it serves this shape.
    pub(super) fn from_env(
        ctx: &Arc<CudaContext>,
        kv: DType,
        head_dim: usize,
    ) -> Result<Option<Self>, CudaError> {
        let v = std::env::var(TC_PREFILL_ENV).unwrap_or_default();
        let on = parse_switch(
            TC_PREFILL_ENV,
            "run prefill attention on the tensor cores",
            &v,
        )
        .map_err(CudaError::Unsupported)?;
        if !on {
            return Ok(None);
        }
        let k = Self::load(ctx, kv, head_dim)?;
        if k.is_none() {
            tracing::info!(
                "{TC_PREFILL_ENV}=1: no tensor-core prefill for a {kv:?} KV cache with head_dim \
                 {head_dim} (bf16/f16, 32, 64 or 128); the classic prefill runs"
            );
        }
        Ok(k)
    }
}

impl Gpu {
    /// Rows per prefill tile the step metadata is cut into for the prefill kernel in use.
    pub(super) fn prefill_tile_rows(&self) -> usize {
        prefill_tc_plan::tile_rows(self.tc_prefill.is_some())
    }

    /// Prefill attention over `n_tiles` tiles (4 u32 each, ≤ [`prefill_tc_plan::Q_TILE`] rows) on the tensor
    /// cores; same arguments as [`Gpu::attn_prefill`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_prefill_tc(
        &self,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: &mut CudaSlice<f32>,
        tables: &CudaSlice<u32>,
        tiles: &CudaSlice<u32>,
        n_tiles: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let tc = self
            .tc_prefill
            .as_ref()
            .expect("attn_prefill_tc called without the tensor-core kernel loaded");
        assert_eq!(
            s.head_dim, tc.head_dim,
            "the kernel was loaded for another head_dim"
        );
        // 16-byte K/V loads: the caches start 16-byte aligned (rows are head_dim · 2 bytes, a
        // multiple of 16 for the head dims served).
        assert!(
            self.p(kc).is_multiple_of(16) && self.p(vc).is_multiple_of(16),
            "KV cache not 16-byte aligned"
        );
        let k = PrefillKernel {
            func: &tc.func,
            block: 32 * WARPS as u32,
        };
        // SAFETY: attn_prefill_tcHD_T has attn_prefill_T's signature (attention_prefill_tc.cu)
        // and is compiled for blockDim 32 · WARPS with a static shared-memory tile of Q_TILE
        // query rows, the tile size step.rs cuts with while this kernel is loaded
        // (prefill_tile_rows); head_dim equals its HD (asserted above; the kernel traps
        // otherwise) and the caches are 16-byte aligned (asserted) for its uint4 loads.
        unsafe { self.launch_prefill(k, q, (kc, vc), out, (tables, tiles, n_tiles), s) }
    }
}

impl CudaBackend {
    /// Switches prefill attention to the tensor-core kernel (`on`) or back (tests,
    /// benchmarks); compiles on first use. Returns whether the tensor-core kernel now runs:
    /// `false` with `on` when it does not serve this backend's KV dtype and head_dim.
    pub fn set_tc_prefill(&mut self, on: bool) -> Result<bool> {
        self.gpu.tc_prefill = if on {
            TcPrefill::load(&self.gpu.ctx, self.gpu.kv_dtype, self.head_dim)?
        } else {
            None
        };
        // The next step rebuilds its metadata with the new tile size.
        self.begin_step();
        Ok(self.tc_prefill())
    }

    /// Whether prefill attention runs on the tensor-core kernel.
    pub fn tc_prefill(&self) -> bool {
        self.gpu.tc_prefill.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_parses_or_says_what_to_use() {
        let p = |s| parse_switch(TC_PREFILL_ENV, "do it", s);
        assert_eq!(p(""), Ok(false));
        assert_eq!(p(" ON "), Ok(true));
        assert_eq!(p("0"), Ok(false));
        let e = p("fast").unwrap_err();
        assert!(
            e.contains(TC_PREFILL_ENV) && e.contains("use 1 to do it"),
            "{e}"
        );
    }
}
