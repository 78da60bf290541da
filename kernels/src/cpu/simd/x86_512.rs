//! AVX-512F versions of the quantised f32-activation kernels ([`super::gemv_quant_f32`] and
//! [`super::dequantize_row`]), used by the AVX2 level when the CPU also has AVX-512F (and
//! `THAW_AVX512` is not `0`). Results are bit-identical to the AVX2 kernels:
//!
//! - A Q4_0/Q4_1 block's 16 possible values are computed once per block with the scalar
//!   dequantiser's operations (`d·(q − 8)`, or `d·q` then `+ m`, each rounded), as a 16-lane
//!   table; each nibble then picks its value with one `vpermps` (which reads only the low 4
//!   bits of each index), instead of a convert, a multiply and an add per value.
//! - One 16-lane accumulator per (weight row, activation row) holds, in lanes 0–7 and 8–15,
//!   exactly the AVX2 kernel's two 8-lane accumulators (elements `16c..16c + 8` and
//!   `16c + 8..16c + 16`), fed in the same order, and ends with the same pairwise lane sum.
// Register tiles are indexed `acc[jj][r]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::atomic::AtomicU8;

use super::x86::{load_w, w_at, BF16, F16, F32};
use super::{FloatWeights, Q8_BLOCK};
use crate::cpu::quant::WeightFormat;

/// Quantised weight formats (const generic codes).
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;

/// Activation rows per tile for batched decode.
const MR: usize = 4;
/// Weight rows per tile for one activation row (independent accumulator chains).
const JR: usize = 4;

/// Proof that this CPU has AVX-512F (and AVX2, FMA, F16C).
#[derive(Copy, Clone, Debug)]
pub(super) struct Avx512 {
    _detected: (),
}

/// 0 = not yet decided, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

impl Avx512 {
    pub(super) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self { _detected: () })
    }

    /// The token when the CPU has AVX-512F and the environment does not set
    /// `THAW_AVX512=0` (read once; for A/B runs of the same binary).
    #[inline]
    pub(super) fn enabled() -> Option<Self> {
        let on = super::decided_once(&STATE, || {
            !crate::cpu::switched_off("THAW_AVX512") && Self::detect().is_some()
        });
        on.then_some(Self { _detected: () })
    }

    /// [`super::gemv_quant_f32`] for Q8_0/Q4_0/Q4_1 (arguments checked by the caller, see
    /// `x86::Avx2::gemv_quant_f32`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv_quant_f32(
        self,
        format: WeightFormat,
        w: &[u8],
        n: usize,
        kb: usize,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        assert!(w.len() >= n * kb * format.block_bytes() && x.len() >= m * kb * Q8_BLOCK);
        assert!(m == 0 || n == 0 || (m - 1) * ldo + n <= out.len());
        let (w, x, o) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr());
        // SAFETY: `self` proves the features; the asserts above bound every row of `w` and
        // `x` and every output `i·ldo + j` (i < m, j < n) the kernel touches.
        unsafe {
            match format {
                WeightFormat::Q8_0 => rows::<Q8_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_0 => rows::<Q4_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_1 => rows::<Q4_1>(w, n, kb, x, m, o, ldo),
                f => unreachable!("gemv_quant_f32 checked the format, got {}", f.name()),
            }
        }
    }

    /// Dequantises whole blocks of `format` (Q8_0/Q4_0/Q4_1) into `out`, bit-identical to
    /// the scalar dequantiser.
    pub(super) fn dequantize_row(self, format: WeightFormat, w: &[u8], out: &mut [f32]) {
        let kb = w.len() / format.block_bytes();
        assert!(out.len() >= kb * Q8_BLOCK, "dequantize_row: short out");
        let (w, o) = (w.as_ptr(), out.as_mut_ptr());
        // SAFETY: `self` proves the features; `w` holds `kb` whole blocks and `out` `32·kb`
        // values (asserted above).
        unsafe {
            match format {
                WeightFormat::Q8_0 => dequant_rows::<Q8_0>(w, kb, o),
                WeightFormat::Q4_0 => dequant_rows::<Q4_0>(w, kb, o),
                WeightFormat::Q4_1 => dequant_rows::<Q4_1>(w, kb, o),
                f => unreachable!("dequantize_row takes 32-value formats, got {}", f.name()),
            }
        }
    }
}

