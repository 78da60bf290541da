//! The `thaw serve` launch options every HTTP benchmark shares (`#[command(flatten)]`).
use std::path::{Path, PathBuf};

use super::coldstart::default_thaw_bin;

/// How a benchmark starts its `thaw serve` processes and waits on them.
#[derive(clap::Args, Clone, Debug)]
pub struct ServerLaunch {
    /// Any other `thaw serve` argument, repeated (e.g. --serve-arg=--max-loras=32).
    #[arg(long, allow_hyphen_values = true)]
    pub serve_arg: Vec<String>,
    /// The `thaw` executable [default: next to thaw-bench].
    #[arg(long)]
    pub thaw_bin: Option<PathBuf>,
    /// Where generated models and adapters go (reused when present) [default: a temp dir].
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Seconds to wait for each server's /health.
    #[arg(long, default_value_t = 300.0)]
    pub startup_timeout: f64,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl ServerLaunch {
    /// `--thaw-bin`, or the `thaw` next to this executable.
    pub fn bin(&self) -> anyhow::Result<PathBuf> {
        match &self.thaw_bin {
            Some(b) => Ok(b.clone()),
            None => default_thaw_bin(),
        }
    }

    /// `--workdir`, or `tmp`; created.
    pub fn root(&self, tmp: &Path) -> anyhow::Result<PathBuf> {
        let root = self.workdir.clone().unwrap_or_else(|| tmp.to_path_buf());
        std::fs::create_dir_all(&root)?;
        Ok(root)
    }
}
