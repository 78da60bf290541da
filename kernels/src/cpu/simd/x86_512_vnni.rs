//! Q8_0, Q4_K and Q4_1 products on 8-bit activations with AVX512-VNNI
//! (`vpdpbusd`), as llama.cpp computes them: each activation row is quantised once per call to 32-value Q8 blocks
//! ([`super::quantize_q8_for`]: `x ≈ d·q`, `q ∈ [−127, 127]`), every weight block is an integer
//! dot with the activation block (exact in i32) and one f32 step scales it by the two block
//! scales. One kernel serves decode batches and prompt rows; up to [`ROW_KERNEL_MAX_M`] rows
//! take the same arithmetic without the pack (`x86_512_vnni_row`), so a row's result never
//! depends on its batch.
//!
//! Layout: the packed panel driver of the prompt GEMM ([`drive_panels`]) over reduction steps
//! of 4 values. A panel of [`NR`] weight rows is packed once per call as `[step][NR]` 32-bit
//! lanes, each holding 4 consecutive weight codes of one row (a 16 × 16 transpose of 4-byte
//! groups), with per (block, row) f32 scales, and for Q4_K/Q4_1 the scaled minimums. A register
//! tile of up to [`VR`] activation rows × 48 weight rows broadcasts 4 activation codes per
//! row against three 16-lane weight vectors: 64 products per instruction.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. For Q8_0 the activation codes are stored
//! offset by 128 (`q ^ 0x80`, unsigned) and the weight codes stay signed; each block's integer
//! sum starts from `−128·Σw` of its weight block (from the pack), so it ends at exactly
//! `Σ q·w` (|sum| < 2²⁴: its f32 conversion is exact). The 4-bit codes `0..15` of Q4_K and
//! Q4_1 are the unsigned operand as they are and the activation codes the signed one, each sum
//! starting from zero: the same `Σ q·w` without the offset pass over the activations or a copy
//! of the sum's start per row and block (`super::tuning`; `THAW_PROMPT_TUNING=0` brings back
//! the offset form for them too).
//!
//! Per output, in order of the blocks `b`: `acc = fma(f32(Σ q·w) · d_x, d_w, acc)`, and for
//! Q4_K/Q4_1 then `acc = acc − m_w · s_x` (Q4_K: `d_w = d·sc_j`, `m_w = dmin·m_j`; Q4_1:
//! `d_w = d`, `m_w = −m`; `s_x = d_x·Σq`), the
//! sum starting from zero and stored/reloaded exactly at the driver's block boundaries, so
//! every output's bits depend only on its own two rows. The error against the f32 product with
//! the dequantised weights is the activation rounding `Σ_b (d_b / 2)·‖w_b‖₁` plus f32 rounding
//! (see [`super`] and the tests).
// Register tiles are indexed `acc[r][v]` in step with pointer offsets.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};

use super::x86_512::Avx512;
use super::x86_512_gemm::{
    col_masks, drive_panels, load_tile, store_tile, transpose16, trivial_product, PanelKernel,
    TileAt, NR,
};
use super::{quantize_q8_for, Q8Block, Q8_BLOCK};
use crate::cpu::quant::WeightFormat;

/// Activation rows per register tile (12 f32 and 12 i32 accumulators, 3 weight vectors and
/// one broadcast: 28 of the 32 registers).
const VR: usize = 4;
/// Most activation rows that take the in-place row kernel, each row on its own, instead of
/// packing a panel: in the A/B of `benches/results/cpu-precisions.md` (2026-11-27) the pack
/// cost about as much as 3.5–5 in-place rows on SmolLM2's projections (Q8_0 and Q4_K).
const ROW_KERNEL_MAX_M: usize = 3;
/// Reduction steps (of 4 values) per 32-value block.
const STEPS: usize = Q8_BLOCK / 4;

use super::stream::row_product_ahead;
use super::x86_512_vnni_row::{row_product, Q4_1, Q4_K, Q8_0};

/// Proof that this CPU has AVX512-VNNI, AVX512-BW and AVX512-VL (and AVX-512F).
#[derive(Copy, Clone, Debug)]
pub(super) struct Avx512Vnni {
    _detected: (),
}

