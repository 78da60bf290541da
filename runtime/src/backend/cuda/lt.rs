//! Products through cuBLASLt (issue 29, `THAW_CUDA_CUBLASLT`; on by default, `0` for
//! `cublasGemmEx`): `cublasLtMatmul` with bf16 / f16 (or f32) operands, f32 compute and
//! scale, and the bias added by `CUBLASLT_EPILOGUE_BIAS` instead of a separate `add_bias`
//! launch. Every raw cuBLASLt call of the backend is in this file.
//!
//! With the switch on, [`Gpu::gemm`](super::launch::Gpu) (every cuBLAS product: the per-module
//! linears, the LM head, a q/k/v or gate/up group run as one `[Σ d_out, d_in]` product) calls
//! [`Gpu::lt_product`] instead of `cublasGemmEx`. The mapping is `gemm`'s: row-major
//! `y = x·Wᵀ` is column-major `yᵀ = W·xᵀ`, A = W read as `[d_in, d_out]` with op T, B = xᵀ
//! `[d_in, rows]`, D = yᵀ `[d_out, rows]`; the bias has one value per row of D (`d_out`),
//! broadcast over its columns (the rows of y).
//!
//! What it keeps, per backend:
//! - one handle, one preference (`CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES`) and one device
//!   workspace of [`workspace_bytes`] (32 MiB on Hopper, 4 MiB before), allocated when the
//!   backend is created (or the switch turned on), never per product;
//! - a cache from [`LtKey`] (shape bucket, dtypes, epilogue, operand alignments) to the matmul
//!   descriptor, the A / B / D layouts and the algorithm `cublasLtMatmulAlgoGetHeuristic` chose,
//!   built on a key's first product and destroyed with the backend. Each product sets the B and
//!   D layouts' column count to its exact rows (and the bias pointer) on the cached descriptors
//!   under the cache's lock, then calls `cublasLtMatmul`: host-side attributes only, no
//!   allocation, so a steady decode step allocates nothing and a CUDA graph captures the
//!   product like any launch.
//!
//! Biases: cuBLASLt reads the bias in D's type ([`bias_dtype`]). The f32-output products take an
//! f32 bias, which the backend keeps beside the weight-dtype one when the switch is on at load
//! ([`bias_f32`]: the 16-bit bias widened, so the epilogue adds exactly what `add_bias`
//! adds); a model loaded with the switch off keeps `add_bias` for its biased products. A 16-bit
//! output ([`CudaBackend::lt_linear_x16`], for a later bf16-activation path) reads the stored
//! weight-dtype bias directly.
//!
//! Numerics: the same operands as `cublasGemmEx` (the activations' 16-bit cast, the stored
//! weights), f32 accumulation: results differ from it only by the algorithm's summation order.
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Mutex;

use cudarc::cublaslt::{result as lt, sys as lsys};
use cudarc::driver::{CudaSlice, DevicePtr};
use thaw_kernels::cuda::KernelCache;

use super::launch::{EpilogueBias, Gpu};
use super::weights::CudaLinear;
use super::{CudaBackend, CudaError, DType};
use crate::backend::kernel_select::CUBLASLT_ENV;
use crate::backend::lt_plan::{
    bias_dtype, bias_f32, plan, product_path, workspace_bytes, Epilogue, LtKey, LtShape,
    ProductPath,
};
use crate::error::Result;

impl From<lt::CublasError> for CudaError {
    fn from(e: lt::CublasError) -> Self {
        CudaError::Unsupported(format!(
            "cuBLASLt call failed: {e:?} (set {CUBLASLT_ENV}=0 to run products through \
             cublasGemmEx)"
        ))
    }
}

fn data_type(d: DType) -> lsys::cudaDataType {
    match d {
        DType::F32 => lsys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => lsys::cudaDataType::CUDA_R_16BF,
        DType::F16 => lsys::cudaDataType::CUDA_R_16F,
    }
}

/// One key's descriptors and algorithm; null handles are not made yet (a failed build).
struct Entry {
    desc: lsys::cublasLtMatmulDesc_t,
    a: lsys::cublasLtMatrixLayout_t,
    b: lsys::cublasLtMatrixLayout_t,
    d: lsys::cublasLtMatrixLayout_t,
    algo: lsys::cublasLtMatmulAlgo_t,
}

