//! Single-core microbenchmark of the LoRA delta kernel against the machine's f32 GEMM rate.
//!
//! `cargo run --release -p thaw-cpu-lora --example kernel_bench [-- --cold]`
//!
//! Prints the reference rate (`matrixmultiply::sgemm`, 1024³, one thread), then for rows
//! {16, 128, 512} × rank {16, 64, 128} at hidden 4096 and f32/bf16 weights: our kernel and
//! `matrixmultiply` (shrink then expand, two sgemm calls on f32 weights) in GFLOP/s, each as a
//! fraction of the reference, our achieved GB/s (x, A, B, Δ once each), and a pass column
//! against the 70 % target. Timings are medians of several samples; the thread is pinned to
//! one core (`THAW_BENCH_CORE`, default the last). Nothing is asserted.
//!
//! By default the inputs stay hot in cache between samples (the kernel's compute ceiling).
//! `--cold` rotates over enough copies of the weights to exceed the last-level cache, as a
//! worker sees them when every call is a different adapter or layer.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_cpu_lora::kernel::{
    flops, lora_delta_on, min_bytes, Isa, LoraMat, LoraProblem, Scratch, WeightDtype,
};

const TARGET: f64 = 0.70;
const SAMPLES: usize = 9;
const SAMPLE_TIME: Duration = Duration::from_millis(20);
/// Bytes of weight copies to rotate over in `--cold` mode (well above a 32 MiB L3).
const COLD_BYTES: usize = 256 << 20;

fn main() {
    let cold = std::env::args().any(|a| a == "--cold");
    let core = pin();
    let isa = Isa::best();
    println!(
        "# thaw-cpu-lora kernel_bench: isa {isa:?}, pinned to core {core:?}, {}",
        load()
    );
    let reference = sgemm_reference();
    println!("reference: matrixmultiply::sgemm 1024^3, 1 thread: {reference:.1} GFLOP/s\n");
    println!(
        "{:<5} {:>4} {:>4} | {:>8} {:>6} {:>7} | {:>8} {:>6} | {:>5} {:>4}",
        "dtype", "rows", "rank", "ours GF", "ratio", "GB/s", "mm GF", "ratio", "flop/B", ""
    );
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        for rows in [16, 128, 512] {
            for rank in [16, 64, 128] {
                let p = LoraProblem {
                    rows,
                    d_in: 4096,
                    d_out: 4096,
                    rank,
                    scale: 0.5,
                };
                let r = bench_shape(&mut rng, &p, dtype, isa, cold);
                let bytes = min_bytes(&p, dtype, false);
                let ours = flops(&p) / r.ours.as_secs_f64() / 1e9;
                let mm = flops(&p) / r.mm.as_secs_f64() / 1e9;
                let pass = if ours / reference >= TARGET {
                    "PASS"
                } else {
                    "FAIL"
                };
                println!(
                    "{:<5} {rows:>4} {rank:>4} | {ours:>8.1} {:>5.0}% {:>7.1} | {mm:>8.1} {:>5.0}% | {:>6.1} {pass}",
                    dtype.name(),
                    100.0 * ours / reference,
                    bytes / r.ours.as_secs_f64() / 1e9,
                    100.0 * mm / reference,
                    flops(&p) / bytes,
                );
            }
        }
    }
    let mode = if cold {
        "cold (weights rotated past the LLC)"
    } else {
        "hot (weights cached)"
    };
    println!(
        "\nmode: {mode}; target: ours >= {:.0}% of reference; {}",
        100.0 * TARGET,
        load()
    );
}

fn pin() -> Option<usize> {
    let ids = core_affinity::get_core_ids()?;
    let want = std::env::var("THAW_BENCH_CORE")
        .ok()
        .and_then(|v| v.parse().ok());
    let id = match want {
        Some(w) => *ids.iter().find(|c| c.id == w)?,
        None => *ids.last()?,
    };
    core_affinity::set_for_current(id).then_some(id.id)
}

fn load() -> String {
    let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    format!(
        "loadavg {}",
        l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    )
}

