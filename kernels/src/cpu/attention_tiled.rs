//! Causal GQA attention tiled for AVX-512F: the query rows of up to [`TILE_ROWS`] rows (whole
//! tokens × the query heads of one kv head; a 128-token prompt chunk of SmolLM2 is 8 tiles of
//! 16 tokens × 3 heads) are transposed into `[head_dim][rows]`, so each key row, read once per
//! tile instead of once per token, scores 16 query rows per instruction (broadcasting
//! `k_j[p]`). The scores land as `[keys][rows]`; the softmax runs down each column, and the
//! weighted sum of the value rows runs [`PV_ROWS`] query rows × 64 lanes of `head_dim` per
//! pass, again reading each value row once per pass instead of once per token.
//!
//! **Bits.** Every query's result is the portable path's (`attend_rows`) bit for bit: each
//! query sits in one SIMD lane that no other query touches, and that lane repeats the portable
//! arithmetic step for step — the dot product's eight partial sums (multiply, then add) added
//! in order plus the `d mod 8` tail, times `scale`; the maximum; `e^x` (the bits of
//! `cpu::expf::expf`, sixteen lanes per call of [`expf_x16`]); the sum of the weights from
//! `f32`'s `Sum` start in key order; the weighted sum of the value rows from `+0` in key order
//! (multiply, then add); times `1 / sum`. So a result depends only on its query, position and
//! the cache — not on the tile, the chunk, the thread or the CPU's SIMD level — and a prefill
//! row and a decode row at the same position agree. The keys
//! of a tile span the first row's window start to the last row's position; a row's keys
//! outside its own range score `-inf`, weigh exactly `+0` and leave its sums unchanged (the
//! cache rows in that range are positions some row of the tile attends to, so they are
//! written and finite).
// Register tiles are indexed `acc[r][c]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{KvLayout, Seq};
use crate::cpu::expf::expf_x16;
use crate::cpu::simd::{simd_level, SimdLevel};

/// Most query rows per tile: three 16-lane vectors (16 tokens of 3 heads, 12 of 4, …).
const TILE_ROWS: usize = 48;
/// What `f32`'s `Sum` starts from (`-0.0` in current Rust; `+0.0` before): the portable
/// path's dot and softmax sums begin there, so these do too.
pub(super) const SUM_START: f32 = {
    // Not `iter::empty().sum()` (not const): the portable path's sums are `Iterator::sum`, and
    // `sum_start_is_iterator_sum` (tests) checks this constant against it.
    -0.0
};
/// Query rows per register tile of the weighted sum (× 4 vectors of `head_dim` = 24
/// accumulators).
pub(super) const PV_ROWS: usize = 6;
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
        let span = tile_span(tokens, end, s.window);
        if super::keys::fits(tokens * group, span) {
            // A decode token (or a few): 16 keys per lane vector instead of 16 query rows.
            let need = super::keys::scratch_len(tokens * group, span, d);
            if scratch.len() < need {
                scratch.resize(need, 0.0);
            }
            for kvh in 0..s.layout.num_kv_heads {
                // SAFETY: `self` proves AVX-512F; the call fits and `scratch` holds what it
                // needs; the cache holds positions `0..end` (checked by the caller).
                unsafe { super::keys::attend(s, kvh, out, scratch) };
            }
            return;
        }
        self.attend_row_lanes(s, out, scratch);
    }

    /// [`Self::attend`] with query rows in the lanes whatever the row count (the key-lane
    /// path's oracle in tests).
    pub(super) fn attend_row_lanes(self, s: &Seq<'_>, out: &mut [f32], scratch: &mut Vec<f32>) {
        let (d, group, tokens) = (s.layout.head_dim, s.group(), s.tokens());
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
pub(super) struct Positions<'a> {
    table: &'a [u32],
    layout: KvLayout,
    /// The block-table entry of the next block.
    next_block: usize,
    /// Positions left in the current block, the current one included.
    left: usize,
    off: usize,
}

impl<'a> Positions<'a> {
    pub(super) fn new(table: &'a [u32], layout: KvLayout, lo: usize) -> Self {
        let bs = layout.block_size;
        let block = lo / bs;
        Self {
            table,
            layout,
            next_block: block + 1,
            left: bs - lo % bs,
            off: (table[block] as usize * bs + lo % bs) * layout.token_len(),
        }
    }

