//! Products of few rows as a GEMV (issue 29, `THAW_CUDA_GEMV`; on by default where it pays,
//! `0` for cast + cuBLAS): `thaw_kernels`' `gemv.cu`.
//!
//! With the switch on, a `linear` over 16-bit weights whose shape the kernel takes
//! ([`gemv_serves`]: 1 to [`shape::GEMV_MAX_ROWS`] rows, `d_in % 8 == 0`, 16-byte aligned
//! buffers) and where it beats cuBLAS ([`gemv_pays`]: every product at 1–2 rows, products of at
//! most 4096 × 4096 weights at 3–4) runs as one launch that reads the f32 activations
//! directly: no cast kernel, no cuBLAS. At batch 1–2 that is every decode product of a
//! Llama-shaped model: q/k/v/o, gate/up/down, the LM head ([`CudaBackend::try_logits`] goes
//! through the same `linear`), and a q/k/v or gate/up group run as one product (`group.rs`,
//! `THAW_CUDA_GROUP_GEMM=1`), whose one `[Σ d_out, d_in]` matrix is simply a wider GEMV.
//! Everything else (prefill, larger batches, f32 weights, odd widths) takes the cast + cuBLAS
//! path as before. LoRA deltas are separate kernels (`sgmv.rs`) added after the product,
//! unchanged. [`CudaBackend::set_gemv_every_row`] lifts the crossover for benchmarks and tests
//! that time or check the kernel at every row count it takes.
//!
//! Why: on an H200 at batch 1 the 4096×4096 products ran at 59–63% of the copy roofline through
//! cast + `gemm_ex` (`cuda-h100.md` §8), and the cast is a launch of its own before each
//! product. TensorRT-LLM and llama.cpp run such shapes through a hand-written GEMV.
//!
//! Numerics: the GEMV multiplies the f32 activations (the CPU oracle's operands) where the
//! cuBLAS path first rounds them to the weight dtype, so the two differ by that rounding; both
//! accumulate in f32.
//!
//! [`CudaBackend::try_logits`]: super::CudaBackend
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::launch::{int, launch, Gpu};
use super::{CudaBackend, CudaError};
use crate::backend::kernel_select::{gemv_grid, gemv_pays, gemv_serves};
use crate::error::Result;

/// The GEMV kernels for one weight dtype: rows up to [`shape::GEMV_FEW_ROWS`], and more.
struct Kernels {
    few: CudaFunction,
    many: CudaFunction,
}

/// The GEMV for one weight dtype; no kernels for f32 weights (they read 16-bit ones: with the
/// switch on, every product of an f32 model still takes cuBLAS).
pub(crate) struct Gemv {
    func: Option<Kernels>,
    /// Every row count the kernel takes, not only where it pays ([`gemv_pays`]).
    every_row: bool,
}

impl Gemv {
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let func = match w {
            DType::F32 => None,
            DType::Bf16 | DType::F16 => {
                let cache = KernelCache::global();
                let f = |kind: &str| cache.function(ctx, &format!("gemv_{kind}_{}", w.suffix()));
                Some(Kernels {
                    few: f("few")?,
                    many: f("many")?,
                })
            }
        };
        Ok(Self {
            func,
            every_row: false,
        })
    }
}

/// The decision that one product runs as a GEMV, made once per product by
/// [`Gpu::gemv_takes`] for exactly these operands (only it makes one) and carried to
/// [`Gpu::gemv_linear`], which runs it: the caller also needs it (a GEMV leaves no 16-bit copy
/// of the input to reuse), so it is not taken twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GemvTake {
    x: u64,
    w: u64,
    rows: usize,
    d_in: usize,
    d_out: usize,
}

