//! `--scheduling-policy`: the waiting queue's order. `fcfs` and `priority` are vLLM's
//! (`priority`: lower value first, ties by arrival, as vLLM orders them); `sjf` is the
//! shortest-job-first baseline Chameleon compares against (Qiu et al.: shortest predicted
//! output first); `mlq` is Chameleon's multi-level queue ([`super::plan_mlq`]). The first
//! three are one ordered queue behind [`super::plan_step_gated`]: a head that does not fit
//! blocks the ones behind it.
use std::collections::HashMap;
use std::fmt;

use thaw_runtime::ids::SeqId;

use super::state::{SchedState, SeqState};

#[derive(
    Copy,
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum SchedulingPolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// The request's `priority` field, lower first; ties first come, first served.
    Priority,
    /// Shortest predicted output first (a baseline; long requests can starve).
    Sjf,
    /// Chameleon's multi-level queue: size classes with per-class quotas.
    Mlq,
}

impl SchedulingPolicy {
    pub const ALL: [SchedulingPolicy; 4] = [
        SchedulingPolicy::Fcfs,
        SchedulingPolicy::Priority,
        SchedulingPolicy::Sjf,
        SchedulingPolicy::Mlq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
            SchedulingPolicy::Sjf => "sjf",
            SchedulingPolicy::Mlq => "mlq",
        }
    }
}

impl fmt::Display for SchedulingPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Keys of the requests in an ordered waiting queue: `(key, arrival number)`.
#[derive(Clone, Debug, Default)]
pub struct OrderKeys {
    keys: HashMap<SeqId, (i64, u64)>,
    arrivals: u64,
}

impl OrderKeys {
    /// Queues `s` behind every waiting request whose key is not larger (stable: equal keys
    /// keep arrival order).
    pub fn enqueue(&mut self, state: &mut SchedState, s: SeqState, key: i64) {
        self.arrivals += 1;
        let k = (key, self.arrivals);
        self.keys.insert(s.id, k);
        self.insert(state, s, k);
    }

    /// Inserts `s` (key `k`) before the first waiting request with a larger key.
    fn insert(&self, state: &mut SchedState, s: SeqState, k: (i64, u64)) {
        let at = state
            .waiting
            .iter()
            .position(|w| self.keys.get(&w.id).is_some_and(|&wk| wk > k));
        match at {
            Some(i) => state.waiting.insert(i, s),
            None => state.waiting.push_back(s),
        }
    }

    pub fn remove(&mut self, id: SeqId) {
        self.keys.remove(&id);
    }

    /// Puts waiting request `id` (preempted, back in the queue) where its key orders it.
    pub fn reposition(&self, state: &mut SchedState, id: SeqId) {
        let Some(&k) = self.keys.get(&id) else { return };
        let Some(i) = state.waiting.iter().position(|w| w.id == id) else {
            return;
        };
        let Some(s) = state.waiting.remove(i) else {
            return;
        };
        self.insert(state, s, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_keys_first_and_ties_by_arrival() {
        let mut st = SchedState::default();
        let mut k = OrderKeys::default();
        for (id, key) in [(1, 5), (2, 0), (3, 5), (4, -1), (5, 0)] {
            k.enqueue(&mut st, SeqState::new(SeqId(id), 4, 4), key);
        }
        let order: Vec<u64> = st.waiting.iter().map(|s| s.id.0).collect();
        assert_eq!(order, vec![4, 2, 5, 1, 3]);
        // Running, then preempted: back where its key puts it, not at the front.
        let cfg = crate::scheduler::SchedConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            block_size: 4,
            total_blocks: 64,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
        };
        st.admit_ids(&[SeqId(1)], &cfg);
        assert!(st.preempt(SeqId(1), &cfg));
        k.reposition(&mut st, SeqId(1));
        let order: Vec<u64> = st.waiting.iter().map(|s| s.id.0).collect();
        assert_eq!(order, vec![4, 2, 5, 1, 3]);
    }
}
