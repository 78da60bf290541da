//! KV cache rows stored in 16 bits (`--kv-cache-dtype fp16` / `bf16`): f32 rows rounded to
//! nearest even on write, widened back to f32 (exactly: every f16 and bf16 value is an f32)
//! for the f32 attention kernels.
//!
//! A decode step of 16 sequences at 160 positions reads 118 MB of f32 K/V on SmolLM2-135M
//! (30 layers × 2 × 3 kv heads × 64); in 16 bits it reads half, as llama.cpp's default f16
//! cache does. Widening runs 16 values an instruction (`vcvtph2ps`, or a 16-bit shift for
//! bf16) into a per-thread buffer that stays in L2.
use half::{bf16, f16};

use super::FloatFormat;

/// `dst[i] = src[i]` rounded to `format` (f16 or bf16, round to nearest even; NaN stays NaN),
/// as bit patterns.
///
/// # Panics
/// If the lengths differ or `format` is f32.
pub fn narrow_kv(format: FloatFormat, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "narrow_kv: lengths differ");
    match format {
        FloatFormat::F16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(s).to_bits();
            }
        }
        FloatFormat::BF16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16::from_f32(s).to_bits();
            }
        }
        FloatFormat::F32 => panic!("narrow_kv: f32 is not a 16-bit format"),
    }
}

/// `dst[i] = src[i]` as f32 (exact), `src` holding `format` bit patterns.
///
/// # Panics
/// If the lengths differ or `format` is f32.
pub fn widen_kv(format: FloatFormat, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_kv: lengths differ");
    assert_ne!(
        format,
        FloatFormat::F32,
        "widen_kv: f32 is not a 16-bit format"
    );
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: `avx512` found AVX-512F; the lengths are equal.
        return unsafe { widen_x86(format, src, dst) };
    }
    widen_portable(format, src, dst);
}

/// [`widen_kv`] one element at a time (the oracle of the 16-lane version, and its tail).
fn widen_portable(format: FloatFormat, src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = match format {
            FloatFormat::F16 => f16::from_bits(s).to_f32(),
            _ => bf16::from_bits(s).to_f32(),
        };
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| is_x86_feature_detected!("avx512f") && !super::switched_off("THAW_AVX512"))
}

/// # Safety
/// AVX-512F available; `src.len() == dst.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_x86(format: FloatFormat, src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len() - src.len() % 16;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i < n {
        // SAFETY: elements `i..i + 16 ≤ n` of both slices.
        unsafe {
            let h = _mm256_loadu_si256(s.add(i).cast());
            let w = match format {
                FloatFormat::F16 => _mm512_cvtph_ps(h),
                _ => {
                    // The top half of an f32; NaNs quieted (bit 22 set), as `half` does.
                    let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                    let f = _mm512_castsi512_ps(w);
                    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(f, f);
                    let q = _mm512_mask_or_epi32(w, nan, w, _mm512_set1_epi32(0x0040_0000));
                    _mm512_castsi512_ps(q)
                }
            };
            _mm512_storeu_ps(d.add(i), w);
        }
        i += 16;
    }
    widen_portable(format, &src[n..], &mut dst[n..]);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any bit pattern (NaNs, infinities, subnormals) widens to `half`'s f32, bit for bit,
        /// at any length (the 16-lane body and its tail); narrowing is `half`'s rounding.
        #[test]
        fn widen_is_halfs_conversion(bits in prop::collection::vec(any::<u16>(), 0..70),
                                     xs in prop::collection::vec(any::<f32>(), 0..70)) {
            for format in [FloatFormat::F16, FloatFormat::BF16] {
                let mut got = vec![0.0f32; bits.len()];
                widen_kv(format, &bits, &mut got);
                for (g, &b) in got.iter().zip(&bits) {
                    let want = match format {
                        FloatFormat::F16 => f16::from_bits(b).to_f32(),
                        _ => bf16::from_bits(b).to_f32(),
                    };
                    prop_assert_eq!(g.to_bits(), want.to_bits(), "{:?} {:#06x}", format, b);
                }
                let mut n = vec![0u16; xs.len()];
                narrow_kv(format, &xs, &mut n);
                for (h, &x) in n.iter().zip(&xs) {
                    let want = match format {
                        FloatFormat::F16 => f16::from_f32(x).to_bits(),
                        _ => bf16::from_f32(x).to_bits(),
                    };
                    prop_assert_eq!(*h, want);
                }
            }
        }
    }

    /// Round trip: finite values in f16's normal range come back within half an ulp
    /// (relative 2⁻¹¹), bf16 within 2⁻⁸.
    #[test]
    fn round_trip_error_is_half_an_ulp() {
        // Magnitudes 10⁻² … 10², both signs: normal numbers in both formats.
        let xs: Vec<f32> = (0..1000)
            .map(|i| {
                let m = 10f32.powf((i as f32 * 0.618).fract() * 4.0 - 2.0);
                if i % 2 == 0 {
                    m
                } else {
                    -m
                }
            })
            .collect();
        for (format, rel) in [
            (FloatFormat::F16, 2f32.powi(-11)),
            (FloatFormat::BF16, 2f32.powi(-8)),
        ] {
            let mut h = vec![0u16; xs.len()];
            narrow_kv(format, &xs, &mut h);
            let mut back = vec![0.0f32; xs.len()];
            widen_kv(format, &h, &mut back);
            for (x, y) in xs.iter().zip(&back) {
                assert!((x - y).abs() <= rel * x.abs(), "{format:?}: {x} -> {y}");
            }
        }
    }
}
