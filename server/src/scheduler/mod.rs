//! The scheduler's state and its decision: which requests run in the next engine step.
//!
//! [`SchedState`] holds the waiting queue and the running set; [`plan_step`] is a pure
//! function over it that returns a [`Decision`] (whom to admit, the step plan). The engine
//! loop ([`crate::engine_loop`]) applies the decision, runs the step and feeds the outputs
//! back with [`SchedState::on_step`]. Nothing here touches tokio or the engine, so the policy
//! is unit- and property-tested directly; the multi-level-queue policy replaces
//! [`plan_step`] later without touching the loop.

mod policy;
mod state;

pub use policy::{plan_step, plan_step_admitting, plan_step_gated, AdmitDecision, Decision, Gate};
pub use state::{SchedConfig, SchedState, SeqState};
