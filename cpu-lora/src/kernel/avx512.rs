//! AVX-512F ops for x86-64: the same blocking as [`super::avx2`] with 16-lane vectors and
//! twice the registers, so both micro-kernels hold 24 accumulators. Widening and the `B`
//! transpose are shared, in [`super::x86`] (they are bound by memory, not vector width).
//!
//! Soundness: an [`Avx512`] exists only after run-time detection of AVX-512F, AVX2, FMA and
//! F16C, and every safe [`Ops`] method checks the bounds its pointer loops rely on.
// Register tiles are indexed `acc[i][j]` in step with pointer offsets; iterators obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::x86::{self, elem_size, load1, Expand, Prefetch, Shrink, BF16, F16, F32};
use super::{check_block, Dims, LoraMat, Ops, Rows, RowsMut, WeightDtype, BCAST_LANES};

/// Shrink register tile: rows × ranks (24 accumulators, 10 loads per 24 FMAs).
const SHRINK_MR: usize = 6;
const SHRINK_NR: usize = 4;
/// Expand register tile: rows × 3 vectors (24 accumulators); the panel is 48 columns.
const EXPAND_MR: usize = 8;
const PANEL: usize = 48;

/// Proof that this CPU has AVX-512F, AVX2, FMA and F16C.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Avx512 {
    _detected: (),
}

impl Avx512 {
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self { _detected: () })
    }
}

impl Ops for Avx512 {
    const PANEL: usize = PANEL;
    const BCAST_ROWS: usize = BCAST_LANES;

    fn expand_rows_bcast(
        self,
        tt: &[f32],
        b: Rows<'_>,
        out: RowsMut<'_>,
        d: Dims,
        accumulate: bool,
    ) {
        check_block("bcast b", b.data.len(), b.ld, d.n, d.k);
        check_block("bcast out", out.data.len(), out.ld, d.m, d.n);
        assert!(
            d.m <= BCAST_LANES && tt.len() >= d.k * BCAST_LANES,
            "bcast: tt"
        );
        let e = Bcast {
            tt: tt.as_ptr(),
            b: b.data.as_ptr(),
            ldb: b.ld,
            k: d.k,
            out: out.data.as_mut_ptr(),
            ldo: out.ld,
            rows: d.m,
            accumulate,
        };
        // SAFETY: `self` proves the features; `tt[..k * 16]`, `b[..n, ..k]` and
        // `out[..m, ..n]` were bounds-checked above and are all `bcast_impl` touches.
        unsafe { bcast_impl(e, d.n) }
    }

    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32], next: &[u8]) {
        assert_eq!(src.len(), dst.len() * dtype.size(), "widen: length");
        let (s, d, n) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
        let pf = Prefetch {
            base: next.as_ptr(),
            len: next.len(),
        };
        // SAFETY: `self` proves the features; `src` holds exactly `n` elements of `dtype` and
        // `dst` has room for `n` f32s, all `widen_impl` touches; `pf` is a live slice.
        unsafe {
            match dtype {
                WeightDtype::F32 => widen_impl::<F32>(s, d, n, pf),
                WeightDtype::F16 => widen_impl::<F16>(s, d, n, pf),
                WeightDtype::Bf16 => widen_impl::<BF16>(s, d, n, pf),
            }
        }
    }

    fn shrink(self, x: Rows<'_>, a: Rows<'_>, t: RowsMut<'_>, d: Dims, first: bool) {
        check_block("shrink x", x.data.len(), x.ld, d.m, d.k);
        check_block("shrink a", a.data.len(), a.ld, d.n, d.k);
        check_block("shrink t", t.data.len(), t.ld, d.m, d.n);
        let s = Shrink {
            x: x.data.as_ptr(),
            ldx: x.ld,
            a: a.data.as_ptr(),
            lda: a.ld,
            t: t.data.as_mut_ptr(),
            ldt: t.ld,
            k: d.k,
            first,
            pf_a: Prefetch::NONE,
            pf_rows: 0,
        };
        // SAFETY: `self` proves the features; the three blocks were bounds-checked above and
        // `shrink_impl` only touches `x[..m, ..k]`, `a[..n, ..k]` and `t[..m, ..n]`.
        unsafe { shrink_impl(s, d.m, d.n) }
    }

    fn pack_bt(self, b: LoraMat<'_>, rank: usize, cols: Range<usize>, dst: &mut [f32]) {
        // SAFETY: `self` proves AVX2/FMA/F16C (and more).
        unsafe { x86::pack_bt(b, rank, cols, dst, PANEL) }
    }

    fn expand(self, t: Rows<'_>, panels: &[f32], out: RowsMut<'_>, d: Dims, accumulate: bool) {
        check_block("expand t", t.data.len(), t.ld, d.m, d.k);
        check_block("expand out", out.data.len(), out.ld, d.m, d.n);
        assert!(
            panels.len() >= d.n.div_ceil(PANEL) * d.k * PANEL,
            "expand: panels too small"
        );
        let e = Expand {
            t: t.data.as_ptr(),
            ldt: t.ld,
            panel: panels.as_ptr(),
            k: d.k,
            out: out.data.as_mut_ptr(),
            ldo: out.ld,
            cols: d.n,
            accumulate,
        };
        // SAFETY: `self` proves the features; `t[..m, ..k]`, `out[..m, ..n]` and the panels
        // were bounds-checked above, and `expand_impl` touches nothing else (the ragged right
        // edge of `out` is read and written with masks).
        unsafe { expand_impl(e, d.m) }
    }
}

