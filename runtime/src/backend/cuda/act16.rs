//! 16-bit MLP activations (issue 29, `THAW_CUDA_BF16_ACT`; on by default, `0` for f32
//! activations): `thaw_kernels`' `act16.cu`.
//!
//! Where [`act16_plan`] serves a step's layer, [`Backend::gated_mlp_in`] runs
//! 1. the input's 16-bit copy: the fused add + RMSNorm's where its [`X16Tag`] serves, else a
//!    cast of `x` (as [`Gpu::linear`] casts);
//! 2. the gate and up GEMMs with their outputs stored in the weight dtype (cublasGemmEx, A and B
//!    16-bit, C 16-bit, `CUBLAS_COMPUTE_32F`: f32 accumulation, one rounding on the store) —
//!    its own product, beside [`Gpu::gemm`] (f32 C), which it does not change;
//! 3. `swiglu16_T`: SwiGLU over the two 16-bit buffers into `x16` (the down GEMM's input,
//!    tagged so down reads it without a cast) and, with the plan's `f32_copy` (LoRA on down),
//!    into the f32 `act` that down's LoRA shrink reads.
//!
//! Against the f32 path (gate, up written and read in f32, then SwiGLU + cast) the block moves
//! half the activation bytes, two thirds with the f32 copy
//! ([`act16_traffic_bytes`](crate::backend::act16_plan::act16_traffic_bytes)). CUDA-graph
//! steps whose key has no LoRA rank class take this path too (the plan there reads only the
//! key, so one captured graph serves every step of its bucket); the 16-bit scratch is reserved
//! at the graphs' largest before a capture and is part of the graph fingerprint. LoRA on gate
//! or up (a graph: a key with a rank class) keeps the f32 path: the deltas would need f32
//! scratch zeroed and read beside the 16-bit products, more bytes than f32 moves
//! ([`F32Why::LoraOnGateUp`](crate::backend::act16_plan::F32Why::LoraOnGateUp)). GEMV-sized
//! products, biased gate/up and f32 weights run the f32 path too. CPU twin of the rounding:
//! [`CpuBackend::set_act16`](crate::backend::cpu::CpuBackend::set_act16).
//!
//! [`act16_plan`]: crate::backend::act16_plan::act16_plan
//! [`Backend::gated_mlp_in`]: crate::backend::Backend::gated_mlp_in
//! [`X16Tag`]: super::fused::X16Tag
use std::sync::Arc;

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::launch::{blocks, launch, Gpu};
use super::weights::{CudaLinear, CudaLora};
use super::{CudaBackend, CudaError};
use crate::backend::act16_plan::{act16_plan, Act16Facts, Act16Plan};
use crate::backend::cpu_act16::lora_facts;
use crate::backend::{LoraBatch, LoraSite};
use crate::error::Result;

/// The resolved kernels for one 16-bit weight dtype.
pub(crate) struct Act16 {
    swiglu: CudaFunction,
    cast: CudaFunction,
    c_type: blas_sys::cudaDataType,
}

impl Act16 {
    /// `None` for f32 weights: there is no 16-bit type to store activations in.
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Option<Self>, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        let c_type = match w {
            DType::F32 => return Ok(None),
            DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        };
        Ok(Some(Self {
            swiglu: f(&format!("swiglu16_{}", w.suffix()))?,
            cast: f(&format!("cast_f32_to_{}", w.suffix()))?,
            c_type,
        }))
    }
}

/// The 16-bit gate and up outputs, grown to the largest step seen (no allocation in a steady
/// step).
#[derive(Default)]
pub(super) struct Act16Scratch {
    gate: Option<CudaSlice<u16>>,
    up: Option<CudaSlice<u16>>,
}

