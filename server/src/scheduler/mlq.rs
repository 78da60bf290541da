//! Chameleon's non-preemptive multi-level queue (§4.2) as a pure policy beside
//! [`super::plan_step_gated`]: requests sit in queues by weighted request size; every step
//! each queue admits from its head within its token quota ("Initial Request Admission"),
//! then the quota left unused by queues with nothing more to admit is offered to the others
//! from the smallest requests' queue down ("Redistribution of Spare Resources"; "if requests
//! from a given queue still cannot be admitted due to insufficient tokens available, no
//! additional resources are allocated to that queue"). All queues get into every step, so the
//! short requests' lane is never blocked behind a long head and long requests do not starve.
//!
//! Bypass ("Bypassing Adapter Blocking"): a head whose adapter cannot be placed now blocks
//! its queue, except that younger requests of that queue may pass it "only if the admitted
//! request will not exceed the waiting time for the request at the head" — its predicted
//! service time is within the head's predicted wait — and at most
//! [`MlqConfig::max_bypass`] times per head. Thaw does not squash a mispredicted bypasser
//! (non-preemptive throughout); the per-head bound is what limits the harm.
//!
//! Starvation bound: a request that has waited [`MlqConfig::max_wait_s`] (and whose adapter
//! can be placed) is admitted before anything else and nothing else is admitted until it is,
//! so it waits at most that, plus its adapter's wait, plus the time the running set needs to
//! make room for it.
//!
//! Borrowed quota comes back only when the borrower finishes (non-preemptive), so a lane lent
//! away can be closed to its own requests for that long. [`MlqConfig::keep_min`] keeps each
//! idle queue's queueing-model minimum back; it is off by default (the paper lends all), since
//! with a KV cache of only a few large requests the kept minima serialise the large ones.
//!
//! Rank-aware cap (CaraServe §5): with a TPOT SLO, a new request is admitted only if the
//! predicted decode step with it stays within the SLO, and prefill chunks are cut so the
//! predicted step does (a step alone is never cut to nothing).
use thaw_runtime::engine::{PlanItem, StepPlan};
use thaw_runtime::ids::SeqId;

use super::mlq_state::Mlq;
use super::policy::{Decision, Gate};
use super::state::{SchedConfig, SchedState, SeqState};
use crate::perf::{PerfModel, StepShape};

/// The rank-aware cap's inputs.
pub struct TpotCap<'a> {
    pub model: &'a PerfModel,
    pub slo_s: f64,
    pub rank: &'a dyn Fn(&SeqState) -> Option<usize>,
}

/// What the multi-level queue plans a step from besides the scheduler state.
pub struct MlqInputs<'a> {
    /// The engine's free KV blocks now.
    pub free_blocks: usize,
    /// KV blocks all reservations may total (the cache less what adapters hold).
    pub kv_capacity: usize,
    pub now_s: f64,
    /// The cold-start gate, as for [`super::plan_step_gated`].
    pub gate: &'a dyn Fn(&SeqState, usize) -> Gate,
    /// `Some(predicted seconds until it can be placed)` for a request whose adapter cannot
    /// be placed now.
    pub adapter_wait: &'a dyn Fn(&SeqState) -> Option<f64>,
    pub tpot: Option<TpotCap<'a>>,
}

/// A step's plan and how the queues got there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlqDecision {
    /// The step's plan; `decision.admit` is `admit_ids.len()`: apply with
    /// [`SchedState::admit_ids`].
    pub decision: Decision,
    pub admit_ids: Vec<SeqId>,
    /// Per queue: admitted in phase 1, admitted in phase 2.
    pub phase1: Vec<usize>,
    pub phase2: Vec<usize>,
    /// Per queue: quota held by running requests before this step.
    pub held_before: Vec<usize>,
    /// Spare quota phase 2 started with.
    pub spare: usize,
    /// Adapter-blocked heads and how many requests passed each this step.
    pub bypassed: Vec<(SeqId, usize)>,
    /// A request past the starvation bound that this step was reserved for.
    pub overdue: Option<SeqId>,
}

