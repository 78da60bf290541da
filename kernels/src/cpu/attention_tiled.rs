//! Causal GQA attention tiled for AVX-512F: the query rows of up to [`TILE_ROWS`] rows (whole
//! tokens × the query heads of one kv head; a 128-token prompt chunk of SmolLM2 is 8 tiles of
//! 16 tokens × 3 heads) are transposed into `[head_dim][rows]`, so each key row, read once per
//! tile instead of once per token, scores 16 query rows per instruction (`q_r · k_j` as one
//! fused multiply-add chain over `p = 0..head_dim`, broadcasting `k_j[p]`). The scores land as
//! `[keys][rows]`; the softmax runs down each column (16 rows at once, a polynomial `exp`), and
//! the weighted sum of the value rows runs [`PV_ROWS`] query rows × 64 lanes of `head_dim` per
//! pass, again reading each value row once per pass instead of once per token.
//!
//! **Bits per query.** A query's scores, maximum, exponentials, sum and weighted sum are each a
//! sequential chain over its own keys in position order, computed in one SIMD lane that no
//! other query touches, so the result depends only on that query, its position and the cache:
//! not on the tile, the chunk or the thread that ran it (a prefill row and a decode row at the
//! same position agree bit for bit). The keys of a tile span the first row's window start to
//! the last row's position; a row's keys outside its own range get a score of `-inf`, weight
//! exactly `+0`, and add nothing to its sums (the cache rows in that range are positions some
//! row of the tile attends to, so they are written and finite).
//!
//! Against the portable path (`attend_rows`: 8-lane partial dot products, `libm` `exp`,
//! separate multiply and add) results differ in rounding only: a few f32 ulps per score and
//! per weight (`exp` here is Cephes' polynomial, ≤ 2 ulp; `e^x` below `2^-126` is flushed to
//! zero, where the portable path keeps a denormal that cannot move a sum ≥ 1).
// Register tiles are indexed `acc[r][c]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{KvLayout, Seq};
use crate::cpu::simd::{simd_level, SimdLevel};

/// Most query rows per tile: three 16-lane vectors (16 tokens of 3 heads, 12 of 4, …).
const TILE_ROWS: usize = 48;
/// Keys scored per register tile (× up to 3 row vectors = 24 accumulators).
const KEYS: usize = 8;
/// Query rows per register tile of the weighted sum (× 4 vectors of `head_dim` = 24
/// accumulators).
const PV_ROWS: usize = 6;
/// Most floats of one tile's score block (`keys × rows`, 4 MiB): long contexts take fewer
/// tokens per tile rather than a larger scratch.
pub(super) const MAX_SCORES: usize = 1 << 20;

/// Proof that this CPU has AVX-512F and the tiled kernel is switched on.
#[derive(Copy, Clone, Debug)]
pub(super) struct Tiled {
    _detected: (),
}

impl Tiled {
    /// The token when the SIMD level is AVX2 (not forced to portable), the CPU has AVX-512F
    /// and neither `THAW_AVX512=0` nor `THAW_TILED_ATTENTION=0` is set (read once).
    pub(super) fn enabled() -> Option<Self> {
        static ON: OnceLock<bool> = OnceLock::new();
        let on = *ON.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && !crate::cpu::switched_off("THAW_AVX512")
                && !crate::cpu::switched_off("THAW_TILED_ATTENTION")
        });
        (on && simd_level() == SimdLevel::Avx2).then_some(Self { _detected: () })
    }

    /// [`super::paged_attention`] over the checked `s` (see the module note).
    pub(super) fn attend(self, s: &Seq<'_>, out: &mut [f32], scratch: &mut Vec<f32>) {
        let (d, group, tokens) = (s.layout.head_dim, s.group(), s.tokens());
        assert_eq!(out.len(), s.q.len(), "attention: out and q differ");
        let end = s.start_pos + tokens;
        let tq = tile_tokens(group, tokens, end, s.window);
        let rp = rows_pad(tq * group);
        let need = rp * (d + tile_span(tq, end, s.window) + 1);
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        for kvh in 0..s.layout.num_kv_heads {
            let mut t0 = 0;
            while t0 < tokens {
                let nt = tq.min(tokens - t0);
                // SAFETY: `self` proves AVX-512F; `scratch` holds `rp·(d + span + 1)` floats
                // for this tile's `rows_pad(nt·group) ≤ rp` and span ≤ `span_of(tq)`; the
                // cache holds positions `0..end` (checked by the caller, with the block
                // table), and `out` has `q`'s shape.
                unsafe { tile(s, kvh, t0, nt, out, scratch) };
                t0 += nt;
            }
        }
    }
}

