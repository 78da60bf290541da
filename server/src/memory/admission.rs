//! Adapter-aware admission: which waiting requests may join the batch this step, and what the
//! device memory must do for them (evict, load, fetch). A pure function over the queue, the
//! running set and a [`MemView`] of the memory manager, so any queueing policy (FIFO here, the
//! multi-level queues later) can call it with its own order of candidates.
//!
//! A request is admissible when its KV reservation fits and its adapter is resident, loading,
//! or in the host tier and loadable — evicting idle adapters (never one a running request
//! uses) to make room, so the adapter cache shrinks before any request waits for KV. A request
//! whose adapter is only on disk waits while the loader fetches it. Nothing is refused here.
//!
//! Prefetch (Chameleon §4, after S-LoRA): every waiting request in view (the head and
//! [`BYPASS_LOOKAHEAD`] behind it) has its disk-only adapter read at once, whatever makes it
//! wait — a full batch too, since a read takes no device memory; and while the head waits for
//! its read or a place in the batch (not for memory), the host copies of those behind it are
//! loaded into pages the head does not need.
//!
//! Requests behind a blocked head may bypass it (Chameleon §4, "Bypassing Adapter Blocking"),
//! but never so as to delay it: while the head waits for memory, a bypasser must be predicted to
//! finish within the head's predicted wait (steps until running requests free enough for it);
//! while the head waits only for its adapter's fetch, a bypasser must leave the head fitting.
//!
//! Under the `no-cache` baseline ([`Limits::keep_idle`] false), the plan finally drops every
//! device adapter that no running or admitted request uses and no waiting request in view wants.
use std::cell::OnceCell;
use std::collections::{HashMap, HashSet};

use thaw_runtime::ids::{AdapterId, SeqId};

use super::manager::{MemoryManager, ReloadCost};
use super::pool::{Counts, PagePool, PoolError};
use crate::scheduler::{SchedConfig, SeqState};

/// How far behind a blocked head the bypass looks.
pub const BYPASS_LOOKAHEAD: usize = 64;

/// Where an adapter is on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Absent,
    /// Registered with the engine, layers still streaming in.
    Loading,
    Resident,
}

/// What admission needs to know of one adapter.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AdapterState {
    /// Pages it takes (or takes now) on the device.
    pub pages: usize,
    pub device: Device,
    /// A host copy exists, so it can be registered with the engine this step.
    pub in_host: bool,
}

/// The memory manager as admission sees it.
#[derive(Clone, Copy, Debug)]
pub struct MemView<'a> {
    pub pool: &'a PagePool,
    pub adapters: &'a HashMap<AdapterId, AdapterState>,
    /// Adapters on the device, most evictable first (the eviction policy's order).
    pub eviction_order: EvictionOrder<'a>,
    /// Which adapters the engine has registered.
    pub registered: Registered<'a>,
}

/// Which adapters the engine has registered. Admission counts an adapter the memory manager
/// places on the device as usable only if the engine has it too: a request is admitted only
/// when its adapter is registered, or loaded by the plan that admits it, so the engine never
/// refuses it (a resumed request included) and nothing admitted is sent back to wait.
#[derive(Clone, Copy)]
pub enum Registered<'a> {
    /// The engine has exactly what the memory manager places on the device (simulations).
    AsTracked,
    /// Asks the engine.
    Engine(&'a dyn Fn(AdapterId) -> bool),
}

impl Registered<'_> {
    fn has(self, a: AdapterId) -> bool {
        match self {
            Self::AsTracked => true,
            Self::Engine(f) => f(a),
        }
    }
}

impl std::fmt::Debug for Registered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AsTracked => "AsTracked",
            Self::Engine(_) => "Engine",
        })
    }
}

/// The eviction order, given or computed on first use. Scoring and sorting every
/// device-resident adapter each step made a step O(n log n) in the registered count once all
/// adapters fit on the device, though most steps evict nothing (issue 11's cache-scale table).
#[derive(Clone, Copy)]
pub enum EvictionOrder<'a> {
    /// Given up front.
    Fixed(&'a [AdapterId]),
    /// The memory manager's policy order, computed into `order` when first asked for.
    Lazy {
        order: &'a OnceCell<Vec<AdapterId>>,
        compute: &'a MemoryManager,
        wanted: &'a HashSet<AdapterId>,
        reload: ReloadCost<'a>,
    },
}

