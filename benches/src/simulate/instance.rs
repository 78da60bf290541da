//! One simulated `thaw serve`: a FIFO admission queue and a running batch planned as the
//! engine's scheduler plans them (decode first, then prefill chunks within the token budget,
//! admission while --max-num-seqs and the KV reservations allow), adapters on the device
//! (--max-loras, least recently used idle one evicted) and in host memory (--max-cpu-loras),
//! loads serialized on the host→device link, and the `auto` cold-start gate per prefill. A
//! step that starts after the instance ran none for the cost model's `after_idle_gap_s` costs
//! the model's after-idle term, as it did on the engine that fitted it. With prefix caching
//! ([`PrefixCache`]) a chat request admitted starts its prefill after its cached prefix, whose
//! blocks it shares instead of reserving, and its computed prompt and answer stay cached in the
//! KV budget (evicted LRU when admission needs room) after it ends.
use std::collections::{HashMap, VecDeque};

use thaw_server::perf::StepShape;

use super::model::{rank_of, InstanceModel};
use super::prefix::{segments, ChatTurn, Hit, Key, PrefixCache};

/// One request of the workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimRequest {
    pub id: usize,
    /// Arrival, seconds.
    pub at: f64,
    pub adapter: u32,
    pub rank: u32,
    pub prompt: usize,
    pub output: usize,
    /// A chat turn: its prompt is a chain the prefix cache can serve.
    pub chat: Option<ChatTurn>,
    /// Sent only after another request ends: (its index in the workload, think seconds).
    pub after: Option<(usize, f64)>,
}

#[derive(Clone, Debug)]
struct Seq {
    req: SimRequest,
    computed: usize,
    generated: usize,
    reserve: usize,
    /// Its prompt's segments (empty without a chat chain or with caching off).
    segs: Vec<(Key, usize)>,
    /// Leading segments it holds pinned in the cache.
    pinned: usize,
}

impl Seq {
    fn in_prefill(&self) -> bool {
        self.computed < self.req.prompt
    }
}

/// An adapter on the device, or on its way there.
#[derive(Clone, Copy, Debug)]
struct Slot {
    ready_at: f64,
    last_used: f64,
}

/// What finished in a step: `(request id, TTFT)` for first tokens, request ids that ended.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub first_tokens: Vec<(usize, f64)>,
    pub finished: Vec<usize>,
}

/// A simulated instance.
#[derive(Debug, Default)]
pub struct Instance {
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    reserved: usize,
    device: HashMap<u32, Slot>,
    host: HashMap<u32, f64>,
    pending: VecDeque<(u32, u32)>,
    link_free_at: f64,
    /// Per adapter: (running, waiting) requests.
    counts: HashMap<u32, (usize, usize)>,
    /// The step in flight: (index into `running`, tokens, CPU-assisted).
    plan: Vec<(usize, usize, bool)>,
    pub busy: bool,
    /// When its last step ended (None: it has run none): a step planned at least the cost
    /// model's `after_idle_gap_s` later is charged the after-idle term, as the engine's is.
    last_step_end: Option<f64>,
    /// Adapter loads started (disk or host → device).
    pub loads: u64,
    /// Whether it keeps a prefix cache.
    caching: bool,
    pub cache: PrefixCache,
}

impl Instance {
    /// An idle instance, with or without prefix caching.
    pub fn new(caching: bool) -> Self {
        Self {
            caching,
            ..Self::default()
        }
    }

    /// The prompt segments the cache would see for `req` (none without caching or a chat).
    pub fn segments_of(&self, req: &SimRequest) -> Vec<(Key, usize)> {
        match (self.caching, &req.chat) {
            (true, Some(c)) => segments(req.adapter, c, false),
            _ => Vec::new(),
        }
    }

    /// What this instance's cache holds of a prompt of `segs` (pure).
    pub fn prefix_hit(&self, segs: &[(Key, usize)], prompt: usize, model: &InstanceModel) -> Hit {
        if !self.caching || segs.is_empty() {
            return Hit::default();
        }
        self.cache
            .lookup(segs, prompt, model.snap.limits.block_size)
    }

    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Fraction of KV blocks reserved or used by running sequences (cached blocks nobody
    /// uses count as free, as in vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self, model: &InstanceModel) -> f64 {
        (self.reserved + self.cache.pinned_blocks) as f64
            / model.snap.limits.kv_total_blocks.max(1) as f64
    }

