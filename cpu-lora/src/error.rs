//! The crate's error type for the worker and the pool (the kernel has its own
//! [`crate::kernel::LoraError`], wrapped here).

use std::time::Duration;

use thaw_ipc::{IpcError, LayerIdx, Module, WorkerId};

use crate::kernel::LoraError;

/// Everything that can go wrong starting, driving or running CPU LoRA workers.
#[derive(Debug, thiserror::Error)]
pub enum CpuLoraError {
    /// A shared-memory segment could not be created, opened or validated (wrong version,
    /// size, kind, …) or an exchange call was refused.
    #[error("shared memory: {0}")]
    Ipc(#[from] IpcError),
    /// The kernel refused a job's shapes.
    #[error("LoRA kernel: {0}")]
    Kernel(#[from] LoraError),
    /// The pool configuration cannot work.
    #[error("invalid CPU LoRA pool config: {0}")]
    Config(String),
    /// A job cannot run: bad rows, unknown adapter (layer, module), or shapes above the
    /// exchange's capacities.
    #[error("invalid CPU LoRA job #{index}: {reason}")]
    InvalidJob {
        /// Index of the job in the submitted slice.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The adapter's (layer, module) vanished from the host store while a step used it
    /// (hold an adapter lease for as long as steps may reference it).
    #[error("adapter {adapter} layer {} module {module:?} is not in the host store", layer.0)]
    AdapterGone {
        /// Adapter id.
        adapter: u64,
        /// Layer.
        layer: LayerIdx,
        /// Module.
        module: Module,
    },
    /// `submit` while the previous step's ticket has not been waited for.
    #[error("a CPU LoRA step is already in flight; wait for its ticket first")]
    StepInFlight,
    /// The ticket does not belong to the step in flight.
    #[error("ticket for step {0} does not match the step in flight")]
    StaleTicket(u32),
    /// A device-triggered step was prepared without arming the doorbell first.
    #[error("arm the pool (LoraPool::arm) before preparing a device-triggered step")]
    NotArmed,
    /// Spawning a worker process failed.
    #[error("cannot spawn CPU LoRA worker {}: {source}", worker.0)]
    Spawn {
        /// Worker slot.
        worker: WorkerId,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A worker exited or did not attach during start-up.
    #[error(
        "CPU LoRA worker {} failed to start ({status}); run the worker command by hand to \
         see its error",
        worker.0
    )]
    WorkerStartup {
        /// Worker slot.
        worker: WorkerId,
        /// Exit status or "no attach within …".
        status: String,
    },
    /// The worker could not pin itself to its core.
    #[error("cannot pin CPU LoRA worker to core {core}: no such core in this cgroup's cpuset")]
    Pin {
        /// Requested core.
        core: usize,
    },
    /// A worker reported jobs it could not compute (their Δ rows hold NaN).
    #[error("{failed} CPU LoRA job module(s) failed in worker {} (adapter missing from the host store?)", worker.0)]
    JobsFailed {
        /// Worker slot.
        worker: WorkerId,
        /// Number of (job, module) pairs that failed.
        failed: u32,
    },
    /// A worker could not read an adapter's weights from its file (a disk-tier adapter served
    /// from its memory-mapped safetensors file while it loads): the file was removed,
    /// replaced, truncated or cannot be read. The step's requests for this adapter cannot run.
    #[error(
        "CPU LoRA workers could not read adapter {adapter} from its file: {reason}; requests \
         using it fail until the file is restored and the adapter reloaded"
    )]
    AdapterFile {
        /// Adapter id (the host store's).
        adapter: u64,
        /// The file the adapter was registered from.
        path: std::path::PathBuf,
        /// What is wrong with it (it names the path).
        reason: String,
    },
    /// A wait on process state failed.
    #[error("process management: {0}")]
    Process(#[source] std::io::Error),
    /// Start-up calibration did not complete.
    #[error("calibration step did not complete within {0:?}")]
    Calibration(Duration),
}