impl<'a> EvictionOrder<'a> {
    pub fn get(self) -> &'a [AdapterId] {
        match self {
            Self::Fixed(o) => o,
            Self::Lazy {
                order,
                compute,
                wanted,
                reload,
            } => order
                .get_or_init(|| compute.compute_order(wanted, reload))
                .as_slice(),
        }
    }
}

impl std::fmt::Debug for EvictionOrder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(o) => f.debug_tuple("Fixed").field(o).finish(),
            Self::Lazy { order, .. } => f
                .debug_struct("Lazy")
                .field("computed", &order.get().map(Vec::len))
                .finish(),
        }
    }
}

/// Batch limits admission keeps.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `--max-loras`: distinct adapters in one batch.
    pub max_loras: usize,
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// Let requests pass a head blocked on memory (bounded as above).
    pub bypass: bool,
    /// Load adapters of waiting requests into free pages ahead of their turn.
    pub prefetch: bool,
    /// Keep idle adapters on the device until memory is needed (the adapter cache). False for
    /// the `no-cache` baseline: every plan also drops what [`super::nocache::idle_drops`] says.
    pub keep_idle: bool,
}

/// The head of the queue is blocked; how long it is predicted to wait.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HeadWait {
    pub seq: SeqId,
    /// Steps until running requests free enough for it; None when it waits only for its
    /// adapter's fetch (bypassers must then leave it fitting).
    pub bound_steps: Option<usize>,
    /// It waits for device memory (its KV and adapter do not fit even with every idle adapter
    /// evicted), not for a place in the batch or its adapter's read.
    pub memory: bool,
}

/// What admission decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdmitPlan {
    /// Requests that may be admitted, in order (a prefix may be taken if the token budget runs
    /// out; the memory below is already arranged for all of them).
    pub admit: Vec<SeqId>,
    /// Idle adapters to drop from the device first.
    pub evict: Vec<AdapterId>,
    /// Adapters to register with the engine (host → device) for admitted requests.
    pub load: Vec<AdapterId>,
    /// Adapters of waiting requests to load ahead of their turn, into free pages only.
    pub prefetch: Vec<AdapterId>,
    /// Adapters of waiting requests the loader must read from disk.
    pub fetch: Vec<AdapterId>,
    /// KV pages the scheduler may reserve in total once the plan is applied.
    pub kv_capacity: usize,
    pub head: Option<HeadWait>,
    /// Requests admitted past a blocked head.
    pub bypassed: usize,
}

/// Predicted steps until `s` finishes if it runs every step (prefill in budget-sized chunks,
/// then one token per step up to `max_new_tokens` — an upper bound, early stops only shorten).
pub fn predicted_steps(s: &SeqState, cfg: &SchedConfig) -> usize {
    let generated = s.total_tokens - s.prompt_len;
    if s.in_prefill() {
        // Its prompt, or after a preemption its prompt and output, in chunks; then the rest.
        let chunks = s.pending().div_ceil(cfg.max_num_batched_tokens.max(1));
        chunks + s.max_new_tokens.saturating_sub(generated + 1)
    } else {
        s.max_new_tokens.saturating_sub(generated)
    }
}

/// Tentative state while building the plan.
#[derive(Clone)]
struct Work<'a> {
    view: MemView<'a>,
    cfg: &'a SchedConfig,
    kv: usize,
    adapter_pages: usize,
    /// Adapters on the device, and those of them still streaming (bounded by the workers'
    /// host store).
    counts: Counts,
    seqs: usize,
    /// Adapter → requests (running or admitted) using it.
    users: HashMap<AdapterId, usize>,
    evicted: HashSet<AdapterId>,
    loaded: HashSet<AdapterId>,
}

/// What admitting one request takes.
#[derive(Clone)]
struct Need {
    r: usize,
    load: Option<(AdapterId, usize)>,
    evict: Vec<AdapterId>,
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Block {
    /// The batch is full: `--max-num-seqs` requests or `--max-loras` distinct adapters.
    Batch,
    /// Not enough device memory for its KV and adapter, even evicting every idle adapter.
    Memory,
    /// Its adapter is only on disk.
    Fetch,
    /// The memory manager places its adapter on the device but the engine does not have it
    /// (an unload racing the plan): it waits, without holding up those behind it, until the
    /// two agree again.
    Unregistered,
}

impl<'a> Work<'a> {
    fn new(
        view: MemView<'a>,
        cfg: &'a SchedConfig,
        running: &[SeqState],
        reserved_kv: usize,
    ) -> Self {
        let mut users: HashMap<AdapterId, usize> = HashMap::new();
        for a in running.iter().filter_map(|s| s.adapter) {
            *users.entry(a).or_default() += 1;
        }
        Self {
            view,
            cfg,
            kv: reserved_kv,
            adapter_pages: view.pool.adapter_pages(),
            counts: view.pool.counts(),
            seqs: running.len(),
            users,
            evicted: HashSet::new(),
            loaded: HashSet::new(),
        }
    }

