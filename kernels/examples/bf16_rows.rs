//! Times bf16 decode products through `WeightMatrix::matmul` at SmolLM2-135M's shapes, weights
//! rotating through 512 MiB of copies (read from memory, as a decode step does), one thread:
//! run it twice, with `THAW_BF16_DOT=0` (f32 activations, the AVX2 row dot) and without
//! (`vdpbf16ps` rows), to compare.
//!
//! `cargo run --release -p thaw-kernels --example bf16_rows`
use std::time::Instant;

use half::bf16;
use thaw_kernels::cpu::{WeightData, WeightMatrix};

fn main() {
    for (m, n, k, what) in [
        (1, 1536, 576, "gate/up"),
        (1, 576, 1536, "down"),
        (1, 49152, 576, "lm_head"),
        (16, 1536, 576, "gate/up"),
        (16, 49152, 576, "lm_head"),
    ] {
        let copies = ((512usize << 20) / (n * k * 2)).max(2);
        let ws: Vec<WeightMatrix> = (0..copies)
            .map(|c| {
                let w: Vec<bf16> = (0..n * k)
                    .map(|i| bf16::from_f32(((i * 7 + c) % 13) as f32 * 0.01 - 0.06))
                    .collect();
                WeightMatrix::from_data(WeightData::BF16(w.into()), n, k).unwrap()
            })
            .collect();
        let x: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
        let mut y = vec![0.0f32; m * n];
        let reps = (copies * 4).max(20);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            for r in 0..reps {
                ws[r % copies].matmul(&x, m, &mut y);
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "{what} {n}x{k}, {m} row(s): {:.1} µs, {:.2} GB/s of weight",
            best * 1e6,
            (n * k * 2) as f64 / best / 1e9
        );
    }
}
