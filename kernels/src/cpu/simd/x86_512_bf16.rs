//! The prompt GEMM over bf16 weights on CPUs with AVX512-BF16 (`vdpbf16ps`): the activation
//! rows are rounded to bf16 (to nearest even, once per call), as a bf16 model computes in
//! PyTorch and llama.cpp, and every instruction multiplies 32 bf16 pairs into 16 f32 sums —
//! twice the products per instruction of the f32 FMA kernel. Same blocking as the f32 packed
//! kernel (`x86_512_gemm`): a panel of [`NR`] weight rows packed once per call as bf16 pairs
//! (`[k/2][NR]` 32-bit lanes, a 16 × 16 transpose), an `MR` × [`NR`] register tile that
//! broadcasts one activation pair per row.
//!
//! Each output is one sequential chain over the pairs `p = 0..⌈k/2⌉` starting from zero
//! (`acc = vdpbf16ps(acc, x pair, w pair)`, a `KC` block storing the partial sum and the next
//! reloading it exactly), so its bits depend only on its own row of `x` and row of `w`, not
//! on `m`, `n`, the tile or a split over threads. Every product of two bf16 values is exact
//! in f32, so each step adds exact products, rounded to f32 (denormals flushed, as
//! `vdpbf16ps` does).
// Register tiles are indexed `acc[r][c]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::atomic::AtomicU8;

use half::bf16;

use super::x86_512::{Avx512, Prefetch};
use super::x86_512_gemm::{
    col_masks, drive_panels, load_tile, store_tile, transpose16, trivial_product, PanelKernel,
    TileAt, NR,
};

thread_local! {
    /// The packed weight panel (bf16 pairs) and the activations rounded to bf16 pairs, per
    /// thread (grown, never shrunk: no allocation per call).
    static SCRATCH: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Proof that this CPU has AVX512-BF16 (and AVX-512F).
#[derive(Copy, Clone, Debug)]
pub(super) struct Avx512Bf16 {
    _detected: (),
}

/// 0 = not yet decided, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

impl Avx512Bf16 {
    /// The token when AVX-512F is in use ([`Avx512::enabled`]), the CPU has AVX512-BF16
    /// and the environment does not set `THAW_BF16_DOT=0` (read once; for A/B runs).
    #[inline]
    pub(super) fn enabled() -> Option<Self> {
        let on = super::decided_once(&STATE, || {
            Avx512::enabled().is_some()
                && is_x86_feature_detected!("avx512bf16")
                && !crate::cpu::switched_off("THAW_BF16_DOT")
        });
        on.then_some(Self { _detected: () })
    }

    /// `out[i·ldo + j] = bf16(x_i)·w_j` for the `m` rows of `x` (`[m, k]`, rounded to bf16)
    /// and the `n` bf16 rows of `w` (`[n, k]`); see the module note for the summation order.
    pub(super) fn gemm_nt_packed(
        self,
        x: &[f32],
        w: &[bf16],
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        ldo: usize,
    ) {
        if trivial_product("gemm_nt_bf16dot", x, w.len(), (m, k, n), out, ldo) {
            return;
        }
        let kp = k.div_ceil(2);
        SCRATCH.with(|s| {
            let (panel, xb) = &mut *s.borrow_mut();
            if panel.len() < kp * NR {
                panel.resize(kp * NR, 0);
            }
            if xb.len() < m * kp {
                xb.resize(m * kp, 0);
            }
            for (row, pairs) in x[..m * k].chunks_exact(k).zip(xb.chunks_exact_mut(kp)) {
                // SAFETY: `self` proves AVX-512F.
                unsafe { to_pairs_avx512(row, pairs) };
            }
            // SAFETY: `self` proves AVX512-BF16 and AVX-512F; the asserts bound every row of
            // `w` and every output `i·ldo + j` (i < m, j < n); `xb` holds `m` rows of `kp`
            // pairs and `panel` `kp·NR` pairs.
            unsafe {
                packed(
                    xb.as_ptr(),
                    w.as_ptr().cast(),
                    (m, k, n),
                    out.as_mut_ptr(),
                    ldo,
                    panel.as_mut_ptr(),
                )
            }
        });
    }
}

/// `row` rounded to bf16 (nearest even), as pairs: pair `p` holds element `2p` in its low
/// half and `2p + 1` (or zero past the end) in its high half.
pub(super) fn to_pairs(row: &[f32], pairs: &mut [u32]) {
    for (p, out) in pairs.iter_mut().enumerate() {
        let lo = bf16::from_f32(row[2 * p]).to_bits() as u32;
        let hi = row
            .get(2 * p + 1)
            .map_or(0, |&v| bf16::from_f32(v).to_bits() as u32);
        *out = lo | (hi << 16);
    }
}

/// [`to_pairs`], 16 values per step: the same rounding (to nearest even; a NaN keeps its top
/// bits and is made quiet) in integer lanes, bit for bit, then the 16 halves narrowed into 8
/// pairs (`vpmovdw`: element `2p` lands in the low half of pair `p`). At prompt sizes the
/// scalar loop cost about a tenth of the product itself (hundreds of millions of values per
/// prefill of 2,048 tokens).
///
/// # Safety
/// AVX-512F available.
#[target_feature(enable = "avx512f,avx2")]
pub(super) unsafe fn to_pairs_avx512(row: &[f32], pairs: &mut [u32]) {
    assert_eq!(
        pairs.len(),
        row.len().div_ceil(2),
        "to_pairs: pairs for {} values",
        row.len()
    );
    let full = row.len() / 16;
    let (one, half, abs, inf, quiet) = (
        _mm512_set1_epi32(1),
        _mm512_set1_epi32(0x7FFF),
        _mm512_set1_epi32(0x7FFF_FFFF),
        _mm512_set1_epi32(0x7F80_0000),
        _mm512_set1_epi32(0x0040),
    );
    for c in 0..full {
        // SAFETY: values `16c..16c + 16 ≤ row.len()`, pairs `8c..8c + 8 ≤ pairs.len()`.
        unsafe {
            let x = _mm512_loadu_si512(row.as_ptr().add(16 * c).cast());
            let top = _mm512_srli_epi32::<16>(x);
            // x + 0x7FFF + (bit 16 of x), then the top half: ties go to the even half.
            let lsb = _mm512_and_si512(top, one);
            let near = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(half, lsb)));
            let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, abs), inf);
            let v = _mm512_mask_blend_epi32(nan, near, _mm512_or_si512(top, quiet));
            _mm256_storeu_si256(
                pairs.as_mut_ptr().add(8 * c).cast(),
                _mm512_cvtepi32_epi16(v),
            );
        }
    }
    to_pairs(&row[16 * full..], &mut pairs[8 * full..]);
}