    fn on_device(&self, a: AdapterId) -> bool {
        self.loaded.contains(&a)
            || (!self.evicted.contains(&a)
                && self
                    .view
                    .adapters
                    .get(&a)
                    .is_some_and(|s| s.device != Device::Absent))
    }

    /// Whether the memory manager places `a` on the device (as this plan leaves it) but the
    /// engine does not have it.
    fn stale(&self, a: AdapterId) -> bool {
        self.view.adapters.contains_key(&a)
            && self.on_device(a)
            && !self.loaded.contains(&a)
            && !self.view.registered.has(a)
    }

    fn pages(&self, a: AdapterId) -> usize {
        self.view.adapters.get(&a).map_or(0, |s| s.pages)
    }

    /// Whether `a`, on the device, is still streaming (loaded by this plan, or not landed).
    fn streaming(&self, a: AdapterId) -> bool {
        self.loaded.contains(&a)
            || self
                .view
                .adapters
                .get(&a)
                .is_some_and(|s| s.device == Device::Loading)
    }

    /// Whether `a` is only on disk, neither on the device nor in the host tier.
    fn on_disk_only(&self, a: AdapterId) -> bool {
        self.view
            .adapters
            .get(&a)
            .is_some_and(|st| !st.in_host && !self.on_device(a))
    }

    /// What `s` needs now, or why it must wait; `fetched` counts as in the host tier.
    fn need(&self, s: &SeqState, lim: &Limits, fetched: Option<AdapterId>) -> Result<Need, Block> {
        if s.adapter.is_some_and(|a| self.stale(a)) {
            return Err(Block::Unregistered);
        }
        if self.seqs >= lim.max_num_seqs {
            return Err(Block::Batch);
        }
        if let Some(a) = s.adapter {
            if !self.users.contains_key(&a) && self.users.len() >= lim.max_loras {
                return Err(Block::Batch);
            }
        }
        self.need_memory(s, fetched)
    }

    /// What `s` needs in device memory alone (batch limits aside), or why it must wait.
    fn need_memory(&self, s: &SeqState, fetched: Option<AdapterId>) -> Result<Need, Block> {
        let r = s.reservation(self.cfg);
        let mut load = None;
        if let Some(a) = s.adapter {
            match self.view.adapters.get(&a) {
                // Unknown to the memory manager: the engine refuses it with a clear error.
                None => {}
                Some(_) if self.on_device(a) => {}
                Some(st) if st.in_host || fetched == Some(a) => load = Some((a, st.pages)),
                Some(_) => return Err(Block::Fetch),
            }
        }
        let pool = self.view.pool;
        let (mut pages, mut counts) = (self.adapter_pages, self.counts);
        let mut evict: Vec<AdapterId> = Vec::new();
        // Asked for only when something must be evicted: one pass for any victim, one for
        // a streaming victim when the streaming bound is what blocks the load (evicting a
        // landed adapter would free pages, not a host-store slot). Each pass moves forward
        // only, so the search stays linear in the device's adapters.
        let mut any: Option<std::slice::Iter<'_, AdapterId>> = None;
        let mut streaming: Option<std::slice::Iter<'_, AdapterId>> = None;
        loop {
            // The step planner admits it only with the watermark left free: room for both.
            let kv = self.kv + r + self.cfg.watermark();
            let room = match load {
                Some((_, p)) => pool.fits_with(p, kv, pages, counts),
                None => Ok(()),
            };
            let with = pages + load.map_or(0, |(_, p)| p);
            if room.is_ok() && kv <= pool.kv_capacity_with(with) {
                return Ok(Need { r, load, evict });
            }
            let need_stream = matches!(room, Err(PoolError::Streaming(_)));
            let idle = |v: &AdapterId| {
                !self.evicted.contains(v)
                    && !evict.contains(v)
                    && !self.users.contains_key(v)
                    && Some(*v) != s.adapter
                    && self.on_device(*v)
            };
            let pass = if need_stream {
                &mut streaming
            } else {
                &mut any
            };
            let victim = pass
                .get_or_insert_with(|| self.view.eviction_order.get().iter())
                .find(|v| idle(v) && (!need_stream || self.streaming(**v)));
            let Some(&v) = victim else {
                return Err(Block::Memory);
            };
            pages -= self.pages(v);
            counts = counts.minus_one(self.streaming(v));
            evict.push(v);
        }
    }

