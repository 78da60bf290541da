//! `thaw-bench gpu` (issue 29): the engine's speed against the device's roofline, in one call.
//!
//! 1. Roofline inputs: the backend's copy bandwidth (its row-copy kernel, bytes read + written)
//!    and GEMM rate (its `linear`, the path the engine's projections take), or `--peak-gbs` /
//!    `--peak-tflops` given.
//! 2. The SGMV / BGMV table of `benches/results/cuda-h100.md` §2, from the same cases as
//!    `cuda_bench` (`thaw_runtime::microbench`), timed by the wall clock over back-to-back calls.
//! 3. Decode tokens/s and achieved bandwidth (weights + distinct adapters + KV read per step ÷
//!    step time) at each `--batches` size with no adapter, one adapter and one distinct adapter
//!    per sequence, per `--ranks`, through the engine (`Engine::step`, sampling included).
//!    With each decode row, what the backend asked of the driver per step (`counts.rs`:
//!    launches, allocations, copies, synchronisations; CUDA only).
//! 4. Prefill TFLOP/s of one sequence at each `--prefill-tokens`.
//! 5. With `--op-profile`, where a decode step's (`op_profile.rs`) and a prefill's
//!    (`prefill_profile.rs`) time goes, per op class.
//!
//! Runs on any backend: `--device cuda` on the GPU machine; `--device cpu --quick` is a
//! seconds-long run of the same code on the tiny preset (the test suite runs it). Tables only;
//! nothing asserts a time.
mod cases;
mod counts;
mod lora_rows;
pub mod op_profile;
mod peaks;
pub mod prefill_profile;
pub mod roofline;

use std::fmt::Write;
use std::path::PathBuf;

use thaw_runtime::backend::DeviceKind;
use thaw_server::gen::Projection;

pub use cases::{DecodeRow, Mix, PrefillRow};
pub use peaks::Peaks;

/// Options of `thaw-bench gpu`.
#[derive(clap::Args, Clone, Debug)]
pub struct GpuArgs {
    /// Backend: cuda, cpu, or auto (CUDA when built with it and a GPU is present).
    #[arg(long, default_value = "auto")]
    pub device: DeviceKind,
    /// Generated model preset (see `thaw gen-model --help`), written under --workdir.
    #[arg(long, default_value = "llama-7b-shape")]
    pub preset: String,
    /// An existing model directory (e.g. one `thaw gen-model` wrote) instead of --preset.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the model and adapters are generated (reused when already there); a temporary
    /// directory when absent.
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub batches: Vec<usize>,
    /// Adapter ranks of the decode rows (one adapter, and one per sequence, per rank).
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    pub ranks: Vec<usize>,
    /// Projections every decode adapter targets.
    #[arg(long, value_delimiter = ',', default_value = "q,k,v,o")]
    pub targets: Vec<Projection>,
    /// Prompt tokens of every decode sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Timed decode steps per row (after 2 warm-up steps).
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Prompt lengths of the prefill rows (one sequence each).
    #[arg(long, value_delimiter = ',', default_value = "128,2048")]
    pub prefill_tokens: Vec<usize>,
    /// Timed repetitions of each prefill; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Roofline bandwidth in GB/s (e.g. the card's measured device-to-device copy); measured
    /// with the backend's row copy when absent.
    #[arg(long)]
    pub peak_gbs: Option<f64>,
    /// Roofline GEMM rate in TFLOP/s (e.g. a cuBLAS bf16 8192³ product); measured with the
    /// backend's `linear` when absent.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Batch sizes of the SGMV / BGMV table (empty: skip the table).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub lora_batches: Vec<usize>,
    /// Ranks of the SGMV / BGMV table.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128")]
    pub lora_ranks: Vec<usize>,
    /// A seconds-long run on the tiny preset (CPU backend unless --device says otherwise).
    #[arg(long)]
    pub quick: bool,
    /// Also time every decode row with CUDA graphs on (`thaw serve --cuda-graphs`) and print
    /// graph against eager tokens/s (skipped on a backend without graphs).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// After each eager decode row, profile `--op-profile-steps` more steps with every
    /// backend op timed (CUDA events on the compute stream; the wall clock on the CPU) and
    /// print where a step's time goes, per op class; likewise after each prefill length's
    /// timed prefills, `--op-profile-steps` more (linears and attention in TFLOP/s,
    /// elementwise ops in GB/s).
    #[arg(long)]
    pub op_profile: bool,
    /// Steps each `--op-profile` table averages.
    #[arg(long, default_value_t = 4)]
    pub op_profile_steps: usize,
}