/// The bf16-pair kernel: pointers as [`packed`] receives them.
struct Pairs {
    xb: *const u32,
    w: *const u16,
    k: usize,
    out: *mut f32,
    ldo: usize,
    panel: *mut u32,
}

impl PanelKernel for Pairs {
    #[inline(always)]
    unsafe fn pack(&mut self, j0: usize, nc: usize) {
        // SAFETY: rows `j0..j0 + nc` of the `n·k` bf16s, the `⌈k/2⌉·NR` panel: the caller's
        // guarantee, which [`packed`]'s covers.
        unsafe { pack_panel(self.w.add(j0 * self.k), nc, self.k, self.panel) }
    }

    #[inline(always)]
    unsafe fn tile<const R: usize>(&mut self, at: TileAt) {
        let (kp, ldo, TileAt { i0, p0, j0, .. }) = (self.k.div_ceil(2), self.ldo, at);
        // SAFETY: rows `i0..i0 + R ≤ m` of `xb` from pair `p0`, the panel's pairs
        // `p0..p0 + kb ≤ ⌈k/2⌉`, outputs `(i0 + r)·ldo + j0 + c` (c < nc): the caller's
        // guarantee.
        unsafe {
            let (a, c) = (self.xb.add(i0 * kp + p0), self.out.add(i0 * ldo + j0));
            tile::<R>(a, kp, self.panel.add(p0 * NR), c, ldo, at)
        }
    }
}

/// # Safety
/// AVX512-BF16/AVX-512F available; `xb` readable for `m` rows of `⌈k/2⌉` pairs, `w` for
/// `n·k` bf16s, `out` writable at `i·ldo + j` for `i < m`, `j < n`, `panel` writable for
/// `⌈k/2⌉·NR` pairs; `m, n, k > 0`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn packed(
    xb: *const u32,
    w: *const u16,
    (m, k, n): (usize, usize, usize),
    out: *mut f32,
    ldo: usize,
    panel: *mut u32,
) {
    let mut kern = Pairs {
        xb,
        w,
        k,
        out,
        ldo,
        panel,
    };
    // SAFETY: the kernel is built over this product (`⌈k/2⌉` pair steps); the caller's
    // guarantee is the driver's.
    unsafe { drive_panels(&mut kern, (m, k.div_ceil(2), n), w.cast(), k * 2) }
}

