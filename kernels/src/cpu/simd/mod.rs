//! Decode-path inner products, dispatched at run time: AVX2/FMA/F16C kernels where the CPU has
//! them, and the portable code (the oracle in tests, and the fallback elsewhere).
//!
//! - [`dot_rows_f32`], [`dot_rows_f16`], [`dot_rows_bf16`]: a weight row in its stored float format × an f32
//!   activation row, accumulated in f32,
//!   for up to a few activation rows at once (one pass over the weight row).
//! - [`quantize_q8`] + [`dot_rows_q8`] / [`gemv_q8`]: as ggml does for Q8_0/Q4_0/Q4_1 weights, the activation
//!   row is quantised to 8-bit blocks once per product, then every weight block is an
//!   i8×i8 (or u4×i8) integer dot scaled by the two block scales.
//! - [`gemv_quant_f32`]: Q8_0/Q4_0/Q4_1 weights × f32 activations, each block dequantised in
//!   registers: exactly the dequantised-f32 model's arithmetic (the default decode path),
//!   reading only the packed weights.
//! - [`gemm_nt`] / [`gemm_nt_prompt`] (AVX-512F): whole products over f32, f16 or bf16 weights
//!   read in place, each 16-bit weight vector widened once per register tile (decode batches)
//!   or once per call while packed (prompt rows) and reused by every activation row; bit for
//!   bit the row dots (decode) or the f32 prompt GEMM over the widened weight (prompt).
//! - [`gemm_nt_vnni`] (AVX512-VNNI): Q8_0, Q4_K and Q4_1 weights (Q4_1 decode rows unless
//!   `THAW_Q8_ACTIVATIONS=0`, prompt rows unless `THAW_Q8_PROMPT=0`: [`gemm_nt_vnni_prompt`])
//!   × activations quantised to Q8 once per call, integer dots
//!   (`vpdpbusd`) for every row count, as llama.cpp computes them; on by default where the CPU
//!   has it (`THAW_VNNI_DOT=0` or [`set_vnni_dot`] turn it off). Batches share a packed weight
//!   panel; up to 3 rows read the weight in place, bit for bit the same result.
//! - [`row_stream`] (`stream.rs`): a one-row product reads its weight rows in address order
//!   (one row at a time for float weights; the VNNI row kernel's 8-row groups each prefetched
//!   a group ahead), which the hardware prefetcher streams ~2× as fast as interleaved rows on
//!   this project's Zen 4 VM; bit for bit the interleaved tiles' results (`THAW_ROW_STREAM=0`).
//!   Decode batches (float tiles, VNNI panels) prefetch the next weight rows spread over the
//!   current ones' compute ([`batch_prefetch`], `THAW_BATCH_PREFETCH=0`).
//!
//! Error of the Q8 path: an activation block `x_b` (32 values) is stored as `d_b·q` with
//! `d_b = max|x_b| / 127` and `q = round(x / d_b)`, so `|x − d_b·q| ≤ d_b / 2` per element and
//! the product with the dequantised weight `w` errs by at most
//! `Σ_b (d_b / 2) · ‖w_b‖₁` (plus f32 rounding), which `tests.rs` checks.
//!
//! The level is detected once (cached in an atomic); [`set_simd_level`] lets a benchmark
//! compare the paths in one process.

mod portable;
mod stream;
mod tuning;
pub use stream::{batch_prefetch, row_stream, set_batch_prefetch, set_row_stream};
pub use tuning::{prompt_tuning, set_prompt_tuning};
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_batched;
#[cfg(test)]
mod tests_bf16_rows;
#[cfg(test)]
mod tests_prompt;
#[cfg(test)]
mod tests_stream;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests_tuning;
#[cfg(test)]
mod tests_vnni;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_512_bf16;
#[cfg(target_arch = "x86_64")]
mod x86_512_finish;
#[cfg(target_arch = "x86_64")]
mod x86_512_gemm;
#[cfg(target_arch = "x86_64")]
mod x86_512_kquant;
#[cfg(target_arch = "x86_64")]
mod x86_512_vnni;
#[cfg(target_arch = "x86_64")]
mod x86_512_vnni_row;

