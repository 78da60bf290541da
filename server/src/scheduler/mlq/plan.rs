//! Chameleon's non-preemptive multi-level queue (§4.2) as a pure policy beside
//! [`crate::scheduler::plan_step_gated`]: requests sit in queues by weighted request size;
//! every step each queue admits from its head within its token quota ("Initial Request
//! Admission"),
//! then the quota every queue left unused is offered to the queues that still have requests,
//! from the smallest requests' queue down ("Redistribution of Spare Resources"; "if requests
//! from a given queue still cannot be admitted due to insufficient tokens available, no
//! additional resources are allocated to that queue"). All queues get into every step, so the
//! short requests' lane is never blocked behind a long head and long requests do not starve.
//!
//! Work-conserving: the quotas only order the queues when they contend. When every request
//! waiting that can be placed fits the step (KV, seats, token budget, TPOT cap) and none waits
//! on memory, all are admitted in arrival order, exactly as `fcfs` would; a queue's unused
//! quota (a head that does not fit the KV, an empty queue) goes to the others in phase 2.
//!
//! Bypass ("Bypassing Adapter Blocking"): the memory layer's head that waits for memory
//! ([`MlqInputs::adapter_wait`]) blocks its queue, except that younger requests of that queue
//! may pass it "only if the admitted request will not exceed the waiting time for the request
//! at the head" — its predicted service time is within the head's predicted wait — and at
//! most [`MlqConfig::max_bypass`] times per head. Thaw does not squash a mispredicted
//! bypasser (non-preemptive throughout); the per-head bound is what limits the harm. A request
//! the memory layer cannot place for another reason ([`MlqInputs::later`]: its adapter's fetch
//! is in flight, or it is behind that head and the memory layer's own bypass rule holds it)
//! is passed over without blocking its queue, as `fcfs` passes it: the memory layer only
//! lets through requests that do not delay its head.
//!
//! Starvation bound: requests that have waited [`MlqConfig::max_wait_s`] (and that can be
//! placed) are admitted before anything else, oldest first; if one does not fit, nothing else
//! is admitted until it does, so it waits at most that, plus its adapter's wait, plus the time
//! the running set needs to make room for it.
//!
//! Borrowed quota comes back only when the borrower finishes (non-preemptive), so a lane lent
//! away can be closed to its own requests for that long. [`MlqConfig::keep_min`] keeps each
//! queue's queueing-model minimum back; it is off by default (the paper lends all), since
//! with a KV cache of only a few large requests the kept minima serialise the large ones.
//!
//! Rank-aware cap (CaraServe §5): with a TPOT SLO, a new request is admitted only if the
//! predicted decode step with it stays within the SLO, and prefill chunks are cut so the
//! predicted step stays within the running requests' slack ([`TpotCap::step_budget_s`]; a
//! step alone is never cut to nothing).
use thaw_runtime::engine::StepPlan;
use thaw_runtime::ids::SeqId;

use super::room::{Refusal, Room};
use super::state::Mlq;
use crate::perf::{PerfModel, StepShape};
use crate::scheduler::policy::{Decision, Gate};
use crate::scheduler::state::{SchedConfig, SchedState, SeqState};

/// The rank-aware cap's inputs.
pub struct TpotCap<'a> {
    pub model: &'a PerfModel,
    /// A new request is admitted only if the decode step with it stays within this.
    pub slo_s: f64,
    /// Prefill chunks are cut so the predicted step stays within this
    /// ([`super::tpot::step_budget_s`]: the running requests' slack, at least `slo_s`).
    pub step_budget_s: f64,
    pub rank: &'a dyn Fn(&SeqState) -> Option<usize>,
}

/// What the multi-level queue plans a step from besides the scheduler state.
pub struct MlqInputs<'a> {
    /// The engine's free KV blocks now.
    pub free_blocks: usize,
    /// KV blocks all reservations may total (the cache less what adapters hold).
    pub kv_capacity: usize,
    pub now_s: f64,
    /// The cold-start gate, as for [`crate::scheduler::plan_step_gated`].
    pub gate: &'a dyn Fn(&SeqState, usize) -> Gate,
    /// `Some(predicted seconds until it can be placed)` for a request that cannot be placed
    /// now and blocks its queue (the memory layer's head waiting for memory).
    pub adapter_wait: &'a dyn Fn(&SeqState) -> Option<f64>,
    /// A request that cannot be placed now but does not block its queue (see the module
    /// note): it is skipped.
    pub later: &'a dyn Fn(&SeqState) -> bool,
    pub tpot: Option<TpotCap<'a>>,
}

