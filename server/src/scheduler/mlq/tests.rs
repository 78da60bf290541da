//! Tests of the multi-level queue: its admission rules on hand-built states, and its
//! invariants over random workloads driven through a fake engine.
use proptest::prelude::*;
use thaw_runtime::ids::SeqId;

use super::plan::{plan_mlq, MlqDecision, MlqInputs, TpotCap};
use super::protect::{fit_steps, protected, Hold, Waiter};
use super::state::{Mlq, MlqConfig};
use super::wrs::RequestSize;
use crate::memory::admission::predicted_steps;
use crate::perf::PerfModel;
use crate::scheduler::policy::Gate;
use crate::scheduler::state::{SchedConfig, SchedState, SeqState};

fn cfg() -> SchedConfig {
    SchedConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        block_size: 4,
        total_blocks: 64,
        kv_reservation: crate::scheduler::KvReservation::OnDemand,
    }
}

/// Files a request of `prompt` + `max` tokens with the queues and the state.
fn add(st: &mut SchedState, mlq: &mut Mlq, cfg: &SchedConfig, id: u64, p: usize, m: usize, t: f64) {
    let s = SeqState::new(SeqId(id), p, m);
    let size = s.worst_case_blocks(cfg) * cfg.block_size;
    let req = RequestSize {
        input: p,
        predicted_output: m,
        rank: 8,
        load_s: 0.0,
    };
    // 10 ms a token.
    mlq.enqueue(s.id, &req, size, (p + m) as f64 * 0.01, t);
    st.enqueue(s);
}

fn plain<'a>(free: usize, now: f64, wait: &'a dyn Fn(&SeqState) -> Option<f64>) -> MlqInputs<'a> {
    MlqInputs {
        free_blocks: free,
        kv_capacity: 64,
        now_s: now,
        gate: &|_, _| Gate::Go,
        adapter_wait: wait,
        later: &|_| false,
        tpot: None,
    }
}

/// [`plain`] on a cache of `kv` blocks, all free: what binds is the blocks of each request's
/// first chunk (KV comes on demand).
fn tight<'a>(kv: usize, now: f64, wait: &'a dyn Fn(&SeqState) -> Option<f64>) -> MlqInputs<'a> {
    MlqInputs {
        kv_capacity: kv,
        ..plain(kv, now, wait)
    }
}

fn apply(st: &mut SchedState, mlq: &mut Mlq, cfg: &SchedConfig, d: &MlqDecision) {
    assert_eq!(d.decision.admit, d.admit_ids.len());
    st.admit_ids(&d.admit_ids, cfg);
    for &(h, n) in &d.bypassed {
        mlq.note_bypass(h, n);
    }
}