impl Drop for Entry {
    fn drop(&mut self) {
        // SAFETY: each non-null handle was created by this entry and is destroyed once, here;
        // cuBLASLt reads descriptors when a matmul is enqueued, not when it runs, so products
        // still in flight do not use them.
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// Sets attribute `attr` of a matmul descriptor to `v`.
///
/// # Safety
/// `desc` is a live descriptor and `T` the attribute's C type.
unsafe fn set_desc<T>(
    desc: lsys::cublasLtMatmulDesc_t,
    attr: lsys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<(), CudaError> {
    // SAFETY: forwarded (see `# Safety`); `v` is read for size_of::<T>() bytes.
    unsafe {
        lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>())
    }?;
    Ok(())
}

/// Sets the column count of a layout (the rows of y, for B and D).
///
/// # Safety
/// `layout` is a live layout.
unsafe fn set_cols(layout: lsys::cublasLtMatrixLayout_t, cols: u64) -> Result<(), CudaError> {
    // SAFETY: forwarded; CUBLASLT_MATRIX_LAYOUT_COLS is a uint64_t.
    unsafe {
        lt::set_matrix_layout_attribute(
            layout,
            lsys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_COLS,
            &cols as *const u64 as *const c_void,
            size_of::<u64>(),
        )
    }?;
    Ok(())
}

/// The descriptor sets built, and the bias-epilogue keys cuBLASLt found no algorithm for (their
/// products run the default epilogue and `add_bias`; asked once per key).
#[derive(Default)]
struct Cache {
    entries: HashMap<LtKey, Entry>,
    refused: HashSet<LtKey>,
}

/// The handle, the workspace, the heuristic preference and the descriptor cache.
pub(crate) struct Lt {
    handle: lsys::cublasLtHandle_t,
    pref: lsys::cublasLtMatmulPreference_t,
    workspace: CudaSlice<u8>,
    cache: Mutex<Cache>,
}

// SAFETY: the handle and preference are only used under `&self` with the cache's mutex held
// (products) or under `&mut self` (drop); cuBLASLt handles may be used from any thread as
// long as calls on one are not concurrent, which the mutex ensures. The entries' raw handles
// are owned by the map and used under the same mutex.
unsafe impl Send for Lt {}
// SAFETY: as for Send: every use of the raw handles holds the cache's mutex.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // Descriptors first (entries' Drop), then the preference and the handle.
        self.cache
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .entries
            .clear();
        // SAFETY: created in `Lt::new`, destroyed once, here; null when creation failed.
        unsafe {
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
            if !self.handle.is_null() {
                let _ = lt::destroy_handle(self.handle);
            }
        }
    }
}

