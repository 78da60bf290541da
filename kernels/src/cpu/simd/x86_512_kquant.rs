//! AVX-512F dequantisation of Q4_K rows (the rows a batched product widens once into a tile
//! and the single-row path widens per row): the same operations per value as the scalar
//! `quant::blocks::dequantize_q4_k` (`d·sc` and `dmin·m` rounded once per sub-block, then
//! `d1·q` rounded, then `− m1` rounded), so the values are bit-identical, 16 lanes at a time.

use std::arch::x86_64::*;

use super::x86_512::Avx512;

/// Values and bytes per Q4_K block.
const QK: usize = 256;
const BLOCK: usize = 144;

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
