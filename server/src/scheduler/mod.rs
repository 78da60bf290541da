//! The scheduler's state and its decision: which requests run in the next engine step.
//!
//! [`SchedState`] holds the waiting queue and the running set; [`plan_step`] is a pure
//! function over it that returns a [`Decision`] (whom to admit, the step plan). The engine
//! loop ([`crate::engine_loop`]) applies the decision, runs the step and feeds the outputs
//! back with [`SchedState::on_step`]. Nothing here touches tokio or the engine, so the policy
//! is unit- and property-tested directly. [`plan_mlq`] is Chameleon's multi-level queue
//! behind the same state; [`SchedulingPolicy`] picks one.

mod mlq;
mod mlq_kmeans;
mod mlq_predict;
mod mlq_protect;
mod mlq_quota;
mod mlq_room;
mod mlq_state;
mod mlq_tpot;
mod mlq_wait;
mod mlq_wrs;
mod ordering;
mod policy;
mod report;
mod select;
mod state;

pub use mlq::{plan_mlq, MlqDecision, MlqInputs, TpotCap};
pub use mlq_predict::{OutputPredictor, PredictorStats};
pub use mlq_protect::{fit_steps, protected, Hold, Waiter};
pub use mlq_state::{Entry, Mlq, MlqConfig};
pub use mlq_tpot::step_budget_s;
pub use mlq_wait::{predicted_wait_s, MemoryWait};
pub use mlq_wrs::{RequestSize, WrsScales, WrsWeights};
pub use ordering::{OrderKeys, SchedulingPolicy};
pub use policy::{plan_step, plan_step_admitting, plan_step_gated, AdmitDecision, Decision, Gate};
pub use report::SchedBoard;
pub use select::{Arrival, QueueInfo, SchedSnapshot, Scheduler};
pub use state::{SchedConfig, SchedState, SeqState};

#[cfg(test)]
mod mlq_tests;
