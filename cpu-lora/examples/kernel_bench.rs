//! Single-core microbenchmark of the LoRA delta kernel against the machine's f32 GEMM rate.
//!
//! ```text
//! cargo run --release -p thaw-cpu-lora --example kernel_bench \
//!     [-- --cold] [--only ROWS,RANK] [--isa scalar|avx2|avx512]
//! ```
//!
//! Prints the reference rate (`matrixmultiply::sgemm`, 1024³, one thread; it uses AVX-512
//! where the CPU has it), then for rows {16, 128, 512} × rank {16, 64, 128} at hidden 4096
//! and f32/bf16 weights:
//!
//! * `ours GF`, `ratio`: our kernel in GFLOP/s and as a fraction of the reference;
//! * `GB/s`: bytes it must move (x, A, B in their dtype, Δ once) per second;
//! * `mm GF`, `ratio`: `matrixmultiply` doing shrink then expand (two sgemm calls, f32 weights);
//! * `flop/B`: the shape's arithmetic intensity;
//! * `floor GF`: the rate at which merely streaming the bytes would take all the time
//!   (copying `x` into `Δ` plus a pass over the weights) — the memory roofline of the shape;
//! * PASS/FAIL against the 70 % target.
//!
//! Timings are medians of 31 samples of ~3 ms of *thread CPU time*, so other processes on a
//! shared machine do not count against a sample (they still share caches and memory
//! bandwidth); the thread is pinned to one core (`THAW_BENCH_CORE`, default the last).
//! Nothing is asserted.
//!
//! By default the inputs stay hot in cache between samples (the compute ceiling). `--cold`
//! rotates our kernel over enough copies of the weights to exceed the last-level cache, as a
//! worker sees them when every call is a different adapter or layer (`mm` stays hot).

use std::hint::black_box;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_cpu_lora::kernel::{
    flops, lora_delta_on, min_bytes, Isa, LoraMat, LoraProblem, Scratch, WeightDtype,
};

const TARGET: f64 = 0.70;
const SAMPLES: usize = 31;
const SAMPLE_TIME: Duration = Duration::from_millis(3);
/// Bytes of weight copies to rotate over in `--cold` mode (well above a 32 MiB L3).
const COLD_BYTES: usize = 256 << 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cold = args.iter().any(|a| a == "--cold");
    // `--only ROWS,RANK` runs one shape (for profiling).
    let only: Option<(usize, usize)> = args.iter().position(|a| a == "--only").and_then(|i| {
        let (r, k) = args.get(i + 1)?.split_once(',')?;
        Some((r.parse().ok()?, k.parse().ok()?))
    });
    let core = pin();
    // `--isa scalar|avx2|avx512` forces an instruction set (default: the best available).
    let isa = match args
        .iter()
        .position(|a| a == "--isa")
        .and_then(|i| args.get(i + 1))
    {
        Some(name) => *Isa::ALL
            .iter()
            .find(|i| format!("{i:?}").eq_ignore_ascii_case(name))
            .expect("--isa takes scalar, avx2 or avx512"),
        None => Isa::best(),
    };
    println!(
        "# thaw-cpu-lora kernel_bench: isa {isa:?}, pinned to core {core:?}, {}",
        load()
    );
    let reference = sgemm_reference();
    println!("reference: matrixmultiply::sgemm 1024^3, 1 thread: {reference:.1} GFLOP/s\n");
    println!(
        "{:<5} {:>4} {:>4} | {:>8} {:>6} {:>7} | {:>8} {:>6} | {:>6} {:>8} | {:>4}",
        "dtype",
        "rows",
        "rank",
        "ours GF",
        "ratio",
        "GB/s",
        "mm GF",
        "ratio",
        "flop/B",
        "floor GF",
        ""
    );
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        for rows in [16, 128, 512] {
            for rank in [16, 64, 128] {
                if only.is_some_and(|o| o != (rows, rank)) {
                    continue;
                }
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
                    "{:<5} {rows:>4} {rank:>4} | {ours:>8.1} {:>5.0}% {:>7.1} | {mm:>8.1} {:>5.0}% | {:>6.1} {:>8.1} | {pass}",
                    dtype.name(),
                    100.0 * ours / reference,
                    bytes / r.ours.as_secs_f64() / 1e9,
                    100.0 * mm / reference,
                    flops(&p) / bytes,
                    flops(&p) / r.floor.as_secs_f64() / 1e9,
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

/// Median over `SAMPLES` of the mean time per call, each sample running `f` for ~3 ms.
fn median_time(mut f: impl FnMut()) -> Duration {
    f();
    let start = Clock::now();
    f();
    let one = start.elapsed().max(Duration::from_nanos(100));
    let iters = (SAMPLE_TIME.as_secs_f64() / one.as_secs_f64())
        .ceil()
        .max(1.0) as u32;
    let mut samples: Vec<Duration> = (0..SAMPLES)
        .map(|_| {
            let start = Clock::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed() / iters
        })
        .collect();
    samples.sort();
    samples[SAMPLES / 2]
}

/// This thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`): time the pinned core spent on us,
/// so other processes sharing the machine do not inflate a sample; wall clock elsewhere.
#[derive(Copy, Clone)]
struct Clock(Duration);

impl Clock {
    #[cfg(target_os = "linux")]
    fn now() -> Self {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; the clock id is a Linux constant.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
        Self(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    #[cfg(not(target_os = "linux"))]
    fn now() -> Self {
        use std::sync::OnceLock;
        static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
        Self(EPOCH.get_or_init(std::time::Instant::now).elapsed())
    }

    fn elapsed(self) -> Duration {
        Self::now().0.saturating_sub(self.0)
    }
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
    assert!(a.len() > (m - 1) * sa[0] + (k - 1) * sa[1]);
    assert!(b.len() > (k - 1) * sb[0] + (n - 1) * sb[1]);
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
    /// Streaming floor: read `x` and the weights, write `Δ`, no arithmetic.
    floor: Duration,
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
    // The memory floor of this shape: what just moving its bytes costs on this core.
    let mut next = 0;
    let floor = median_time(|| {
        let (a, b) = &weights[next % copies];
        next += 1;
        let w = a
            .iter()
            .chain(b.iter())
            .step_by(64)
            .fold(0u8, |s, &v| s ^ v);
        for (o, row) in out.chunks_exact_mut(p.d_out).zip(x.chunks_exact(p.d_in)) {
            let n = p.d_out.min(p.d_in);
            o[..n].copy_from_slice(&row[..n]);
        }
        black_box((w, &mut out));
    });
    Timings { ours, mm, floor }
}