/// Bytes per block of a quantised format code.
const fn block_bytes(fmt: u8) -> usize {
    match fmt {
        Q8_0 => 34,
        Q4_0 => 18,
        _ => 20,
    }
}

/// Block `wb` of format `FMT` as f32: values `0..16` and `16..32`, each computed with the
/// scalar dequantiser's operations, so bit-identical to it.
///
/// # Safety
/// AVX-512F/F16C available; `wb` readable for one block of `FMT`.
#[inline(always)]
unsafe fn block_values<const FMT: u8>(wb: *const u8) -> (__m512, __m512) {
    // SAFETY: every load stays inside the block (scales at 0..4, codes at byte 2 or 4, 32 or
    // 16 bytes).
    unsafe {
        let s = _mm_cvtph_ps(_mm_cvtsi32_si128(wb.cast::<i32>().read_unaligned()));
        let d = _mm512_broadcastss_ps(s);
        if FMT == Q8_0 {
            let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(wb.add(2).cast()));
            let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(wb.add(18).cast()));
            return (
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)),
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1)),
            );
        }
        // The 16 values a nibble can stand for, as the scalar code computes them.
        let table = if FMT == Q4_0 {
            let q = _mm512_setr_ps(
                -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
                7.0,
            );
            _mm512_mul_ps(d, q)
        } else {
            let q = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(s));
            _mm512_add_ps(_mm512_mul_ps(d, q), m)
        };
        // Byte `b` holds value `b` (low nibble) and value `b + 16` (high nibble); vpermps
        // reads the low 4 bits of each 32-bit index.
        let off = if FMT == Q4_0 { 2 } else { 4 };
        let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(off).cast()));
        (
            _mm512_permutexvar_ps(e, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(e), table),
        )
    }
}

/// The AVX2 kernels' final sum of one 16-lane accumulator: lanes 0–7 plus lanes 8–15, then
/// the pairwise sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn finish(a: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(a);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    let v = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// `out[r·ldo + jj] = w_jj·x[r]` for `jj < J` weight rows (stride `rb` bytes, `kb` blocks)
/// and `r < R` activation rows (stride `ldx`), each block's values computed once.
///
/// # Safety
/// AVX-512F/F16C available; `w` readable for `J` rows of `kb` blocks at stride `rb`, `x` for
/// `R` rows of `32·kb` f32s at stride `ldx`, `out` writable at `r·ldo + jj`.
#[inline(always)]
unsafe fn tile<const FMT: u8, const J: usize, const R: usize>(
    w: *const u8,
    rb: usize,
    kb: usize,
    x: *const f32,
    ldx: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: block `b < kb` of each of the `J` rows, elements `< 32·kb` of each of the `R`
    // activation rows and the `R × J` outputs: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; J];
        for b in 0..kb {
            let mut v = [(_mm512_setzero_ps(), _mm512_setzero_ps()); J];
            for jj in 0..J {
                v[jj] = block_values::<FMT>(w.add(jj * rb + b * block_bytes(FMT)));
            }
            for r in 0..R {
                let xb = x.add(r * ldx + b * Q8_BLOCK);
                let (x0, x1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
                for jj in 0..J {
                    let a = _mm512_fmadd_ps(x0, v[jj].0, acc[jj][r]);
                    acc[jj][r] = _mm512_fmadd_ps(x1, v[jj].1, a);
                }
            }
        }
        for jj in 0..J {
            for r in 0..R {
                *out.add(r * ldo + jj) = finish(acc[jj][r]);
            }
        }
    }
}