impl MlqInputs<'_> {
    /// Neither blocked nor deferred: admission may place it now.
    fn placeable(&self, s: &SeqState) -> bool {
        (self.adapter_wait)(s).is_none() && !(self.later)(s)
    }
}

/// A step's plan and how the queues got there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlqDecision {
    /// The step's plan; `decision.admit` is `admit_ids.len()`: apply with
    /// [`SchedState::admit_ids`].
    pub decision: Decision,
    pub admit_ids: Vec<SeqId>,
    /// Everything placeable fitted: admitted in arrival order, no quotas applied.
    pub all_fit: bool,
    /// Per queue: admitted in phase 1, admitted in phase 2.
    pub phase1: Vec<usize>,
    pub phase2: Vec<usize>,
    /// Per queue: quota held by running requests before this step.
    pub held_before: Vec<usize>,
    /// Spare quota phase 2 started with.
    pub spare: usize,
    /// Adapter-blocked heads and how many requests passed each this step.
    pub bypassed: Vec<(SeqId, usize)>,
    /// Requests past the starvation bound admitted first (the head of `admit_ids`).
    pub overdue: Vec<SeqId>,
    /// A request past the starvation bound that did not fit: this step admits nothing else.
    pub reserved_for: Option<SeqId>,
}
/// Plans one step under the multi-level queue.
pub fn plan_mlq(
    state: &SchedState,
    cfg: &SchedConfig,
    mlq: &Mlq,
    inp: &MlqInputs<'_>,
) -> MlqDecision {
    let k = mlq.num_queues();
    let mut room = Room {
        cfg,
        budget: cfg.max_num_batched_tokens,
        free: inp.free_blocks,
        reserved: state.reserved_blocks,
        kv_capacity: inp.kv_capacity,
        seqs: state.running.len(),
        decode: StepShape::default(),
        step: StepShape::default(),
        items: Vec::new(),
        admit_ids: Vec::new(),
    };
    let mut held = vec![0usize; k];
    for s in &state.running {
        held[mlq.queue(s.id)] += mlq.entry(s.id).map_or(0, |e| e.size);
        let r = room.rank(inp, s);
        room.decode.add(1, true, r);
    }
    // Running sequences: decode first (one token each), then prefill chunks, the fast
    // lane's first.
    for s in state.running.iter().filter(|s| !s.in_prefill()) {
        if room.budget == 0 || room.items.len() >= cfg.max_num_seqs {
            break;
        }
        if s.blocks_needed(cfg, 1) <= room.free {
            room.push(inp, s, 1, true);
        }
    }
    let mut prefill: Vec<&SeqState> = state.running.iter().filter(|s| s.in_prefill()).collect();
    prefill.sort_by_key(|s| mlq.queue(s.id));
    for s in prefill {
        if room.budget == 0 || room.items.len() >= cfg.max_num_seqs {
            break;
        }
        let mut n = s.pending().min(room.budget);
        match (inp.gate)(s, cfg.max_num_batched_tokens - room.budget) {
            Gate::Go => {}
            Gate::Hold => continue,
            Gate::Cap(c) => n = n.min(c),
        }
        n = room.tpot_rows(inp, s, n);
        if n == 0 || s.blocks_needed(cfg, n) > room.free {
            continue;
        }
        room.push(inp, s, n, false);
    }

    let mut out = MlqDecision {
        held_before: held.clone(),
        phase1: vec![0; k],
        phase2: vec![0; k],
        ..Default::default()
    };
    // No contention: everything placeable fits, admitted as fcfs would (arrival order).
    if state
        .waiting
        .iter()
        .all(|s| (inp.adapter_wait)(s).is_none())
    {
        let mut all = room.clone();
        let fits = state
            .waiting
            .iter()
            .filter(|s| !(inp.later)(s))
            .all(|s| all.admit(inp, s).is_ok());
        if fits {
            out.all_fit = true;
            return finish(out, all);
        }
    }
    let size = |s: &SeqState| mlq.entry(s.id).map_or(0, |e| e.size);
    // The starvation bound and the protected request (`mlq_protect`): overdue requests
    // first, oldest first; one that does not fit keeps the step for itself.
    let arrived = |s: &SeqState| mlq.entry(s.id).map_or(f64::INFINITY, |e| e.arrived_s);
    let mut overdue: Vec<&SeqState> = state
        .waiting
        .iter()
        .filter(|s| mlq.goes_first(s.id, inp.now_s) && inp.placeable(s))
        .collect();
    overdue.sort_by(|a, b| arrived(a).total_cmp(&arrived(b)));
    for s in overdue {
        if room.admit(inp, s).is_err() {
            out.reserved_for = Some(s.id);
            return finish(out, room);
        }
        held[mlq.queue(s.id)] += size(s);
        out.overdue.push(s.id);
    }
    let queues: Vec<Vec<&SeqState>> = (0..k)
        .map(|q| {
            state
                .waiting
                .iter()
                .filter(|s| mlq.queue(s.id) == q)
                .collect()
        })
        .collect();
    let mut taken = vec![0usize; k];
    let mut full = false;
    // Phase 1: each queue within its own quota (a queue holding nothing may always admit its
    // head, so a request larger than its queue's quota is not stuck on quota alone).
    for q in 0..k {
        if full {
            break;
        }
        let quota = mlq.quotas()[q].tokens;
        let mut h = held[q];
        let r = scan(
            &queues[q],
            &mut taken[q],
            mlq,
            inp,
            &mut room,
            &mut out,
            |s, commit| {
                if commit {
                    h += size(s);
                }
                h == 0 || h + size(s) <= quota
            },
        );
        out.phase1[q] = r.0;
        held[q] = h;
        full = r.1;
    }
    // Phase 2: every queue's unused quota (with `keep_min`, less its minimum, so lending
    // never closes a lane), offered top down to the queues with requests left.
    let mut spare: usize = (0..k)
        .map(|q| {
            let quota = mlq.quotas()[q];
            let kept = if mlq.cfg.keep_min { quota.min } else { 0 };
            quota.tokens.saturating_sub(held[q].max(kept))
        })
        .sum();
    out.spare = spare;
    for q in 0..k {
        if full || spare == 0 {
            break;
        }
        if taken[q] == queues[q].len() {
            continue;
        }
        let r = scan(
            &queues[q],
            &mut taken[q],
            mlq,
            inp,
            &mut room,
            &mut out,
            |s, commit| {
                if commit {
                    spare -= size(s);
                }
                size(s) <= spare
            },
        );
        out.phase2[q] = r.0;
        full = r.1;
    }
    finish(out, room)
}

