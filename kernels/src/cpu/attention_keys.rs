//! Attention for a few query rows at once — a decode token's query heads of one kv head (3 for
//! SmolLM2) — on AVX-512F with 16 **keys** in the lanes. The row-lane tile
//! (`attention_tiled.rs`) fills 3 of its 16 lanes at decode and pays for all 16 (scores,
//! softmax); here each block of 16 key rows is transposed once (`[head_dim][16 keys]`, in L1)
//! and every query row scores all 16 keys per instruction, broadcasting its own `q[p]`.
//!
//! **Bits.** As the row-lane tile: each (query row, key) score sits in one lane and repeats
//! the portable path's arithmetic step for step — eight partial dot sums over `p ≡ l (mod 8)`
//! (multiply, then add, from `+0`), added in order from `f32`'s `Sum` start, plus the
//! `d mod 8` tail, times `scale`; keys outside the row's range score `-inf`. Then per row the
//! maximum, `e^(s − max)` (the bits of `cpu::expf::expf`), the sum of the weights in key order
//! from the `Sum` start, and the weighted value rows (the row-lane tile's `weigh_values`). So
//! every output equals the portable path's and the row-lane tile's bit for bit.
// Register tiles are indexed `acc[r][l]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::tiled::{weigh_values, Positions, Weights, MAX_SCORES, SUM_START};
use super::Seq;
use crate::cpu::expf::expf_x16;
use crate::cpu::simd::transpose16;

/// Most query rows one call takes (rows × 8 accumulators stay in registers, three rows at a
/// time); more rows fill the row-lane tile's lanes well enough.
pub(super) const MAX_ROWS: usize = 8;

/// Whether a call of `rows` query rows over `span` keys runs here (`THAW_KEY_LANES=0` sends
/// every call to the row-lane tile, read once; for A/B runs, the bits are the same).
pub(super) fn fits(rows: usize, span: usize) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    rows <= MAX_ROWS
        && rows * span.next_multiple_of(16) <= MAX_SCORES
        && *ON.get_or_init(|| !crate::cpu::switched_off("THAW_KEY_LANES"))
}

/// Scratch floats [`attend`] needs: the transposed key block, the score rows, the sums.
pub(super) fn scratch_len(rows: usize, span: usize, d: usize) -> usize {
    16 * d.next_multiple_of(16) + rows * span.next_multiple_of(16) + rows
}