/// Two size classes fitted: 1-token prompts with 2-token outputs, and 40 + 100.
fn two_queues(cfg: &SchedConfig) -> (SchedState, Mlq) {
    let mc = MlqConfig {
        warmup: 20,
        keep_min: true,
        weights: crate::scheduler::WrsWeights {
            max_input: 128,
            max_output: 128,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut mlq = Mlq::new(mc, cfg.total_blocks * cfg.block_size);
    let mut st = SchedState::default();
    for i in 0..20u64 {
        let (p, m) = if i % 5 == 0 { (40, 100) } else { (1, 2) };
        add(&mut st, &mut mlq, cfg, 1000 + i, p, m, i as f64);
    }
    st.waiting.clear();
    for i in 0..20u64 {
        mlq.remove(SeqId(1000 + i));
    }
    assert_eq!(mlq.num_queues(), 2, "{:?}", mlq.cutoffs());
    (st, mlq)
}

#[test]
fn a_long_head_that_does_not_fit_does_not_block_the_short_lane() {
    let cfg = cfg();
    let (mut st, mut mlq) = two_queues(&cfg);
    add(&mut st, &mut mlq, &cfg, 1, 40, 100, 1.0); // its 40-token prompt: 10 blocks
    add(&mut st, &mut mlq, &cfg, 2, 40, 100, 1.0); // 10 more: over a cache of 19
    add(&mut st, &mut mlq, &cfg, 3, 1, 2, 1.0);
    let none = |_: &SeqState| None;
    let d = plan_mlq(&st, &cfg, &mlq, &tight(19, 1.0, &none));
    assert!(d.admit_ids.contains(&SeqId(3)), "{d:?}");
    assert!(d.admit_ids.contains(&SeqId(1)));
    assert!(!d.admit_ids.contains(&SeqId(2)));
    // FIFO admits 1 and blocks 3 behind 2.
    let fifo = crate::scheduler::plan_step_admitting(
        &st,
        &cfg,
        19,
        &|_, _| Gate::Go,
        &[SeqId(1), SeqId(2), SeqId(3)],
        19,
    );
    assert_eq!(fifo.admit, vec![SeqId(1)]);
}

#[test]
fn spare_quota_of_an_empty_queue_goes_to_the_others() {
    // A token budget for four 48-token prompts: only the quotas and the KV limit here.
    let cfg = SchedConfig {
        max_num_batched_tokens: 256,
        ..cfg()
    };
    let (mut st, mut mlq) = two_queues(&cfg);
    let q = mlq.quotas().to_vec();
    assert!(q[0].tokens > q[1].tokens / 4, "{q:?}");
    assert_eq!(q.iter().map(|q| q.tokens).sum::<usize>(), 256);
    // Only long requests: beyond the long queue's quota, within the whole cache.
    // Quotas 79 and 177 tokens, minima 4 and 140: the short lane lends 75, the long one
    // its 37 above its minimum (two hold 136 of 177; the third goes on the spare, a fourth
    // does not fit the 40 blocks of KV: each prompt takes 12).
    assert_eq!((q[0].min, q[1].min), (4, 140));
    for id in 1..=4 {
        // 17 blocks = 68 tokens; a long prompt, so it sizes with the long class (WRS is
        // normalised by the window's means: 8.8 input and 21.6 output tokens).
        add(&mut st, &mut mlq, &cfg, id, 48, 20, 1.0);
    }
    let none = |_: &SeqState| None;
    let d = plan_mlq(&st, &cfg, &mlq, &tight(40, 1.0, &none));
    let long = mlq.queue(SeqId(1));
    assert_eq!(long, 1);
    assert_eq!(
        (d.phase1[long], d.phase2[long], d.spare),
        (2, 1, 75 + 37),
        "{d:?}"
    );
    assert_eq!(d.admit_ids.len(), 3, "{d:?}");
}

#[test]
fn younger_requests_bypass_an_adapter_blocked_head_within_its_wait_and_bound() {
    let cfg = cfg();
    let mc = MlqConfig {
        max_bypass: 2,
        ..Default::default()
    };
    let mut mlq = Mlq::new(mc, 256);
    let mut st = SchedState::default();
    add(&mut st, &mut mlq, &cfg, 1, 4, 4, 0.0); // blocked head
    add(&mut st, &mut mlq, &cfg, 2, 30, 30, 0.0); // service 0.6 s > the head's wait
    add(&mut st, &mut mlq, &cfg, 3, 2, 2, 0.0);
    add(&mut st, &mut mlq, &cfg, 4, 2, 2, 0.0);
    add(&mut st, &mut mlq, &cfg, 5, 2, 2, 0.0);
    let blocked = |s: &SeqState| (s.id == SeqId(1)).then_some(0.5);
    let d = plan_mlq(&st, &cfg, &mlq, &plain(cfg.total_blocks, 0.0, &blocked));
    assert!(
        d.admit_ids.is_empty(),
        "request 2 would outlast the head's wait: {d:?}"
    );
    assert!(st.remove(SeqId(2), &cfg));
    mlq.remove(SeqId(2));
    let d = plan_mlq(&st, &cfg, &mlq, &plain(cfg.total_blocks, 0.0, &blocked));
    assert_eq!(
        d.admit_ids,
        vec![SeqId(3), SeqId(4)],
        "two bypasses at most"
    );
    assert_eq!(d.bypassed, vec![(SeqId(1), 2)]);
    apply(&mut st, &mut mlq, &cfg, &d);
    let d = plan_mlq(&st, &cfg, &mlq, &plain(cfg.total_blocks, 0.0, &blocked));
    assert!(
        d.admit_ids.is_empty(),
        "the bound holds across steps: {d:?}"
    );
    let none = |_: &SeqState| None;
    let d = plan_mlq(&st, &cfg, &mlq, &plain(cfg.total_blocks, 0.0, &none));
    assert_eq!(d.admit_ids, vec![SeqId(1), SeqId(5)]);
}

#[test]
fn overdue_requests_go_first_and_one_that_does_not_fit_keeps_the_step() {
    let cfg = cfg();
    let mut mlq = Mlq::new(MlqConfig::default(), 256);
    let mut st = SchedState::default();
    add(&mut st, &mut mlq, &cfg, 1, 4, 4, 100.0);
    add(&mut st, &mut mlq, &cfg, 2, 4, 4, 0.0);
    let none = |_: &SeqState| None;
    let d = plan_mlq(&st, &cfg, &mlq, &tight(16, 100.0, &none));
    assert!(d.all_fit, "everything fits: fcfs order, {d:?}");
    assert_eq!(d.admit_ids, vec![SeqId(1), SeqId(2)]);
    // Contention (5's first chunk, 16 blocks, does not fit beside the others in 16): the
    // overdue one first.
    add(&mut st, &mut mlq, &cfg, 5, 200, 50, 100.0);
    let d = plan_mlq(&st, &cfg, &mlq, &tight(16, 100.0, &none));
    assert!(!d.all_fit);
    assert_eq!(d.overdue, vec![SeqId(2)]);
    assert_eq!(d.admit_ids[..2], [SeqId(2), SeqId(1)], "{d:?}");
    // An overdue request that does not fit keeps the step for itself.
    add(&mut st, &mut mlq, &cfg, 3, 240, 16, 0.0);
    let d = plan_mlq(&st, &cfg, &mlq, &tight(16, 100.0, &none));
    assert_eq!(d.reserved_for, Some(SeqId(3)));
    assert_eq!(d.admit_ids, vec![SeqId(2)], "{d:?}");
}

#[test]
fn a_request_to_wait_without_blocking_is_passed_over() {
    let cfg = cfg();
    let (mut st, mut mlq) = two_queues(&cfg);
    for id in 1..=4 {
        add(&mut st, &mut mlq, &cfg, id, 1, 2, 1.0);
    }
    let none = |_: &SeqState| None;
    let fetching = |s: &SeqState| s.id == SeqId(1);
    let inp = MlqInputs {
        later: &fetching,
        ..tight(17, 1.0, &none)
    };
    let d = plan_mlq(&st, &cfg, &mlq, &inp);
    assert!(d.all_fit);
    assert_eq!(d.admit_ids, vec![SeqId(2), SeqId(3), SeqId(4)]);
    // Under contention too (a long request whose first chunk does not fit the KV): the lane
    // stays open.
    add(&mut st, &mut mlq, &cfg, 5, 200, 60, 1.0);
    let inp = MlqInputs {
        later: &fetching,
        ..tight(17, 1.0, &none)
    };
    let d = plan_mlq(&st, &cfg, &mlq, &inp);
    assert!(!d.all_fit);
    assert_eq!(d.admit_ids, vec![SeqId(2), SeqId(3), SeqId(4)], "{d:?}");
}

#[test]
fn the_tpot_cap_refuses_a_rank_that_would_slow_the_decode_batch_past_the_slo() {
    let cfg = cfg();
    let mut mlq = Mlq::new(MlqConfig::default(), 256);
    let mut st = SchedState::default();
    add(&mut st, &mut mlq, &cfg, 1, 4, 20, 0.0);
    st.admit(1, &cfg);
    st.on_step(&[(SeqId(1), 4)], &[SeqId(1)], &[], &cfg);
    add(&mut st, &mut mlq, &cfg, 2, 4, 20, 0.0);
    add(&mut st, &mut mlq, &cfg, 3, 4, 20, 0.0);
    let model = PerfModel {
        lora_sgmv_s: 1e-5,
        lora_bgmv_s: 1e-5,
        num_layers: 1,
        ..Default::default()
    };
    let rank = |s: &SeqState| Some(if s.id == SeqId(2) { 128 } else { 8 });
    let none = |_: &SeqState| None;
    let mut shape = crate::perf::StepShape::default();
    shape.add(1, true, Some(8));
    shape.add(1, true, Some(8));
    let slo = model.predict(&shape) * 1.01;
    let inp = MlqInputs {
        tpot: Some(TpotCap {
            model: &model,
            slo_s: slo,
            step_budget_s: slo,
            rank: &rank,
        }),
        ..plain(cfg.total_blocks, 0.0, &none)
    };
    let d = plan_mlq(&st, &cfg, &mlq, &inp);
    assert_eq!(
        d.admit_ids,
        vec![],
        "the rank-128 head blocks its queue: {d:?}"
    );
    assert!(st.remove(SeqId(2), &cfg));
    let d = plan_mlq(&st, &cfg, &mlq, &inp);
    assert_eq!(d.admit_ids, vec![SeqId(3)]);
    assert_eq!(
        d.decision.plan.items[1].num_tokens, 1,
        "its prefill chunk is cut to what the SLO leaves"
    );
    // Running requests with slack (fast steps so far) let the whole prompt in one step:
    // cutting it would only add a step to every decoder's time.
    let mut both = crate::perf::StepShape::default();
    both.add(1, true, Some(8));
    both.add(4, false, Some(8));
    let inp = MlqInputs {
        tpot: Some(TpotCap {
            model: &model,
            slo_s: slo,
            step_budget_s: model.predict_interval(&both),
            rank: &rank,
        }),
        ..plain(cfg.total_blocks, 0.0, &none)
    };
    let d = plan_mlq(&st, &cfg, &mlq, &inp);
    assert_eq!(d.admit_ids, vec![SeqId(3)]);
    assert_eq!(d.decision.plan.items[1].num_tokens, 4, "{d:?}");
}

/// Pages adapters hold in the simulated pool, a phase every [`ADAPTER_PERIOD`] steps.
const ADAPTER_PAGES: [usize; 3] = [0, 3, 7];
const ADAPTER_PERIOD: usize = 5;

/// Pages of an absent adapter charged to request `i`'s quota (its adapter must be loaded).
fn adapter_charge(i: usize) -> usize {
    [0, 2, 5][i % 3]
}

/// One request of a generated workload: prompt, max tokens, early stop, arrival step,
/// its adapter blocked until this step.
type Req = (usize, usize, usize, usize, usize);

fn simulate(reqs: &[Req], cfg: SchedConfig, mc: MlqConfig) -> Result<(), TestCaseError> {
    let mut mlq = Mlq::new(mc, cfg.total_blocks * cfg.block_size);
    let mut st = SchedState::default();
    let mut arrived = vec![None; reqs.len()];
    let mut admitted = vec![None; reqs.len()];
    let mut bypasses = vec![0usize; reqs.len()];
    let mut done = 0;
    let max_size = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| (cfg.blocks_for(r.0 + r.1) + adapter_charge(i)) * cfg.block_size)
        .max()
        .unwrap_or(0);
    let work: usize = reqs.iter().map(|r| r.0 + r.1).sum();
    let mut t = 0usize;
    while done < reqs.len() {
        prop_assert!(t < 20_000, "no progress: {st:?}");
        for (i, r) in reqs.iter().enumerate() {
            if r.3 == t {
                let s = SeqState::new(SeqId(i as u64), r.0, r.1);
                let size = (s.worst_case_blocks(&cfg) + adapter_charge(i)) * cfg.block_size;
                let req = RequestSize {
                    input: r.0,
                    predicted_output: r.1 / 2,
                    rank: 8 << (i % 4),
                    load_s: 0.0,
                };
                mlq.enqueue(s.id, &req, size, (r.0 + r.1) as f64, t as f64);
                st.enqueue(s);
                arrived[i] = Some(t);
            }
        }
        let now = t;
        // Until its step, an even request blocks its queue (the memory layer's head), an
        // odd one waits without blocking (its fetch in flight).
        let blocked = |s: &SeqState| {
            let r = reqs[s.id.0 as usize];
            (r.4 > now && s.id.0.is_multiple_of(2)).then(|| (r.4 - now) as f64)
        };
        let later = |s: &SeqState| reqs[s.id.0 as usize].4 > now && s.id.0 % 2 == 1;
        let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
        // Adapters come and go in the same pool: what KV may hold moves (never below what is
        // held: idle adapters are evicted before KV is preempted). The quotas split the whole
        // pool, since sizes charge absent adapters' pages as well as KV.
        let adapters = ADAPTER_PAGES[(t / ADAPTER_PERIOD) % ADAPTER_PAGES.len()];
        let kv_capacity = (cfg.total_blocks - adapters).max(used);
        // Blocks on demand: whoever cannot get its next blocks is preempted first.
        let run = crate::scheduler::runners(&st, &cfg, |s| s.held_blocks(&cfg));
        for id in crate::scheduler::choose_preemptions(&run, kv_capacity - used) {
            prop_assert!(st.preempt(id, &cfg));
        }
        let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
        mlq.set_capacity(cfg.total_blocks * cfg.block_size);
        prop_assert_eq!(
            mlq.quotas().iter().map(|q| q.tokens).sum::<usize>(),
            cfg.total_blocks * cfg.block_size,
            "quotas split the whole pool"
        );
        let inp = MlqInputs {
            kv_capacity,
            later: &later,
            ..plain(kv_capacity - used, t as f64, &blocked)
        };
        // The P99 rule (`mlq_protect`): the oldest large request, due once it has waited the
        // steps the running batch needs (at most its max tokens each) to free its reservation.
        let protect = if mc.protect {
            let waiters: Vec<Waiter> = st
                .waiting
                .iter()
                .map(|s| Waiter {
                    id: s.id,
                    arrived_s: mlq.entry(s.id).unwrap().arrived_s,
                    queue: mlq.queue(s.id),
                })
                .collect();
            let holds: Vec<Hold> = st
                .running
                .iter()
                .map(|s| Hold {
                    steps: predicted_steps(s, &cfg),
                    blocks: s.reservation(&cfg),
                })
                .collect();
            let free = kv_capacity.saturating_sub(st.reserved_blocks);
            let need = |id: SeqId| {
                st.waiting
                    .iter()
                    .find(|s| s.id == id)
                    .unwrap()
                    .reservation(&cfg)
            };
            protected(&waiters, t as f64, |id| {
                fit_steps(free, &holds, need(id)).map_or(0.0, |n| n as f64)
            })
        } else {
            None
        };
        mlq.set_protected(protect);
        let d = plan_mlq(&st, &cfg, &mlq, &inp);
        if let Some(p) = protect {
            let s = st.waiting.iter().find(|s| s.id == p).unwrap();
            let oldest = st
                .waiting
                .iter()
                .all(|w| mlq.entry(w.id).unwrap().arrived_s >= mlq.entry(p).unwrap().arrived_s);
            prop_assert!(oldest && mlq.queue(p) > 0, "only the oldest large one");
            // Placeable: it goes first, or nothing else is admitted past it.
            if blocked(s).is_none() && !later(s) {
                // Admitted in the same step as everything else is not passed either (a
                // preempted request back in the queue can stand before it).
                prop_assert!(
                    d.admit_ids.first() == Some(&p)
                        || (d.all_fit && d.admit_ids.contains(&p))
                        || (d.reserved_for == Some(p) && d.admit_ids.len() == d.overdue.len())
                        || d.admit_ids.is_empty(),
                    "the protected request was passed: {d:?}"
                );
            }
        }
        let items = &d.decision.plan.items;
        prop_assert!(
            items.iter().map(|i| i.num_tokens).sum::<usize>() <= cfg.max_num_batched_tokens
        );
        prop_assert!(items.len() <= cfg.max_num_seqs);
        prop_assert!(
            st.running.len() + d.admit_ids.len() <= cfg.max_num_seqs,
            "seats"
        );
        // Quotas: phase 1 keeps each queue within its quota (or one request, when it held
        // nothing); phase 2 spends no more than the spare.
        let size = |id: SeqId| mlq.entry(id).map_or(0, |e| e.size);
        if d.reserved_for.is_some() {
            prop_assert_eq!(
                d.admit_ids.len(),
                d.overdue.len(),
                "nothing after a reservation"
            );
        } else if !d.all_fit {
            let n0 = d.overdue.len();
            let n1: usize = d.phase1.iter().sum();
            let mut it = d.admit_ids[n0..].iter();
            for q in 0..mlq.num_queues() {
                let got: usize = it.by_ref().take(d.phase1[q]).map(|&id| size(id)).sum();
                let quota = mlq.quotas()[q].tokens;
                let over: usize = d
                    .overdue
                    .iter()
                    .filter(|&&id| mlq.queue(id) == q)
                    .map(|&id| size(id))
                    .sum();
                prop_assert!(
                    d.held_before[q] + over + got <= quota.max(max_size) || d.phase1[q] == 0,
                    "queue {q} over quota: {d:?}"
                );
            }
            let p2: usize = d.admit_ids[n0 + n1..].iter().map(|&id| size(id)).sum();
            prop_assert!(p2 <= d.spare, "phase 2 over the spare: {d:?}");
        } else {
            prop_assert!(d.overdue.is_empty() && d.bypassed.is_empty());
        }
        for &(h, n) in &d.bypassed {
            bypasses[h.0 as usize] += n;
            prop_assert!(bypasses[h.0 as usize] <= mlq.cfg.max_bypass, "bypass bound");
            prop_assert!(blocked(st.waiting.iter().find(|s| s.id == h).unwrap()).is_some());
        }
        for id in &d.admit_ids {
            admitted[id.0 as usize].get_or_insert(t);
            let s = st.waiting.iter().find(|s| s.id == *id).unwrap();
            prop_assert!(
                blocked(s).is_none() && !later(s),
                "a blocked request was admitted"
            );
        }
        apply(&mut st, &mut mlq, &cfg, &d);
        let planned: Vec<_> = items.iter().map(|i| (i.seq, i.num_tokens)).collect();
        let (mut sampled, mut finished) = (Vec::new(), Vec::new());
        for it in items {
            let s = st.running.iter().find(|s| s.id == it.seq).unwrap();
            prop_assert!(it.num_tokens <= s.pending());
            if s.computed + it.num_tokens == s.total_tokens {
                sampled.push(it.seq);
                let generated = s.total_tokens + 1 - s.prompt_len;
                let r = reqs[it.seq.0 as usize];
                if generated >= r.1 || generated == r.2 {
                    finished.push(it.seq);
                    mlq.remove(it.seq);
                    done += 1;
                }
            }
        }
        st.on_step(&planned, &sampled, &finished, &cfg);
        let used: usize = st.running.iter().map(|s| cfg.blocks_for(s.computed)).sum();
        prop_assert!(used <= kv_capacity, "KV over-committed after the step");
        t += 1;
    }
    // The starvation bound: nobody waits past max_wait plus the time to drain everything
    // ahead of it, its adapter's block and one cycle of the adapters' pages.
    for (i, r) in reqs.iter().enumerate() {
        let wait = admitted[i].unwrap() - arrived[i].unwrap();
        let memory = ADAPTER_PERIOD * ADAPTER_PAGES.len();
        let bound = mc.max_wait_s.ceil() as usize + r.4.saturating_sub(r.3) + work + memory;
        prop_assert!(wait <= bound, "request {i} waited {wait} > {bound}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Token budget, seats and KV never exceeded, quotas and the bypass bound respected,
    /// every request (each fits the cache alone) served — nothing FIFO serves is refused.
    #[test]
    fn mlq_serves_everything_within_limits(
        reqs in proptest::collection::vec(
            (1usize..60, 1usize..40, 1usize..45, 0usize..60, 0usize..80), 1..40),
        budget in 1usize..64,
        seqs in 1usize..8,
        max_wait in 5.0f64..50.0,
        max_bypass in 0usize..4,
        protect in any::<bool>(),
    ) {
        let cfg = SchedConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            block_size: 4,
            total_blocks: 40,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
        };
        let reqs: Vec<Req> = reqs
            .into_iter()
            .filter(|r| cfg.blocks_for(r.0 + r.1) <= cfg.total_blocks)
            .map(|r| (r.0, r.1, r.2, r.3, if r.4 % 3 == 0 { r.3 + r.4 } else { 0 }))
            .collect();
        let mc = MlqConfig {
            warmup: 6,
            refit_every_s: 15.0,
            max_wait_s: max_wait,
            max_bypass,
            protect,
            weights: crate::scheduler::WrsWeights { max_input: 64, max_output: 64, ..Default::default() },
            ..Default::default()
        };
        simulate(&reqs, cfg, mc)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Work conservation: when `fcfs` would admit every placeable waiting request (the
    /// waiting set fits the KV, the seats and the token budget), the multi-level queue admits
    /// all of them too, in the same (arrival) order, whatever its queues and quotas; requests
    /// to wait without blocking are passed over by both.
    #[test]
    fn mlq_admits_everything_that_fits_as_fcfs_does(
        reqs in proptest::collection::vec((1usize..60, 1usize..40, any::<bool>()), 1..24),
        running in 0usize..6,
        budget in 1usize..256,
        seqs in 1usize..16,
        blocks in 8usize..200,
        warmup in 1usize..12,
    ) {
        let cfg = SchedConfig {
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            block_size: 4,
            total_blocks: blocks,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
        };
        let mc = MlqConfig {
            warmup,
            weights: crate::scheduler::WrsWeights { max_input: 64, max_output: 64, ..Default::default() },
            ..Default::default()
        };
        let mut mlq = Mlq::new(mc, cfg.total_blocks * cfg.block_size);
        let mut st = SchedState::default();
        for (i, r) in reqs.iter().enumerate() {
            add(&mut st, &mut mlq, &cfg, i as u64, r.0, r.1, i as f64 * 0.1);
        }
        // The first ones already run (as fcfs admitted them).
        let first = crate::scheduler::plan_step(&st, &cfg, cfg.total_blocks);
        let n = first.admit.min(running);
        let ids: Vec<SeqId> = st.waiting.iter().take(n).map(|s| s.id).collect();
        st.admit_ids(&ids, &cfg);
        // The engine's free KV: nothing is computed yet, so every block (reservations are
        // promises, not allocations; with fewer free blocks the running prefills' order,
        // which the queues change, decides which chunks fit, and the totals differ).
        let free = cfg.total_blocks;
        let later = |s: &SeqState| reqs[s.id.0 as usize].2;
        let placeable: Vec<SeqId> =
            st.waiting.iter().filter(|s| !later(s)).map(|s| s.id).collect();
        let fcfs = crate::scheduler::plan_step_admitting(
            &st, &cfg, free, &|_, _| Gate::Go, &placeable, cfg.total_blocks,
        );
        let none = |_: &SeqState| None;
        let inp = MlqInputs {
            kv_capacity: cfg.total_blocks,
            later: &later,
            ..plain(free, 10.0, &none)
        };
        let d = plan_mlq(&st, &cfg, &mlq, &inp);
        if fcfs.admit.len() == placeable.len() {
            prop_assert!(d.all_fit, "{d:?}");
            prop_assert_eq!(&d.admit_ids, &fcfs.admit);
            let tokens = |items: &[thaw_runtime::engine::PlanItem]| {
                items.iter().map(|i| i.num_tokens).sum::<usize>()
            };
            prop_assert_eq!(tokens(&d.decision.plan.items), tokens(&fcfs.plan.items));
        } else {
            prop_assert!(!d.all_fit);
        }
        prop_assert!(d.admit_ids.iter().all(|id| placeable.contains(id)));
    }
}