/// Sixteen lanes at a time (half the instructions of the 8-lane AVX2 widen, which showed in
/// the profile of bf16 at 16 rows).
///
/// # Safety
/// AVX-512F/F16C available; `src` holds `n` elements of `DT`, `dst` has room for `n` f32s;
/// `pf` as in [`Prefetch::line`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn widen_impl<const DT: u8>(src: *const u8, dst: *mut f32, n: usize, pf: Prefetch) {
    let es = elem_size(DT);
    // SAFETY: every offset below is `< n` elements, within the caller's guarantee.
    unsafe {
        let mut i = 0;
        while i + 16 <= n {
            if (i * es).is_multiple_of(64) {
                pf.line(i * es);
            }
            let p = src.add(i * es);
            let v = match DT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())),
                    16,
                )),
            };
            _mm512_storeu_ps(dst.add(i), v);
            i += 16;
        }
        while i < n {
            *dst.add(i) = load1::<DT>(src.add(i * es));
            i += 1;
        }
    }
}

/// Lanes `< n` of a 16-lane mask (all for `n ≥ 16`).
#[inline(always)]
fn first_lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// # Safety
/// AVX-512F/AVX2/FMA available; `x[..m, ..k]`, `a[..n, ..k]` readable and `t[..m, ..n]`
/// writable at their leading dimensions.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn shrink_impl(s: Shrink, m: usize, n: usize) {
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(SHRINK_MR);
        let mut j = 0;
        while j < n {
            let nr = (n - j).min(SHRINK_NR);
            // The first row block streams `a` from memory: prefetch the next tile's rows.
            let pf_rows = if i == 0 {
                (n - j - nr).min(SHRINK_NR)
            } else {
                0
            };
            // SAFETY: the tile `[i..i+mr, j..j+nr]` lies inside the caller's `m × n` block,
            // and so do the `pf_rows` rows of `a` after it (`j + nr + pf_rows ≤ n`).
            let tile = unsafe {
                Shrink {
                    x: s.x.add(i * s.ldx),
                    a: s.a.add(j * s.lda),
                    t: s.t.add(i * s.ldt + j),
                    pf_a: match pf_rows {
                        0 => Prefetch::NONE,
                        r => Prefetch {
                            base: s.a.add((j + nr) * s.lda).cast(),
                            len: ((r - 1) * s.lda + s.k) * 4,
                        },
                    },
                    pf_rows,
                    ..s
                }
            };
            // SAFETY: as above; `shrink_rows` gets the tile's true row and rank counts.
            unsafe {
                match mr {
                    6 => shrink_rows::<6>(tile, nr),
                    5 => shrink_rows::<5>(tile, nr),
                    4 => shrink_rows::<4>(tile, nr),
                    3 => shrink_rows::<3>(tile, nr),
                    2 => shrink_rows::<2>(tile, nr),
                    _ => shrink_rows::<1>(tile, nr),
                }
            }
            j += nr;
        }
        i += mr;
    }
}

/// # Safety
/// As [`shrink_tile`] with `NR = nr ≤ 4`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn shrink_rows<const MR: usize>(s: Shrink, nr: usize) {
    // SAFETY: forwarded; `nr` selects the matching const parameter.
    unsafe {
        match nr {
            4 => shrink_tile::<MR, 4>(s),
            3 => shrink_tile::<MR, 3>(s),
            2 => shrink_tile::<MR, 2>(s),
            _ => shrink_tile::<MR, 1>(s),
        }
    }
}

