//! Admission and pool together, driven by a simulated engine: never over-committed, no leased
//! adapter evicted, KV pressure shrinks the cache, every request runs, bypass bounded.
use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use thaw_runtime::ids::{AdapterId, SeqId};

use super::admission::{
    admit, predicted_steps, AdapterState, Device, EvictionOrder, Limits, MemView, Registered,
};
use super::pool::{Layout, PagePool};
use crate::scheduler::{
    choose_preemptions, plan_step_admitting, runners, step_needs, Gate, SchedConfig, SchedState,
    SeqState,
};

/// One request: (arrival step, prompt, max new tokens, adapter index or none).
type Req = (usize, usize, usize, Option<u32>);

/// Admitted ids and the blocked head with its predicted wait.
type Stepped = (Vec<SeqId>, Option<(SeqId, usize)>);

struct Sim {
    cfg: SchedConfig,
    pool: PagePool,
    lim: Limits,
    adapters: HashMap<AdapterId, AdapterState>,
    /// Steps left on each adapter's disk read.
    fetching: HashMap<AdapterId, usize>,
    fetch_steps: usize,
    /// Steps a load takes to land (1: by the end of the step that loaded it), and the steps
    /// left on each adapter still streaming.
    land_steps: usize,
    landing: HashMap<AdapterId, usize>,
    last_used: HashMap<AdapterId, usize>,
    state: SchedState,
}

impl Sim {
    fn new(cfg: SchedConfig, lim: Limits, pages: &[(usize, bool)], fetch_steps: usize) -> Self {
        let adapters = pages
            .iter()
            .enumerate()
            .map(|(i, &(p, host))| {
                (
                    AdapterId(i as u32),
                    AdapterState {
                        pages: p,
                        device: Device::Absent,
                        in_host: host,
                    },
                )
            })
            .collect();
        Self {
            pool: PagePool::new(
                1,
                cfg.total_blocks,
                Layout::Unified {
                    max_streaming: None,
                },
            ),
            cfg,
            lim,
            adapters,
            fetching: HashMap::new(),
            fetch_steps,
            land_steps: 1,
            landing: HashMap::new(),
            last_used: HashMap::new(),
            state: SchedState::default(),
        }
    }

    /// At most `max` adapters streaming at once (the workers' host store), each taking
    /// `land_steps` steps to land.
    fn streaming(mut self, max: usize, land_steps: usize) -> Self {
        self.pool = PagePool::new(
            1,
            self.cfg.total_blocks,
            Layout::Unified {
                max_streaming: Some(max),
            },
        );
        self.land_steps = land_steps;
        self
    }

    /// Blocks on demand, as the engine loop makes room: when the running requests cannot
    /// all get their next step's blocks, idle adapters leave first, then requests are
    /// preempted.
    fn make_room(&mut self) -> Result<(), TestCaseError> {
        let used = |st: &SchedState| -> usize {
            st.running
                .iter()
                .map(|s| self.cfg.blocks_for(s.computed))
                .sum()
        };
        let need: usize = step_needs(&self.state, &self.cfg).iter().map(|n| n.1).sum();
        let busy = self.state.running_adapters();
        let mut idle: Vec<AdapterId> = self
            .pool
            .adapters()
            .map(|(a, _)| a)
            .filter(|a| !busy.contains(a))
            .collect();
        idle.sort_by_key(|a| (self.last_used.get(a).copied().unwrap_or(0), *a));
        for v in idle {
            if used(&self.state) + need <= self.pool.kv_capacity() {
                break;
            }
            self.pool.remove(v);
            self.adapters.get_mut(&v).unwrap().device = Device::Absent;
            self.landing.remove(&v);
        }
        let free = self.pool.kv_capacity().saturating_sub(used(&self.state));
        let run = runners(&self.state, &self.cfg, |s| s.held_blocks(&self.cfg));
        for id in choose_preemptions(&run, free) {
            prop_assert!(self.state.preempt(id, &self.cfg));
        }
        Ok(())
    }