impl Lt {
    /// The handle, the preference and the workspace for `gpu`'s device; an error that says what
    /// to set where libcublasLt is missing.
    pub(super) fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        // SAFETY: only probes for the shared library (dlopen); no cuBLASLt function is called
        // (cudarc panics on a missing library otherwise).
        if !unsafe { lsys::is_culib_present() } {
            return Err(CudaError::Unsupported(format!(
                "{CUBLASLT_ENV}=1 asks for cuBLASLt products, but libcublasLt was not found; \
                 install the CUDA toolkit's cuBLAS libraries or set {CUBLASLT_ENV}=0"
            )));
        }
        let bytes = workspace_bytes(KernelCache::arch(&gpu.ctx)?);
        let workspace = gpu.alloc_zeros::<u8>(bytes)?;
        let mut me = Self {
            handle: null_mut(),
            pref: null_mut(),
            workspace,
            cache: Mutex::new(Cache::default()),
        };
        me.handle = lt::create_handle()?;
        me.pref = lt::create_matmul_pref()?;
        let limit = bytes as u64;
        // SAFETY: the preference was just created; MAX_WORKSPACE_BYTES is a uint64_t.
        unsafe {
            lt::set_matmul_pref_attribute(
                me.pref,
                lsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &limit as *const u64 as *const c_void,
                size_of::<u64>(),
            )
        }?;
        Ok(me)
    }

    /// The device workspace's bytes.
    pub(super) fn workspace_len(&self) -> usize {
        self.workspace.len()
    }

    /// Builds `key`'s descriptors and asks the heuristic for its algorithm (rows = the bucket;
    /// the bias pointer of the first product, so its alignment is considered).
    fn build(&self, key: &LtKey, bias: u64) -> Result<Entry, CudaError> {
        let mut e = Entry {
            desc: null_mut(),
            a: null_mut(),
            b: null_mut(),
            d: null_mut(),
            algo: lsys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let desc = lt::create_matmul_desc(
            lsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lsys::cudaDataType::CUDA_R_32F,
        )?;
        e.desc = desc;
        let epilogue = match key.epilogue {
            Epilogue::Default => lsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => lsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        };
        use lsys::cublasLtMatmulDescAttributes_t as A;
        // SAFETY: `desc` is live; TRANSA/TRANSB are cublasOperation_t (int32: 1 = T, 0 = N),
        // EPILOGUE a cublasLtEpilogue_t (uint32), BIAS_POINTER a device pointer (void*). The
        // bias's type is left unset: D's ([`bias_dtype`]).
        unsafe {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
            if key.epilogue == Epilogue::Bias {
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
        }
        let (w, o) = (data_type(key.weight), data_type(key.out));
        let (d_in, d_out, n) = (key.d_in as u64, key.d_out as u64, key.bucket as u64);
        e.a = lt::create_matrix_layout(w, d_in, d_out, d_in as i64)?;
        e.b = lt::create_matrix_layout(w, d_in, n, d_in as i64)?;
        e.d = lt::create_matrix_layout(o, d_out, n, d_out as i64)?;
        // The operands' alignments (the key's): the heuristic assumes 256-byte aligned
        // pointers unless told, and could pick an algorithm a less aligned view cannot run.
        use lsys::cublasLtMatmulPreferenceAttributes_t as P;
        for (attr, align) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
        ] {
            let v = align as u32;
            // SAFETY: the preference is live (the cache's lock is held by our caller, so no
            // other build changes it meanwhile); MIN_ALIGNMENT_*_BYTES are uint32_t.
            unsafe {
                lt::set_matmul_pref_attribute(
                    self.pref,
                    attr,
                    &v as *const u32 as *const c_void,
                    size_of::<u32>(),
                )
            }?;
        }
        // SAFETY: every descriptor above is live and describes the product's operands.
        let h = unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc, e.a, e.b, e.d, e.d, self.pref)
        }
        .map_err(|err| match err.0 {
            // cudarc's answer to no algorithm returned (or one whose state is this).
            lsys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => CudaError::LtNoAlgorithm,
            _ => err.into(),
        })?;
        e.algo = h.algo;
        debug_assert!(h.workspaceSize <= self.workspace.len());
        Ok(e)
    }
}

/// What a cuBLASLt product writes: D's address and dtype (f32, or the weight's 16-bit one).
#[derive(Copy, Clone, Debug)]
pub(super) struct LtOut {
    pub ptr: u64,
    pub dtype: DType,
}

