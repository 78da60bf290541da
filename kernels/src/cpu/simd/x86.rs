//! AVX2 + FMA + F16C decode kernels (x86-64). An [`Avx2`] token exists only once the features
//! were detected, so calling the `#[target_feature]` functions through it is sound; each safe
//! method asserts the lengths its raw loop relies on.
//!
//! Every kernel takes up to [`MR`] activation rows against one weight row (the weight is
//! loaded and widened or unpacked once for all of them), and sums each row in the same order
//! whatever the number of rows, so a sequence's result does not depend on its batch.
// Register tiles are indexed `acc[r][..]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::x86_512::Avx512;
use super::{Q8Block, Q8_BLOCK};
use crate::cpu::quant::WeightFormat;

/// Activation rows per kernel call (4 rows × 2 accumulators + 2 weight vectors + a load).
pub(super) const MR: usize = 4;

/// Weight element types (const generic codes, shared with the AVX-512 kernels).
pub(super) const F32: u8 = 0;
pub(super) const F16: u8 = 1;
pub(super) const BF16: u8 = 2;
/// Quantised weight formats (const generic codes).
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;

/// Proof that this CPU has AVX2, FMA and F16C.
#[derive(Copy, Clone, Debug)]
pub(super) struct Avx2 {
    _detected: (),
}

/// Calls `tile::<R>(row0, rows)` over `m` rows in tiles of `MR` (then the remainder).
macro_rules! tiled {
    ($m:expr, |$r0:ident, $mr:ident| $body:expr) => {{
        let mut $r0 = 0;
        while $r0 < $m {
            let left = $m - $r0;
            match left.min(MR) {
                4 => {
                    const $mr: usize = 4;
                    $body
                }
                3 => {
                    const $mr: usize = 3;
                    $body
                }
                2 => {
                    const $mr: usize = 2;
                    $body
                }
                _ => {
                    const $mr: usize = 1;
                    $body
                }
            }
            $r0 += left.min(MR);
        }
    }};
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

    /// `out[r] = x[r]·w` for the `out.len()` rows of `x` (each `w.len()` long); `W` is the
    /// weight element type, `w` its raw bytes.
    #[inline]
    fn float_rows<const W: u8>(self, x: &[f32], w: &[u8], n: usize, out: &mut [f32]) {
        let m = out.len();
        assert_eq!(x.len(), m * n, "dot rows: x is not [{m}, {n}]");
        let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        tiled!(m, |r0, R| {
            // SAFETY: `self` proves the features; rows `r0..r0 + R ≤ m` of `x` (`n` f32s
            // each, stride `n`), the `n` weight elements and `out[r0..r0 + R]` are in bounds.
            unsafe { float_tile::<W, R>(xp.add(r0 * n), n, wp, n, op.add(r0)) }
        });
    }

    pub(super) fn dot_rows_f32(self, x: &[f32], w: &[f32], out: &mut [f32]) {
        // SAFETY: an f32 slice is readable as its bytes.
        let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 4) };
        self.float_rows::<F32>(x, bytes, w.len(), out)
    }

    pub(super) fn dot_rows_f16(self, x: &[f32], w: &[f16], out: &mut [f32]) {
        // SAFETY: `f16` is two plain bytes.
        let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 2) };
        self.float_rows::<F16>(x, bytes, w.len(), out)
    }

    pub(super) fn dot_rows_bf16(self, x: &[f32], w: &[bf16], out: &mut [f32]) {
        // SAFETY: `bf16` is two plain bytes.
        let bytes = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), w.len() * 2) };
        self.float_rows::<BF16>(x, bytes, w.len(), out)
    }

    /// `out[r] = w·x[r]` for one weight row `w` (`kb` blocks of `format`) and `out.len()`
    /// activation rows of `kb` blocks each.
    pub(super) fn dot_rows_q8(
        self,
        format: WeightFormat,
        w: &[u8],
        x: &[Q8Block],
        out: &mut [f32],
    ) {
        let m = out.len();
        let kb = w.len() / format.block_bytes();
        assert_eq!(
            w.len(),
            kb * format.block_bytes(),
            "dot_q8: partial weight block"
        );
        assert_eq!(x.len(), m * kb, "dot_q8: x is not [{m}, {kb}] blocks");
        let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        tiled!(m, |r0, R| {
            // SAFETY: `self` proves the features; the weight row holds `kb` blocks, rows
            // `r0..r0 + R ≤ m` of `x` hold `kb` blocks each, and `out[r0..r0 + R]` exists.
            unsafe {
                let (x, o) = (xp.add(r0 * kb), op.add(r0));
                match format {
                    WeightFormat::Q8_0 => q8_tile::<Q8_0, R>(wp, kb, x, o),
                    WeightFormat::Q4_0 => q8_tile::<Q4_0, R>(wp, kb, x, o),
                    WeightFormat::Q4_1 => q8_tile::<Q4_1, R>(wp, kb, x, o),
                    f => unreachable!("dot_q8 checked the format, got {}", f.name()),
                }
            }
        });
    }
}

