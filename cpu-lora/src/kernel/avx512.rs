//! AVX-512F ops for x86-64: the same blocking as [`super::avx2`] with 16-lane vectors and
//! twice the registers, so both micro-kernels hold 24 accumulators. Widening and the `B`
//! transpose are shared with the AVX2 module (they are bound by memory, not by vector width).
//!
//! Soundness: an [`Avx512`] exists only after run-time detection of AVX-512F, AVX2, FMA and
//! F16C, and every safe [`Ops`] method checks the bounds its pointer loops rely on.
// Register tiles are indexed `acc[i][j]` in step with pointer offsets; iterators obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{self, hsum4_store, Expand, Shrink};
use super::{check_block, Dims, LoraMat, Ops, Rows, RowsMut, WeightDtype};

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

    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32]) {
        // SAFETY: `self` proves AVX2/FMA/F16C (and more).
        unsafe { avx2::widen(dtype, src, dst) }
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
        };
        // SAFETY: `self` proves the features; the three blocks were bounds-checked above and
        // `shrink_impl` only touches `x[..m, ..k]`, `a[..n, ..k]` and `t[..m, ..n]`.
        unsafe { shrink_impl(s, d.m, d.n) }
    }

    fn pack_bt(self, b: LoraMat<'_>, rank: usize, cols: Range<usize>, dst: &mut [f32]) {
        // SAFETY: `self` proves AVX2/FMA/F16C (and more).
        unsafe { avx2::pack_bt(b, rank, cols, dst, PANEL) }
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
            // SAFETY: the tile `[i..i+mr, j..j+nr]` lies inside the caller's `m × n` block.
            let tile = unsafe {
                Shrink {
                    x: s.x.add(i * s.ldx),
                    a: s.a.add(j * s.lda),
                    t: s.t.add(i * s.ldt + j),
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
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn shrink_tile<const MR: usize, const NR: usize>(s: Shrink) {
    // SAFETY: loads are masked to offsets `< k` along rows `< MR` of x and `< NR` of a (masked
    // lanes are not accessed); stores hit `t[..MR, ..NR]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut p = 0;
        while p < s.k {
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
            let mut four = [_mm256_setzero_ps(); 4];
            for j in 0..NR {
                let v = acc[i][j];
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
                four[j] = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
            }
            let mut sums = [0.0f32; 4];
            hsum4_store(four, sums.as_mut_ptr());
            for j in 0..NR {
                let dst = s.t.add(i * s.ldt + j);
                *dst = if s.first { sums[j] } else { *dst + sums[j] };
            }
        }
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
#[inline]
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
