//! Chameleon's multi-level queue (§4.2): weighted request sizes ([`wrs`]), K-means queue
//! cut-offs ([`kmeans`]), per-queue token quotas ([`quota`]), the step it plans ([`plan`],
//! [`room`]), the output-length predictor ([`predict`]), the starvation bound's protected
//! request ([`protect`]), the memory wait that bounds bypass ([`wait`]) and the rank-aware
//! TPOT cap ([`tpot`]). Re-exports only.
mod kmeans;
mod plan;
mod predict;
pub(crate) mod protect;
mod quota;
mod room;
mod state;
mod tpot;
mod wait;
mod wrs;

pub use plan::{plan_mlq, MlqDecision, MlqInputs, TpotCap};
pub use predict::{OutputPredictor, PredictorStats};
pub use protect::{fit_steps, protected, Hold, Waiter};
pub use state::{Entry, Mlq, MlqConfig};
pub use tpot::step_budget_s;
pub(crate) use wait::blocked_wait_s;
pub use wait::{predicted_wait_s, MemoryWait};
pub use wrs::{RequestSize, WrsScales, WrsWeights};

#[cfg(test)]
mod tests;