    /// One decode row of every running request, with its adapter's rank.
    pub fn decode_shape(&self) -> StepShape {
        let mut shape = StepShape::default();
        for s in &self.running {
            shape.add(1, true, rank_of(s.req.rank));
        }
        shape
    }

    /// (running, waiting) requests of `adapter` here.
    pub fn adapter_requests(&self, adapter: u32) -> (usize, usize) {
        self.counts.get(&adapter).copied().unwrap_or((0, 0))
    }

    /// Distinct adapters with running or waiting requests (the EPP's active ∪ waiting).
    pub fn active_adapters(&self) -> usize {
        self.counts.len()
    }

    /// Seconds until `adapter` is usable on the device: Some(0) resident, Some(t) loading,
    /// None not there.
    pub fn device_eta(&self, adapter: u32, now: f64) -> Option<f64> {
        self.device
            .get(&adapter)
            .map(|s| (s.ready_at - now).max(0.0))
    }

    pub fn in_host(&self, adapter: u32) -> bool {
        self.host.contains_key(&adapter)
    }

    fn count(&mut self, adapter: u32, f: impl FnOnce(&mut (usize, usize))) {
        let e = self.counts.entry(adapter).or_default();
        f(e);
        if *e == (0, 0) {
            self.counts.remove(&adapter);
        }
    }

    /// Queues a request; returns the time a load it started lands, if it started one.
    pub fn enqueue(&mut self, req: SimRequest, model: &InstanceModel, now: f64) -> Option<f64> {
        let l = &model.snap.limits;
        let blocks = (req.prompt + req.output).div_ceil(l.block_size.max(1));
        // A request larger than the whole cache runs alone rather than never.
        let reserve = blocks.min(l.kv_total_blocks);
        self.count(req.adapter, |c| c.1 += 1);
        let segs = self.segments_of(&req);
        self.waiting.push_back(Seq {
            req,
            computed: 0,
            generated: 0,
            reserve,
            segs,
            pinned: 0,
        });
        self.ensure(req.adapter, req.rank, model, now)
    }

    /// Starts loading `adapter` if it is not on the device and a slot is free or can be
    /// freed (an idle adapter evicted); otherwise remembers it. Returns the landing time.
    fn ensure(&mut self, adapter: u32, rank: u32, model: &InstanceModel, now: f64) -> Option<f64> {
        if let Some(s) = self.device.get_mut(&adapter) {
            s.last_used = now;
            return None;
        }
        if self.device.len() >= model.snap.limits.max_loras {
            let victim = self
                .device
                .iter()
                .filter(|(a, s)| s.ready_at <= now && self.adapter_requests(**a).0 == 0)
                .min_by(|x, y| x.1.last_used.total_cmp(&y.1.last_used))
                .map(|(a, _)| *a);
            match victim {
                Some(v) => {
                    self.device.remove(&v);
                }
                None => {
                    if !self.pending.iter().any(|p| p.0 == adapter) {
                        self.pending.push_back((adapter, rank));
                    }
                    return None;
                }
            }
        }
        let disk = if self.host.contains_key(&adapter) {
            0.0
        } else {
            if self.host.len() >= model.snap.limits.max_cpu_loras.max(1) {
                if let Some(v) = self
                    .host
                    .iter()
                    .min_by(|x, y| x.1.total_cmp(y.1))
                    .map(|(a, _)| *a)
                {
                    self.host.remove(&v);
                }
            }
            model.disk_time(rank)
        };
        self.host.insert(adapter, now);
        let start = (now + disk).max(self.link_free_at);
        let ready = start + model.link_time(rank);
        self.link_free_at = ready;
        self.device.insert(
            adapter,
            Slot {
                ready_at: ready,
                last_used: now,
            },
        );
        self.loads += 1;
        Some(ready)
    }

    /// Retries loads that found no free slot; returns landing times of those started.
    fn retry_pending(&mut self, model: &InstanceModel, now: f64) -> Vec<f64> {
        let mut out = Vec::new();
        for _ in 0..self.pending.len() {
            let Some((a, r)) = self.pending.pop_front() else {
                break;
            };
            if self.adapter_requests(a) == (0, 0) || self.device.contains_key(&a) {
                continue;
            }
            if let Some(t) = self.ensure(a, r, model, now) {
                out.push(t);
            }
        }
        out
    }

