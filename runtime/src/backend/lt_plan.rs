//! The cuBLASLt products' plan (issue 29, `THAW_CUDA_CUBLASLT=1`), as pure functions so the
//! rules are unit- and property-tested on the CPU; `cuda/lt.rs` only builds the descriptors
//! this plan names and calls `cublasLtMatmul`.
//!
//! A linear `y[rows, d_out] = x[rows, d_in] · Wᵀ (+ bias)` maps to one [`LtKey`]: the operand
//! dtype (the weight's: bf16 / f16, or f32 for an f32 model; the activations are cast to it, as
//! for `cublasGemmEx`), the output (D) dtype (f32 today; the weight's 16-bit dtype for a later
//! bf16-activation path), the epilogue ([`Epilogue::Bias`] iff the product has a bias: it
//! replaces the separate `add_bias` launch) and a **row bucket** ([`row_bucket`]): the
//! descriptors and the algorithm `cublasLtMatmulAlgoGetHeuristic` picks are cached per bucket,
//! so a prefill of any length queries the heuristic at most once per power of two, while the
//! product itself runs on the exact rows (the cached B and D layouts' column count is set per
//! call).
//!
//! Which path a product takes, in one place ([`product_path`]): the small-batch GEMV where it
//! is on and serves the product (`THAW_CUDA_GEMV=1`, few rows: it reads the f32
//! activations, no cast), else cuBLASLt where it is on, else `cublasGemmEx` (+ `add_bias`).
//!
//! The bias's element type: cuBLASLt reads the bias in the D type when
//! `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` is unset (the cuBLAS documentation of that attribute;
//! the exceptions are the integer and FP8 kernels, which Thaw does not use), so an f32 output
//! takes an f32 bias and a 16-bit output the weight dtype's ([`bias_dtype`]).
use thaw_kernels::cuda::registry::{DType, GpuArch};

/// cuBLASLt's workspace on Hopper and newer: 32 MiB.
pub const WORKSPACE_HOPPER: usize = 32 << 20;
/// cuBLASLt's workspace on older devices: 4 MiB.
pub const WORKSPACE_OLDER: usize = 4 << 20;

/// Bytes of the one device workspace cuBLASLt gets (allocated once per backend, also its
/// heuristic's `CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES`): the cuBLAS documentation's
/// recommendation for `cublasSetWorkspace`, 32 MiB on Hopper (compute capability 9.x) and 4 MiB
/// on other architectures, which PyTorch adopted for its cuBLASLt products (pytorch#120925:
/// 32 MiB for major ≥ 9) and vLLM inherits through it. Blackwell (10.x, 12.x) takes Hopper's.
pub fn workspace_bytes(arch: GpuArch) -> usize {
    if arch.major >= 9 {
        WORKSPACE_HOPPER
    } else {
        WORKSPACE_OLDER
    }
}

/// What cuBLASLt does to the product before writing D.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `CUBLASLT_EPILOGUE_DEFAULT`: D = A·B.
    Default,
    /// `CUBLASLT_EPILOGUE_BIAS`: D = A·B + bias, the bias (one value per output column of the
    /// row-major y) broadcast over the rows.
    Bias,
}

/// One linear as the backend asks for it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LtShape {
    pub rows: usize,
    pub d_in: usize,
    pub d_out: usize,
    /// The weight dtype, which is also the activations' (cast) dtype.
    pub weight: DType,
    pub bias: bool,
    /// The output (D) dtype: f32, or the weight's 16-bit dtype.
    pub out: DType,
    /// Device addresses of W, of the activations and of the output (their alignments enter
    /// the key).
    pub addrs: [u64; 3],
}

/// The descriptors' cache key: everything the matmul descriptor, the A layout and the chosen
/// algorithm depend on. Rows enter only as their [`row_bucket`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct LtKey {
    pub bucket: usize,
    pub d_in: usize,
    pub d_out: usize,
    pub weight: DType,
    pub out: DType,
    pub epilogue: Epilogue,
    /// [`alignment`] of W, the activations and the output.
    pub align: [usize; 3],
}

/// A product's plan: its cache key and the exact rows it runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LtPlan {
    pub key: LtKey,
    pub rows: usize,
}

