//! Every raw CUDA call of the backend: kernel launches, cuBLAS, stream memory operations, host
//! memory registration (cuBLASLt's are in `lt.rs`). Everything above this module uses
//! the safe methods of [`Gpu`], which check buffer sizes against the shapes they are given
//! before launching.
//!
//! Launch arguments are passed by value exactly as the `extern "C"` signatures in
//! `thaw-kernels/src/cuda/*.cu` declare them: pointers as `u64`, `int` as `i32`, `long` as
//! `i64`, `u32`, `float` as `f32`.
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::attn_out::AttnOut;
use super::CudaError;

/// Device address of a slice's first element.
pub(super) fn dptr<T>(s: &impl DevicePtr<T>, stream: &CudaStream) -> u64 {
    // Event tracking is disabled for the backend's context (see `Gpu::new`), so the returned
    // guard records nothing; ordering comes from the single compute stream.
    s.device_ptr(stream).0
}

pub(super) fn int(n: usize, what: &str) -> i32 {
    i32::try_from(n).unwrap_or_else(|_| panic!("{what} = {n} does not fit a kernel's int"))
}

pub(super) fn blocks(n: usize, per: u32, cap: u32) -> u32 {
    (n.div_ceil(per as usize) as u32).clamp(1, cap)
}

/// A product's bias for cuBLASLt's epilogue (made only where cuBLASLt runs the product:
/// `CudaBackend::epilogue_bias`): the device addresses of its `d_out` values in f32 (what the
/// epilogue of an f32 output reads) and as stored in the weight dtype (what `add_bias` reads,
/// should cuBLASLt refuse the epilogue for the shape).
#[derive(Copy, Clone, Debug)]
pub(super) struct EpilogueBias {
    pub f32: u64,
    pub stored: u64,
}

/// The kernels one backend launches, resolved once for its weight and KV dtypes.
struct Kernels {
    embed: CudaFunction,
    add_bias: CudaFunction,
    rms_norm: CudaFunction,
    cast_x: Option<CudaFunction>,
    residual_add: CudaFunction,
    swiglu: CudaFunction,
    gather_rows: CudaFunction,
    rope: CudaFunction,
    write_kv: CudaFunction,
    attn_decode: CudaFunction,
    attn_prefill: CudaFunction,
    sgmv_shrink: CudaFunction,
    sgmv_expand: CudaFunction,
    bgmv_shrink: CudaFunction,
    bgmv_expand: CudaFunction,
    export_rows: CudaFunction,
    merge_deltas: CudaFunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, w: DType, kv: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        let wf = |base: &str| f(&format!("{base}_{}", w.suffix()));
        let kf = |base: &str| f(&format!("{base}_{}", kv.suffix()));
        Ok(Self {
            embed: wf("embed_gather")?,
            add_bias: wf("add_bias")?,
            rms_norm: wf("rms_norm")?,
            cast_x: match w {
                DType::F32 => None,
                DType::Bf16 => Some(f("cast_f32_to_bf16")?),
                DType::F16 => Some(f("cast_f32_to_f16")?),
            },
            residual_add: f("residual_add_f32")?,
            swiglu: f("swiglu_f32")?,
            gather_rows: f("gather_rows_f32")?,
            rope: f("rope_f32")?,
            write_kv: kf("write_kv")?,
            attn_decode: kf("attn_decode")?,
            attn_prefill: kf("attn_prefill")?,
            sgmv_shrink: wf("sgmv_shrink")?,
            sgmv_expand: wf("sgmv_expand")?,
            bgmv_shrink: wf("bgmv_shrink")?,
            bgmv_expand: wf("bgmv_expand")?,
            export_rows: f("export_rows")?,
            merge_deltas: f("merge_deltas")?,
        })
    }
}

/// Launches `func` with arguments given as values; each becomes a temporary that lives until
/// the launch call returns (cuLaunchKernel copies the parameters before returning).
macro_rules! launch {
    ($gpu:expr, $func:expr, $grid:expr, $block:expr, smem $smem:expr, [$($arg:expr),* $(,)?]) => {
        $gpu.launch_raw_smem(
            $func,
            $grid,
            $block,
            $smem,
            &mut [$(&mut { $arg } as *mut _ as *mut std::ffi::c_void),*],
        )
    };
    ($gpu:expr, $func:expr, $grid:expr, $block:expr, [$($arg:expr),* $(,)?]) => {
        $gpu.launch_raw_smem(
            $func,
            $grid,
            $block,
            0,
            &mut [$(&mut { $arg } as *mut _ as *mut std::ffi::c_void),*],
        )
    };
}
pub(super) use launch;

/// Attention geometry shared by the decode and prefill launches.
#[derive(Copy, Clone, Debug)]
pub(super) struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// 0 = no sliding window.
    pub window: usize,
    pub scale: f32,
}

