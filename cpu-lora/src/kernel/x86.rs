//! x86-64 pieces shared by the AVX2 and AVX-512 backends: widening stored weights to f32,
//! transposing `B` into panels (8 × 8 register transposes; bound by memory, so 256-bit is
//! enough for both), prefetch hints for cold weights, and the raw operand structs of the
//! micro-kernels. Together with `avx2.rs` and `avx512.rs`, the crate's only `unsafe`.
//!
//! Every `unsafe fn` here needs AVX2, FMA and F16C; callers prove that with a backend token
//! (`Avx2` or `Avx512`), which exists only after run-time detection.
// Register tiles are indexed in step with pointer offsets; iterators obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::{LoraMat, WeightDtype};

/// Dtype codes for const generics (one instantiation per stored format).
pub(super) const F32: u8 = 0;
pub(super) const F16: u8 = 1;
pub(super) const BF16: u8 = 2;

/// [`Ops::widen`] for any x86 backend.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn widen(dtype: WeightDtype, src: &[u8], dst: &mut [f32], next: &[u8]) {
    assert_eq!(src.len(), dst.len() * dtype.size(), "widen: length");
    let (s, d, n) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
    let pf = Prefetch {
        base: next.as_ptr(),
        len: next.len(),
    };
    // SAFETY: the caller vouches for the features; `src` holds exactly `n` elements of
    // `dtype` and `dst` has room for `n` f32s, which is all `widen_impl` touches; `pf` is a
    // live slice, only prefetched.
    unsafe {
        match dtype {
            WeightDtype::F32 => widen_impl::<F32>(s, d, n, pf),
            WeightDtype::F16 => widen_impl::<F16>(s, d, n, pf),
            WeightDtype::Bf16 => widen_impl::<BF16>(s, d, n, pf),
        }
    }
}

/// A byte range to pull into L2 ahead of use.
#[derive(Copy, Clone)]
pub(super) struct Prefetch {
    pub base: *const u8,
    pub len: usize,
}

impl Prefetch {
    pub(super) const NONE: Self = Self {
        base: std::ptr::null(),
        len: 0,
    };

    /// Prefetches the line holding byte `off`, if it is inside the range.
    ///
    /// # Safety
    /// `base..base + len` must lie in one allocation (it is only prefetched, never read).
    #[inline(always)]
    pub(super) unsafe fn line(self, off: usize) {
        if off < self.len {
            // SAFETY: `off < len`, so the address is inside the caller's allocation; a
            // prefetch does not access memory architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.base.add(off).cast()) };
        }
    }
}

/// [`Ops::pack_bt`] for any x86 backend, with panels `panel` (a multiple of 8) wide.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn pack_bt(
    b: LoraMat<'_>,
    rank: usize,
    cols: Range<usize>,
    dst: &mut [f32],
    panel: usize,
) {
    assert!(
        panel.is_multiple_of(8),
        "pack_bt: panel width {panel} is not a multiple of 8"
    );
    let panels = cols.len().div_ceil(panel);
    assert!(dst.len() >= panels * rank * panel, "pack_bt: dst too small");
    assert!(
        b.bytes.len() >= cols.end * rank * b.dtype.size(),
        "pack_bt: b too small"
    );
    let (s, o0, n, d) = (b.bytes.as_ptr(), cols.start, cols.len(), dst.as_mut_ptr());
    let pf = Prefetch {
        base: b.bytes.as_ptr(),
        len: b.bytes.len(),
    };
    let geo = PackGeometry {
        rank,
        o0,
        n,
        panel,
        pf,
    };
    // SAFETY: the caller vouches for the features; `pack_impl` reads rows `cols` of `b` and
    // writes `panels` whole panels of `dst`, both checked above.
    unsafe {
        match b.dtype {
            WeightDtype::F32 => pack_impl::<F32>(s, geo, d),
            WeightDtype::F16 => pack_impl::<F16>(s, geo, d),
            WeightDtype::Bf16 => pack_impl::<BF16>(s, geo, d),
        }
    }
}

/// Which rows of `B` a pack reads and how wide its panels are.
#[derive(Copy, Clone)]
struct PackGeometry {
    rank: usize,
    o0: usize,
    n: usize,
    panel: usize,
    /// All of `b`, for prefetching ahead of the 8-row groups.
    pf: Prefetch,
}

pub(super) const fn elem_size(dt: u8) -> usize {
    if dt == F32 {
        4
    } else {
        2
    }
}

/// Eight elements at `p`, widened.
///
/// # Safety
/// AVX2 and F16C must be available and `p` must point to 8 readable elements of `DT`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const DT: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 readable elements; all loads are unaligned.
    unsafe {
        match DT {
            F32 => _mm256_loadu_ps(p.cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            // bf16 → f32 is the 16 bits moved to the top of a 32-bit lane.
            _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
                16,
            )),
        }
    }
}