    /// One planning round plus one engine step; returns the admitted ids and the plan's head.
    fn step(&mut self, t: usize) -> Result<Stepped, TestCaseError> {
        self.make_room()?;
        let mut order: Vec<AdapterId> = self
            .adapters
            .iter()
            .filter(|(_, s)| s.device != Device::Absent)
            .map(|(a, _)| *a)
            .collect();
        order.sort_by_key(|a| (self.last_used.get(a).copied().unwrap_or(0), *a));
        let view = MemView {
            pool: &self.pool,
            adapters: &self.adapters,
            eviction_order: EvictionOrder::Fixed(&order),
            registered: Registered::AsTracked,
        };
        let plan = admit(
            &self.state.waiting,
            &self.state.running,
            self.state.reserved_blocks,
            &self.cfg,
            view,
            &self.lim,
        );
        let leased = self.state.running_adapters();
        for v in &plan.evict {
            prop_assert!(!leased.contains(v), "evicted leased adapter {v}");
            prop_assert!(
                self.pool.remove(*v).is_some(),
                "evicted a non-resident adapter"
            );
            self.adapters.get_mut(v).unwrap().device = Device::Absent;
            self.landing.remove(v);
        }
        for a in plan.load.iter().chain(&plan.prefetch) {
            let st = self.adapters.get_mut(a).unwrap();
            prop_assert!(st.in_host && st.device == Device::Absent);
            let r = self.pool.insert(*a, st.pages, self.state.reserved_blocks);
            prop_assert!(
                r.is_ok(),
                "admission planned a load that does not fit: {r:?}"
            );
            st.device = Device::Loading;
            self.landing.insert(*a, self.land_steps);
        }
        for a in &plan.fetch {
            self.fetching.entry(*a).or_insert(self.fetch_steps);
        }
        let used: usize = self
            .state
            .running
            .iter()
            .map(|s| self.cfg.blocks_for(s.computed))
            .sum();
        // What the engine has free: the blocks the adapters leave, less those held.
        let d = plan_step_admitting(
            &self.state,
            &self.cfg,
            self.pool.kv_capacity().saturating_sub(used),
            &|_: &SeqState, _| Gate::Go,
            &plan.admit,
            self.pool.kv_capacity(),
        );
        self.state.admit_ids(&d.admit, &self.cfg);
        let step_blocks: usize = d
            .plan
            .items
            .iter()
            .map(|it| {
                let s = self.state.running.iter().find(|s| s.id == it.seq).unwrap();
                self.cfg.blocks_for(s.computed + it.num_tokens)
            })
            .sum();
        let idle_blocks: usize = self
            .state
            .running
            .iter()
            .filter(|s| d.plan.items.iter().all(|it| it.seq != s.id))
            .map(|s| self.cfg.blocks_for(s.computed))
            .sum();
        prop_assert!(
            step_blocks + idle_blocks + self.pool.adapter_pages() <= self.pool.total(),
            "device memory over-committed"
        );
        let batch = self.state.running_adapters();
        prop_assert!(
            batch.len() <= self.lim.max_loras,
            "too many adapters in the batch"
        );
        for a in &batch {
            prop_assert!(
                self.pool.contains(*a),
                "a running request's adapter is not on device"
            );
            self.last_used.insert(*a, t);
        }
        if !self.lim.keep_idle {
            let wanted = self.state.waiting_adapters();
            for (a, _) in self.pool.adapters() {
                prop_assert!(
                    batch.contains(&a) || wanted.contains(&a),
                    "no-cache kept idle adapter {a} that no request wants"
                );
            }
        }
        // The engine: computes the plan, samples at the end of each prompt, finishes at max.
        let planned: Vec<_> = d.plan.items.iter().map(|i| (i.seq, i.num_tokens)).collect();
        let (mut sampled, mut finished) = (Vec::new(), Vec::new());
        for it in &d.plan.items {
            let s = self.state.running.iter().find(|s| s.id == it.seq).unwrap();
            if s.computed + it.num_tokens == s.total_tokens {
                sampled.push(it.seq);
                if s.total_tokens + 1 - s.prompt_len >= s.max_new_tokens {
                    finished.push(it.seq);
                }
            }
        }
        self.state.on_step(&planned, &sampled, &finished, &self.cfg);
        if !self.lim.keep_idle && !finished.is_empty() {
            // As the engine loop does after a step whose requests finished.
            let running = self.state.running_adapters();
            let on_device: Vec<AdapterId> = self.pool.adapters().map(|(a, _)| a).collect();
            for v in super::nocache::idle_drops(on_device, &running, &self.state.waiting_adapters())
            {
                self.pool.remove(v);
                self.adapters.get_mut(&v).unwrap().device = Device::Absent;
                self.landing.remove(&v);
            }
        }
        let pool = &mut self.pool;
        let adapters = &mut self.adapters;
        self.landing.retain(|a, left| {
            *left -= 1;
            if *left == 0 {
                adapters.get_mut(a).unwrap().device = Device::Resident;
                pool.mark_landed(*a);
            }
            *left > 0
        });
        self.fetching.retain(|a, left| {
            *left -= 1;
            if *left == 0 {
                self.adapters.get_mut(a).unwrap().in_host = true;
            }
            *left > 0
        });
        let head = plan.head.and_then(|h| h.bound_steps.map(|b| (h.seq, b)));
        Ok((d.admit, head))
    }