/// A prefill attention kernel with `attn_prefill_T`'s signature and its launch shape.
#[derive(Copy, Clone)]
pub(super) struct PrefillKernel<'a> {
    pub func: &'a CudaFunction,
    /// Threads per block.
    pub block: u32,
    /// Blocks along y: the query heads (the FA kernel: query heads / heads per block).
    pub grid_y: u32,
    /// Dynamic shared memory, bytes (0 but for the FA kernel).
    pub smem: u32,
}

/// The context, the compute stream, cuBLAS and the resolved kernels.
pub(super) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    pub weight_dtype: DType,
    pub kv_dtype: DType,
    /// The Punica-shaped LoRA kernels (`sgmv.rs`, the default); `None` = `lora.cu`'s.
    pub punica: Option<super::sgmv::Punica>,
    /// Flash-decoding (`flash.rs`, the default); `None` = `attention.cu`'s decode.
    pub flash: Option<super::flash::FlashDecode>,
    /// Fused add + RMSNorm and SwiGLU + cast (`fused.rs`, the default); `None` = separate.
    pub fused: Option<super::fused::Fused>,
    /// Prefill attention on the tensor cores (`attn_prefill_tc.rs`, the default where
    /// served); `None` = `attention.cu`'s prefill.
    pub tc_prefill: Option<super::attn_prefill_tc::TcPrefill>,
    /// The FlashAttention-2-style prefill (`attn_prefill_fa.rs`, opt-in), run in place of
    /// `tc_prefill` where that is loaded; `None` = `tc_prefill`.
    pub fa_prefill: Option<super::attn_prefill_fa::FaPrefill>,
    /// Wide RMSNorm / add + RMSNorm / RoPE (`wide.rs`, default); `None` = the classic kernels.
    pub wide: Option<super::wide::Wide>,
    /// RoPE folded into the KV write (`wide.rs`, default); `None` = separate RoPE launches.
    pub rope_fold: Option<super::wide::RopeFold>,
    /// q/k/v and gate/up as one product (`group.rs`, default); `None` = one per module.
    pub group: Option<super::group::Group>,
    /// Greedy token ids on the device (`argmax.rs`, default); `None` = the logits' copy and
    /// the host's argmax.
    pub argmax: Option<super::argmax::DeviceArgmax>,
    /// What this backend asked of the driver (`counters.rs`).
    pub counters: super::counters::Counters,
    /// Products of few rows as a GEMV (`gemv.rs`, default); `None` = cast + cuBLAS.
    pub gemv: Option<super::gemv::Gemv>,
    /// The LoRA of q/k/v and gate/up as one launch pair over slices (`lora_slices.rs`,
    /// default); `None` = a pair per module.
    pub slices: Option<super::lora_slices::Slices>,
    /// SGMV / BGMV of few rows as one fused launch (`lora_small.rs`, opt-in); `None` = the
    /// two Punica launches.
    pub small: Option<super::lora_small::LoraSmall>,
    /// The occupancy-planned decode attention (`attn_occupancy.rs`, default); when loaded it
    /// runs eager steps' decode instead of `flash` or `attention.cu`.
    pub occupancy: Option<super::attn_occupancy::OccupancyDecode>,
    /// Products through cuBLASLt, bias in its epilogue (`lt.rs`, default); `None` = GemmEx.
    pub lt: Option<super::lt::Lt>,
    /// 16-bit gate/up outputs and SwiGLU (`act16.rs`, default); `None` = f32.
    pub act16: Option<super::act16::Act16>,
    /// The residual stream in 16 bits (`residual16.rs`, with `act16`); `None` = f32.
    pub residual16: Option<super::residual16::Residual16>,
    /// The attention kernels' 16-bit-output entries (`attn_out.rs`, with `act16`).
    pub attn_out16: Option<super::attn_out::AttnOut16>,
}