impl Gpu {
    fn act16_kernels(&self) -> Result<&Act16, CudaError> {
        self.act16
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("the act16 kernels are not loaded".into()))
    }

    /// out[rows, d_out] = x16[rows, d_in] · Wᵀ with W `[d_out, d_in]` of the weight dtype, both
    /// 16-bit, `out` stored in the weight dtype; f32 accumulation (`CUBLAS_COMPUTE_32F`):
    /// through cuBLASLt where it is on, else `cublasGemmEx`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm16(
        &self,
        x16: &CudaSlice<u16>,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let t = self.act16_kernels()?.c_type;
        assert!(
            x16.len() >= rows * d_in && out.len() >= rows * d_out,
            "gemm16: buffers too small"
        );
        assert!(
            w.len() >= d_in * d_out * self.weight_dtype.size(),
            "gemm16: weight too small"
        );
        if rows == 0 {
            return Ok(());
        }
        if let Some(lt) = &self.lt {
            // cuBLASLt on (`THAW_CUDA_CUBLASLT=1`): its product with D in the weight dtype.
            let o = super::lt::LtOut {
                ptr: self.p(out),
                dtype: self.weight_dtype,
            };
            match self.lt_product(lt, self.p(x16), w, rows, d_in, d_out, o, None) {
                Ok(_) => return Ok(()),
                // No cuBLASLt algorithm for this product (nothing enqueued): cublasGemmEx.
                Err(CudaError::LtNoAlgorithm) => {}
                Err(e) => return Err(e),
            }
        }
        // SAFETY: x16 holds rows × d_in and out rows × d_out elements of the weight dtype
        // (checked above); (16BF|16F, same, same) with COMPUTE_32F is a supported GemmEx
        // combination.
        unsafe { self.gemm_ex(t, self.p(x16), w, (rows, d_in, d_out), self.p(out), t) }?;
        Ok(())
    }

    /// `x16[..n]` = `x[..n]` in the weight dtype (`cast_f32_to_T`).
    pub(super) fn cast16(
        &self,
        x: &CudaSlice<f32>,
        x16: &mut CudaSlice<u16>,
        n: usize,
    ) -> Result<(), CudaError> {
        let k = self.act16_kernels()?;
        assert!(x.len() >= n && x16.len() >= n, "cast16: buffers too small");
        // SAFETY: cast_f32_to_{bf16,f16}(const float*, T*, long); x holds n f32 and x16 n
        // 16-bit elements (checked above).
        unsafe {
            launch!(
                self,
                &k.cast,
                (blocks(n, 256, 4096), 1, 1),
                256,
                [self.p(x), self.p(x16), n as i64]
            )
        }
    }

    /// `out16[..n]` = silu(gate) · up over 16-bit `gate` and `up`, in the weight dtype; with
    /// `out`, the same values in f32 too (`swiglu16_T`).
    pub fn swiglu16(
        &self,
        gate: &CudaSlice<u16>,
        up: &CudaSlice<u16>,
        out16: &mut CudaSlice<u16>,
        out: Option<&mut CudaSlice<f32>>,
        n: usize,
    ) -> Result<(), CudaError> {
        let k = self.act16_kernels()?;
        assert!(
            gate.len() >= n && up.len() >= n && out16.len() >= n,
            "swiglu16: buffers too small"
        );
        assert!(
            out.as_ref().is_none_or(|o| o.len() >= n),
            "swiglu16: f32 output too small"
        );
        let out = out.map_or(0, |o| self.p(o));
        // 4 elements a thread on the vector path (n a multiple of 4), 1 otherwise.
        let per = if n.is_multiple_of(4) { n / 4 } else { n };
        // SAFETY: swiglu16_T(const T*, const T*, T*, float*, long); gate, up and out16 hold n
        // 16-bit elements, `out` is null or holds n f32 (checked above); every buffer starts
        // at a cudaMalloc address (256-byte aligned), as the 8- and 16-byte accesses of the
        // vector path need.
        unsafe {
            launch!(
                self,
                &k.swiglu,
                (blocks(per, 256, 4096), 1, 1),
                256,
                [self.p(gate), self.p(up), self.p(out16), out, n as i64]
            )
        }
    }
}

/// `buf` grown to at least `n` 16-bit elements (contents unset when grown).
///
/// # Safety
/// The caller writes the first `n` elements before anything reads them.
pub(super) unsafe fn grown<'a>(
    gpu: &Gpu,
    buf: &'a mut Option<CudaSlice<u16>>,
    n: usize,
) -> Result<&'a mut CudaSlice<u16>, CudaError> {
    // SAFETY: written before it is read (this function's contract).
    unsafe { gpu.x16_ptr(buf, n) }?;
    Ok(buf.as_mut().expect("grown above"))
}