/// Tokens per tile for `group` query heads per kv head and a call of `tokens` tokens ending at
/// position `end`: [`TILE_ROWS`] rows, fewer where the score block (rows × keys) would pass
/// [`MAX_SCORES`], at least 1.
pub(super) fn tile_tokens(group: usize, tokens: usize, end: usize, window: Option<usize>) -> usize {
    let mut tq = (TILE_ROWS / group).clamp(1, tokens.max(1));
    while tq > 1 && rows_pad(tq * group) * tile_span(tq, end, window) > MAX_SCORES {
        tq -= 1;
    }
    tq
}

/// Most keys a tile of `tq` tokens can span: the whole context up to `end`, or the window plus
/// the tile's own extra positions.
fn tile_span(tq: usize, end: usize, window: Option<usize>) -> usize {
    window.map_or(end, |w| (w + tq - 1).min(end))
}

/// Rows rounded up to whole 16-lane vectors.
pub(super) fn rows_pad(rows: usize) -> usize {
    rows.next_multiple_of(16)
}

/// Walks the cache offsets of positions `lo..` in order, one block-table lookup per block.
struct Positions<'a> {
    table: &'a [u32],
    layout: KvLayout,
    pos: usize,
    off: usize,
}

impl<'a> Positions<'a> {
    fn new(table: &'a [u32], layout: KvLayout, lo: usize) -> Self {
        let mut p = Self {
            table,
            layout,
            pos: lo,
            off: 0,
        };
        p.seek();
        p
    }

    fn seek(&mut self) {
        let bs = self.layout.block_size;
        self.off =
            (self.table[self.pos / bs] as usize * bs + self.pos % bs) * self.layout.token_len();
    }

    /// The offset of the current position's `[num_kv_heads, head_dim]` row; moves on.
    #[inline]
    fn next_off(&mut self) -> usize {
        let off = self.off;
        self.pos += 1;
        if self.pos.is_multiple_of(self.layout.block_size) {
            // The next block (its table entry exists while `pos` is inside the context).
            if self.pos / self.layout.block_size < self.table.len() {
                self.seek();
            }
        } else {
            self.off += self.layout.token_len();
        }
        off
    }
}