impl Gpu {
    pub fn new(ordinal: usize, weight_dtype: DType, kv_dtype: DType) -> Result<Self, CudaError> {
        if !super::cuda_available() {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: nothing has been allocated or launched in this context by us yet, and the
        // backend orders all of its work itself: one compute stream, plus explicit events for
        // the adapter copy stream (stream.rs). Without per-slice events every launch costs
        // only the launch.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let k = Kernels::load(&ctx, weight_dtype, kv_dtype)?;
        // Issue 29's kernels are loaded by the backend once it has resolved them
        // (`CudaBackend::load_kernels`): which run depends on the model's shape too.
        Ok(Self {
            punica: None,
            flash: None,
            fused: None,
            tc_prefill: None,
            fa_prefill: None,
            wide: None,
            rope_fold: None,
            group: None,
            argmax: None,
            counters: Default::default(),
            gemv: None,
            slices: None,
            small: None,
            occupancy: None,
            lt: None,
            act16: None,
            residual16: None,
            attn_out16: None,
            ctx,
            stream,
            blas,
            k,
            weight_dtype,
            kv_dtype,
        })
    }

    /// Device address of a buffer or of a view into one (CUDA graphs read views of their
    /// persistent metadata buffer, `graph.rs`).
    pub fn p<T>(&self, s: &impl DevicePtr<T>) -> u64 {
        dptr(s, &self.stream)
    }

    /// Launches `func` with `smem` bytes of dynamic shared memory (0 for static-only kernels).
    ///
    /// # Safety
    /// `params` must match `func`'s C signature in count, order and size, and every pointer
    /// among them must be valid for the accesses the kernel makes given the other arguments;
    /// `smem` is what the kernel expects and within the function's dynamic shared-memory limit.
    pub(super) unsafe fn launch_raw_smem(
        &self,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.counters.launch();
        // SAFETY: forwarded to the caller (see `# Safety`); the stream belongs to `ctx`.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.cu_function(),
                grid,
                (block, 1, 1),
                smem,
                self.stream.cu_stream(),
                params,
            )
        }?;
        Ok(())
    }

    /// out[r, :] = table[ids[r], :] (table of the weight dtype, `[vocab, hidden]`).
    pub fn embed(
        &self,
        table: &impl DevicePtr<u8>,
        ids: &impl DevicePtr<u32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        assert!(
            ids.len() >= rows && out.len() >= rows * hidden,
            "embed: buffers too small"
        );
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: embed_gather_T(const T*, const u32*, float*, int, int). `out` holds
        // rows × hidden f32 (checked); ids hold `rows` entries which the engine validated
        // against the vocabulary, the size `table` was uploaded with.
        unsafe {
            launch!(
                self,
                &self.k.embed,
                (rows as u32, 1, 1),
                256,
                [
                    self.p(table),
                    self.p(ids),
                    self.p(out),
                    int(rows, "rows"),
                    int(hidden, "hidden")
                ]
            )
        }
    }

    /// y[r, :] += bias.
    pub fn add_bias(
        &self,
        y: &mut CudaSlice<f32>,
        bias: &CudaSlice<u8>,
        rows: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        assert!(
            bias.len() >= d * self.weight_dtype.size(),
            "add_bias: bias too small"
        );
        // SAFETY: `bias` holds d values of the weight dtype (checked).
        unsafe { self.add_bias_at(y, self.p(bias), rows, d) }
    }

    /// y[r, :] += the `d` weight-dtype values at device address `bias`.
    ///
    /// # Safety
    /// `bias` points at `d` values of the weight dtype, live until the launch completes.
    pub(super) unsafe fn add_bias_at(
        &self,
        y: &mut CudaSlice<f32>,
        bias: u64,
        rows: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        assert!(y.len() >= rows * d, "add_bias: buffers too small");
        // SAFETY: add_bias_T(float*, const T*, int, int); y holds rows × d f32 (checked), bias
        // d values of T (this function's contract).
        unsafe {
            launch!(
                self,
                &self.k.add_bias,
                (blocks(rows * d, 256, 4096), 1, 1),
                256,
                [self.p(y), bias, int(rows, "rows"), int(d, "d")]
            )
        }
    }

    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        assert!(
            x.len() >= rows * d && out.len() >= rows * d,
            "rms_norm: buffers too small"
        );
        assert!(
            w.len() >= d * self.weight_dtype.size(),
            "rms_norm: weight too small"
        );
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: rms_norm_T(const float*, const T*, float*, int, int, float); one block per
        // row (block_sum needs blockDim a multiple of 32: 256); sizes checked above.
        unsafe {
            launch!(
                self,
                &self.k.rms_norm,
                (rows as u32, 1, 1),
                256,
                [
                    self.p(x),
                    self.p(w),
                    self.p(out),
                    int(rows, "rows"),
                    int(d, "d"),
                    eps
                ]
            )
        }
    }

    /// out[rows, d_out] = x[rows, d_in] · Wᵀ (+ `bias`) with W `[d_out, d_in]` of the weight
    /// dtype, f32 accumulation. For 16-bit weights x is first cast into `x16` (grown as needed).
    /// `bias` is an f32 bias cuBLASLt's epilogue adds ([`Gpu::gemm`]).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        x: &CudaSlice<f32>,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: &mut CudaSlice<f32>,
        x16: &mut Option<CudaSlice<u16>>,
        bias: Option<EpilogueBias>,
    ) -> Result<(), CudaError> {
        assert!(
            x.len() >= rows * d_in && out.len() >= rows * d_out,
            "linear: buffers too small"
        );
        assert!(
            w.len() >= d_in * d_out * self.weight_dtype.size(),
            "linear: weight too small"
        );
        if rows == 0 {
            return Ok(());
        }
        let (a_type, b_ptr) = match self.weight_dtype {
            DType::F32 => (blas_sys::cudaDataType::CUDA_R_32F, self.p(x)),
            DType::Bf16 => (
                blas_sys::cudaDataType::CUDA_R_16BF,
                self.cast_x16(x, rows * d_in, x16)?,
            ),
            DType::F16 => (
                blas_sys::cudaDataType::CUDA_R_16F,
                self.cast_x16(x, rows * d_in, x16)?,
            ),
        };
        self.gemm(a_type, b_ptr, w, rows, d_in, d_out, out, bias)
    }

    /// Casts the first `n` values of `x` to the (16-bit) weight dtype into `x16` (grown as
    /// needed); its device address. Err for f32 weights (nothing to cast to).
    pub(super) fn cast_x16(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        x16: &mut Option<CudaSlice<u16>>,
    ) -> Result<u64, CudaError> {
        let Some(cast) = &self.k.cast_x else {
            return Err(CudaError::Unsupported(
                "f32 weights take no 16-bit input".into(),
            ));
        };
        assert!(x.len() >= n, "cast_x16: x too small");
        // SAFETY: the cast below writes all n elements.
        let xb = unsafe { self.x16_ptr(x16, n) }?;
        // SAFETY: cast_f32_to_{bf16,f16}(const float*, T*, long); x holds n f32 (checked) and
        // x16 at least n 16-bit elements (grown above).
        unsafe {
            launch!(
                self,
                cast,
                (blocks(n, 256, 4096), 1, 1),
                256,
                [self.p(x), xb, n as i64]
            )
        }?;
        Ok(xb)
    }

    /// The cuBLAS product of [`Gpu::linear`]: out[rows, d_out] = B[rows, d_in] · Wᵀ with B at
    /// device address `b_ptr` of `a_type` (the weight dtype's, or f32 for f32 weights). With
    /// cuBLASLt on (`lt.rs`) it runs there, `bias` added by its epilogue; otherwise through
    /// `cublasGemmEx`, and `bias` must be `None` (only cuBLASLt's callers make one).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        a_type: blas_sys::cudaDataType,
        b_ptr: u64,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: &mut CudaSlice<f32>,
        bias: Option<EpilogueBias>,
    ) -> Result<(), CudaError> {
        if let Some(lt) = &self.lt {
            let o = super::lt::LtOut {
                ptr: self.p(out),
                dtype: DType::F32,
            };
            match self.lt_product(lt, b_ptr, w, rows, d_in, d_out, o, bias.map(|b| b.f32)) {
                Ok(added) => {
                    if let (Some(b), false) = (bias, added) {
                        // SAFETY: `stored` is the product's bias as uploaded (d_out
                        // weight-dtype values), owned by the weight the caller holds.
                        unsafe { self.add_bias_at(out, b.stored, rows, d_out) }?;
                    }
                    return Ok(());
                }
                // No cuBLASLt algorithm for this product (nothing enqueued): cublasGemmEx
                // below, and the bias added after it.
                Err(CudaError::LtNoAlgorithm) => {}
                Err(e) => return Err(e),
            }
        } else if bias.is_some() {
            return Err(CudaError::Unsupported(
                "a bias epilogue without cuBLASLt (set THAW_CUDA_CUBLASLT=1)".into(),
            ));
        }
        // SAFETY: B (`b_ptr`, the callers' x or its cast) holds rows × d_in of `a_type` and
        // out rows × d_out f32 (checked by the callers); (16BF|16F|32F, same, 32F) with
        // COMPUTE_32F is a supported GemmEx combo.
        unsafe {
            self.gemm_ex(
                a_type,
                b_ptr,
                w,
                (rows, d_in, d_out),
                self.p(out),
                blas_sys::cudaDataType::CUDA_R_32F,
            )
        }?;
        if let Some(b) = bias {
            // SAFETY: as above: `stored` holds the product's d_out bias values.
            unsafe { self.add_bias_at(out, b.stored, rows, d_out) }?;
        }
        Ok(())
    }

    /// `cublasGemmEx` of row-major C[rows, d_out] = B[rows, d_in] · Wᵀ, f32 accumulation
    /// (`CUBLAS_COMPUTE_32F`): B at `b_ptr` of `a_type` (W's too), C at `c_ptr` of `c_type`.
    ///
    /// # Safety
    /// `b_ptr` holds rows × d_in elements of `a_type` and `c_ptr` rows × d_out of `c_type`;
    /// (`a_type`, `a_type`, `c_type`) with COMPUTE_32F is a combination GemmEx supports.
    pub(super) unsafe fn gemm_ex(
        &self,
        a_type: blas_sys::cudaDataType,
        b_ptr: u64,
        w: &impl DevicePtr<u8>,
        (rows, d_in, d_out): (usize, usize, usize),
        c_ptr: u64,
        c_type: blas_sys::cudaDataType,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.counters.gemm();
        // Row-major y = x·Wᵀ is column-major yᵀ = W·xᵀ: W read column-major is [d_in, d_out]
        // (transposed: op T), xᵀ is [d_in, rows] (op N), yᵀ is [d_out, rows].
        // SAFETY: the handle is bound to our stream; A = W holds d_out × d_in elements (the
        // callers checked it), B and C hold what this function's contract says.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(d_out, "d_out"),
                int(rows, "rows"),
                int(d_in, "d_in"),
                &alpha as *const f32 as *const c_void,
                self.p(w) as *const c_void,
                a_type,
                int(d_in, "d_in"),
                b_ptr as *const c_void,
                a_type,
                int(d_in, "d_in"),
                &beta as *const f32 as *const c_void,
                c_ptr as *mut c_void,
                c_type,
                int(d_out, "d_out"),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    pub fn residual_add(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(y.len() >= n && x.len() >= n, "add: buffers too small");
        // SAFETY: residual_add_f32(float*, const float*, long); both hold n elements.
        unsafe {
            launch!(
                self,
                &self.k.residual_add,
                (blocks(n, 256, 4096), 1, 1),
                256,
                [self.p(y), self.p(x), n as i64]
            )
        }
    }

    pub fn swiglu(
        &self,
        g: &CudaSlice<f32>,
        u: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(
            g.len() >= n && u.len() >= n && out.len() >= n,
            "swiglu: buffers too small"
        );
        // SAFETY: swiglu_f32(const float*, const float*, float*, long); all hold n elements.
        unsafe {
            launch!(
                self,
                &self.k.swiglu,
                (blocks(n, 256, 4096), 1, 1),
                256,
                [self.p(g), self.p(u), self.p(out), n as i64]
            )
        }
    }

    /// out[i, :] = x[rows[i], :]; `rows` entries are < x.len() / width (the caller's rows).
    pub fn gather_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: &impl DevicePtr<u32>,
        n: usize,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        assert!(
            rows.len() >= n && out.len() >= n * width,
            "gather_rows: buffers too small"
        );
        if n == 0 {
            return Ok(());
        }
        // SAFETY: gather_rows_f32(const float*, const u32*, float*, int, int); out holds
        // n × width; every row index was checked against x by the caller (backend.rs).
        unsafe {
            launch!(
                self,
                &self.k.gather_rows,
                (n as u32, 1, 1),
                256,
                [
                    self.p(x),
                    self.p(rows),
                    self.p(out),
                    int(n, "n"),
                    int(width, "width")
                ]
            )
        }
    }

    /// Rotates `[tokens, n_heads, head_dim]` in place.
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &impl DevicePtr<u32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        assert!(x.len() >= tokens * n_heads * head_dim && positions.len() >= tokens);
        assert!(
            inv_freq.len() * 2 == head_dim,
            "rope: inv_freq is not head_dim / 2"
        );
        if tokens == 0 {
            return Ok(());
        }
        // SAFETY: rope_f32(float*, const u32*, const float*, int, int, int); sizes checked.
        unsafe {
            launch!(
                self,
                &self.k.rope,
                (tokens as u32, 1, 1),
                64,
                [
                    self.p(x),
                    self.p(positions),
                    self.p(inv_freq),
                    int(tokens, "tokens"),
                    int(n_heads, "n_heads"),
                    int(head_dim, "head_dim")
                ]
            )
        }
    }

    /// Writes rows of k, v (f32 `[rows, token_len]`) into cache slots (`slots[r]` < cache
    /// tokens; checked by the caller against the block tables it built them from).
    #[allow(clippy::too_many_arguments)]
    pub fn write_kv(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        kc: &mut CudaSlice<u8>,
        vc: &mut CudaSlice<u8>,
        slots: &impl DevicePtr<u32>,
        rows: usize,
        token_len: usize,
    ) -> Result<(), CudaError> {
        assert!(k.len() >= rows * token_len && v.len() >= rows * token_len && slots.len() >= rows);
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: write_kv_T(const float*, const float*, T*, T*, const u32*, int, int); the
        // slots address whole token rows inside the caches (caller's invariant, above).
        unsafe {
            launch!(
                self,
                &self.k.write_kv,
                (rows as u32, 1, 1),
                256,
                [
                    self.p(k),
                    self.p(v),
                    self.p(kc),
                    self.p(vc),
                    self.p(slots),
                    int(rows, "rows"),
                    int(token_len, "token_len")
                ]
            )
        }
    }

    /// Decode attention for `n` rows described by `row_meta` (3 u32 each).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(
        &self,
        q: &CudaSlice<f32>,
        kc: &CudaSlice<u8>,
        vc: &CudaSlice<u8>,
        out: AttnOut<'_>,
        tables: &impl DevicePtr<u32>,
        row_meta: &impl DevicePtr<u32>,
        n: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        assert!(
            s.head_dim <= shape::MAX_HEAD_DIM,
            "head_dim {} > {}",
            s.head_dim,
            shape::MAX_HEAD_DIM
        );
        assert!(row_meta.len() >= 3 * n);
        if n == 0 {
            return Ok(());
        }
        let func = self.attn_kernel(&out, &self.k.attn_decode, |k| Some(&k.decode))?;
        // SAFETY: attn_decode_T(q, kc, vc, out, block_tables, row_meta, int rows, int n_heads,
        // int n_kv_heads, int head_dim, int block_size, int window, float scale), `out` of the
        // entry's output type (attn_kernel picks attn_decode_T_out_W for a 16-bit `out`); the
        // metadata was built by step.rs from the same StepLayout whose K/V were written, so
        // every block table entry and row index is in range; blockDim = 32 · ATTN_WARPS as
        // compiled.
        unsafe {
            launch!(
                self,
                func,
                (n as u32, s.n_heads as u32, 1),
                32 * shape::ATTN_WARPS,
                [
                    self.p(q),
                    self.p(kc),
                    self.p(vc),
                    out.ptr(self),
                    self.p(tables),
                    self.p(row_meta),
                    int(n, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim"),
                    int(s.block_size, "block_size"),
                    int(s.window, "window"),
                    s.scale
                ]
            )
        }
    }

    /// Prefill attention over `n_tiles` tiles (4 u32 each).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        q: &CudaSlice<f32>,
        kc: &CudaSlice<u8>,
        vc: &CudaSlice<u8>,
        out: AttnOut<'_>,
        tables: &impl DevicePtr<u32>,
        tiles: &impl DevicePtr<u32>,
        n_tiles: usize,
        s: AttnShape,
    ) -> Result<(), CudaError> {
        assert!(
            s.head_dim <= shape::MAX_HEAD_DIM,
            "head_dim {} > {}",
            s.head_dim,
            shape::MAX_HEAD_DIM
        );
        let k = PrefillKernel {
            func: self.attn_kernel(&out, &self.k.attn_prefill, |k| Some(&k.prefill))?,
            block: 32 * shape::ATTN_WARPS,
            grid_y: s.n_heads as u32,
            smem: 0,
        };
        // SAFETY: attn_prefill_T (or its 16-bit-output twin for a 16-bit `out`) is compiled for blockDim 32 · ATTN_WARPS and tiles of at most
        // PREFILL_Q rows, the tile size step.rs cuts with when the tensor-core kernel is off.
        unsafe { self.launch_prefill(k, q, (kc, vc), out, (tables, tiles, n_tiles), s) }
    }

    /// Launches a prefill attention kernel with `attn_prefill_T`'s signature (`attention.cu`'s,
    /// or the tensor-core one, which shares it).
    ///
    /// # Safety
    /// `k.func` has that signature with `out` of `out`'s element type, runs with `k.block`
    /// threads, serves tiles as long as the metadata's (step.rs cuts them to the loaded
    /// kernel's tile) and serves `s.head_dim`.
    pub(super) unsafe fn launch_prefill(
        &self,
        k: PrefillKernel<'_>,
        q: &CudaSlice<f32>,
        (kc, vc): (&CudaSlice<u8>, &CudaSlice<u8>),
        out: AttnOut<'_>,
        (tables, tiles, n_tiles): (&impl DevicePtr<u32>, &impl DevicePtr<u32>, usize),
        s: AttnShape,
    ) -> Result<(), CudaError> {
        assert!(tiles.len() >= 4 * n_tiles);
        if n_tiles == 0 {
            return Ok(());
        }
        // SAFETY: the kernel's signature, block size, tile size and head_dim are the caller's
        // (`# Safety`); the tiles and tables come from step.rs over the StepLayout whose K/V
        // were written, so every table entry and row is in range, as for decode.
        unsafe {
            launch!(
                self,
                k.func,
                (n_tiles as u32, k.grid_y, 1),
                k.block,
                smem k.smem,
                [
                    self.p(q),
                    self.p(kc),
                    self.p(vc),
                    out.ptr(self),
                    self.p(tables),
                    self.p(tiles),
                    int(n_tiles, "n_tiles"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim"),
                    int(s.block_size, "block_size"),
                    int(s.window, "window"),
                    s.scale
                ]
            )
        }
    }

    /// SGMV shrink then expand: y[seg rows] += scale · x · Aᵀ · Bᵀ for `n_segs` segments,
    /// the longest `max_seg_rows` rows; `v` is `[rows, v_stride]` scratch, `v_stride` ≥ every
    /// segment's rank for this slot.
    #[allow(clippy::too_many_arguments)]
    pub fn sgmv(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        seg_tables: &CudaSlice<u64>,
        seg_rows: &CudaSlice<u32>,
        (n_segs, max_seg_rows): (usize, usize),
        slot: usize,
        (d_in, d_out, v_stride): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        assert!(seg_tables.len() >= n_segs && seg_rows.len() >= 2 * n_segs);
        assert!(
            v_stride <= shape::MAX_LORA_RANK,
            "LoRA rank {v_stride} > {}",
            shape::MAX_LORA_RANK
        );
        if n_segs == 0 || v_stride == 0 || max_seg_rows == 0 {
            return Ok(());
        }
        let chunks = (max_seg_rows as u32).div_ceil(shape::LORA_ROWS);
        // SAFETY: sgmv_shrink_T(const float* x, float* v, const u64* seg_tables, const u32*
        // seg_rows, int n_segs, int slot, int d_in, int v_stride). Each table is a live
        // CudaLora descriptor array with more than `slot` entries whose A/B point at
        // [rank, d_in] / [d_out, rank] device weights; segment rows lie inside x, y and v
        // (step.rs builds them from the step's rows, and v/x/y are sized for the max batch).
        unsafe {
            launch!(
                self,
                &self.k.sgmv_shrink,
                (n_segs as u32, v_stride as u32, chunks),
                32 * shape::LORA_WARPS,
                [
                    self.p(x),
                    self.p(v),
                    self.p(seg_tables),
                    self.p(seg_rows),
                    int(n_segs, "n_segs"),
                    int(slot, "slot"),
                    int(d_in, "d_in"),
                    int(v_stride, "v_stride")
                ]
            )?;
            launch!(
                self,
                &self.k.sgmv_expand,
                (
                    n_segs as u32,
                    (d_out as u32).div_ceil(shape::LORA_EXPAND_THREADS),
                    chunks
                ),
                shape::LORA_EXPAND_THREADS,
                [
                    self.p(v),
                    self.p(y),
                    self.p(seg_tables),
                    self.p(seg_rows),
                    int(n_segs, "n_segs"),
                    int(slot, "slot"),
                    int(d_out, "d_out"),
                    int(v_stride, "v_stride")
                ]
            )
        }
    }

    /// BGMV shrink then expand over `rows` rows; `row_tables[r]` = 0 for rows without LoRA.
    #[allow(clippy::too_many_arguments)]
    pub fn bgmv(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        row_tables: &impl DevicePtr<u64>,
        rows: usize,
        slot: usize,
        (d_in, d_out, max_rank): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        assert!(row_tables.len() >= rows && v.len() >= rows * max_rank);
        assert!(
            max_rank <= shape::MAX_LORA_RANK,
            "LoRA rank {max_rank} > {}",
            shape::MAX_LORA_RANK
        );
        if rows == 0 || max_rank == 0 {
            return Ok(());
        }
        // SAFETY: bgmv_shrink_T(const float* x, float* v, const u64* row_tables, int rows, int
        // slot, int d_in, int max_rank) and bgmv_expand_T(v, y, row_tables, rows, slot, d_out,
        // max_rank); tables as for SGMV, every adapter's rank for this slot ≤ max_rank (the
        // caller took the max), v holds rows × max_rank (checked).
        unsafe {
            launch!(
                self,
                &self.k.bgmv_shrink,
                (rows as u32, max_rank as u32, 1),
                32 * shape::LORA_WARPS,
                [
                    self.p(x),
                    self.p(v),
                    self.p(row_tables),
                    int(rows, "rows"),
                    int(slot, "slot"),
                    int(d_in, "d_in"),
                    int(max_rank, "max_rank")
                ]
            )?;
            launch!(
                self,
                &self.k.bgmv_expand,
                (
                    rows as u32,
                    (d_out as u32).div_ceil(shape::LORA_EXPAND_THREADS),
                    1
                ),
                shape::LORA_EXPAND_THREADS,
                [
                    self.p(v),
                    self.p(y),
                    self.p(row_tables),
                    int(rows, "rows"),
                    int(slot, "slot"),
                    int(d_out, "d_out"),
                    int(max_rank, "max_rank")
                ]
            )
        }
    }

    /// The fused export: rows of x → mapped host rows at `dst` (stride `dst_stride` f32),
    /// then `seq` into the mapped word at `seq_word`.
    ///
    /// # Safety
    /// `dst` must be a device address of mapped host memory holding `n × dst_stride` f32 and
    /// `seq_word` of a mapped u32, both registered for as long as the launch may run; `counter`
    /// a device u32 that is 0 and used by no concurrent export.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn export_rows(
        &self,
        x: &CudaSlice<f32>,
        d_in: usize,
        rows: &CudaSlice<u32>,
        n: usize,
        (dst, dst_stride): (u64, usize),
        (seq_word, seq): (u64, u32),
        counter: &CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        assert!(rows.len() >= n && d_in <= dst_stride);
        let grid = blocks(n, 1, 132);
        // SAFETY: export_rows(const float*, int, const u32*, int, float*, int, volatile u32*,
        // u32, u32*); host pointers per this function's contract, row indices in x (caller).
        unsafe {
            launch!(
                self,
                &self.k.export_rows,
                (grid, 1, 1),
                256,
                [
                    self.p(x),
                    int(d_in, "d_in"),
                    self.p(rows),
                    int(n, "n"),
                    dst,
                    int(dst_stride, "dst_stride"),
                    seq_word,
                    seq,
                    self.p(counter)
                ]
            )
        }
    }

    /// Makes the compute stream wait until the u32 at mapped address `addr` is ≥ `value`
    /// (cuStreamWaitValue32 GEQ): the GPU waits, the host does not. GEQ compares cyclically,
    /// `(i32)(*addr - value) >= 0` (cuda_bench's exchange table, whose words were u32::MAX,
    /// hung on an H100), so result words must be sequence numbers, not sentinels.
    ///
    /// # Safety
    /// `addr` must be the device address of a u32 in host memory registered with
    /// `CU_MEMHOSTREGISTER_DEVICEMAP`, registered until the wait has completed.
    pub unsafe fn wait_value_geq(&self, addr: u64, value: u32) -> Result<(), CudaError> {
        // SAFETY: per this function's contract; the stream belongs to our context.
        unsafe {
            sys::cuStreamWaitValue32_v2(
                self.stream.cu_stream(),
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        }
        .result()?;
        Ok(())
    }

    /// y[rows[i], :] += delta[i, :] with delta at mapped address `delta` (stride in f32).
    ///
    /// # Safety
    /// `delta` must be the device address of mapped host memory holding `n × stride` f32,
    /// registered until the kernel has run, and complete once the preceding waits release.
    pub unsafe fn merge_deltas(
        &self,
        y: &mut CudaSlice<f32>,
        d_out: usize,
        rows: &CudaSlice<u32>,
        n: usize,
        (delta, stride): (u64, usize),
    ) -> Result<(), CudaError> {
        assert!(rows.len() >= n && d_out <= stride);
        let grid = blocks(n, 1, 132);
        // SAFETY: merge_deltas(float*, int, const u32*, int, const volatile float*, int); host
        // memory per this function's contract, row indices in y (caller).
        unsafe {
            launch!(
                self,
                &self.k.merge_deltas,
                (grid, 1, 1),
                256,
                [
                    self.p(y),
                    int(d_out, "d_out"),
                    self.p(rows),
                    int(n, "n"),
                    delta,
                    int(stride, "stride")
                ]
            )
        }
    }

    pub fn attribute(&self, a: sys::CUdevice_attribute) -> Result<i32, CudaError> {
        Ok(self.ctx.attribute(a)?)
    }
}

