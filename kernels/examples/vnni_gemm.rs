//! Times the quantised products at SmolLM2-135M's shapes, one thread, against this core's
//! peaks measured in the same process (so the efficiency column survives a shared machine
//! better than the µs): prompt rows (Q8 activations, `vpdpbusd`, 64 multiply-adds an
//! instruction) and decode batches (Q8_0/Q4_K on `vpdpbusd`; Q4_1 on f32 activations, 16
//! fused multiply-adds an instruction). Each cell is the best of 5 passes of `reps` calls
//! (default 3: short passes, so a neighbour's time slice rarely lands in the best one).
//!
//! `cargo run --release -p thaw-kernels --example vnni_gemm [reps]`
use std::time::Instant;

use thaw_kernels::cpu::{WeightFormat, WeightMatrix};

/// Multiply-adds per second of a register-only loop of 24 independent chains of `op`.
#[cfg(target_arch = "x86_64")]
fn peak(vnni: bool) -> f64 {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn run(iters: usize, vnni: bool) -> i64 {
        let mut ai = [_mm512_set1_epi32(0); 24];
        let mut af = [_mm512_set1_ps(0.0); 24];
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        let (fa, fb) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            if vnni {
                for v in ai.iter_mut() {
                    *v = _mm512_dpbusd_epi32(*v, a, b);
                }
            } else {
                for v in af.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, fa, fb);
                }
            }
        }
        let (mut s, mut f) = (_mm512_setzero_si512(), _mm512_setzero_ps());
        for (v, w) in ai.iter().zip(af) {
            s = _mm512_add_epi32(s, *v);
            f = _mm512_add_ps(f, w);
        }
        _mm512_reduce_add_epi32(s) as i64 + _mm512_reduce_add_ps(f) as i64
    }
    assert!(
        is_x86_feature_detected!("avx512vnni"),
        "no AVX512-VNNI here"
    );
    // Short passes (about a millisecond), the best of many: on a shared machine a long pass
    // is mostly someone else's time slice.
    let iters = 100_000;
    let mut best = f64::MAX;
    for _ in 0..15 {
        let t = Instant::now();
        // SAFETY: AVX512-VNNI (and F, BW) detected above.
        std::hint::black_box(unsafe { run(iters, vnni) });
        best = best.min(t.elapsed().as_secs_f64());
    }
    let per = if vnni { 64 } else { 16 };
    (iters * 24 * per) as f64 / best
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let mut seed = 0x2545_f491_u32;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) - 0.5
    };
    let shapes = [
        (WeightFormat::Q4_1, 1536, 576, "gate/up"),
        (WeightFormat::Q4_1, 576, 576, "q/o"),
        (WeightFormat::Q4_K, 576, 1536, "down"),
        (WeightFormat::Q8_0, 1536, 576, "gate/up"),
        (WeightFormat::Q8_0, 576, 1536, "down"),
    ];
    println!("| format | shape | m | µs | GMAC/s | peak GMAC/s (same pass) | efficiency |");
    println!("|---|---|---|---|---|---|---|");
    for (f, n, k, what) in shapes {
        let w = if f == WeightFormat::Q4_K {
            // Thaw's quantiser has no K-quants: random blocks cost the same to multiply.
            let bytes: Vec<u8> = (0..f.bytes_for(n * k).unwrap())
                .map(|i| {
                    if i % 144 < 4 {
                        0x11
                    } else {
                        (rnd() * 255.0) as u8 & 0x3f
                    }
                })
                .collect();
            WeightMatrix::from_bytes(f, &bytes, n, k).unwrap()
        } else {
            let w32: Vec<f32> = (0..n * k).map(|_| rnd() * 0.1).collect();
            WeightMatrix::from_f32(w32, n, k).convert(f).unwrap()
        };
        for m in [16usize, 128] {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let mut y = vec![0.0f32; m * n];
            // Q4_1 decode rows multiply f32 activations (16 per instruction).
            let vnni = !(f == WeightFormat::Q4_1 && m <= 16);
            let (mut best, mut pk) = (f64::MAX, 0.0f64);
            for _ in 0..5 {
                pk = pk.max(peak(vnni));
                w.matmul(&x, m, &mut y);
                let t = Instant::now();
                for _ in 0..reps {
                    w.matmul(&x, m, &mut y);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            let mac = (m * n * k) as f64 / best;
            println!(
                "| {f} | {what} {n}x{k} | {m} | {:.1} | {:.1} | {:.1} ({}) | {:.0}% |",
                best * 1e6,
                mac / 1e9,
                pk / 1e9,
                if vnni { "vpdpbusd" } else { "f32 fma" },
                100.0 * mac / pk
            );
        }
    }
}
