//! Times the prompt (prefill) products `y = x · Wᵀ` as the CPU backend runs them
//! (`WeightMatrix::matmul`, more than 16 rows: the packed f32 GEMM, `vdpbf16ps` pairs for bf16,
//! `vpdpbusd` on Q8 activations for Q8_0, Q4_1 and Q4_K: the "Q4_K" GGUF of SmolLM2 stores its
//! `k = 576` weights as Q4_1 and only `ffn_down` as Q4_K) at SmolLM2-135M's shapes for one thread's
//! share of a prefill step (a step of 16 × 128-token prompts gives each of 2 threads 1,024
//! rows), at f32, bf16, Q8_0, Q4_1 and Q4_K stored weights, one thread. Each cell is the best of
//! `passes` (default 5) passes, the kernels alternated pass by pass, timed in this thread's CPU
//! time (the VM is shared: the wall clock would count the slices other jobs ran in); a
//! neighbour's cache traffic only slows a pass down. Columns: µs per call, µs per activation row (flat when the per-call
//! costs — packing, conversions — are amortised), GFLOP/s, for the tuned kernels (`new`) and
//! the previous ones (`old`, `THAW_PROMPT_TUNING=0`, see `simd::set_prompt_tuning`) in one
//! process, and old ÷ new (above 1: the tuning helps; the outputs are the same bits).
//!
//! `cargo run --release -p thaw-kernels --example prefill_gemm [passes] [m,m,…]`
use thaw_kernels::cpu::simd::set_prompt_tuning;
use thaw_kernels::cpu::{WeightFormat, WeightMatrix};

/// Seconds of CPU time this thread has run: on a VM shared with other jobs the wall clock
/// also counts the time slices this thread waited for.
fn thread_secs() -> f64 {
    thaw_ipc::thread_cpu_time().as_secs_f64()
}

/// A `[n, k]` weight in `format` from seeded values (Q4_K: random blocks with small scales,
/// Thaw's quantiser has no K-quants; the cost of a product does not depend on the values);
/// `None` where rows of `k` are not whole blocks of `format`.
fn weight(
    format: WeightFormat,
    n: usize,
    k: usize,
    rnd: &mut impl FnMut() -> f32,
) -> Option<WeightMatrix> {
    if !k.is_multiple_of(format.block_elems()) {
        return None;
    }
    if format == WeightFormat::Q4_K {
        let bytes: Vec<u8> = (0..format.bytes_for(n * k).unwrap())
            .map(|i| {
                if i % 144 < 4 {
                    0x11
                } else {
                    (rnd() * 255.0) as u8 & 0x3f
                }
            })
            .collect();
        return WeightMatrix::from_bytes(format, &bytes, n, k).ok();
    }
    let w: Vec<f32> = (0..n * k).map(|_| rnd() * 0.1).collect();
    WeightMatrix::from_f32(w, n, k).convert(format).ok()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let passes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let ms: Vec<usize> = args
        .next()
        .map(|a| a.split(',').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_else(|| vec![128, 512, 1024, 2048]);
    let mut seed = 0x2545_f491_u32;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) - 0.5
    };
    let shapes = [
        (576, 576, "q/o"),
        (192, 576, "k/v"),
        (1536, 576, "gate/up"),
        (576, 1536, "down"),
    ];
    let formats = [
        WeightFormat::F32,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
        WeightFormat::Q4_K,
    ];
    println!("| format | shape n×k | m | old µs | new µs | new µs/row | old GFLOP/s | new GFLOP/s | old ÷ new |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (n, k, what) in shapes {
        let ws: Vec<WeightMatrix> = formats
            .iter()
            .filter_map(|&f| weight(f, n, k, &mut rnd))
            .collect();
        for &m in &ms {
            let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
            let mut y = vec![0.0f32; m * n];
            // [new, old] per weight.
            let mut best = vec![[f64::MAX; 2]; ws.len()];
            let reps = (400_000_000 / (m * n * k)).clamp(1, 20);
            for _ in 0..passes {
                for (w, b) in ws.iter().zip(best.iter_mut()) {
                    for (s, on) in [true, false].into_iter().enumerate() {
                        set_prompt_tuning(on);
                        w.matmul(&x, m, &mut y);
                        let t = thread_secs();
                        for _ in 0..reps {
                            w.matmul(&x, m, &mut y);
                        }
                        b[s] = b[s].min((thread_secs() - t) / reps as f64);
                    }
                }
            }
            for (w, [new, old]) in ws.iter().zip(&best) {
                let gf = |t: f64| 2.0 * (m * n * k) as f64 / t / 1e9;
                println!(
                    "| {} | {what} {n}×{k} | {m} | {:.0} | {:.0} | {:.2} | {:.1} | {:.1} | {:.2} |",
                    w.format(),
                    old * 1e6,
                    new * 1e6,
                    new * 1e6 / m as f64,
                    gf(*old),
                    gf(*new),
                    old / new
                );
            }
        }
    }
}