/// One `R × NR` tile: `c[r·ldc + j] (+)= Σ_{p < kb} a[r·lda + p] · bp[p·NR + j]` (pairs of
/// bf16, `vdpbf16ps`) for the first `nc` columns, in order of `p`; `first` starts from zero
/// instead of `c`.
///
/// # Safety
/// AVX512-BF16/AVX-512F available; `a` readable for `R` rows of `kb` pairs at stride `lda`,
/// `bp` for `kb·NR` pairs, `c` readable and writable at `r·ldc + j` for `r < R`, `j < nc ≤ NR`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn tile<const R: usize>(
    a: *const u32,
    lda: usize,
    bp: *const u32,
    c: *mut f32,
    ldc: usize,
    TileAt { kb, nc, first, .. }: TileAt,
) {
    let mask = col_masks(nc);
    let bh = |v: __m512i| -> __m512bh {
        // SAFETY: `__m512bh` is 32 bf16 values in the same 512 bits as `v`.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    };
    // SAFETY: loads and stores stay inside the caller's guarantee (masked to `nc` columns).
    unsafe {
        let mut acc = load_tile::<R>(c, ldc, mask, first);
        for p in 0..kb {
            let b = bp.add(p * NR);
            let (b0, b1, b2) = (
                bh(_mm512_loadu_si512(b.cast())),
                bh(_mm512_loadu_si512(b.add(16).cast())),
                bh(_mm512_loadu_si512(b.add(32).cast())),
            );
            for r in 0..R {
                let av = bh(_mm512_set1_epi32(*a.add(r * lda + p) as i32));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
            }
        }
        store_tile::<R>(c, ldc, mask, &acc);
    }
}

/// Packs bf16 weight rows `0..nc` (`nc ≤ NR`, each `k` long) into
/// `panel[p·NR + c] = (w[c·k + 2p], w[c·k + 2p + 1])` (a bf16 pair; zero past `k`), columns
/// `nc..NR` zero.
///
/// # Safety
/// AVX-512F available; `w` readable for `nc·k` bf16s, `panel` writable for `⌈k/2⌉·NR` pairs.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn pack_panel(w: *const u16, nc: usize, k: usize, panel: *mut u32) {
    let kp = k.div_ceil(2);
    // SAFETY: row `g·16 + t < nc` elements `2·p0..2·p0 + 32` (or the scalar tail up to `k`),
    // panel rows `p0 + e < kp`, columns `g·16..g·16 + 16 ≤ NR`.
    unsafe {
        for g in 0..NR / 16 {
            let mut p0 = 0;
            while p0 < kp {
                let mut r = [_mm512_setzero_ps(); 16];
                for t in 0..16 {
                    if g * 16 + t < nc {
                        let row = w.add((g * 16 + t) * k);
                        r[t] = if 2 * p0 + 32 <= k {
                            _mm512_loadu_ps(row.add(2 * p0).cast())
                        } else {
                            let mut v = [0u16; 32];
                            for (e, ve) in v.iter_mut().enumerate().take(k - 2 * p0) {
                                *ve = row.add(2 * p0 + e).read_unaligned();
                            }
                            _mm512_loadu_ps(v.as_ptr().cast())
                        };
                    }
                }
                let cols = transpose16(r);
                for e in 0..(kp - p0).min(16) {
                    _mm512_storeu_ps(panel.add((p0 + e) * NR + g * 16).cast(), cols[e]);
                }
                p0 += 16;
            }
        }
    }
}

/// Weight rows per register tile of [`Avx512Bf16::gemm_nt_rows`].
const RJ: usize = 4;
/// Activation rows per register tile of [`Avx512Bf16::gemm_nt_rows`].
const RR: usize = 4;