/// 0 = not yet decided, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

fn detect() -> bool {
    Avx512::enabled().is_some()
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

thread_local! {
    /// The activation rows quantised to Q8 (codes offset by 128) and the packed panel, per
    /// thread (grown, never shrunk: no allocation per call).
    static SCRATCH: RefCell<(Vec<Q8Block>, Panel)> = RefCell::new((Vec::new(), Panel::default()));
}

/// A packed panel of [`NR`] weight rows: codes as `[step][NR]` 4-byte groups, and per
/// `[block][NR]` the start of each integer sum (`−128·Σw`), the scale and (Q4_K) the scaled
/// minimum.
#[derive(Default)]
struct Panel {
    q: Vec<u32>,
    start: Vec<i32>,
    scale: Vec<f32>,
    min: Vec<f32>,
}

impl Panel {
    fn reserve(&mut self, k: usize) {
        let kb = k / Q8_BLOCK;
        if self.q.len() < k / 4 * NR {
            self.q.resize(k / 4 * NR, 0);
        }
        if self.start.len() < kb * NR {
            self.start.resize(kb * NR, 0);
            self.scale.resize(kb * NR, 0.0);
            self.min.resize(kb * NR, 0.0);
        }
    }
}

impl Avx512Vnni {
    /// The token when AVX-512F is in use ([`Avx512::enabled`]), the CPU has AVX512-VNNI,
    /// AVX512-BW and AVX512-VL, and the environment does not set `THAW_VNNI_DOT=0` (read once; for A/B runs)
    /// or [`Self::set`] turned it off.
    #[inline]
    pub(super) fn enabled() -> Option<Self> {
        let on = super::decided_once(&STATE, || {
            detect() && !crate::cpu::switched_off("THAW_VNNI_DOT")
        });
        on.then_some(Self { _detected: () })
    }

    /// Turns the kernel on (where the CPU has it) or off for the whole process; returns
    /// whether it was on.
    pub(super) fn set(on: bool) -> bool {
        let was = Self::enabled().is_some();
        STATE.store(if on && detect() { 2 } else { 1 }, Ordering::Relaxed);
        was
    }

    /// `out[i·ldo + j] = q8(x_i)·w_j` for the `m` rows of `x` (`[m, k]`) and the `n` rows of
    /// `w` (whole blocks of `format`: Q8_0, Q4_K or Q4_1); see the module note. Q8_0 leaves
    /// the panel's minimums unused.
    pub(super) fn gemm_nt(
        self,
        format: WeightFormat,
        w: &[u8],
        x: &[f32],
        (m, k, n): (usize, usize, usize),
        out: &mut [f32],
        ldo: usize,
    ) {
        assert!(
            matches!(
                format,
                WeightFormat::Q8_0 | WeightFormat::Q4_K | WeightFormat::Q4_1
            ),
            "gemm_nt_vnni: {} weights",
            format.name()
        );
        let rb = format
            .bytes_for(k)
            .unwrap_or_else(|| panic!("gemm_nt_vnni: rows of {k} are not whole {format} blocks"));
        assert_eq!(w.len(), n * rb, "gemm_nt_vnni: w is not {n} rows of {k}");
        if trivial_product("gemm_nt_vnni", x, n * k, (m, k, n), out, ldo) {
            return;
        }
        let kb = k / Q8_BLOCK;
        SCRATCH.with(|s| {
            let (xq, panel) = &mut *s.borrow_mut();
            if xq.len() < m * kb {
                xq.resize(m * kb, Q8Block::default());
            }
            if m <= ROW_KERNEL_MAX_M {
                // Too few rows to pay for the panel: the weight is read in place, once per
                // row (`x86_512_vnni_row`, bit for bit this kernel's result).
                assert!(
                    rb <= i32::MAX as usize / 8,
                    "gemm_nt_vnni: rows of {rb} bytes"
                );
                for i in 0..m {
                    quantize_q8_for(format, &x[i * k..(i + 1) * k], &mut xq[..kb]);
                    let (wp, xp) = (w.as_ptr(), xq.as_ptr());
                    let op = out[i * ldo..].as_mut_ptr();
                    // SAFETY: `self` proves the features (VL included); `w` holds `n` rows
                    // of `rb` bytes of `format` (asserted), `xq` `kb` blocks quantised from
                    // row `i` of `x` (codes in −127..=127), `out` at least `n` values from
                    // `i·ldo` (`trivial_product`), `n, kb > 0` (not trivial) and
                    // `8·rb ≤ i32::MAX` (asserted).
                    unsafe {
                        // Streamed (`super::stream`): the same arithmetic, faster from memory.
                        let ahead = super::stream::row_stream();
                        match format {
                            WeightFormat::Q8_0 if ahead => {
                                row_product_ahead::<Q8_0>(wp, rb, n, xp, kb, op)
                            }
                            WeightFormat::Q4_1 if ahead => {
                                row_product_ahead::<Q4_1>(wp, rb, n, xp, kb, op)
                            }
                            _ if ahead => row_product_ahead::<Q4_K>(wp, rb, n, xp, kb, op),
                            WeightFormat::Q8_0 => row_product::<Q8_0>(wp, rb, n, xp, kb, op),
                            WeightFormat::Q4_1 => row_product::<Q4_1>(wp, rb, n, xp, kb, op),
                            _ => row_product::<Q4_K>(wp, rb, n, xp, kb, op),
                        }
                    }
                }
                return;
            }
            // 4-bit codes (0..15) are the unsigned operand of `vpdpbusd` as they are, so the
            // activation codes stay signed and each sum starts from zero (see the module note).
            let unsigned_w = format != WeightFormat::Q8_0 && super::tuning::prompt_tuning();
            for (row, blocks) in x[..m * k].chunks_exact(k).zip(xq.chunks_exact_mut(kb)) {
                quantize_q8_for(format, row, blocks);
                if unsigned_w {
                    continue;
                }
                for b in blocks.iter_mut() {
                    for q in b.qs.iter_mut() {
                        *q ^= i8::MIN; // + 128 as an unsigned byte
                    }
                }
            }
            // The Q4_K pack gathers 16 rows' scales at offsets up to `15·rb`.
            assert!(
                rb <= i32::MAX as usize / 16,
                "gemm_nt_vnni: rows of {rb} bytes"
            );
            panel.reserve(k);
            let kern = Vnni {
                x: xq.as_ptr(),
                kb,
                w: w.as_ptr(),
                rb,
                out: out.as_mut_ptr(),
                ldo,
                q: panel.q.as_mut_ptr(),
                start: panel.start.as_mut_ptr(),
                scale: panel.scale.as_mut_ptr(),
                min: panel.min.as_mut_ptr(),
            };
            // SAFETY: `self` proves the features; the asserts bound every row of `w` (`n`
            // rows of `rb` bytes, `16·rb ≤ i32::MAX`) and every output `i·ldo + j` (i < m,
            // j < n); `xq` holds `m` rows of `kb` blocks and the panel `k/4·NR` groups and
            // `kb·NR` scales.
            unsafe {
                match (format, unsigned_w) {
                    (WeightFormat::Q8_0, _) => run::<Q8_0, false>(kern, (m, k, n)),
                    (WeightFormat::Q4_1, true) => run::<Q4_1, true>(kern, (m, k, n)),
                    (WeightFormat::Q4_1, false) => run::<Q4_1, false>(kern, (m, k, n)),
                    (_, true) => run::<Q4_K, true>(kern, (m, k, n)),
                    _ => run::<Q4_K, false>(kern, (m, k, n)),
                }
            }
        });
    }
}

/// The VNNI kernel over one product: pointers as [`Avx512Vnni::gemm_nt`] sets them up;
struct Vnni {
    x: *const Q8Block,
    kb: usize,
    w: *const u8,
    rb: usize,
    out: *mut f32,
    ldo: usize,
    q: *mut u32,
    start: *mut i32,
    scale: *mut f32,
    min: *mut f32,
}

/// # Safety
/// AVX512-VNNI/BW/F available; `kern` set up over `m` rows of `x`, `n` rows of `k` in `w`
/// and `out` as [`Avx512Vnni::gemm_nt`] checks; `m, n, k > 0`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn run<const F: u8, const U: bool>(mut kern: Vnni, (m, k, n): (usize, usize, usize)) {
    let (w, rb) = (kern.w, kern.rb);
    let mut k4 = Kern::<F, U>(&mut kern);
    // SAFETY: the kernel is built over this product (`k/4` steps); the caller's guarantee
    // is the driver's.
    unsafe { drive_panels(&mut k4, (m, k / 4, n), w, rb) }
}

