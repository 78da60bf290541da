//! The cold-start gate the step planner consults for each prefilling request.
use thaw_runtime::ids::SeqId;

use crate::coldstart::{AssistWork, ColdCase, ColdDecision, ColdStartPolicy, ColdTier};
use crate::perf::DiskQueue;
use crate::scheduler::{Gate, SeqState};

use super::{ColdStart, ServeEngine};

/// The cold-start gate of one prefilling request next to `planned` rows of the step (of at
/// most `max_batched` rows) and the `running` requests: go when its adapter is resident (or
/// it has none); otherwise as the policy says. Asked again every step, so an assist stops
/// the step its decision flips, and its chunk is never more than the decision's.
pub(super) fn cold_gate(
    engine: &ServeEngine,
    cold: &ColdStart,
    s: &SeqState,
    planned: usize,
    running: &[SeqState],
    max_batched: usize,
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
    if cold.policy == ColdStartPolicy::OnDemand {
        // It waits for its layers in the step when that lengthens the step by little.
        let tokens = planned + s.pending().min(max_batched.saturating_sub(planned));
        return super::layer_gate::on_demand(engine, &cold.cost, id, (landed, layers), tokens);
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
            let (running, fewest_left) = beside(running, s.id);
            let case = ColdCase {
                tier,
                bytes: adapter.size_bytes() as u64,
                backlog: engine.backend().link_backlog(),
                reads: DiskQueue::default(),
                work: AssistWork::of(adapter),
                prompt_left: pending,
                // What this step can still give it: the decision sizes its chunks by it.
                cap: pending.min(max_batched.saturating_sub(planned)),
                other_tokens: planned,
                running,
                fewest_left,
                max_new_tokens: s.max_new_tokens,
            };
            match cold.cost.decide_cold(&case).decision {
                ColdDecision::Wait => Gate::Hold,
                ColdDecision::Assist { max_chunk } => Gate::Cap(max_chunk),
            }
        }
    }
}

/// Whether a disk-tier adapter is served from its file while it is read (see
/// [`crate::memory::mapped`]): the upload pipeline then reads it layer by layer into the arena
/// and each layer lands as soon as it is read and checked, instead of after the loader's whole
/// read. Under every policy but `cached` (whose adapters are uploaded whole): waiting for the
/// layers from the file is never slower than waiting for the loader's queue and whole read
/// first (a property of [`crate::perf::LayerLanding`], the copy path `auto` models), and CPU
/// assist, where `auto` chooses it, computes from the same file.
pub(super) fn serves_from_file(policy: ColdStartPolicy) -> bool {
    policy != ColdStartPolicy::Cached
}

/// The requests running beside request `id`: how many, and the fewest output tokens one of
/// them has left (what `auto` spreads an assist's stretch over; `usize::MAX` with none).
fn beside(running: &[SeqState], id: SeqId) -> (usize, usize) {
    running
        .iter()
        .filter(|r| r.id != id)
        .fold((0, usize::MAX), |(n, f), r| (n + 1, f.min(r.tokens_left())))
}

/// The gate of a request whose adapter has not fully landed, where the policy alone decides
/// it; `None` for `auto`, which asks the cost model (`on-demand` asks
/// [`super::layer_gate::on_demand`] first, whether to wait for the layers in the step or
/// here). `cached` waits: its adapters are copied
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

    /// `auto` spreads an assist's stretch over the running requests beside the cold one (not
    /// itself), by the one with the fewest output tokens left.
    #[test]
    fn beside_counts_the_others_and_their_fewest_tokens_left() {
        let seq = |id: u64, prompt: usize, max: usize, generated: usize| SeqState {
            total_tokens: prompt + generated,
            computed: prompt + generated - 1,
            ..SeqState::new(SeqId(id), prompt, max)
        };
        let running = [seq(1, 16, 32, 30), seq(2, 128, 64, 0), seq(3, 8, 100, 10)];
        assert_eq!(running[0].tokens_left(), 2);
        assert_eq!(beside(&running, SeqId(2)), (2, 2));
        assert_eq!(beside(&running, SeqId(1)), (2, 64));
        assert_eq!(beside(&running, SeqId(9)), (3, 2));
        assert_eq!(beside(&running[1..2], SeqId(2)), (0, usize::MAX));
    }

    /// Only `cpu-assist` runs a request before its adapter landed without asking the cost
    /// model; `cached` and `on-demand` wait for the copy. Every policy but `cached` reads a
    /// disk miss from its file layer by layer.
    #[test]
    fn unlanded_adapters_wait_unless_the_policy_assists() {
        for p in [
            ColdStartPolicy::OnDemand,
            ColdStartPolicy::CpuAssist,
            ColdStartPolicy::Auto,
        ] {
            assert!(serves_from_file(p), "{p:?}");
        }
        assert!(!serves_from_file(ColdStartPolicy::Cached));
        assert_eq!(unlanded_gate(ColdStartPolicy::Cached), Some(Gate::Hold));
        assert_eq!(unlanded_gate(ColdStartPolicy::OnDemand), Some(Gate::Hold));
        assert_eq!(unlanded_gate(ColdStartPolicy::CpuAssist), Some(Gate::Go));
        assert_eq!(unlanded_gate(ColdStartPolicy::Auto), None);
    }
}