    /// The offset of the current position's `[num_kv_heads, head_dim]` row; moves on (one
    /// block-table lookup per block, no division per position).
    #[inline]
    pub(super) fn next_off(&mut self) -> usize {
        let off = self.off;
        self.left -= 1;
        if self.left == 0 {
            // The next block (its table entry exists while the position is in the context).
            if let Some(&b) = self.table.get(self.next_block) {
                self.off = b as usize * self.layout.block_size * self.layout.token_len();
            }
            self.next_block += 1;
            self.left = self.layout.block_size;
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
        for j in 0..span {
            let key = s.k[keys.next_off() + kd..][..d].as_ptr();
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
            // SAFETY: `key` points at the `d` floats of a key row inside the cache; `qt` holds
            // `d` rows of `rp ≥ 16·(v0 + nv)` lanes, `pt` row `j < span` of `rp`.
            unsafe {
                match nv {
                    1 => scores::<1>(&at, key),
                    2 => scores::<2>(&at, key),
                    _ => scores::<3>(&at, key),
                }
            }
        }
        v0 += nv;
    }
    // Softmax down each column: `p = e^(s - max)` (masked scores give +0), `sums[r] = Σ p`.
    // SAFETY: `pt` holds `span` rows of `rp` lanes, `sums` `rp`.
    unsafe { softmax_columns(pt.as_mut_ptr(), span, rp, sums.as_mut_ptr()) };
    let w = Weights {
        p: pt.as_ptr(),
        key_stride: rp,
        row_stride: 1,
        sums: &*sums,
    };
    // SAFETY: `pt` holds `span` rows of `rp ≥ rows` lanes, `sums` `rp`; the value rows of
    // positions `lo..=hi` are in the cache; `q_at(r)` of every row is a row of `out`.
    unsafe { weigh_values(s, kvh, lo, span, rows, &q_at, &w, out) };
}

/// A tile's softmax weights: row `i`'s weight of key `j` at `p[j·key_stride + i·row_stride]`,
/// their sums in `sums[i]`.
pub(super) struct Weights<'a> {
    pub(super) p: *const f32,
    pub(super) key_stride: usize,
    pub(super) row_stride: usize,
    pub(super) sums: &'a [f32],
}

/// `out` row `q_at(i)` = `Σ_j w_ij · v_j / sums[i]` for the tile's `rows` rows and its `span`
/// keys from position `lo` (kv head `kvh`): [`PV_ROWS`] rows × 64 lanes of `head_dim` per pass
/// over the value rows.
///
/// # Safety
/// AVX-512F available; `w.p` readable at `j·key_stride + i·row_stride` for `j < span`,
/// `i < rows`, `w.sums` holds `rows` sums; the cache holds positions `lo..lo + span`; every
/// `q_at(i)` starts a distinct `[head_dim]` row of `out`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn weigh_values(
    s: &Seq<'_>,
    kvh: usize,
    lo: usize,
    span: usize,
    rows: usize,
    q_at: &dyn Fn(usize) -> usize,
    w: &Weights<'_>,
    out: &mut [f32],
) {
    let d = s.layout.head_dim;
    let kd = kvh * d;
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
                inv[i] = 1.0 / w.sums[r0 + i];
            }
            let at = Sums {
                pt: w.p.wrapping_add(r0 * w.row_stride),
                key_stride: w.key_stride,
                row_stride: w.row_stride,
                span,
                v: s.v.as_ptr().wrapping_add(kd + c0),
                keys: Positions::new(s.table, s.layout, lo),
                nc,
                out: o,
                inv,
            };
            // SAFETY: the weights of rows `r0..r0 + nr ≤ rows` and keys `0..span`; the value
            // rows of positions `lo..lo + span` from lane `kd + c0` hold `nc` floats; `o[..nr]`
            // point at `nc` floats of distinct output rows.
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