use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(target_arch = "x86_64")]
pub use x86::transpose8;
/// The 16 × 16 transpose of the packed GEMMs, for the decode attention's key blocks.
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_512_gemm::transpose16;

use half::{bf16, f16};

use super::quant::WeightFormat;

/// Which kernels the decode products use.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// Plain Rust (baseline x86-64 / any target).
    Portable,
    /// AVX2 + FMA + F16C (x86-64, detected at run time).
    Avx2,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Portable => "portable",
            SimdLevel::Avx2 => "avx2+fma+f16c",
        }
    }
}

/// 0 = not yet detected, 1 = portable, 2 = AVX2.
static LEVEL: AtomicU8 = AtomicU8::new(0);

fn detect() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    if x86::Avx2::detect().is_some() {
        return SimdLevel::Avx2;
    }
    SimdLevel::Portable
}

fn code(l: SimdLevel) -> u8 {
    match l {
        SimdLevel::Portable => 1,
        SimdLevel::Avx2 => 2,
    }
}

/// The level in use (detected on first call).
#[inline]
pub fn simd_level() -> SimdLevel {
    match LEVEL.load(Ordering::Relaxed) {
        1 => SimdLevel::Portable,
        2 => SimdLevel::Avx2,
        _ => {
            let l = detect();
            LEVEL.store(code(l), Ordering::Relaxed);
            l
        }
    }
}

/// Uses `want` from now on, if this CPU supports it (else the detected level); returns the
/// level in effect. For benchmarks comparing the paths; results differ between levels in
/// rounding only.
pub fn set_simd_level(want: SimdLevel) -> SimdLevel {
    let l = match want {
        SimdLevel::Avx2 => detect(),
        SimdLevel::Portable => SimdLevel::Portable,
    };
    LEVEL.store(code(l), Ordering::Relaxed);
    l
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2() -> Option<x86::Avx2> {
    match simd_level() {
        // SAFETY: the level is `Avx2` only after `detect()` found AVX2, FMA and F16C
        // (`set_simd_level` also goes through `detect()`).
        SimdLevel::Avx2 => Some(unsafe { x86::Avx2::new_unchecked() }),
        SimdLevel::Portable => None,
    }
}

/// `Σ a·b` over two equal-length f32 rows.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: lengths differ");
    let mut out = [0.0];
    dot_rows_f32(a, b, &mut out);
    out[0]
}

/// `out[r] = x[r]·w` for the `out.len()` rows of `x` (each `w.len()` long, packed): one pass
/// over `w` for all rows; each row sums as [`dot_f32`] does, so results do not depend on how
/// many rows come along.
#[inline]
pub fn dot_rows_f32(x: &[f32], w: &[f32], out: &mut [f32]) {
    check_rows("dot_rows_f32", x.len(), w.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.dot_rows_f32(x, w, out);
    }
    portable::rows(x, w.len(), out, |xr| portable::dot_f32(xr, w))
}

/// Weight rows (`[n, k]`, row-major) in a stored float format, read in place by
/// [`gemm_nt`] and [`gemm_nt_prompt`], which widen them to f32 exactly.
#[derive(Copy, Clone, Debug)]
pub enum FloatWeights<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl FloatWeights<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            FloatWeights::F32(w) => w.len(),
            FloatWeights::F16(w) => w.len(),
            FloatWeights::BF16(w) => w.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' little-endian bytes (what the kernels read).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: f32, f16 and bf16 are plain bytes (no padding, any bit pattern is a value
        // of u8); the slice covers exactly the elements' memory.
        unsafe {
            match self {
                FloatWeights::F32(w) => std::slice::from_raw_parts(w.as_ptr().cast(), w.len() * 4),
                FloatWeights::F16(w) => std::slice::from_raw_parts(w.as_ptr().cast(), w.len() * 2),
                FloatWeights::BF16(w) => std::slice::from_raw_parts(w.as_ptr().cast(), w.len() * 2),
            }
        }
    }
}