/// One tile: tokens `t0..t0 + nt` of `s` against kv head `kvh`, written to `out`.
///
/// # Safety
/// AVX-512F available; `scratch` holds `rows_pad(nt·group)·(head_dim + span + 1)` floats where
/// span is the tile's key count; `s` was checked by [`super::paged_attention`].
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile(
    s: &Seq<'_>,
    kvh: usize,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let (d, group, nh) = (s.layout.head_dim, s.group(), s.n_heads);
    let rows = nt * group;
    let rp = rows_pad(rows);
    let (pos0, hi) = (s.start_pos + t0, s.start_pos + t0 + nt - 1);
    let lo = s.lo(pos0);
    let span = hi + 1 - lo;
    let (qt, rest) = scratch.split_at_mut(d * rp);
    let (pt, sums) = rest.split_at_mut(span * rp);
    let sums = &mut sums[..rp];
    // Row `r` is token `t0 + r / group`, head `kvh·group + r % group`.
    let q_at = |r: usize| ((t0 + r / group) * nh + kvh * group + r % group) * d;
    // The query rows, transposed: `qt[p·rp + r]`, padding rows zero.
    for r in 0..rp {
        if r < rows {
            let q = &s.q[q_at(r)..q_at(r) + d];
            for p in 0..d {
                qt[p * rp + r] = q[p];
            }
        } else {
            for p in 0..d {
                qt[p * rp + r] = 0.0;
            }
        }
    }
    // Each row's own key range, as positions relative to `lo`; padding rows take every key
    // (their scores are zeros, finite, and never stored).
    let mut lo_r = [0i32; TILE_ROWS];
    let mut hi_r = [span as i32 - 1; TILE_ROWS];
    let bounds = |r: usize| {
        let pos = pos0 + r / group;
        ((s.lo(pos) - lo) as i32, (pos - lo) as i32)
    };
    let kd = kvh * d;
    // Scores, 48 rows (3 vectors) per pass over the keys.
    let mut v0 = 0;
    while v0 < rp / 16 {
        let nv = (rp / 16 - v0).min(3);
        for r in 0..16 * nv {
            (lo_r[r], hi_r[r]) = if v0 * 16 + r < rows {
                bounds(v0 * 16 + r)
            } else {
                (0, span as i32 - 1)
            };
        }
        let (mut lov, mut hiv) = ([_mm512_setzero_si512(); 3], [_mm512_setzero_si512(); 3]);
        for v in 0..3 {
            // SAFETY: lanes `16v..16v + 16 ≤ TILE_ROWS` of the two arrays.
            unsafe {
                lov[v] = _mm512_loadu_si512(lo_r.as_ptr().add(16 * v).cast());
                hiv[v] = _mm512_loadu_si512(hi_r.as_ptr().add(16 * v).cast());
            }
        }
        let mut keys = Positions::new(s.table, s.layout, lo);
        let mut j = 0;
        while j < span {
            let jn = (span - j).min(KEYS);
            let mut kp = [std::ptr::null::<f32>(); KEYS];
            for kk in kp.iter_mut().take(jn) {
                *kk = s.k[keys.next_off() + kd..][..d].as_ptr();
            }
            let at = Scores {
                qt: qt[16 * v0..].as_ptr(),
                rp,
                d,
                scale: s.scale,
                j: j as i32,
                lo: lov,
                hi: hiv,
                pt: pt[j * rp + 16 * v0..].as_mut_ptr(),
            };
            // SAFETY: `kp[..jn]` point at `d` floats of key rows inside the cache; `qt` holds
            // `d` rows of `rp ≥ 16·(v0 + nv)` lanes, `pt` rows `j..j + jn < span` of `rp`.
            unsafe {
                macro_rules! go {
                    ($($nv:literal)*) => {
                        match (nv, jn == KEYS) {
                            $(($nv, true) => scores::<$nv, KEYS>(&at, &kp),
                              ($nv, false) => for (i, k) in kp[..jn].iter().enumerate() {
                                  let at = Scores { j: at.j + i as i32, pt: at.pt.add(i * rp), ..at };
                                  scores::<$nv, 1>(&at, &[*k]);
                              },)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(1 2 3);
            }
            j += jn;
        }
        v0 += nv;
    }
    // Softmax down each column: `p = e^(s - max)` (masked scores give +0), `sums[r] = Σ p`.
    // SAFETY: `pt` holds `span` rows of `rp` lanes, `sums` `rp`.
    unsafe { softmax_columns(pt.as_mut_ptr(), span, rp, sums.as_mut_ptr()) };
    // Weighted sums, `PV_ROWS` rows × 64 lanes of `head_dim` per pass over the value rows.
    let mut r0 = 0;
    while r0 < rows {
        let nr = (rows - r0).min(PV_ROWS);
        let mut c0 = 0;
        while c0 < d {
            let nc = (d - c0).min(64);
            let mut o = [std::ptr::null_mut::<f32>(); PV_ROWS];
            let mut inv = [0.0f32; PV_ROWS];
            for i in 0..nr {
                o[i] = out[q_at(r0 + i) + c0..][..nc].as_mut_ptr();
                inv[i] = 1.0 / sums[r0 + i];
            }
            let at = Sums {
                pt: pt[r0..].as_ptr(),
                rp,
                span,
                v: s.v.as_ptr().wrapping_add(kd + c0),
                keys: Positions::new(s.table, s.layout, lo),
                nc,
                out: o,
                inv,
            };
            // SAFETY: `pt` rows `0..span` from lane `r0` (`r0 + nr ≤ rows ≤ rp`); the value
            // rows of positions `lo..=hi` from lane `kd + c0` hold `nc` floats; `o[..nr]` point
            // at `nc` floats of distinct output rows.
            unsafe {
                macro_rules! go {
                    ($($R:literal)*) => {
                        match nr {
                            $($R => weighted_sum::<$R>(at),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(6 5 4 3 2 1);
            }
            c0 += nc;
        }
        r0 += nr;
    }
}

/// Where a score register tile reads and writes.
#[derive(Copy, Clone)]
struct Scores {
    /// The transposed queries from the tile's first row vector: `qt[p·rp + lane]`.
    qt: *const f32,
    rp: usize,
    d: usize,
    scale: f32,
    /// The first key's index relative to the tile's first key.
    j: i32,
    /// Each lane's key range (relative indices, inclusive).
    lo: [__m512i; 3],
    hi: [__m512i; 3],
    /// The first key's score row, at the first row vector.
    pt: *mut f32,
}

/// `pt[jj·rp + 16v + l] = scale · Σ_p qt[p·rp + 16v + l] · k_jj[p]` for `J` keys and `NV` row
/// vectors, `-inf` where the key is outside the lane's range.
///
/// # Safety
/// AVX-512F available; `keys[jj]` readable for `d` floats; `qt` for `d` rows of `16·NV` lanes
/// at stride `rp`; `pt` writable for `J` rows of `16·NV` lanes at stride `rp`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores<const NV: usize, const J: usize>(at: &Scores, keys: &[*const f32; J]) {
    // SAFETY: reads and writes stay inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; J];
        for p in 0..at.d {
            let row = at.qt.add(p * at.rp);
            let mut qv = [_mm512_setzero_ps(); NV];
            for v in 0..NV {
                qv[v] = _mm512_loadu_ps(row.add(16 * v));
            }
            for jj in 0..J {
                let b = _mm512_set1_ps(*keys[jj].add(p));
                for v in 0..NV {
                    acc[jj][v] = _mm512_fmadd_ps(qv[v], b, acc[jj][v]);
                }
            }
        }
        let (scale, ninf) = (_mm512_set1_ps(at.scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for jj in 0..J {
            let jv = _mm512_set1_epi32(at.j + jj as i32);
            for v in 0..NV {
                let live =
                    _mm512_cmple_epi32_mask(at.lo[v], jv) & _mm512_cmple_epi32_mask(jv, at.hi[v]);
                let sv = _mm512_mask_mov_ps(ninf, live, _mm512_mul_ps(acc[jj][v], scale));
                _mm512_storeu_ps(at.pt.add(jj * at.rp + 16 * v), sv);
            }
        }
    }
}

/// For each of the `rp` columns of `pt` (`span` rows): `p = e^(s - max s)` in place, and the
/// column's `Σ p` (in row order) into `sums`.
///
/// # Safety
/// AVX-512F available; `pt` readable and writable for `span·rp` floats, `sums` for `rp`;
/// `rp` a multiple of 16.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_columns(pt: *mut f32, span: usize, rp: usize, sums: *mut f32) {
    // SAFETY: every access is at `j·rp + 16v + lane` with `j < span`, `16v + 16 ≤ rp`.
    unsafe {
        for v in 0..rp / 16 {
            let col = pt.add(16 * v);
            let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
            for j in 0..span {
                m = _mm512_max_ps(m, _mm512_loadu_ps(col.add(j * rp)));
            }
            let mut sum = _mm512_setzero_ps();
            for j in 0..span {
                let e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(col.add(j * rp)), m));
                _mm512_storeu_ps(col.add(j * rp), e);
                sum = _mm512_add_ps(sum, e);
            }
            _mm512_storeu_ps(sums.add(16 * v), sum);
        }
    }
}

/// `e^x` for `x ≤ 0` (a score minus its row's maximum), 16 lanes: Cephes' `expf` (`x = n·ln 2
/// + r`, `|r| ≤ ln 2 / 2`, a degree-7 polynomial in `r`, scaled by `2^n`), within 2 ulp of
/// `e^x`; `x < -87.33` (`e^x` below f32's normal range), `-inf` and NaN give `+0`.
///
/// # Safety
/// AVX-512F available.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn exp_nonpositive(x: __m512) -> __m512 {
    const LOW: f32 = -87.336_55;
    let s = _mm512_set1_ps;
    let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, s(LOW));
    let x = _mm512_max_ps(x, s(LOW));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, s(std::f32::consts::LOG2_E)),
    );
    // r = x - n·ln 2, ln 2 in two parts so n·C1 is exact.
    let r = _mm512_fnmadd_ps(n, s(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, s(-2.121_944_4e-4), r);
    let mut y = s(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm512_fmadd_ps(y, r, s(c));
    }
    let y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, s(1.0)));
    _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n))
}