/// `pt[16v + l] = scale · (q · k)` for the `16·NV` query rows in lanes `l` of vectors `v`
/// (`q[p] = qt[p·rp + 16v + l]`) and one key row `k`, `-inf` where the key is outside the
/// lane's range. The dot is the portable path's, step for step: eight partial sums over
/// `p ≡ 0..8 (mod 8)` (multiply, then add), added in order, plus the `d mod 8` tail.
///
/// # Safety
/// AVX-512F available; `key` readable for `d` floats; `qt` for `d` rows of `16·NV` lanes at
/// stride `rp`; `pt` writable for `16·NV` lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores<const NV: usize>(at: &Scores, key: *const f32) {
    let d8 = at.d - at.d % 8;
    // SAFETY: reads and writes stay inside the caller's guarantee.
    unsafe {
        let q = |p: usize, v: usize| _mm512_loadu_ps(at.qt.add(p * at.rp + 16 * v));
        let mut acc = [[_mm512_setzero_ps(); NV]; 8];
        let mut c = 0;
        while c < d8 {
            for l in 0..8 {
                let b = _mm512_set1_ps(*key.add(c + l));
                for v in 0..NV {
                    acc[l][v] = _mm512_add_ps(acc[l][v], _mm512_mul_ps(q(c + l, v), b));
                }
            }
            c += 8;
        }
        let zero = _mm512_set1_ps(SUM_START);
        let (scale, ninf) = (_mm512_set1_ps(at.scale), _mm512_set1_ps(f32::NEG_INFINITY));
        let jv = _mm512_set1_epi32(at.j);
        for v in 0..NV {
            let mut dot = zero;
            for l in 0..8 {
                dot = _mm512_add_ps(dot, acc[l][v]);
            }
            let mut tail = zero;
            for p in d8..at.d {
                tail = _mm512_add_ps(tail, _mm512_mul_ps(q(p, v), _mm512_set1_ps(*key.add(p))));
            }
            let sv = _mm512_mul_ps(_mm512_add_ps(dot, tail), scale);
            let live =
                _mm512_cmple_epi32_mask(at.lo[v], jv) & _mm512_cmple_epi32_mask(jv, at.hi[v]);
            _mm512_storeu_ps(at.pt.add(16 * v), _mm512_mask_mov_ps(ninf, live, sv));
        }
    }
}

/// For each of the `rp` columns of `pt` (`span` rows): `p = e^(s - max s)` in place
/// ([`expf_x16`], the portable path's bits; a masked `-inf` gives `+0`), and the column's
/// `Σ p` (in row order, from the start value of `f32`'s `Sum`) into `sums`.
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
            let mut sum = _mm512_set1_ps(SUM_START);
            for j in 0..span {
                let x = _mm512_sub_ps(_mm512_loadu_ps(col.add(j * rp)), m);
                let ev = expf_x16(x);
                _mm512_storeu_ps(col.add(j * rp), ev);
                sum = _mm512_add_ps(sum, ev);
            }
            _mm512_storeu_ps(sums.add(16 * v), sum);
        }
    }
}

/// Where a weighted-sum register tile reads and writes.
pub(super) struct Sums<'a> {
    /// The weights from the tile's row `r0`: `pt[j·key_stride + i·row_stride]` for key `j`
    /// and row `r0 + i`.
    pub(super) pt: *const f32,
    pub(super) key_stride: usize,
    pub(super) row_stride: usize,
    pub(super) span: usize,
    /// The value cache from lane `kvh·d + c0`.
    pub(super) v: *const f32,
    pub(super) keys: Positions<'a>,
    /// Lanes of `head_dim` in this pass (≤ 64).
    pub(super) nc: usize,
    pub(super) out: [*mut f32; PV_ROWS],
    pub(super) inv: [f32; PV_ROWS],
}

/// `out[i][c] = inv[i] · Σ_j pt[j·key_stride + i·row_stride] · v_j[c]` for `R` rows and
/// `nc ≤ 64` lanes, `j` in key order.
///
/// # Safety
/// AVX-512F available; `pt` readable at `j·key_stride + i·row_stride` for `j < span`, `i < R`; each key's
/// value row (from `v` plus its cache offset) readable for `nc` floats; `out[i]` writable for
/// `nc` floats, `i < R`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn weighted_sum<const R: usize>(mut at: Sums<'_>) {
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
            let w = at.pt.add(j * at.key_stride);
            for i in 0..R {
                let b = _mm512_set1_ps(*w.add(i * at.row_stride));
                for c in 0..4 {
                    acc[i][c] = _mm512_add_ps(acc[i][c], _mm512_mul_ps(b, vv[c]));
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