impl Avx2 {
    /// `out[i·ldo + j] = w_j·x_i` for the `n` weight rows `w_j` (`kb` blocks of `format`
    /// each, packed) and the `m = x.len() / kb` activation rows `x_i`: one call for a whole
    /// product, each weight row unpacked once for every activation row, each result summed
    /// exactly as [`Avx2::dot_rows_q8`] sums it.
    pub(super) fn gemv_q8(
        self,
        format: WeightFormat,
        w: &[u8],
        n: usize,
        x: &[Q8Block],
        out: &mut [f32],
        ldo: usize,
    ) {
        let (kb, m) = super::gemv_q8_shape(format, w, n, x, out, ldo);
        if kb == 0 || m == 0 || n == 0 {
            return;
        }
        let (w, x, o) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr());
        // SAFETY: `self` proves the features; `gemv_q8_shape` checked that `w` holds `n` rows
        // of `kb` blocks, `x` `m` rows of `kb` blocks and `out` every `i·ldo + j`.
        unsafe {
            match format {
                WeightFormat::Q8_0 => gemv_q8_rows::<Q8_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_0 => gemv_q8_rows::<Q4_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_1 => gemv_q8_rows::<Q4_1>(w, n, kb, x, m, o, ldo),
                f => unreachable!("gemv_q8 checked the format, got {}", f.name()),
            }
        }
    }

    /// [`super::gemv_quant_f32`] (arguments checked there): `n` weight rows of `kb` blocks,
    /// `m` activation rows of `kb·32` f32s. One activation row (decode) takes two weight rows
    /// at a time, so their accumulator chains overlap.
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
        if let Some(z) = Avx512::enabled() {
            return z.gemv_quant_f32(format, w, n, kb, x, m, out, ldo);
        }
        self.gemv_quant_f32_ymm(format, w, n, kb, x, m, out, ldo)
    }

    /// [`Avx2::gemv_quant_f32`] with the 8-lane kernel only (what the AVX-512 kernel must
    /// equal bit for bit).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv_quant_f32_ymm(
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
                WeightFormat::Q8_0 => gemv_quant_rows::<Q8_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_0 => gemv_quant_rows::<Q4_0>(w, n, kb, x, m, o, ldo),
                WeightFormat::Q4_1 => gemv_quant_rows::<Q4_1>(w, n, kb, x, m, o, ldo),
                f => unreachable!("gemv_quant_f32 checked the format, got {}", f.name()),
            }
        }
    }

    /// Dequantises whole blocks of `format` (Q8_0/Q4_0/Q4_1) into `out`, bit-identical to
    /// the scalar `dequantize_block` (see [`dequant_block`]).
    pub(super) fn dequantize_row(self, format: WeightFormat, w: &[u8], out: &mut [f32]) {
        if let Some(z) = Avx512::enabled() {
            return z.dequantize_row(format, w, out);
        }
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

    /// [`super::quantize_q8`] with AVX2: the same operations in the same order per element
    /// (max of |x| is order-free, `x·(1/d)` rounded to nearest-even, exact integer sum), so
    /// the blocks are bit-identical to the portable ones.
    pub(super) fn quantize_q8(self, x: &[f32], out: &mut [Q8Block]) {
        assert_eq!(x.len(), out.len() * Q8_BLOCK, "quantize_q8: lengths");
        for (v, b) in x.chunks_exact(Q8_BLOCK).zip(out.iter_mut()) {
            // SAFETY: `self` proves the features; `v` holds 32 f32s.
            unsafe { quantize_block(v.as_ptr(), b) }
        }
    }
}

