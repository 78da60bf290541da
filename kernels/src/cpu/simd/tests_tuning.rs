//! [`super::tuning`]: the tuned prompt kernels give the previous kernels' outputs bit for bit
//! (4-bit weights on AVX512-VNNI: the codes as `vpdpbusd`'s unsigned operand, sums from zero,
//! against activations offset by 128 and sums from `−128·Σw`), at SmolLM2's shapes and any
//! shape the panel kernel takes (4 rows and up: decode batches and prompt rows), with the
//! codes at their extremes. The switch is process-wide and other tests may flip it while one
//! of these runs; both settings compute the same bits, so an interleaving changes nothing.
use proptest::prelude::*;

use super::tests_vnni::{activations, vnni, weights};
use super::*;

/// The product of `f` weights with both settings of the switch; `None` where the VNNI kernel
/// does not run here.
fn both(
    f: WeightFormat,
    w: &[u8],
    x: &[f32],
    (m, k, n): (usize, usize, usize),
) -> Option<[Vec<u32>; 2]> {
    let ldo = n + 1;
    let mut outs = [vec![f32::NAN; m * ldo], vec![f32::NAN; m * ldo]];
    for (on, out) in [true, false].into_iter().zip(outs.iter_mut()) {
        set_prompt_tuning(on);
        if !vnni(f, w, x, (m, k, n), out, ldo) {
            set_prompt_tuning(true);
            return None;
        }
    }
    set_prompt_tuning(true);
    Some(outs.map(|o| o.iter().map(|v| v.to_bits()).collect()))
}

fn check(f: WeightFormat, (m, k, n): (usize, usize, usize), seed: u64) {
    let w = weights(f, n, k, seed);
    let x = activations(m, k, seed ^ 0x7e57);
    if let Some([new, old]) = both(f, &w, &x, (m, k, n)) {
        assert_eq!(
            new, old,
            "{f} ({m}, {k}, {n}) seed {seed}: tuned vs previous kernel"
        );
    }
}

#[test]
fn tuned_vnni_equals_previous_at_model_shapes() {
    for (f, k) in [
        (WeightFormat::Q4_1, 576),
        (WeightFormat::Q4_K, 1536),
        (WeightFormat::Q8_0, 576),
    ] {
        for (m, n) in [(4, 64), (16, 100), (17, 192), (130, 50)] {
            check(f, (m, k, n), (m * 7 + n) as u64);
        }
    }
}

/// Codes 0 and 15 (the 4-bit extremes) against activation blocks that reach ±127.
#[test]
fn tuned_vnni_equals_previous_at_extreme_codes() {
    let (m, n) = (9, 21);
    for f in [WeightFormat::Q4_1, WeightFormat::Q4_K] {
        let k = if f == WeightFormat::Q4_K { 512 } else { 96 };
        let mut w = weights(f, n, k, 5);
        let skip = if f == WeightFormat::Q4_K { 16 } else { 4 };
        for (i, blk) in w.chunks_exact_mut(f.block_bytes()).enumerate() {
            let code = if i % 2 == 0 { 0x00 } else { 0xFF };
            blk[skip..].fill(code);
        }
        let x: Vec<f32> = (0..m * k)
            .map(|i| if i % 3 == 0 { -4.0 } else { 4.0 } * (1.0 + (i % 5) as f32))
            .collect();
        if let Some([new, old]) = both(f, &w, &x, (m, k, n)) {
            assert_eq!(new, old, "{f}: extreme codes");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn tuned_vnni_equals_previous_any_shape(
        q4k in any::<bool>(),
        m in 4usize..40,
        blocks in 1usize..40,
        n in 1usize..110,
        seed in any::<u64>(),
    ) {
        let (f, k) = if q4k {
            (WeightFormat::Q4_K, 256 * blocks.div_ceil(8))
        } else {
            (WeightFormat::Q4_1, 32 * blocks)
        };
        check(f, (m, k, n), seed);
    }
}