    /// Runs `reqs` to the end; returns each request's admission step. Checks that a head
    /// blocked on memory is admitted within the bound predicted when it first blocked, unless
    /// a preemption since put work back ahead of it (the bound assumes the running batch runs
    /// undisturbed).
    fn run(&mut self, reqs: &[Req], check_bound: bool) -> Result<Vec<usize>, TestCaseError> {
        let mut admitted = vec![usize::MAX; reqs.len()];
        // Head → (its bound's step, preemptions when it was predicted).
        let mut deadline: HashMap<SeqId, (usize, u64)> = HashMap::new();
        let mut t = 0;
        while t < 10_000 {
            for (i, r) in reqs.iter().enumerate().filter(|(_, r)| r.0 == t) {
                let mut s = SeqState::new(SeqId(i as u64), r.1, r.2);
                s.adapter = r.3.map(AdapterId);
                self.state.enqueue(s);
            }
            let (ids, head) = self.step(t)?;
            for id in ids {
                // A preempted request is admitted again later: its first admission counts.
                let Some(a) = admitted
                    .get_mut(id.0 as usize)
                    .filter(|a| **a == usize::MAX)
                else {
                    continue;
                };
                *a = t;
                if check_bound {
                    if let Some(&(d, p)) = deadline.get(&id) {
                        let undisturbed = p == self.state.preemptions;
                        prop_assert!(
                            t <= d || !undisturbed,
                            "head {id} admitted at {t}, bound was {d}"
                        );
                    }
                }
            }
            if let Some((h, b)) = head {
                deadline.entry(h).or_insert((t + b, self.state.preemptions));
            }
            t += 1;
            if self.state.is_idle() && reqs.iter().all(|r| r.0 < t) {
                return Ok(admitted);
            }
        }
        Err(TestCaseError::fail(format!(
            "no progress after {t} steps: {:?}",
            self.state
        )))
    }
}

pub(super) fn cfg(total: usize, budget: usize) -> SchedConfig {
    SchedConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: budget,
        block_size: 4,
        total_blocks: total,
        kv_reservation: crate::scheduler::KvReservation::OnDemand,
    }
}

pub(super) fn lim(max_loras: usize, max_num_seqs: usize) -> Limits {
    Limits {
        max_loras,
        max_num_seqs,
        bypass: true,
        prefetch: true,
        keep_idle: true,
    }
}

/// One step's state for a plan-level test: adapters in tiers, running and waiting requests.
#[derive(Clone)]
pub(super) struct Snapshot {
    pub pool: PagePool,
    pub adapters: HashMap<AdapterId, AdapterState>,
    /// Device adapters, in the order they were placed (the eviction order given).
    pub order: Vec<AdapterId>,
    pub running: Vec<SeqState>,
    /// The running requests' KV reservations.
    pub reserved: usize,
    pub waiting: Vec<SeqState>,
}

