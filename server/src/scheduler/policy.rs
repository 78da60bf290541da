//! FIFO with a token budget, a batch-size cap, chunked prefill and on-demand KV — as a pure
//! function of the scheduler state.
use std::collections::HashSet;

use thaw_runtime::engine::{PlanItem, StepPlan};
use thaw_runtime::ids::SeqId;

use super::state::{SchedConfig, SchedState, SeqState};

/// What the cold-start policy says about a request's prefill this step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Schedule it as usual.
    Go,
    /// Its adapter is not resident and the policy waits for it: admit (reserve KV) but
    /// schedule no tokens.
    Hold,
    /// Schedule at most this many prefill tokens (CPU assist sized to the device's time).
    Cap(usize),
}

/// What the next step does: admit the first `admit` waiting requests, then run `plan`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub admit: usize,
    pub plan: StepPlan,
}

/// Plans one step. Decode tokens of running sequences go first (one each), then prefill
/// chunks of running sequences in admission order, then new requests from the head of the
/// queue while the token budget, the batch size and the KV reservation allow. The queue is
/// strictly FIFO: a head request that does not fit blocks the ones behind it (no bypass).
///
/// `free_blocks` is the engine's current free KV; every item's block growth must fit in it
/// (it always does while reservations hold, so this is a second line of defence).
pub fn plan_step(state: &SchedState, cfg: &SchedConfig, free_blocks: usize) -> Decision {
    plan_step_gated(state, cfg, free_blocks, &|_, _| Gate::Go)
}

/// [`plan_step`] with a cold-start gate per prefill: `gate(seq, tokens already planned)`.
/// Decode tokens are never gated (a decoding sequence's adapter is usable: every layer is
/// either landed or assisted). A held waiting request is still admitted, so the queue stays
/// FIFO and its KV is reserved, but runs no tokens until its gate opens.
pub fn plan_step_gated(
    state: &SchedState,
    cfg: &SchedConfig,
    free_blocks: usize,
    gate: &dyn Fn(&SeqState, usize) -> Gate,
) -> Decision {
    let (ids, plan) = plan_tokens(
        state,
        cfg,
        free_blocks,
        gate,
        state.waiting.iter(),
        cfg.total_blocks,
    );
    Decision {
        admit: ids.len(),
        plan,
    }
}

/// What the next step does when admission chose the requests (any subset of the queue).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdmitDecision {
    /// Waiting requests to admit, in queue order ([`SchedState::admit_ids`]).
    pub admit: Vec<SeqId>,
    pub plan: StepPlan,
}

/// Plans one step over the running set and the waiting requests in `admissible` (an
/// admission policy's choice, e.g. [`crate::memory::admit`]), in queue order, while the token
/// budget, the batch size and `kv_capacity` (KV pages the memory manager leaves) allow.
pub fn plan_step_admitting(
    state: &SchedState,
    cfg: &SchedConfig,
    free_blocks: usize,
    gate: &dyn Fn(&SeqState, usize) -> Gate,
    admissible: &[SeqId],
    kv_capacity: usize,
) -> AdmitDecision {
    let set: HashSet<SeqId> = admissible.iter().copied().collect();
    let cands = state.waiting.iter().filter(|s| set.contains(&s.id));
    let (admit, plan) = plan_tokens(state, cfg, free_blocks, gate, cands, kv_capacity);
    AdmitDecision { admit, plan }
}

