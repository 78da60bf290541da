//! AVX2 + FMA (+ F16C) ops for x86-64: 8-lane shrink and expand micro-kernels with 12
//! accumulators (16 registers). Widening and the `B` transpose live in [`super::x86`].
//!
//! Soundness rests on two things: an [`Avx2`] value exists only after run-time detection of
//! all three features (so calling the `#[target_feature]` functions is sound), and every safe
//! [`Ops`] method checks the slice bounds its raw-pointer loop relies on before entering it.
// Register tiles are indexed `acc[i][j]` in step with pointer offsets; iterators obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::x86::{pack_bt, widen, Expand, Prefetch, Shrink};
use super::{check_block, Dims, LoraMat, Ops, Rows, RowsMut, WeightDtype};

/// Expand panel width: 2 AVX vectors.
const PANEL: usize = 16;

/// Shrink register tile: rows × ranks (12 accumulators, 7 loads per 12 FMAs).
const SHRINK_MR: usize = 3;
const SHRINK_NR: usize = 4;
/// Expand register tile: rows × `PANEL` columns (6 × 2 vectors = 12 accumulators; with the
/// 2 panel vectors and a broadcast that is 15 of the 16 registers; 4 × 3 spilled).
const EXPAND_MR: usize = 6;

/// Proof that this CPU has AVX2, FMA and F16C.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Avx2 {
    _detected: (),
}

impl Avx2 {
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self { _detected: () })
    }
}

impl Ops for Avx2 {
    const PANEL: usize = PANEL;

    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32], next: &[u8]) {
        // SAFETY: `self` proves AVX2/FMA/F16C.
        unsafe { widen(dtype, src, dst, next) }
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
        // SAFETY: `self` proves AVX2/FMA/F16C.
        unsafe { pack_bt(b, rank, cols, dst, PANEL) }
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
        // were bounds-checked above, and `expand_impl` touches nothing else (partial vectors
        // at the right edge of `out` use masked loads and stores).
        unsafe { expand_impl(e, d.m) }
    }
}

/// # Safety
/// AVX2/FMA available; `x[..m, ..k]`, `a[..n, ..k]` readable and `t[..m, ..n]` writable at
/// their leading dimensions.
#[target_feature(enable = "avx2,fma,f16c")]
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
            // SAFETY: as above; the tile's row and rank counts match the const parameters.
            unsafe {
                match (mr, nr) {
                    (3, 4) => shrink_tile::<3, 4>(tile),
                    (3, 3) => shrink_tile::<3, 3>(tile),
                    (3, 2) => shrink_tile::<3, 2>(tile),
                    (3, _) => shrink_tile::<3, 1>(tile),
                    (2, 4) => shrink_tile::<2, 4>(tile),
                    (2, 3) => shrink_tile::<2, 3>(tile),
                    (2, 2) => shrink_tile::<2, 2>(tile),
                    (2, _) => shrink_tile::<2, 1>(tile),
                    (_, 4) => shrink_tile::<1, 4>(tile),
                    (_, 3) => shrink_tile::<1, 3>(tile),
                    (_, 2) => shrink_tile::<1, 2>(tile),
                    (_, _) => shrink_tile::<1, 1>(tile),
                }
            }
            j += nr;
        }
        i += mr;
    }
}

/// `MR × NR` dot products of length `k`, eight lanes at a time, one accumulator each.
///
/// # Safety
/// As [`shrink_impl`] with `m = MR`, `n = NR`.
// Never inlined: register allocation of the 12 accumulators is only reliable when each
// tile is its own function (inlined into the dispatcher, LLVM spilled them to the stack).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn shrink_tile<const MR: usize, const NR: usize>(s: Shrink) {
    // SAFETY: all offsets are `< k` along rows `< MR` of x and `< NR` of a, and the stores hit
    // `t[..MR, ..NR]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        let k8 = s.k & !7;
        let mut p = 0;
        while p < k8 {
            if p.is_multiple_of(16) {
                for r in 0..s.pf_rows {
                    s.pf_a.line((r * s.lda + p) * 4);
                }
            }
            let mut av = [_mm256_setzero_ps(); NR];
            for j in 0..NR {
                av[j] = _mm256_loadu_ps(s.a.add(j * s.lda + p));
            }
            for i in 0..MR {
                let xv = _mm256_loadu_ps(s.x.add(i * s.ldx + p));
                for j in 0..NR {
                    acc[i][j] = _mm256_fmadd_ps(xv, av[j], acc[i][j]);
                }
            }
            p += 8;
        }
        for i in 0..MR {
            let mut four = [_mm256_setzero_ps(); 4];
            four[..NR].copy_from_slice(&acc[i]);
            let mut sums = [0.0f32; 4];
            hsum4_store(four, sums.as_mut_ptr());
            for p in k8..s.k {
                let xv = *s.x.add(i * s.ldx + p);
                for j in 0..NR {
                    sums[j] += xv * *s.a.add(j * s.lda + p);
                }
            }
            for j in 0..NR {
                let dst = s.t.add(i * s.ldt + j);
                *dst = if s.first { sums[j] } else { *dst + sums[j] };
            }
        }
    }
}