/// Builds a [`Snapshot`]: `tiers` are (pages, 0 disk / 1 host / 2 device) per adapter;
/// `running` (prompt, adapter index) keeps those whose adapter is on the device and whose KV
/// fits beside the device adapters; `waiting` is (prompt, max new tokens, adapter index).
pub(super) fn snapshot(
    c: &SchedConfig,
    tiers: &[(usize, u8)],
    running: &[(usize, u32)],
    waiting: &[(usize, usize, Option<u32>)],
) -> Snapshot {
    let mut pool = PagePool::new(
        1,
        c.total_blocks,
        Layout::Unified {
            max_streaming: None,
        },
    );
    let mut adapters = HashMap::new();
    let mut order = Vec::new();
    for (i, &(pages, tier)) in tiers.iter().enumerate() {
        let a = AdapterId(i as u32);
        // A device adapter (if it fits) keeps its host copy.
        let device = tier == 2 && pool.insert(a, pages, 0).is_ok();
        if device {
            order.push(a);
        }
        adapters.insert(
            a,
            AdapterState {
                pages,
                device: if device {
                    Device::Resident
                } else {
                    Device::Absent
                },
                in_host: tier >= 1,
            },
        );
    }
    let n = tiers.len() as u32;
    let mut reserved = 0;
    let mut run = Vec::new();
    for (i, &(prompt, a)) in running.iter().enumerate() {
        let a = AdapterId(a % n);
        let s = SeqState {
            adapter: Some(a),
            ..SeqState::new(SeqId(1000 + i as u64), prompt, 4)
        };
        let r = s.reservation(c);
        if pool.contains(a) && reserved + r <= pool.kv_capacity() {
            reserved += r;
            run.push(s);
        }
    }
    let waiting = waiting
        .iter()
        .enumerate()
        .map(|(i, &(p, m, a))| SeqState {
            adapter: a.map(|a| AdapterId(a % n)),
            ..SeqState::new(SeqId(i as u64), p, m)
        })
        .collect();
    Snapshot {
        pool,
        adapters,
        order,
        running: run,
        reserved,
        waiting,
    }
}

/// Adapters for the simulated runs: (pages, starts in the host tier).
fn adapter_pages() -> impl Strategy<Value = Vec<(usize, bool)>> {
    proptest::collection::vec((1usize..8, any::<bool>()), 1..10)
}

/// Requests for the simulated runs: (arrival step, prompt, output, adapter index or none).
fn arrivals() -> impl Strategy<Value = Vec<Req>> {
    proptest::collection::vec(
        (
            0usize..40,
            1usize..40,
            1usize..12,
            proptest::option::of(0u32..10),
        ),
        1..40,
    )
}

/// Requests that fit the pool alone beside their adapter.
fn fitting(reqs: Vec<Req>, c: &SchedConfig, pages: &[(usize, bool)]) -> Vec<Req> {
    reqs.into_iter()
        .map(|(t, p, m, a)| (t, p, m, a.map(|a| a % pages.len() as u32)))
        .filter(|&(_, p, m, a)| {
            c.blocks_for(p + m) + a.map_or(0, |a| pages[a as usize].0) <= c.total_blocks
        })
        .collect()
}

/// The workers' host store bounds only adapters still streaming: with room for one, six
/// adapters used one after another all stay on the device once landed (before, the bound was
/// on every adapter registered, so the cache held at most `--max-cpu-loras`).
#[test]
fn landed_adapters_are_not_bounded_by_the_host_store() {
    let pages = vec![(1, true); 6];
    let mut sim = Sim::new(cfg(100, 64), lim(4, 8), &pages, 1).streaming(1, 3);
    // Each arrives after the one before has landed (3 steps).
    let reqs: Vec<Req> = (0..6).map(|i| (5 * i, 4, 2, Some(i as u32))).collect();
    let admitted = sim.run(&reqs, false).unwrap();
    assert!(admitted.iter().all(|t| *t != usize::MAX));
    assert_eq!(
        sim.pool.counts().adapters,
        6,
        "every adapter stays on the device"
    );
    assert!(
        sim.pool.counts().streaming <= 1,
        "the last may still be streaming"
    );
    // Two arriving together: the second waits for the first, which its running request
    // pins, to land (steps 0–2), then loads.
    let mut sim = Sim::new(cfg(100, 64), lim(4, 8), &pages, 1).streaming(1, 3);
    let admitted = sim
        .run(&[(0, 4, 10, Some(0)), (0, 4, 2, Some(1))], false)
        .unwrap();
    assert_eq!(admitted, vec![0, 3]);
    // An idle adapter still streaming gives its slot up to a waiting request's: evicted.
    let mut sim = Sim::new(cfg(100, 64), lim(4, 8), &pages, 1).streaming(1, 3);
    let admitted = sim
        .run(&[(0, 4, 1, Some(0)), (1, 4, 2, Some(1))], false)
        .unwrap();
    assert_eq!(admitted, vec![0, 1]);
    assert!(!sim.pool.contains(AdapterId(0)));
}