impl Avx512Bf16 {
    /// `out[i·ldo + j] = bf16(x_i)·w_j` for decode-sized `m` (one row up to a batch), the
    /// weight read in place: an `RR × RJ` register tile of 16-lane accumulators, each step
    /// one `vdpbf16ps` of 16 pairs of `x_i` (rounded to bf16 once per call) against 16 pairs
    /// of `w_j` as stored — no widening, twice the products per instruction of the f32 FMA.
    /// Lane `l` of output `(i, j)` sums the pairs `p ≡ l (mod 16)` in order of `p`, then the
    /// 16 lanes are added in one fixed tree ([`lane_sum`]): every output's bits depend only
    /// on its own two rows, not on `m`, `n`, the tile or a split over threads, so a decode
    /// row gets the same result alone and in a batch. Returns false (doing nothing) for odd
    /// `k` (a weight row would start inside a pair).
    pub(super) fn gemm_nt_rows(
        self,
        x: &[f32],
        w: &[bf16],
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        ldo: usize,
    ) -> bool {
        if k % 2 == 1 {
            return false;
        }
        if trivial_product("gemm_nt_bf16rows", x, w.len(), (m, k, n), out, ldo) {
            return true;
        }
        let kp = k / 2;
        // Each row's pairs padded with zeros to whole 16-pair vectors.
        let stride = kp.next_multiple_of(16);
        SCRATCH.with(|s| {
            let (_, xb) = &mut *s.borrow_mut();
            if xb.len() < m * stride {
                xb.resize(m * stride, 0);
            }
            for (row, pairs) in x[..m * k].chunks_exact(k).zip(xb.chunks_exact_mut(stride)) {
                // SAFETY: `self` proves AVX-512F.
                unsafe { to_pairs_avx512(row, &mut pairs[..kp]) };
                pairs[kp..].fill(0);
            }
            // SAFETY: `self` proves AVX512-BF16 and AVX-512F; the asserts bound every row of
            // `w` (`n·k` bf16s, `k` even) and every output `i·ldo + j` (i < m, j < n); `xb`
            // holds `m` rows of `stride` pairs.
            unsafe {
                rows_kernel(
                    xb.as_ptr(),
                    stride,
                    w.as_ptr().cast(),
                    (m, kp, n),
                    out.as_mut_ptr(),
                    ldo,
                )
            }
        });
        true
    }
}