/// All `tokens` query tokens of `s` against kv head `kvh`, written to `out`.
///
/// # Safety
/// AVX-512F available; `s` was checked by `paged_attention`; `fits(tokens·group, span)`
/// where span runs from the first token's window start to the last token's position;
/// `scratch` holds `scratch_len(tokens·group, span, head_dim)` floats.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn attend(s: &Seq<'_>, kvh: usize, out: &mut [f32], scratch: &mut [f32]) {
    let (d, group, nh, tokens) = (s.layout.head_dim, s.group(), s.n_heads, s.tokens());
    let rows = tokens * group;
    let (pos0, hi) = (s.start_pos, s.start_pos + tokens - 1);
    let lo = s.lo(pos0);
    let span = hi + 1 - lo;
    let sp = span.next_multiple_of(16);
    let (kt, rest) = scratch.split_at_mut(16 * d.next_multiple_of(16));
    let (pt, sums) = rest.split_at_mut(rows * sp);
    let sums = &mut sums[..rows];
    // Row `r` is token `r / group`, head `kvh·group + r % group`.
    let q_at = |r: usize| ((r / group) * nh + kvh * group + r % group) * d;
    // Each row's own key range, relative to `lo` (inclusive).
    let mut range = [(0i32, 0i32); MAX_ROWS];
    for (r, b) in range.iter_mut().enumerate().take(rows) {
        let pos = pos0 + r / group;
        *b = ((s.lo(pos) - lo) as i32, (pos - lo) as i32);
    }
    let kd = kvh * s.layout.head_dim;
    let mut keys = Positions::new(s.table, s.layout, lo);
    let lines = (d * 4).div_ceil(64);
    let mut j0 = 0;
    while j0 < span {
        let nk = (span - j0).min(16);
        let mut rows_at = [std::ptr::null::<f32>(); 16];
        for row in rows_at.iter_mut().take(nk) {
            let off = keys.next_off() + kd;
            *row = s.k[off..][..d].as_ptr();
            // The value row, asked for while the scores are computed, for `weigh_values`
            // after them (to L2: a context's value rows outgrow L1). A decode step reads
            // every key and value row of its context once from memory (2 × 59 MB a step for
            // 16 sequences of 160 positions on SmolLM2's 30 layers); the key rows stream in
            // as the scores ask for them, but `weigh_values` waited on each value row
            // (`examples/decode_attention.rs … cold`: 17.0–18.2 → 14.4–16.5 ms a step; key
            // rows prefetched ahead too measured no gain). A hint: the bits are unchanged.
            let v = s.v.as_ptr().wrapping_add(off);
            for l in 0..lines {
                _mm_prefetch::<_MM_HINT_T1>(v.wrapping_add(16 * l).cast());
            }
        }
        // SAFETY: `rows_at[..nk]` point at `d` floats of key rows in the cache; `kt` holds
        // `16·⌈d/16⌉` rows of 16 floats (`scratch_len`).
        unsafe { transpose_keys(&rows_at, nk, d, kt.as_mut_ptr()) };
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(3);
            let at = Block {
                q: [0, 1, 2].map(|i| s.q.as_ptr().wrapping_add(q_at(r + i.min(n - 1)))),
                kt: kt.as_ptr(),
                d,
                scale: s.scale,
                j0: j0 as i32,
                range: [0, 1, 2].map(|i| range[r + i.min(n - 1)]),
                out: pt[r * sp + j0..].as_mut_ptr(),
                sp,
            };
            // SAFETY: rows `r..r + n ≤ rows` of `q` (each `d` floats), the `d·16` transposed
            // keys, score lanes `j0..j0 + 16 ≤ sp` of rows `r..r + n` of `pt`.
            unsafe {
                match n {
                    1 => block_scores::<1>(&at),
                    2 => block_scores::<2>(&at),
                    _ => block_scores::<3>(&at),
                }
            }
            r += n;
        }
        j0 += 16;
    }
    for r in 0..rows {
        // SAFETY: row `r` of `pt` holds `sp ≥ span` floats (a multiple of 16).
        unsafe { softmax_row(pt[r * sp..].as_mut_ptr(), span) };
    }
    // Each row's weights summed in key order from the `Sum` start, the rows side by side (one
    // dependent add per key and row: the rows overlap their latencies).
    let mut acc = [SUM_START; MAX_ROWS];
    for j in 0..span {
        for r in 0..rows {
            acc[r] += pt[r * sp + j];
        }
    }
    sums.copy_from_slice(&acc[..rows]);
    let w = Weights {
        p: pt.as_ptr(),
        key_stride: 1,
        row_stride: sp,
        sums: &*sums,
    };
    // SAFETY: `pt` holds `rows` rows of `sp ≥ span` weights, `sums` `rows`; the value rows of
    // positions `lo..=hi` are in the cache; `q_at(r)` of every row is a row of `out`.
    unsafe { weigh_values(s, kvh, lo, span, rows, &q_at, &w, out) };
}

/// `kt[p·16 + lane] = key_lane[p]` for `p < d`, lanes `nk..16` zero.
///
/// # Safety
/// AVX-512F available; `rows[..nk]` readable for `d` floats each; `kt` writable for
/// `⌈d/16⌉·16` rows of 16 floats.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn transpose_keys(rows: &[*const f32; 16], nk: usize, d: usize, kt: *mut f32) {
    let mut c = 0;
    while c < d {
        let n = (d - c).min(16);
        let mask = ((1u32 << n) - 1) as __mmask16;
        let mut r = [_mm512_setzero_ps(); 16];
        if nk == 16 {
            for l in 0..16 {
                // SAFETY: elements `c..c + n ≤ d` of key row `l` (masked).
                r[l] = unsafe { _mm512_maskz_loadu_ps(mask, rows[l].add(c)) };
            }
        } else {
            for l in 0..nk {
                // SAFETY: as above.
                r[l] = unsafe { _mm512_maskz_loadu_ps(mask, rows[l].add(c)) };
            }
        }
        let t = transpose16(r);
        for e in 0..16 {
            // SAFETY: `kt` rows `c + e < 16·⌈d/16⌉`.
            unsafe { _mm512_storeu_ps(kt.add((c + e) * 16), t[e]) };
        }
        c += 16;
    }
}

