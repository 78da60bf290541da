//! The prompt GEMMs' helpers against their scalar definitions: the AVX-512 rounding of
//! activation rows to bf16 pairs ([`x86_512_bf16::to_pairs_avx512`]) bit for bit against
//! [`x86_512_bf16::to_pairs`] (`half`'s rounding to nearest even), on every kind of f32 value
//! (ties, NaNs, infinities, subnormals, values that round up to infinity) and every length.
use proptest::prelude::*;

/// Both roundings of `row` (skipped, `None`, on a CPU without AVX-512F).
#[cfg(target_arch = "x86_64")]
fn both(row: &[f32]) -> Option<(Vec<u32>, Vec<u32>)> {
    use super::x86_512_bf16::{to_pairs, to_pairs_avx512};
    if !is_x86_feature_detected!("avx512f") {
        return None;
    }
    let kp = row.len().div_ceil(2);
    let (mut scalar, mut wide) = (vec![0xDEAD_BEEF; kp], vec![0xDEAD_BEEF; kp]);
    to_pairs(row, &mut scalar);
    // SAFETY: AVX-512F was detected above.
    unsafe { to_pairs_avx512(row, &mut wide) };
    Some((scalar, wide))
}

/// Values that stress the rounding: ties to even both ways, one ulp either side of a tie,
/// the largest finite values (which round to infinity), infinities, NaNs with payloads in
/// the dropped and the kept bits, subnormals and zeros of both signs.
const SPECIAL: [u32; 20] = [
    0x3F80_8000, // tie, even below: stays 0x3F80
    0x3F81_8000, // tie, odd below: rounds up to 0x3F82
    0x3F80_8001, // just above a tie: up
    0x3F80_7FFF, // just below a tie: down
    0xBF81_8000, // negative tie, odd
    0x7F7F_FFFF, // f32::MAX: rounds to +inf
    0xFF7F_FFFF, // -f32::MAX: -inf
    0x7F7F_7FFF, // largest value that stays finite
    0x7F80_0000, // +inf
    0xFF80_0000, // -inf
    0x7FC0_0000, // quiet NaN
    0x7F80_0001, // signalling NaN, payload only in the dropped bits
    0xFFA0_0000, // negative signalling NaN, payload in the kept bits
    0x0000_0001, // smallest subnormal
    0x0000_8000, // subnormal tie
    0x0001_8000, // subnormal tie, odd
    0x007F_FFFF, // largest subnormal: rounds up to the smallest normal
    0x0000_0000,
    0x8000_0000,
    0x3DCC_CCCD, // 0.1
];

#[cfg(target_arch = "x86_64")]
#[test]
fn bf16_pairs_special_values_match_scalar() {
    // Every special value at every lane position of a 16-value step, and past it (the tail).
    for len in [1, 15, 16, 17, 31, 32, 33, 47] {
        for shift in 0..SPECIAL.len() {
            let row: Vec<f32> = (0..len)
                .map(|i| f32::from_bits(SPECIAL[(i + shift) % SPECIAL.len()]))
                .collect();
            let Some((scalar, wide)) = both(&row) else {
                return;
            };
            assert_eq!(scalar, wide, "len {len} shift {shift}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary bit patterns (every exponent, sign and NaN payload) and lengths, odd ones
    /// included (the last pair's high half is zero).
    #[test]
    fn bf16_pairs_any_bits_match_scalar(bits in proptest::collection::vec(any::<u32>(), 0..100)) {
        let row: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        if let Some((scalar, wide)) = both(&row) {
            prop_assert_eq!(scalar, wide);
        }
    }

    /// Ordinary activations (a normal spread of magnitudes), where ties are rare: what a
    /// prompt row holds.
    #[test]
    fn bf16_pairs_activations_match_scalar(v in proptest::collection::vec(-1e4f32..1e4, 0..700)) {
        if let Some((scalar, wide)) = both(&v) {
            prop_assert_eq!(scalar, wide);
        }
    }
}
