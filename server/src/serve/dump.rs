//! `--dump-cost-model PATH`: the performance model the engine fits online, with the adapter
//! sizes and load rates the registry measured and the server's limits, written as a
//! [`CostSnapshot`] every [`DUMP_EVERY`] and once more at shutdown. Each snapshot is also
//! appended, one JSON line, to [`history_path`]: the model as it evolved over the run (the fit
//! covers only the last steps), which `thaw-bench simulate --replay` can replay in time.
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::coldstart::{adapter_costs, AdapterCosts, CostSnapshot, ServerLimits, SNAPSHOT_FORMAT};
use crate::http::AppState;

/// How often the file is rewritten while serving.
pub const DUMP_EVERY: Duration = Duration::from_secs(10);

/// The server's cost model now; None before the engine published one.
pub fn snapshot(state: &AppState, max_cpu_loras: usize) -> Option<CostSnapshot> {
    let s = &state.engine.stats;
    let mut perf = s.cost.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
    let views = state.registry.views();
    let (bytes_per_rank, disk) =
        adapter_costs(views.iter().map(|a| (a.size_bytes, a.rank, a.load_secs)));
    // The registry's mean over every read since start-up (the engine's model follows recent
    // reads, weighted by its smoothing factor).
    if let Some(d) = disk {
        perf.disk_bytes_per_s = d;
    }
    Some(CostSnapshot {
        format: SNAPSHOT_FORMAT,
        written_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
        steps_observed: s.steps.load(Ordering::Relaxed),
        perf,
        adapters: AdapterCosts {
            bytes_per_rank,
            disk_rate_measured: disk.is_some(),
        },
        limits: ServerLimits {
            max_loras: state.registry.limits.max_loras,
            max_cpu_loras,
            max_num_seqs: state.sched.max_num_seqs,
            max_num_batched_tokens: state.sched.max_num_batched_tokens,
            block_size: state.sched.block_size,
            kv_total_blocks: state.sched.total_blocks,
        },
    })
}

/// Where the snapshots of `--dump-cost-model PATH` accumulate: `PATH` with the extension
/// `history.jsonl` (`cost.json` → `cost.history.jsonl`).
pub fn history_path(path: &Path) -> PathBuf {
    path.with_extension("history.jsonl")
}

/// Writes the snapshot to `path` and appends it to [`history_path`], logging (not failing)
/// when it cannot.
pub fn write(state: &AppState, max_cpu_loras: usize, path: &Path) {
    if let Some(snap) = snapshot(state, max_cpu_loras) {
        let r = snap
            .write(path)
            .and_then(|()| snap.append_line(&history_path(path)));
        if let Err(e) = r {
            tracing::warn!(
                "could not write the cost model to {}: {e}; check --dump-cost-model",
                path.display()
            );
        }
    }
}

/// Rewrites the file every [`DUMP_EVERY`] until the task is dropped or aborted.
pub fn spawn_periodic(
    state: Arc<AppState>,
    max_cpu_loras: usize,
    path: PathBuf,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(DUMP_EVERY);
        loop {
            tick.tick().await;
            let (st, p) = (state.clone(), path.clone());
            let _ = tokio::task::spawn_blocking(move || write(&st, max_cpu_loras, &p)).await;
        }
    })
}
