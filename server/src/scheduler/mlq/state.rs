//! What the multi-level queue remembers between steps: each request's size and queue, the
//! recent sizes the queues are fitted to, the cut-offs and quotas, and bypass counts.
use std::collections::{HashMap, VecDeque};

use thaw_runtime::ids::SeqId;

use super::kmeans::{choose_queues, cutoffs, queue_of};
use super::quota::{quotas, QueueLoad, Quota};
use super::wrs::{RequestSize, WrsScales, WrsWeights};

/// Chameleon's scheduler knobs (§4.2) and Thaw's bounds around them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlqConfig {
    pub weights: WrsWeights,
    /// Most queues (`K_max`; the paper's 4).
    pub max_queues: usize,
    /// Re-fit period of queues, cut-offs and quotas (`t_refit`; the paper's 5 minutes).
    pub refit_every_s: f64,
    /// Arrivals before the first fit (before it, one queue: FIFO).
    pub warmup: usize,
    /// Recent arrivals the fit looks at.
    pub window: usize,
    /// Elbow of the queue-count rule (see `kmeans.rs`).
    pub elbow: f64,
    /// The TTFT SLO the quotas are sized for, seconds.
    pub slo_s: f64,
    /// A request waiting longer than this is admitted before anything else (and nothing else
    /// is, until it is): the starvation bound, whatever the quotas say.
    pub max_wait_s: f64,
    /// Most younger requests that may bypass one adapter-blocked head.
    pub max_bypass: usize,
    /// An idle queue lends only its quota above its queueing-model minimum (see
    /// `plan.rs`).
    pub keep_min: bool,
    /// Protect the oldest large request once it has waited its predicted drain time (see
    /// `protect.rs`).
    pub protect: bool,
}

impl Default for MlqConfig {
    fn default() -> Self {
        Self {
            weights: WrsWeights::default(),
            max_queues: 4,
            refit_every_s: 300.0,
            warmup: 32,
            window: 1024,
            elbow: 0.1,
            slo_s: 5.0,
            max_wait_s: 30.0,
            max_bypass: 8,
            keep_min: false,
            protect: true,
        }
    }
}

/// One request as the queues know it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Entry {
    /// What its WRS is computed from (recomputed with each refit's scales).
    pub req: RequestSize,
    pub wrs: f64,
    /// Quota it consumes while it runs, tokens.
    pub size: usize,
    /// Predicted time to serve it once admitted, seconds.
    pub service_s: f64,
    pub arrived_s: f64,
    pub queue: usize,
    /// Younger requests admitted past it while its adapter could not be placed.
    pub bypassed: usize,
}

#[derive(Clone, Copy, Debug)]
struct Recent {
    req: RequestSize,
    wrs: f64,
    size: usize,
    service_s: f64,
    at_s: f64,
}

/// The queues' state. Waiting order itself stays in [`crate::scheduler::SchedState::waiting`].
#[derive(Clone, Debug)]
pub struct Mlq {
    pub cfg: MlqConfig,
    entries: HashMap<SeqId, Entry>,
    recent: VecDeque<Recent>,
    cuts: Vec<f64>,
    /// What WRS terms are divided by: the fixed maxima until the first fit, then the last
    /// refit's window means.
    scales: WrsScales,
    quotas: Vec<Quota>,
    /// What the last refit measured per queue; quotas are re-split from it when the KV
    /// capacity moves.
    load: Vec<QueueLoad>,
    total_tokens: usize,
    fitted_at: Option<f64>,
    /// The request [`super::protect`] protects this step.
    protected: Option<SeqId>,
}

impl Mlq {
    /// Queues over a KV cache of `total_tokens` token slots (until [`Self::set_capacity`]).
    pub fn new(cfg: MlqConfig, total_tokens: usize) -> Self {
        Self {
            cfg,
            entries: HashMap::new(),
            recent: VecDeque::new(),
            cuts: Vec::new(),
            scales: cfg.weights.fixed_scales(),
            quotas: vec![Quota {
                tokens: total_tokens,
                min: 0,
            }],
            load: Vec::new(),
            total_tokens,
            fitted_at: None,
            protected: None,
        }
    }

    /// Sizes a new request and files it (refitting first when one is due).
    pub fn enqueue(
        &mut self,
        id: SeqId,
        req: &RequestSize,
        size: usize,
        service_s: f64,
        now_s: f64,
    ) {
        let wrs = self.cfg.weights.wrs_with(req, &self.scales);
        if self.recent.len() == self.cfg.window.max(1) {
            self.recent.pop_front();
        }
        self.recent.push_back(Recent {
            req: *req,
            wrs,
            size,
            service_s,
            at_s: now_s,
        });
        let due = match self.fitted_at {
            None => self.recent.len() >= self.cfg.warmup,
            Some(t) => now_s - t >= self.cfg.refit_every_s,
        };
        if due {
            self.refit(now_s);
        }
        let wrs = self.cfg.weights.wrs_with(req, &self.scales);
        self.entries.insert(
            id,
            Entry {
                req: *req,
                wrs,
                size,
                service_s,
                arrived_s: now_s,
                queue: queue_of(&self.cuts, wrs),
                bypassed: 0,
            },
        );
    }

