//! The performance model (DESIGN §4, §7): step latency from prefill rows, decode rows and the
//! ranks in the batch (CaraServe §5) plus fixed costs per prefilled sequence and after idle,
//! CPU-assist throughput and adapter load time per tier (layer by layer: [`LayerLanding`]),
//! fitted online by least squares over every step of the run, and the engine thread's time
//! between steps. There is exactly one:
//! the cold-start planner, the scheduler (kernel choice, the TPOT cap, request sizes) and
//! `thaw-bench simulate` (through [`PerfSnapshot`]) all read the same fitted numbers.
pub mod enginetime;
mod fit;
mod landing;
mod model;
mod snapshot;
pub mod steplog;

pub use enginetime::{Cause, CauseTimes, EngineTime, Stopwatch};
pub use fit::{ErrorStat, Sample, StepStats};
pub use landing::LayerLanding;
pub use model::{DiskQueue, PerfModel, StepShape, Tier};
pub use snapshot::PerfSnapshot;
pub use steplog::StepLog;
