//! The LoRA delta kernel: `Δ = scale · (x · Aᵀ) · Bᵀ` for one worker's slice of rows.
//!
//! `x` is f32 `[rows, d_in]`; `A` is `[rank, d_in]` and `B` is `[d_out, rank]`, both row-major
//! in their *stored* dtype (f32, f16 or bf16, little-endian bytes), read in place from the host
//! store; `Δ` is f32 `[rows, d_out]`, written or accumulated.
//!
//! How it is blocked (one driver for every ISA; only the inner ops differ):
//!
//! * **shrink** `t = x · Aᵀ` into [`Scratch`] (`[rows, rank]`: 1 KiB at 16 × 16, 256 KiB at
//!   512 × 128, so it stays in L1/L2). `d_in` is cut into chunks of `kc` columns so that the
//!   `[rank, kc]` slice of `A` (≤ 512 KiB of f32) stays in L2 while every row block streams
//!   past it; f32 weights are read in place, f16/bf16 chunks are widened once per call into
//!   scratch. Micro-kernel: a rows × ranks tile of dot products along `d_in`, one SIMD
//!   accumulator each (AVX-512: 6 × 4 = 24 accumulators, 10 loads per 24 FMAs; the ragged end
//!   of `d_in` is a masked step), reduced horizontally once per chunk.
//! * **expand** `Δ = (scale · t) · Bᵀ`: `d_out` is cut into chunks of `nc` columns; each chunk
//!   of `B` is transposed (and widened) once into panels of a few vectors' width (8 × 8
//!   register transposes), then every row block of `t` sweeps the panels with a rows ×
//!   panel register tile (AVX-512: 8 × 48 = 24 accumulators; one broadcast of `t` per row and
//!   rank step, folded into the FMA). Ragged output columns use masked stores.
//!
//! Every element of `x`, `A` and `B` is read from memory once per call; the only copies are
//! the per-chunk widen/transpose buffers, sized by the cache, not by the matrix.
//!
//! Dispatch: [`Isa::best`] picks AVX-512F, else AVX2+FMA+F16C, at run time, else the portable
//! scalar path (also what aarch64 and other targets compile). Any ISA can be forced with
//! [`lora_delta_on`] (tests compare them).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod driver;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;

use thiserror::Error;

pub(crate) use driver::{check_block, read_elem, Dims, Ops, Rows, RowsMut, BCAST_LANES};
use driver::{Blocking, Job, MAX_PANEL};

/// Storage format of an adapter matrix in the host store.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of a binary32).
    Bf16,
}

impl WeightDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// Lower-case name, as in safetensors headers.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// A row-major weight matrix borrowed in place: little-endian elements of `dtype`, any
/// alignment. Its shape comes from the [`LoraProblem`] it is used with.
#[derive(Copy, Clone, Debug)]
pub struct LoraMat<'a> {
    /// Element format of `bytes`.
    pub dtype: WeightDtype,
    /// The raw elements, row-major.
    pub bytes: &'a [u8],
}

#[cfg(target_endian = "little")]
impl<'a> LoraMat<'a> {
    /// Views typed f32 weights.
    pub fn from_f32(w: &'a [f32]) -> Self {
        Self {
            dtype: WeightDtype::F32,
            bytes: bytemuck::cast_slice(w),
        }
    }

    /// Views typed f16 weights.
    pub fn from_f16(w: &'a [half::f16]) -> Self {
        Self {
            dtype: WeightDtype::F16,
            bytes: bytemuck::cast_slice(w),
        }
    }

    /// Views typed bf16 weights.
    pub fn from_bf16(w: &'a [half::bf16]) -> Self {
        Self {
            dtype: WeightDtype::Bf16,
            bytes: bytemuck::cast_slice(w),
        }
    }
}

/// The shape of one delta computation.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LoraProblem {
    /// Rows of `x` and `Δ` (tokens in this worker's slice).
    pub rows: usize,
    /// Input features: columns of `x` and `A`.
    pub d_in: usize,
    /// Output features: columns of `Δ`, rows of `B`.
    pub d_out: usize,
    /// Adapter rank: rows of `A`, columns of `B`.
    pub rank: usize,
    /// LoRA scale (`alpha / rank`), applied to the whole product.
    pub scale: f32,
}

/// Multiply-adds counted as two flops: `2 · rows · rank · (d_in + d_out)`.
pub fn flops(p: &LoraProblem) -> f64 {
    2.0 * p.rows as f64 * p.rank as f64 * (p.d_in + p.d_out) as f64
}

