//! The disk → device table of `thaw-bench adapter-load`: one miss from disk, timed to its
//! first layer landed and to its last, two ways through the one upload pipeline (loader threads
//! encode each layer into the pinned arena, the copy thread moves it over the link, emulated
//! here at `--link-gbps`):
//!
//! * `whole read`: the file is read whole (`LoraAdapter::load`: pread, finite check), then
//!   every layer is queued: the first layer lands after the whole read;
//! * `layer by layer`: the file is mapped (header only) and queued at once; the loader thread
//!   reads each layer from the file, checks it (file unchanged, weights finite) and encodes it,
//!   and its copy is queued as soon as that layer is in the arena, so the first layers land
//!   while later ones are still read.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::model::ModelConfig;
use thaw_runtime::residency::{LinkModel, LoadPriority};
use thaw_runtime::upload::{EmulatedLink, ImageLayout, Landing, Upload, UploadPipeline};

/// When each layer landed, from the start of the miss.
struct Landed {
    start: Instant,
    at: Mutex<Vec<Duration>>,
    failed: Mutex<bool>,
}

impl Landing for Landed {
    fn land(&self, _layer: usize) {
        let t = self.start.elapsed();
        self.at.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }

    fn fail(&self, _why: &str) {
        *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }
}

/// One miss: (ms until the adapter could be queued, first layer landed ms, all layers landed
/// ms); `by_layer`: mapped and read layer by layer by the pipeline, else read whole first.
fn miss(
    pipeline: &UploadPipeline<EmulatedLink>,
    dir: &Path,
    model: &ModelConfig,
    by_layer: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let landing = Arc::new(Landed {
        start: Instant::now(),
        at: Mutex::new(Vec::new()),
        failed: Mutex::new(false),
    });
    let adapter = if by_layer {
        LoraAdapter::map(dir, model)
    } else {
        LoraAdapter::load(dir, model)
    };
    let adapter = Arc::new(adapter.with_context(|| format!("loading {}", dir.display()))?);
    let read = landing.start.elapsed();
    let layers = adapter.num_layers();
    let up = Upload {
        layout: ImageLayout::of(&adapter, None),
        adapter,
        dtype: None,
        dst: Arc::new(()),
        landing: landing.clone(),
    };
    pipeline.submit(up, LoadPriority::Demand)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        anyhow::ensure!(
            !*landing.failed.lock().unwrap_or_else(|e| e.into_inner()),
            "an upload failed"
        );
        let at = landing.at.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if at.len() == layers {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            return Ok((ms(read), ms(at[0]), ms(at[layers - 1])));
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the upload did not land in 120 s"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The table: `reps` misses, one after another, each on a fresh adapter image (the previous
/// one freed first), over a link of `gbps`.
pub fn table(
    model: &ModelConfig,
    dirs: &[PathBuf],
    reps: usize,
    gbps: f64,
) -> anyhow::Result<String> {
    let bytes = LoraAdapter::load(&dirs[0], model)?.size_bytes();
    let link = LinkModel {
        gbps,
        ..LinkModel::default()
    };
    // Room for two images: the next miss's while the last one's is being reaped.
    let pipeline = UploadPipeline::start(EmulatedLink::new(link), 2 * bytes + (1 << 20), 1)?;
    let mut out = String::new();
    writeln!(
        out,
        "\none miss, disk -> device through the upload pipeline (1 loader thread, link \
         emulated at {gbps} GB/s), median of {reps}:"
    )?;
    writeln!(
        out,
        "| read | queued after ms | first layer landed ms | all layers landed ms | first / all |"
    )?;
    writeln!(out, "|---|---|---|---|---|")?;
    for by_layer in [false, true] {
        let mut rows = Vec::new();
        for i in 0..reps {
            let deadline = Instant::now() + Duration::from_secs(30);
            while pipeline.arena_usage().used > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            rows.push(miss(&pipeline, &dirs[i % dirs.len()], model, by_layer)?);
        }
        let med = |f: fn(&(f64, f64, f64)) -> f64| {
            let mut v: Vec<f64> = rows.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (read, first, all) = (med(|r| r.0), med(|r| r.1), med(|r| r.2));
        let how = if by_layer {
            "layer by layer (mapped)"
        } else {
            "whole file first"
        };
        writeln!(
            out,
            "| {how} | {read:.1} | {first:.1} | {all:.1} | {:.2} |",
            first / all
        )?;
    }
    Ok(out)
}
