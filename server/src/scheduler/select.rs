//! The scheduler the engine loop holds: the `--scheduling-policy` in force, the state each
//! policy keeps beside [`SchedState`] (order keys, the multi-level queue, the output-length
//! predictor) and what it publishes for /metrics. The decisions themselves stay the pure
//! functions [`plan_step_gated`] and [`plan_mlq`].
use std::collections::{HashMap, HashSet};
use std::time::Instant;

use thaw_runtime::ids::{AdapterId, SeqId};

use super::mlq::{
    blocked_wait_s, fit_steps, plan_mlq, protected, step_budget_s, Hold, MemoryWait, Mlq,
    MlqConfig, MlqInputs, OutputPredictor, PredictorStats, RequestSize, TpotCap, Waiter,
};
use super::ordering::{OrderKeys, SchedulingPolicy};
use super::policy::{plan_step_admitting, AdmitDecision, Gate};
use super::state::{SchedConfig, SchedState, SeqState};
use crate::perf::{PerfModel, StepShape};

/// What the loop knows of a new request beyond its [`SeqState`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Arrival {
    /// The request's `priority` (vLLM: lower runs first; default 0).
    pub priority: i64,
    /// Its adapter's rank, 0 for the base model.
    pub rank: usize,
    /// Predicted seconds until its adapter is on the device.
    pub load_s: f64,
    /// Device pages its adapter takes, when it is not on the device (nor on its way) at
    /// arrival; 0 otherwise. The multi-level queue charges them to the request's quota.
    pub adapter_pages: usize,
}

/// One queue of the multi-level queue, for /metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QueueInfo {
    pub waiting: usize,
    pub quota_tokens: usize,
}

/// What the scheduler publishes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedSnapshot {
    pub policy: SchedulingPolicy,
    pub queues: Vec<QueueInfo>,
    pub predictor: PredictorStats,
}

struct Known {
    adapter: Option<AdapterId>,
    predicted: usize,
    rank: usize,
    /// When the scheduler first saw it with an output token (the TPOT cap's clock).
    first_token_s: Option<f64>,
}

pub struct Scheduler {
    pub policy: SchedulingPolicy,
    /// `--tpot-slo-ms`: the rank-aware cap of the multi-level queue.
    pub tpot_slo_s: Option<f64>,
    mlq: Mlq,
    keys: OrderKeys,
    predictor: OutputPredictor,
    known: HashMap<SeqId, Known>,
    start: Instant,
}

impl Scheduler {
    pub fn new(
        policy: SchedulingPolicy,
        mlq: MlqConfig,
        tpot_slo_s: Option<f64>,
        cfg: &SchedConfig,
    ) -> Self {
        Self {
            policy,
            tpot_slo_s,
            mlq: Mlq::new(mlq, cfg.total_blocks * cfg.block_size),
            keys: OrderKeys::default(),
            predictor: OutputPredictor::default(),
            known: HashMap::new(),
            start: Instant::now(),
        }
    }

    fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Queues a new request where the policy puts it.
    pub fn enqueue(
        &mut self,
        state: &mut SchedState,
        cfg: &SchedConfig,
        seq: SeqState,
        arrival: Arrival,
        perf: &PerfModel,
    ) {
        let predicted = self.predictor.predict(seq.adapter, seq.max_new_tokens);
        self.known.insert(
            seq.id,
            Known {
                adapter: seq.adapter,
                predicted,
                rank: arrival.rank,
                first_token_s: None,
            },
        );
        match self.policy {
            SchedulingPolicy::Fcfs => state.enqueue(seq),
            SchedulingPolicy::Priority => self.keys.enqueue(state, seq, arrival.priority),
            SchedulingPolicy::Sjf => self.keys.enqueue(state, seq, predicted as i64),
            SchedulingPolicy::Mlq => {
                let req = RequestSize {
                    input: seq.prompt_len,
                    predicted_output: predicted,
                    rank: arrival.rank,
                    load_s: arrival.load_s,
                };
                // What binds in the unified pool: its KV reservation, plus its adapter's pages
                // when they must be found for it (an upper bound when several waiting
                // requests bring the same absent adapter: each is charged).
                let size = (seq.worst_case_blocks(cfg) + arrival.adapter_pages) * cfg.block_size;
                let service_s = perf.step_time(seq.prompt_len)
                    + predicted as f64 * perf.step_time(1)
                    + arrival.load_s;
                let now = self.now_s();
                self.mlq.enqueue(seq.id, &req, size, service_s, now);
                state.enqueue(seq);
            }
        }
    }