/// # Safety
/// AVX-512F/F16C available; `w` readable for `n` rows of `kb` blocks of `FMT`, `x` for `m`
/// rows of `kb·32` f32s, `out` writable at `i·ldo + j` for `i < m`, `j < n`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn rows<const FMT: u8>(
    w: *const u8,
    n: usize,
    kb: usize,
    x: *const f32,
    m: usize,
    out: *mut f32,
    ldo: usize,
) {
    let (rb, k) = (kb * block_bytes(FMT), kb * Q8_BLOCK);
    let mut j = 0;
    // SAFETY: weight rows `j..j + J ≤ n`, activation rows `r0..r0 + R ≤ m` and the outputs
    // `(r0 + r)·ldo + j + jj` are inside the caller's guarantee.
    unsafe {
        if m == 1 {
            while j + JR <= n {
                tile::<FMT, JR, 1>(w.add(j * rb), rb, kb, x, k, out.add(j), ldo);
                j += JR;
            }
            while j < n {
                tile::<FMT, 1, 1>(w.add(j * rb), rb, kb, x, k, out.add(j), ldo);
                j += 1;
            }
            return;
        }
        while j < n {
            let wj = w.add(j * rb);
            let mut r0 = 0;
            while r0 < m {
                let (xr, o) = (x.add(r0 * k), out.add(r0 * ldo + j));
                match (m - r0).min(MR) {
                    4 => tile::<FMT, 1, 4>(wj, rb, kb, xr, k, o, ldo),
                    3 => tile::<FMT, 1, 3>(wj, rb, kb, xr, k, o, ldo),
                    2 => tile::<FMT, 1, 2>(wj, rb, kb, xr, k, o, ldo),
                    _ => tile::<FMT, 1, 1>(wj, rb, kb, xr, k, o, ldo),
                }
                r0 += (m - r0).min(MR);
            }
            j += 1;
        }
    }
}

/// # Safety
/// AVX-512F/F16C available; `w` readable for `kb` blocks of `FMT`, `out` writable for
/// `32·kb` f32s.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dequant_rows<const FMT: u8>(w: *const u8, kb: usize, out: *mut f32) {
    for b in 0..kb {
        // SAFETY: block `b < kb` and values `32b..32b + 32` are inside the caller's guarantee.
        unsafe {
            let (v0, v1) = block_values::<FMT>(w.add(b * block_bytes(FMT)));
            _mm512_storeu_ps(out.add(b * Q8_BLOCK), v0);
            _mm512_storeu_ps(out.add(b * Q8_BLOCK + 16), v1);
        }
    }
}

/// The bounds both `x_i·w_j` products rely on for their unchecked loads and stores: `x` holds
/// `m` rows and `w` `n` rows of `k`, every output `i·ldo + j` (i < m, j < n) is inside `out`,
/// and rows of `out` do not overlap.
pub(super) fn check_gemm_nt(
    name: &str,
    x: &[f32],
    w_len: usize,
    (m, k, n): (usize, usize, usize),
    out: &[f32],
    ldo: usize,
) {
    assert!(x.len() >= m * k && w_len >= n * k, "{name}: short operands");
    assert!(m == 0 || n == 0 || (m - 1) * ldo + n <= out.len());
    assert!(m <= 1 || ldo >= n, "{name}: rows of out overlap");
}

/// Weight rows and activation rows per tile of [`Avx512::gemm_nt`] (16 accumulators,
/// 4 weight vectors and one activation vector of the 32 registers).
const GJ: usize = 4;
const GR: usize = 4;

impl Avx512 {
    /// `out[i·ldo + j] = x_i·w_j` for the `m` rows of `x` (`[m, k]`) and the `n` rows of `w`
    /// (`[n, k]`, f32, f16 or bf16), both read in place (no packing copy). Each output is
    /// summed exactly as the AVX2 row dot (`x86::float_tile`) sums it — lanes 0–7 and 8–15
    /// of one 16-lane accumulator are its two 8-lane accumulators, then one masked 8-wide
    /// step, the pairwise lane sum and the scalar tail — so a prompt row's product is
    /// bit-identical to the same row's decode product, whatever `m`. A 16-bit weight vector
    /// is widened once per tile and used for all of the tile's activation rows.
    pub(super) fn gemm_nt(
        self,
        x: &[f32],
        w: FloatWeights<'_>,
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        ldo: usize,
    ) {
        check_gemm_nt("gemm_nt", x, w.len(), (m, k, n), out, ldo);
        let (x, wp, o) = (x.as_ptr(), w.as_bytes().as_ptr(), out.as_mut_ptr());
        // SAFETY: `self` proves the features; the asserts bound every row of `x` and `w`
        // (`w`'s bytes hold `n·k` elements of its type) and every output `i·ldo + j`
        // (i < m, j < n).
        unsafe {
            match w {
                FloatWeights::F32(_) => gemm_nt_rows::<F32>(x, wp, (m, k, n), o, ldo),
                FloatWeights::F16(_) => gemm_nt_rows::<F16>(x, wp, (m, k, n), o, ldo),
                FloatWeights::BF16(_) => gemm_nt_rows::<BF16>(x, wp, (m, k, n), o, ldo),
            }
        }
    }
}

