//! One activation row (a decode step at batch 1) on AVX512-VNNI, without the panel pack: the
//! packed kernel (`x86_512_vnni`) transposes every weight row into its panel once per call,
//! which a batch shares but one row pays alone (1.15–1.26× slower than the f32-activation
//! kernel on SmolLM2's 576-wide Q8_0 projections, `benches/results/cpu-precisions.md`).
//! Here each weight block is read in place and dotted with the activation block directly:
//! eight weight rows at a time, one 8-lane integer dot (`vpdpbusd`, 256 bits) per row and
//! block, the eight partial vectors reduced to one vector of eight exact block sums (lane =
//! weight row), then the f32 steps run eight rows wide.
//!
//! Bit for bit the packed kernel's result: the block sums are exact integers whichever way
//! they are added, and per output the f32 steps are the packed kernel's, in the same block
//! order from zero — `acc = fma(f32(Σ q·w) · d_x, d_w, acc)`, then for Q4_K/Q4_1
//! `acc = acc − m_w · s_x` (fused), with `d_w`, `m_w` rounded as its pack rounds them — so a
//! row's result does not depend on whether it came alone or in a batch (`tests_vnni.rs`).
//!
//! The activation codes stay signed here (`q ∈ [−127, 127]`, [`super::quantize_q8`]). Q8_0's
//! signed weight codes go in as `|w|` (unsigned) against `sign(w)·q` (`vpsignb`), exact for
//! every code including −128 (whose magnitude 128 is a valid unsigned byte) because `q` is
//! never −128; Q4_K/Q4_1 codes `0..15` are unsigned as they are.
// Lanes are indexed `v[r]` in step with row pointers.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::Q8Block;

/// Weight rows per group: the eight lanes of one 256-bit vector.
const G: usize = 8;
/// Bytes per Q8_0, Q4_1 and Q4_K block.
const Q8_0_BYTES: usize = 34;
const Q4_1_BYTES: usize = 20;
const Q4_K_BYTES: usize = 144;

/// Weight formats (the packed kernel's const generic codes).
pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_K: u8 = 1;
pub(super) const Q4_1: u8 = 2;

/// `out[j] = q8(x)·w_j` for the `n` weight rows at `w` (`rb` bytes each, format `F`) and
/// one activation row `x` quantised to `kb` signed blocks.
///
/// # Safety
/// AVX512-VNNI/VL/BW/F, AVX2, FMA and F16C available; `w` readable for `n` rows of `rb`
/// bytes, each `kb` whole 32-value blocks of `F` (Q4_K: `kb / 8` super-blocks); `x` readable
/// for `kb` blocks with codes in `−127..=127`; `out` writable for `n` values;
/// `n, kb > 0` and `8·rb ≤ i32::MAX` (gather offsets).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn row_product<const F: u8>(
    w: *const u8,
    rb: usize,
    n: usize,
    x: *const Q8Block,
    kb: usize,
    out: *mut f32,
) {
    let mut j0 = 0;
    while j0 < n {
        let nr = (n - j0).min(G);
        // Lanes past the last row repeat it (read, computed, never stored).
        let lane = |r: usize| r.min(nr - 1);
        let off = |r: usize| (lane(r) * rb) as i32;
        let idx = _mm256_setr_epi32(
            off(0),
            off(1),
            off(2),
            off(3),
            off(4),
            off(5),
            off(6),
            off(7),
        );
        // SAFETY: rows `j0..j0 + nr ≤ n` (lanes repeat row `j0 + nr − 1`), the caller's
        // guarantee; `out` at `j0..j0 + nr`.
        unsafe {
            let w0 = w.add(j0 * rb);
            let rows: [*const u8; G] = std::array::from_fn(|r| w0.add(lane(r) * rb));
            let acc = match F {
                Q8_0 => group_q8_0(w0, rows, idx, x, kb),
                Q4_1 => group_q4_1(w0, rows, idx, x, kb),
                _ => group_q4_k(w0, rows, idx, x, kb),
            };
            _mm256_mask_storeu_ps(out.add(j0), (1u16 << nr).wrapping_sub(1) as u8, acc);
        }
        j0 += nr;
    }
}

