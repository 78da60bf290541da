//! The cold-start gate the step planner consults for each prefilling request.
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::ids::AdapterId;

use crate::coldstart::{AssistWork, ColdCase, ColdDecision, ColdStartPolicy, ColdTier};
use crate::memory::loader::Loader;
use crate::perf::DiskQueue;
use crate::scheduler::{Gate, SchedState, SeqState};

use super::{ColdStart, ServeEngine};

/// The cold-start gate of one prefilling request next to `planned` rows of the step and
/// `running` running requests: go when its adapter is resident (or it has none); otherwise as
/// the policy says.
pub(super) fn cold_gate(
    engine: &ServeEngine,
    cold: &ColdStart,
    s: &SeqState,
    planned: usize,
    running: usize,
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
    match unlanded_gate(cold.policy) {
        Some(g) => g,
        None => {
            let Some(adapter) = engine.adapter_host(id) else {
                return Gate::Go;
            };
            let pending = s.pending();
            // Still read from its mapped file, nothing landed: the copy waits for the disk (its
            // own read of the file, behind no loader queue).
            let tier = if landed == 0 && engine.adapter_is_mapped(id) {
                ColdTier::Disk
            } else {
                ColdTier::Streaming {
                    landed: landed as f64 / layers.max(1) as f64,
                }
            };
            let case = ColdCase {
                tier,
                bytes: adapter.size_bytes() as u64,
                backlog: engine.backend().link_backlog(),
                reads: DiskQueue::default(),
                work: AssistWork::of(adapter),
                prompt_left: pending,
                cap: pending,
                other_tokens: planned,
                running,
                max_new_tokens: s.max_new_tokens,
            };
            match cold.cost.decide_cold(&case).decision {
                ColdDecision::Wait => Gate::Hold,
                ColdDecision::Assist { max_chunk } => Gate::Cap(max_chunk),
            }
        }
    }
}

/// Whether adapter `id`, only on disk and mapped as `a`, is served from its file while it is
/// read (see [`crate::memory::mapped`]): the upload pipeline then reads it layer by layer into
/// the arena and each layer lands as soon as it is read and checked, instead of after the
/// loader's whole read. Always under `cpu-assist`, and under `on-demand` (its requests wait for
/// every layer anyway) and `auto` without CPU workers (nothing computes from the file but the
/// upload); under `auto` with workers when the cost model would assist the first waiting
/// request for it from the disk tier, its read waiting behind the reads `loader` has queued
/// ahead of it; never under `cached` (its adapters are uploaded whole).
pub(super) fn serves_from_file(
    engine: &ServeEngine,
    cold: &ColdStart,
    state: &SchedState,
    loader: &Loader,
    (id, a): (AdapterId, &LoraAdapter),
) -> bool {
    match cold.policy {
        ColdStartPolicy::CpuAssist | ColdStartPolicy::OnDemand => true,
        ColdStartPolicy::Cached => false,
        ColdStartPolicy::Auto if engine.pool().is_none() => true,
        ColdStartPolicy::Auto => {
            let Some(s) = state.waiting.iter().find(|s| s.adapter == Some(id)) else {
                return false;
            };
            let pending = s.pending();
            let case = ColdCase {
                tier: ColdTier::Disk,
                bytes: a.size_bytes() as u64,
                backlog: engine.backend().link_backlog(),
                reads: loader.reads_ahead(id).unwrap_or_default(),
                work: AssistWork::of(a),
                prompt_left: pending,
                cap: pending,
                other_tokens: state.running.len(),
                running: state.running.len(),
                max_new_tokens: s.max_new_tokens,
            };
            matches!(
                cold.cost.decide_cold(&case).decision,
                ColdDecision::Assist { .. }
            )
        }
    }
}

/// The gate of a request whose adapter has not fully landed, where the policy alone decides
/// it; `None` for `auto`, which asks the cost model. `cached` waits: its adapters are copied
/// whole (on a GPU through the same asynchronous pipeline as a streamed one, so a freshly
/// registered one has not landed yet) and it never computes a delta on the CPU.
fn unlanded_gate(policy: ColdStartPolicy) -> Option<Gate> {
    match policy {
        ColdStartPolicy::Cached | ColdStartPolicy::OnDemand => Some(Gate::Hold),
        ColdStartPolicy::CpuAssist => Some(Gate::Go),
        ColdStartPolicy::Auto => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only `cpu-assist` runs a request before its adapter landed without asking the cost
    /// model; `cached` and `on-demand` wait for the copy.
    #[test]
    fn unlanded_adapters_wait_unless_the_policy_assists() {
        assert_eq!(unlanded_gate(ColdStartPolicy::Cached), Some(Gate::Hold));
        assert_eq!(unlanded_gate(ColdStartPolicy::OnDemand), Some(Gate::Hold));
        assert_eq!(unlanded_gate(ColdStartPolicy::CpuAssist), Some(Gate::Go));
        assert_eq!(unlanded_gate(ColdStartPolicy::Auto), None);
    }
}