/// Median over `SAMPLES` of the mean time per call, each sample running `f` for ~20 ms.
fn median_time(mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    f();
    let one = start.elapsed().max(Duration::from_nanos(100));
    let iters = (SAMPLE_TIME.as_secs_f64() / one.as_secs_f64())
        .ceil()
        .max(1.0) as u32;
    let mut samples: Vec<Duration> = (0..SAMPLES)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed() / iters
        })
        .collect();
    samples.sort();
    samples[SAMPLES / 2]
}

fn random(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn sgemm_reference() -> f64 {
    let n = 1024;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let (a, b) = (random(&mut rng, n * n), random(&mut rng, n * n));
    let mut c = vec![0.0f32; n * n];
    let t = median_time(|| sgemm(n, n, n, 1.0, &a, [n, 1], &b, [n, 1], &mut c));
    2.0 * (n * n * n) as f64 / t.as_secs_f64() / 1e9
}

/// `c[m, n] = alpha · a[m, k] · b[k, n]`, strides `[row, col]`, one thread.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: &[f32],
    sa: [usize; 2],
    b: &[f32],
    sb: [usize; 2],
    c: &mut [f32],
) {
    assert!(a.len() >= (m - 1) * sa[0] + (k - 1) * sa[1] + 1);
    assert!(b.len() >= (k - 1) * sb[0] + (n - 1) * sb[1] + 1);
    assert_eq!(c.len(), m * n);
    let s = |v: usize| v as isize;
    // SAFETY: the asserts above keep every strided element of a, b and c inside its slice.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            s(sa[0]),
            s(sa[1]),
            b.as_ptr(),
            s(sb[0]),
            s(sb[1]),
            0.0,
            c.as_mut_ptr(),
            s(n),
            1,
        );
    }
}

struct Timings {
    ours: Duration,
    mm: Duration,
}

fn bench_shape(
    rng: &mut ChaCha8Rng,
    p: &LoraProblem,
    dtype: WeightDtype,
    isa: Isa,
    cold: bool,
) -> Timings {
    let a32 = random(rng, p.rank * p.d_in);
    let b32 = random(rng, p.d_out * p.rank);
    let encode = |w: &[f32]| -> Vec<u8> {
        match dtype {
            WeightDtype::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            WeightDtype::F16 => w
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            WeightDtype::Bf16 => w
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    };
    let weight_bytes = (p.rank * (p.d_in + p.d_out) * dtype.size()).max(1);
    let copies = if cold {
        (COLD_BYTES / weight_bytes).clamp(1, 256)
    } else {
        1
    };
    let weights: Vec<(Vec<u8>, Vec<u8>)> =
        (0..copies).map(|_| (encode(&a32), encode(&b32))).collect();
    let x = random(rng, p.rows * p.d_in);
    let mut out = vec![0.0f32; p.rows * p.d_out];
    let mut scratch = Scratch::for_problem(p);
    let mut next = 0;
    let ours = median_time(|| {
        let (a, b) = &weights[next % copies];
        next += 1;
        let (a, b) = (LoraMat { dtype, bytes: a }, LoraMat { dtype, bytes: b });
        lora_delta_on(isa, p, black_box(&x), a, b, &mut out, false, &mut scratch).expect("valid");
        black_box(&mut out);
    });
    // matrixmultiply on the f32 weights: t = x · Aᵀ, then Δ = scale · t · Bᵀ.
    let mut t = vec![0.0f32; p.rows * p.rank];
    let mm = median_time(|| {
        sgemm(
            p.rows,
            p.d_in,
            p.rank,
            1.0,
            &x,
            [p.d_in, 1],
            &a32,
            [1, p.d_in],
            &mut t,
        );
        sgemm(
            p.rows,
            p.rank,
            p.d_out,
            p.scale,
            &t,
            [p.rank, 1],
            &b32,
            [1, p.rank],
            &mut out,
        );
        black_box(&mut out);
    });
    Timings { ours, mm }
}
