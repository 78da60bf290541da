//! AVX-512F prompt GEMM `out = x · wᵀ` (`w` is `[n, k]`, the `nn.Linear` layout) for
//! prompt-sized `m`: the weight is packed once per call, a panel of [`NR`] weight rows at a
//! time, into `[k][NR]` (a 16 × 16 register transpose), then an [`MR`] × [`NR`] register tile
//! broadcasts one activation value per row against three 16-lane weight vectors. Every
//! weight element is read from memory once per call; the packed panel stays in L2 and its
//! [`KC`]-deep slices in L1 while every row block of `x` passes them. While a panel's tiles
//! run, the next panel's weight rows (contiguous) are prefetched, a share per tile, so
//! packing reads them from cache: without it a call took 1.1–1.35× as long at 64 rows
//! (`examples/prompt_gemm.rs`, quiet, session 11; T0 was ahead of T1/T2 by a few percent).
//!
//! Each output is one sequential fused multiply-add chain over `p = 0..k` starting from zero
//! (a `KC` block stores the partial sum and the next reloads it, exactly), so its bits depend
//! only on its own row of `x` and row of `w` — not on `m`, `n`, the tile it falls in or how
//! the product is split over threads. (The summation order differs from the decode kernel's
//! 16-lane dot product, so a prompt row and a decode row differ in rounding.)
// Register tiles are indexed `acc[r][c]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::x86::{w_at, BF16, F16, F32};
use super::x86_512::{check_gemm_nt, elem_bytes, load16, Avx512, Prefetch};
use super::FloatWeights;

/// Activation rows per register tile.
pub(super) const MR: usize = 8;
/// Weight rows (output columns) per packed panel and register tile: three 16-lane vectors,
/// so the tile is 24 accumulators.
pub(super) const NR: usize = super::PROMPT_PANEL_ROWS;
/// Most reduction steps per block: a `KC × NR` packed slice (≤ 30 KiB) stays in L1 while the
/// row blocks pass.
const KC: usize = 160;