    /// Drops `v` from the device in this plan.
    fn evict(&mut self, v: AdapterId, plan: &mut AdmitPlan) {
        self.adapter_pages -= self.pages(v);
        self.counts = self.counts.minus_one(self.streaming(v));
        self.evicted.insert(v);
        self.loaded.remove(&v);
        plan.evict.push(v);
    }

    fn commit(&mut self, s: &SeqState, n: Need, plan: &mut AdmitPlan) {
        for v in n.evict {
            self.evict(v, plan);
        }
        if let Some((a, p)) = n.load {
            self.adapter_pages += p;
            self.counts = self.counts.plus_one();
            self.loaded.insert(a);
            self.evicted.remove(&a);
            plan.load.push(a);
        }
        if let Some(a) = s.adapter {
            *self.users.entry(a).or_default() += 1;
        }
        self.kv += n.r;
        self.seqs += 1;
        plan.admit.push(s.id);
    }

    /// Steps until the requests in `running` free enough for `head` (None: they never do).
    fn head_wait(&self, head: &SeqState, running: &[&SeqState], lim: &Limits) -> Option<usize> {
        let mut rel: Vec<(usize, &SeqState)> = running
            .iter()
            .map(|s| (predicted_steps(s, self.cfg), *s))
            .collect();
        rel.sort_by_key(|(k, _)| *k);
        let mut users = self.users.clone();
        // KV comes on demand: until it finishes, a running request may grow to its worst case,
        // so the head's wait is bounded by that, not by what they hold now.
        let worst = |s: &SeqState| s.worst_case_blocks(self.cfg).max(s.reservation(self.cfg));
        let mut kv = self.kv.max(running.iter().map(|s| worst(s)).sum());
        let mut seqs = self.seqs;
        let r = head.reservation(self.cfg) + self.cfg.watermark();
        let pool = self.view.pool;
        for (steps, s) in rel {
            kv = kv.saturating_sub(worst(s));
            seqs -= 1;
            if let Some(a) = s.adapter {
                if let Some(u) = users.get_mut(&a) {
                    *u -= 1;
                    if *u == 0 {
                        users.remove(&a);
                    }
                }
            }
            // Adapters still used stay; every idle one could be evicted.
            let pinned: usize = users.keys().map(|a| self.pages(*a)).sum();
            let pinned_counts = Counts {
                adapters: users.len(),
                streaming: users.keys().filter(|a| self.streaming(**a)).count(),
            };
            let (shared, load) = match head.adapter {
                Some(a) if users.contains_key(&a) => (true, 0),
                Some(a) => (false, self.pages(a)),
                None => (true, 0),
            };
            let fits = seqs < lim.max_num_seqs
                && (shared || users.len() < lim.max_loras)
                && (load == 0 || pool.fits_with(load, kv + r, pinned, pinned_counts).is_ok())
                && kv + r <= pool.kv_capacity_with(pinned + load);
            if fits {
                return Some(steps);
            }
        }
        None
    }