/// Registers `len` bytes at `ptr` as page-locked (portable; DEVICEMAP when `mapped`), returning
/// the device address when mapped.
///
/// # Safety
/// `ptr..ptr+len` must be a live host mapping that stays mapped until [`host_unregister`] is
/// called with the same `ptr`, and must not already be registered.
pub(super) unsafe fn host_register(
    ctx: &CudaContext,
    ptr: *mut u8,
    len: usize,
    mapped: bool,
) -> Result<Option<u64>, CudaError> {
    ctx.bind_to_thread()?;
    let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
    if mapped {
        flags |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    }
    // SAFETY: per this function's contract. Not write-combined: CPU workers read this memory.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }.result()?;
    if !mapped {
        return Ok(None);
    }
    let mut dev = 0u64;
    // SAFETY: `ptr` was registered with DEVICEMAP just above.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) }.result();
    if let Err(e) = r {
        // SAFETY: registered above, not yet handed out.
        unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        return Err(e.into());
    }
    Ok(Some(dev))
}

/// # Safety
/// `ptr` must have been registered by [`host_register`] and no queued GPU work may still read
/// or write it.
pub(super) unsafe fn host_unregister(ctx: &CudaContext, ptr: *mut u8) {
    let _ = ctx.bind_to_thread();
    // SAFETY: per this function's contract.
    let r = unsafe { sys::cuMemHostUnregister(ptr.cast()) }.result();
    if let Err(e) = r {
        tracing::warn!("cuMemHostUnregister failed: {e}");
    }
}