impl CudaBackend {
    /// The plan of the MLP at `sites[0].layer` for a step of `rows` rows over `ws` (in a
    /// CUDA graph: the key's rank class, not `batch`, decides the LoRA facts).
    pub fn act16_plan_for(
        &self,
        ws: [&CudaLinear; 2],
        rows: usize,
        sites: &[LoraSite; 2],
        batch: &LoraBatch<'_, CudaLora>,
    ) -> Act16Plan {
        let graph = self.graphs.active();
        let (lora_on_gate_up, lora_on_down) = match graph {
            Some(_) => (false, false),
            None => lora_facts(batch, sites[0].layer, |a: &CudaLora, l, m| a.rank(l, m)),
        };
        act16_plan(&Act16Facts {
            switch_on: self.gpu.act16.is_some(),
            weights_16bit: self.gpu.weight_dtype != DType::F32,
            rows,
            lora_on_gate_up,
            lora_on_down,
            graph: graph.is_some(),
            graph_lora: graph.is_some_and(|a| a.key.lora_rank > 0),
            // gate/up's and down's products stream the same weights (gemv_pays is symmetric).
            gemv: self
                .gpu
                .gemv_may_take(rows, ws.iter().map(|w| (w.d_in, w.d_out))),
            bias: ws.iter().any(|w| w.bias.is_some()),
        })
    }