#[test]
fn disk_adapter_is_fetched_and_resident_requests_bypass_it() {
    let c = cfg(40, 64);
    let mut sim = Sim::new(c, lim(4, 8), &[(4, false), (4, true)], 3);
    sim.state.enqueue(SeqState {
        adapter: Some(AdapterId(0)),
        ..SeqState::new(SeqId(0), 8, 4)
    });
    sim.state.enqueue(SeqState {
        adapter: Some(AdapterId(1)),
        ..SeqState::new(SeqId(1), 8, 4)
    });
    let (ids, _) = sim.step(0).unwrap();
    assert_eq!(
        ids,
        vec![SeqId(1)],
        "the host-tier adapter's request passes"
    );
    assert!(
        sim.fetching.contains_key(&AdapterId(0)),
        "the disk one is read"
    );
    let admitted = sim.run(&[], false).unwrap();
    assert!(admitted.is_empty());
    assert!(sim.state.is_idle(), "the fetched request ran too");
}

#[test]
fn max_loras_caps_distinct_adapters_per_batch() {
    let c = cfg(100, 64);
    let mut sim = Sim::new(c, lim(2, 8), &[(1, true), (1, true), (1, true)], 1);
    // Request 3 shares adapter 0 but would outlive the head's predicted wait: no bypass.
    for (i, (a, m)) in [(0u32, 8), (1, 8), (2, 8), (0, 16)].into_iter().enumerate() {
        sim.state.enqueue(SeqState {
            adapter: Some(AdapterId(a)),
            ..SeqState::new(SeqId(i as u64), 4, m)
        });
    }
    let (ids, head) = sim.step(0).unwrap();
    assert_eq!(ids, vec![SeqId(0), SeqId(1)], "adapter 2 must wait");
    assert_eq!(head, Some((SeqId(2), 8)));
    assert!(sim.run(&[], true).is_ok());
}

/// A full batch (here `--max-loras 1`) does not hold back the adapters of those waiting: the
/// disk ones are read and the host ones loaded into free pages, so each is on the device when
/// a place opens. Chameleon's and S-LoRA's prefetch of queued requests' adapters; before,
/// a request blocked by the batch limits started its disk read only once admissible.
#[test]
fn a_full_batch_still_reads_and_prefetches_queued_adapters() {
    let c = cfg(100, 64);
    let mut pool = PagePool::new(
        1,
        100,
        Layout::Unified {
            max_streaming: None,
        },
    );
    let st = |pages, device, in_host| AdapterState {
        pages,
        device,
        in_host,
    };
    let mut adapters = HashMap::new();
    adapters.insert(AdapterId(0), st(4, Device::Resident, true));
    pool.insert(AdapterId(0), 4, 0).unwrap();
    adapters.insert(AdapterId(1), st(4, Device::Absent, false));
    adapters.insert(AdapterId(2), st(4, Device::Absent, true));
    adapters.insert(AdapterId(3), st(4, Device::Absent, false));
    let running = vec![SeqState {
        adapter: Some(AdapterId(0)),
        ..SeqState::new(SeqId(9), 4, 4)
    }];
    let reserved = running[0].reservation(&c);
    let waiting: Vec<SeqState> = [1u32, 2, 3, 1]
        .iter()
        .enumerate()
        .map(|(i, a)| SeqState {
            adapter: Some(AdapterId(*a)),
            ..SeqState::new(SeqId(i as u64), 4, 4)
        })
        .collect();
    let order = [AdapterId(0)];
    let view = MemView {
        pool: &pool,
        adapters: &adapters,
        eviction_order: EvictionOrder::Fixed(&order),
        registered: Registered::AsTracked,
    };
    let plan = admit(&waiting, &running, reserved, &c, view, &lim(1, 8));
    assert!(plan.admit.is_empty(), "one adapter per batch: all wait");
    assert_eq!(plan.head.map(|h| h.seq), Some(SeqId(0)));
    assert_eq!(plan.fetch, vec![AdapterId(1), AdapterId(3)]);
    assert_eq!(plan.prefetch, vec![AdapterId(2)]);
    assert!(plan.evict.is_empty());
}