fn plan_tokens<'a>(
    state: &SchedState,
    cfg: &SchedConfig,
    free_blocks: usize,
    gate: &dyn Fn(&SeqState, usize) -> Gate,
    candidates: impl Iterator<Item = &'a SeqState>,
    kv_capacity: usize,
) -> (Vec<SeqId>, StepPlan) {
    let mut budget = cfg.max_num_batched_tokens;
    let mut free = free_blocks;
    let mut items = Vec::new();
    let decode = state.running.iter().filter(|s| !s.in_prefill());
    let prefill = state.running.iter().filter(|s| s.in_prefill());
    for s in decode.chain(prefill) {
        if budget == 0 || items.len() >= cfg.max_num_seqs {
            break;
        }
        let mut n = s.pending().min(budget);
        if s.in_prefill() {
            match gate(s, cfg.max_num_batched_tokens - budget) {
                Gate::Go => {}
                Gate::Hold => continue,
                Gate::Cap(c) => n = n.min(c),
            }
        }
        if n == 0 {
            continue;
        }
        let blocks = s.blocks_needed(cfg, n);
        if blocks > free {
            continue;
        }
        free -= blocks;
        budget -= n;
        items.push(PlanItem {
            seq: s.id,
            num_tokens: n,
        });
    }
    let mut admit = Vec::new();
    let mut reserved = state.reserved_blocks;
    for s in candidates {
        if budget == 0 || state.running.len() + admit.len() >= cfg.max_num_seqs {
            break;
        }
        // On demand: the blocks of its first chunk (a cached prefix included: sharing an
        // unreferenced cached block takes it out of the free pool), and a watermark left free.
        let r = s.reservation(cfg);
        if reserved + r + cfg.watermark() > kv_capacity {
            break;
        }
        let mut n = s.pending().min(budget);
        match gate(s, cfg.max_num_batched_tokens - budget) {
            Gate::Go => {}
            Gate::Hold => n = 0,
            Gate::Cap(c) => n = n.min(c),
        }
        let blocks = cfg.blocks_for(s.computed + n);
        if blocks + cfg.watermark() > free {
            break;
        }
        reserved += r;
        free -= blocks;
        budget -= n;
        admit.push(s.id);
        if n > 0 {
            items.push(PlanItem {
                seq: s.id,
                num_tokens: n,
            });
        }
    }
    (
        admit,
        StepPlan {
            items,
            return_logits: false,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::SeqState;
    use proptest::prelude::*;
    use thaw_runtime::ids::SeqId;

    fn cfg() -> SchedConfig {
        SchedConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 32,
            block_size: 4,
            total_blocks: 40,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
        }
    }

    /// Eight chat requests without `max_tokens` (each may grow to the whole 128-token
    /// context): on demand they all start on a 48-block pool that holds their prompts; the
    /// `max-tokens` baseline reserves each one's worst case, so only one fits at a time and
    /// the others wait — and none ever needs a block it was not charged.
    #[test]
    fn the_max_tokens_baseline_reserves_the_worst_case_and_on_demand_does_not() {
        let on_demand = SchedConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 256,
            total_blocks: 48,
            ..cfg()
        };
        let baseline = SchedConfig {
            kv_reservation: crate::scheduler::KvReservation::MaxTokens,
            ..on_demand
        };
        let mut st = SchedState::default();
        for i in 0..8 {
            st.enqueue(SeqState::new(SeqId(i), 20, 108));
        }
        assert_eq!(plan_step(&st, &on_demand, 48).admit, 8);
        let d = plan_step(&st, &baseline, 48);
        assert_eq!(
            d.admit, 1,
            "one worst case (32 blocks) leaves too little for another"
        );
        let s = &st.waiting[0];
        assert_eq!(s.reservation(&baseline), s.worst_case_blocks(&baseline));
        assert_eq!(s.reservation(&baseline), 32);
        assert_eq!(s.reservation(&on_demand), 5);
        // As it runs, the baseline's charge covers every block it will hold.
        let mut grown = s.clone();
        grown.computed = 127;
        grown.total_tokens = 128;
        assert!(grown.reservation(&baseline) >= grown.held_blocks(&baseline));
        assert_eq!(grown.reservation(&baseline), 32);
    }

    #[test]
    fn chunks_prefill_and_puts_decode_first() {
        let cfg = cfg();
        let mut st = SchedState::default();
        st.enqueue(SeqState::new(SeqId(1), 50, 4));
        let d = plan_step(&st, &cfg, cfg.total_blocks);
        assert_eq!(d.admit, 1);
        assert_eq!(
            d.plan.items[0].num_tokens, 32,
            "prefill chunked to the budget"
        );
        st.admit(1, &cfg);
        st.on_step(&[(SeqId(1), 32)], &[], &[], &cfg);
        st.enqueue(SeqState::new(SeqId(2), 3, 4));
        let d = plan_step(&st, &cfg, cfg.total_blocks - 8);
        assert_eq!(d.plan.items[0].num_tokens, 18);
        assert_eq!(d.plan.items[1].num_tokens, 3);
        st.admit(d.admit, &cfg);
        st.on_step(
            &[(SeqId(1), 18), (SeqId(2), 3)],
            &[SeqId(1), SeqId(2)],
            &[],
            &cfg,
        );
        let d = plan_step(&st, &cfg, 20);
        assert_eq!(d.plan.items.len(), 2);
        assert!(d.plan.items.iter().all(|i| i.num_tokens == 1));
    }

    #[test]
    fn fifo_head_blocks_on_its_first_chunk() {
        let cfg = SchedConfig {
            total_blocks: 10,
            ..cfg()
        };
        let mut st = SchedState::default();
        st.enqueue(SeqState::new(SeqId(1), 36, 400)); // first chunk of 32: 8 blocks
        st.enqueue(SeqState::new(SeqId(2), 12, 400)); // 3 blocks: would not fit beside it
        st.enqueue(SeqState::new(SeqId(3), 1, 1)); // fits, but FIFO: waits behind 2
        let d = plan_step(&st, &cfg, 10);
        assert_eq!(d.admit, 1);
        st.admit(1, &cfg);
        assert_eq!(
            st.reserved_blocks, 8,
            "its chunk, not prompt + max_tokens (109)"
        );
        assert!(st.remove(SeqId(1), &cfg));
        assert_eq!(st.reserved_blocks, 0);
        assert_eq!(plan_step(&st, &cfg, 10).admit, 2);
    }

    /// A fake engine: it holds blocks_for(computed) per sequence and finishes a sequence at
    /// `max_new_tokens` or at its early-stop point.
    fn simulate(reqs: &[(usize, usize, usize)], cfg: SchedConfig) -> Result<(), TestCaseError> {
        let mut st = SchedState::default();
        for (i, &(p, m, _)) in reqs.iter().enumerate() {
            st.enqueue(SeqState::new(SeqId(i as u64), p, m));
        }
        let mut done = vec![false; reqs.len()];
        let mut steps = 0;
        while !st.is_idle() {
            steps += 1;
            prop_assert!(steps < 10_000, "no progress: {st:?}");
            let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
            prop_assert!(used <= cfg.total_blocks);
            // Blocks on demand: whoever cannot get its next blocks is preempted first.
            let run = crate::scheduler::runners(&st, &cfg, |s| s.held_blocks(&cfg));
            for id in crate::scheduler::choose_preemptions(&run, cfg.total_blocks - used) {
                prop_assert!(st.preempt(id, &cfg));
            }
            let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
            let d = plan_step(&st, &cfg, cfg.total_blocks - used);
            let total: usize = d.plan.items.iter().map(|i| i.num_tokens).sum();
            prop_assert!(total <= cfg.max_num_batched_tokens, "token budget exceeded");
            prop_assert!(d.plan.items.len() <= cfg.max_num_seqs);
            prop_assert!(
                !d.plan.items.is_empty(),
                "a non-idle state must make progress"
            );
            st.admit(d.admit, &cfg);
            let planned: Vec<_> = d.plan.items.iter().map(|i| (i.seq, i.num_tokens)).collect();
            let mut sampled = Vec::new();
            let mut finished = Vec::new();
            for it in &d.plan.items {
                let s = st.running.iter().find(|s| s.id == it.seq).unwrap();
                prop_assert!(it.num_tokens <= s.pending());
                if s.computed + it.num_tokens == s.total_tokens {
                    sampled.push(it.seq);
                    let generated = s.total_tokens + 1 - s.prompt_len;
                    let (_, max, stop_at) = reqs[it.seq.0 as usize];
                    if generated >= max || generated == stop_at {
                        finished.push(it.seq);
                        done[it.seq.0 as usize] = true;
                    }
                }
            }
            st.on_step(&planned, &sampled, &finished, &cfg);
            let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
            prop_assert!(used <= cfg.total_blocks, "KV over-committed after the step");
        }
        prop_assert!(done.iter().all(|d| *d), "every admitted request finishes");
        Ok(())
    }

    proptest! {
        /// Token budget and batch size never exceeded, KV never over-committed, and every
        /// request (each fits the cache alone) eventually finishes.
        #[test]
        fn every_request_finishes_within_limits(
            reqs in proptest::collection::vec((1usize..60, 1usize..20, 1usize..25), 1..30),
            budget in 1usize..64,
            seqs in 1usize..6,
        ) {
            let cfg = SchedConfig {
                max_num_seqs: seqs,
                max_num_batched_tokens: budget,
                block_size: 4,
                total_blocks: 20,
                kv_reservation: crate::scheduler::KvReservation::OnDemand,
            };
            let reqs: Vec<_> = reqs
                .into_iter()
                .filter(|&(p, m, _)| cfg.blocks_for(p + m) <= cfg.total_blocks)
                .collect();
            simulate(&reqs, cfg)?;
        }

        /// The cold-start gate is applied as decided, every step: a prefill held runs no
        /// tokens, a capped one no more than its cap (the `auto` decision's chunk), decode is
        /// never gated, and the rows the gate is told are already planned are the step's rows
        /// before that request's (what `auto` sizes its chunk next to).
        #[test]
        fn the_cold_start_gate_bounds_every_prefill_it_is_asked_about(
            running in proptest::collection::vec((1usize..60, 0usize..60, 1usize..20), 0..6),
            waiting in proptest::collection::vec(1usize..60, 0..6),
            gates in proptest::collection::vec(0usize..40, 12),
            budget in 1usize..96,
        ) {
            let cfg = SchedConfig {
                max_num_seqs: 8,
                max_num_batched_tokens: budget,
                total_blocks: 400,
                ..cfg()
            };
            let mut st = SchedState::default();
            for (i, &(prompt, done, max)) in running.iter().enumerate() {
                // `done` tokens computed: some still prefill, the rest decode.
                let mut s = SeqState::new(SeqId(i as u64), prompt, max);
                if done >= prompt {
                    s.total_tokens = prompt + 1;
                    s.computed = prompt;
                } else {
                    s.computed = done;
                }
                st.running.push(s);
            }
            for (i, &prompt) in waiting.iter().enumerate() {
                st.waiting.push_back(SeqState::new(SeqId(100 + i as u64), prompt, 4));
            }
            // 0: hold, 1: go, c ≥ 2: at most c − 1 tokens.
            let gate_of = |id: SeqId| gates[(id.0 % 100) as usize + 6 * usize::from(id.0 >= 100)];
            let asked = std::cell::RefCell::new(Vec::new());
            let gate = |s: &SeqState, planned: usize| {
                asked.borrow_mut().push((s.id, planned));
                match gate_of(s.id) {
                    0 => Gate::Hold,
                    1 => Gate::Go,
                    c => Gate::Cap(c - 1),
                }
            };
            let d = plan_step_gated(&st, &cfg, cfg.total_blocks, &gate);
            let mut before = 0;
            for it in &d.plan.items {
                let s = st.running.iter().chain(&st.waiting).find(|s| s.id == it.seq).unwrap();
                if s.in_prefill() {
                    let at = asked.borrow().iter().find(|a| a.0 == it.seq).map(|a| a.1);
                    prop_assert_eq!(at, Some(before), "asked with the rows planned before it");
                    match gate_of(s.id) {
                        0 => prop_assert!(false, "a held prefill ran {} tokens", it.num_tokens),
                        1 => {}
                        c => prop_assert!(it.num_tokens < c, "{} over its cap {}", it.num_tokens, c - 1),
                    }
                } else {
                    prop_assert_eq!(it.num_tokens, 1);
                    prop_assert!(asked.borrow().iter().all(|a| a.0 != it.seq), "decode gated");
                }
                before += it.num_tokens;
            }
        }
    }
}