/// The tiles of [`Avx512Bf16::gemm_nt_rows`]: weight rows outermost (a tile of `RJ` rows
/// stays in L1 while every activation row passes it).
///
/// # Safety
/// AVX512-BF16/AVX-512F available; `xb` readable for `m` rows of `stride ≥ kp` pairs (zero
/// from `kp` on, `stride` a multiple of 16), `w` for `n` rows of `kp` pairs, `out` writable at
/// `i·ldo + j` for `i < m`, `j < n`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn rows_kernel(
    xb: *const u32,
    stride: usize,
    w: *const u32,
    (m, kp, n): (usize, usize, usize),
    out: *mut f32,
    ldo: usize,
) {
    // One activation row streams one weight row at a time (from memory, four rows read side
    // by side measured 1.2–2.2× slower, `examples/bf16_rows.rs`); batches share a tile of
    // `RJ` weight rows. Each output's bits are the same either way.
    let rj = if m == 1 { 1 } else { RJ };
    // A batch reads a tile's weight rows from memory in its first pass over the activation
    // rows and from L1 in the others, so the memory idles while the later passes compute:
    // every pass prefetches its share of the next tile's rows instead (`THAW_BF16_PREFETCH=0`
    // turns it off, for A/B runs).
    let passes = m.div_ceil(RR);
    let prefetch = m > 1 && prefetch_on();
    let mut j = 0;
    while j < n {
        let jn = (n - j).min(rj);
        let next_lines = if prefetch {
            ((n - j - jn).min(rj) * kp * 4).div_ceil(64)
        } else {
            0
        };
        let mut i = 0;
        while i < m {
            let rn = (m - i).min(RR);
            let g = i / RR;
            let pf = Prefetch {
                // Line `a` of the next tile's rows (which follow this tile's in memory).
                base: w.wrapping_add((j + jn) * kp).cast(),
                first: g * next_lines / passes,
                lines: (g + 1) * next_lines / passes - g * next_lines / passes,
            };
            // SAFETY: weight rows `j..j + jn ≤ n`, activation rows `i..i + rn ≤ m`, outputs
            // `(i + r)·ldo + j + jj`: inside the caller's guarantee (prefetches of the next
            // tile's rows touch no memory).
            unsafe {
                let (xi, wj, o) = (xb.add(i * stride), w.add(j * kp), out.add(i * ldo + j));
                macro_rules! go {
                    ($($J:literal, $R:literal);*) => {
                        match (jn, rn) {
                            $(($J, $R) => rows_tile::<$J, $R>(xi, stride, wj, kp, o, ldo, pf),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(4,4; 4,3; 4,2; 4,1; 3,4; 3,3; 3,2; 3,1; 2,4; 2,3; 2,2; 2,1; 1,4; 1,3; 1,2; 1,1);
            }
            i += rn;
        }
        j += jn;
    }
}

/// 0 = not yet decided, 1 = off, 2 = on.
static PREFETCH: AtomicU8 = AtomicU8::new(0);

/// Whether batches prefetch the next weight tile (`THAW_BF16_PREFETCH=0` turns it off).
fn prefetch_on() -> bool {
    super::decided_once(&PREFETCH, || {
        !crate::cpu::switched_off("THAW_BF16_PREFETCH")
    })
}

/// One `R × J` tile of [`rows_kernel`]: `out[r·ldo + jj] = Σ_p xb[r·stride + p] · w[jj·kp + p]`
/// over bf16 pairs, lanes summed by [`lane_sum`].
///
/// # Safety
/// AVX512-BF16/AVX-512F available; `xb` readable for `R` rows of `stride` pairs (a multiple
/// of 16, zero from `kp`), `w` for `J` rows of `kp` pairs, `out` writable at `r·ldo + jj`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
unsafe fn rows_tile<const J: usize, const R: usize>(
    xb: *const u32,
    stride: usize,
    w: *const u32,
    kp: usize,
    out: *mut f32,
    ldo: usize,
    pf: Prefetch,
) {
    let bh = |v: __m512i| -> __m512bh {
        // SAFETY: `__m512bh` is 32 bf16 values in the same 512 bits as `v`.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    };
    // Lines per step, the last steps fewer (none past the tile's share).
    let per = pf.lines.div_ceil(kp.div_ceil(16));
    // SAFETY: weight loads read pairs `< kp` of the J rows (the last step masked), activation
    // loads pairs `< stride` of the R rows; stores hit the R × J outputs; prefetches are hints
    // (addresses formed with `wrapping_add`, never dereferenced).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; J];
        let mut p = 0;
        let mut line = pf.first;
        let end = pf.first + pf.lines;
        while p < kp {
            for _ in 0..per {
                if line < end {
                    _mm_prefetch::<_MM_HINT_T0>(pf.base.wrapping_add(64 * line));
                    line += 1;
                }
            }
            let mask: __mmask16 = if p + 16 <= kp {
                0xFFFF
            } else {
                (1u16 << (kp - p)) - 1
            };
            let mut wv = [bh(_mm512_setzero_si512()); J];
            for jj in 0..J {
                wv[jj] = bh(_mm512_maskz_loadu_epi32(mask, w.add(jj * kp + p).cast()));
            }
            for r in 0..R {
                let xv = bh(_mm512_loadu_si512(xb.add(r * stride + p).cast()));
                for jj in 0..J {
                    acc[jj][r] = _mm512_dpbf16_ps(acc[jj][r], xv, wv[jj]);
                }
            }
            p += 16;
        }
        if J == 4 && R == 4 {
            // Lane `4r + jj` of the sums is output `(r, jj)`: each 128-bit block is one
            // activation row's four outputs, side by side in `out`.
            let sums = lane_sums16(std::array::from_fn(|t| acc[t / 4][t % 4]));
            for r in 0..R {
                let block = match r {
                    0 => _mm512_extractf32x4_ps::<0>(sums),
                    1 => _mm512_extractf32x4_ps::<1>(sums),
                    2 => _mm512_extractf32x4_ps::<2>(sums),
                    _ => _mm512_extractf32x4_ps::<3>(sums),
                };
                _mm_storeu_ps(out.add(r * ldo), block);
            }
        } else {
            for jj in 0..J {
                for r in 0..R {
                    *out.add(r * ldo + jj) = lane_sum(acc[jj][r]);
                }
            }
        }
    }
}

/// [`lane_sum`] of 16 vectors at once, the same additions (halves, quarters, pairs, then the
/// last pair; addition of the same two operands, so the same bits) done four or eight sums
/// per instruction: lane `4b + c` of the result is the sum of `a[4c + b]`. A decode batch's
/// 4 × 4 tile spent about a third as many instructions on [`lane_sum`] as on its products
/// at `k = 576`.
///
/// # Safety
/// AVX-512F available.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn lane_sums16(a: [__m512; 16]) -> __m512 {
    // Halves: h[k] = [a[2k].lo256 + a[2k].hi256, a[2k+1].lo256 + a[2k+1].hi256].
    let h: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    });
    // Quarters: block b of q[m] is a[4m + b]'s lo128 + hi128 of its half.
    let q: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (h[2 * m], h[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    });
    // Pairs: block b of d[n] holds (l0 + l2, l1 + l3) of a[8n + b], then of a[8n + 4 + b].
    let d: [__m512; 2] = std::array::from_fn(|n| {
        let (x, y) = (q[2 * n], q[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
        )
    });
    // The last pair: block b = sums of a[b], a[4 + b], a[8 + b], a[12 + b].
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
    )
}

/// The 16 lanes of `v` added in one fixed tree: halves, quarters, then pairs
/// (`((l0 + l8) + (l4 + l12)) + …`), the same sequence wherever it is inlined.
///
/// # Safety
/// AVX-512F available.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn lane_sum(v: __m512) -> f32 {
    {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps::<1>(d, d)))
    }
}
