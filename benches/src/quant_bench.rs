//! `thaw-bench weight-formats`: `y = x·Wᵀ` over every stored weight format on the shapes of
//! a real model (SmolLM2-135M: 576 ↔ 1536, and the 49152-row tied output head), decode
//! (1 row) and prefill-sized row counts, interleaved format by format so machine noise hits
//! all alike. Prints µs per product, effective weight GB/s and the speed relative to f32.
//! Q8_0 and Q4_K (and Q4_1 at more than 16 rows, `q8_prompt`) run twice where the CPU has
//! AVX512-VNNI: on Q8 activations with `vpdpbusd` (the default, kernels `avx512-vnni`) and on
//! f32 activations (`set_vnni_dot(false)`).
//!
//! With `--model` it measures the whole engine on a real model per stored precision instead
//! (batches with mixed adapters, tok/s and each batch over batch 1): see [`crate::quant_step`].
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use thaw_kernels::cpu::simd::{set_vnni_dot, vnni_dot_active, vnni_prompt_active};
use thaw_kernels::cpu::{set_simd_level, SimdLevel, WeightFormat, WeightMatrix};

/// Decode kernels to measure (`avx2` runs portable on CPUs without AVX2/FMA/F16C).
#[derive(ValueEnum, Copy, Clone, Debug, PartialEq, Eq)]
pub enum Simd {
    Portable,
    Avx2,
}