/// `MR × NR` dot products of length `k`, sixteen lanes at a time; the ragged end of `k` is
/// a masked step, so no scalar tail.
///
/// # Safety
/// As [`shrink_impl`] with `m = MR`, `n = NR`.
// Never inlined: register allocation of the 24 accumulators is only reliable when each
// tile is its own function (inlined into the dispatcher, LLVM spilled them to the stack).
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn shrink_tile<const MR: usize, const NR: usize>(s: Shrink) {
    // SAFETY: loads are masked to offsets `< k` along rows `< MR` of x and `< NR` of a (masked
    // lanes are not accessed); stores hit `t[..MR, ..NR]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut p = 0;
        while p < s.k {
            for r in 0..s.pf_rows {
                s.pf_a.line((r * s.lda + p) * 4);
            }
            let mask = first_lanes(s.k - p);
            let mut av = [_mm512_setzero_ps(); NR];
            for j in 0..NR {
                av[j] = _mm512_maskz_loadu_ps(mask, s.a.add(j * s.lda + p));
            }
            for i in 0..MR {
                let xv = _mm512_maskz_loadu_ps(mask, s.x.add(i * s.ldx + p));
                for j in 0..NR {
                    acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
                }
            }
            p += 16;
        }
        for i in 0..MR {
            let mut four = [_mm512_setzero_ps(); 4];
            four[..NR].copy_from_slice(&acc[i]);
            let mut sums = [0.0f32; 4];
            hsum4_store(four, sums.as_mut_ptr());
            for j in 0..NR {
                let dst = s.t.add(i * s.ldt + j);
                *dst = if s.first { sums[j] } else { *dst + sums[j] };
            }
        }
    }
}

/// Stores the lane sums of four vectors to `dst[..4]`.
///
/// Only 512-bit (EVEX) operations touch the inputs: feeding an accumulator to a VEX
/// instruction (any 256-bit op without AVX-512VL) would confine every accumulator to
/// `zmm0..15`, and the 24-accumulator tile would spill.
///
/// # Safety
/// AVX-512F available; `dst` writable for 4 f32s.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn hsum4_store(v: [__m512; 4], dst: *mut f32) {
    // SAFETY: the caller guarantees `dst[..4]`.
    unsafe {
        // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
        let ab = _mm512_add_ps(
            _mm512_unpacklo_ps(v[0], v[1]),
            _mm512_unpackhi_ps(v[0], v[1]),
        );
        let cd = _mm512_add_ps(
            _mm512_unpacklo_ps(v[2], v[3]),
            _mm512_unpackhi_ps(v[2], v[3]),
        );
        // Per 128-bit lane: [a, b, c, d] partial sums.
        let abcd = _mm512_add_ps(
            _mm512_shuffle_ps(ab, cd, 0x44),
            _mm512_shuffle_ps(ab, cd, 0xEE),
        );
        // Sum the four 128-bit lanes into lane 0.
        let x = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
        let y = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
        _mm_storeu_ps(dst, _mm512_castps512_ps128(y));
    }
}

/// # Safety
/// AVX-512F available; `t[..m, ..k]` readable, `out[..m, ..cols]` writable, and
/// `⌈cols / PANEL⌉` panels of `k × PANEL` readable at `panel`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn expand_impl(e: Expand, m: usize) {
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(EXPAND_MR);
        for (pi, c0) in (0..e.cols).step_by(PANEL).enumerate() {
            // SAFETY: row block `i..i + mr` and panel `pi` lie inside the caller's block.
            let tile = unsafe {
                Expand {
                    t: e.t.add(i * e.ldt),
                    panel: e.panel.add(pi * e.k * PANEL),
                    out: e.out.add(i * e.ldo + c0),
                    cols: (e.cols - c0).min(PANEL),
                    ..e
                }
            };
            // SAFETY: as above; `expand_rows` gets the tile's true row count.
            unsafe {
                match mr {
                    8 => expand_rows::<8>(tile),
                    7 => expand_rows::<7>(tile),
                    6 => expand_rows::<6>(tile),
                    5 => expand_rows::<5>(tile),
                    4 => expand_rows::<4>(tile),
                    3 => expand_rows::<3>(tile),
                    2 => expand_rows::<2>(tile),
                    _ => expand_rows::<1>(tile),
                }
            }
        }
        i += mr;
    }
}

/// # Safety
/// As [`expand_tile`]; picks `NV = ⌈cols / 16⌉`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn expand_rows<const MR: usize>(e: Expand) {
    // SAFETY: forwarded; `NV` vectors cover `cols ≤ 16 · NV` columns.
    unsafe {
        match e.cols.div_ceil(16) {
            3 => expand_tile::<MR, 3>(e),
            2 => expand_tile::<MR, 2>(e),
            _ => expand_tile::<MR, 1>(e),
        }
    }
}