/// Lane `r` = the sum of `v[r]`'s eight lanes (exact: integer adds in any order).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn reduce8(v: [__m256i; G]) -> __m256i {
    {
        // [r a, r' a, r b, r' b | r c, r' c, r d, r' d] for pairs (r, r').
        let pair = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
        };
        let quad = |a: __m256i, b: __m256i| {
            _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
        };
        let lo = quad(pair(v[0], v[1]), pair(v[2], v[3]));
        let hi = quad(pair(v[4], v[5]), pair(v[6], v[7]));
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(lo, hi),
            _mm256_permute2x128_si256::<0x31>(lo, hi),
        )
    }
}

/// The eight f16 values in the low (`HI` false) or high halves of `g`'s 32-bit lanes, as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn halves<const HI: bool>(g: __m256i) -> __m256 {
    {
        let g = if HI { _mm256_srli_epi32::<16>(g) } else { g };
        _mm256_cvtph_ps(_mm256_cvtepi32_epi16(g))
    }
}

/// One f32 step of eight outputs for a block: `acc = fma(f32(isum)·d_x, d_w, acc)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn step(acc: __m256, isum: __m256i, xb: &Q8Block, dw: __m256) -> __m256 {
    {
        let p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(xb.d));
        _mm256_fmadd_ps(p, dw, acc)
    }
}

/// Eight Q8_0 rows (`rows`, lanes as `idx` offsets from `w0`) × `x`.
///
/// # Safety
/// As [`row_product`], for the group's rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_q8_0(
    w0: *const u8,
    rows: [*const u8; G],
    idx: __m256i,
    x: *const Q8Block,
    kb: usize,
) -> __m256 {
    // SAFETY: block `b < kb` of each row (codes at bytes 2..34, scale at 0..2, the gather's
    // 4 bytes inside the block), activation block `b`.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for b in 0..kb {
            let xb = &*x.add(b);
            let xv = _mm256_loadu_si256(xb.qs.as_ptr().cast());
            let mut v = [_mm256_setzero_si256(); G];
            for r in 0..G {
                let wv = _mm256_loadu_si256(rows[r].add(b * Q8_0_BYTES + 2).cast());
                v[r] = _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    _mm256_abs_epi8(wv),
                    _mm256_sign_epi8(xv, wv),
                );
            }
            let g = _mm256_i32gather_epi32::<1>(w0.add(b * Q8_0_BYTES).cast(), idx);
            acc = step(acc, reduce8(v), xb, halves::<false>(g));
        }
        acc
    }
}

/// Eight Q4_1 rows × `x`: codes `0..15` (low nibbles values 0..16, high 16..32), scale `d`
/// and minimum `−m` as the pack takes them.
///
/// # Safety
/// As [`row_product`], for the group's rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_q4_1(
    w0: *const u8,
    rows: [*const u8; G],
    idx: __m256i,
    x: *const Q8Block,
    kb: usize,
) -> __m256 {
    // SAFETY: block `b < kb` of each row (codes at bytes 4..20, `d` and `m` at 0..4),
    // activation block `b`.
    unsafe {
        let low = _mm_set1_epi8(0xF);
        let mut acc = _mm256_setzero_ps();
        for b in 0..kb {
            let xb = &*x.add(b);
            let xv = _mm256_loadu_si256(xb.qs.as_ptr().cast());
            let mut v = [_mm256_setzero_si256(); G];
            for r in 0..G {
                let c = _mm_loadu_si128(rows[r].add(b * Q4_1_BYTES + 4).cast());
                let lo = _mm_and_si128(c, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(c), low);
                let codes = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
                v[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xv);
            }
            let g = _mm256_i32gather_epi32::<1>(w0.add(b * Q4_1_BYTES).cast(), idx);
            let neg_m = _mm256_sub_ps(_mm256_setzero_ps(), halves::<true>(g));
            acc = step(acc, reduce8(v), xb, halves::<false>(g));
            acc = _mm256_fnmadd_ps(neg_m, _mm256_set1_ps(xb.s), acc);
        }
        acc
    }
}