/// [`Vnni`] for one weight format (`F`: [`Q8_0`], [`Q4_K`] or [`Q4_1`]); `U`: the weight
/// codes are `vpdpbusd`'s unsigned operand and the activation codes its signed one (4-bit
/// formats, sums from zero), else the other way round (activations offset by 128, sums from
/// the panel's `−128·Σw`).
struct Kern<'a, const F: u8, const U: bool>(&'a mut Vnni);

impl<const F: u8, const U: bool> PanelKernel for Kern<'_, F, U> {
    #[inline(always)]
    unsafe fn pack(&mut self, j0: usize, nc: usize) {
        let v = &*self.0;
        // SAFETY: rows `j0..j0 + nc` of `w`, the panel's `k/4·NR` groups and `kb·NR`
        // scales: the caller's guarantee, which [`run`]'s covers.
        unsafe {
            let w = v.w.add(j0 * v.rb);
            let p = (v.q, v.start, v.scale, v.min);
            match F {
                Q4_K => pack_q4_k::<U>(w, v.rb, nc, v.kb, p),
                _ => pack_32::<F, U>(w, v.rb, nc, v.kb, p),
            }
        }
    }

    const SPREADS_PREFETCH: bool = true;

    #[inline(always)]
    unsafe fn tile<const R: usize>(&mut self, at: TileAt) {
        let v = &*self.0;
        let (b0, nb) = (at.p0 / STEPS, at.kb / STEPS);
        let (parts, pf) = (R.div_ceil(VR), at.pf);
        let mut r0 = 0;
        while r0 < R {
            let rn = (R - r0).min(VR);
            let i = at.i0 + r0;
            // Each sub-tile of rows issues its part of the tile's prefetch share.
            let g = r0 / VR;
            let mut at = at;
            at.pf.first = pf.first + g * pf.lines / parts;
            at.pf.lines = (g + 1) * pf.lines / parts - g * pf.lines / parts;
            // SAFETY: activation rows `i..i + rn ≤ m` and their blocks `b0..b0 + nb ≤ kb`,
            // the panel's steps `8·b0..` and blocks `b0..b0 + nb`, outputs
            // `(i + r)·ldo + j0 + c` (c < nc): the caller's guarantee.
            unsafe {
                let t = Tile {
                    x: v.x.add(i * v.kb + b0),
                    ldx: v.kb,
                    q: v.q.add(b0 * STEPS * NR),
                    start: v.start.add(b0 * NR),
                    scale: v.scale.add(b0 * NR),
                    min: v.min.add(b0 * NR),
                    nb,
                    c: v.out.add(i * v.ldo + at.j0),
                    ldc: v.ldo,
                };
                match rn {
                    4 => tile::<4, F, U>(t, at),
                    3 => tile::<3, F, U>(t, at),
                    2 => tile::<2, F, U>(t, at),
                    _ => tile::<1, F, U>(t, at),
                }
            }
            r0 += rn;
        }
    }
}

