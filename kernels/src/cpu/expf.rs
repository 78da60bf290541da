//! `e^x` in f32 with fixed bits on every machine, one lane or sixteen at a time.
//!
//! [`expf`] is glibc's `expf` (2.28 and later, the algorithm of ARM's optimized-routines:
//! `2^(k/32)` from a 32-entry table times a cubic in double precision, rounded once to f32),
//! written out with its fused multiply-adds where glibc's FMA build has them — the build
//! glibc picks on every x86-64 CPU with FMA and AVX2. So on such machines it returns what
//! `f32::exp` returns, bit for bit (checked over all 2³² inputs by
//! `examples/expf_exhaustive.rs`), and elsewhere it still returns the same bits as here.
//! [`expf_x16`] (AVX-512F) computes the same arithmetic in eight double lanes twice, so its
//! lanes equal [`expf`] bit for bit, and costs about what one scalar call costs for 16 values.
//!
//! Why not libm: attention's softmax and SwiGLU call `exp` once per score and per
//! activation — tens of millions of calls in a prefill of 2,048 tokens, at about 20 cycles
//! each — and a vector version can only stand in for the scalar one, with the token tests'
//! texts unchanged, if both compute the same bits.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

/// `2^(i/32)` as f64 bits, less `i << 47` (glibc's `__exp2f_data.tab`): adding `k << 47` to
/// entry `k mod 32` gives `2^(k/32)` for an integer `k`.
const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `32 / ln 2`.
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// `1.5 · 2^52`: adding it rounds a double below 2^51 in magnitude to an integer, to nearest.
const SHIFT: u64 = 0x4338000000000000;
/// The cubic's coefficients for `2^(r/32)`, `r` in `[-1/2, 1/2]`: `C0·r³ + C1·r² + C2·r + 1`.
const C0: u64 = 0x3ebc6af84b912394;
const C1: u64 = 0x3f2ebfce50fac4f3;
const C2: u64 = 0x3f962e42ff0c52d6;
/// `|x| ≥ 88` (or not finite) leaves the main path: the top 12 bits of `|x|` from here on.
const SPECIAL_TOP: u32 = 0x42b;
/// Largest `x` whose `e^x` is finite in f32 (`0x1.62e42ep6`).
const OVERFLOW_ABOVE: u32 = 0x42b17217;
/// Below it `e^x` rounds to `+0` (`-0x1.9fe368p6`).
const UNDERFLOW_BELOW: u32 = 0xc2cff1b4;
/// Below it (and not below [`UNDERFLOW_BELOW`]) glibc returns the least subnormal
/// (`-0x1.9d1d9ep6`, its `__math_may_uflowf`).
const MAY_UNDERFLOW_BELOW: u32 = 0xc2ce8ecf;

/// `e^x`, glibc's `expf` bit for bit (see the module note).
#[inline]
pub fn expf(x: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA.
        return unsafe { expf_fma(x) };
    }
    expf_any(x)
}

/// [`expf_any`] compiled with FMA instructions (`mul_add` is otherwise a libm call, five
/// times the cost of the whole function); the same bits.
///
/// # Safety
/// FMA available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn expf_fma(x: f32) -> f32 {
    expf_any(x)
}

#[inline(always)]
fn expf_any(x: f32) -> f32 {
    if (x.to_bits() >> 20) & 0x7ff >= SPECIAL_TOP {
        return special(x);
    }
    main_path(x)
}

/// `|x| ≥ 88`, infinities and NaN, as glibc's `expf` treats them.
#[cold]
fn special(x: f32) -> f32 {
    let top = (x.to_bits() >> 20) & 0x7ff;
    if x == f32::NEG_INFINITY {
        0.0
    } else if top >= 0x7f8 {
        // +inf stays, NaN becomes quiet.
        x + x
    } else if x > f32::from_bits(OVERFLOW_ABOVE) {
        f32::INFINITY
    } else if x < f32::from_bits(UNDERFLOW_BELOW) {
        0.0
    } else if x < f32::from_bits(MAY_UNDERFLOW_BELOW) {
        f32::from_bits(1)
    } else {
        main_path(x)
    }
}

/// The table-and-cubic path, each step as glibc's FMA build rounds it.
#[inline(always)]
fn main_path(x: f32) -> f32 {
    let f = f64::from_bits;
    let xd = x as f64;
    // `k = round(x·32/ln 2)` in the low bits of `kd0`, and `r = x·32/ln 2 − k` exactly as
    // one fused step.
    let kd0 = f(INV_LN2_N).mul_add(xd, f(SHIFT));
    let ki = kd0.to_bits();
    let kd = kd0 - f(SHIFT);
    let r = f(INV_LN2_N).mul_add(xd, -kd);
    let s = f(TAB[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = r.mul_add(f(C0), f(C1));
    let r2 = r * r;
    let y = r.mul_add(f(C2), 1.0);
    (z.mul_add(r2, y) * s) as f32
}

/// Whether [`expf_x16`] and the kernels built on it are in use: AVX-512F present, the SIMD
/// level not forced to portable, and neither `THAW_AVX512=0` nor `THAW_VECTOR_EXP=0` set
/// (read once; the results are the same bits either way, so the switch is for A/B runs).
#[cfg(target_arch = "x86_64")]
pub(crate) fn vector_enabled() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && !super::switched_off("THAW_AVX512")
            && !super::switched_off("THAW_VECTOR_EXP")
    }) && super::simd_level() == super::SimdLevel::Avx2
}

/// `out[i] = e^x[i]` ([`expf`] per element).
pub fn expf_slice(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "expf_slice: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if vector_enabled() {
        // SAFETY: `vector_enabled` found AVX-512F; the lengths are equal.
        return unsafe { x86::expf_slice(x, out) };
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = expf(v);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::expf_x16;

#[cfg(target_arch = "x86_64")]
#[path = "expf_x86.rs"]
pub(crate) mod x86;

#[cfg(test)]
#[path = "expf_tests.rs"]
mod tests;