/// The rows the heuristic is asked about for a product of `rows` rows: the next power of two
/// (1 for 0 or 1). Every bucket is at least the rows it serves and below twice them, so the
/// algorithm chosen for it was chosen for a shape of the same order.
pub fn row_bucket(rows: usize) -> usize {
    rows.max(1).next_power_of_two()
}

/// The largest alignment the key distinguishes: cuBLASLt's preferences assume 256-byte aligned
/// operands unless told less (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`).
pub const MAX_ALIGN: usize = 256;

/// The alignment of device address `addr` in bytes: the largest power of two dividing it, at
/// most [`MAX_ALIGN`] (PyTorch's `_getAlignment`, which it passes to those preferences): the
/// heuristic may pick an algorithm with wide vector loads only for operands it knows allow them.
pub fn alignment(addr: u64) -> usize {
    if addr == 0 {
        return MAX_ALIGN;
    }
    (1usize << addr.trailing_zeros().min(MAX_ALIGN.trailing_zeros())).min(MAX_ALIGN)
}

/// The f32 bias the epilogue of an f32-output product reads: `bias` rounded to the weight dtype
/// `dt` (round to nearest even, as the upload encodes it) and widened back: exactly the values
/// `add_bias` reads from the stored bias, so the epilogue adds what the separate kernel added.
pub fn bias_f32(bias: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::F32 => bias.to_vec(),
        DType::Bf16 => bias
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        DType::F16 => bias
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect(),
    }
}

/// The bias's element type for output `out` (cuBLASLt's default: D's).
pub fn bias_dtype(out: DType) -> DType {
    out
}

/// The plan for `s`, or why cuBLASLt cannot run it (the caller then takes `cublasGemmEx`):
/// no rows; a dimension above cuBLASLt's int64 leading dimensions or the i32 the backend's
/// kernels take; an output that is neither f32 nor the weight's dtype.
pub fn plan(s: &LtShape) -> Result<LtPlan, String> {
    if s.rows == 0 || s.d_in == 0 || s.d_out == 0 {
        return Err(format!(
            "an empty product ({} × {} → {})",
            s.rows, s.d_in, s.d_out
        ));
    }
    for (what, n) in [("rows", s.rows), ("d_in", s.d_in), ("d_out", s.d_out)] {
        if i32::try_from(n).is_err() {
            return Err(format!("{what} = {n} does not fit an int"));
        }
    }
    if s.out != DType::F32 && s.out != s.weight {
        return Err(format!(
            "a {:?} output of {:?} weights (D is f32 or the weight dtype)",
            s.out, s.weight
        ));
    }
    Ok(LtPlan {
        key: LtKey {
            bucket: row_bucket(s.rows),
            d_in: s.d_in,
            d_out: s.d_out,
            weight: s.weight,
            out: s.out,
            epilogue: if s.bias {
                Epilogue::Bias
            } else {
                Epilogue::Default
            },
            align: s.addrs.map(alignment),
        },
        rows: s.rows,
    })
}

/// Which library or kernel runs a product.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ProductPath {
    /// `gemv.cu` (`THAW_CUDA_GEMV=1`), f32 activations read directly; bias by `add_bias`.
    Gemv,
    /// `cublasLtMatmul` (`THAW_CUDA_CUBLASLT=1`), bias by its epilogue.
    Lt,
    /// `cublasGemmEx`; bias by `add_bias`.
    GemmEx,
}

/// The order, in one place: the GEMV where it serves the product (it needs no cast and no
/// library call, and takes at most 8 rows), cuBLASLt where it is on, `cublasGemmEx` otherwise.
pub fn product_path(gemv_serves: bool, lt_on: bool) -> ProductPath {
    if gemv_serves {
        ProductPath::Gemv
    } else if lt_on {
        ProductPath::Lt
    } else {
        ProductPath::GemmEx
    }
}

/// `add_bias` launches a path saves for a product with `bias`: one where cuBLASLt's epilogue
/// adds it, none otherwise.
pub fn bias_launches_saved(path: ProductPath, bias: bool) -> u64 {
    u64::from(path == ProductPath::Lt && bias)
}

#[cfg(test)]
#[path = "lt_plan_tests.rs"]
mod tests;