/// One register tile's operands: activation blocks from `x` (rows at stride `ldx` blocks),
/// the panel from block `b0` (`nb` blocks), outputs at `c` (rows at stride `ldc`).
#[derive(Copy, Clone)]
struct Tile {
    x: *const Q8Block,
    ldx: usize,
    q: *const u32,
    start: *const i32,
    scale: *const f32,
    min: *const f32,
    nb: usize,
    c: *mut f32,
    ldc: usize,
}

/// `R × NR` outputs (+)= the products of `nb` blocks (see the module note for the order);
/// `at.first` starts from zero instead of the outputs.
///
/// # Safety
/// AVX512-VNNI/F available; `t`'s pointers readable for `R` rows of `nb` blocks, `8·nb·NR`
/// groups and `nb·NR` scales, `c` readable and writable at `r·ldc + j` for `r < R`,
/// `j < at.nc ≤ NR`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn tile<const R: usize, const F: u8, const U: bool>(t: Tile, at: TileAt) {
    let mask = col_masks(at.nc);
    // Prefetch lines per block (the last blocks fewer: none past the share).
    let per = at.pf.lines.div_ceil(t.nb.max(1));
    let (mut line, end) = (at.pf.first, at.pf.first + at.pf.lines);
    // SAFETY: loads and stores stay inside the caller's guarantee (masked to `nc` columns);
    // prefetches are hints (addresses formed with `wrapping_add`, never dereferenced).
    unsafe {
        let mut acc = load_tile::<R>(t.c, t.ldc, mask, at.first);
        for b in 0..t.nb {
            for _ in 0..per {
                if line < end {
                    _mm_prefetch::<_MM_HINT_T0>(at.pf.base.wrapping_add(64 * line));
                    line += 1;
                }
            }
            let mut isum = [[_mm512_setzero_si512(); 3]; R];
            if !U {
                let start = t.start.add(b * NR);
                let s = [
                    _mm512_loadu_si512(start.cast()),
                    _mm512_loadu_si512(start.add(16).cast()),
                    _mm512_loadu_si512(start.add(32).cast()),
                ];
                isum = [s; R];
            }
            let q = t.q.add(b * STEPS * NR);
            for e in 0..STEPS {
                let g = q.add(e * NR);
                let wv = [
                    _mm512_loadu_si512(g.cast()),
                    _mm512_loadu_si512(g.add(16).cast()),
                    _mm512_loadu_si512(g.add(32).cast()),
                ];
                for r in 0..R {
                    let xb = &*t.x.add(r * t.ldx + b);
                    let a =
                        _mm512_set1_epi32(xb.qs.as_ptr().add(4 * e).cast::<i32>().read_unaligned());
                    for v in 0..3 {
                        isum[r][v] = if U {
                            _mm512_dpbusd_epi32(isum[r][v], wv[v], a)
                        } else {
                            _mm512_dpbusd_epi32(isum[r][v], a, wv[v])
                        };
                    }
                }
            }
            let (scale, min) = (t.scale.add(b * NR), t.min.add(b * NR));
            for r in 0..R {
                let xb = &*t.x.add(r * t.ldx + b);
                let dx = _mm512_set1_ps(xb.d);
                for v in 0..3 {
                    let p = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][v]), dx);
                    acc[r][v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(scale.add(16 * v)), acc[r][v]);
                    if F != Q8_0 {
                        let mv = _mm512_loadu_ps(min.add(16 * v));
                        acc[r][v] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xb.s), acc[r][v]);
                    }
                }
            }
        }
        store_tile::<R>(t.c, t.ldc, mask, &acc);
    }
}