/// Asynchronous host → device copy on `stream` from registered host memory.
///
/// # Safety
/// `src..src+len` must be page-locked host memory that stays valid and unchanged until the copy
/// completes (the caller records an event after it), and `dst` must hold at least `len` bytes.
/// `dst` is shared: the caller guarantees no kernel reads the bytes written before the copy's
/// event completed (the upload pipeline publishes a layer only after its event).
pub(super) unsafe fn copy_htod_async(
    stream: &CudaStream,
    dst: &CudaSlice<u8>,
    dst_off: usize,
    src: *const u8,
    len: usize,
) -> Result<(), CudaError> {
    assert!(
        dst_off + len <= dst.len(),
        "copy_htod_async: destination too small"
    );
    let d = dptr(dst, stream) + dst_off as u64;
    // SAFETY: per this function's contract.
    unsafe { copy_htod_async_to(stream, d, src, len) }
}

/// [`copy_htod_async`] to a raw device address (a range of blocks in a KV buffer that an
/// adapter's image owns).
///
/// # Safety
/// As [`copy_htod_async`], and `dst..dst+len` must be device memory of this context that
/// stays allocated, and is written by nothing else, until the copy completes.
pub(super) unsafe fn copy_htod_async_to(
    stream: &CudaStream,
    dst: u64,
    src: *const u8,
    len: usize,
) -> Result<(), CudaError> {
    // SAFETY: per this function's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.cu_stream()) }.result()?;
    Ok(())
}