/// Where one block's scores are computed and stored.
struct Block {
    /// Up to three query rows (`d` floats each; unused entries repeat the last row).
    q: [*const f32; 3],
    /// The block's keys transposed: `kt[p·16 + lane]`.
    kt: *const f32,
    d: usize,
    scale: f32,
    /// The block's first key, relative to the tile's first.
    j0: i32,
    /// Each row's key range (relative, inclusive).
    range: [(i32, i32); 3],
    /// Row 0's score lanes `j0..j0 + 16`; row `i` at `+ i·sp`.
    out: *mut f32,
    sp: usize,
}

/// `out[i·sp + lane] = scale · (q_i · k_lane)` (the portable dot, step for step), `-inf` for
/// keys outside row `i`'s range, for `R` rows.
///
/// # Safety
/// AVX-512F available; the pointers of `at` as documented, `R ≤ 3`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_scores<const R: usize>(at: &Block) {
    let d8 = at.d - at.d % 8;
    // SAFETY: reads of `q_i[p]`, `kt[p·16..]` for `p < d`; writes of 16 lanes of each row.
    unsafe {
        let k = |p: usize| _mm512_loadu_ps(at.kt.add(p * 16));
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        let mut c = 0;
        while c < d8 {
            for l in 0..8 {
                let kv = k(c + l);
                for i in 0..R {
                    let qv = _mm512_set1_ps(*at.q[i].add(c + l));
                    acc[i][l] = _mm512_add_ps(acc[i][l], _mm512_mul_ps(qv, kv));
                }
            }
            c += 8;
        }
        let lanes = _mm512_add_epi32(
            _mm512_set1_epi32(at.j0),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let (scale, ninf) = (_mm512_set1_ps(at.scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in 0..R {
            let mut dot = _mm512_set1_ps(SUM_START);
            for l in 0..8 {
                dot = _mm512_add_ps(dot, acc[i][l]);
            }
            let mut tail = _mm512_set1_ps(SUM_START);
            for p in d8..at.d {
                tail = _mm512_add_ps(tail, _mm512_mul_ps(_mm512_set1_ps(*at.q[i].add(p)), k(p)));
            }
            let sv = _mm512_mul_ps(_mm512_add_ps(dot, tail), scale);
            let (a, b) = at.range[i];
            let live = _mm512_cmple_epi32_mask(_mm512_set1_epi32(a), lanes)
                & _mm512_cmple_epi32_mask(lanes, _mm512_set1_epi32(b));
            _mm512_storeu_ps(at.out.add(i * at.sp), _mm512_mask_mov_ps(ninf, live, sv));
        }
    }
}

/// `x ← e^(x − max x)` over one score row (`span` keys, padded with `-inf` to whole vectors).
///
/// # Safety
/// AVX-512F available; `x` readable and writable for `span.next_multiple_of(16)` floats.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_row(x: *mut f32, span: usize) {
    let nv = span.div_ceil(16);
    // SAFETY: vectors `0..nv` of the padded row.
    unsafe {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for v in 0..nv {
            m = _mm512_max_ps(m, _mm512_loadu_ps(x.add(16 * v)));
        }
        let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for v in 0..nv {
            let e = expf_x16(_mm512_sub_ps(_mm512_loadu_ps(x.add(16 * v)), m));
            _mm512_storeu_ps(x.add(16 * v), e);
        }
    }
}