/// `out[i·ldo + j] = x_i·w_j` for the `m` rows of `x` and the `n` rows of `w` (both
/// `[_, k]`, read in place), each output summed exactly as [`dot_rows_f32`] sums it (so
/// results do not depend on `m` or `n`). Runs on AVX-512F; returns false, doing nothing,
/// where the CPU lacks it, the level is portable or `THAW_AVX512=0` (the caller then uses
/// its own path).
pub fn gemm_nt_f32(
    x: &[f32],
    w: &[f32],
    shape: (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    gemm_nt(x, FloatWeights::F32(w), shape, out, ldo)
}

/// Whether [`gemm_nt`] runs here (AVX-512F at the AVX2 level, `THAW_AVX512` not `0`).
pub fn gemm_nt_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 {
        return x86_512::Avx512::enabled().is_some();
    }
    false
}

/// [`gemm_nt_f32`] over weights in any stored float format: each output equals
/// [`dot_rows_f32`] / [`dot_rows_f16`] / [`dot_rows_bf16`] of its two rows bit for bit, while
/// a 16-bit weight vector is widened once per register tile (4 weight rows × 4 activation
/// rows) rather than once per activation row.
pub fn gemm_nt(
    x: &[f32],
    w: FloatWeights<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 {
        if let Some(z) = x86_512::Avx512::enabled() {
            z.gemm_nt(x, w, (m, k, n), out, ldo);
            return true;
        }
    }
    let _ = (x, w, m, k, n, out, ldo);
    false
}

/// `out[i·ldo + j] = x_i·w_j` as [`gemm_nt_f32`] computes it, but for prompt-sized `m`: the
/// weight is packed (a 16 × 16 transpose, once per call) and each output is one sequential
/// fused multiply-add chain over `k`, so its bits depend only on its own two rows (not on
/// `m`, `n` or a split over threads) but differ in rounding from [`dot_rows_f32`]'s. Runs on
/// AVX-512F; returns false, doing nothing, where [`gemm_nt_f32`] would, or where
/// `THAW_PROMPT_GEMM=0` (the caller then uses its own path).
pub fn gemm_nt_f32_prompt(
    x: &[f32],
    w: &[f32],
    shape: (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    gemm_nt_prompt(x, FloatWeights::F32(w), shape, out, ldo)
}

/// [`gemm_nt_f32_prompt`] over weights in any stored float format, widened while packed
/// (once per call): every output equals the f32 prompt GEMM over the widened weight, bit for
/// bit — except bf16 weights where [`bf16_dot_active`]: there the activation rows are rounded
/// to bf16 and multiplied in bf16 pairs (`vdpbf16ps`, f32 sums: a bf16 model's arithmetic in
/// PyTorch and llama.cpp), twice the products per instruction.
pub fn gemm_nt_prompt(
    x: &[f32],
    w: FloatWeights<'_>,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 && prompt_gemm_on() {
        if let (FloatWeights::BF16(wb), Some(z)) = (w, x86_512_bf16::Avx512Bf16::enabled()) {
            z.gemm_nt_packed(x, wb, (m, k, n), out, ldo);
            return true;
        }
        if let Some(z) = x86_512::Avx512::enabled() {
            z.gemm_nt_packed(x, w, (m, k, n), out, ldo);
            return true;
        }
    }
    let _ = (x, w, m, k, n, out, ldo);
    false
}

/// `out[i·ldo + j] = bf16(x_i)·w_j` for decode-sized `m` over bf16 weights where
/// [`bf16_dot_active`] (`vdpbf16ps` on the weight as stored, the activations rounded to bf16
/// once per call: a bf16 model's arithmetic in PyTorch and llama.cpp, as the prompt rows of
/// [`gemm_nt_prompt`]). Each output's bits depend only on its own two rows, so one row alone
/// and in a batch agree. Returns false, doing nothing, where the kernel is off or `k` is odd
/// (the caller then uses [`gemm_nt`] or its own path).
pub fn gemm_nt_bf16_rows(
    x: &[f32],
    w: &[bf16],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 {
        if let Some(z) = x86_512_bf16::Avx512Bf16::enabled() {
            return z.gemm_nt_rows(x, w, (m, k, n), out, ldo);
        }
    }
    let _ = (x, w, m, k, n, out, ldo);
    false
}