/// Byte `j` (0..4) of each 32-bit lane of `v`, shifted down by `extra` more bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn bits(v: __m256i, j: usize, extra: u32) -> __m256i {
    _mm256_srlv_epi32(v, _mm256_set1_epi32(8 * j as i32 + extra as i32))
}

/// Eight Q4_K rows × `x`: per 256-value super-block, the eight sub-blocks' `d·sc_j` and
/// `dmin·m_j` for all eight rows (ggml's `get_scale_min_k4`, eight lanes at a time, rounded
/// as the pack rounds them), then four 32-byte chunks of codes, each two sub-blocks (low
/// and high nibbles).
///
/// # Safety
/// As [`row_product`], for the group's rows (`kb` a multiple of 8).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_q4_k(
    w0: *const u8,
    rows: [*const u8; G],
    idx: __m256i,
    x: *const Q8Block,
    kb: usize,
) -> __m256 {
    // SAFETY: super-block `sb < kb / 8` of each row (bytes `144·sb..144·sb + 144`: `d`,
    // `dmin` at 0..4, scales at 4..16, codes at 16..144; every gather's 4 bytes inside),
    // activation blocks `8·sb..8·sb + 8`.
    unsafe {
        let low = _mm256_set1_epi8(0xF);
        let (six, two, four) = (
            _mm256_set1_epi32(63),
            _mm256_set1_epi32(3),
            _mm256_set1_epi32(0xF),
        );
        let mut acc = _mm256_setzero_ps();
        for sb in 0..kb / 8 {
            let base = w0.add(sb * Q4_K_BYTES);
            let gather = |at: usize| _mm256_i32gather_epi32::<1>(base.add(at).cast(), idx);
            let dm = gather(0);
            let (d, dmin) = (halves::<false>(dm), halves::<true>(dm));
            let (q0, q1, q2) = (gather(4), gather(8), gather(12));
            let mut sc = [_mm256_setzero_ps(); 8];
            let mut mn = [_mm256_setzero_ps(); 8];
            for j in 0..8 {
                let (s, m) = if j < 4 {
                    (
                        _mm256_and_si256(bits(q0, j, 0), six),
                        _mm256_and_si256(bits(q1, j, 0), six),
                    )
                } else {
                    let jj = j - 4;
                    let top =
                        |q: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(bits(q, jj, 6), two));
                    (
                        _mm256_or_si256(_mm256_and_si256(bits(q2, jj, 0), four), top(q0)),
                        _mm256_or_si256(_mm256_and_si256(bits(q2, jj, 4), four), top(q1)),
                    )
                };
                sc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s));
                mn[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
            }
            for c in 0..4 {
                let (xa, xb) = (&*x.add(8 * sb + 2 * c), &*x.add(8 * sb + 2 * c + 1));
                let (va, vb) = (
                    _mm256_loadu_si256(xa.qs.as_ptr().cast()),
                    _mm256_loadu_si256(xb.qs.as_ptr().cast()),
                );
                let mut lo = [_mm256_setzero_si256(); G];
                let mut hi = [_mm256_setzero_si256(); G];
                for r in 0..G {
                    let v = _mm256_loadu_si256(rows[r].add(sb * Q4_K_BYTES + 16 + 32 * c).cast());
                    let (l, h) = (
                        _mm256_and_si256(v, low),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                    );
                    lo[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), l, va);
                    hi[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), h, vb);
                }
                acc = step(acc, reduce8(lo), xa, sc[2 * c]);
                acc = _mm256_fnmadd_ps(mn[2 * c], _mm256_set1_ps(xa.s), acc);
                acc = step(acc, reduce8(hi), xb, sc[2 * c + 1]);
                acc = _mm256_fnmadd_ps(mn[2 * c + 1], _mm256_set1_ps(xb.s), acc);
            }
        }
        acc
    }
}