impl GpuArgs {
    /// The bounded configuration the test suite runs.
    pub fn quick() -> Self {
        Self {
            device: DeviceKind::Cpu,
            preset: "tiny".into(),
            model: None,
            workdir: None,
            batches: vec![1, 4],
            ranks: vec![16],
            targets: vec![Projection::Q, Projection::V],
            prompt_len: 16,
            decode_steps: 2,
            prefill_tokens: vec![16, 64],
            reps: 1,
            peak_gbs: None,
            peak_tflops: None,
            lora_batches: vec![1, 4],
            lora_ranks: vec![16],
            quick: true,
            cuda_graphs: false,
            op_profile: false,
            op_profile_steps: 2,
        }
    }

    /// [`GpuArgs::quick`] with `--op-profile`.
    #[cfg(test)]
    pub fn quick_profiled() -> Self {
        Self {
            op_profile: true,
            ..Self::quick()
        }
    }

    /// Decode steps a row runs after its timed ones (`--op-profile`).
    pub fn profiled_steps(&self) -> usize {
        if self.op_profile {
            self.op_profile_steps.max(1)
        } else {
            0
        }
    }

    fn resolved(&self) -> Self {
        if self.quick {
            Self {
                device: self.device,
                model: self.model.clone(),
                workdir: self.workdir.clone(),
                cuda_graphs: self.cuda_graphs,
                op_profile: self.op_profile,
                ..Self::quick()
            }
        } else {
            self.clone()
        }
    }
}

/// Everything one call measured.
#[derive(Clone, Debug)]
pub struct GpuReport {
    /// The device in words.
    pub device: String,
    pub model: String,
    pub peaks: Peaks,
    /// The LoRA kernels' implementation the table ran (`punica` by default on CUDA,
    /// `classic` with `THAW_CUDA_LORA_IMPL=classic`, `cpu`).
    pub lora_impl: String,
    /// Which of the CUDA backend's issue-29 kernels ran (None on the CPU backend).
    pub kernels: Option<thaw_runtime::backend::kernel_select::KernelPlan>,
    /// Which of the nine that became defaults after session 24 ran (None on the CPU backend):
    /// what tells `attn29.sh`'s "off9" and "on" tables apart.
    pub nine: Option<thaw_runtime::backend::kernel_select::OptInPlan>,
    pub lora: Vec<lora_rows::LoraRow>,
    pub decode: Vec<DecodeRow>,
    /// The decode rows again with CUDA graphs on (`--cuda-graphs`; empty otherwise, or where
    /// the backend has no graphs).
    pub graph_decode: Vec<DecodeRow>,
    pub prefill: Vec<PrefillRow>,
    /// The eager decode rows' op profiles (`--op-profile`; empty otherwise).
    pub op_profiles: Vec<op_profile::OpProfileRun>,
    /// The prefill rows' op profiles (`--op-profile`; empty otherwise).
    pub prefill_op_profiles: Vec<prefill_profile::PrefillOpRun>,
    /// The model's shape (the op profile's weight bytes).
    pub config: thaw_runtime::model::ModelConfig,
}

/// Runs every part of the benchmark.
pub fn run(args: &GpuArgs) -> anyhow::Result<GpuReport> {
    let args = args.resolved();
    anyhow::ensure!(
        !args.batches.is_empty() && args.batches.iter().all(|&b| b > 0),
        "--batches must list positive batch sizes, e.g. --batches 1,8,32,64"
    );
    anyhow::ensure!(
        args.ranks.iter().all(|&r| r > 0) && args.lora_ranks.iter().all(|&r| r > 0),
        "--ranks and --lora-ranks must be positive"
    );
    anyhow::ensure!(args.decode_steps > 0, "--decode-steps must be at least 1");
    let device = args.device.resolve()?;
    let tmp = tempfile::tempdir()?;
    let root = args
        .workdir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let model_dir = cases::model_dir(&args, &root)?;
    let config = thaw_runtime::model::ModelConfig::from_dir(&model_dir)?;
    let (peaks, lora, plans, device_name) = peaks::measure(&args, &device, &config)?;
    let (kernels, nine) = plans.map_or((None, None), |(k, n)| (Some(k), Some(n)));
    let lora_impl = peaks::lora_impl(&kernels);
    let m = cases::run(&args, &device, &model_dir, &root)?;
    Ok(GpuReport {
        device: device_name,
        model: format!(
            "{} ({} layers, hidden {})",
            model_dir.display(),
            config.num_layers,
            config.hidden_size
        ),
        peaks,
        lora_impl: lora_impl.into(),
        kernels,
        nine,
        lora,
        decode: m.decode,
        graph_decode: m.graph_decode,
        prefill: m.prefill,
        op_profiles: m.op_profiles,
        prefill_op_profiles: m.prefill_op_profiles,
        config,
    })
}