/// Why a waiting request was not admitted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Refusal {
    /// No seat or no token left: nothing else can be admitted this step.
    Full,
    /// It does not fit (KV, quota, SLO): its queue waits behind it.
    Blocked,
}

/// The step being built.
struct Room<'a> {
    cfg: &'a SchedConfig,
    budget: usize,
    free: usize,
    reserved: usize,
    kv_capacity: usize,
    seqs: usize,
    /// One decode row per running or admitted sequence: the next steps' decode batch.
    decode: StepShape,
    step: StepShape,
    items: Vec<PlanItem>,
    admit_ids: Vec<SeqId>,
}

impl Room<'_> {
    fn rank(&self, inp: &MlqInputs<'_>, s: &SeqState) -> Option<usize> {
        inp.tpot.as_ref().and_then(|t| (t.rank)(s))
    }

    /// Prefill rows of `s` the TPOT cap allows out of `n`.
    fn tpot_rows(&self, inp: &MlqInputs<'_>, s: &SeqState, n: usize) -> usize {
        match &inp.tpot {
            Some(t) if !self.items.is_empty() && n > 0 => {
                t.model
                    .max_rows_within(&self.step, self.rank(inp, s), false, t.slo_s, n)
            }
            _ => n,
        }
    }

    fn push(&mut self, inp: &MlqInputs<'_>, s: &SeqState, n: usize, decode: bool) {
        let r = self.rank(inp, s);
        self.step.add(n, decode, r);
        self.budget -= n;
        self.free -= s.blocks_needed(self.cfg, n);
        self.items.push(PlanItem {
            seq: s.id,
            num_tokens: n,
        });
    }

    /// Tries to admit waiting `s` (whose quota the caller checked).
    fn admit(&mut self, inp: &MlqInputs<'_>, s: &SeqState) -> Result<(), Refusal> {
        if self.budget == 0 || self.seqs >= self.cfg.max_num_seqs {
            return Err(Refusal::Full);
        }
        let r = s.reservation(self.cfg);
        if self.reserved + r > self.kv_capacity {
            return Err(Refusal::Blocked);
        }
        if let Some(t) = &inp.tpot {
            let mut d = self.decode;
            d.add(1, true, (t.rank)(s));
            if self.seqs > 0 && t.model.predict(&d) > t.slo_s {
                return Err(Refusal::Blocked);
            }
        }
        let mut n = s.pending().min(self.budget);
        match (inp.gate)(s, self.cfg.max_num_batched_tokens - self.budget) {
            Gate::Go => {}
            Gate::Hold => n = 0,
            Gate::Cap(c) => n = n.min(c),
        }
        n = self.tpot_rows(inp, s, n);
        if s.blocks_needed(self.cfg, n) > self.free {
            return Err(Refusal::Blocked);
        }
        self.reserved += r;
        self.seqs += 1;
        let rank = self.rank(inp, s);
        self.decode.add(1, true, rank);
        if n > 0 {
            self.push(inp, s, n, false);
        }
        self.admit_ids.push(s.id);
        Ok(())
    }
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
    let size = |s: &SeqState| mlq.entry(s.id).map_or(0, |e| e.size);
    // The starvation bound: the oldest overdue request goes alone.
    let overdue = state
        .waiting
        .iter()
        .filter(|s| {
            mlq.entry(s.id)
                .is_some_and(|e| inp.now_s - e.arrived_s >= mlq.cfg.max_wait_s)
                && (inp.adapter_wait)(s).is_none()
        })
        .min_by(|a, b| {
            let t = |s: &SeqState| mlq.entry(s.id).map_or(0.0, |e| e.arrived_s);
            t(a).total_cmp(&t(b))
        });
    if let Some(s) = overdue {
        out.overdue = Some(s.id);
        let _ = room.admit(inp, s);
        return finish(out, room);
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
    // Phase 2: quota unused by queues with nothing left to admit, offered top down (with
    // `keep_min`, an idle queue keeps its minimum, so lending never closes its lane).
    let mut spare: usize = (0..k)
        .filter(|&q| taken[q] == queues[q].len())
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
/// with the bypass rule for an adapter-blocked head. `quota(s, false)` asks whether `s` fits
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
        if room.admit_ids.contains(&s.id) {
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