impl Simd {
    pub fn level(self) -> SimdLevel {
        match self {
            Simd::Portable => SimdLevel::Portable,
            Simd::Avx2 => SimdLevel::Avx2,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct WeightFormatsArgs {
    /// Rows of x (tokens in the step) to measure.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 16, 128])]
    pub rows: Vec<usize>,
    /// Interleaved rounds; the median round is reported.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Minimum time per measurement within a round.
    #[arg(long, default_value_t = 30)]
    pub min_ms: u64,
    /// Kernel levels, each format timed at each (interleaved); ratios are against f32 at the
    /// first level.
    #[arg(long, value_delimiter = ',', default_value = "portable,avx2")]
    pub simd: Vec<Simd>,
    /// Whole-engine mode: a HF model directory or GGUF file (repeatable), measured as stored
    /// with batches of `--batches` sequences instead of single products.
    #[arg(long, value_name = "PATH")]
    pub model: Vec<PathBuf>,
    /// With --model: PEFT adapter directories, mixed round robin over the batch's sequences.
    #[arg(long, value_name = "DIR")]
    pub lora: Vec<PathBuf>,
    /// With --model: also measure the first HF model re-encoded in these formats (f16, bf16,
    /// q8_0, q4_0, q4_1).
    #[arg(long, value_delimiter = ',')]
    pub convert: Vec<String>,
    /// With --model: sequences per batch.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 16])]
    pub batches: Vec<usize>,
    /// With --model: prompt tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// With --model: decode steps per sequence.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// With --model: CPU compute threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

impl Default for WeightFormatsArgs {
    fn default() -> Self {
        Self {
            rows: vec![1, 8, 16, 128],
            rounds: 7,
            min_ms: 30,
            simd: vec![Simd::Portable, Simd::Avx2],
            model: Vec::new(),
            lora: Vec::new(),
            convert: Vec::new(),
            batches: vec![1, 8, 16],
            prompt_len: 64,
            decode_steps: 32,
            threads: 2,
        }
    }
}

/// (name, output rows, input cols) of the measured products.
const SHAPES: [(&str, usize, usize); 3] = [
    ("gate/up 1536x576", 1536, 576),
    ("down 576x1536 (K-quants fit)", 576, 1536),
    ("lm_head 49152x576", 49152, 576),
];

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

fn time_one(w: &WeightMatrix, x: &[f32], m: usize, y: &mut [f32], min: Duration) -> f64 {
    w.matmul(x, m, y); // warm: scratch sized, pages touched
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < min {
        w.matmul(x, m, y);
        n += 1;
    }
    start.elapsed().as_secs_f64() / n as f64
}

/// Runs the measurements and renders the table.
pub fn run(args: &WeightFormatsArgs) -> anyhow::Result<String> {
    let levels: Vec<SimdLevel> = if args.simd.is_empty() {
        vec![SimdLevel::Avx2]
    } else {
        args.simd.iter().map(|s| s.level()).collect()
    };
    let mut out = format!(
        "| shape | rows | format | kernels | bytes | µs/product | weight GB/s | vs f32 ({}) | \
         rows/s vs {} row(s) |\n|---|---|---|---|---|---|---|---|---|\n",
        levels[0].name(),
        args.rows.first().copied().unwrap_or(1)
    );
    let mut seed = 15u64;
    for (name, n, k) in SHAPES {
        let w32: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.1).collect();
        let base = WeightMatrix::from_f32(w32, n, k);
        // Q4_K/Q6_K cannot be produced by Thaw's quantiser: they are measured on random
        // blocks, which cost the same to decode.
        // (K-quants need rows of whole 256-value blocks: 576 columns have none.)
        let mats: Vec<WeightMatrix> = WeightFormat::ALL
            .iter()
            .filter(|f| k.is_multiple_of(f.block_elems()))
            .map(|&f| match base.convert(f) {
                Ok(m) => m,
                Err(_) => {
                    let bytes: Vec<u8> = (0..f.bytes_for(n * k).expect("k is whole blocks"))
                        .map(|_| (lcg(&mut seed) * 255.0) as u8 & 0x3f)
                        .collect();
                    WeightMatrix::from_bytes(f, &bytes, n, k).expect("sized above")
                }
            })
            .collect();
        // Each cell's time at the first row count, keyed by (matrix, level, VNNI): batching
        // pays when m rows take less than m times as long. A VNNI cell that appears only at
        // larger row counts (Q4_1 takes it at prompt sizes) is against the same matrix's
        // f32-activation cell.
        let mut first: Vec<((usize, SimdLevel, bool), f64)> = Vec::new();
        for &m in &args.rows {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let mut y = vec![0.0; m * n];
            // (matrix, level, VNNI): the VNNI cell too where it applies (Q4_1 at prompt sizes,
            // `q8_prompt`).
            let vnni = |i: usize, l: SimdLevel| {
                let f = mats[i].format();
                set_simd_level(l) == SimdLevel::Avx2
                    && (vnni_dot_active(f) || (m > 16 && vnni_prompt_active(f)))
            };
            let cells: Vec<(usize, SimdLevel, bool)> = (0..mats.len())
                .flat_map(|i| levels.iter().map(move |&l| (i, l)))
                .flat_map(|(i, l)| {
                    let both = vnni(i, l);
                    [(i, l, false)]
                        .into_iter()
                        .chain(both.then_some((i, l, true)))
                })
                .collect();
            let mut times = vec![Vec::new(); cells.len()];
            let mut used = vec![SimdLevel::Portable; cells.len()];
            for _ in 0..args.rounds {
                for (c, &(i, l, v)) in cells.iter().enumerate() {
                    used[c] = set_simd_level(l);
                    set_vnni_dot(v);
                    let min = Duration::from_millis(args.min_ms);
                    times[c].push(time_one(&mats[i], &x, m, &mut y, min));
                }
            }
            set_simd_level(SimdLevel::Avx2);
            set_vnni_dot(true);
            let med: Vec<f64> = times
                .iter_mut()
                .map(|t| {
                    t.sort_by(f64::total_cmp);
                    t[t.len() / 2]
                })
                .collect();
            let m0 = args.rows[0].max(1) as f64;
            for (c, &(i, l, v)) in cells.iter().enumerate() {
                let (w, t) = (&mats[i], med[c]);
                let found = {
                    let at = |key| first.iter().find(|(k, _)| *k == key).map(|&(_, t0)| t0);
                    at((i, l, v)).or_else(|| at((i, l, false)))
                };
                let t0 = found.unwrap_or_else(|| {
                    first.push(((i, l, v), t * m0 / m as f64));
                    t * m0 / m as f64
                });
                let kernels = if v { "avx512-vnni" } else { used[c].name() };
                out.push_str(&format!(
                    "| {name} | {m} | {} | {} | {} | {:.1} | {:.2} | {:.2}x | {:.2}x |\n",
                    w.format(),
                    kernels,
                    w.storage_bytes(),
                    t * 1e6,
                    w.storage_bytes() as f64 / t / 1e9,
                    med[0] / t,
                    (m as f64 / t) / (m0 / t0)
                ));
            }
        }
    }
    Ok(out)
}