proptest! {
    /// Idle adapters never make a request wait for KV: however full the cache, a request that
    /// fits beside the leased adapters is admitted, evicting idle ones.
    #[test]
    fn kv_pressure_shrinks_the_cache(
        pages in proptest::collection::vec(1usize..6, 1..12),
        prompt in 1usize..80,
        leased in 0usize..3,
    ) {
        let total = 40;
        let c = cfg(total, 256);
        let mut adapters = HashMap::new();
        let mut pool = PagePool::new(1, total, Layout::Unified { max_streaming: None });
        let mut order = Vec::new();
        for (i, p) in pages.iter().enumerate() {
            let a = AdapterId(i as u32);
            if pool.insert(a, *p, 0).is_ok() {
                adapters.insert(a, AdapterState { pages: *p, device: Device::Resident, in_host: true });
                order.push(a);
            }
        }
        let running: Vec<SeqState> = order.iter().take(leased).enumerate().map(|(i, a)| SeqState {
            adapter: Some(*a),
            ..SeqState::new(SeqId(100 + i as u64), 1, 1)
        }).collect();
        let reserved: usize = running.iter().map(|s| s.reservation(&c)).sum();
        let pinned: usize = running.iter().map(|s| adapters[&s.adapter.unwrap()].pages).sum();
        let req = SeqState::new(SeqId(1), prompt, 4);
        let view = MemView { pool: &pool, adapters: &adapters, eviction_order: EvictionOrder::Fixed(&order), registered: Registered::AsTracked };
        let plan = admit([&req], &running, reserved, &c, view, &lim(16, 16));
        let fits = reserved + pinned + req.reservation(&c) <= total;
        prop_assert_eq!(plan.admit == vec![SeqId(1)], fits);
        let leased: HashSet<_> = running.iter().filter_map(|s| s.adapter).collect();
        prop_assert!(plan.evict.iter().all(|v| !leased.contains(v)));
        if fits {
            let freed: usize = plan.evict.iter().map(|v| adapters[v].pages).sum();
            prop_assert!(reserved + req.reservation(&c) <= plan.kv_capacity);
            prop_assert_eq!(plan.kv_capacity, total - pool.adapter_pages() + freed);
        }
    }

    /// Random arrivals, adapters partly on disk, tight memory: the pool is never
    /// over-committed, no leased adapter is evicted, and every request runs; under the
    /// `no-cache` baseline also no adapter stays on the device that no request uses or wants.
    #[test]
    fn every_queued_request_eventually_runs(
        pages in adapter_pages(),
        reqs in arrivals(),
        total in 16usize..60,
        budget in 4usize..64,
        max_loras in 1usize..4,
        max_seqs in 1usize..8,
        bypass in any::<bool>(),
        prefetch in any::<bool>(),
        keep_idle in any::<bool>(),
        fetch_steps in 1usize..6,
    ) {
        let c = cfg(total, budget);
        let reqs = fitting(reqs, &c, &pages);
        let l = Limits { bypass, prefetch, keep_idle, ..lim(max_loras, max_seqs) };
        let mut sim = Sim::new(c, l, &pages, fetch_steps);
        let admitted = sim.run(&reqs, false)?;
        prop_assert!(admitted.iter().all(|t| *t != usize::MAX), "a request never ran");
    }

    /// With at most `max` adapters streaming at once, each landing after some steps: no plan
    /// loads past the bound (the simulated pool refuses it), nothing is over-committed, no
    /// leased adapter is evicted, and every request runs.
    #[test]
    fn the_streaming_bound_holds_and_every_request_runs(
        pages in adapter_pages(),
        reqs in arrivals(),
        total in 16usize..60,
        max_loras in 1usize..4,
        max_seqs in 1usize..8,
        bypass in any::<bool>(),
        max_streaming in 1usize..3,
        land_steps in 1usize..5,
    ) {
        let c = cfg(total, 64);
        let reqs = fitting(reqs, &c, &pages);
        let l = Limits { bypass, ..lim(max_loras, max_seqs) };
        let mut sim = Sim::new(c, l, &pages, 2).streaming(max_streaming, land_steps);
        let admitted = sim.run(&reqs, false)?;
        prop_assert!(admitted.iter().all(|t| *t != usize::MAX), "a request never ran");
        prop_assert!(sim.pool.counts().streaming <= max_streaming);
    }

    /// With exact predictions (ample token budget, no early stops, adapters in host memory),
    /// a head blocked on memory is admitted within the wait predicted when it first blocked,
    /// however many requests bypassed it.
    #[test]
    fn bypass_never_delays_the_head_past_its_bound(
        pages in proptest::collection::vec(1usize..8, 1..8),
        reqs in proptest::collection::vec((0usize..30, 1usize..30, 1usize..16, proptest::option::of(0u32..8)), 1..40),
        total in 16usize..50,
        max_loras in 1usize..4,
        max_seqs in 1usize..8,
    ) {
        let pages: Vec<(usize, bool)> = pages.into_iter().map(|p| (p, true)).collect();
        let c = cfg(total, 100_000);
        let reqs = fitting(reqs, &c, &pages);
        let mut sim = Sim::new(c, lim(max_loras, max_seqs), &pages, 1);
        sim.run(&reqs, true)?;
    }
}