impl Gpu {
    /// out[rows, d_out] = x[rows, d_in] · Wᵀ through `gemv.cu`, as `take` decided for these
    /// operands (their addresses are checked against it).
    pub(super) fn gemv_linear(
        &self,
        take: GemvTake,
        x: &CudaSlice<f32>,
        w: &impl DevicePtr<u8>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let GemvTake {
            rows, d_in, d_out, ..
        } = take;
        let k = (self.gemv.as_ref().and_then(|g| g.func.as_ref()))
            .expect("gemv_takes decides a GEMV only with its kernels loaded");
        let (xp, wp) = (self.p(x), self.p(w));
        assert!(
            (xp, wp) == (take.x, take.w),
            "gemv: operands other than the ones gemv_takes decided for"
        );
        assert!(
            x.len() >= rows * d_in && out.len() >= rows * d_out,
            "gemv: buffers too small"
        );
        assert!(
            w.len() >= d_in * d_out * self.weight_dtype.size(),
            "gemv: weight too small"
        );
        let func = if rows <= shape::GEMV_FEW_ROWS {
            &k.few
        } else {
            &k.many
        };
        // SAFETY: gemv_{few,many}_T(const float*, const T*, float*, int, int, int); x holds
        // rows × d_in f32, w d_out × d_in 16-bit weights, out rows × d_out f32 (checked above);
        // gemv_serves, through gemv_takes for these very addresses (checked above), checked
        // 1 <= rows <= GEMV_MAX_ROWS, d_in % 8 == 0 and both addresses 16-byte aligned, which
        // the kernel's 16-byte loads need; the few-row kernel gets rows <= GEMV_FEW_ROWS, the
        // many-row one the rest (each ignores rows it has no case for); blocks of GEMV_WARPS
        // warps, as their __launch_bounds__ declare.
        unsafe {
            launch!(
                self,
                func,
                (gemv_grid(d_out, rows), 1, 1),
                shape::GEMV_WARPS * 32,
                [
                    xp,
                    wp,
                    self.p(out),
                    int(rows, "rows"),
                    int(d_in, "d_in"),
                    int(d_out, "d_out")
                ]
            )
        }
    }

    /// Whether the GEMV may serve a product of `rows` rows of any of `shapes` (`(d_in, d_out)`)
    /// by row count and size alone, before addresses and widths are known: what the 16-bit
    /// activation plans count (the GEMV reads and writes f32, so where it may run they keep
    /// f32; counting a product it then does not take only keeps f32).
    pub(super) fn gemv_may_take(
        &self,
        rows: usize,
        shapes: impl IntoIterator<Item = (usize, usize)>,
    ) -> bool {
        self.gemv.as_ref().is_some_and(|g| {
            (1..=shape::GEMV_MAX_ROWS).contains(&rows)
                && (g.every_row || shapes.into_iter().any(|(i, o)| gemv_pays(rows, i, o)))
        })
    }

    /// Whether a product of `rows` rows of `x` through `w` runs as a GEMV (switch on, kernels
    /// loaded, [`Gpu::gemv_may_take`] by rows and size, [`gemv_serves`] by width and
    /// alignment): the decision
    /// [`Gpu::gemv_linear`] runs, None for cuBLAS.
    pub(super) fn gemv_takes(
        &self,
        x: &CudaSlice<f32>,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
    ) -> Option<GemvTake> {
        let loaded = self.gemv.as_ref().is_some_and(|g| g.func.is_some());
        let (xp, wp) = (self.p(x), self.p(w));
        let runs = loaded
            && self.gemv_may_take(rows, [(d_in, d_out)])
            && gemv_serves(true, self.weight_dtype, rows, d_in, d_out, wp, xp);
        runs.then_some(GemvTake {
            x: xp,
            w: wp,
            rows,
            d_in,
            d_out,
        })
    }
}

impl CudaBackend {
    /// Switches the small-batch GEMV on or off (tests, benchmarks); compiles on first use.
    pub fn set_gemv(&mut self, on: bool) -> Result<()> {
        self.gpu.gemv = if on {
            Some(Gemv::load(&self.gpu.ctx, self.gpu.weight_dtype)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether the small-batch GEMV is switched on (it runs where [`gemv_serves`] and
    /// [`gemv_pays`] say).
    pub fn gemv(&self) -> bool {
        self.gpu.gemv.is_some()
    }

    /// With the GEMV on, runs it at every row count its kernel takes ([`gemv_serves`]), not
    /// only where it beats cuBLAS ([`gemv_pays`]): for the benchmark that measures the
    /// crossover (`cuda_bench --gemv`) and the parity tests. No effect with the GEMV off; a
    /// later [`set_gemv`](Self::set_gemv) resets it.
    pub fn set_gemv_every_row(&mut self, every_row: bool) {
        if let Some(g) = self.gpu.gemv.as_mut() {
            g.every_row = every_row;
        }
    }
}