impl Gpu {
    /// D[rows, d_out] = B[rows, d_in] · Wᵀ (+ bias) through cuBLASLt: B at `b_ptr` in the weight
    /// dtype (its cast, or f32 for f32 weights), `bias` (D's dtype, `d_out` values) added by the
    /// epilogue. The callers checked the buffers against the shape; `lt` is this Gpu's. Whether
    /// the bias was added: false where cuBLASLt has no algorithm with the bias epilogue for the
    /// shape (the product then ran with the default one; the caller adds the bias).
    /// [`CudaError::LtNoAlgorithm`] where it has none for the product at all, before enqueueing
    /// anything: the caller runs it through `cublasGemmEx` instead.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lt_product(
        &self,
        lt: &Lt,
        b_ptr: u64,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: LtOut,
        bias: Option<u64>,
    ) -> Result<bool, CudaError> {
        let w_ptr = self.p(w);
        let shape = |bias: bool| LtShape {
            rows,
            d_in,
            d_out,
            weight: self.weight_dtype,
            bias,
            out: out.dtype,
            addrs: [w_ptr, b_ptr, out.ptr],
        };
        let why = |why| CudaError::Unsupported(format!("cuBLASLt cannot run {why}"));
        let mut p = plan(&shape(bias.is_some())).map_err(why)?;
        debug_assert!(bias.is_none() || bias_dtype(out.dtype) == out.dtype);
        let mut guard = lt.cache.lock().unwrap_or_else(|e| e.into_inner());
        let cache = &mut *guard;
        let mut bias = bias;
        if bias.is_some() && !cache.entries.contains_key(&p.key) {
            let refused = cache.refused.contains(&p.key)
                || match lt.build(&p.key, bias.unwrap_or(0)) {
                    Ok(e) => {
                        cache.entries.insert(p.key, e);
                        false
                    }
                    Err(CudaError::LtNoAlgorithm) => {
                        tracing::warn!(
                            "cuBLASLt has no algorithm with the bias epilogue for {:?}; its \
                             products add the bias with a separate kernel",
                            p.key
                        );
                        cache.refused.insert(p.key);
                        true
                    }
                    Err(e) => return Err(e),
                };
            if refused {
                bias = None;
                p = plan(&shape(false)).map_err(why)?;
            }
        }
        let entry = match cache.entries.entry(p.key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            // A shape cuBLASLt has no algorithm for at all: the caller runs `cublasGemmEx`
            // (`Gpu::gemm`, `Gpu::gemm16`); asked once, remembered (never an entry, so the
            // steady path above does not look).
            std::collections::hash_map::Entry::Vacant(_) if cache.refused.contains(&p.key) => {
                return Err(CudaError::LtNoAlgorithm);
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                match lt.build(&p.key, bias.unwrap_or(0)) {
                    Ok(e) => v.insert(e),
                    Err(CudaError::LtNoAlgorithm) => {
                        tracing::warn!(
                            "cuBLASLt has no algorithm for {:?}; its products run through \
                             cublasGemmEx",
                            p.key
                        );
                        cache.refused.insert(p.key);
                        return Err(CudaError::LtNoAlgorithm);
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ws = self.p(&lt.workspace);
        // SAFETY: the entry's descriptors are live (owned by the cache, whose lock we hold, so
        // no other product changes them between these calls); B's and D's column count is
        // uint64_t, BIAS_POINTER a device pointer.
        unsafe {
            set_cols(entry.b, rows as u64)?;
            set_cols(entry.d, rows as u64)?;
            if let Some(b) = bias {
                set_desc(
                    entry.desc,
                    lsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &b,
                )?;
            }
        }
        // The bucket's algorithm, or (where cuBLASLt refuses it for these exact rows, before
        // enqueueing anything) none: cuBLASLt then runs its own heuristic for this call.
        let mut result = Ok(());
        for algo in [
            &entry.algo as *const lsys::cublasLtMatmulAlgo_t,
            std::ptr::null(),
        ] {
            // SAFETY: the layouts describe W (d_out × d_in of the weight dtype), B (rows × d_in,
            // the same dtype) and D (rows × d_out of out.dtype); the callers checked those
            // buffers hold that many elements. The bias, when the key's epilogue is BIAS, holds
            // d_out values of D's type (the callers'). beta = 0, so C (= D) is not read. The
            // workspace is ours, of the size the preference told the heuristic; `algo` is the
            // entry's (live while the lock is held) or null; the products are ordered on our
            // compute stream.
            result = unsafe {
                lt::matmul(
                    lt.handle,
                    entry.desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    w_ptr as *const c_void,
                    entry.a,
                    b_ptr as *const c_void,
                    entry.b,
                    out.ptr as *const c_void,
                    entry.d,
                    out.ptr as *mut c_void,
                    entry.d,
                    algo,
                    ws as *mut c_void,
                    lt.workspace.len(),
                    self.stream.cu_stream() as lsys::cudaStream_t,
                )
            };
            let refused = matches!(
                result,
                Err(lt::CublasError(
                    lsys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                        | lsys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
                ))
            );
            if !refused {
                break;
            }
            tracing::debug!(
                "cuBLASLt refused the cached algorithm for {rows} rows of {:?}",
                p.key
            );
        }
        result?;
        self.counters.gemm();
        self.counters.lt_product(bias.is_some());
        Ok(bias.is_some())
    }
}

impl CudaBackend {
    /// The f32 copy of a bias the epilogue reads, uploaded while cuBLASLt is on (None
    /// otherwise, or without a bias).
    pub(super) fn lt_bias(
        &self,
        bias: Option<&[f32]>,
    ) -> Result<Option<CudaSlice<f32>>, CudaError> {
        match (bias, &self.gpu.lt) {
            (Some(b), Some(_)) if !b.is_empty() => {
                let v = bias_f32(b, self.gpu.weight_dtype);
                Ok(Some(self.gpu.stream.clone_htod(&v)?))
            }
            _ => Ok(None),
        }
    }

    /// The bias cuBLASLt's epilogue adds to `w`'s product, where cuBLASLt runs it
    /// ([`product_path`]: not where the small-batch GEMV takes it, `gemv`, the caller's
    /// `Gpu::gemv_takes`) and `w` has an f32 bias.
    pub(super) fn epilogue_bias(&self, w: &CudaLinear, gemv: bool) -> Option<EpilogueBias> {
        let (b32, stored) = (w.bias32.as_ref()?, w.bias.as_ref()?);
        (product_path(gemv, self.gpu.lt.is_some()) == ProductPath::Lt).then(|| EpilogueBias {
            f32: self.gpu.p(b32),
            stored: self.gpu.p(stored),
        })
    }

    /// `add_bias` of `w`'s bias into `out`, unless `fused` says the epilogue added it.
    pub(super) fn add_bias_unless_fused(
        &self,
        w: &CudaLinear,
        fused: Option<EpilogueBias>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        match (&w.bias, fused) {
            (Some(b), None) => self.gpu.add_bias(out, b, rows, w.d_out),
            _ => Ok(()),
        }
    }

    /// Switches cuBLASLt products on or off (tests, benchmarks). On allocates the workspace;
    /// biases of weights uploaded while it was off keep their `add_bias` launch (their f32 copy
    /// is made at load), so a test turns it on before the model is loaded.
    pub fn set_cublaslt(&mut self, on: bool) -> Result<()> {
        self.gpu.lt = if on { Some(Lt::new(&self.gpu)?) } else { None };
        Ok(())
    }

    /// Whether products run through cuBLASLt.
    pub fn cublaslt(&self) -> bool {
        self.gpu.lt.is_some()
    }

    /// The bytes of cuBLASLt's workspace (0 with the switch off).
    pub fn cublaslt_workspace(&self) -> usize {
        self.gpu.lt.as_ref().map_or(0, Lt::workspace_len)
    }

    /// Descriptor sets cached (one per shape bucket, dtypes, epilogue and alignments seen).
    pub fn cublaslt_cached(&self) -> usize {
        self.gpu.lt.as_ref().map_or(0, |l| {
            l.cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entries
                .len()
        })
    }

    /// A zeroed device buffer of `n` 16-bit values (the output of [`CudaBackend::lt_linear_x16`]).
    pub fn alloc_x16(&self, n: usize) -> Result<CudaSlice<u16>> {
        Ok(self.gpu.alloc_zeros::<u16>(n.max(1))?)
    }

    /// The first `n` values of a buffer of the weight's 16-bit dtype, widened to f32
    /// (synchronises the compute stream).
    pub fn download_x16(&self, b: &CudaSlice<u16>, n: usize) -> Result<Vec<f32>> {
        let mut raw = vec![0u16; n];
        if n > 0 {
            self.gpu.dtoh(&b.slice(..n), &mut raw[..])?;
        }
        self.gpu.sync()?;
        let dt = self.gpu.weight_dtype;
        Ok(raw
            .into_iter()
            .map(|v| match dt {
                DType::F16 => half::f16::from_bits(v).to_f32(),
                _ => half::bf16::from_bits(v).to_f32(),
            })
            .collect())
    }

    /// `out[rows, d_out] = x · Wᵀ (+ bias)` with D in the weight's 16-bit dtype (the output a
    /// bf16-activation path will take): x cast to the weight dtype, one cuBLASLt product, the
    /// stored 16-bit bias (D's type) added by the epilogue. Needs the switch on and 16-bit
    /// weights.
    pub fn lt_linear_x16(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaLinear,
        rows: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let dt = self.gpu.weight_dtype;
        let (Some(lt), true) = (self.gpu.lt.as_ref(), dt != DType::F32) else {
            return Err(CudaError::Unsupported(format!(
                "a 16-bit output needs {CUBLASLT_ENV}=1 and 16-bit weights (these are {dt:?})"
            ))
            .into());
        };
        assert!(
            x.len() >= rows * w.d_in && out.len() >= rows * w.d_out,
            "lt_linear_x16: buffers too small"
        );
        if rows == 0 {
            return Ok(());
        }
        self.x16_tag = None;
        let b_ptr = self.gpu.cast_x16(x, rows * w.d_in, &mut self.x16)?;
        let bias = w.bias.as_ref().map(|b| self.gpu.p(b));
        let o = LtOut {
            ptr: self.gpu.p(out),
            dtype: dt,
        };
        let view = w.w.view();
        let added = (self.gpu).lt_product(lt, b_ptr, &view, rows, w.d_in, w.d_out, o, bias)?;
        if bias.is_some() && !added {
            return Err(CudaError::Unsupported(format!(
                "cuBLASLt has no bias epilogue for this {dt:?}-output shape"
            ))
            .into());
        }
        Ok(())
    }
}