/// The panel's outputs: codes `[step][NR]`, and per `[block][NR]` sum starts, scales and
/// minimums.
type PanelPtrs = (*mut u32, *mut i32, *mut f32, *mut f32);

/// Stores 16 columns' codes of two 32-value blocks (`cols` from [`transpose16`] of 16 rows
/// of `[block b | block b + 1]` 4-byte groups; `both` false: block `b` only) at column
/// group `g`, with each block's sum start `−128·Σw`.
///
/// # Safety
/// AVX512-VNNI/BW/F available; the panel holds blocks `b` (and `b + 1` when `both`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn store_codes<const U: bool>(
    cols: [__m512; 16],
    (q, start): (*mut u32, *mut i32),
    b: usize,
    g: usize,
    both: bool,
) {
    let ones = _mm512_set1_epi8(1);
    for h in 0..1 + both as usize {
        if U {
            for e in 0..STEPS {
                let v = _mm512_castps_si512(cols[h * STEPS + e]);
                // SAFETY: step `8·(b + h) + e` of the panel, columns `16g..16g + 16 ≤ NR`.
                unsafe {
                    _mm512_storeu_si512(q.add(((b + h) * STEPS + e) * NR + 16 * g).cast(), v)
                };
            }
            continue;
        }
        let mut sum = _mm512_setzero_si512();
        for e in 0..STEPS {
            let v = _mm512_castps_si512(cols[h * STEPS + e]);
            sum = _mm512_dpbusd_epi32(sum, ones, v);
            // SAFETY: step `8·(b + h) + e` of the panel, columns `16g..16g + 16 ≤ NR`.
            unsafe { _mm512_storeu_si512(q.add(((b + h) * STEPS + e) * NR + 16 * g).cast(), v) };
        }
        let s = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sum));
        // SAFETY: block `b + h` of the panel, columns `16g..16g + 16 ≤ NR`.
        unsafe { _mm512_storeu_si512(start.add((b + h) * NR + 16 * g).cast(), s) };
    }
}