/// Stores the lane sums of four vectors to `dst[..4]`.
///
/// # Safety
/// AVX available; `dst` writable for 4 f32s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum4_store(v: [__m256; 4], dst: *mut f32) {
    // SAFETY: the caller guarantees `dst[..4]`.
    unsafe {
        let s01 = _mm256_hadd_ps(v[0], v[1]);
        let s23 = _mm256_hadd_ps(v[2], v[3]);
        let s = _mm256_hadd_ps(s01, s23);
        _mm_storeu_ps(
            dst,
            _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)),
        );
    }
}

/// # Safety
/// AVX2/FMA available; `t[..m, ..k]` readable, `out[..m, ..cols]` writable, and
/// `⌈cols / PANEL⌉` panels of `k × PANEL` readable at `panel`.
#[target_feature(enable = "avx2,fma,f16c")]
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
/// As [`expand_tile`]; picks `NV = ⌈cols / 8⌉`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand_rows<const MR: usize>(e: Expand) {
    // SAFETY: forwarded; `NV` vectors cover `cols ≤ 8 · NV` columns.
    unsafe {
        if e.cols > 8 {
            expand_tile::<MR, 2>(e)
        } else {
            expand_tile::<MR, 1>(e)
        }
    }
}

/// `MR` rows × `NV` vectors of outputs: per rank step, `NV` panel loads, `MR` broadcasts of
/// `t` and `MR · NV` FMAs. Columns past `cols` are masked off at the store.
///
/// # Safety
/// As [`expand_impl`] with `m = MR` and one panel, `cols ≤ 8 · NV`.
// Never inlined: register allocation of the 12 accumulators is only reliable when each
// tile is its own function (inlined into the dispatcher, LLVM spilled them to the stack).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand_tile<const MR: usize, const NV: usize>(e: Expand) {
    // SAFETY: loads read `t[..MR, ..k]` and panel rows `..k`, columns `< 8 · NV ≤ PANEL`; the
    // stores (masked on the ragged vector) write `out[..MR, ..cols]`.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NV]; MR];
        for j in 0..e.k {
            let mut bv = [_mm256_setzero_ps(); NV];
            for v in 0..NV {
                bv[v] = _mm256_loadu_ps(e.panel.add(j * PANEL + 8 * v));
            }
            for i in 0..MR {
                let tb = _mm256_broadcast_ss(&*e.t.add(i * e.ldt + j));
                for v in 0..NV {
                    acc[i][v] = _mm256_fmadd_ps(tb, bv[v], acc[i][v]);
                }
            }
        }
        for i in 0..MR {
            for v in 0..NV {
                let (c, o) = (8 * v, e.out.add(i * e.ldo + 8 * v));
                if c + 8 <= e.cols {
                    let r = if e.accumulate {
                        _mm256_add_ps(_mm256_loadu_ps(o), acc[i][v])
                    } else {
                        acc[i][v]
                    };
                    _mm256_storeu_ps(o, r);
                } else {
                    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((e.cols - c) as i32), lane);
                    let r = if e.accumulate {
                        _mm256_add_ps(_mm256_maskload_ps(o, mask), acc[i][v])
                    } else {
                        acc[i][v]
                    };
                    _mm256_maskstore_ps(o, mask, r);
                }
            }
        }
    }
}
