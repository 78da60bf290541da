//! AVX-512F dequantisation of Q4_K and Q6_K rows (the rows a batched product widens once into
//! a tile and the single-row path widens per row): the same operations per value as the
//! scalar `quant::blocks::dequantize_q4_k` (`d·sc` and `dmin·m` rounded once per sub-block,
//! then `d1·q` rounded, then `− m1` rounded) and `dequantize_q6_k` (`d·sc` rounded per 16
//! values, then `·q`), so the values are bit-identical, 16 lanes at a time.

use std::arch::x86_64::*;

use super::x86_512::Avx512;

/// Values per K-quant block, and bytes per Q4_K and Q6_K block.
const QK: usize = 256;
const BLOCK: usize = 144;
const BLOCK6: usize = 210;

impl Avx512 {
    /// Dequantises whole Q4_K blocks `w` into `out` (256 values a block).
    pub(super) fn dequantize_q4_k(self, w: &[u8], out: &mut [f32]) {
        let kb = w.len() / BLOCK;
        assert!(
            w.len() == kb * BLOCK && out.len() >= kb * QK,
            "dequantize_q4_k: {} bytes into {} values",
            w.len(),
            out.len()
        );
        // SAFETY: `self` proves the features; `w` holds `kb` whole blocks and `out` `256·kb`
        // values (asserted above).
        unsafe { q4_k_rows(w.as_ptr(), kb, out.as_mut_ptr()) }
    }

    /// Dequantises whole Q6_K blocks `w` into `out` (256 values a block).
    pub(super) fn dequantize_q6_k(self, w: &[u8], out: &mut [f32]) {
        let kb = w.len() / BLOCK6;
        assert!(
            w.len() == kb * BLOCK6 && out.len() >= kb * QK,
            "dequantize_q6_k: {} bytes into {} values",
            w.len(),
            out.len()
        );
        // SAFETY: `self` proves the features; `w` holds `kb` whole blocks and `out` `256·kb`
        // values (asserted above).
        unsafe { q6_k_rows(w.as_ptr(), kb, out.as_mut_ptr()) }
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8).
#[inline(always)]
pub(super) fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// # Safety
/// AVX-512F/F16C available; `w` readable for `kb` Q4_K blocks, `out` writable for `256·kb`
/// f32s.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q4_k_rows(w: *const u8, kb: usize, out: *mut f32) {
    let low = _mm512_set1_epi32(0xF);
    for b in 0..kb {
        // SAFETY: block `b < kb` (bytes `144b..144b + 144`) and values `256b..256b + 256`
        // are inside the caller's guarantee; every load below stays inside the block.
        unsafe {
            let wb = w.add(b * BLOCK);
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(wb.cast::<i32>().read_unaligned()));
            let (d, dmin) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
            let scales: [u8; 12] = wb.add(4).cast::<[u8; 12]>().read_unaligned();
            let o = out.add(b * QK);
            for c in 0..4 {
                let (sc1, m1) = scale_min(2 * c, &scales);
                let (sc2, m2) = scale_min(2 * c + 1, &scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                let q = wb.add(16 + 32 * c);
                for h in 0..2 {
                    let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(16 * h).cast()));
                    let lo = _mm512_cvtepi32_ps(_mm512_and_si512(e, low));
                    let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(e));
                    let lo =
                        _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d1), lo), _mm512_set1_ps(m1));
                    let hi =
                        _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d2), hi), _mm512_set1_ps(m2));
                    _mm512_storeu_ps(o.add(64 * c + 16 * h), lo);
                    _mm512_storeu_ps(o.add(64 * c + 32 + 16 * h), hi);
                }
            }
        }
    }
}

/// # Safety
/// AVX-512F/F16C available; `w` readable for `kb` Q6_K blocks, `out` writable for `256·kb`
/// f32s.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q6_k_rows(w: *const u8, kb: usize, out: *mut f32) {
    let (low, two, off) = (
        _mm512_set1_epi32(0xF),
        _mm512_set1_epi32(3),
        _mm512_set1_epi32(32),
    );
    for b in 0..kb {
        // SAFETY: block `b < kb` (bytes `210b..210b + 210`: low nibbles at 0..128, high bits
        // at 128..192, scales at 192..208, `d` at 208) and values `256b..256b + 256` are
        // inside the caller's guarantee; every load below stays inside the block.
        unsafe {
            let wb = w.add(b * BLOCK6);
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                wb.add(208).cast::<u16>().read_unaligned() as i32,
            )));
            let sc: [i8; 16] = wb.add(192).cast::<[i8; 16]>().read_unaligned();
            for n in 0..2 {
                let (ql, qh) = (wb.add(64 * n), wb.add(128 + 32 * n));
                let o = out.add(b * QK + 128 * n);
                for h in 0..2 {
                    let l = 16 * h;
                    let bytes = |p: *const u8| _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
                    let (a, c, hb) = (bytes(ql.add(l)), bytes(ql.add(l + 32)), bytes(qh.add(l)));
                    // Value `32·j + l + i` (j = 0..4) takes ql's low/high nibble and qh's bits
                    // `2j..2j + 2`, less 32; its scale is `d·sc[8n + 2j + h]`.
                    let quads = [
                        (_mm512_and_si512(a, low), hb),
                        (_mm512_and_si512(c, low), _mm512_srli_epi32::<2>(hb)),
                        (_mm512_srli_epi32::<4>(a), _mm512_srli_epi32::<4>(hb)),
                        (_mm512_srli_epi32::<4>(c), _mm512_srli_epi32::<6>(hb)),
                    ];
                    for (j, (lo, hi)) in quads.into_iter().enumerate() {
                        let hi = _mm512_slli_epi32::<4>(_mm512_and_si512(hi, two));
                        let q = _mm512_sub_epi32(_mm512_or_si512(lo, hi), off);
                        let ds = d * sc[8 * n + 2 * j + h] as f32;
                        let v = _mm512_mul_ps(_mm512_set1_ps(ds), _mm512_cvtepi32_ps(q));
                        _mm512_storeu_ps(o.add(32 * j + l), v);
                    }
                }
            }
        }
    }
}
