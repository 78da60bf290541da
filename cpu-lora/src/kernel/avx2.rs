//! AVX2 + FMA (+ F16C) ops for x86-64: the crate's only `unsafe`.
//!
//! Soundness rests on two things: an [`Avx2`] value exists only after run-time detection of
//! all three features (so calling the `#[target_feature]` functions is sound), and every safe
//! [`Ops`] method checks the slice bounds its raw-pointer loop relies on before entering it.
// Register tiles are indexed `acc[i][j]` in step with pointer offsets; iterators obscure that.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::{check_block, Dims, LoraMat, Ops, Rows, RowsMut, WeightDtype};

/// Dtype codes for const generics (one instantiation per stored format).
pub(super) const F32: u8 = 0;
pub(super) const F16: u8 = 1;
pub(super) const BF16: u8 = 2;

/// Expand panel width: 3 AVX vectors.
const PANEL: usize = 24;

/// Shrink register tile: rows × ranks (12 accumulators, 7 loads per 12 FMAs).
const SHRINK_MR: usize = 3;
const SHRINK_NR: usize = 4;
/// Expand register tile: rows × `PANEL` columns (4 × 3 vectors = 12 accumulators).
const EXPAND_MR: usize = 4;

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

    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32]) {
        // SAFETY: `self` proves AVX2/FMA/F16C.
        unsafe { widen(dtype, src, dst) }
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

/// [`Ops::widen`] for any x86 backend.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn widen(dtype: WeightDtype, src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * dtype.size(), "widen: length");
    let (s, d, n) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
    // SAFETY: the caller vouches for the features; `src` holds exactly `n` elements of
    // `dtype` and `dst` has room for `n` f32s, which is all `widen_impl` touches.
    unsafe {
        match dtype {
            WeightDtype::F32 => widen_impl::<F32>(s, d, n),
            WeightDtype::F16 => widen_impl::<F16>(s, d, n),
            WeightDtype::Bf16 => widen_impl::<BF16>(s, d, n),
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
        panel % 8 == 0,
        "pack_bt: panel width {panel} is not a multiple of 8"
    );
    let panels = cols.len().div_ceil(panel);
    assert!(dst.len() >= panels * rank * panel, "pack_bt: dst too small");
    assert!(
        b.bytes.len() >= cols.end * rank * b.dtype.size(),
        "pack_bt: b too small"
    );
    let (s, o0, n, d) = (b.bytes.as_ptr(), cols.start, cols.len(), dst.as_mut_ptr());
    let geo = PackGeometry { rank, o0, n, panel };
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
}

const fn elem_size(dt: u8) -> usize {
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
unsafe fn load1<const DT: u8>(p: *const u8) -> f32 {
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
/// AVX2/F16C available; `src` holds `n` elements of `DT`, `dst` has room for `n` f32s.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_impl<const DT: u8>(src: *const u8, dst: *mut f32, n: usize) {
    let es = elem_size(DT);
    // SAFETY: every offset below is `< n` elements, within the caller's guarantee.
    unsafe {
        let mut i = 0;
        while i + 8 <= n {
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
            // SAFETY: the tile `[i..i+mr, j..j+nr]` lies inside the caller's `m × n` block.
            let tile = unsafe {
                Shrink {
                    x: s.x.add(i * s.ldx),
                    a: s.a.add(j * s.lda),
                    t: s.t.add(i * s.ldt + j),
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
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn shrink_tile<const MR: usize, const NR: usize>(s: Shrink) {
    // SAFETY: all offsets are `< k` along rows `< MR` of x and `< NR` of a, and the stores hit
    // `t[..MR, ..NR]`: inside the caller's guarantee.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        let k8 = s.k & !7;
        let mut p = 0;
        while p < k8 {
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
pub(super) unsafe fn hsum4_store(v: [__m256; 4], dst: *mut f32) {
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
/// AVX2/F16C available; `b` holds rows `o0..o0 + n` of `rank` elements of `DT`; `dst` has room
/// for `⌈n / panel⌉` panels of `rank × panel` f32s; `panel` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_impl<const DT: u8>(b: *const u8, g: PackGeometry, dst: *mut f32) {
    let PackGeometry {
        rank,
        o0,
        n,
        panel: pw,
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
        while c < n8 {
            let src = b.add((o0 + c) * rank * es);
            let out = dst.add(panel_of(c));
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
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps(t0, t2, 0x44);
        let u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        let u2 = _mm256_shuffle_ps(t1, t3, 0x44);
        let u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        let u4 = _mm256_shuffle_ps(t4, t6, 0x44);
        let u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        let u6 = _mm256_shuffle_ps(t5, t7, 0x44);
        let u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        let cols = [
            _mm256_permute2f128_ps(u0, u4, 0x20),
            _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20),
            _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31),
            _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31),
            _mm256_permute2f128_ps(u3, u7, 0x31),
        ];
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
            // SAFETY: as above; the tile's row count matches the const parameter and its
            // vector count covers `cols ≤ PANEL` columns.
            unsafe {
                match (mr, tile.cols.div_ceil(8)) {
                    (4, 3) => expand_tile::<4, 3>(tile),
                    (4, 2) => expand_tile::<4, 2>(tile),
                    (4, _) => expand_tile::<4, 1>(tile),
                    (3, 3) => expand_tile::<3, 3>(tile),
                    (3, 2) => expand_tile::<3, 2>(tile),
                    (3, _) => expand_tile::<3, 1>(tile),
                    (2, 3) => expand_tile::<2, 3>(tile),
                    (2, 2) => expand_tile::<2, 2>(tile),
                    (2, _) => expand_tile::<2, 1>(tile),
                    (_, 3) => expand_tile::<1, 3>(tile),
                    (_, 2) => expand_tile::<1, 2>(tile),
                    (_, _) => expand_tile::<1, 1>(tile),
                }
            }
        }
        i += mr;
    }
}

/// `MR` rows × `NV` vectors of outputs: per rank step, `NV` panel loads, `MR` broadcasts of
/// `t` and `MR · NV` FMAs. Columns past `cols` are masked off at the store.
///
/// # Safety
/// As [`expand_impl`] with `m = MR` and one panel, `cols ≤ 8 · NV`.
#[inline]
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
