//! The final lane sums of a 4 × 4 register tile of 16-lane accumulators at once: the decode
//! kernels' per-accumulator sum ([`super::x86_512`]'s `finish`: lanes `i` and `i + 8`, then
//! `i` and `i + 4`, then `i` and `i + 2`, then the two left) costs 8 shuffles and adds per
//! output, about a fifth of the multiply-adds behind an output at SmolLM2's `k = 576` (36
//! steps of 16). Here the same additions run on four or eight accumulators per instruction
//! (45 instructions for 16 outputs): every output is the same tree of the same additions
//! (IEEE addition is commutative), so bit for bit `finish`'s result.
use std::arch::x86_64::*;

/// `out` lane `4r + j` = the lane sum of `acc[j][r]` (`j`, `r` < 4), added in `finish`'s
/// order.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn finish_4x4(acc: &[[__m512; 4]; 4]) -> __m512 {
    // x[4j + r]; each step halves the vectors, pairing neighbours.
    let x: [__m512; 16] = std::array::from_fn(|i| acc[i / 4][i % 4]);
    // Lanes i + 8: y[a] = [x[2a] lanes 0..8 | x[2a + 1] lanes 0..8].
    let y: [__m512; 8] = std::array::from_fn(|a| {
        let (p, q) = (x[2 * a], x[2 * a + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(p, q),
            _mm512_shuffle_f32x4::<0xEE>(p, q),
        )
    });
    // Lanes i + 4: z[b] chunk c (4 lanes) = x[4b + c]'s four partial sums.
    let z: [__m512; 4] = std::array::from_fn(|b| {
        let (p, q) = (y[2 * b], y[2 * b + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(p, q),
            _mm512_shuffle_f32x4::<0xDD>(p, q),
        )
    });
    // Lanes i + 2: w[c] chunk q = [x[8c + q]'s two sums, x[8c + 4 + q]'s two sums].
    let w: [__m512; 2] = std::array::from_fn(|c| {
        let (p, q) = (_mm512_castps_pd(z[2 * c]), _mm512_castps_pd(z[2 * c + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)),
        )
    });
    // The last pair: chunk q = [x[q], x[4 + q], x[8 + q], x[12 + q]], so lane 4q + e holds
    // x[4e + q] = acc[e][q].
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(w[0], w[1]),
        _mm512_shuffle_ps::<0xDD>(w[0], w[1]),
    )
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `x86_512`'s `finish`, restated (lanes i + 8, i + 4, i + 2, i + 1 in that order).
    fn finish_ref(a: [f32; 16]) -> f32 {
        let v: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
        let s: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
        (s[0] + s[2]) + (s[1] + s[3])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Bit for bit the one-accumulator sum, lane `4r + j` for `acc[j][r]`, over values of
        /// mixed signs and magnitudes (so the order of additions shows in the rounding).
        #[test]
        fn finish_4x4_is_finish_bit_for_bit(
            vals in proptest::collection::vec(
                (any::<bool>(), -30i32..30, 1u32..(1 << 23)), 256),
        ) {
            if !is_x86_feature_detected!("avx512f") {
                return Ok(());
            }
            let lanes: Vec<f32> = vals
                .iter()
                .map(|&(neg, e, m)| {
                    let v = (1.0 + m as f32 / (1u32 << 23) as f32) * 2f32.powi(e);
                    if neg { -v } else { v }
                })
                .collect();
            let mut acc = [[[0.0f32; 16]; 4]; 4];
            for (i, l) in lanes.chunks_exact(16).enumerate() {
                acc[i / 4][i % 4].copy_from_slice(l);
            }
            // SAFETY: AVX-512F detected above; loads and the store cover 16 f32s each.
            let got = unsafe {
                let v: [[__m512; 4]; 4] = std::array::from_fn(|j| {
                    std::array::from_fn(|r| _mm512_loadu_ps(acc[j][r].as_ptr()))
                });
                let mut out = [0.0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), finish_4x4(&v));
                out
            };
            for j in 0..4 {
                for r in 0..4 {
                    let want = finish_ref(acc[j][r]);
                    prop_assert_eq!(got[4 * r + j].to_bits(), want.to_bits(), "acc[{}][{}]", j, r);
                }
            }
        }
    }
}