/// Whether [`gemm_nt_vnni`] runs for weights of `format`: Q8_0 or Q4_K (or Q4_1 where
/// [`crate::cpu::q8_activations`] is on: by default wherever this kernel runs, see
/// `quant::matrix`), AVX-512F in use, the CPU has AVX512-VNNI, AVX512-BW and AVX512-VL, and neither
/// `THAW_VNNI_DOT=0` nor [`set_vnni_dot`] turned it off.
pub fn vnni_dot_active(format: WeightFormat) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 {
        let wanted = match format {
            WeightFormat::Q8_0 | WeightFormat::Q4_K => true,
            WeightFormat::Q4_1 => crate::cpu::quant::q8_activations(),
            _ => false,
        };
        return wanted && x86_512_vnni::Avx512Vnni::enabled().is_some();
    }
    let _ = format;
    false
}

/// Whether [`gemm_nt_vnni_prompt`] runs for weights of `format`: where [`vnni_dot_active`]
/// is, and for Q4_1 also where [`crate::cpu::q8_prompt`] is on (the default) and the VNNI
/// kernel is in use.
pub fn vnni_prompt_active(format: WeightFormat) -> bool {
    vnni_dot_active(format)
        || (format == WeightFormat::Q4_1
            && crate::cpu::quant::q8_prompt()
            && vnni_dot_active(WeightFormat::Q8_0))
}

/// [`gemm_nt_vnni`] for prompt rows (the caller's choice: more than 16 in the product): also
/// Q4_1 weights where [`vnni_prompt_active`] says so. Returns false, doing nothing, where it
/// does not.
pub fn gemm_nt_vnni_prompt(
    format: WeightFormat,
    w: &[u8],
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    vnni_gemm_if(
        vnni_prompt_active(format),
        format,
        w,
        x,
        (m, k, n),
        out,
        ldo,
    )
}

/// Turns [`gemm_nt_vnni`] on (where the CPU has it) or off for the whole process, for
/// benchmarks and tests that compare it with the f32-activation path; returns whether it was
/// on.
pub fn set_vnni_dot(on: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86_512_vnni::Avx512Vnni::set(on);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = on;
        false
    }
}

/// `out[i·ldo + j] = q8(x_i)·w_j` for the `m` rows of `x` (`[m, k]`) and the `n` weight rows
/// packed in `w` (whole Q8_0, Q4_K or Q4_1 blocks, `k` values a row), as llama.cpp computes it:
/// each activation row quantised once per call by [`quantize_q8`], an exact integer dot per
/// 32-value block (`vpdpbusd`), scaled in f32 by the weight block's scale (and, for Q4_K and
/// Q4_1, plus its minimum term times the activation block's sum). Every `m` the same arithmetic
/// (up to 3 rows read the weight in place, more share a packed panel): each output's bits
/// depend only on its own two rows. Error against the f32 product with the
/// dequantised weight: the activation rounding `Σ_b (d_b / 2)·‖w_b‖₁` plus f32 rounding.
/// Returns false, doing nothing, where [`vnni_dot_active`] is false.
pub fn gemm_nt_vnni(
    format: WeightFormat,
    w: &[u8],
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    vnni_gemm_if(vnni_dot_active(format), format, w, x, (m, k, n), out, ldo)
}

/// The VNNI product of [`gemm_nt_vnni`] and [`gemm_nt_vnni_prompt`] where `active` (their
/// switch) holds and the CPU has the kernel; false, doing nothing, otherwise.
fn vnni_gemm_if(
    active: bool,
    format: WeightFormat,
    w: &[u8],
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if active {
        if let Some(z) = x86_512_vnni::Avx512Vnni::enabled() {
            z.gemm_nt(format, w, x, (m, k, n), out, ldo);
            return true;
        }
    }
    let _ = (active, format, w, x, m, k, n, out, ldo);
    false
}