thread_local! {
    /// The packed weight panel, per thread (grown, never shrunk: no allocation per call).
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Avx512 {
    /// `out[i·ldo + j] = x_i·w_j` for the `m` rows of `x` (`[m, k]`) and the `n` rows of `w`
    /// (`[n, k]`, f32, f16 or bf16: 16-bit weights are widened while packed, once per
    /// call); see the module note for the summation order, which makes every output equal
    /// to the product with the weight widened to f32 first, bit for bit.
    pub(super) fn gemm_nt_packed(
        self,
        x: &[f32],
        w: FloatWeights<'_>,
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        ldo: usize,
    ) {
        if trivial_product("gemm_nt_packed", x, w.len(), (m, k, n), out, ldo) {
            return;
        }
        PANEL.with(|p| {
            let mut panel = p.borrow_mut();
            if panel.len() < k * NR {
                panel.resize(k * NR, 0.0);
            }
            let (xp, wp, op, pp) = (
                x.as_ptr(),
                w.as_bytes().as_ptr(),
                out.as_mut_ptr(),
                panel.as_mut_ptr(),
            );
            // SAFETY: `self` proves the features; the asserts bound every row of `x` and `w`
            // (`w`'s bytes hold `n·k` elements of its type) and every output `i·ldo + j`
            // (i < m, j < n); `panel` holds `k·NR` values.
            unsafe {
                match w {
                    FloatWeights::F32(_) => packed::<F32>(xp, wp, (m, k, n), op, ldo, pp),
                    FloatWeights::F16(_) => packed::<F16>(xp, wp, (m, k, n), op, ldo, pp),
                    FloatWeights::BF16(_) => packed::<BF16>(xp, wp, (m, k, n), op, ldo, pp),
                }
            }
        });
    }
}

/// Checks a packed product's operands ([`check_gemm_nt`]) and settles the products with no
/// work: true (done) when `m` or `n` is zero, or when `k` is (the outputs are zeroed).
pub(super) fn trivial_product(
    name: &str,
    x: &[f32],
    w_len: usize,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    ldo: usize,
) -> bool {
    check_gemm_nt(name, x, w_len, (m, k, n), out, ldo);
    if m > 0 && n > 0 && k == 0 {
        for i in 0..m {
            out[i * ldo..i * ldo + n].fill(0.0);
        }
    }
    m == 0 || n == 0 || k == 0
}

/// The `KC` blocks of `0..k`: near-equal, multiples of 16 but the last.
pub(super) fn kc_for(k: usize) -> usize {
    k.div_ceil(k.div_ceil(KC)).next_multiple_of(16)
}

/// What a packed prompt GEMM plugs into [`drive_panels`]: how to pack a panel of weight rows
/// and how to run one register tile over the packed panel. The f32/f16/bf16-widening kernel
/// here and the bf16-pair kernel (`x86_512_bf16`) share the loop and differ only in these.
pub(super) trait PanelKernel {
    /// Packs weight rows `j0..j0 + nc` (`nc ≤ NR`) into the panel.
    ///
    /// # Safety
    /// The rows are inside the weight the kernel was built over.
    unsafe fn pack(&mut self, j0: usize, nc: usize);

    /// One `R × NR` tile over the packed panel, at `at` (activation rows `at.i0..at.i0 + R`).
    ///
    /// # Safety
    /// Rows, steps and columns are inside the product the kernel was built over, and the
    /// panel holds rows `at.j0..at.j0 + at.nc` (packed by [`Self::pack`]).
    unsafe fn tile<const R: usize>(&mut self, at: TileAt);

    /// Whether [`Self::tile`] issues `at.pf`'s prefetches itself, spread over its steps
    /// (decode batches, where [`super::stream::batch_prefetch`]); otherwise the driver issues
    /// each tile's share before the tile.
    const SPREADS_PREFETCH: bool = false;
}

/// Where a tile of [`drive_panels`] falls: activation rows from `i0`, reduction steps
/// `p0..p0 + kb`, output columns `j0..j0 + nc` (`nc ≤ NR`); `first` when `p0 == 0` (the sums
/// start from zero instead of the outputs).
#[derive(Copy, Clone, Debug)]
pub(super) struct TileAt {
    pub i0: usize,
    pub p0: usize,
    pub kb: usize,
    pub j0: usize,
    pub nc: usize,
    pub first: bool,
    /// The tile's share of the next panel's prefetch, where the kernel
    /// [`PanelKernel::SPREADS_PREFETCH`] (otherwise no lines).
    pub pf: Prefetch,
}

/// The panel loop of a packed prompt GEMM over `m` activation rows, `depth` reduction steps
/// (values, or pairs of values) and `n` weight rows of `row_bytes` bytes each at `w`: a panel
/// of [`NR`] weight rows is packed, then its [`kc_for`] blocks of steps pass every [`MR`]-row
/// block of activations, while the next panel's rows (contiguous) are prefetched, a share
/// per tile.
///
/// # Safety
/// `kern` is built over these `m`, `depth`, `n`, and `w` is readable for `n·row_bytes`
/// bytes; `m, n, depth > 0`.
#[inline(always)]
pub(super) unsafe fn drive_panels<K: PanelKernel>(
    kern: &mut K,
    (m, depth, n): (usize, usize, usize),
    w: *const u8,
    row_bytes: usize,
) {
    let kc = kc_for(depth);
    // Tile calls per panel, over which the next panel's weight rows are prefetched.
    let tiles = depth.div_ceil(kc) * m.div_ceil(MR);
    // Decode batches spread each share over the tile's steps (a burst of hundreds of lines
    // before a short tile waits on the memory instead).
    let spread = K::SPREADS_PREFETCH && m <= crate::cpu::gemm::SMALL_M && super::batch_prefetch();
    let mut j0 = 0;
    while j0 < n {
        let nc = (n - j0).min(NR);
        // The next panel is rows `j0 + nc..`, contiguous: `next` bytes from `w + (j0 + nc)·row`.
        let next = (n - j0 - nc).min(NR) * row_bytes;
        let per_tile = next.div_ceil(64).div_ceil(tiles) * 64;
        let mut pf = 0;
        let (next_lines, mut ti) = (next.div_ceil(64), 0);
        // SAFETY: weight rows `j0..j0 + nc ≤ n`, row blocks `i0..i0 + R ≤ m` and steps
        // `p0..p0 + kb ≤ depth`: inside the caller's guarantee; prefetches touch rows
        // `j0 + nc..n` only (and are hints: they never fault).
        unsafe {
            kern.pack(j0, nc);
            let wn = w.add((j0 + nc) * row_bytes);
            let mut p0 = 0;
            while p0 < depth {
                let kb = (depth - p0).min(kc);
                let first = p0 == 0;
                let mut i0 = 0;
                while i0 < m {
                    let mut share = Prefetch {
                        base: wn.cast(),
                        first: 0,
                        lines: 0,
                    };
                    if spread {
                        share.first = ti * next_lines / tiles;
                        share.lines = (ti + 1) * next_lines / tiles - share.first;
                        ti += 1;
                    } else {
                        let end = (pf + per_tile).min(next);
                        while pf < end {
                            _mm_prefetch::<_MM_HINT_T0>(wn.add(pf).cast());
                            pf += 64;
                        }
                    }
                    let rn = (m - i0).min(MR);
                    let at = TileAt {
                        i0,
                        p0,
                        kb,
                        j0,
                        nc,
                        first,
                        pf: share,
                    };
                    macro_rules! go {
                        ($($R:literal)*) => {
                            match rn {
                                $($R => kern.tile::<$R>(at),)*
                                _ => unreachable!(),
                            }
                        };
                    }
                    go!(8 7 6 5 4 3 2 1);
                    i0 += rn;
                }
                p0 += kb;
            }
        }
        j0 += nc;
    }
}

/// The f32 kernel over weights of type `W` (widened while packed): pointers as
/// [`packed`] receives them.
struct Widening<const W: u8> {
    x: *const f32,
    w: *const u8,
    k: usize,
    out: *mut f32,
    ldo: usize,
    panel: *mut f32,
}

impl<const W: u8> PanelKernel for Widening<W> {
    #[inline(always)]
    unsafe fn pack(&mut self, j0: usize, nc: usize) {
        // SAFETY: rows `j0..j0 + nc` of the `n·k`-element weight, the `k·NR` panel: the
        // caller's guarantee, which [`packed`]'s covers.
        unsafe {
            pack_panel::<W>(
                self.w.add(j0 * self.k * elem_bytes(W)),
                nc,
                self.k,
                self.panel,
            )
        }
    }

    #[inline(always)]
    unsafe fn tile<const R: usize>(&mut self, at: TileAt) {
        let (k, ldo, TileAt { i0, p0, j0, .. }) = (self.k, self.ldo, at);
        // SAFETY: rows `i0..i0 + R ≤ m` of `x` from step `p0`, the panel's steps
        // `p0..p0 + kb ≤ k`, outputs `(i0 + r)·ldo + j0 + c` (c < nc): the caller's guarantee.
        unsafe {
            let (a, c) = (self.x.add(i0 * k + p0), self.out.add(i0 * ldo + j0));
            tile::<R>(a, k, self.panel.add(p0 * NR), c, ldo, at)
        }
    }
}

/// # Safety
/// AVX-512F/F16C available; `x` readable for `m·k` f32s, `w` for `n·k` elements of type
/// `W`, `out` writable at `i·ldo + j` for `i < m`, `j < n`, `panel` writable for `k·NR`;
/// `m, n, k > 0`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn packed<const W: u8>(
    x: *const f32,
    w: *const u8,
    (m, k, n): (usize, usize, usize),
    out: *mut f32,
    ldo: usize,
    panel: *mut f32,
) {
    let mut kern = Widening::<W> {
        x,
        w,
        k,
        out,
        ldo,
        panel,
    };
    // SAFETY: the kernel is built over this product; the caller's guarantee is the driver's.
    unsafe { drive_panels(&mut kern, (m, k, n), w, k * elem_bytes(W)) }
}