/// One element at `p`, widened.
///
/// # Safety
/// `p` must point to one readable element of `DT`.
#[inline(always)]
pub(super) unsafe fn load1<const DT: u8>(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees one readable element; reads are unaligned.
    unsafe {
        match DT {
            F32 => p.cast::<f32>().read_unaligned(),
            F16 => half::f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
            _ => f32::from_bits(u32::from(p.cast::<u16>().read_unaligned()) << 16),
        }
    }
}

/// # Safety
/// AVX2/F16C available; `src` holds `n` elements of `DT`, `dst` has room for `n` f32s;
/// `pf` as in [`Prefetch::line`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_impl<const DT: u8>(src: *const u8, dst: *mut f32, n: usize, pf: Prefetch) {
    let es = elem_size(DT);
    // SAFETY: every offset below is `< n` elements, within the caller's guarantee.
    unsafe {
        let mut i = 0;
        while i + 8 <= n {
            if (i * es).is_multiple_of(64) {
                pf.line(i * es);
            }
            _mm256_storeu_ps(dst.add(i), load8::<DT>(src.add(i * es)));
            i += 8;
        }
        while i < n {
            *dst.add(i) = load1::<DT>(src.add(i * es));
            i += 1;
        }
    }
}

/// Raw operands of one shrink block (`t[m, n] (=|+=) x[m, k] · a[n, k]ᵀ`).
#[derive(Copy, Clone)]
pub(super) struct Shrink {
    pub x: *const f32,
    pub ldx: usize,
    pub a: *const f32,
    pub lda: usize,
    pub t: *mut f32,
    pub ldt: usize,
    pub k: usize,
    pub first: bool,
    /// The next rank tile's rows of `a` (`lda` apart), prefetched while this tile runs when
    /// this is the first row block, the one that pulls `a` in from memory.
    pub pf_a: Prefetch,
    pub pf_rows: usize,
}

/// # Safety
/// AVX2/F16C available; `b` holds rows `o0..o0 + n` of `rank` elements of `DT`; `dst` has room
/// for `⌈n / panel⌉` panels of `rank × panel` f32s; `panel` is a multiple of 8; `g.pf` as in
/// [`Prefetch::line`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_impl<const DT: u8>(b: *const u8, g: PackGeometry, dst: *mut f32) {
    let PackGeometry {
        rank,
        o0,
        n,
        panel: pw,
        ..
    } = g;
    let es = elem_size(DT);
    let (r8, n8) = (rank & !7, n & !7);
    let panel_of = |c: usize| (c / pw) * rank * pw + c % pw;
    // SAFETY: reads stay in rows `o0 + c < o0 + n`, columns `j < rank`; writes stay in panel
    // `c / pw < ⌈n / pw⌉`, row `j < rank`, column `c % pw < pw`.
    unsafe {
        let mut c = 0;
        // Eight whole columns (eight rows of `b`) at a time: 8 × 8 blocks, transposed in
        // registers. `pw` is a multiple of 8, so a block never straddles two panels.
        let group = 8 * rank * es;
        while c < n8 {
            let src = b.add((o0 + c) * rank * es);
            let out = dst.add(panel_of(c));
            // Cold weights: pull the group two ahead (rows o0 + c + 16..24) into L2.
            let ahead = (o0 + c + 16) * rank * es;
            for off in (0..group).step_by(64) {
                g.pf.line(ahead + off);
            }
            let mut j = 0;
            while j < r8 {
                let mut r = [_mm256_setzero_ps(); 8];
                for ii in 0..8 {
                    r[ii] = load8::<DT>(src.add((ii * rank + j) * es));
                }
                transpose8_store(r, out.add(j * pw), pw);
                j += 8;
            }
            while j < rank {
                for ii in 0..8 {
                    *out.add(j * pw + ii) = load1::<DT>(src.add((ii * rank + j) * es));
                }
                j += 1;
            }
            c += 8;
        }
        // Ragged last columns, then zeros up to the panel edge.
        while c < n.div_ceil(pw) * pw {
            let out = dst.add(panel_of(c));
            for j in 0..rank {
                *out.add(j * pw) = if c < n {
                    load1::<DT>(b.add(((o0 + c) * rank + j) * es))
                } else {
                    0.0
                };
            }
            c += 1;
        }
    }
}

/// 8 × 8 transpose: stores `r[i][k]` to `out[k * ld + i]`.
///
/// # Safety
/// AVX available; `out[k * ld..][..8]` writable for `k < 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose8_store(r: [__m256; 8], out: *mut f32, ld: usize) {
    // SAFETY: the caller guarantees rows `k < 8` of `out`.
    unsafe {
        let cols = thaw_kernels::cpu::simd::transpose8(r);
        for (k, col) in cols.into_iter().enumerate() {
            _mm256_storeu_ps(out.add(k * ld), col);
        }
    }
}

/// Raw operands of one expand block (`out[m, cols] (=|+=) t[m, k] · panels`).
#[derive(Copy, Clone)]
pub(super) struct Expand {
    pub t: *const f32,
    pub ldt: usize,
    pub panel: *const f32,
    pub k: usize,
    pub out: *mut f32,
    pub ldo: usize,
    pub cols: usize,
    pub accumulate: bool,
}
