//! Times the f32 prompt GEMM `y = x · wᵀ` per call at SmolLM2-135M's per-thread shapes (a
//! 64-token prompt, each of 2 threads computing half the output columns), one thread: the
//! in-place dot kernel (`gemm_nt_f32`, the decode path) against the packed prompt kernel
//! (`gemm_nt_f32_prompt`, what `linear` takes for more than 16 rows), and the packed kernel
//! over the same weights stored as bf16 (`gemm_nt_prompt`: `vdpbf16ps` pairs where the CPU has
//! AVX512-BF16, else widened while packed). Weights rotate through
//! 256 MiB of copies so each call reads its weight from memory, as a prefill does.
//!
//! `cargo run --release -p thaw-kernels --example prompt_gemm [reps]`
use std::time::Instant;

use half::bf16;
use thaw_kernels::cpu::simd::{gemm_nt_f32, gemm_nt_f32_prompt, gemm_nt_prompt, FloatWeights};

/// GFLOP/s of a register-only loop of independent 16-lane FMAs (24 chains): this core's
/// peak for the f32 GEMM, whatever its clock.
#[cfg(target_arch = "x86_64")]
fn fma_peak() -> f64 {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f")]
    fn run(iters: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(0.0); 24];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for v in acc {
            s = _mm512_add_ps(s, v);
        }
        _mm512_reduce_add_ps(s)
    }
    assert!(is_x86_feature_detected!("avx512f"), "no AVX-512F here");
    let iters = 20_000_000;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: AVX-512F was detected above.
        std::hint::black_box(unsafe { run(iters) });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (iters * 24 * 32) as f64 / best / 1e9
}

/// GFLOP/s of a register-only loop of independent `vdpbf16ps` (24 chains, 32 bf16 products
/// each): this core's peak for the bf16 prompt GEMM; `None` without AVX512-BF16.
#[cfg(target_arch = "x86_64")]
fn bf16_peak() -> Option<f64> {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn run(iters: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(0.0); 24];
        // SAFETY: `__m512bh` is 32 bf16 values in the same 512 bits.
        let (a, b) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3f80)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3380)),
            )
        };
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for v in acc {
            s = _mm512_add_ps(s, v);
        }
        _mm512_reduce_add_ps(s)
    }
    if !is_x86_feature_detected!("avx512bf16") {
        return None;
    }
    let iters = 20_000_000;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: AVX512-BF16 (and so AVX-512F) was detected above.
        std::hint::black_box(unsafe { run(iters) });
        best = best.min(t.elapsed().as_secs_f64());
    }
    Some((iters * 24 * 64) as f64 / best / 1e9)
}

/// The kernels compared.
#[derive(Copy, Clone)]
enum Kernel {
    Dot,
    Packed,
    PackedBf16,
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        println!("one core's FMA peak: {:.1} GFLOP/s", fma_peak());
        if let Some(p) = bf16_peak() {
            println!("one core's vdpbf16ps peak: {p:.1} GFLOP/s");
        }
    }
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let shapes = [
        (64, 576, 288, "q/o half"),
        (64, 576, 96, "k/v half"),
        (64, 576, 768, "gate/up half"),
        (64, 1536, 288, "down half"),
        (64, 576, 576, "q/o whole"),
        (48, 576, 288, "q/o half, 48 rows"),
        (32, 576, 288, "q/o half, 32 rows"),
        (17, 576, 288, "q/o half, 17 rows"),
        (128, 576, 288, "q/o half, 128 rows"),
        // A prefill step of 16 × 128-token prompts, rows split over 2 threads (1024 each) or
        // chunked: whole weights.
        (256, 576, 576, "q/o, 256 rows"),
        (256, 576, 192, "k/v, 256 rows"),
        (256, 576, 1536, "gate/up, 256 rows"),
        (256, 1536, 576, "down, 256 rows"),
        (1024, 576, 1536, "gate/up, 1024 rows"),
    ];
    println!("| m | k | n | shape | dot kernel µs | packed µs | bf16 packed µs | dot GFLOP/s | packed GFLOP/s | bf16 packed GFLOP/s | packed ÷ dot time |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut seed = 0x2545_f491_u32;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) - 0.5
    };
    for (m, k, n, what) in shapes {
        let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
        let pool_mib: usize = std::env::var("POOL_MIB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256);
        let copies = ((pool_mib << 20) / (n * k * 4)).max(1);
        let ws: Vec<Vec<f32>> = (0..copies)
            .map(|_| (0..n * k).map(|_| rnd()).collect())
            .collect();
        let ws16: Vec<Vec<bf16>> = ws
            .iter()
            .take((copies / 2).max(1))
            .map(|w| w.iter().map(|&v| bf16::from_f32(v)).collect())
            .collect();
        let mut y = vec![0.0f32; m * n];
        let mut time = |kernel: Kernel| {
            let mut best = f64::MAX;
            // Best of 3 passes of `reps` calls (the median-free minimum: neighbours only slow).
            for _ in 0..1 {
                let t = Instant::now();
                for r in 0..reps {
                    let w = &ws[r % copies];
                    let ok = match kernel {
                        Kernel::Dot => gemm_nt_f32(&x, w, (m, k, n), &mut y, n),
                        Kernel::Packed => gemm_nt_f32_prompt(&x, w, (m, k, n), &mut y, n),
                        Kernel::PackedBf16 => {
                            let w = FloatWeights::BF16(&ws16[r % ws16.len()]);
                            gemm_nt_prompt(&x, w, (m, k, n), &mut y, n)
                        }
                    };
                    assert!(ok, "no AVX-512F here");
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            best
        };
        let (mut dot, mut packed, mut pbf) = (f64::MAX, f64::MAX, f64::MAX);
        // Alternated passes, the best of each (neighbours only slow a pass down).
        for _ in 0..4 {
            dot = dot.min(time(Kernel::Dot));
            packed = packed.min(time(Kernel::Packed));
            pbf = pbf.min(time(Kernel::PackedBf16));
        }
        let flop = 2.0 * (m * k * n) as f64;
        println!(
            "| {m} | {k} | {n} | {what} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            dot * 1e6,
            packed * 1e6,
            pbf * 1e6,
            flop / dot / 1e9,
            flop / packed / 1e9,
            flop / pbf / 1e9,
            packed / dot
        );
    }
}
