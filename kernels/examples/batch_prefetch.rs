//! Times 16-row decode products over f32, f16, Q8_0 and Q4_1 weights (the quantised ones on
//! the VNNI panel kernel where the CPU has it) at SmolLM2-135M's shapes with the
//! batch prefetch (`THAW_BATCH_PREFETCH`) on and off, interleaved in one process, weights
//! rotating through 512 MiB of copies (read from memory, as a decode step does), one thread.
//! Each cell is the best of 5 passes; the ratio is off / on (above 1: the prefetch helps).
//!
//! `cargo run --release -p thaw-kernels --example batch_prefetch`
use std::time::Instant;

use thaw_kernels::cpu::simd::set_batch_prefetch;
use thaw_kernels::cpu::{WeightFormat, WeightMatrix};

fn main() {
    let m = 16;
    println!("format shape (n x k), {m} rows: µs on | µs off | off/on");
    for f in [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
    ] {
        for (n, k) in [(576, 576), (1536, 576), (576, 1536), (49152, 576)] {
            let bytes = f.bytes_for(n * k).unwrap();
            let copies = ((512usize << 20) / bytes).max(2);
            let ws: Vec<WeightMatrix> = (0..copies)
                .map(|c| {
                    let w: Vec<f32> = (0..n * k)
                        .map(|i| ((i * 7 + c) % 13) as f32 * 0.01 - 0.06)
                        .collect();
                    WeightMatrix::from_f32(w, n, k).convert(f).unwrap()
                })
                .collect();
            let x: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
            let mut y = vec![0.0f32; m * n];
            let reps = (copies * 2).max(20);
            let mut best = [f64::MAX; 2];
            for _ in 0..5 {
                for (s, on) in [true, false].into_iter().enumerate() {
                    set_batch_prefetch(on);
                    let t = Instant::now();
                    for r in 0..reps {
                        ws[r % copies].matmul(&x, m, &mut y);
                    }
                    best[s] = best[s].min(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            println!(
                "{f:?} {n}x{k}: {:.1} | {:.1} | {:.2}",
                best[0] * 1e6,
                best[1] * 1e6,
                best[1] / best[0]
            );
        }
    }
}