    /// Under `mlq` (with [`MlqConfig::protect`]), picks the request to protect this step
    /// (see `mlq/protect.rs`): the oldest waiting request, when it is in a queue above
    /// the fast lane and has waited the time the running batch is predicted to need to free
    /// its KV reservation out of `kv_capacity` blocks (running requests finish after their
    /// predicted output, one step per token, each step the perf model's time for the running
    /// decode batch). Call once per step before [`Self::candidate_order`].
    pub fn protect(
        &mut self,
        state: &SchedState,
        cfg: &SchedConfig,
        perf: &PerfModel,
        kv_capacity: usize,
    ) {
        if self.policy != SchedulingPolicy::Mlq || !self.mlq.cfg.protect {
            self.mlq.set_protected(None);
            return;
        }
        let waiters: Vec<Waiter> = state
            .waiting
            .iter()
            .filter_map(|s| {
                self.mlq.entry(s.id).map(|e| Waiter {
                    id: s.id,
                    arrived_s: e.arrived_s,
                    queue: self.mlq.queue(s.id),
                })
            })
            .collect();
        let mut running = StepShape::default();
        let holds: Vec<Hold> = state
            .running
            .iter()
            .map(|s| {
                let rank = self.rank(s.id);
                running.add(1, true, rank);
                let predicted = self
                    .known
                    .get(&s.id)
                    .map_or(s.max_new_tokens, |k| k.predicted);
                let generated = s.total_tokens - s.prompt_len;
                let prefill = (s.prompt_len - s.computed.min(s.prompt_len))
                    .div_ceil(cfg.max_num_batched_tokens.max(1));
                Hold {
                    steps: prefill + predicted.saturating_sub(generated).max(1),
                    blocks: s.reservation(cfg),
                }
            })
            .collect();
        let step_s = perf.predict(&running);
        let free = kv_capacity.saturating_sub(state.reserved_blocks);
        let now = self.now_s();
        let need = |id: SeqId| {
            state
                .waiting
                .iter()
                .find(|s| s.id == id)
                .map_or(0, |s| s.reservation(cfg))
        };
        let bound = |id: SeqId| match fit_steps(free, &holds, need(id)) {
            Some(steps) => steps as f64 * step_s,
            // Not even the whole batch finishing frees enough: it is due now.
            None => 0.0,
        };
        let p = protected(&waiters, now, bound);
        self.mlq.set_protected(p);
    }

