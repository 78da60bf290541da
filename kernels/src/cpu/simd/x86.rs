//! AVX2 + FMA + F16C decode kernels (x86-64). Each safe method checks the lengths its raw
//! loop relies on (the public wrappers in `mod.rs` already did; the asserts restate them
//! where the pointer arithmetic needs them), and an [`Avx2`] token exists only once the
//! features were detected, so calling the `#[target_feature]` functions is sound.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{Q8Block, Q8_BLOCK};
use crate::cpu::quant::WeightFormat;

/// Proof that this CPU has AVX2, FMA and F16C.
#[derive(Copy, Clone, Debug)]
pub(super) struct Avx2 {
    _detected: (),
}

impl Avx2 {
    pub(super) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self { _detected: () })
    }

    /// # Safety
    /// [`Avx2::detect`] must have returned `Some` in this process.
    #[inline(always)]
    pub(super) unsafe fn new_unchecked() -> Self {
        Self { _detected: () }
    }

    #[inline]
    pub(super) fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        // SAFETY: `self` proves the features; both slices hold `a.len()` f32s.
        unsafe { dot_f32(a.as_ptr(), b.as_ptr(), a.len()) }
    }

    #[inline]
    pub(super) fn dot_f16(self, x: &[f32], w: &[f16]) -> f32 {
        assert_eq!(x.len(), w.len());
        // SAFETY: `self` proves the features; `x` holds `n` f32s and `w` `n` halves.
        unsafe { dot_half::<false>(x.as_ptr(), w.as_ptr().cast(), x.len()) }
    }

    #[inline]
    pub(super) fn dot_bf16(self, x: &[f32], w: &[bf16]) -> f32 {
        assert_eq!(x.len(), w.len());
        // SAFETY: as for `dot_f16`; bf16 is also two bytes per element.
        unsafe { dot_half::<true>(x.as_ptr(), w.as_ptr().cast(), x.len()) }
    }

    #[inline]
    pub(super) fn dot_q8(self, format: WeightFormat, w: &[u8], x: &[Q8Block]) -> f32 {
        assert_eq!(w.len(), x.len() * format.block_bytes());
        let (wp, xp, n) = (w.as_ptr(), x.as_ptr(), x.len());
        // SAFETY: `self` proves the features; `w` holds `n` blocks of `format` and `x` `n`
        // activation blocks, which is all each kernel reads.
        unsafe {
            match format {
                WeightFormat::Q8_0 => dot_q8_0(wp, xp, n),
                WeightFormat::Q4_0 => dot_q4::<false>(wp, xp, n),
                WeightFormat::Q4_1 => dot_q4::<true>(wp, xp, n),
                f => unreachable!("dot_q8 checked the format, got {}", f.name()),
            }
        }
    }
}

/// Lane sum of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// # Safety
/// AVX2/FMA available; `a` and `b` readable for `n` f32s.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(a: *const f32, b: *const f32, n: usize) -> f32 {
    // SAFETY: every load reads `[i, i + 8)` with `i + 8 ≤ n` (or `i < n` in the tail).
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, c) in acc.iter_mut().enumerate() {
                let o = i + 8 * u;
                *c = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), *c);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut t = hsum(s);
        while i < n {
            t += *a.add(i) * *b.add(i);
            i += 1;
        }
        t
    }
}

/// Eight halves at `p` widened to f32: bf16 (`BF`) by a shift, f16 by F16C.
///
/// # Safety
/// AVX2/F16C available; `p` readable for 8 `u16`s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen8<const BF: bool>(p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    if BF {
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    } else {
        _mm256_cvtph_ps(h)
    }
}

/// # Safety
/// AVX2/FMA/F16C available; `x` readable for `n` f32s, `w` for `n` halves (bf16 if `BF`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half<const BF: bool>(x: *const f32, w: *const u16, n: usize) -> f32 {
    // SAFETY: every load reads `[i, i + 8)` with `i + 8 ≤ n` (or element `i < n`).
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, c) in acc.iter_mut().enumerate() {
                let o = i + 8 * u;
                *c = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(o)), widen8::<BF>(w.add(o)), *c);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), widen8::<BF>(w.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut t = hsum(s);
        while i < n {
            let h = *w.add(i);
            let wv = if BF {
                bf16::from_bits(h).to_f32()
            } else {
                f16::from_bits(h).to_f32()
            };
            t += *x.add(i) * wv;
            i += 1;
        }
        t
    }
}

/// The f16 scale at `p` (unaligned little-endian).
///
/// # Safety
/// `p` readable for 2 bytes.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes.
    f16::from_bits(u16::from_le(unsafe { p.cast::<u16>().read_unaligned() })).to_f32()
}

/// Eight i32 lanes of `Σ w·x` over 32 signed byte pairs (`x` in [-127, 127], so negating it
/// never overflows; `|w| ≤ 128` keeps each i16 pair sum within 2·128·127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
    let aw = _mm256_abs_epi8(w);
    let sx = _mm256_sign_epi8(x, w);
    _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
}

/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `n` Q8_0 blocks (34 bytes), `x` for `n` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(w: *const u8, x: *const Q8Block, n: usize) -> f32 {
    // SAFETY: block `i` reads bytes `[34 i, 34 i + 34)` of `w` and `x[i]`, `i < n`.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 2];
        for i in 0..n {
            let (b, xb) = (w.add(34 * i), &*x.add(i));
            let q = _mm256_loadu_si256(b.add(2).cast());
            let xq = _mm256_loadu_si256(xb.qs.as_ptr().cast());
            let s = _mm256_cvtepi32_ps(dot_i8(q, xq));
            let d = _mm256_set1_ps(f16_at(b) * xb.d);
            acc[i & 1] = _mm256_fmadd_ps(d, s, acc[i & 1]);
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }
}

/// Q4_0 (`MIN = false`: 18-byte blocks, value `d·(q − 8)`) or Q4_1 (`MIN`: 20-byte blocks,
/// value `d·q + m`).
///
/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `n` blocks of the format, `x` for `n` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4<const MIN: bool>(w: *const u8, x: *const Q8Block, n: usize) -> f32 {
    let (bb, off) = if MIN { (20, 4) } else { (18, 2) };
    let low = _mm_set1_epi8(0xF);
    // SAFETY: block `i` reads bytes `[bb i, bb i + bb)` of `w` and `x[i]`, `i < n`.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut mins = 0.0f32;
        for i in 0..n {
            let (b, xb) = (w.add(bb * i), &*x.add(i));
            let packed = _mm_loadu_si128(b.add(off).cast());
            // Low nibbles are values 0..16, high nibbles 16..32 (ggml's layout).
            let lo = _mm_and_si128(packed, low);
            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            let q = _mm256_set_m128i(hi, lo);
            let xq = _mm256_loadu_si256(xb.qs.as_ptr().cast());
            let d = _mm256_set1_ps(f16_at(b) * xb.d);
            let s = if MIN {
                mins += f16_at(b.add(2)) * xb.s;
                // Unsigned nibbles × signed activations: maddubs directly (≤ 2·15·127).
                _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), _mm256_set1_epi16(1))
            } else {
                dot_i8(_mm256_sub_epi8(q, _mm256_set1_epi8(8)), xq)
            };
            acc[i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[i & 1]);
        }
        hsum(_mm256_add_ps(acc[0], acc[1])) + mins
    }
}

// The kernels load one 32-byte vector of activations per block.
const _: () = assert!(Q8_BLOCK == 32);