/// Lanes `0..n` of a 16-lane mask (`n ≥ 16`: all).
#[inline(always)]
pub(super) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xFFFF
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// The masks of an `R × NR` tile's three 16-lane column vectors for its first `nc` columns.
#[inline(always)]
pub(super) fn col_masks(nc: usize) -> [__mmask16; 3] {
    [
        lanes(nc),
        lanes(nc.saturating_sub(16)),
        lanes(nc.saturating_sub(32)),
    ]
}

/// An `R × NR` tile's accumulators: zero when `first`, else the outputs `c[r·ldc + j]`
/// (masked to the columns of `mask`).
///
/// # Safety
/// AVX-512F available; unless `first`, `c` readable at `r·ldc + j` for `r < R` and the
/// columns `j` of `mask`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn load_tile<const R: usize>(
    c: *const f32,
    ldc: usize,
    mask: [__mmask16; 3],
    first: bool,
) -> [[__m512; 3]; R] {
    let mut acc = [[_mm512_setzero_ps(); 3]; R];
    if !first {
        for r in 0..R {
            for v in 0..3 {
                // SAFETY: masked to the caller's columns of row `r`.
                acc[r][v] = unsafe { _mm512_maskz_loadu_ps(mask[v], c.add(r * ldc + 16 * v)) };
            }
        }
    }
    acc
}

/// Stores an `R × NR` tile's accumulators into `c[r·ldc + j]` (masked to `mask`'s columns).
///
/// # Safety
/// AVX-512F available; `c` writable at `r·ldc + j` for `r < R` and the columns of `mask`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store_tile<const R: usize>(
    c: *mut f32,
    ldc: usize,
    mask: [__mmask16; 3],
    acc: &[[__m512; 3]; R],
) {
    for r in 0..R {
        for v in 0..3 {
            // SAFETY: masked to the caller's columns of row `r`.
            unsafe { _mm512_mask_storeu_ps(c.add(r * ldc + 16 * v), mask[v], acc[r][v]) };
        }
    }
}