/// Sixteen weight elements of type `W` at element `i` of `w`, widened to f32 (exactly: every
/// f16 and bf16 value is an f32 value).
///
/// # Safety
/// AVX-512F/F16C available; elements `i..i + 16` of `w` readable.
#[inline(always)]
pub(super) unsafe fn load16<const W: u8>(w: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees the 16 elements and the features.
    unsafe {
        match W {
            F32 => _mm512_loadu_ps(w.cast::<f32>().add(i)),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.cast::<u16>().add(i).cast())),
            _ => {
                let h = _mm256_loadu_si256(w.cast::<u16>().add(i).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }
}

/// Eight weight elements of type `W` at element `i` of `w`, widened to f32 in lanes 0–7
/// (lanes 8–15 zero).
///
/// # Safety
/// AVX-512F/F16C available; elements `i..i + 8` of `w` readable.
#[inline(always)]
unsafe fn load8<const W: u8>(w: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees the 8 elements and the features.
    unsafe {
        match W {
            F32 => _mm512_maskz_loadu_ps(0x00FF, w.cast::<f32>().add(i)),
            _ => _mm512_zextps256_ps512(load_w::<W>(w, i)),
        }
    }
}

/// # Safety
/// AVX-512F/F16C available; `x` readable for `m·k` f32s, `w` for `n·k` elements of type
/// `W`, `out` writable at `i·ldo + j` for `i < m`, `j < n`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn gemm_nt_rows<const W: u8>(
    x: *const f32,
    w: *const u8,
    (m, k, n): (usize, usize, usize),
    out: *mut f32,
    ldo: usize,
) {
    // Weight rows outermost: a tile of GJ rows stays in L1 while every activation row
    // (the whole prompt chunk, in L2) streams past it.
    let eb = elem_bytes(W);
    // One activation row: one weight row at a time, an ascending stream (`super::stream`).
    let gj = if m == 1 && super::stream::row_stream() {
        1
    } else {
        GJ
    };
    // A batch reads a tile's weight rows from memory in its first pass over the activation
    // rows and from L1 in the others (rows side by side, which this VM's hardware prefetcher
    // does not follow): every pass prefetches its share of the next tile's rows, spread over
    // its steps (as `x86_512_bf16`'s decode rows; `THAW_BATCH_PREFETCH=0` turns it off).
    let passes = m.div_ceil(GR);
    let prefetch = m > 1 && super::stream::batch_prefetch();
    let mut j = 0;
    while j < n {
        let jn = (n - j).min(gj);
        let next_lines = if prefetch {
            ((n - j - jn).min(gj) * k * eb).div_ceil(64)
        } else {
            0
        };
        let mut i = 0;
        while i < m {
            let rn = (m - i).min(GR);
            let g = i / GR;
            let pf = Prefetch {
                // The next tile's rows follow this tile's in memory.
                base: w.wrapping_add((j + jn) * k * eb).cast(),
                first: g * next_lines / passes,
                lines: (g + 1) * next_lines / passes - g * next_lines / passes,
            };
            // SAFETY: weight rows `j..j + jn ≤ n`, activation rows `i..i + rn ≤ m` and the
            // outputs `(i + r)·ldo + j + jj`: inside the caller's guarantee (prefetches of the
            // next tile's rows touch no memory).
            unsafe {
                let (xi, wj, o) = (x.add(i * k), w.add(j * k * eb), out.add(i * ldo + j));
                macro_rules! go {
                    ($($J:literal, $R:literal);*) => {
                        match (jn, rn) {
                            $(($J, $R) => nt_tile::<W, $J, $R>(xi, wj, k, o, ldo, pf),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(4,4; 4,3; 4,2; 4,1; 3,4; 3,3; 3,2; 3,1; 2,4; 2,3; 2,2; 2,1; 1,4; 1,3; 1,2; 1,1);
            }
            i += rn;
        }
        j += jn;
    }
}

/// Cache lines a tile prefetches, spread over its steps: lines `first..first + lines` from
/// `base` (never dereferenced: formed with `wrapping_add`). The decode batches' tiles here,
/// in `x86_512_bf16` and in the VNNI panel kernel share it.
#[derive(Copy, Clone, Debug)]
pub(super) struct Prefetch {
    pub base: *const i8,
    pub first: usize,
    pub lines: usize,
}

/// Bytes per element of a float weight type code.
pub(super) const fn elem_bytes(w: u8) -> usize {
    if w == F32 {
        4
    } else {
        2
    }
}

/// One `R × J` tile of [`gemm_nt_rows`]: rows `x[r·k..]` (r < R) against weight rows `jj`
/// (jj < J, `k` elements of type `W` each), output at `out[r·ldo + jj]`.
///
/// # Safety
/// AVX-512F/F16C available; `x` readable for `R·k` f32s, `w` for `J·k` elements, `out`
/// writable at `r·ldo + jj`.
#[inline(always)]
unsafe fn nt_tile<const W: u8, const J: usize, const R: usize>(
    x: *const f32,
    w: *const u8,
    k: usize,
    out: *mut f32,
    ldo: usize,
    pf: Prefetch,
) {
    // Lines per 16-wide step (the last steps fewer: none past the tile's share).
    let per = pf.lines.div_ceil((k / 16).max(1));
    // SAFETY: every load reads elements `< k` of one of the R + J rows (`p + 16 ≤ k`,
    // `p + 8 ≤ k`, scalar `q < k`); stores hit the R × J outputs; the tile is viewed as
    // `[[__m512; 4]; 4]` only where `J = R = 4` (the same type); prefetches are hints
    // (addresses formed with `wrapping_add`, never dereferenced).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; J];
        let mut p = 0;
        let mut line = pf.first;
        let end = pf.first + pf.lines;
        while p + 16 <= k {
            for _ in 0..per {
                if line < end {
                    _mm_prefetch::<_MM_HINT_T0>(pf.base.wrapping_add(64 * line));
                    line += 1;
                }
            }
            let mut wv = [_mm512_setzero_ps(); J];
            for jj in 0..J {
                wv[jj] = load16::<W>(w, jj * k + p);
            }
            for r in 0..R {
                let xv = _mm512_loadu_ps(x.add(r * k + p));
                for jj in 0..J {
                    acc[jj][r] = _mm512_fmadd_ps(xv, wv[jj], acc[jj][r]);
                }
            }
            p += 16;
        }
        if p + 8 <= k {
            // The AVX2 kernel's single 8-wide step, into lanes 0–7 only.
            const LOW: __mmask16 = 0x00FF;
            for jj in 0..J {
                let wv = load8::<W>(w, jj * k + p);
                for r in 0..R {
                    let xv = _mm512_maskz_loadu_ps(LOW, x.add(r * k + p));
                    acc[jj][r] = _mm512_mask3_fmadd_ps(xv, wv, acc[jj][r], LOW);
                }
            }
            p += 8;
        }
        if J == 4 && R == 4 && p == k {
            // A whole tile and no scalar tail: the 16 lane sums at once (bit for bit
            // `finish`'s), row `r`'s four outputs in lanes `4r..4r + 4`.
            let a: &[[__m512; 4]; 4] = &*(&acc as *const [[__m512; R]; J]).cast();
            let s = super::x86_512_finish::finish_4x4(a);
            let mut v = [0.0f32; 16];
            _mm512_storeu_ps(v.as_mut_ptr(), s);
            for r in 0..4 {
                std::ptr::copy_nonoverlapping(v.as_ptr().add(4 * r), out.add(r * ldo), 4);
            }
            return;
        }
        for jj in 0..J {
            for r in 0..R {
                let mut t = finish(acc[jj][r]);
                for q in p..k {
                    t += *x.add(r * k + q) * w_at::<W>(w, jj * k + q);
                }
                *out.add(r * ldo + jj) = t;
            }
        }
    }
}
