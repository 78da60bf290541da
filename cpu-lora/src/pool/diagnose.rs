//! Failed jobs explained: a worker reports only how many (job, module) pairs it could not
//! compute; the engine finds which adapter's file went bad, so the error names the adapter,
//! the file and what to do instead of "jobs failed".

use super::LoraPool;
use crate::CpuLoraError;

impl LoraPool {
    /// `e` made specific where it can be: when the step's jobs read an adapter from a file
    /// that is no longer the one registered, [`CpuLoraError::AdapterFile`] for the first such
    /// adapter; `e` otherwise.
    pub(super) fn explain(&self, e: CpuLoraError) -> CpuLoraError {
        if !matches!(e, CpuLoraError::JobsFailed { .. }) {
            return e;
        }
        let store = self.store.reader();
        let mut seen = Vec::new();
        for job in &self.jobs {
            if seen.contains(&job.adapter) {
                continue;
            }
            seen.push(job.adapter);
            if let Some((path, reason)) = crate::file_maps::diagnose(store, job.adapter) {
                return CpuLoraError::AdapterFile {
                    adapter: job.adapter.id.0,
                    path,
                    reason,
                };
            }
        }
        e
    }
}
