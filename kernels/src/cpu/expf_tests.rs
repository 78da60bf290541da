use proptest::prelude::*;

use super::*;

/// Inputs every path must agree on: both ends of every special range, the boundaries of the
/// main path, zeros, infinities, NaNs, subnormals.
fn edge_cases() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fa0_0000), // signalling NaN
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::MAX,
        f32::MIN,
        88.0,
        -88.0,
    ];
    for b in [
        OVERFLOW_ABOVE,
        UNDERFLOW_BELOW,
        MAY_UNDERFLOW_BELOW,
        0x42b0_0000,
        0xc2b0_0000,
    ] {
        for d in -3i32..=3 {
            v.push(f32::from_bits(b.wrapping_add_signed(d)));
        }
    }
    v
}

/// The relative error of `got` against `e^x` in f64, in units of f32's last place.
fn ulps(x: f32, got: f32) -> f64 {
    let want = (x as f64).exp();
    if want == 0.0 || !want.is_finite() || want < f32::MIN_POSITIVE as f64 {
        return if (got as f64 - want).abs() <= f32::from_bits(1) as f64 {
            0.0
        } else {
            f64::INFINITY
        };
    }
    let ulp = f32::EPSILON as f64 * 2f64.powi(want.log2().floor() as i32);
    (got as f64 - want).abs() / ulp
}

#[test]
fn edge_cases_follow_glibc_rules() {
    assert_eq!(expf(f32::NEG_INFINITY).to_bits(), 0);
    assert_eq!(expf(f32::INFINITY), f32::INFINITY);
    assert!(expf(f32::NAN).is_nan());
    assert_eq!(expf(0.0), 1.0);
    assert_eq!(expf(-0.0), 1.0);
    let top = expf(f32::from_bits(OVERFLOW_ABOVE));
    assert!(
        top.is_finite() && top > 3.4e38,
        "e^{} = {top}",
        f32::from_bits(OVERFLOW_ABOVE)
    );
    assert_eq!(expf(f32::from_bits(OVERFLOW_ABOVE + 1)), f32::INFINITY);
    assert_eq!(expf(f32::from_bits(UNDERFLOW_BELOW + 1)).to_bits(), 0);
    assert_eq!(expf(f32::from_bits(MAY_UNDERFLOW_BELOW + 1)).to_bits(), 1);
    // Just above the least-subnormal band the main path gives a subnormal.
    let x = f32::from_bits(MAY_UNDERFLOW_BELOW - 1);
    let y = expf(x);
    assert!(y > 0.0 && y < f32::MIN_POSITIVE, "e^{x} = {y}");
}

/// Within a last place (glibc documents 0.502 ulp) wherever the result is a normal f32:
/// the port is an `exp`, not just a copy of some bits.
#[test]
fn within_one_ulp_of_f64_exp() {
    let mut x = -87.0f32;
    let mut worst = 0.0f64;
    while x < 88.0 {
        let e = ulps(x, expf(x));
        assert!(e < 1.0, "e^{x}: {} is {e} ulp off", expf(x));
        worst = worst.max(e);
        x += 0.00123;
    }
    assert!(worst > 0.0, "no rounding seen: the sweep compared nothing");
}

/// On x86-64 glibc with FMA (this project's CPUs) the port is `f32::exp` bit for bit; a
/// sample here, all 2³² inputs in `examples/expf_exhaustive.rs`. Elsewhere libm may round
/// differently, within a last place.
#[test]
fn port_matches_libm() {
    let exact = cfg!(all(target_arch = "x86_64", target_env = "gnu"))
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("avx2");
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut inputs = edge_cases();
    for _ in 0..200_000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        inputs.push(f32::from_bits(rng as u32));
        // Softmax's range: scores minus their maximum.
        inputs.push(-((rng >> 40) as f32) / (1u64 << 19) as f32);
    }
    for x in inputs {
        let (got, want) = (expf(x), x.exp());
        if exact {
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "expf({x:e} = {:#x}) = {got:e}, libm {want:e}",
                x.to_bits()
            );
        } else {
            assert!(ulps(x, got) < 1.0 || got.is_nan() == want.is_nan());
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn vector_of(xs: &[f32; 16]) -> [f32; 16] {
    use std::arch::x86_64::*;
    assert!(std::arch::is_x86_feature_detected!("avx512f"));
    let mut out = [0.0f32; 16];
    // SAFETY: AVX-512F checked above; both arrays hold 16 floats.
    unsafe {
        _mm512_storeu_ps(out.as_mut_ptr(), expf_x16(_mm512_loadu_ps(xs.as_ptr())));
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_lanes_equal_the_port_at_the_edges() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        return;
    }
    let edges = edge_cases();
    // Every edge value at every lane, the other lanes ordinary or `-inf`.
    for (i, &x) in edges.iter().enumerate() {
        for lane in 0..16 {
            let mut xs = [-(i as f32) * 0.37; 16];
            if i % 2 == 1 {
                xs[(lane + 5) % 16] = f32::NEG_INFINITY;
            }
            xs[lane] = x;
            let got = vector_of(&xs);
            for l in 0..16 {
                assert!(
                    same_bits(got[l], expf(xs[l])),
                    "lane {l}: e^{} = {} (vector) vs {} (port)",
                    xs[l],
                    got[l],
                    expf(xs[l])
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Sixteen random bit patterns (any float, NaNs included), or sixteen softmax-like
    /// values: every lane is the port's bits.
    #[test]
    fn vector_lanes_equal_the_port(bits in prop::array::uniform16(any::<u32>()),
                                   small in prop::array::uniform16(-104.0f32..1.0)) {
        if std::arch::is_x86_feature_detected!("avx512f") {
            for xs in [bits.map(f32::from_bits), small] {
                let got = vector_of(&xs);
                for l in 0..16 {
                    prop_assert!(same_bits(got[l], expf(xs[l])),
                        "lane {}: e^{:e} = {:e} vs {:e}", l, xs[l], got[l], expf(xs[l]));
                }
            }
        }
    }

    /// The slice form (vector body, scalar tail) and SwiGLU's 16-lane form against their
    /// one-element definitions, at every length up to 70.
    #[test]
    fn slices_and_swiglu_equal_the_scalar_paths(xs in prop::collection::vec(-30.0f32..30.0, 0..70),
                                                 seed in any::<u64>()) {
        let mut out = vec![0.0; xs.len()];
        expf_slice(&xs, &mut out);
        for (o, &x) in out.iter().zip(&xs) {
            prop_assert_eq!(o.to_bits(), expf(x).to_bits());
        }
        let up: Vec<f32> = xs.iter().enumerate()
            .map(|(i, &x)| x * 0.5 + ((seed >> (i % 60)) & 7) as f32 - 3.5).collect();
        let (mut fast, mut slow) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        crate::cpu::swiglu(&xs, &up, &mut fast);
        crate::cpu::activation::swiglu_scalar(&xs, &up, &mut slow);
        for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
            prop_assert_eq!(a.to_bits(), b.to_bits(), "element {}", i);
        }
    }
}
