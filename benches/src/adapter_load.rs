//! `thaw-bench adapter-load`: the disk → host read of PEFT adapters (`LoraAdapter::load`: parse,
//! validate, copy into host memory), one adapter alone and a queue of them on 1…N loader
//! threads, with the page cache warm (every file is read once before timing). What a request
//! for a cold adapter on disk waits for before anything can be copied to the device; then one
//! miss timed to its first and last layer on the device ([`crate::adapter_land`]).
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::model::ModelConfig;
use thaw_server::gen::{self, GenAdaptersOptions, Projection, WeightDtype};

/// Options of `thaw-bench adapter-load`.
#[derive(clap::Args, Clone, Debug)]
pub struct AdapterLoadArgs {
    /// Model shape (only its config.json is written): tiny, small, llama-7b-shape.
    #[arg(long, default_value = "llama-7b-shape")]
    pub preset: String,
    /// LoRA rank (targets q, k, v, o).
    #[arg(long, default_value_t = 64)]
    pub rank: usize,
    /// Adapter weight dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: WeightDtype,
    /// Distinct adapter files (each timed load picks the next, round-robin).
    #[arg(long, default_value_t = 4)]
    pub adapters: usize,
    /// Timed single loads (one thread, one after another).
    #[arg(long, default_value_t = 8)]
    pub reps: usize,
    /// Loader thread counts of the queue table (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4])]
    pub threads: Vec<usize>,
    /// Threads reading one adapter's file at once (`LoraAdapter::load_with`), comma-separated:
    /// a row each in the single-load table.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    pub read_threads: Vec<usize>,
    /// Loads queued at once in the queue table.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Link rate of the disk -> device table (the upload pipeline's emulated DMA), GB/s; 0
    /// leaves the table out.
    #[arg(long, default_value_t = 55.0)]
    pub link_gbps: f64,
    /// Where to write the model config and adapters (reused when present).
    #[arg(long, default_value = "/tmp/thaw-adapter-load")]
    pub workdir: PathBuf,
}

/// The adapter directories and the model config they belong to, generated when missing.
fn prepare(args: &AdapterLoadArgs) -> anyhow::Result<(ModelConfig, Vec<PathBuf>)> {
    let preset =
        gen::preset(&args.preset).with_context(|| format!("unknown preset {}", args.preset))?;
    let model_dir = args.workdir.join(format!("model-{}", args.preset));
    std::fs::create_dir_all(&model_dir)?;
    let cfg = gen::model_config(&preset, args.dtype);
    std::fs::write(model_dir.join("config.json"), serde_json::to_string(&cfg)?)?;
    let out = args.workdir.join(format!(
        "adapters-{}-r{}-{:?}-{}",
        args.preset, args.rank, args.dtype, args.adapters
    ));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&out)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    if dirs.len() != args.adapters {
        let _ = std::fs::remove_dir_all(&out);
        dirs = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model_dir.clone(),
            out_dir: out,
            count: args.adapters,
            ranks: vec![args.rank],
            targets: vec![Projection::Q, Projection::K, Projection::V, Projection::O],
            dtype: Some(args.dtype),
            ..Default::default()
        })?;
    }
    dirs.sort();
    Ok((ModelConfig::from_dir(&model_dir)?, dirs))
}

fn load(dir: &Path, model: &ModelConfig) -> anyhow::Result<LoraAdapter> {
    load_with(dir, model, 1)
}

fn load_with(dir: &Path, model: &ModelConfig, threads: usize) -> anyhow::Result<LoraAdapter> {
    LoraAdapter::load_with(dir, model, threads)
        .with_context(|| format!("loading {}", dir.display()))
}

/// Milliseconds of each of `reps` loads one after another, each read by `threads` threads,
/// and the adapter's bytes.
fn single(
    args: &AdapterLoadArgs,
    model: &ModelConfig,
    dirs: &[PathBuf],
    threads: usize,
) -> anyhow::Result<(Vec<f64>, usize)> {
    let mut ms = Vec::new();
    let mut bytes = 0;
    for i in 0..args.reps {
        let t = Instant::now();
        let a = load_with(&dirs[i % dirs.len()], model, threads)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        bytes = a.size_bytes();
        drop(a);
    }
    Ok((ms, bytes))
}

/// Seconds to load `queue` adapters handed out in order to `threads` loader threads.
fn queued(
    model: &ModelConfig,
    dirs: &[PathBuf],
    queue: usize,
    threads: usize,
) -> anyhow::Result<f64> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= queue {
                            return Ok(());
                        }
                        drop(load(&dirs[i % dirs.len()], model)?);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join()
                .map_err(|_| anyhow::anyhow!("a loader thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs the benchmark and returns its tables.
pub fn run(args: &AdapterLoadArgs) -> anyhow::Result<String> {
    anyhow::ensure!(
        args.adapters > 0 && args.reps > 0,
        "--adapters and --reps must be positive"
    );
    let (model, dirs) = prepare(args)?;
    for d in &dirs {
        drop(load(d, &model)?); // page cache warm
    }
    let mut out = String::new();
    let bytes = load(&dirs[0], &model)?.size_bytes();
    let mb = bytes as f64 / 1e6;
    writeln!(
        out,
        "adapter load (disk -> host, page cache warm): preset {}, rank {} on q,k,v,o, {:?}, \
         {mb:.1} MB an adapter, {} cores",
        args.preset,
        args.rank,
        args.dtype,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    )?;
    writeln!(
        out,
        "| read threads | loads | min ms | median ms | max ms | GB/s (median) |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|")?;
    for &t in &args.read_threads {
        let (mut ms, _) = single(args, &model, &dirs, t)?;
        ms.sort_by(f64::total_cmp);
        let med = percentile(&ms, 0.5);
        writeln!(
            out,
            "| {t} | {} | {:.1} | {med:.1} | {:.1} | {:.2} |",
            ms.len(),
            ms[0],
            ms[ms.len() - 1],
            mb / med
        )?;
    }
    writeln!(out, "\n{} loads queued at once:", args.queue)?;
    writeln!(
        out,
        "| loader threads | all done ms | ms per adapter | GB/s |"
    )?;
    writeln!(out, "|---|---|---|---|")?;
    for &t in &args.threads {
        let s = queued(&model, &dirs, args.queue, t)?;
        writeln!(
            out,
            "| {t} | {:.1} | {:.1} | {:.2} |",
            s * 1e3,
            s * 1e3 / args.queue as f64,
            mb * args.queue as f64 / 1e3 / s
        )?;
    }
    if args.link_gbps > 0.0 {
        out += &crate::adapter_land::table(&model, &dirs, args.reps, args.link_gbps)?;
    }
    Ok(out)
}