/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `n` rows of `kb` blocks of `FMT`, `x` for `m`
/// rows of `kb` blocks, `out` writable at `i·ldo + j` for `i < m`, `j < n`.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_q8_rows<const FMT: u8>(
    w: *const u8,
    n: usize,
    kb: usize,
    x: *const Q8Block,
    m: usize,
    out: *mut f32,
    ldo: usize,
) {
    let rb = kb
        * match FMT {
            Q8_0 => 34,
            Q4_0 => 18,
            _ => 20,
        };
    let mut col = [0.0f32; MR];
    for j in 0..n {
        // SAFETY: row `j < n` of `w`, rows `r0..r0 + R ≤ m` of `x`, and the outputs
        // `i·ldo + j` are inside the caller's guarantee.
        unsafe {
            let wj = w.add(j * rb);
            tiled!(m, |r0, R| {
                q8_tile::<FMT, R>(wj, kb, x.add(r0 * kb), col.as_mut_ptr());
                for r in 0..R {
                    *out.add((r0 + r) * ldo + j) = col[r];
                }
            });
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

/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `n` rows of `kb` blocks of `FMT`, `x` for `m`
/// rows of `kb·32` f32s, `out` writable at `i·ldo + j` for `i < m`, `j < n`.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_quant_rows<const FMT: u8>(
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
            while j + 2 <= n {
                quant_tile::<FMT, 2, 1>(w.add(j * rb), rb, kb, x, k, out.add(j), ldo);
                j += 2;
            }
        }
        while j < n {
            let wj = w.add(j * rb);
            tiled!(m, |r0, R| {
                quant_tile::<FMT, 1, R>(wj, rb, kb, x.add(r0 * k), k, out.add(r0 * ldo + j), ldo);
            });
            j += 1;
        }
    }
}

/// # Safety
/// AVX2/F16C available; `w` readable for `kb` blocks of `FMT`, `out` writable for `32·kb` f32s.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_rows<const FMT: u8>(w: *const u8, kb: usize, out: *mut f32) {
    for b in 0..kb {
        // SAFETY: block `b < kb` and values `32b..32b + 32` are inside the caller's guarantee.
        unsafe {
            let v = dequant_block::<FMT>(w.add(b * block_bytes(FMT)));
            for (g, vg) in v.iter().enumerate() {
                _mm256_storeu_ps(out.add(b * Q8_BLOCK + 8 * g), *vg);
            }
        }
    }
}

/// Block `wb` of format `FMT` as f32, elements `8g..8g + 8` in `[g]`, computed with the
/// operations of `quant::blocks::dequantize_block` (`d·q` then `+ m`, each rounded; f16
/// scales widen exactly), so the values are bit-identical.
///
/// # Safety
/// AVX2/F16C available; `wb` readable for one block of `FMT`.
#[inline(always)]
unsafe fn dequant_block<const FMT: u8>(wb: *const u8) -> [__m256; 4] {
    // SAFETY: every load stays inside the block (codes at byte 2 or 4, 16 or 32 bytes).
    unsafe {
        let (d, m) = f16_pair(wb);
        let d = _mm256_set1_ps(d);
        let mut v = [_mm256_setzero_ps(); 4];
        if FMT == Q8_0 {
            for (g, vg) in v.iter_mut().enumerate() {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(wb.add(2 + 8 * g).cast()));
                *vg = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
            }
            return v;
        }
        // Byte `b` holds value `b` (low nibble) and value `b + 16` (high nibble).
        let off = if FMT == Q4_0 { 2 } else { 4 };
        let low = _mm256_set1_epi32(0xF);
        let e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(off).cast()));
        let e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(off + 8).cast()));
        let q = [
            _mm256_and_si256(e0, low),
            _mm256_and_si256(e1, low),
            _mm256_srli_epi32(e0, 4),
            _mm256_srli_epi32(e1, 4),
        ];
        let (eight, m) = (_mm256_set1_epi32(8), _mm256_set1_ps(m));
        for (vg, qg) in v.iter_mut().zip(q) {
            *vg = if FMT == Q4_0 {
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(qg, eight)))
            } else {
                _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(qg)), m)
            };
        }
        v
    }
}