    /// Plans the next step at `now`. Returns its duration (None: nothing can run) and the
    /// landing times of loads it started.
    pub fn plan_step(&mut self, model: &InstanceModel, now: f64) -> (Option<f64>, Vec<f64>) {
        let mut loads = self.retry_pending(model, now);
        let l = model.snap.limits;
        let mut budget = l.max_num_batched_tokens;
        self.plan.clear();
        let order: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].in_prefill())
            .chain((0..self.running.len()).filter(|&i| self.running[i].in_prefill()))
            .collect();
        for i in order {
            if budget == 0 || self.plan.len() >= l.max_num_seqs {
                break;
            }
            if let Some((n, assisted)) = self.gate(i, budget, model, now) {
                budget -= n;
                self.plan.push((i, n, assisted));
            }
        }
        while let Some(s) = self.waiting.front() {
            if budget == 0 || self.running.len() >= l.max_num_seqs {
                break;
            }
            // Its cached prefix is shared, not reserved; cached blocks nobody uses make room.
            let hit = self.prefix_hit(&s.segs, s.req.prompt, model);
            let reserve = s.reserve.saturating_sub(hit.blocks);
            self.cache.pin(&s.segs, hit.segments, now);
            let free = l
                .kv_total_blocks
                .saturating_sub(self.reserved + self.cache.blocks);
            if reserve > free + self.cache.evictable() {
                self.cache.unpin(&s.segs, hit.segments, now);
                break;
            }
            self.cache.evict(reserve.saturating_sub(free));
            let mut s = self.waiting.pop_front().expect("front exists");
            if self.caching {
                self.cache.queried_tokens += s.req.prompt as u64;
                self.cache.hit_tokens += hit.tokens as u64;
            }
            s.reserve = reserve;
            s.computed = hit.tokens;
            s.pinned = hit.segments;
            self.reserved += s.reserve;
            self.count(s.req.adapter, |c| {
                c.1 -= 1;
                c.0 += 1;
            });
            let (a, r) = (s.req.adapter, s.req.rank);
            self.running.push(s);
            loads.extend(self.ensure(a, r, model, now));
            let i = self.running.len() - 1;
            if let Some((n, assisted)) = self.gate(i, budget, model, now) {
                budget -= n;
                self.plan.push((i, n, assisted));
            }
        }
        if self.plan.is_empty() {
            return (None, loads);
        }
        let (mut shape, mut cpu) = (StepShape::default(), 0.0);
        shape.after_idle = model
            .perf
            .is_after_idle(self.last_step_end.map(|end| now - end));
        let mut assisted_any = false;
        for &(i, n, assisted) in &self.plan {
            let (rank, decode) = (self.running[i].req.rank, !self.running[i].in_prefill());
            shape.add(n, decode, rank_of(rank));
            if assisted {
                assisted_any = true;
                cpu += model.cpu_layer_time(n, rank);
            }
        }
        let dev = model.layer_time(&shape);
        let layer = if assisted_any {
            model.assisted_layer(dev, cpu)
        } else {
            dev
        };
        (Some(layer * model.layers() + model.step_overhead()), loads)
    }

    /// Tokens running request `i` may compute this step, and whether with CPU assist.
    fn gate(
        &self,
        i: usize,
        budget: usize,
        model: &InstanceModel,
        now: f64,
    ) -> Option<(usize, bool)> {
        let s = &self.running[i];
        if !s.in_prefill() {
            return Some((1, false));
        }
        let left = s.req.prompt - s.computed;
        match self.device_eta(s.req.adapter, now) {
            Some(t) if t <= 0.0 => Some((left.min(budget), false)),
            Some(t) => {
                let other: usize = self.plan.iter().map(|p| p.1).sum();
                // The planned requests' fewest output tokens left (the engine's
                // `ColdCase::fewest_left`).
                let fewest_left = self
                    .plan
                    .iter()
                    .map(|p| {
                        let r = &self.running[p.0];
                        r.req.output.saturating_sub(r.generated)
                    })
                    .min()
                    .unwrap_or(usize::MAX);
                model
                    .decide(left, (other, fewest_left), s.req.rank, t)
                    .map(|c| (c.min(budget), true))
            }
            None => None,
        }
    }

    /// Applies the planned step, which ended at `now`.
    pub fn finish_step(&mut self, now: f64, model: &InstanceModel) -> StepOutcome {
        let bs = model.snap.limits.block_size;
        let mut out = StepOutcome::default();
        for &(i, n, _) in &self.plan {
            let s = &mut self.running[i];
            if s.in_prefill() {
                s.computed += n;
                if !s.in_prefill() {
                    s.generated = 1;
                    out.first_tokens.push((s.req.id, now - s.req.at));
                    // The prompt's full blocks join the cache, still used by the sequence;
                    // they leave its reservation.
                    if !s.segs.is_empty() {
                        let added = self.cache.insert(&s.segs, s.pinned, bs, now, true);
                        debug_assert!(added <= s.reserve, "{added} > {}", s.reserve);
                        let moved = added.min(s.reserve);
                        s.reserve -= moved;
                        self.reserved -= moved;
                        s.pinned = s.segs.len();
                    }
                }
            } else {
                s.generated += 1;
            }
            if let Some(slot) = self.device.get_mut(&s.req.adapter) {
                slot.last_used = now;
            }
        }
        self.plan.clear();
        self.last_step_end = Some(now);
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if !s.in_prefill() && s.generated >= s.req.output.max(1) {
                let mut s = self.running.swap_remove(i);
                if let (false, Some(chat)) = (s.segs.is_empty(), &s.req.chat) {
                    // Its answer's full blocks too: the next turn's prompt starts with them.
                    let chain = segments(s.req.adapter, chat, true);
                    let added = self.cache.insert(&chain, s.segs.len(), bs, now, false);
                    let moved = added.min(s.reserve);
                    s.reserve -= moved;
                    self.reserved -= moved;
                    self.cache.unpin(&s.segs, s.pinned, now);
                }
                self.reserved -= s.reserve;
                self.count(s.req.adapter, |c| c.0 -= 1);
                out.finished.push(s.req.id);
            } else {
                i += 1;
            }
        }
        self.busy = false;
        out
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;

    /// Durations of the steps of requests arriving at `arrivals` (seconds) on one instance,
    /// each run to its end before the next arrives (at its time, or when the previous one
    /// ended if that is later), and when the last one ended. The first request's adapter
    /// load is waited for.
    fn step_times(m: &InstanceModel, arrivals: &[f64]) -> (Vec<f64>, f64) {
        let mut inst = Instance::default();
        let mut now = 0.0;
        let mut out = Vec::new();
        for (id, &at) in arrivals.iter().enumerate() {
            now = f64::max(now, at);
            let req = SimRequest {
                id,
                at: now,
                adapter: 1,
                rank: 8,
                prompt: 40,
                output: 3,
                chat: None,
                after: None,
            };
            if let Some(landed) = inst.enqueue(req, m, now) {
                now = landed;
            }
            while let (Some(d), _) = inst.plan_step(m, now) {
                out.push(d);
                now += d;
                inst.finish_step(now, m);
            }
            assert!(inst.is_idle());
        }
        (out, now)
    }

    #[test]
    fn only_a_step_after_idle_pays_the_after_idle_term() {
        let mut snap = snapshot();
        snap.perf.after_idle_gap_s = 0.05;
        let warm = InstanceModel::new(snap.clone()).unwrap();
        snap.perf.layer_after_idle_s = 5e-3;
        let cold = InstanceModel::new(snap).unwrap();
        // The first request meets an instance that never ran a step; the second comes 10 ms
        // after the first finished on the slower model (under 50 ms on both: not idle long
        // enough), the third 10 s later.
        let end_of_first = step_times(&cold, &[0.0]).1;
        let arrivals = [0.0, end_of_first + 0.01, end_of_first + 10.0];
        let (w, c) = (
            step_times(&warm, &arrivals).0,
            step_times(&cold, &arrivals).0,
        );
        assert_eq!(w.len(), c.len());
        let extra: Vec<f64> = c.iter().zip(&w).map(|(c, w)| c - w).collect();
        let charged: Vec<usize> = (0..extra.len()).filter(|&i| extra[i] != 0.0).collect();
        // Each request runs a prefill step and two decode steps: steps 0 and 6 follow idle.
        assert_eq!(w.len(), 9, "{w:?}");
        assert_eq!(charged, vec![0, 6], "{extra:?}");
        for i in charged {
            assert!((extra[i] - 4.0 * 5e-3).abs() < 1e-12, "{extra:?}");
        }
    }
}