/// Admits from the queue `reqs` past its first `*taken` while the quota and the room allow,
/// with the bypass rule for an adapter-blocked head; requests that are to wait without
/// blocking ([`MlqInputs::later`]) are passed over. `quota(s, false)` asks whether `s` fits
/// the quota; `quota(s, true)` charges it once admitted. Returns (admitted, full).
fn scan(
    reqs: &[&SeqState],
    taken: &mut usize,
    mlq: &Mlq,
    inp: &MlqInputs<'_>,
    room: &mut Room<'_>,
    out: &mut MlqDecision,
    mut quota: impl FnMut(&SeqState, bool) -> bool,
) -> (usize, bool) {
    let mut n = 0;
    let mut head: Option<(SeqId, f64, usize)> = None; // blocked head, its wait, bypasses left
    let mut i = *taken;
    while i < reqs.len() {
        let s = reqs[i];
        if room.admit_ids.contains(&s.id) || (head.is_none() && (inp.later)(s)) {
            if head.is_none() && *taken == i {
                *taken = i + 1;
            }
            i += 1;
            continue;
        }
        let e = mlq.entry(s.id);
        if let Some(w) = (inp.adapter_wait)(s) {
            if head.is_none() {
                // Bypasses of earlier steps and of this step's phase 1.
                let used = e.map_or(0, |e| e.bypassed)
                    + out.bypassed.iter().find(|b| b.0 == s.id).map_or(0, |b| b.1);
                head = Some((s.id, w, mlq.cfg.max_bypass.saturating_sub(used)));
            }
            i += 1;
            continue;
        }
        if (inp.later)(s) {
            i += 1;
            continue;
        }
        if let Some((_, wait, left)) = head {
            let service = e.map_or(f64::INFINITY, |e| e.service_s);
            if left == 0 || service > wait {
                break;
            }
        }
        if !quota(s, false) {
            break;
        }
        match room.admit(inp, s) {
            Ok(()) => {
                n += 1;
                quota(s, true);
                match &mut head {
                    Some((id, _, left)) => {
                        *left -= 1;
                        match out.bypassed.iter_mut().find(|b| b.0 == *id) {
                            Some(b) => b.1 += 1,
                            None => out.bypassed.push((*id, 1)),
                        }
                    }
                    None => *taken = i + 1,
                }
            }
            Err(Refusal::Full) => return (n, true),
            Err(Refusal::Blocked) => break,
        }
        i += 1;
    }
    (n, false)
}

fn finish(mut out: MlqDecision, room: Room<'_>) -> MlqDecision {
    out.decision = Decision {
        admit: room.admit_ids.len(),
        plan: StepPlan {
            items: room.items,
            return_logits: false,
        },
    };
    out.admit_ids = room.admit_ids;
    out
}
