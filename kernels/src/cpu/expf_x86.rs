//! [`super::expf`] sixteen lanes at a time on AVX-512F: each half widened to eight doubles
//! and taken through the same fused steps, table lookup by permutes, so every lane is the
//! scalar port's bits. Lanes off the main path (`|x| ≥ 88`, not finite) other than `-inf`
//! (softmax's masked scores, which give `+0` here) are redone by the scalar port.
use std::arch::x86_64::*;

use super::{C0, C1, C2, INV_LN2_N, SHIFT, SPECIAL_TOP, TAB};

/// `e^x` lane by lane, bit for bit [`super::expf`].
///
/// # Safety
/// AVX-512F available.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn expf_x16(x: __m512) -> __m512 {
    let xi = _mm512_castps_si512(x);
    let top = _mm512_and_si512(_mm512_srli_epi32::<20>(xi), _mm512_set1_epi32(0x7ff));
    let special = _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(SPECIAL_TOP as i32));
    let lo = main8(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    let hi = main8(_mm512_cvtps_pd(_mm256_castpd_ps(
        _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)),
    )));
    let y = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
        _mm256_castps_pd(_mm512_cvtpd_ps(hi)),
    ));
    if special == 0 {
        return y;
    }
    let ninf = _mm512_cmpeq_ps_mask(x, _mm512_set1_ps(f32::NEG_INFINITY));
    let y = _mm512_mask_mov_ps(y, ninf, _mm512_setzero_ps());
    let rest = special & !ninf;
    if rest == 0 {
        return y;
    }
    let (mut xs, mut ys) = ([0.0f32; 16], [0.0f32; 16]);
    // SAFETY: both arrays hold 16 floats.
    unsafe {
        _mm512_storeu_ps(xs.as_mut_ptr(), x);
        _mm512_storeu_ps(ys.as_mut_ptr(), y);
    }
    for l in 0..16 {
        if rest >> l & 1 == 1 {
            ys[l] = super::expf(xs[l]);
        }
    }
    // SAFETY: `ys` holds 16 floats.
    unsafe { _mm512_loadu_ps(ys.as_ptr()) }
}

/// The main path of [`super::main_path`] in eight double lanes, before the rounding to f32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn main8(xd: __m512d) -> __m512d {
    let c = |b: u64| _mm512_set1_pd(f64::from_bits(b));
    let (inv, shift) = (c(INV_LN2_N), c(SHIFT));
    let kd0 = _mm512_fmadd_pd(inv, xd, shift);
    let ki = _mm512_castpd_si512(kd0);
    let kd = _mm512_sub_pd(kd0, shift);
    let r = _mm512_fmsub_pd(inv, xd, kd);
    // TAB[k mod 32]: each permute picks from 16 entries by the index's low 4 bits, bit 4
    // chooses between the two.
    let t = |i: usize| {
        _mm512_set_epi64(
            TAB[i + 7] as i64,
            TAB[i + 6] as i64,
            TAB[i + 5] as i64,
            TAB[i + 4] as i64,
            TAB[i + 3] as i64,
            TAB[i + 2] as i64,
            TAB[i + 1] as i64,
            TAB[i] as i64,
        )
    };
    let low = _mm512_permutex2var_epi64(t(0), ki, t(8));
    let high = _mm512_permutex2var_epi64(t(16), ki, t(24));
    let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
    let tab = _mm512_mask_mov_epi64(low, upper, high);
    let s = _mm512_castsi512_pd(_mm512_add_epi64(tab, _mm512_slli_epi64::<47>(ki)));
    let z = _mm512_fmadd_pd(r, c(C0), c(C1));
    let r2 = _mm512_mul_pd(r, r);
    let y = _mm512_fmadd_pd(r, c(C2), _mm512_set1_pd(1.0));
    _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s)
}

/// `out[i] = e^x[i]` for equal-length slices, 16 at a time, the tail by the scalar port.
///
/// # Safety
/// AVX-512F available; `x.len() == out.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn expf_slice(x: &[f32], out: &mut [f32]) {
    let full = x.len() / 16;
    for c in 0..full {
        // SAFETY: elements `16c..16c + 16` of both slices (equal lengths, the caller's).
        unsafe {
            let v = expf_x16(_mm512_loadu_ps(x.as_ptr().add(16 * c)));
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), v);
        }
    }
    for (o, &v) in out[16 * full..].iter_mut().zip(&x[16 * full..]) {
        *o = super::expf(v);
    }
}

/// `out[i] = g / (1 + e^(−g)) · u` for `g = gate[i]`, `u = up[i]`, 16 at a time: the
/// portable `swiglu`'s operations in its order (each IEEE-exact), so the same bits.
///
/// # Safety
/// AVX-512F available; the three slices have equal lengths.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let full = gate.len() / 16;
    let one = _mm512_set1_ps(1.0);
    let sign = _mm512_set1_ps(-0.0);
    for c in 0..full {
        // SAFETY: elements `16c..16c + 16` of the three equal-length slices.
        unsafe {
            let g = _mm512_loadu_ps(gate.as_ptr().add(16 * c));
            let u = _mm512_loadu_ps(up.as_ptr().add(16 * c));
            let e = expf_x16(_mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(g),
                _mm512_castps_si512(sign),
            )));
            let s = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), _mm512_mul_ps(s, u));
        }
    }
    let t = 16 * full;
    super::super::activation::swiglu_scalar(&gate[t..], &up[t..], &mut out[t..]);
}
