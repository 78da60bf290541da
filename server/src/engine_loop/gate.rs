//! The cold-start gate the step planner consults for each prefilling request, and what the
//! step then does with its adapter's layers not landed: wait for them in the forward, or
//! compute them on the CPU (per adapter, [`thaw_runtime::engine::UnlandedLayers`]).
use thaw_runtime::ids::SeqId;

use crate::coldstart::{in_step, policy_gate, AssistWork, ColdCase, ColdGate, ColdTier, InFlight};
use crate::perf::DiskQueue;
use crate::scheduler::SeqState;

use super::{ColdStart, ServeEngine};

/// The cold-start gate of one prefilling request next to `planned` rows of the step (of at
/// most `max_batched` rows) and the `running` requests: warm when its adapter is resident (or
/// it has none); otherwise as the policy says ([`policy_gate`]). Asked again every step, so
/// an assist stops the step its decision flips, and its chunk is never more than the
/// decision's.
pub(super) fn cold_gate(
    engine: &ServeEngine,
    cold: &ColdStart,
    s: &SeqState,
    planned: usize,
    running: &[SeqState],
    max_batched: usize,
) -> ColdGate {
    let Some(id) = s.adapter else {
        return ColdGate::Warm;
    };
    // Not registered: admission fails with a clear error.
    let (Some((landed, layers)), Some(adapter)) =
        (engine.adapter_landed(id), engine.adapter_host(id))
    else {
        return ColdGate::Warm;
    };
    if landed >= layers {
        return ColdGate::Warm;
    }
    let pending = s.pending();
    // What this step can still give it.
    let cap = pending.min(max_batched.saturating_sub(planned));
    // Whether it may wait for its layers in this step: they lengthen the step by little.
    let layers_gate = || {
        let tokens = planned + cap;
        let a = InFlight::of(
            adapter.size_bytes() as u64,
            (landed, layers),
            engine.backend().link_backlog(),
            engine.adapter_is_mapped(id),
        );
        in_step(&cold.cost, a, tokens)
    };
    let decide = || {
        let tier = ColdTier::registered(landed, layers, engine.adapter_is_mapped(id));
        let (running, fewest_left) = beside(running, s.id);
        let case = ColdCase {
            tier,
            bytes: adapter.size_bytes() as u64,
            backlog: engine.backend().link_backlog(),
            reads: DiskQueue::default(),
            work: AssistWork::of(adapter),
            prompt_left: pending,
            // The decision sizes its chunks by it.
            cap,
            other_tokens: planned,
            running,
            fewest_left,
            max_new_tokens: s.max_new_tokens,
        };
        cold.cost.decide_cold(&case).decision
    };
    policy_gate(cold.policy, decide, layers_gate)
}

/// The requests running beside request `id`: how many, and the fewest output tokens one of
/// them has left (what `auto` spreads an assist's stretch over; `usize::MAX` with none).
fn beside(running: &[SeqState], id: SeqId) -> (usize, usize) {
    running
        .iter()
        .filter(|r| r.id != id)
        .fold((0, usize::MAX), |(n, f), r| (n + 1, f.min(r.tokens_left())))
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
}