    /// The 16-bit path of [`Backend::gated_mlp_in`](crate::backend::Backend::gated_mlp_in)
    /// (the plan served it): the steps of the module docs as one op, `at` (the norm's tag
    /// serves the products, SwiGLU's serves down, op `at + 1`).
    pub(super) fn try_gated_mlp_act16(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; 2],
        rows: usize,
        f32_copy: bool,
        act: &mut CudaSlice<f32>,
        at: u64,
    ) -> Result<(), CudaError> {
        self.try_act16_gate_up(x, ws, rows, at)?;
        self.try_act16_swiglu(f32_copy, act, rows * ws[0].d_out, at)
    }

    /// `x16` grown to `need` elements (at least `n_in`) holding the first `n_in` values of `x`
    /// in the weight dtype, for the 16-bit products of op `at`: the fused norm's copy where its
    /// [`X16Tag`](super::fused::X16Tag) serves and `x16` needs no growth (growing drops what it
    /// holds), else a cast.
    ///
    /// # Safety
    /// The caller writes elements `n_in..need` before anything reads them.
    pub(super) unsafe fn x16_input(
        &mut self,
        x: &CudaSlice<f32>,
        n_in: usize,
        need: usize,
        at: u64,
    ) -> Result<(), CudaError> {
        let tag = self.x16_tag.take();
        let fits = self.x16.as_ref().is_some_and(|b| b.len() >= need);
        let served = fits && tag.is_some_and(|t| t.serves(self.gpu.p(x), n_in, at));
        // SAFETY: the cast below writes the first n_in elements unless they hold x's copy
        // (served); the rest is the caller's to write (this function's contract).
        let x16 = unsafe { grown(&self.gpu, &mut self.x16, need.max(n_in)) }?;
        if !served {
            self.gpu.cast16(x, x16, n_in)?;
        }
        Ok(())
    }

    /// Steps 1–2: `x`'s 16-bit copy and the two 16-bit products into the scratch; op `at`.
    fn try_act16_gate_up(
        &mut self,
        x: &CudaSlice<f32>,
        [wg, wu]: [&CudaLinear; 2],
        rows: usize,
        at: u64,
    ) -> Result<(), CudaError> {
        let (d_in, inter) = (wg.d_in, wg.d_out);
        assert!(
            wu.d_in == d_in && wu.d_out == inter,
            "gated_mlp_in: gate and up shapes differ"
        );
        let (n_in, n) = (rows * d_in, rows * inter);
        assert!(x.len() >= n_in, "gated_mlp_in: x too small");
        // SAFETY: `x16` then takes SwiGLU's output (n elements): swiglu16 writes them before
        // down reads them.
        unsafe { self.x16_input(x, n_in, n_in.max(n), at) }?;
        let x16 = self.x16.as_ref().expect("grown by x16_input");
        let s = &mut self.act16_scratch;
        // SAFETY: the GEMMs below write all n elements of each before SwiGLU reads them.
        let gate = unsafe { grown(&self.gpu, &mut s.gate, n) }?;
        self.gpu
            .gemm16(x16, &wg.w.view(), rows, d_in, inter, gate)?;
        // SAFETY: as above.
        let up = unsafe { grown(&self.gpu, &mut s.up, n) }?;
        self.gpu.gemm16(x16, &wu.w.view(), rows, d_in, inter, up)
    }

    /// Step 3: SwiGLU over the 16-bit products into `x16` and, with `f32_copy`, `act`; tags
    /// `x16` for down, op `at + 1`.
    fn try_act16_swiglu(
        &mut self,
        f32_copy: bool,
        act: &mut CudaSlice<f32>,
        n: usize,
        at: u64,
    ) -> Result<(), CudaError> {
        assert!(act.len() >= n, "gated_mlp_in: act too small");
        let s = &self.act16_scratch;
        let (Some(gate), Some(up), Some(x16)) = (s.gate.as_ref(), s.up.as_ref(), self.x16.as_mut())
        else {
            return Err(CudaError::Unsupported(
                "act16 SwiGLU before its products".into(),
            ));
        };
        (self.gpu).swiglu16(gate, up, x16, f32_copy.then_some(act), n)?;
        // `x16` holds `act` in the weight dtype: down, the next op, reads it without a cast.
        self.x16_tag = Some(super::fused::X16Tag {
            ptr: self.gpu.p(act),
            len: n,
            at,
        });
        Ok(())
    }

    /// Grows the 16-bit gate and up scratch to `n` elements each (a graph's largest, before a
    /// capture: a captured graph bakes their addresses in); nothing with the switch off.
    pub(super) fn act16_reserve(&mut self, n: usize) -> Result<(), CudaError> {
        if self.gpu.act16.is_none() {
            return Ok(());
        }
        let s = &mut self.act16_scratch;
        // SAFETY: the scratch is written by the 16-bit GEMMs before SwiGLU reads it.
        unsafe { grown(&self.gpu, &mut s.gate, n) }?;
        // SAFETY: as above.
        unsafe { grown(&self.gpu, &mut s.up, n) }?;
        Ok(())
    }

    /// The 16-bit scratch addresses a captured graph reads (0 with the switch off, so
    /// switching it changes the graph fingerprint).
    pub(super) fn act16_addrs(&self) -> [u64; 2] {
        let s = &self.act16_scratch;
        let p = |b: &Option<CudaSlice<u16>>| match (&self.gpu.act16, b) {
            (Some(_), Some(b)) => self.gpu.p(b),
            _ => 0,
        };
        [p(&s.gate), p(&s.up)]
    }

    /// Switches the 16-bit MLP activations on or off (tests, benchmarks), and with them the
    /// 16-bit residual stream (`residual16.rs`): between forward passes only; compiles on
    /// first use. On with f32 weights is an error: there is no 16-bit type.
    pub fn set_act16(&mut self, on: bool) -> Result<()> {
        self.gpu.act16 = if on {
            let a = Act16::load(&self.gpu.ctx, self.gpu.weight_dtype)?;
            if a.is_none() {
                return Err(CudaError::Unsupported(
                    "16-bit activations (THAW_CUDA_BF16_ACT, on by default) need bf16 or f16 \
                     weights; with f32 weights they stay off (or set THAW_CUDA_BF16_ACT=0)"
                        .into(),
                )
                .into());
            }
            a
        } else {
            None
        };
        // The residual stream follows the switch (`residual16.rs`).
        self.gpu.load_residual16()?;
        self.load_attn_out16()?;
        self.x16_tag = None;
        Ok(())
    }

    /// Whether the 16-bit MLP activations are switched on (they run where the plan serves).
    pub fn act16(&self) -> bool {
        self.gpu.act16.is_some()
    }

    /// `swiglu16_T` over host `gate` and `up` (bit patterns of the weight dtype): its 16-bit
    /// output and, with `f32_copy`, its f32 one (parity tests and benchmarks; synchronises).
    /// Needs the switch on.
    pub fn swiglu16_host(
        &mut self,
        gate: &[u16],
        up: &[u16],
        f32_copy: bool,
    ) -> Result<(Vec<u16>, Option<Vec<f32>>)> {
        let n = gate.len();
        assert_eq!(up.len(), n, "swiglu16_host: gate and up lengths differ");
        let g = &self.gpu;
        let up_dev = |v: &[u16]| -> Result<CudaSlice<u16>, CudaError> {
            let mut d = g.alloc_zeros::<u16>(n.max(1))?;
            if n > 0 {
                g.htod(v, &mut d)?;
            }
            Ok(d)
        };
        let (gd, ud) = (up_dev(gate)?, up_dev(up)?);
        let mut o16 = g.alloc_zeros::<u16>(n.max(1))?;
        let mut o32 = if f32_copy {
            Some(g.alloc_zeros::<f32>(n.max(1))?)
        } else {
            None
        };
        g.swiglu16(&gd, &ud, &mut o16, o32.as_mut(), n)?;
        let mut h16 = vec![0u16; n];
        if n > 0 {
            g.dtoh(&o16.slice(..n), &mut h16[..])?;
        }
        g.sync()?;
        let h32 = match &o32 {
            Some(o) => Some(self.download_f32(o, n)?),
            None => None,
        };
        Ok((h16, h32))
    }
}