/// Bytes the kernel must move at least once: `x`, `A`, `B` in their stored dtype, `Δ` written
/// (and read too when accumulating). Divide by the run time for the achieved bandwidth.
pub fn min_bytes(p: &LoraProblem, dtype: WeightDtype, accumulate: bool) -> f64 {
    let out_passes = if accumulate { 2.0 } else { 1.0 };
    let w = (p.rank * (p.d_in + p.d_out) * dtype.size()) as f64;
    4.0 * (p.rows * p.d_in) as f64 + w + out_passes * 4.0 * (p.rows * p.d_out) as f64
}

/// A buffer whose length disagrees with the [`LoraProblem`]; the job is skipped, nothing is
/// written. Usually a stale job-table entry or an adapter whose shape changed under its handle.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum LoraError {
    /// `x` or `out` has the wrong number of f32s.
    #[error("LoRA `{which}` has {got} f32s but the problem needs {expected}; check rows and hidden sizes")]
    Activation {
        /// `"x"`, `"out"` or `"t"`.
        which: &'static str,
        /// `rows · d_in` or `rows · d_out`.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A weight buffer has the wrong number of bytes for its dtype and shape.
    #[error("LoRA `{which}` ({dtype}) has {got} bytes but {expected} were expected; check the adapter's rank, dtype and target module")]
    Weight {
        /// `"A"` or `"B"`.
        which: &'static str,
        /// Its declared dtype name.
        dtype: &'static str,
        /// `rank · d · dtype size`.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The shape's element counts overflow `usize`.
    #[error("LoRA problem {0:?} is too large to address")]
    Overflow(LoraProblem),
    /// [`lora_delta_on`] was asked for an instruction set this CPU lacks.
    #[error("instruction set {0:?} is not available on this CPU; use Isa::best()")]
    IsaUnavailable(Isa),
}

/// The instruction set a kernel call runs with.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512F (plus AVX2 + FMA + F16C).
    Avx512,
}

impl Isa {
    /// Every variant, slowest first.
    pub const ALL: [Self; 3] = [Self::Scalar, Self::Avx2, Self::Avx512];

    /// The fastest instruction set this CPU supports (detected once, then cached by std).
    pub fn best() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.available())
            .unwrap_or(Self::Scalar)
    }

    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => avx2::Avx2::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => avx512::Avx512::detect().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512 => false,
        }
    }
}

/// Reusable working memory. Grows to the largest problem seen and is never shrunk, so a warm
/// worker does not allocate per call.
#[derive(Debug, Default)]
pub struct Scratch {
    /// `t = x · Aᵀ`, `[rows, rank]`.
    t: Vec<f32>,
    /// One widened `[rank, kc]` chunk of `A` (f16/bf16 or unaligned f32 only).
    a_chunk: Vec<f32>,
    /// Transposed, widened `B` chunk: `⌈nc / panel⌉` panels of `[rank, panel]`.
    panels: Vec<f32>,
    /// `tᵀ`, `[rank, BCAST_LANES]`, rows past `rows` zero (few-rows path only).
    tt: Vec<f32>,
}

