//! The performance model as a file: what `thaw serve --dump-cost-model PATH` writes (JSON),
//! and what `thaw-bench simulate` models each instance of a cluster with. It is the one
//! [`PerfModel`](crate::perf::PerfModel) the engine fits online, as its [`PerfSnapshot`]
//! (device time per step with the rank terms, CPU assist, link, disk), plus what the
//! simulator needs beside it that the server measured: the adapters' host bytes per unit of
//! rank and the limits the server runs under (cache sizes, batch, KV).
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::perf::PerfSnapshot;

/// Version of the file's layout; readers refuse others. 2: the perf model's snapshot.
pub const SNAPSHOT_FORMAT: u32 = 2;

/// Adapter sizes and load rates the server measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterCosts {
    /// Host bytes of an adapter per unit of rank (all its layers and projections): an adapter
    /// of rank r moves `r · bytes_per_rank` over the link. None: no adapter was loaded.
    pub bytes_per_rank: Option<f64>,
    /// Whether the disk → host rate in the perf snapshot was measured from timed adapter
    /// loads (false: it is the model's uncalibrated default).
    pub disk_rate_measured: bool,
}

/// The limits the server ran under.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerLimits {
    /// Adapters resident on the device at once (`--max-loras`).
    pub max_loras: usize,
    /// Adapters kept in host memory (`--max-cpu-loras`).
    pub max_cpu_loras: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub kv_total_blocks: usize,
}

/// Everything `--dump-cost-model` writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostSnapshot {
    pub format: u32,
    /// Unix seconds when it was written.
    pub written_unix_s: f64,
    /// Engine steps the device-time fit has seen (0: the start-up calibration only).
    pub steps_observed: u64,
    /// The engine's performance model.
    pub perf: PerfSnapshot,
    pub adapters: AdapterCosts,
    pub limits: ServerLimits,
}

/// A snapshot file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot read the cost model {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a cost model written by `thaw serve --dump-cost-model`: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path} has cost-model format {found}, this build reads {SNAPSHOT_FORMAT}; dump it again with this build's `thaw serve --dump-cost-model`")]
    Format { path: String, found: u32 },
}

impl CostSnapshot {
    /// Reads and checks a snapshot file.
    pub fn read(path: &Path) -> Result<Self, SnapshotError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SnapshotError::Io {
            path: p.clone(),
            source,
        })?;
        let s: Self = serde_json::from_str(&text).map_err(|source| SnapshotError::Parse {
            path: p.clone(),
            source,
        })?;
        if s.format != SNAPSHOT_FORMAT {
            return Err(SnapshotError::Format {
                path: p,
                found: s.format,
            });
        }
        Ok(s)
    }

    /// Writes the snapshot atomically (a temporary file renamed over `path`), so a reader
    /// never sees half a file.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }

    /// Appends the snapshot to `path` as one line of JSON (a history: [`Self::read_history`]).
    pub fn append_line(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let mut line = serde_json::to_string(self).map_err(std::io::Error::other)?;
        line.push('\n');
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?
            .write_all(line.as_bytes())
    }

    /// Reads a history [`Self::append_line`] wrote, oldest first; checks every line like
    /// [`Self::read`].
    pub fn read_history(path: &Path) -> Result<Vec<Self>, SnapshotError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SnapshotError::Io {
            path: p.clone(),
            source,
        })?;
        let mut out = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let s: Self = serde_json::from_str(line).map_err(|source| SnapshotError::Parse {
                path: p.clone(),
                source,
            })?;
            if s.format != SNAPSHOT_FORMAT {
                return Err(SnapshotError::Format {
                    path: p,
                    found: s.format,
                });
            }
            out.push(s);
        }
        out.sort_by(|a, b| a.written_unix_s.total_cmp(&b.written_unix_s));
        Ok(out)
    }
}

/// Host bytes per unit of rank, and the disk → host rate (bytes per second: the sizes over
/// the load times) when any load was timed, from the adapters the server loaded:
/// `(size in bytes, rank, load seconds if timed)`.
pub fn adapter_costs(
    loaded: impl IntoIterator<Item = (usize, usize, Option<f64>)>,
) -> (Option<f64>, Option<f64>) {
    let (mut per_rank, mut n) = (0.0, 0usize);
    let (mut bytes, mut secs) = (0.0, 0.0);
    for (size, rank, load) in loaded {
        if rank > 0 {
            per_rank += size as f64 / rank as f64;
            n += 1;
        }
        if let Some(t) = load.filter(|t| *t > 0.0) {
            bytes += size as f64;
            secs += t;
        }
    }
    (
        (n > 0).then(|| per_rank / n as f64),
        (secs > 0.0).then(|| bytes / secs),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::PerfModel;
    use thaw_runtime::residency::LinkModel;

    fn snapshot() -> CostSnapshot {
        let m = PerfModel {
            layer_base_s: 1e-4,
            layer_per_token_s: 2e-6,
            lora_sgmv_s: 3e-9,
            num_layers: 4,
            cpu_flops: 3e9,
            cpu_overlaps: true,
            link: LinkModel {
                gbps: 12.5,
                latency_us: 7.0,
            },
            assist_layer_overhead_s: 5e-5,
            ..Default::default()
        };
        let (bytes_per_rank, disk) = adapter_costs([(800, 8, Some(0.5)), (1600, 16, None)]);
        let mut perf = m.snapshot();
        perf.disk_bytes_per_s = disk.unwrap();
        CostSnapshot {
            format: SNAPSHOT_FORMAT,
            written_unix_s: 1.0,
            steps_observed: 9,
            perf,
            adapters: AdapterCosts {
                bytes_per_rank,
                disk_rate_measured: true,
            },
            limits: ServerLimits {
                max_loras: 4,
                max_cpu_loras: 16,
                max_num_seqs: 32,
                max_num_batched_tokens: 512,
                block_size: 16,
                kv_total_blocks: 1000,
            },
        }
    }

    #[test]
    fn round_trips_through_a_file_and_refuses_other_formats() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cost.json");
        let s = snapshot();
        assert_eq!(s.adapters.bytes_per_rank, Some(100.0));
        assert_eq!(s.perf.disk_bytes_per_s, 1600.0);
        assert_eq!(s.perf.link_gbps, 12.5);
        assert_eq!(s.perf.lora_sgmv_s, 3e-9);
        s.write(&p).unwrap();
        assert_eq!(CostSnapshot::read(&p).unwrap(), s);
        let mut other = s.clone();
        other.format = SNAPSHOT_FORMAT + 1;
        other.write(&p).unwrap();
        let e = CostSnapshot::read(&p).unwrap_err().to_string();
        assert!(e.contains("dump it again"), "{e}");
        std::fs::write(&p, "{}").unwrap();
        assert!(matches!(
            CostSnapshot::read(&p),
            Err(SnapshotError::Parse { .. })
        ));
    }

    #[test]
    fn history_appends_lines_and_reads_back_in_time_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cost.history.jsonl");
        let (mut a, mut b) = (snapshot(), snapshot());
        a.written_unix_s = 20.0;
        b.written_unix_s = 10.0;
        b.perf.layer_per_token_s = 9e-6;
        a.append_line(&p).unwrap();
        b.append_line(&p).unwrap();
        let h = CostSnapshot::read_history(&p).unwrap();
        assert_eq!(h, vec![b.clone(), a]);
        let mut c = b;
        c.format = SNAPSHOT_FORMAT + 1;
        c.append_line(&p).unwrap();
        assert!(matches!(
            CostSnapshot::read_history(&p),
            Err(SnapshotError::Format { .. })
        ));
    }
}