/// Whether [`gemm_nt_prompt`] multiplies bf16 weights with bf16-rounded activations
/// (`vdpbf16ps`): AVX-512F in use, the CPU has AVX512-BF16 and `THAW_BF16_DOT` is not `0`.
pub fn bf16_dot_active() -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 && prompt_gemm_on() {
        return x86_512_bf16::Avx512Bf16::enabled().is_some();
    }
    false
}

/// 0 = not yet read, 1 = off, 2 = on.
static PROMPT_GEMM: AtomicU8 = AtomicU8::new(0);

/// A process-wide switch decided once: `state` 0 = not yet (then `decide` settles it), 1 =
/// off, 2 = on.
#[inline]
fn decided_once(state: &AtomicU8, decide: impl FnOnce() -> bool) -> bool {
    match state.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = decide();
            state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Whether the environment leaves [`gemm_nt_f32_prompt`] on (`THAW_PROMPT_GEMM=0` turns it
/// off; read once, for A/B runs of one binary).
fn prompt_gemm_on() -> bool {
    decided_once(&PROMPT_GEMM, || !super::switched_off("THAW_PROMPT_GEMM"))
}

/// As [`dot_rows_f32`] with `w` stored as f16.
#[inline]
pub fn dot_rows_f16(x: &[f32], w: &[f16], out: &mut [f32]) {
    check_rows("dot_rows_f16", x.len(), w.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.dot_rows_f16(x, w, out);
    }
    portable::rows(x, w.len(), out, |xr| portable::dot_f16(xr, w))
}

/// As [`dot_rows_f32`] with `w` stored as bf16.
#[inline]
pub fn dot_rows_bf16(x: &[f32], w: &[bf16], out: &mut [f32]) {
    check_rows("dot_rows_bf16", x.len(), w.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.dot_rows_bf16(x, w, out);
    }
    portable::rows(x, w.len(), out, |xr| portable::dot_bf16(xr, w))
}

fn check_rows(op: &str, x: usize, k: usize, m: usize) {
    assert_eq!(x, m * k, "{op}: x has {x} values, not {m} rows of {k}");
}

/// One activation block quantised to 8 bits: `x ≈ d · qs`, and `s = d · Σ qs` (the block's
/// sum, for formats with a per-block minimum).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

/// Weight rows per packed panel of the AVX-512 prompt GEMMs ([`gemm_nt_prompt`],
/// [`gemm_nt_f32_prompt`]): a product over `n` weight rows computes `⌈n / 48⌉` whole panels,
/// so callers that cut a weight into pieces (a dequantised tile at a time) cut it in
/// multiples of this to waste no lanes.
pub const PROMPT_PANEL_ROWS: usize = 48;

/// Values per [`Q8Block`] (the block size of Q8_0/Q4_0/Q4_1).
pub const Q8_BLOCK: usize = 32;

/// Whether [`dot_rows_q8`] handles weights of `format`.
pub fn q8_dot_supported(format: WeightFormat) -> bool {
    matches!(
        format,
        WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q4_1
    )
}

/// Quantises `x` (a multiple of 32 long) into `out` (one block per 32 values): per block
/// `d = max|x| / 127`, `q = round_ties_even(x / d)`. Deterministic and bit-identical on every
/// level (the AVX2 version performs the same operations per element).
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    assert!(
        x.len().is_multiple_of(Q8_BLOCK) && out.len() == x.len() / Q8_BLOCK,
        "quantize_q8: {} values into {} blocks",
        x.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.quantize_q8(x, out);
    }
    portable::quantize_q8(x, out)
}

/// [`quantize_q8`] as products over weights of `format` use it, following ggml's
/// `vec_dot_type`: for Q4_1 the blocks are ggml's Q8_1 (`quantize_row_q8_1`), the scale `d`
/// and the sum `s = d·Σq` (taken with the unrounded `d`, as ggml takes it) each rounded to
/// f16, so the product is llama.cpp's to the accumulation order; every other format keeps
/// them f32.
pub fn quantize_q8_for(format: WeightFormat, x: &[f32], out: &mut [Q8Block]) {
    quantize_q8(x, out);
    if format == WeightFormat::Q4_1 {
        for b in out.iter_mut() {
            b.d = f16::from_f32(b.d).to_f32();
            b.s = f16::from_f32(b.s).to_f32();
        }
    }
}

/// `out[i·ldo + j] = w_j·x_i` for the `n` weight rows `w_j` packed in `w` (whole blocks of
/// `format`: Q8_0, Q4_0 or Q4_1) and the activation rows `x_i` (each quantised by
/// [`quantize_q8`], as many blocks as a weight row): a whole decode product in one call. Each
/// result equals [`dot_rows_q8`]'s for the same row pair, bit for bit.
pub fn gemv_q8(
    format: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[Q8Block],
    out: &mut [f32],
    ldo: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.gemv_q8(format, w, n, x, out, ldo);
    }
    gemv_q8_portable(format, w, n, x, out, ldo)
}