/// `out[r·ldo + jj] = w_jj·x[r]` for `jj < J` weight rows (stride `rb` bytes, `kb` blocks)
/// and `r < R` activation rows (stride `ldx`): each block dequantised once, then per row
/// [`float_tile`]'s order (accumulator 0 for elements `16c..16c + 8`, 1 for the next 8, the
/// pairwise lane sum; no tail, rows are whole blocks).
///
/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `J` rows of `kb` blocks at stride `rb`, `x` for
/// `R` rows of `32·kb` f32s at stride `ldx`, `out` writable at `r·ldo + jj`.
#[inline(always)]
unsafe fn quant_tile<const FMT: u8, const J: usize, const R: usize>(
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
        let mut acc = [[[_mm256_setzero_ps(); 2]; R]; J];
        for b in 0..kb {
            for jj in 0..J {
                let v = dequant_block::<FMT>(w.add(jj * rb + b * block_bytes(FMT)));
                for r in 0..R {
                    let xb = x.add(r * ldx + b * Q8_BLOCK);
                    let a = &mut acc[jj][r];
                    for g in 0..4 {
                        a[g & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb.add(8 * g)), v[g], a[g & 1]);
                    }
                }
            }
        }
        for jj in 0..J {
            for r in 0..R {
                *out.add(r * ldo + jj) = hsum(_mm256_add_ps(acc[jj][r][0], acc[jj][r][1]));
            }
        }
    }
}

/// One block of [`Avx2::quantize_q8`].
///
/// # Safety
/// AVX2 available; `v` readable for 32 f32s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block(v: *const f32, b: &mut Q8Block) {
    // SAFETY: four 8-lane loads cover the 32 readable values; the store writes the 32
    // bytes of `b.qs`.
    unsafe {
        let x = [
            _mm256_loadu_ps(v),
            _mm256_loadu_ps(v.add(8)),
            _mm256_loadu_ps(v.add(16)),
            _mm256_loadu_ps(v.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let mut amax = _mm256_andnot_ps(sign, x[0]);
        for xi in &x[1..] {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, *xi));
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_movehdup_ps(h));
        let d = _mm_cvtss_f32(h) / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let q = x.map(|xi| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(xi, id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), packed);
        b.d = d;
        b.s = d * _mm_cvtsi128_si32(s) as f32;
    }
}

/// Lane sum of `v`, pairwise: lanes `l + 4`, then `l + 2`, then `l + 1` (the portable
/// kernels' reduction order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Eight weight elements at element `i` of `w`, widened to f32.
///
/// # Safety
/// AVX2/F16C available; elements `i..i + 8` of `w` (type `W`) readable.
#[inline(always)]
pub(super) unsafe fn load_w<const W: u8>(w: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees the 8 elements; the intrinsics need AVX2/F16C, which
    // every caller (a `#[target_feature]` kernel) has.
    unsafe {
        match W {
            F32 => _mm256_loadu_ps(w.cast::<f32>().add(i)),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.cast::<u16>().add(i).cast())),
            _ => {
                let h = _mm_loadu_si128(w.cast::<u16>().add(i).cast());
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            }
        }
    }
}

/// Weight element `i` as f32.
///
/// # Safety
/// Element `i` of `w` (type `W`) readable.
#[inline(always)]
pub(super) unsafe fn w_at<const W: u8>(w: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees element `i`.
    unsafe {
        match W {
            F32 => w.cast::<f32>().add(i).read_unaligned(),
            F16 => f16::from_bits(w.cast::<u16>().add(i).read_unaligned()).to_f32(),
            _ => bf16::from_bits(w.cast::<u16>().add(i).read_unaligned()).to_f32(),
        }
    }
}

/// `out[r] = Σ_p x[r·ldx + p]·w[p]` for `r < R`, `p < n`: two 8-lane accumulators per row
/// (elements `16c..16c+8` and `16c+8..16c+16`), one more 8-wide step, the pairwise lane
/// sum, then the scalar tail.
///
/// # Safety
/// AVX2/FMA/F16C available; `x` readable for `R` rows of `n` f32s at stride `ldx`, `w` for
/// `n` elements of type `W`, `out` writable for `R` f32s.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_tile<const W: u8, const R: usize>(
    x: *const f32,
    ldx: usize,
    w: *const u8,
    n: usize,
    out: *mut f32,
) {
    // SAFETY: loads read elements `< n` of each row (`i + 16 ≤ n`, `i + 8 ≤ n`, `p < n`) and
    // stores hit `out[..R]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut i = 0;
        while i + 16 <= n {
            let (w0, w1) = (load_w::<W>(w, i), load_w::<W>(w, i + 8));
            for r in 0..R {
                let xr = x.add(r * ldx + i);
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8)), w1, acc[r][1]);
            }
            i += 16;
        }
        if i + 8 <= n {
            let w0 = load_w::<W>(w, i);
            for r in 0..R {
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(r * ldx + i)), w0, acc[r][0]);
            }
            i += 8;
        }
        for r in 0..R {
            let mut t = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
            for p in i..n {
                t += *x.add(r * ldx + p) * w_at::<W>(w, p);
            }
            *out.add(r) = t;
        }
    }
}