proptest! {
    /// Whatever makes the waiting requests wait (full batch, memory, their own reads), every
    /// adapter of theirs that is only on disk is read this step, once, and nothing else is;
    /// prefetches only fill free pages (nothing evicted for them, nothing over-committed).
    #[test]
    fn every_queued_disk_adapter_is_read_whatever_blocks_it(
        tiers in proptest::collection::vec((1usize..8, 0u8..3), 1..10),
        running in proptest::collection::vec((1usize..20, 0u32..10), 0..6),
        waiting in proptest::collection::vec((1usize..40, 1usize..12, proptest::option::of(0u32..10)), 1..20),
        total in 16usize..80,
        max_loras in 1usize..4,
        max_seqs in 1usize..8,
        bypass in any::<bool>(),
    ) {
        let c = cfg(total, 64);
        let Snapshot { pool, adapters, order, running: run, reserved, waiting: wait } =
            snapshot(&c, &tiers, &running, &waiting);
        let view = MemView { pool: &pool, adapters: &adapters, eviction_order: EvictionOrder::Fixed(&order), registered: Registered::AsTracked };
        let l = Limits { bypass, ..lim(max_loras, max_seqs) };
        let plan = admit(&wait, &run, reserved, &c, view, &l);
        let mut want = Vec::new();
        for a in wait.iter().filter_map(|s| s.adapter) {
            let st = adapters[&a];
            if !st.in_host && st.device == Device::Absent && !want.contains(&a) {
                want.push(a);
            }
        }
        prop_assert_eq!(&plan.fetch, &want);
        let mut after = pool.clone();
        for v in &plan.evict {
            prop_assert!(after.remove(*v).is_some());
        }
        let evicted_for_prefetch = plan.prefetch.iter().any(|a| plan.evict.contains(a));
        prop_assert!(!evicted_for_prefetch);
        for a in plan.load.iter().chain(&plan.prefetch) {
            prop_assert!(adapters[a].in_host);
            let r = after.insert(*a, adapters[a].pages, reserved);
            prop_assert!(r.is_ok(), "planned load does not fit: {:?}", r);
        }
    }
}

#[test]
fn predicted_steps_counts_prefill_chunks_and_decode() {
    let c = cfg(10, 8);
    let mut s = SeqState::new(SeqId(0), 20, 5);
    assert_eq!(predicted_steps(&s, &c), 3 + 4);
    s.computed = 21;
    s.total_tokens = 22;
    assert_eq!(predicted_steps(&s, &c), 3);
    // Preempted after two tokens: prompt and output again in 3 chunks, then 2 more tokens.
    s.computed = 0;
    assert_eq!(predicted_steps(&s, &c), 3 + 2);
}

