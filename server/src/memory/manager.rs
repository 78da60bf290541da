//! The memory manager: every registered adapter's tier (disk: metadata only; host: weights in
//! host memory; device: pages in the pool), the host tier's bounds, the eviction order, and the
//! numbers it publishes. Owned by the engine thread; admission reads it through [`MemView`].
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::ids::AdapterId;

use super::admission::{AdapterState, Device, MemView};
use super::board::{Board, Residence, Tier};
use super::eviction::{order, Candidate, Decayed, EvictionPolicy};
use super::pool::{Layout, PagePool, PoolError};

/// Sizes and policy.
#[derive(Clone, Debug)]
pub struct MemoryConfig {
    /// Bytes of one page (one KV block over every layer).
    pub page_bytes: u64,
    /// Pages in the device budget (KV and adapters together).
    pub total_pages: usize,
    pub policy: EvictionPolicy,
    /// `--max-loras` (the slot count of `fixed-slots`).
    pub max_loras: usize,
    /// Most adapters registered with the engine at once, if bounded (the workers' host store).
    pub max_device_adapters: Option<usize>,
    /// Bytes of the largest adapter accepted (a `fixed-slots` slot).
    pub max_adapter_bytes: u64,
    /// `--max-cpu-loras` and `--max-cpu-lora-bytes`: the host tier (adapters not on device).
    pub host_max_adapters: usize,
    pub host_max_bytes: u64,
    /// Host → device bandwidth in bytes per second (the reload cost of a host-tier adapter).
    pub link_bytes_per_sec: f64,
}

/// What the registry tells the manager about a new adapter.
#[derive(Clone, Debug)]
pub struct AdapterMeta {
    pub id: AdapterId,
    pub path: PathBuf,
    pub bytes: u64,
    pub num_layers: usize,
    /// Seconds its last disk read and validation took.
    pub disk_secs: f64,
}

struct Entry {
    meta: AdapterMeta,
    state: AdapterState,
    host: Option<Arc<LoraAdapter>>,
    fetching: bool,
    freq: Decayed,
    last_used: f64,
    /// Loaded by a prefetch and not used since.
    prefetched: bool,
}

/// See the module docs.
pub struct MemoryManager {
    cfg: MemoryConfig,
    pool: PagePool,
    entries: HashMap<AdapterId, Entry>,
    states: HashMap<AdapterId, AdapterState>,
    order: Vec<AdapterId>,
    origin: Instant,
    board: Arc<Board>,
}