/// Packs `nc ≤ NR` rows of a 32-value format `F` (Q8_0 or Q4_1; `rb` bytes each, `kb`
/// blocks) into the panel: Q8_0's codes as they are and its scale `d`; Q4_1's 4-bit codes,
/// its scale `d` and minimum `−m` (a Q4_1 value is `d·q + m`). Columns `nc..NR` get zero
/// codes and scales.
///
/// # Safety
/// AVX512-VNNI/BW/F, F16C available; `w` readable for `nc` rows of `rb` bytes, the panel
/// writable for `8·kb·NR` groups and `kb·NR` scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn pack_32<const F: u8, const U: bool>(
    w: *const u8,
    rb: usize,
    nc: usize,
    kb: usize,
    p: PanelPtrs,
) {
    let bb = if F == Q8_0 { 34 } else { 20 };
    let low = _mm_set1_epi8(0xF);
    // Block `b`'s 32 codes at `blk`, in order.
    let codes = |blk: *const u8| -> __m256i {
        // SAFETY: codes at bytes 2..34 (Q8_0) or 4..20 (Q4_1) of the caller's block.
        unsafe {
            if F == Q8_0 {
                _mm256_loadu_si256(blk.add(2).cast())
            } else {
                let v = _mm_loadu_si128(blk.add(4).cast());
                let lo = _mm_and_si128(v, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), low);
                _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
            }
        }
    };
    // SAFETY: rows `16g + t < nc`, blocks `b, b + 1 < kb` (scales at bytes 0..4 of a block),
    // panel blocks `b, b + 1` and columns `16g..16g + 16 ≤ NR`.
    unsafe {
        for g in 0..NR / 16 {
            let mut b = 0;
            while b < kb {
                let both = b + 1 < kb;
                let mut r = [_mm512_setzero_ps(); 16];
                let (mut d, mut m) = ([0u16; 32], [0u16; 32]);
                for t in 0..16 {
                    if g * 16 + t < nc {
                        let blk = w.add((g * 16 + t) * rb + b * bb);
                        let hi = if both {
                            d[16 + t] = blk.add(bb).cast::<u16>().read_unaligned();
                            m[16 + t] = blk.add(bb + 2).cast::<u16>().read_unaligned();
                            codes(blk.add(bb))
                        } else {
                            _mm256_setzero_si256()
                        };
                        d[t] = blk.cast::<u16>().read_unaligned();
                        m[t] = blk.add(2).cast::<u16>().read_unaligned();
                        r[t] = _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(codes(blk)),
                            hi,
                        ));
                    }
                }
                store_codes::<U>(transpose16(r), (p.0, p.1), b, g, both);
                for h in 0..1 + both as usize {
                    let half = |v: &[u16; 32]| {
                        _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(16 * h).cast()))
                    };
                    _mm512_storeu_ps(p.2.add((b + h) * NR + 16 * g), half(&d));
                    if F == Q4_1 {
                        let neg = _mm512_sub_ps(_mm512_setzero_ps(), half(&m));
                        _mm512_storeu_ps(p.3.add((b + h) * NR + 16 * g), neg);
                    }
                }
                b += 2;
            }
        }
    }
}