/// The manager's eviction order is computed only when admission needs a victim, and then it
/// is the policy's order: admitting with room leaves it uncomputed, and a request that must
/// evict gets the same plan as with the order given up front.
#[test]
fn eviction_order_is_computed_only_when_a_victim_is_needed() {
    use std::sync::Arc;

    use super::board::Board;
    use super::eviction::EvictionPolicy;
    use super::manager::{AdapterMeta, MemoryConfig, MemoryManager};

    let total = 40;
    let mut m = MemoryManager::new(
        MemoryConfig {
            page_bytes: 1,
            total_pages: total,
            policy: EvictionPolicy::Cost,
            max_loras: 16,
            max_streaming_adapters: None,
            host_max_adapters: 16,
            host_max_bytes: 1 << 20,
        },
        Arc::new(Board::default()),
    );
    for i in 0..6u32 {
        m.register(
            AdapterMeta {
                id: AdapterId(i),
                path: format!("/nowhere/{i}").into(),
                root: None,
                bytes: 5,
                num_layers: 2,
                disk_secs: 0.001,
            },
            None,
        );
        m.on_registered(AdapterId(i), 0, false).unwrap();
    }
    let c = cfg(total, 256);
    let wanted = HashSet::new();
    let reload = |_: crate::perf::Tier, bytes: u64| bytes as f64 * 1e-6;
    // 30 of 40 pages hold adapters: a 2-block request fits, a 12-block one must evict.
    let small = SeqState::new(SeqId(1), 4, 4);
    let view = m.view(&wanted, &reload);
    let plan = admit([&small], &[], 0, &c, view, &lim(16, 16));
    assert_eq!((plan.admit, plan.evict.len()), (vec![SeqId(1)], 0));
    assert!(
        !m.order_computed(),
        "a step that evicts nothing scored the device"
    );

    let big = SeqState::new(SeqId(2), 44, 4);
    let view = m.view(&wanted, &reload);
    let lazy = admit([&big], &[], 0, &c, view, &lim(16, 16));
    assert!(m.order_computed());
    assert_eq!(lazy.admit, vec![SeqId(2)]);
    assert!(!lazy.evict.is_empty());
    let order = m.compute_order(&wanted, &reload);
    let states = m.view(&wanted, &reload).adapters.clone();
    let view = MemView {
        pool: m.pool(),
        adapters: &states,
        eviction_order: EvictionOrder::Fixed(&order),
        registered: Registered::AsTracked,
    };
    let fixed = admit([&big], &[], 0, &c, view, &lim(16, 16));
    assert_eq!((lazy.admit, lazy.evict), (fixed.admit, fixed.evict));
    // A new view starts uncomputed.
    let _ = m.view(&wanted, &reload);
    assert!(!m.order_computed());
}

/// Admission makes room for the watermark the step planner leaves free (vLLM's 1% of the
/// cache): a request whose first chunk fits the KV that idle adapters leave, but not with the
/// watermark too, has an idle adapter evicted for it. Before, admission found it fitting
/// (evicting nothing) and the planner refused it every step: with nothing running, nothing
/// ever freed a block and the queue stalled (the is28 benchmark's never-finished requests).
#[test]
fn a_head_that_fits_only_without_the_watermark_gets_room() {
    let c = cfg(100, 160);
    assert_eq!(c.watermark(), 1);
    let mut sim = Sim::new(c, lim(4, 8), &[(60, true)], 1);
    // Adapter 0 (60 pages) is loaded for request 0 and stays, idle; request 1's first chunk
    // is 40 blocks: exactly the KV capacity beside it.
    let admitted = sim
        .run(&[(0, 4, 1, Some(0)), (5, 160, 1, None)], false)
        .unwrap();
    assert_eq!(admitted, vec![0, 5]);
    assert!(
        !sim.pool.contains(AdapterId(0)),
        "the idle adapter made room"
    );
}