/// `MR` rows × `NV` vectors of outputs: per rank step, `NV` panel loads, `MR` broadcasts of
/// `t` (folded into the FMAs) and `MR · NV` FMAs. Columns past `cols` are masked off.
///
/// # Safety
/// As [`expand_impl`] with `m = MR` and one panel, `cols ≤ 16 · NV`.
// Never inlined: register allocation of the 24 accumulators is only reliable when each
// tile is its own function (inlined into the dispatcher, LLVM spilled them to the stack).
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn expand_tile<const MR: usize, const NV: usize>(e: Expand) {
    // SAFETY: loads read `t[..MR, ..k]` and panel rows `..k`, columns `< 16 · NV ≤ PANEL`; the
    // masked stores write `out[..MR, ..cols]` only.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for j in 0..e.k {
            let mut bv = [_mm512_setzero_ps(); NV];
            for v in 0..NV {
                bv[v] = _mm512_loadu_ps(e.panel.add(j * PANEL + 16 * v));
            }
            for i in 0..MR {
                let tb = _mm512_set1_ps(*e.t.add(i * e.ldt + j));
                for v in 0..NV {
                    acc[i][v] = _mm512_fmadd_ps(tb, bv[v], acc[i][v]);
                }
            }
        }
        for i in 0..MR {
            for v in 0..NV {
                let o = e.out.add(i * e.ldo + 16 * v);
                let mask = first_lanes(e.cols - 16 * v);
                let r = if e.accumulate {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), acc[i][v])
                } else {
                    acc[i][v]
                };
                _mm512_mask_storeu_ps(o, mask, r);
            }
        }
    }
}

/// Raw operands of the few-rows expand (`out[rows, n] (=|+=) tt[k, 16]ᵀ · b[n, k]ᵀ`).
#[derive(Copy, Clone)]
struct Bcast {
    tt: *const f32,
    b: *const f32,
    ldb: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    rows: usize,
    accumulate: bool,
}

/// # Safety
/// AVX-512F available; `tt[..k * 16]` and `b[..n, ..k]` readable, `out[..rows, ..n]`
/// writable, `rows ≤ 16`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn bcast_impl(e: Bcast, n: usize) {
    let mut o = 0;
    while o < n {
        let cols = (n - o).min(16);
        // SAFETY: block `o..o + cols` lies inside the caller's `n` columns.
        unsafe { bcast_block(e, o, cols) };
        o += cols;
    }
}

/// Sixteen outputs `o..o + 16` for all rows: `acc[c]` holds output `o + c` of every row
/// (lanes = rows), one FMA with a broadcast of `b[o + c, j]` per rank step; a 16 × 16
/// transpose then turns the accumulators into rows of `out`.
///
/// # Safety
/// As [`bcast_impl`], with `o + cols ≤ n`, `1 ≤ cols ≤ 16`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn bcast_block(e: Bcast, o: usize, cols: usize) {
    // SAFETY: `b` rows `o + min(c, cols - 1) < n` (columns past `cols` recompute the last one
    // and are masked off at the store), `tt[..k * 16]`, and masked stores to rows `< rows`,
    // columns `o..o + cols` of `out`.
    unsafe {
        // Two passes of 8 columns: 8 row pointers fit in general registers (16 spilled).
        let mut acc = [_mm512_setzero_ps(); 16];
        let (lo, hi) = acc.split_at_mut(8);
        for (half, acc) in [lo, hi].into_iter().enumerate() {
            let mut brow = [e.b; 8];
            for c in 0..8 {
                brow[c] = e.b.add((o + (8 * half + c).min(cols - 1)) * e.ldb);
            }
            for j in 0..e.k {
                let tv = _mm512_loadu_ps(e.tt.add(j * BCAST_LANES));
                for c in 0..8 {
                    acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(*brow[c].add(j)), tv, acc[c]);
                }
            }
        }
        let rows = transpose16(acc);
        let mask = first_lanes(cols);
        for r in 0..e.rows {
            let dst = e.out.add(r * e.ldo + o);
            let v = if e.accumulate {
                _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), rows[r])
            } else {
                rows[r]
            };
            _mm512_mask_storeu_ps(dst, mask, v);
        }
    }
}

/// 16 × 16 transpose: `out[i]` lane `c` = `r[c]` lane `i`.
///
/// # Safety
/// AVX-512F available.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let z = _mm512_setzero_ps();
    // Per 128-bit lane L: t[2i] = [a0 b0 a1 b1], t[2i+1] = [a2 b2 a3 b3] for a, b = r[2i], r[2i+1].
    let mut t = [z; 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + k], lane L = rows 4i..4i+4 at column 4L + k.
    let mut u = [z; 16];
    for i in 0..4 {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    // Gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k] into column 4L + k.
    let mut out = [z; 16];
    for k in 0..4 {
        let va = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        let vb = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        let wa = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        let wb = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        out[k] = _mm512_shuffle_f32x4(va, wa, 0x88);
        out[4 + k] = _mm512_shuffle_f32x4(vb, wb, 0x88);
        out[8 + k] = _mm512_shuffle_f32x4(va, wa, 0xDD);
        out[12 + k] = _mm512_shuffle_f32x4(vb, wb, 0xDD);
    }
    out
}