impl Scratch {
    /// Empty scratch; grows on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scratch already sized for `p`, so that even the first call does not allocate.
    pub fn for_problem(p: &LoraProblem) -> Self {
        let mut s = Self::new();
        let b = Blocking::for_problem(p, MAX_PANEL);
        grow(&mut s.t, p.rows * p.rank);
        grow(&mut s.a_chunk, p.rank * b.kc);
        grow(&mut s.panels, b.nc.div_ceil(MAX_PANEL) * MAX_PANEL * p.rank);
        s
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Computes `Δ = scale · (x · Aᵀ) · Bᵀ` into `out` (or adds it, with `accumulate`) using the
/// best instruction set of this CPU.
pub fn lora_delta(
    p: &LoraProblem,
    x: &[f32],
    a: LoraMat<'_>,
    b: LoraMat<'_>,
    out: &mut [f32],
    accumulate: bool,
    scratch: &mut Scratch,
) -> Result<(), LoraError> {
    lora_delta_on(Isa::best(), p, x, a, b, out, accumulate, scratch)
}

/// [`lora_delta`] on a chosen instruction set (tests and benchmarks compare them).
#[allow(clippy::too_many_arguments)]
pub fn lora_delta_on(
    isa: Isa,
    p: &LoraProblem,
    x: &[f32],
    a: LoraMat<'_>,
    b: LoraMat<'_>,
    out: &mut [f32],
    accumulate: bool,
    scratch: &mut Scratch,
) -> Result<(), LoraError> {
    check(p, x, a, b, out)?;
    let job = Job {
        p,
        x,
        a,
        b,
        accumulate,
    };
    let unavailable = Err(LoraError::IsaUnavailable(isa));
    match isa {
        Isa::Scalar => job.run(scalar::Scalar, out, scratch),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match avx2::Avx2::detect() {
            Some(ops) => job.run(ops, out, scratch),
            None => return unavailable,
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => match avx512::Avx512::detect() {
            Some(ops) => job.run(ops, out, scratch),
            None => return unavailable,
        },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => return unavailable,
    }
    Ok(())
}

/// Runs `$body` with `$ops` bound to the [`Ops`] of `$isa`, or returns
/// [`LoraError::IsaUnavailable`].
macro_rules! with_ops {
    ($isa:expr, $ops:ident => $body:expr) => {
        match $isa {
            Isa::Scalar => {
                let $ops = scalar::Scalar;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => match avx2::Avx2::detect() {
                Some($ops) => $body,
                None => return Err(LoraError::IsaUnavailable($isa)),
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => match avx512::Avx512::detect() {
                Some($ops) => $body,
                None => return Err(LoraError::IsaUnavailable($isa)),
            },
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => return Err(LoraError::IsaUnavailable($isa)),
        }
    };
}

/// The shrink of [`lora_delta`] for rank rows `ranks` only: `t = x · A[ranks]ᵀ`, unscaled,
/// `[rows, ranks.len()]`. Every element is bit for bit what [`lora_delta`] computes for it,
/// so threads can split a shrink by rank rows, assemble `t` and [`lora_expand`] it.
pub fn lora_shrink(
    p: &LoraProblem,
    x: &[f32],
    a: LoraMat<'_>,
    ranks: std::ops::Range<usize>,
    t: &mut [f32],
    scratch: &mut Scratch,
) -> Result<(), LoraError> {
    let mul = |u: usize, v: usize| u.checked_mul(v).ok_or(LoraError::Overflow(*p));
    check_len("x", mul(p.rows, p.d_in)?, x.len())?;
    check_weight("A", a, mul(mul(p.rank, p.d_in)?, a.dtype.size())?)?;
    assert!(
        ranks.start <= ranks.end && ranks.end <= p.rank,
        "lora_shrink: rank rows {ranks:?} of rank {}",
        p.rank
    );
    check_len("t", mul(p.rows, ranks.len())?, t.len())?;
    if p.rows == 0 || ranks.is_empty() {
        return Ok(());
    }
    if p.d_in == 0 {
        t.fill(0.0);
        return Ok(());
    }
    let job = Job {
        p,
        x,
        a,
        b: a,
        accumulate: false,
    };
    with_ops!(Isa::best(), ops => job.shrink(ops, ranks, t, &mut scratch.a_chunk));
    Ok(())
}

/// The expand of [`lora_delta`]: `Δ = (scale · t) · Bᵀ` into `out` (or added, with
/// `accumulate`) from the unscaled shrink `t` (`[rows, rank]`; scaled in place). After
/// [`lora_shrink`] over every rank row, bit for bit [`lora_delta`].
pub fn lora_expand(
    p: &LoraProblem,
    t: &mut [f32],
    b: LoraMat<'_>,
    out: &mut [f32],
    accumulate: bool,
    scratch: &mut Scratch,
) -> Result<(), LoraError> {
    let mul = |u: usize, v: usize| u.checked_mul(v).ok_or(LoraError::Overflow(*p));
    check_len("t", mul(p.rows, p.rank)?, t.len())?;
    check_len("out", mul(p.rows, p.d_out)?, out.len())?;
    check_weight("B", b, mul(mul(p.rank, p.d_out)?, b.dtype.size())?)?;
    if p.rows == 0 || p.d_out == 0 {
        return Ok(());
    }
    if p.rank == 0 || p.d_in == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return Ok(());
    }
    let job = Job {
        p,
        x: &[],
        a: b,
        b,
        accumulate,
    };
    with_ops!(Isa::best(), ops => job.expand(ops, t, out, scratch));
    Ok(())
}

fn check_len(which: &'static str, expected: usize, got: usize) -> Result<(), LoraError> {
    (expected == got)
        .then_some(())
        .ok_or(LoraError::Activation {
            which,
            expected,
            got,
        })
}

fn check_weight(which: &'static str, m: LoraMat<'_>, expected: usize) -> Result<(), LoraError> {
    let got = m.bytes.len();
    (expected == got).then_some(()).ok_or(LoraError::Weight {
        which,
        dtype: m.dtype.name(),
        expected,
        got,
    })
}

fn check(
    p: &LoraProblem,
    x: &[f32],
    a: LoraMat<'_>,
    b: LoraMat<'_>,
    out: &[f32],
) -> Result<(), LoraError> {
    let mul = |u: usize, v: usize| u.checked_mul(v).ok_or(LoraError::Overflow(*p));
    let weight = |which, m: LoraMat<'_>, d: usize| {
        check_weight(which, m, mul(mul(p.rank, d)?, m.dtype.size())?)
    };
    check_len("x", mul(p.rows, p.d_in)?, x.len())?;
    check_len("out", mul(p.rows, p.d_out)?, out.len())?;
    weight("A", a, p.d_in)?;
    weight("B", b, p.d_out)
}
