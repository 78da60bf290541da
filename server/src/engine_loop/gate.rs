//! The cold-start gate the step planner consults for each prefilling request.
use crate::coldstart::{ColdDecision, ColdStartPolicy};
use crate::scheduler::{Gate, SeqState};

use super::{ColdStart, ServeEngine};

/// The cold-start gate of one prefilling request: go when its adapter is resident (or it has
/// none); otherwise as the policy says.
pub(super) fn cold_gate(
    engine: &ServeEngine,
    cold: &ColdStart,
    s: &SeqState,
    planned: usize,
) -> Gate {
    let Some(id) = s.adapter else {
        return Gate::Go;
    };
    let Some((landed, layers)) = engine.adapter_landed(id) else {
        return Gate::Go; // not registered: admission fails with a clear error
    };
    if landed >= layers {
        return Gate::Go;
    }
    match cold.policy {
        ColdStartPolicy::Cached | ColdStartPolicy::CpuAssist => Gate::Go,
        ColdStartPolicy::OnDemand => Gate::Hold,
        ColdStartPolicy::Auto => {
            let Some(adapter) = engine.adapter_host(id) else {
                return Gate::Go;
            };
            let pending = s.pending();
            let case = crate::coldstart::ColdCase {
                tier: crate::coldstart::ColdTier::Streaming {
                    landed: landed as f64 / layers.max(1) as f64,
                },
                bytes: adapter.size_bytes() as u64,
                backlog: engine.backend().link_backlog(),
                work: crate::coldstart::AssistWork::of(adapter),
                prompt_left: pending,
                cap: pending,
                other_tokens: planned,
            };
            match cold.cost.decide_cold(&case).decision {
                ColdDecision::Wait => Gate::Hold,
                ColdDecision::Assist { max_chunk } => Gate::Cap(max_chunk),
            }
        }
    }
}