/// Packs `nc ≤ NR` Q4_K rows (`rb` bytes each, `kb / 8` super-blocks) into the panel: codes
/// `0..15`, per 32-value sub-block `j` the scale `d·sc_j` and minimum `dmin·m_j` (rounded as
/// the scalar dequantiser rounds them); columns `nc..NR` get zero codes and scales.
///
/// # Safety
/// As [`pack_32`], for Q4_K rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn pack_q4_k<const U: bool>(w: *const u8, rb: usize, nc: usize, kb: usize, p: PanelPtrs) {
    const BB: usize = 144;
    let low = _mm256_set1_epi8(0xF);
    // SAFETY: rows `16g + t < nc`, super-blocks `sb < kb / 8` (bytes `144·sb..144·sb + 144`
    // of a row), panel blocks `8·sb..8·sb + 8` and columns `16g..16g + 16 ≤ NR`.
    unsafe {
        for g in 0..NR / 16 {
            for sb in 0..kb / 8 {
                for c in 0..4 {
                    let mut r = [_mm512_setzero_ps(); 16];
                    for t in 0..16 {
                        if g * 16 + t < nc {
                            let row = w.add((g * 16 + t) * rb + sb * BB);
                            let v = _mm256_loadu_si256(row.add(16 + 32 * c).cast());
                            let lo = _mm256_and_si256(v, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                            r[t] = _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
                                _mm512_castsi256_si512(lo),
                                hi,
                            ));
                        }
                    }
                    store_codes::<U>(transpose16(r), (p.0, p.1), 8 * sb + 2 * c, g, true);
                }
                // Rows `16g..` may all be past `nc` (then nothing is read): a wrapping
                // address, never dereferenced.
                let hdr = w.wrapping_add(16 * g * rb + sb * BB);
                let live = nc.saturating_sub(16 * g);
                scales_q4_k(hdr, rb, live, p, 8 * sb * NR + 16 * g);
            }
        }
    }
}

/// The sub-block scales `d·sc_j` and minimums `dmin·m_j` (ggml's `get_scale_min_k4`) of one
/// Q4_K super-block for 16 rows at once (lane `t` = row `t` at `w + t·rb`; rows `live..16`
/// get zeros), stored at `p.2 + at + j·NR` and `p.3 + at + j·NR` (`j` = 0..8): each value is
/// the scalar dequantiser's `d · f32(sc)` (one rounded product), as the row kernel computes it.
///
/// # Safety
/// AVX512-F/BW, F16C available; the 16-byte super-block header (`d`, `dmin`, 12 scale bytes)
/// of rows `t < live` readable at `w + t·rb`, `15·rb ≤ i32::MAX`; the panel writable at
/// `at + j·NR..at + j·NR + 16` for `j < 8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn scales_q4_k(w: *const u8, rb: usize, live: usize, p: PanelPtrs, at: usize) {
    let live = live.min(16);
    let mask = ((1u32 << live) - 1) as __mmask16;
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(rb as i32),
    );
    let zero = _mm512_setzero_si512();
    // SAFETY: lanes `t < live` read 4 bytes at `w + t·rb + off` (off + 4 ≤ 16, inside the
    // header); other lanes are masked off and read nothing.
    let gather = |off: usize| unsafe {
        _mm512_mask_i32gather_epi32::<1>(zero, mask, idx, w.add(off).cast())
    };
    let (dm, q0, q1, q2) = (gather(0), gather(4), gather(8), gather(12));
    let half = |v: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    let (d, dmin) = (half(dm), half(_mm512_srli_epi32::<16>(dm)));
    let bits = |v: __m512i, shift: u32, keep: i32| {
        _mm512_and_si512(
            _mm512_srlv_epi32(v, _mm512_set1_epi32(shift as i32)),
            _mm512_set1_epi32(keep),
        )
    };
    for j in 0..8u32 {
        let (s, m) = if j < 4 {
            (bits(q0, 8 * j, 63), bits(q1, 8 * j, 63))
        } else {
            let jj = 8 * (j - 4);
            let top = |q: __m512i| _mm512_slli_epi32::<4>(bits(q, jj + 6, 3));
            (
                _mm512_or_si512(bits(q2, jj, 0xF), top(q0)),
                _mm512_or_si512(bits(q2, jj + 4, 0xF), top(q1)),
            )
        };
        let o = at + j as usize * NR;
        // SAFETY: 16 values at `at + j·NR`, the caller's guarantee.
        unsafe {
            _mm512_storeu_ps(p.2.add(o), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
            _mm512_storeu_ps(p.3.add(o), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
        }
    }
}
