//! Cold-start hiding policy (DESIGN §4): the `--cold-start` policies, the cost model that
//! drives `auto`, and an engine-level driver that runs a timed request trace under a policy
//! (its disk reads go through the server's loader, [`crate::memory::loader::Loader`]).
mod amortize;
mod calibrate;
mod cost;
mod decide;
mod driver;
mod layer_gate;
mod layerwise;
mod policy;
mod snapshot;

pub use amortize::{Stretch, MAX_TPOT_SLOWDOWN};
pub use calibrate::calibrate;
pub use cost::{AssistWork, ColdDecision, ColdPlan, ColdTimes, CostModel, Prediction};
pub use decide::{ColdCase, ColdTier};
pub use driver::{run, DriverConfig, Outcome, Request, RunReport, StartTier, StepRecord};
pub use layer_gate::{
    carry_out, in_step, layer_stall, policy_gate, unlanded_layers, Answer, ColdGate, InFlight,
    MAX_STALL_SHARE,
};
pub use policy::ColdStartPolicy;
pub use snapshot::{
    adapter_costs, AdapterCosts, CostSnapshot, ServerLimits, SnapshotError, SNAPSHOT_FORMAT,
};
