//! Whom to preempt when the running sequences cannot all get the KV blocks of their next step
//! (vLLM V1's recompute preemption): serving them in step order, while the next one does not
//! fit, preempt the newest running sequence of the lowest priority (the highest `priority`
//! value, then the latest arrival) — possibly the one being served, which then waits too.
//! A pure function over the running set, so it is property-tested without an engine.
use thaw_runtime::ids::SeqId;

use super::state::{SchedConfig, SchedState, SeqState};

/// One running sequence as the decision sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Runner {
    pub id: SeqId,
    /// vLLM's priority (lower runs first).
    pub priority: i64,
    /// Blocks its next step needs beyond what it holds.
    pub need: usize,
    /// Blocks preempting it gives back (those no other sequence shares).
    pub frees: usize,
}

/// The blocks each running sequence's next step needs, in the order a step serves them
/// (decode first, then prefill chunks within the token budget), as [`super::plan_step`] does.
pub fn step_needs(state: &SchedState, cfg: &SchedConfig) -> Vec<(SeqId, usize)> {
    let mut budget = cfg.max_num_batched_tokens;
    let decode = state.running.iter().filter(|s| !s.in_prefill());
    let prefill = state.running.iter().filter(|s| s.in_prefill());
    let mut out = Vec::with_capacity(state.running.len());
    for s in decode.chain(prefill).take(cfg.max_num_seqs) {
        let n = s.pending().min(budget);
        budget -= n;
        out.push((s.id, s.blocks_needed(cfg, n)));
    }
    out
}

/// The sequences to preempt, in order, so that the rest get their `need` out of `free`.
/// None when everything fits.
pub fn choose_preemptions(runners: &[Runner], free: usize) -> Vec<SeqId> {
    let key = |r: &Runner| (r.priority, r.id);
    let mut alive = vec![true; runners.len()];
    let mut served = vec![false; runners.len()];
    let mut free = free;
    let mut victims = Vec::new();
    for i in 0..runners.len() {
        if !alive[i] {
            continue;
        }
        while runners[i].need > free {
            let Some(v) = (0..runners.len())
                .filter(|&j| alive[j])
                .max_by_key(|&j| key(&runners[j]))
            else {
                break;
            };
            alive[v] = false;
            victims.push(runners[v].id);
            free += runners[v].frees;
            if served[v] {
                free += runners[v].need;
            }
            if v == i {
                break;
            }
        }
        if alive[i] {
            free -= runners[i].need;
            served[i] = true;
        }
    }
    victims
}

/// [`Runner`]s for `state`'s running sequences in step order; `frees(seq)` says what
/// preempting one gives back.
pub fn runners(
    state: &SchedState,
    cfg: &SchedConfig,
    frees: impl Fn(&SeqState) -> usize,
) -> Vec<Runner> {
    step_needs(state, cfg)
        .into_iter()
        .filter_map(|(id, need)| {
            let s = state.running.iter().find(|s| s.id == id)?;
            Some(Runner {
                id,
                priority: s.priority,
                need,
                frees: frees(s),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn r(id: u64, priority: i64, need: usize, frees: usize) -> Runner {
        Runner {
            id: SeqId(id),
            priority,
            need,
            frees,
        }
    }

    #[test]
    fn newest_of_the_lowest_priority_goes_first() {
        let run = [r(1, 0, 1, 4), r(2, 5, 1, 4), r(3, 0, 1, 4), r(4, 5, 0, 2)];
        assert!(choose_preemptions(&run, 3).is_empty(), "everything fits");
        assert_eq!(choose_preemptions(&run, 1), vec![SeqId(4)]);
        assert_eq!(
            choose_preemptions(&run, 0),
            vec![SeqId(4), SeqId(2)],
            "2 was served, then 3 needed its blocks"
        );
        let run = [r(1, 0, 1, 4), r(2, 0, 1, 4)];
        assert_eq!(choose_preemptions(&run, 0), vec![SeqId(2)]);
        // The one being served is itself the victim: it waits, nothing else is taken.
        let run = [r(7, 0, 3, 0)];
        assert_eq!(choose_preemptions(&run, 1), vec![SeqId(7)]);
    }

    proptest! {
        /// The survivors' needs fit what is free plus what the victims give back; victims
        /// are taken in (priority, arrival) order from the back; nobody is preempted when
        /// everything fits.
        #[test]
        fn survivors_fit_and_victims_are_the_lowest(
            run in proptest::collection::vec((0i64..3, 0usize..4, 0usize..6), 0..12),
            free in 0usize..12,
        ) {
            let runners: Vec<Runner> = run
                .iter()
                .enumerate()
                .map(|(i, &(p, need, frees))| r(i as u64, p, need, frees))
                .collect();
            let v = choose_preemptions(&runners, free);
            let total: usize = runners.iter().map(|r| r.need).sum();
            if total <= free {
                prop_assert!(v.is_empty());
            }
            let gone: std::collections::HashSet<SeqId> = v.iter().copied().collect();
            prop_assert_eq!(gone.len(), v.len(), "preempted twice");
            let need: usize = runners.iter().filter(|r| !gone.contains(&r.id)).map(|r| r.need).sum();
            let back: usize = runners.iter().filter(|r| gone.contains(&r.id)).map(|r| r.frees).sum();
            prop_assert!(need <= free + back, "survivors need {need}, free {free} + {back}");
            // Each victim was the lowest-ranked alive one when taken.
            let mut alive: Vec<&Runner> = runners.iter().collect();
            for id in &v {
                let lowest = alive.iter().max_by_key(|r| (r.priority, r.id)).unwrap().id;
                prop_assert_eq!(*id, lowest);
                alive.retain(|r| r.id != *id);
            }
        }
    }
}