impl MemoryManager {
    pub fn new(cfg: MemoryConfig, board: Arc<Board>) -> Self {
        let layout = match cfg.policy {
            EvictionPolicy::FixedSlots => Layout::FixedSlots {
                slots: cfg.max_loras,
                slot_pages: (cfg.max_adapter_bytes.div_ceil(cfg.page_bytes.max(1)) as usize).max(1),
            },
            _ => Layout::Unified {
                max_adapters: cfg.max_device_adapters,
            },
        };
        let pool = PagePool::new(cfg.page_bytes, cfg.total_pages, layout);
        let s = &board.stats;
        s.page_bytes.store(cfg.page_bytes, Ordering::Relaxed);
        s.total_pages
            .store(cfg.total_pages as u64, Ordering::Relaxed);
        Self {
            cfg,
            pool,
            entries: HashMap::new(),
            states: HashMap::new(),
            order: Vec::new(),
            origin: Instant::now(),
            board,
        }
    }

    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.cfg.policy
    }

    pub fn board(&self) -> &Arc<Board> {
        &self.board
    }

    /// Pages an adapter of `bytes` takes.
    pub fn pages_for(&self, bytes: u64) -> usize {
        self.pool.pages_for(bytes)
    }

    pub fn contains(&self, id: AdapterId) -> bool {
        self.entries.contains_key(&id)
    }

    pub fn state(&self, id: AdapterId) -> Option<AdapterState> {
        self.states.get(&id).copied()
    }

    /// A new adapter; `host` is its parsed copy if the caller has one (kept if the host tier
    /// has room, so a first request need not read the disk again).
    pub fn register(&mut self, meta: AdapterMeta, host: Option<Arc<LoraAdapter>>) {
        let id = meta.id;
        let state = AdapterState {
            pages: self.pool.pages_for(meta.bytes),
            device: Device::Absent,
            in_host: host.is_some(),
        };
        self.states.insert(id, state);
        let now = self.now();
        self.entries.insert(
            id,
            Entry {
                meta,
                state,
                host,
                fetching: false,
                freq: Decayed::default(),
                last_used: now,
                prefetched: false,
            },
        );
        self.trim_host(&HashSet::new());
        self.publish_one(id);
    }

    /// Forgets an adapter (unloaded, no request left); true if the engine still has it.
    pub fn forget(&mut self, id: AdapterId) -> bool {
        let was = self.pool.remove(id).is_some();
        self.entries.remove(&id);
        self.states.remove(&id);
        self.board.remove(id);
        was
    }

    /// A request for `id` arrived; true if its adapter was on the device (a hit).
    pub fn on_arrival(&mut self, id: AdapterId) -> bool {
        let now = self.now();
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        e.freq.hit(now);
        e.last_used = now;
        let hit = e.state.device != Device::Absent;
        let c = if hit {
            &self.board.stats.hits
        } else {
            &self.board.stats.misses
        };
        c.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// A request that missed its adapter at arrival is admitted: a prefetch hit if a prefetch
    /// brought the adapter in meanwhile.
    pub fn on_admit(&mut self, id: AdapterId, missed: bool) {
        let now = self.now();
        if let Some(e) = self.entries.get_mut(&id) {
            e.last_used = now;
            if e.prefetched && missed {
                self.board
                    .stats
                    .prefetch_hits
                    .fetch_add(1, Ordering::Relaxed);
            }
            e.prefetched = false;
        }
    }

    /// Recomputes the eviction order; `wanted` are adapters of queued requests.
    pub fn view(&mut self, wanted: &HashSet<AdapterId>) -> MemView<'_> {
        let link = self.cfg.link_bytes_per_sec.max(1.0);
        let now = self.now();
        let (hn, hb) = self.host_usage();
        let host_room =
            |bytes: u64| hn < self.cfg.host_max_adapters && hb + bytes <= self.cfg.host_max_bytes;
        let cands: Vec<Candidate<AdapterId>> = self
            .entries
            .values()
            .filter(|e| e.state.device != Device::Absent)
            .map(|e| Candidate {
                key: e.meta.id,
                frequency: e.freq.value(now),
                last_used: e.last_used,
                // Evicting keeps the host copy when the host tier has room; count a reload
                // from disk otherwise.
                reload_secs: e.meta.bytes as f64 / link
                    + if host_room(e.meta.bytes) {
                        0.0
                    } else {
                        e.meta.disk_secs
                    },
                queued: wanted.contains(&e.meta.id),
            })
            .collect();
        self.order = order(self.cfg.policy, &cands);
        MemView {
            pool: &self.pool,
            adapters: &self.states,
            eviction_order: &self.order,
        }
    }

    fn host_usage(&self) -> (usize, u64) {
        self.entries
            .values()
            .filter(|e| e.host.is_some() && e.state.device == Device::Absent)
            .fold((0, 0), |(n, b), e| (n + 1, b + e.meta.bytes))
    }

    /// The host copy to register with the engine.
    pub fn host_copy(&self, id: AdapterId) -> Option<Arc<LoraAdapter>> {
        self.entries.get(&id)?.host.clone()
    }

    /// The engine took `id`: its pages are the pool's now.
    pub fn on_registered(
        &mut self,
        id: AdapterId,
        kv_reserved: usize,
        prefetch: bool,
    ) -> Result<(), PoolError> {
        let Some(e) = self.entries.get_mut(&id) else {
            return Ok(());
        };
        self.pool.insert(id, e.state.pages, kv_reserved)?;
        e.state.device = Device::Loading;
        e.prefetched = prefetch;
        self.states.insert(id, e.state);
        let s = &self.board.stats;
        s.loads.fetch_add(1, Ordering::Relaxed);
        if prefetch {
            s.prefetches.fetch_add(1, Ordering::Relaxed);
        }
        self.publish_one(id);
        Ok(())
    }

    /// The engine refused `id`: its pages go back, it stays where it was.
    pub fn on_register_failed(&mut self, id: AdapterId) {
        self.pool.remove(id);
        if let Some(e) = self.entries.get_mut(&id) {
            e.state.device = Device::Absent;
            self.states.insert(id, e.state);
        }
        self.publish_one(id);
    }

    /// The engine dropped `id` to make room: back to the host tier (or disk).
    pub fn on_evicted(&mut self, id: AdapterId, wanted: &HashSet<AdapterId>) {
        if self.pool.remove(id).is_none() {
            return;
        }
        if let Some(e) = self.entries.get_mut(&id) {
            e.state.device = Device::Absent;
            e.prefetched = false;
            self.states.insert(id, e.state);
        }
        self.board.stats.evictions.fetch_add(1, Ordering::Relaxed);
        self.trim_host(wanted);
        self.publish_one(id);
    }

    /// Updates streaming adapters from `landed(id) -> (landed, layers)`.
    pub fn refresh_landed(&mut self, landed: impl Fn(AdapterId) -> Option<(usize, usize)>) {
        let loading: Vec<AdapterId> = self
            .entries
            .values()
            .filter(|e| e.state.device == Device::Loading)
            .map(|e| e.meta.id)
            .collect();
        for id in loading {
            if let Some((l, n)) = landed(id) {
                self.board.set(
                    id,
                    Residence {
                        tier: Tier::Device,
                        landed_layers: l,
                    },
                );
                if l >= n {
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.state.device = Device::Resident;
                        self.states.insert(id, e.state);
                    }
                }
            }
        }
    }

    /// Marks `id` as being read from disk; its path, unless it needs no read.
    pub fn start_fetch(&mut self, id: AdapterId) -> Option<PathBuf> {
        let e = self.entries.get_mut(&id)?;
        if e.fetching || e.host.is_some() {
            return None;
        }
        e.fetching = true;
        self.board.stats.fetches.fetch_add(1, Ordering::Relaxed);
        Some(e.meta.path.clone())
    }

    /// Expected bytes of `id`'s weights (a fetched copy must match).
    pub fn bytes(&self, id: AdapterId) -> Option<u64> {
        self.entries.get(&id).map(|e| e.meta.bytes)
    }

    /// A disk read finished. `wanted` are adapters of queued requests, kept over the bound.
    pub fn on_fetched(
        &mut self,
        id: AdapterId,
        host: Option<Arc<LoraAdapter>>,
        wanted: &HashSet<AdapterId>,
    ) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        e.fetching = false;
        e.state.in_host = host.is_some();
        e.host = host;
        self.states.insert(id, e.state);
        self.trim_host(wanted);
        self.publish_one(id);
    }

    /// Drops host copies (least recently used first) of adapters on neither the device nor a
    /// queued request's wish list until the host tier is within its bounds.
    fn trim_host(&mut self, wanted: &HashSet<AdapterId>) {
        let (mut n, mut b) = self.host_usage();
        if n <= self.cfg.host_max_adapters && b <= self.cfg.host_max_bytes {
            return;
        }
        let mut lru: Vec<(f64, AdapterId, u64)> = self
            .entries
            .values()
            .filter(|e| e.host.is_some() && e.state.device == Device::Absent)
            .filter(|e| !wanted.contains(&e.meta.id))
            .map(|e| (e.last_used, e.meta.id, e.meta.bytes))
            .collect();
        lru.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id, bytes) in lru {
            if n <= self.cfg.host_max_adapters && b <= self.cfg.host_max_bytes {
                break;
            }
            if let Some(e) = self.entries.get_mut(&id) {
                e.host = None;
                e.state.in_host = false;
                self.states.insert(id, e.state);
            }
            n -= 1;
            b -= bytes;
            self.board
                .stats
                .host_evictions
                .fetch_add(1, Ordering::Relaxed);
            self.publish_one(id);
        }
    }

    fn publish_one(&self, id: AdapterId) {
        let Some(e) = self.entries.get(&id) else {
            return;
        };
        let tier = match (e.state.device, &e.host) {
            (Device::Absent, Some(_)) => Tier::Host,
            (Device::Absent, None) => Tier::Disk,
            _ => Tier::Device,
        };
        let landed_layers = match e.state.device {
            Device::Resident => e.meta.num_layers,
            _ => self
                .board
                .residence(id)
                .filter(|r| r.tier == Tier::Device && e.state.device == Device::Loading)
                .map_or(0, |r| r.landed_layers),
        };
        self.board.set(
            id,
            Residence {
                tier,
                landed_layers,
            },
        );
    }

    /// Publishes the budget's split; `kv_reserved` and `kv_used` are in pages.
    pub fn publish(&self, kv_reserved: usize, kv_used: usize) {
        let s = &self.board.stats;
        let (mut dn, mut db, mut hn, mut hb, mut disk) = (0u64, 0u64, 0u64, 0u64, 0u64);
        for e in self.entries.values() {
            match (e.state.device, &e.host) {
                (Device::Absent, Some(_)) => {
                    hn += 1;
                    hb += e.meta.bytes;
                }
                (Device::Absent, None) => disk += 1,
                _ => {
                    dn += 1;
                    db += e.meta.bytes;
                }
            }
        }
        let set = |a: &std::sync::atomic::AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&s.kv_reserved_pages, kv_reserved as u64);
        set(&s.kv_used_pages, kv_used as u64);
        set(&s.adapter_pages, self.pool.adapter_pages() as u64);
        set(&s.device_adapters, dn);
        set(&s.device_bytes, db);
        set(&s.host_adapters, hn);
        set(&s.host_bytes, hb);
        set(&s.disk_adapters, disk);
    }
}