/// [`gemv_q8`] on the portable kernel.
fn gemv_q8_portable(
    format: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[Q8Block],
    out: &mut [f32],
    ldo: usize,
) {
    let (kb, _) = gemv_q8_shape(format, w, n, x, out, ldo);
    if kb == 0 || n == 0 {
        return;
    }
    let rb = kb * format.block_bytes();
    for (j, wj) in w.chunks_exact(rb).enumerate() {
        for (i, xi) in x.chunks_exact(kb).enumerate() {
            out[i * ldo + j] = portable::dot_q8(format, wj, xi);
        }
    }
}

/// Blocks in each of the `n` weight rows packed in `w` (whole blocks of `format`, one that
/// [`q8_dot_supported`]); panics naming `what` otherwise.
fn blocks_per_row(format: WeightFormat, w: &[u8], n: usize, what: &str) -> usize {
    assert!(
        q8_dot_supported(format),
        "{what}: {} weights",
        format.name()
    );
    let bb = format.block_bytes();
    let kb = (w.len() / bb).checked_div(n).unwrap_or(0);
    assert_eq!(
        w.len(),
        n * kb * bb,
        "{what}: w is not {n} rows of whole blocks"
    );
    kb
}

/// Checks [`gemv_q8`]'s arguments; returns (blocks per row, activation rows) and zeroes
/// `out` when rows are empty.
fn gemv_q8_shape(
    format: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[Q8Block],
    out: &mut [f32],
    ldo: usize,
) -> (usize, usize) {
    let kb = blocks_per_row(format, w, n, "gemv_q8");
    let m = x.len().checked_div(kb).unwrap_or(0);
    assert_eq!(x.len(), m * kb, "gemv_q8: x is not [{m}, {kb}] blocks");
    assert!(
        m == 0 || n == 0 || ((m - 1) * ldo + n <= out.len() && (m == 1 || ldo >= n)),
        "gemv_q8: out is not {m} rows of {n} at stride {ldo}"
    );
    if kb == 0 {
        for i in 0..m {
            out[i * ldo..i * ldo + n].fill(0.0);
        }
    }
    (kb, m)
}

