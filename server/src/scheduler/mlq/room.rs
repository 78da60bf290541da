//! The step [`super::plan_mlq`] builds: token budget, seats, KV reservation, free blocks and
//! the rank-aware cap (CaraServe §5) checked per admitted request.
use thaw_runtime::engine::PlanItem;
use thaw_runtime::ids::SeqId;

use super::plan::MlqInputs;
use crate::perf::StepShape;
use crate::scheduler::policy::Gate;
use crate::scheduler::state::{SchedConfig, SeqState};

/// Why a waiting request was not admitted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// No seat or no token left: nothing else can be admitted this step.
    Full,
    /// It does not fit (KV, quota, SLO): its queue waits behind it.
    Blocked,
}

/// The step being built.
#[derive(Clone)]
pub(super) struct Room<'a> {
    pub(super) cfg: &'a SchedConfig,
    pub(super) budget: usize,
    pub(super) free: usize,
    pub(super) reserved: usize,
    pub(super) kv_capacity: usize,
    pub(super) seqs: usize,
    /// One decode row per running or admitted sequence: the next steps' decode batch.
    pub(super) decode: StepShape,
    pub(super) step: StepShape,
    pub(super) items: Vec<PlanItem>,
    pub(super) admit_ids: Vec<SeqId>,
}

impl Room<'_> {
    pub(super) fn rank(&self, inp: &MlqInputs<'_>, s: &SeqState) -> Option<usize> {
        inp.tpot.as_ref().and_then(|t| (t.rank)(s))
    }

    /// Prefill rows of `s` the TPOT cap allows out of `n`.
    pub(super) fn tpot_rows(&self, inp: &MlqInputs<'_>, s: &SeqState, n: usize) -> usize {
        match &inp.tpot {
            Some(t) if !self.items.is_empty() && n > 0 => {
                t.model
                    .max_rows_within(&self.step, self.rank(inp, s), false, t.step_budget_s, n)
            }
            _ => n,
        }
    }

    pub(super) fn push(&mut self, inp: &MlqInputs<'_>, s: &SeqState, n: usize, decode: bool) {
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
    pub(super) fn admit(&mut self, inp: &MlqInputs<'_>, s: &SeqState) -> Result<(), Refusal> {
        if self.budget == 0 || self.seqs >= self.cfg.max_num_seqs {
            return Err(Refusal::Full);
        }
        // On demand: its first chunk's blocks and the watermark (see `plan_step`).
        let r = s.reservation(self.cfg);
        if self.reserved + r + self.cfg.watermark() > self.kv_capacity {
            return Err(Refusal::Blocked);
        }
        if let Some(t) = &inp.tpot {
            let mut d = self.decode;
            d.add(1, true, (t.rank)(s));
            if self.seqs > 0 && t.model.predict_interval(&d) > t.slo_s {
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
        if self.cfg.blocks_for(s.computed + n) + self.cfg.watermark() > self.free {
            return Err(Refusal::Blocked);
        }
        self.reserved += r;
        // Its shared prefix counts too: taking a cached block takes it out of the free pool.
        self.free -= self.cfg.blocks_for(s.computed);
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
