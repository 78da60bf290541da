//! `set_vnni_dot` in its own process (it changes a process-wide setting, so it cannot share
//! a test binary with products that read it): off, Q8_0 and Q4_K products are the f32 product
//! with the dequantised weight again; on, they run the VNNI kernel where the CPU has it.
use thaw_kernels::cpu::simd::{gemm_nt_available, set_vnni_dot, vnni_dot_active};
use thaw_kernels::cpu::{q8_activations, WeightFormat, WeightMatrix};

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32 - 0.5
        })
        .collect()
}

#[test]
fn vnni_switch_selects_the_product() {
    let (m, k, n) = (5, 512, 40);
    let w = WeightMatrix::from_f32(values(n * k, 7), n, k)
        .convert(WeightFormat::Q8_0)
        .unwrap();
    let wide = WeightMatrix::from_f32(w.to_f32(), n, k);
    let x = values(m * k, 11);
    let product = |w: &WeightMatrix| {
        let mut y = vec![f32::NAN; m * n];
        w.matmul(&x, m, &mut y);
        y
    };
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let has = vnni_dot_active(WeightFormat::Q8_0);
    let was = set_vnni_dot(false);
    assert_eq!(was, has);
    assert!(!vnni_dot_active(WeightFormat::Q8_0) && !vnni_dot_active(WeightFormat::Q4_K));
    if gemm_nt_available() {
        assert_eq!(
            bits(product(&w)),
            bits(product(&wide)),
            "off: the f32 product"
        );
    }
    set_vnni_dot(true);
    assert_eq!(vnni_dot_active(WeightFormat::Q8_0), has);
    // Q4_1 decode rows follow the kernel by default (Q8 activations on where it runs), and
    // switching the kernel off switches them back to f32 activations.
    assert_eq!(vnni_dot_active(WeightFormat::Q4_1), has && q8_activations());
    set_vnni_dot(false);
    assert!(!vnni_dot_active(WeightFormat::Q4_1));
    if std::env::var_os("THAW_Q8_ACTIVATIONS").is_none() {
        assert!(
            !q8_activations(),
            "Q8 activations follow the VNNI switch by default"
        );
    }
    set_vnni_dot(true);
    if has {
        let (q, f) = (product(&w), product(&wide));
        assert_ne!(
            bits(q.clone()),
            bits(f.clone()),
            "on: Q8-rounded activations"
        );
        // Q8 rounding of activations in [-0.5, 0.5): a relative error of a few 1e-3 at most.
        let scale = f.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        for (a, b) in q.iter().zip(&f) {
            assert!((a - b).abs() <= 2e-2 * scale, "on: {a} vs {b}");
        }
    } else {
        eprintln!("no AVX512-VNNI here: checked the off path only");
    }
}