/// `out[i·ldo + j] = w_j·x_i` for the `n` weight rows `w_j` packed in `w` (whole blocks of
/// `format`: Q8_0, Q4_0 or Q4_1) and the f32 activation rows `x_i` (`x` is `[m, k]`, `k` the
/// row length in values). Each block is dequantised with the same f32 operations as
/// [`crate::cpu::quant::dequantize_blocks`] and summed in [`dot_rows_f32`]'s order, so every
/// result equals widening the row to f32 and calling [`dot_rows_f32`], bit for bit, at each
/// level, while only the packed bytes are read (no widened row is written).
pub fn gemv_quant_f32(
    format: WeightFormat,
    w: &[u8],
    n: usize,
    x: &[f32],
    out: &mut [f32],
    ldo: usize,
) {
    let kb = blocks_per_row(format, w, n, "gemv_quant_f32");
    let k = kb * Q8_BLOCK;
    let m = x.len().checked_div(k).unwrap_or(0);
    assert_eq!(x.len(), m * k, "gemv_quant_f32: x is not [{m}, {k}]");
    assert!(
        m == 0 || n == 0 || ((m - 1) * ldo + n <= out.len() && (m == 1 || ldo >= n)),
        "gemv_quant_f32: out is not {m} rows of {n} at stride {ldo}"
    );
    if n == 0 || m == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.gemv_quant_f32(format, w, n, kb, x, m, out, ldo);
    }
    gemv_quant_f32_portable(format, w, (n, kb), x, m, out, ldo)
}

/// [`gemv_quant_f32`] on the portable kernel (arguments checked there; `shape` is
/// (weight rows, blocks per row)).
fn gemv_quant_f32_portable(
    format: WeightFormat,
    w: &[u8],
    (n, kb): (usize, usize),
    x: &[f32],
    m: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let (rb, k) = (kb * format.block_bytes(), kb * Q8_BLOCK);
    for i in 0..m {
        for j in 0..n {
            out[i * ldo + j] =
                portable::dot_quant_f32(format, &w[j * rb..(j + 1) * rb], &x[i * k..(i + 1) * k]);
        }
    }
}

/// Dequantises `w` (whole blocks of Q8_0, Q4_0 or Q4_1; or Q4_K and Q6_K where AVX-512F runs) into
/// `out`, bit-identical to [`crate::cpu::quant::dequantize_blocks`] (AVX2 where available).
/// Returns false for other formats, leaving `out` alone.
pub fn dequantize_row(format: WeightFormat, w: &[u8], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(format, WeightFormat::Q4_K | WeightFormat::Q6_K) && simd_level() == SimdLevel::Avx2
    {
        if let Some(z) = x86_512::Avx512::enabled() {
            match format {
                WeightFormat::Q4_K => z.dequantize_q4_k(w, out),
                _ => z.dequantize_q6_k(w, out),
            }
            return true;
        }
    }
    if !q8_dot_supported(format) {
        return false;
    }
    let kb = w.len() / format.block_bytes();
    assert!(
        w.len() == kb * format.block_bytes() && out.len() == kb * Q8_BLOCK,
        "dequantize_row: {} bytes into {} values",
        w.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        t.dequantize_row(format, w, out);
        return true;
    }
    let bb = format.block_bytes();
    for (b, y) in w.chunks_exact(bb).zip(out.chunks_exact_mut(Q8_BLOCK)) {
        crate::cpu::quant::dequantize_block(format, b, y);
    }
    true
}

/// `out[r] = w·x[r]` for one weight row `w` (whole blocks of `format`: Q8_0, Q4_0 or Q4_1)
/// and the `out.len()` activation rows in `x`, each quantised by [`quantize_q8`] (one block
/// per weight block). Each row's result does not depend on how many rows come along.
#[inline]
pub fn dot_rows_q8(format: WeightFormat, w: &[u8], x: &[Q8Block], out: &mut [f32]) {
    assert!(
        q8_dot_supported(format),
        "dot_q8: {} weights",
        format.name()
    );
    let kb = w.len() / format.block_bytes();
    assert_eq!(
        w.len(),
        kb * format.block_bytes(),
        "dot_q8: {} bytes are not whole {} blocks",
        w.len(),
        format.name()
    );
    assert_eq!(
        x.len(),
        out.len() * kb,
        "dot_q8: {} activation blocks for {} rows of {kb}",
        x.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = avx2() {
        return t.dot_rows_q8(format, w, x, out);
    }
    if kb == 0 {
        return out.fill(0.0);
    }
    for (o, xr) in out.iter_mut().zip(x.chunks_exact(kb)) {
        *o = portable::dot_q8(format, w, xr);
    }
}
