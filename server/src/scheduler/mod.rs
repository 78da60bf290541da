//! The scheduler's state and its decision: which requests run in the next engine step.
//!
//! [`SchedState`] holds the waiting queue and the running set; [`plan_step`] is a pure
//! function over it that returns a [`Decision`] (whom to admit, the step plan). The engine
//! loop ([`crate::engine_loop`]) applies the decision, runs the step and feeds the outputs
//! back with [`SchedState::on_step`]. Nothing here touches tokio or the engine, so the policy
//! is unit- and property-tested directly. [`plan_mlq`] is Chameleon's multi-level queue
//! behind the same state; [`SchedulingPolicy`] picks one.

mod mlq;
mod ordering;
mod policy;
mod preempt;
mod report;
mod select;
mod state;

pub use mlq::{
    fit_steps, plan_mlq, predicted_wait_s, protected, step_budget_s, Entry, Hold, MemoryWait, Mlq,
    MlqConfig, MlqDecision, MlqInputs, OutputPredictor, PredictorStats, RequestSize, TpotCap,
    Waiter, WrsScales, WrsWeights,
};
pub use ordering::{OrderKeys, SchedulingPolicy};
pub use policy::{plan_step, plan_step_admitting, plan_step_gated, AdmitDecision, Decision, Gate};
pub use preempt::{choose_preemptions, runners, step_needs, Runner};
pub use report::SchedBoard;
pub use select::{Arrival, QueueInfo, SchedSnapshot, Scheduler};
pub use state::{KvReservation, SchedConfig, SchedState, SeqState};