    /// The waiting requests in the order adapter-aware admission should consider them:
    /// the queue's own order, or under `mlq` the requests past the starvation bound first,
    /// oldest first, then the smallest requests' queue first (so memory is arranged for the
    /// fast lane before a long head can block it). An overdue request that does not fit
    /// becomes the memory layer's head, whose bypass rule then lets pass only requests that
    /// do not delay it: without this, a request whose adapter needs much of the pool (a
    /// rank-128 adapter on a small pool) came last every step and waited until the fast lane
    /// happened to leave that much free.
    pub fn candidate_order<'a>(&self, state: &'a SchedState) -> Vec<&'a SeqState> {
        let mut v: Vec<&SeqState> = state.waiting.iter().collect();
        if self.policy == SchedulingPolicy::Mlq {
            let now = self.now_s();
            v.sort_by_key(|s| self.mlq.admission_rank(s.id, now));
        }
        v
    }

    /// Plans the next step over the requests adapter-aware admission found `admissible`,
    /// reserving at most `kv_capacity` KV blocks in all (what the memory layer leaves KV now).
    /// Under `mlq` the queues' quotas split the whole pool (`cfg.total_blocks`): a request is
    /// charged its KV and the pages of an adapter that was not on the device, the two things
    /// that compete for the pool. `mem` says how long the others wait (the
    /// bypass rule's bound). Apply the decision with [`SchedState::admit_ids`].
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        &mut self,
        state: &SchedState,
        cfg: &SchedConfig,
        free_blocks: usize,
        gate: &dyn Fn(&SeqState, usize) -> Gate,
        perf: &PerfModel,
        admissible: &[SeqId],
        kv_capacity: usize,
        mem: &MemoryWait,
    ) -> AdmitDecision {
        if self.policy != SchedulingPolicy::Mlq {
            return plan_step_admitting(state, cfg, free_blocks, gate, admissible, kv_capacity);
        }
        self.mlq.set_capacity(cfg.total_blocks * cfg.block_size);
        let ok: HashSet<SeqId> = admissible.iter().copied().collect();
        let now = self.now_s();
        // The TPOT cap's clock: a request's first token came with the step before the one
        // that first shows it here.
        for s in state
            .running
            .iter()
            .filter(|s| s.total_tokens > s.prompt_len)
        {
            if let Some(k) = self.known.get_mut(&s.id) {
                k.first_token_s.get_or_insert(now);
            }
        }
        let known = &self.known;
        let step_budget = self.tpot_slo_s.map(|slo| {
            step_budget_s(
                slo,
                state.running.iter().filter_map(|s| {
                    let first = known.get(&s.id)?.first_token_s?;
                    Some((s.total_tokens - s.prompt_len, now - first))
                }),
            )
        });
        let rank = |s: &SeqState| known.get(&s.id).map(|k| k.rank).filter(|&r| r > 0);
        // The memory layer's head that waits for memory blocks its queue, bounded by its
        // predicted wait (the running batch freeing memory, then its adapter's load); any
        // other request it could not place waits without blocking (see `plan_mlq`).
        let mut running = StepShape::default();
        for s in &state.running {
            running.add(1, true, rank(s));
        }
        let wait = |s: &SeqState| {
            if ok.contains(&s.id) {
                return None;
            }
            blocked_wait_s(perf, &running, mem, s.id)
        };
        let later = |s: &SeqState| !ok.contains(&s.id) && wait(s).is_none();
        let d = plan_mlq(
            state,
            cfg,
            &self.mlq,
            &MlqInputs {
                free_blocks,
                kv_capacity,
                now_s: self.now_s(),
                gate,
                adapter_wait: &wait,
                later: &later,
                tpot: self.tpot_slo_s.map(|slo_s| TpotCap {
                    model: perf,
                    slo_s,
                    step_budget_s: step_budget.unwrap_or(slo_s),
                    rank: &rank,
                }),
            },
        );
        for &(head, n) in &d.bypassed {
            self.mlq.note_bypass(head, n);
        }
        AdmitDecision {
            admit: d.admit_ids,
            plan: d.decision.plan,
        }
    }

    /// A running request was preempted ([`SchedState::preempt`]): under `priority` and `sjf`
    /// it goes back where its key orders it.
    pub fn preempted(&self, state: &mut SchedState, id: SeqId) {
        if matches!(
            self.policy,
            SchedulingPolicy::Priority | SchedulingPolicy::Sjf
        ) {
            self.keys.reposition(state, id);
        }
    }

    /// Records a finished request's output length (the predictor learns from it) and forgets
    /// it.
    pub fn finished(&mut self, id: SeqId, generated: usize) {
        if let Some(k) = self.known.get(&id) {
            self.predictor.observe(k.adapter, k.predicted, generated);
        }
        self.remove(id);
    }

    /// The adapter rank a queued or running request was filed with (None: base model).
    pub fn rank(&self, id: SeqId) -> Option<usize> {
        self.known.get(&id).map(|k| k.rank).filter(|&r| r > 0)
    }

    /// The multi-level queue's state (sizes, queues, quotas).
    pub fn mlq(&self) -> &Mlq {
        &self.mlq
    }

    /// Gives back the room a burst left in the per-request map once nothing is queued or
    /// running (its capacity otherwise stays at the burst's peak for the process's life).
    pub fn shrink_idle(&mut self, keep: usize) {
        self.known.shrink_to(keep);
    }

    /// Forgets a request that left without finishing.
    pub fn remove(&mut self, id: SeqId) {
        self.known.remove(&id);
        self.keys.remove(id);
        self.mlq.remove(id);
    }

    pub fn snapshot(&self, state: &SchedState) -> SchedSnapshot {
        let queues = if self.policy == SchedulingPolicy::Mlq {
            let mut q: Vec<QueueInfo> = self
                .mlq
                .quotas()
                .iter()
                .map(|q| QueueInfo {
                    waiting: 0,
                    quota_tokens: q.tokens,
                })
                .collect();
            for s in &state.waiting {
                q[self.mlq.queue(s.id)].waiting += 1;
            }
            q
        } else {
            Vec::new()
        };
        SchedSnapshot {
            policy: self.policy,
            queues,
            predictor: self.predictor.stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SchedConfig {
        SchedConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            block_size: 4,
            total_blocks: 64,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
        }
    }

    #[test]
    fn priority_orders_admission_lower_first() {
        let cfg = cfg();
        let mut st = SchedState::default();
        let mut s = Scheduler::new(SchedulingPolicy::Priority, MlqConfig::default(), None, &cfg);
        let perf = PerfModel::default();
        for (id, p) in [(1, 3), (2, -2), (3, 3), (4, 0)] {
            let a = Arrival {
                priority: p,
                ..Default::default()
            };
            s.enqueue(&mut st, &cfg, SeqState::new(SeqId(id), 4, 4), a, &perf);
        }
        let ids: Vec<u64> = st.waiting.iter().map(|s| s.id.0).collect();
        assert_eq!(ids, vec![2, 4, 1, 3]);
        let all: Vec<SeqId> = st.waiting.iter().map(|s| s.id).collect();
        let d = s.plan(
            &st,
            &cfg,
            64,
            &|_, _| Gate::Go,
            &perf,
            &all,
            64,
            &MemoryWait::default(),
        );
        assert_eq!(d.admit, vec![SeqId(2), SeqId(4), SeqId(1), SeqId(3)]);
        // Only what adapter-aware admission allowed is admitted.
        let d = s.plan(
            &st,
            &cfg,
            64,
            &|_, _| Gate::Go,
            &perf,
            &all[1..],
            64,
            &MemoryWait::default(),
        );
        assert!(!d.admit.contains(&SeqId(2)));
    }

    /// Ten waiting requests, the first (id 1) the only one admission could not place.
    fn mlq_with_blocked_head(cfg: &SchedConfig) -> (Scheduler, SchedState, Vec<SeqId>) {
        let mut st = SchedState::default();
        let mut s = Scheduler::new(SchedulingPolicy::Mlq, MlqConfig::default(), None, cfg);
        let perf = PerfModel::default();
        for id in 1..=10u64 {
            let a = Arrival {
                rank: 8,
                ..Default::default()
            };
            s.enqueue(&mut st, cfg, SeqState::new(SeqId(id), 4, 4), a, &perf);
        }
        let ok: Vec<SeqId> = (2..=10u64).map(SeqId).collect();
        (s, st, ok)
    }

    #[test]
    fn mlq_quotas_split_the_whole_pool_whatever_kv_is_left() {
        let cfg = cfg();
        let (mut s, st, ok) = mlq_with_blocked_head(&cfg);
        let perf = PerfModel::default();
        for cap in [64, 40, 17, 64] {
            s.plan(
                &st,
                &cfg,
                64,
                &|_, _| Gate::Go,
                &perf,
                &ok,
                cap,
                &MemoryWait::default(),
            );
            let q = s.snapshot(&st).queues;
            let sum: usize = q.iter().map(|q| q.quota_tokens).sum();
            assert_eq!(sum, cfg.total_blocks * cfg.block_size, "{q:?}");
        }
    }

    #[test]
    fn mlq_charges_an_absent_adapters_pages_with_the_kv() {
        let cfg = cfg();
        let mut st = SchedState::default();
        let mut s = Scheduler::new(SchedulingPolicy::Mlq, MlqConfig::default(), None, &cfg);
        let perf = PerfModel::default();
        for (id, pages) in [(1u64, 0usize), (2, 14)] {
            let a = Arrival {
                rank: 64,
                adapter_pages: pages,
                ..Default::default()
            };
            s.enqueue(&mut st, &cfg, SeqState::new(SeqId(id), 10, 6), a, &perf);
        }
        // 16 tokens: 4 blocks of 4 slots.
        let size = |id| s.mlq().entry(SeqId(id)).map(|e| e.size);
        assert_eq!(size(1), Some(4 * 4));
        assert_eq!(size(2), Some((4 + 14) * 4));
    }

    /// A long request, then short ones; 40 arrivals before them fit the queues.
    fn long_then_short(max_wait_s: f64) -> Vec<u64> {
        let cfg = cfg();
        let mut st = SchedState::default();
        let mc = MlqConfig {
            warmup: 40,
            max_wait_s,
            ..Default::default()
        };
        let mut s = Scheduler::new(SchedulingPolicy::Mlq, mc, None, &cfg);
        let perf = PerfModel::default();
        for i in 0..40u64 {
            let out = if i % 4 == 0 { 200 } else { 2 };
            let q = SeqState::new(SeqId(100 + i), 4, out);
            s.enqueue(&mut st, &cfg, q, Arrival::default(), &perf);
            s.finished(SeqId(100 + i), out);
        }
        st.waiting.clear();
        assert!(s.mlq().num_queues() >= 2, "{:?}", s.mlq().cutoffs());
        for (id, out) in [(1, 200), (2, 2), (3, 2)] {
            let q = SeqState::new(SeqId(id), 4, out);
            s.enqueue(&mut st, &cfg, q, Arrival::default(), &perf);
        }
        s.candidate_order(&st).iter().map(|q| q.id.0).collect()
    }

    #[test]
    fn memory_admission_sees_overdue_requests_first_then_the_fast_lane() {
        assert_eq!(long_then_short(1e9), vec![2, 3, 1], "fast lane first");
        assert_eq!(
            long_then_short(0.0),
            vec![1, 2, 3],
            "all overdue: oldest first, so the long one heads memory admission"
        );
    }

    #[test]
    fn bypass_waits_on_the_perf_models_prediction_of_the_heads_wait() {
        let cfg = cfg();
        let perf = PerfModel::default();
        let plan = |load_s: f64| {
            let (mut s, st, ok) = mlq_with_blocked_head(&cfg);
            let mem = MemoryWait {
                head: Some((SeqId(1), Some(0))),
                load_s: [(SeqId(1), load_s)].into_iter().collect(),
            };
            s.plan(&st, &cfg, 64, &|_, _| Gate::Go, &perf, &ok, 64, &mem)
        };
        // The head (blocked on memory the running batch does not hold) has its adapter
        // land at once: nothing is short enough to pass it.
        assert!(plan(0.0).admit.is_empty());
        // Its adapter takes long to load: the requests behind it go first (up to the bound).
        let d = plan(1e3);
        assert!(!d.admit.is_empty() && !d.admit.contains(&SeqId(1)), "{d:?}");
        assert!(d.admit.len() <= MlqConfig::default().max_bypass);
    }

    #[test]
    fn sjf_orders_by_predicted_output_and_the_predictor_learns() {
        let cfg = cfg();
        let mut st = SchedState::default();
        let mut s = Scheduler::new(SchedulingPolicy::Sjf, MlqConfig::default(), None, &cfg);
        let perf = PerfModel::default();
        let (a, b) = (Some(AdapterId(1)), Some(AdapterId(2)));
        for i in 0..8u64 {
            let mut q = SeqState::new(SeqId(100 + i), 4, 500);
            q.adapter = if i % 2 == 0 { a } else { b };
            s.enqueue(&mut st, &cfg, q, Arrival::default(), &perf);
            s.finished(SeqId(100 + i), if i % 2 == 0 { 300 } else { 10 });
        }
        st.waiting.clear();
        let mut long = SeqState::new(SeqId(1), 4, 500);
        long.adapter = a;
        let mut short = SeqState::new(SeqId(2), 4, 500);
        short.adapter = b;
        s.enqueue(&mut st, &cfg, long, Arrival::default(), &perf);
        s.enqueue(&mut st, &cfg, short, Arrival::default(), &perf);
        assert_eq!(st.waiting[0].id, SeqId(2), "adapter 2's requests are short");
        assert_eq!(s.snapshot(&st).predictor.count, 8);
    }
}