/// One `R × NR` tile: `c[r·ldc + j] (+)= Σ_{p < kb} a[r·lda + p] · bp[p·NR + j]` for the
/// first `nc` columns, in order of `p`; `first` starts from zero instead of `c`.
///
/// # Safety
/// AVX-512F available; `a` readable for `R` rows of `kb` at stride `lda`, `bp` for
/// `kb·NR`, `c` readable and writable at `r·ldc + j` for `r < R`, `j < nc ≤ NR`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile<const R: usize>(
    a: *const f32,
    lda: usize,
    bp: *const f32,
    c: *mut f32,
    ldc: usize,
    TileAt { kb, nc, first, .. }: TileAt,
) {
    let mask = col_masks(nc);
    // SAFETY: loads and stores stay inside the caller's guarantee (masked to `nc` columns).
    unsafe {
        let mut acc = load_tile::<R>(c, ldc, mask, first);
        for p in 0..kb {
            let b = bp.add(p * NR);
            let (b0, b1, b2) = (
                _mm512_loadu_ps(b),
                _mm512_loadu_ps(b.add(16)),
                _mm512_loadu_ps(b.add(32)),
            );
            for r in 0..R {
                let av = _mm512_set1_ps(*a.add(r * lda + p));
                acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
            }
        }
        store_tile::<R>(c, ldc, mask, &acc);
    }
}

/// Packs weight rows `0..nc` (`nc ≤ NR`, each `k` elements of type `W`) into
/// `panel[p·NR + c] = w[c·k + p]` widened to f32, columns `nc..NR` zero.
///
/// # Safety
/// AVX-512F/F16C available; `w` readable for `nc·k` elements, `panel` writable for `k·NR`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn pack_panel<const W: u8>(w: *const u8, nc: usize, k: usize, panel: *mut f32) {
    // SAFETY: row `g·16 + t < nc` elements `p0..p0 + 16` (or `p0..k` in the tail), panel
    // rows `p0 + e < k`, columns `g·16..g·16 + 16 ≤ NR`.
    unsafe {
        for g in 0..NR / 16 {
            let mut p0 = 0;
            while p0 < k {
                let mut r = [_mm512_setzero_ps(); 16];
                for t in 0..16 {
                    if g * 16 + t < nc {
                        let row = (g * 16 + t) * k;
                        r[t] = if p0 + 16 <= k {
                            load16::<W>(w, row + p0)
                        } else {
                            let mut v = [0.0f32; 16];
                            for (e, ve) in v.iter_mut().enumerate().take(k - p0) {
                                *ve = w_at::<W>(w, row + p0 + e);
                            }
                            _mm512_loadu_ps(v.as_ptr())
                        };
                    }
                }
                let cols = transpose16(r);
                for e in 0..(k - p0).min(16) {
                    _mm512_storeu_ps(panel.add((p0 + e) * NR + g * 16), cols[e]);
                }
                p0 += 16;
            }
        }
    }
}

/// The transpose of a 16 × 16 block held as 16 row vectors: `out[j][i] = r[i][j]`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Stage 1: per 128-bit lane L, t[2i] = (a0 b0 a1 b1), t[2i+1] = (a2 b2 a3 b3) of rows
    // a = r[2i], b = r[2i+1] (elements 4L..4L+4).
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Stage 2: u[4i + e], lane L = element 4L + e of rows 4i..4i + 4.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let pd = |v: __m512| _mm512_castps_pd(v);
        let (t0, t1, t2, t3) = (
            pd(t[4 * i]),
            pd(t[4 * i + 1]),
            pd(t[4 * i + 2]),
            pd(t[4 * i + 3]),
        );
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    // Stages 3–4: column 4L + e gathers lane L of u[e], u[4 + e], u[8 + e], u[12 + e].
    let mut out = [_mm512_setzero_ps(); 16];
    for e in 0..4 {
        let s0 = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]);
        let s1 = _mm512_shuffle_f32x4::<0xDD>(u[e], u[4 + e]);
        let s2 = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
        let s3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + e], u[12 + e]);
        out[e] = _mm512_shuffle_f32x4::<0x88>(s0, s2);
        out[4 + e] = _mm512_shuffle_f32x4::<0x88>(s1, s3);
        out[8 + e] = _mm512_shuffle_f32x4::<0xDD>(s0, s2);
        out[12 + e] = _mm512_shuffle_f32x4::<0xDD>(s1, s3);
    }
    out
}