/// The two f16 values at `p` (a block's scale and, for Q4_1, its minimum), widened with
/// F16C (exact, as every f16 → f32 conversion is).
///
/// # Safety
/// F16C available; `p` readable for 4 bytes (every Q8_0/Q4_0/Q4_1 block is longer).
#[inline(always)]
unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    // SAFETY: the caller guarantees 4 readable bytes and F16C.
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

/// `out[r] = w·x[r]` for `r < R`: per weight block, its 32 codes are unpacked once
/// (`Q8_0`: i8; `Q4_0`: nibble − 8; `Q4_1`: nibble, plus `m·s_x`), dotted as integers with
/// each row's Q8 block (8 i32 lanes), scaled by `d_w·d_x` into one of two accumulators per
/// row (even and odd blocks).
///
/// Integer ranges: activations are in [-127, 127] (negating them never overflows) and
/// `|w| ≤ 128`, so each maddubs pair sum is at most 2·128·127 < 2¹⁵.
///
/// # Safety
/// AVX2/FMA/F16C available; `w` readable for `kb` blocks of format `FMT`, `x` for `R` rows
/// of `kb` blocks (row stride `kb`), `out` writable for `R` f32s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_tile<const FMT: u8, const R: usize>(
    w: *const u8,
    kb: usize,
    x: *const Q8Block,
    out: *mut f32,
) {
    let (bb, off) = match FMT {
        Q8_0 => (34, 2),
        Q4_0 => (18, 2),
        _ => (20, 4),
    };
    let low = _mm_set1_epi8(0xF);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: block `b < kb` reads bytes `[bb·b, bb·b + bb)` of `w` and `x[r·kb + b]` for
    // `r < R`; stores hit `out[..R]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut mins = [0.0f32; R];
        for b in 0..kb {
            let wb = w.add(bb * b);
            let q = if FMT == Q8_0 {
                _mm256_loadu_si256(wb.add(off).cast())
            } else {
                // Low nibbles are values 0..16, high nibbles 16..32 (ggml's layout).
                let packed = _mm_loadu_si128(wb.add(off).cast());
                let lo = _mm_and_si128(packed, low);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
                let q = _mm256_set_m128i(hi, lo);
                if FMT == Q4_0 {
                    _mm256_sub_epi8(q, _mm256_set1_epi8(8))
                } else {
                    q
                }
            };
            // Signed codes: |w| once, its sign moved onto each activation row.
            let aw = _mm256_abs_epi8(q);
            let (d, m) = f16_pair(wb);
            for r in 0..R {
                let xb = &*x.add(r * kb + b);
                let xq = _mm256_loadu_si256(xb.qs.as_ptr().cast());
                let pairs = if FMT == Q4_1 {
                    // Unsigned nibbles × signed activations directly (≤ 2·15·127).
                    _mm256_maddubs_epi16(q, xq)
                } else {
                    _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, q))
                };
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                let a = &mut acc[r][b & 1];
                *a = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), s, *a);
                if FMT == Q4_1 {
                    mins[r] += m * xb.s;
                }
            }
        }
        for r in 0..R {
            *out.add(r) = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + mins[r];
        }
    }
}

// The kernels load one 32-byte vector of activations per block.
const _: () = assert!(Q8_BLOCK == 32);

/// 8 × 8 transpose of f32 lanes: lane `i` of `out[k]` is lane `k` of `r[i]` (unpack, shuffle,
/// then 128-bit permutes: 24 shuffles). Data movement only, so any caller's bits are unchanged.
///
/// # Safety
/// Safe to call from code compiled with AVX; elsewhere (an `unsafe` call) the CPU must have
/// AVX, as [`super::simd_level`]'s `Avx2` proves.
#[inline]
#[target_feature(enable = "avx")]
pub fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