/// Where a weighted-sum register tile reads and writes.
struct Sums<'a> {
    /// The weights from the tile's row `r0`: `pt[j·rp + i]` for row `r0 + i`.
    pt: *const f32,
    rp: usize,
    span: usize,
    /// The value cache from lane `kvh·d + c0`.
    v: *const f32,
    keys: Positions<'a>,
    /// Lanes of `head_dim` in this pass (≤ 64).
    nc: usize,
    out: [*mut f32; PV_ROWS],
    inv: [f32; PV_ROWS],
}

/// `out[i][c] = inv[i] · Σ_j pt[j·rp + i] · v_j[c]` for `R` rows and `nc ≤ 64` lanes, `j` in
/// key order.
///
/// # Safety
/// AVX-512F available; `pt` readable for `span` rows of `R` lanes at stride `rp`; each key's
/// value row (from `v` plus its cache offset) readable for `nc` floats; `out[i]` writable for
/// `nc` floats, `i < R`.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn weighted_sum<const R: usize>(mut at: Sums<'_>) {
    let mut mask = [0 as __mmask16; 4];
    for (c, m) in mask.iter_mut().enumerate() {
        *m = ((1u32 << at.nc.saturating_sub(16 * c).min(16)) - 1) as __mmask16;
    }
    // SAFETY: masked loads and stores touch the `nc` floats of each row only (addresses of
    // masked-off vectors are formed with `wrapping_add` and never dereferenced); the rest is
    // the caller's guarantee.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for j in 0..at.span {
            let vr = at.v.wrapping_add(at.keys.next_off());
            let mut vv = [_mm512_setzero_ps(); 4];
            for c in 0..4 {
                vv[c] = _mm512_maskz_loadu_ps(mask[c], vr.wrapping_add(16 * c));
            }
            let w = at.pt.add(j * at.rp);
            for i in 0..R {
                let b = _mm512_set1_ps(*w.add(i));
                for c in 0..4 {
                    acc[i][c] = _mm512_fmadd_ps(b, vv[c], acc[i][c]);
                }
            }
        }
        for i in 0..R {
            let inv = _mm512_set1_ps(at.inv[i]);
            for c in 0..4 {
                _mm512_mask_storeu_ps(
                    at.out[i].wrapping_add(16 * c),
                    mask[c],
                    _mm512_mul_ps(acc[i][c], inv),
                );
            }
        }
    }
}