/// The report as Markdown tables.
pub fn table(args: &GpuArgs, r: &GpuReport) -> String {
    let args = args.resolved();
    let mut s = String::new();
    let _ = writeln!(s, "## thaw-bench gpu — {}", r.device);
    let _ = writeln!(s, "model: {}", r.model);
    if let Some(k) = &r.kernels {
        let _ = writeln!(s, "CUDA kernels: {k}");
    }
    if let Some(n) = &r.nine {
        let _ = writeln!(
            s,
            "CUDA kernels, issue 29's nine and the opt-in FA prefill: {n}"
        );
    }
    let p = &r.peaks;
    let _ = writeln!(
        s,
        "roofline: {:.0} GB/s ({}), {:.1} TFLOP/s ({})",
        p.gbs, p.gbs_source, p.tflops, p.tflops_source
    );
    if !r.lora.is_empty() {
        let _ = writeln!(
            s,
            "\n### SGMV / BGMV, q_proj {}→{}, one layer (wall clock over back-to-back calls; device time of the same calls queued ahead of the GPU, host-bound where they could not be; GB/s = distinct adapter bytes + x/y over time; impl {}, +small: THAW_CUDA_LORA_SMALL's one launch)",
            r.lora[0].res.case.dims.d_in, r.lora[0].res.case.dims.d_out, r.lora_impl
        );
        let _ = writeln!(s, "{}", lora_rows::HEADER);
        for l in &r.lora {
            let _ = writeln!(s, "{}", l.markdown(p.gbs));
        }
    }
    let _ = writeln!(
        s,
        "\n### Decode, {}-token prompts, {} timed steps; GB/s = (weights + distinct adapters + KV) read per step ÷ step time",
        args.prompt_len, args.decode_steps
    );
    let _ = writeln!(
        s,
        "| batch | adapters | rank | step ms | tok/s | vs base | GB/step | GB/s | % of roofline |\n|---|---|---|---|---|---|---|---|---|"
    );
    for d in &r.decode {
        let base = r
            .decode
            .iter()
            .find(|b| b.batch == d.batch && b.mix == Mix::Base)
            .map_or(f64::NAN, |b| d.tok_s / b.tok_s);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.1} | {:.2} | {:.4} | {:.0} | {:.0}% |",
            d.batch,
            d.mix.label(),
            d.mix.rank().map_or("-".into(), |r| r.to_string()),
            d.step_ms,
            d.tok_s,
            base,
            d.traffic.total() / 1e9,
            d.gbs(),
            d.gbs() / p.gbs * 100.0
        );
    }
    if args.cuda_graphs {
        let _ = writeln!(s, "{}", graph_table(r));
    }
    s.push_str(&counts::table(&r.decode, &r.graph_decode));
    if args.op_profile {
        s.push_str(&op_profile::table(&r.op_profiles, &r.config, p.gbs));
        s.push_str(&prefill_profile::table(
            &r.prefill_op_profiles,
            &r.config,
            p,
        ));
    }
    let _ = writeln!(
        s,
        "\n### Prefill, one sequence, base model (median of {})",
        args.reps.max(1)
    );
    let _ = writeln!(
        s,
        "| tokens | ms | tok/s | TFLOP | TFLOP/s | % of roofline |\n|---|---|---|---|---|---|"
    );
    for f in &r.prefill {
        let _ = writeln!(
            s,
            "| {} | {:.2} | {:.0} | {:.3} | {:.2} | {:.0}% |",
            f.tokens,
            f.ms,
            f.tokens as f64 / f.ms * 1e3,
            f.flops / 1e12,
            f.tflops(),
            f.tflops() / p.tflops * 100.0
        );
    }
    s
}