    /// New scales from the window's means (see `wrs.rs`), K-means over the recent
    /// sizes, cut-offs at the midpoints, quotas from the queueing model; every known request
    /// is re-sized with the new scales and moves to the queue its size now falls in (a
    /// running one's quota is then charged to its new queue).
    pub fn refit(&mut self, now_s: f64) {
        let fixed = self.cfg.weights.fixed_scales();
        if let Some(sc) =
            WrsScales::of_window(self.recent.iter().map(|r| (&r.req, r.service_s)), &fixed)
        {
            self.scales = sc;
        }
        let (w, sc) = (self.cfg.weights, self.scales);
        for r in self.recent.iter_mut() {
            r.wrs = w.wrs_with(&r.req, &sc);
        }
        let xs: Vec<f64> = self.recent.iter().map(|r| r.wrs).collect();
        let centroids = choose_queues(&xs, self.cfg.max_queues, self.cfg.elbow);
        self.cuts = cutoffs(&centroids);
        let k = self.cuts.len() + 1;
        let span = match (self.recent.front(), self.recent.back()) {
            (Some(a), Some(b)) => (b.at_s - a.at_s).max(1e-3),
            _ => 1.0,
        };
        let mut load = vec![(QueueLoad::default(), 0usize); k];
        for r in &self.recent {
            let (q, n) = &mut load[queue_of(&self.cuts, r.wrs)];
            q.max_size = q.max_size.max(r.size as f64);
            q.mean_service_s += r.service_s;
            *n += 1;
        }
        let load: Vec<QueueLoad> = load
            .into_iter()
            .map(|(mut q, n)| {
                q.mean_service_s /= n.max(1) as f64;
                q.rate = n as f64 / span;
                q
            })
            .collect();
        self.quotas = quotas(&load, self.total_tokens, self.cfg.slo_s);
        self.load = load;
        self.fitted_at = Some(now_s);
        let cuts = &self.cuts;
        for e in self.entries.values_mut() {
            e.wrs = w.wrs_with(&e.req, &sc);
            e.queue = queue_of(cuts, e.wrs).min(k - 1);
        }
    }

    /// Sets the token slots the quotas split (pages times the block size): the scheduler
    /// passes the whole pool, since a request's size counts both its KV and the pages of an
    /// adapter that must be loaded for it. The queueing model's split is redone over the last
    /// refit's loads (no new fit), summing to `total_tokens`.
    pub fn set_capacity(&mut self, total_tokens: usize) {
        if total_tokens == self.total_tokens {
            return;
        }
        self.total_tokens = total_tokens;
        self.quotas = if self.load.is_empty() {
            vec![Quota {
                tokens: total_tokens,
                min: 0,
            }]
        } else {
            quotas(&self.load, total_tokens, self.cfg.slo_s)
        };
    }

    /// Token slots the quotas split.
    pub fn capacity(&self) -> usize {
        self.total_tokens
    }

    /// Forgets a request (finished, cancelled, failed).
    pub fn remove(&mut self, id: SeqId) -> Option<Entry> {
        self.entries.remove(&id)
    }

    pub fn entry(&self, id: SeqId) -> Option<&Entry> {
        self.entries.get(&id)
    }

    /// Records the bypasses a decision made.
    pub fn note_bypass(&mut self, head: SeqId, n: usize) {
        if let Some(e) = self.entries.get_mut(&head) {
            e.bypassed += n;
        }
    }

    pub fn num_queues(&self) -> usize {
        self.quotas.len()
    }

    pub fn quotas(&self) -> &[Quota] {
        &self.quotas
    }

    pub fn cutoffs(&self) -> &[f64] {
        &self.cuts
    }

    /// What WRS terms are divided by now.
    pub fn scales(&self) -> &WrsScales {
        &self.scales
    }

    /// Sets the request protected this step (see `protect.rs`).
    pub fn set_protected(&mut self, id: Option<SeqId>) {
        self.protected = id;
    }

    /// The request protected this step.
    pub fn protected(&self) -> Option<SeqId> {
        self.protected
    }

    /// Whether waiting request `id` goes before every queue at `now_s`: past the starvation
    /// bound, or protected.
    pub fn goes_first(&self, id: SeqId, now_s: f64) -> bool {
        self.protected == Some(id)
            || self
                .entries
                .get(&id)
                .is_some_and(|e| now_s - e.arrived_s >= self.cfg.max_wait_s)
    }

    /// Where memory admission considers waiting request `id` at `now_s` (lower first; a
    /// stable sort keeps arrival order within a rank): past the starvation bound or protected
    /// first, then by queue.
    pub fn admission_rank(&self, id: SeqId, now_s: f64) -> usize {
        if self.goes_first(id, now_s) {
            0
        } else {
            1 + self.queue(id)
        }
    }

    /// The queue a request is in (its queue at admission once it runs); unknown ones count
    /// as the fast lane.
    pub fn queue(&self, id: SeqId) -> usize {
        self.entries
            .get(&id)
            .map_or(0, |e| e.queue.min(self.quotas.len() - 1))
    }
}