    /// Loads adapters of waiting requests into pages nobody uses, evicting nothing, never so
    /// that a head waiting for its fetch stops fitting.
    fn prefetch(&mut self, rest: &[&SeqState], head: Option<&SeqState>, plan: &mut AdmitPlan) {
        let pool = self.view.pool;
        // Those admitted this step keep the watermark the step planner leaves free.
        let wm = self.cfg.watermark();
        for s in head.iter().chain(rest) {
            let Some(a) = s.adapter else { continue };
            let Some(st) = self.view.adapters.get(&a).copied() else {
                continue;
            };
            // Not what this plan just dropped to make room: that would move it twice.
            if !st.in_host || self.on_device(a) || self.evicted.contains(&a) {
                continue;
            }
            if pool
                .fits_with(st.pages, self.kv + wm, self.adapter_pages, self.counts)
                .is_err()
                || self.kv + wm > pool.kv_capacity_with(self.adapter_pages + st.pages)
            {
                continue;
            }
            let mut probe = self.clone();
            probe.adapter_pages += st.pages;
            probe.counts = probe.counts.plus_one();
            probe.loaded.insert(a);
            // The head must still fit, evicting nothing, once what it waits for (its fetch, a
            // place in the batch) is there: prefetches take only pages it does not need, so
            // none is loaded only to be evicted when the head's turn comes.
            if let Some(h) = head.filter(|h| h.id != s.id) {
                match probe.need_memory(h, h.adapter) {
                    Ok(n) if n.evict.is_empty() => {}
                    _ => continue,
                }
            }
            *self = probe;
            plan.prefetch.push(a);
        }
    }
}

/// Decides admission for `waiting` (in the policy's order) beside `running`, whose KV
/// reservations total `reserved_kv` pages.
pub fn admit<'a>(
    waiting: impl IntoIterator<Item = &'a SeqState>,
    running: &[SeqState],
    reserved_kv: usize,
    cfg: &SchedConfig,
    view: MemView<'_>,
    lim: &Limits,
) -> AdmitPlan {
    let mut w = Work::new(view, cfg, running, reserved_kv);
    let mut plan = AdmitPlan::default();
    let mut admitted: Vec<&SeqState> = Vec::new();
    let mut head: Option<(&SeqState, Option<usize>, Block)> = None;
    let mut behind = 0;
    let mut fetch_seen = HashSet::new();
    let mut rest: Vec<&SeqState> = Vec::new();
    for s in waiting {
        if head.is_some() {
            behind += 1;
            if behind > BYPASS_LOOKAHEAD {
                break;
            }
        }
        // Every waiting request in view whose adapter is only on disk has it read now, however
        // it waits (a full batch included): the read uses no device memory, and a request
        // that waited for a place in the batch would otherwise start its read only then
        // (Chameleon's and S-LoRA's prefetch of queued requests' adapters).
        if let Some(a) = s.adapter.filter(|a| w.on_disk_only(*a)) {
            if fetch_seen.insert(a) {
                plan.fetch.push(a);
            }
        }
        let Some((h, bound, _)) = head else {
            match w.need(s, lim, None) {
                Ok(n) => {
                    w.commit(s, n, &mut plan);
                    admitted.push(s);
                }
                Err(Block::Unregistered) => rest.push(s),
                Err(why) => {
                    let bound = match why {
                        Block::Fetch | Block::Unregistered => None,
                        Block::Memory | Block::Batch => {
                            let run: Vec<&SeqState> =
                                running.iter().chain(admitted.iter().copied()).collect();
                            Some(w.head_wait(s, &run, lim).unwrap_or(0))
                        }
                    };
                    head = Some((s, bound, why));
                    plan.head = Some(HeadWait {
                        seq: s.id,
                        bound_steps: bound,
                        memory: why == Block::Memory,
                    });
                }
            }
            continue;
        };
        if !lim.bypass {
            // Looked at for its adapter's read only.
            rest.push(s);
            continue;
        }
        let Ok(n) = w.need(s, lim, None) else {
            rest.push(s);
            continue;
        };
        let allowed = match bound {
            Some(b) => predicted_steps(s, cfg) <= b,
            // The head waits for its fetch: it must still fit once that lands.
            None => {
                let mut probe = w.clone();
                probe.commit(s, n.clone(), &mut AdmitPlan::default());
                probe.need(h, lim, h.adapter).is_ok()
            }
        };
        if allowed {
            w.commit(s, n, &mut plan);
            admitted.push(s);
            plan.bypassed += 1;
        } else {
            rest.push(s);
        }
    }
    if lim.prefetch {
        // While the head waits for memory, only its own adapter: the free pages are its. While
        // it waits for its fetch or a place in the batch, the pages it will not need may hold
        // the adapters of those behind it, so they are on the device when their turn comes.
        let others: &[&SeqState] = if matches!(head, Some((_, _, Block::Memory))) {
            &[]
        } else {
            &rest
        };
        w.prefetch(others, head.map(|(h, _, _)| h), &mut plan);
    }
    if !lim.keep_idle {
        let in_use: HashSet<AdapterId> = w.users.keys().copied().collect();
        let wanted: HashSet<AdapterId> = head
            .map(|(h, _, _)| h)
            .into_iter()
            .chain(rest.iter().copied())
            .filter_map(|s| s.adapter)
            .collect();
        let on_device = view.pool.adapters().map(|(a, _)| a);
        let on_device: Vec<AdapterId> = on_device.filter(|a| w.on_device(*a)).collect();
        for v in super::nocache::idle_drops(on_device, &in_use, &wanted) {
            w.evict(v, &mut plan);
        }
    }
    plan.kv_capacity = view.pool.kv_capacity_with(w.adapter_pages);
    plan
}