/// The decode rows with CUDA graphs against the eager ones (issue 29).
fn graph_table(r: &GpuReport) -> String {
    let mut s = String::from("\n### Decode with CUDA graphs vs eager (same rows, same engine)\n");
    if r.graph_decode.is_empty() {
        s.push_str("skipped: this backend has no CUDA graphs\n");
        return s;
    }
    s.push_str("| batch | adapters | rank | eager tok/s | graph tok/s | graph ÷ eager |\n|---|---|---|---|---|---|\n");
    for (e, g) in r.decode.iter().zip(&r.graph_decode) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} |",
            e.batch,
            e.mix.label(),
            e.mix.rank().map_or("-".into(), |r| r.to_string()),
            e.tok_s,
            g.tok_s,
            g.tok_s / e.tok_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounded run (`--quick --op-profile`): every part of the report is there, in the
    /// right shape, and every figure is positive and finite; the op profiles as
    /// [`op_profile::check_quick`] says.
    #[test]
    fn quick_gpu_bench_on_the_cpu_backend_reports_every_table() {
        let args = GpuArgs {
            cuda_graphs: true,
            ..GpuArgs::quick_profiled()
        };
        let r = run(&args).unwrap();
        op_profile::check_quick(&r);
        // The CPU backend has no CUDA graphs: the graph rows are skipped, and say so.
        assert!(r.graph_decode.is_empty());
        assert!(table(&args, &r).contains("skipped: this backend has no CUDA graphs"));
        // Nor driver counts: the table says so.
        assert!(r.decode.iter().all(|d| d.counts.is_none() && d.steps > 0));
        assert!(table(&args, &r).contains("not counted: this backend keeps no driver counts"));
        let pos = |v: f64| v.is_finite() && v > 0.0;
        assert!(pos(r.peaks.gbs) && pos(r.peaks.tflops));
        // No CUDA kernels to name: the LoRA table ran the CPU backend's.
        assert!(r.kernels.is_none() && r.nine.is_none());
        assert_eq!(r.lora_impl, "cpu");
        assert!(!table(&args, &r).contains("CUDA kernels:"));
        // Table rows: 1 rank × 2 batches × 2 kernels × 4 popularities.
        assert_eq!(r.lora.len(), 16);
        assert!(r.lora.iter().all(|l| pos(l.res.us) && pos(l.res.gbs())));
        // The CPU backend's calls run as they are made: its device time is theirs, always
        // there, and no one-launch rows (a CUDA kernel).
        assert!(r
            .lora
            .iter()
            .all(|l| l.device_us.is_some_and(pos) && l.device_gbs().is_some_and(pos)));
        assert!(r.lora.iter().all(|l| l.imp == "cpu"));
        // Batch 1: base, one adapter; batch 4: base, one, four distinct (one rank).
        let mixes: Vec<(usize, Mix)> = r.decode.iter().map(|d| (d.batch, d.mix)).collect();
        assert_eq!(
            mixes,
            vec![
                (1, Mix::Base),
                (1, Mix::One { rank: 16 }),
                (4, Mix::Base),
                (4, Mix::One { rank: 16 }),
                (4, Mix::Distinct { n: 4, rank: 16 }),
            ]
        );
        for d in &r.decode {
            assert!(pos(d.step_ms) && pos(d.tok_s) && pos(d.gbs()), "{d:?}");
            assert_eq!(d.traffic.adapters > 0.0, d.mix != Mix::Base, "{d:?}");
        }
        // Four distinct adapters read four adapters' bytes per step, one reads one.
        let one = r.decode[3].traffic.adapters;
        assert!((r.decode[4].traffic.adapters - 4.0 * one).abs() < 1e-6 * one);
        assert_eq!(r.prefill.len(), 2);
        assert!(r.prefill.iter().all(|f| pos(f.ms) && pos(f.tflops())));
        let t = table(&args, &r);
        let rows = |header: &str| {
            t.split(header)
                .nth(1)
                .unwrap_or_else(|| panic!("no {header} table"))
                .lines()
                .skip(3)
                .take_while(|l| l.starts_with("| "))
                .count()
        };
        assert_eq!(rows("### SGMV / BGMV"), 16);
        assert_eq!(rows("### Decode"), 5);
        assert_eq!(rows("### Prefill"), 2);
    }
}
