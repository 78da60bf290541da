//! The loop's KV on demand: before each step, KV gets the device budget adapters leave; when
//! the running sequences cannot all get the blocks of their next step, idle adapters are
//! evicted first (cached blocks go on their own: they count as free) and then the newest
//! running sequence of the lowest priority is preempted by recompute
//! ([`crate::scheduler::choose_preemptions`]). Admission sees each waiting request with the
//! prefix the cache holds for it, so it is charged, and planned, only for the rest.
use std::collections::HashSet;
use std::sync::atomic::Ordering;

use thaw_runtime::engine::StepPlan;
use thaw_runtime::ids::{AdapterId, SeqId};

use super::Loop;
use crate::memory::AdmitPlan;
use crate::perf::Tier;
use crate::scheduler::{choose_preemptions, runners, step_needs, SchedState};

impl Loop {
    /// Gives KV the budget adapters leave and makes room for the running sequences' next
    /// step: idle adapters go first, then sequences are preempted.
    pub(super) fn make_room(&mut self) {
        self.engine.set_kv_capacity(self.mem.pool().kv_capacity());
        let need: usize = step_needs(&self.state, &self.cfg)
            .iter()
            .map(|&(_, n)| n)
            .sum();
        let free = self.engine.kv_usage().free_blocks();
        if need <= free {
            return;
        }
        let evict = self.idle_adapters(need - free);
        if !evict.is_empty() {
            let wanted = self.state.waiting_adapters();
            let plan = AdmitPlan {
                evict,
                ..Default::default()
            };
            self.apply_memory(&plan, &wanted);
            self.engine.set_kv_capacity(self.mem.pool().kv_capacity());
        }
        let free = self.engine.kv_usage().free_blocks();
        let engine = &self.engine;
        let run = runners(&self.state, &self.cfg, |s| {
            engine.exclusive_blocks(s.id).unwrap_or(0)
        });
        for id in choose_preemptions(&run, free) {
            self.preempt(id);
        }
    }

    /// Device adapters no live sequence uses, most evictable first, until their pages cover
    /// `deficit` (all of them if they do not).
    fn idle_adapters(&mut self, deficit: usize) -> Vec<AdapterId> {
        let busy: HashSet<AdapterId> = self
            .state
            .running
            .iter()
            .chain(&self.state.waiting)
            .filter(|s| {
                self.live
                    .get(&s.id)
                    .is_some_and(|l| l.running || l.preempted)
            })
            .filter_map(|s| s.adapter)
            .collect();
        let wanted = self.state.waiting_adapters();
        let cost = &self.cold.cost;
        let reload = |tier: Tier, bytes: u64| cost.load_time_from(tier, bytes, 0);
        let view = self.mem.view(&wanted, &reload);
        let mut out = Vec::new();
        let mut pages = 0;
        for &a in view.eviction_order.get() {
            if pages >= deficit {
                break;
            }
            if busy.contains(&a) {
                continue;
            }
            pages += view.adapters.get(&a).map_or(0, |s| s.pages);
            out.push(a);
        }
        out
    }

    /// Preempts running `id` by recompute: its blocks go back, it keeps its place in the
    /// queue (ahead of everyone who came after it), its adapter lease and the tokens it has
    /// streamed.
    fn preempt(&mut self, id: SeqId) {
        if self.engine.preempt_sequence(id).is_err() || !self.state.preempt(id, &self.cfg) {
            return;
        }
        self.sched.preempted(&mut self.state, id);
        if let Some(l) = self.live.get_mut(&id) {
            l.running = false;
            l.preempted = true;
        }
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        tracing::debug!(seq = %id, "preempted: KV blocks given back, to be recomputed");
    }

    /// Running requests that have computed nothing yet share what the cache now holds for
    /// them (a burst admitted together, held while its adapter streams in, finds the blocks
    /// the first of it wrote).
    pub(super) fn reshare_held(&mut self) {
        let mut changed = false;
        for s in self.state.running.iter_mut().filter(|s| s.computed == 0) {
            let cached = self.engine.reshare_prefix(s.id);
            if cached > 0 {
                s.computed = cached;
                changed = true;
                // Reported with the first token only (a resumed request sent it already).
                if let Some(l) = self.live.get_mut(&s.id).filter(|l| l.last_token.is_none()) {
                    l.cached_tokens = l.cached_tokens.max(cached);
                }
            }
        }
        if changed {
            self.state.recount(&self.cfg);
        }
    }

    /// Sets each waiting request admission may take this step to the prefix the cache holds
    /// for it now, so it is planned (and charged) for the rest only.
    pub(super) fn probe_prefixes(&mut self, ids: &[SeqId]) {
        for id in ids {
            let Some(l) = self.live.get(id) else { continue };
            let cached = if l.preempted {
                self.engine.probe_sequence(*id)
            } else {
                l.params.as_ref().map_or(0, |p| {
                    self.engine
                        .probe_prefix(self.engine.prefix_key_for(p), &p.prompt)
                })
            };
            if let Some(s) = self.state.waiting.iter_mut().find(|s| s.id == *id) {
                s.computed = cached;
            }
        }
    }
}

/// After the engine admitted `id` with `cached` tokens found (normally what the probe saw):
/// should the cache have moved under the plan, the scheduler's count follows the engine's and
/// the sequence sits this step out (its planned chunk and blocks no longer match).
pub(super) fn reconcile(state: &mut SchedState, plan: &mut StepPlan, id: SeqId, cached: usize) {
    let Some(s) = state.running.iter_mut().find(|s| s.id == id) else {
        return;
    };
    if s.computed == cached {
        return;
    }
    tracing::debug!(seq = %id, planned = s.computed, cached, "prefix cache moved under a plan");
    s.computed = cached;
    plan.items.retain(|it| it.seq != id);
}
