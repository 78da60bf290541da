//! The memory manager: every registered adapter's tier (disk: metadata only; host: weights in
//! host memory; device: pages in the pool), the host tier's bounds, the eviction order, and the
//! numbers it publishes. Owned by the engine thread; admission reads it through [`MemView`].
use std::cell::OnceCell;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::ids::AdapterId;

use super::admission::{AdapterState, Device, EvictionOrder, MemView, Registered};
use super::board::{Board, Residence, Tier as Placed};
use super::eviction::{order, Candidate, Decayed, EvictionPolicy};
use super::pool::{Layout, PagePool, PoolError};
use super::tiers::{Place, TierIndex};
use crate::perf::Tier;

/// Seconds to bring an adapter of `bytes` from a tier to the device: the one performance
/// model's [`crate::perf::PerfModel::load_time_from`] (link rate and latency, disk rate), so
/// the eviction score's reload cost is what the planner and the scheduler predict too.
pub type ReloadCost<'a> = &'a dyn Fn(Tier, u64) -> f64;

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
    /// Most adapters streaming to the device at once, if bounded: the CPU workers' host store
    /// holds an adapter only until its last layer lands. Landed adapters are bounded by pages.
    pub max_streaming_adapters: Option<usize>,
    /// `--max-cpu-loras` and `--max-cpu-lora-bytes`: the host tier (adapters not on device),
    /// its bytes each adapter's device image in the upload arena and its heap copy, if it has
    /// one (a host copy read in place from its file is the page cache's, not counted).
    pub host_max_adapters: usize,
    pub host_max_bytes: u64,
}

/// What the registry tells the manager about a new adapter.
#[derive(Clone, Debug)]
pub struct AdapterMeta {
    pub id: AdapterId,
    pub path: PathBuf,
    /// The `--lora-root` a runtime load was confined to: every re-read is confined to it too.
    pub root: Option<PathBuf>,
    pub bytes: u64,
    pub num_layers: usize,
    /// Seconds its last disk read and validation took (the engine loop folds it into the
    /// performance model's disk rate).
    pub disk_secs: f64,
}

struct Entry {
    meta: AdapterMeta,
    state: AdapterState,
    host: Option<Arc<LoraAdapter>>,
    /// Arena bytes its host copy's device image holds (staged when it entered the host tier;
    /// 0 without a host copy or an image): the host tier holds both.
    image: u64,
    fetching: bool,
    /// Its file was mapped during the read in flight and not served from (refused, or the
    /// policy waits for the read): not mapped again until the next read. Mapping parses the
    /// safetensors header on the engine thread (O(tensors), ~1 ms for a 7B rank-64 adapter);
    /// asked at every plan while a read of ~100 ms ran, it took a third of the engine thread.
    map_refused: bool,
    freq: Decayed,
    last_used: f64,
    /// Loaded by a prefetch and not used since.
    prefetched: bool,
}

impl Entry {
    fn place(&self) -> Place {
        Place {
            device: self.state.device,
            host: self.host.is_some(),
            bytes: self.meta.bytes,
            heap: self.host.as_ref().map_or(0, |h| h.heap_bytes() as u64),
            image: self.image,
        }
    }
}

impl Entry {
    /// What keeping it in the host tier once evicted costs the tier's bound: its arena image
    /// and its host copy's heap bytes (0 for one read in place); its bytes when it has no host
    /// copy.
    fn kept_bytes(&self) -> u64 {
        let heap = self
            .host
            .as_ref()
            .map_or(self.meta.bytes, |h| h.heap_bytes() as u64);
        heap + self.image
    }
}

/// See the module docs.
pub struct MemoryManager {
    cfg: MemoryConfig,
    pool: PagePool,
    entries: HashMap<AdapterId, Entry>,
    states: HashMap<AdapterId, AdapterState>,
    /// This step's eviction order, computed only if admission needs a victim (see
    /// [`EvictionOrder`]); reset by every [`MemoryManager::view`].
    order: OnceCell<Vec<AdapterId>>,
    /// Adapters by tier, so per-step work is O(device + host), not O(registered).
    tiers: TierIndex,
    origin: Instant,
    board: Arc<Board>,
}

impl MemoryManager {
    pub fn new(cfg: MemoryConfig, board: Arc<Board>) -> Self {
        let layout = match cfg.policy {
            EvictionPolicy::FixedSlots => Layout::FixedSlots {
                slots: cfg.max_loras,
                slot_pages: 1,
            },
            _ => Layout::Unified {
                max_streaming: cfg.max_streaming_adapters,
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
            order: OnceCell::new(),
            tiers: TierIndex::default(),
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

    /// Pages adapter `id` takes on the device: as placed by the engine in the unified pool, a
    /// whole (current) slot in `fixed-slots`; `None` for an unknown adapter.
    pub fn device_pages(&self, id: AdapterId) -> Option<usize> {
        self.entries.get(&id).map(|e| self.entry_pages(e))
    }

    fn entry_pages(&self, e: &Entry) -> usize {
        match self.pool.layout() {
            crate::memory::Layout::Unified { .. } => e.state.pages,
            crate::memory::Layout::FixedSlots { .. } => self.pool.pages_for(e.meta.bytes),
        }
    }

    pub fn state(&self, id: AdapterId) -> Option<AdapterState> {
        self.states.get(&id).copied()
    }

    /// Changes `id`'s entry through `f`, keeping the tier index and `states` in step; false if
    /// there is no such adapter. Every change of an entry's device state or host copy goes
    /// through here.
    fn update(&mut self, id: AdapterId, f: impl FnOnce(&mut Entry)) -> bool {
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        let before = e.place();
        f(e);
        e.state.in_host = e.host.is_some();
        if e.host.is_none() {
            // The image goes with the last reference to the adapter.
            e.image = 0;
        }
        self.tiers.moved(id, before, e.place());
        self.states.insert(id, e.state);
        true
    }

    /// A new adapter; `host` is its parsed copy if the caller has one (kept if the host tier
    /// has room, so a first request need not read the disk again).
    pub fn register(&mut self, meta: AdapterMeta, host: Option<Arc<LoraAdapter>>) {
        self.register_placed(meta, host, None);
    }

    /// [`MemoryManager::register`] for an adapter the engine places in `device_pages` pages
    /// of the budget ([`thaw_runtime::engine::Engine::adapter_pages`]: on CUDA its image in
    /// KV blocks, which may take a page more than its bytes over the page size), so the
    /// pool counts the pages the engine really takes.
    pub fn register_placed(
        &mut self,
        meta: AdapterMeta,
        host: Option<Arc<LoraAdapter>>,
        device_pages: Option<usize>,
    ) {
        let id = meta.id;
        self.pool.note_adapter(meta.bytes);
        let pages = match (self.pool.layout(), device_pages) {
            (crate::memory::Layout::Unified { .. }, Some(p)) => p.max(1),
            _ => self.pool.pages_for(meta.bytes),
        };
        let state = AdapterState {
            pages,
            device: Device::Absent,
            in_host: host.is_some(),
        };
        self.states.insert(id, state);
        let now = self.now();
        let e = Entry {
            meta,
            state,
            host,
            image: 0,
            fetching: false,
            map_refused: false,
            freq: Decayed::default(),
            last_used: now,
            prefetched: false,
        };
        if let Some(old) = self.entries.insert(id, e) {
            self.tiers.remove(id, old.place());
        }
        self.tiers.add(id, self.entries[&id].place());
        self.trim_host(&HashSet::new());
        self.publish_one(id);
    }

    /// Forgets an adapter (unloaded, no request left); true if the engine still has it.
    pub fn forget(&mut self, id: AdapterId) -> bool {
        let was = self.pool.remove(id).is_some();
        if let Some(mut e) = self.entries.remove(&id) {
            self.tiers.remove(id, e.place());
            if let Some(h) = e.host.take() {
                thaw_runtime::upload::drop_later(h);
            }
        }
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

    /// This step's view for admission; `wanted` are adapters of queued requests, `reload` the
    /// performance model's load time per tier. The eviction order is left to be computed on
    /// first use.
    pub fn view<'a>(
        &'a mut self,
        wanted: &'a HashSet<AdapterId>,
        reload: ReloadCost<'a>,
    ) -> MemView<'a> {
        self.order = OnceCell::new();
        let me: &'a Self = self;
        MemView {
            pool: &me.pool,
            adapters: &me.states,
            eviction_order: EvictionOrder::Lazy {
                order: &me.order,
                compute: me,
                wanted,
                reload,
            },
            registered: Registered::AsTracked,
        }
    }

    /// Whether this step's eviction order has been computed (tests: a step that evicts
    /// nothing must not pay for scoring every device-resident adapter).
    pub fn order_computed(&self) -> bool {
        self.order.get().is_some()
    }

    /// The eviction policy's order over the device-resident adapters, most evictable first.
    /// O(d log d) in the adapters on the device, which is every registered one once they all
    /// fit; hence computed only when admission needs a victim.
    pub(super) fn compute_order(
        &self,
        wanted: &HashSet<AdapterId>,
        reload: ReloadCost<'_>,
    ) -> Vec<AdapterId> {
        let now = self.now();
        let (hn, hb) = self.host_usage();
        let host_room =
            |bytes: u64| hn < self.cfg.host_max_adapters && hb + bytes <= self.cfg.host_max_bytes;
        let cands: Vec<Candidate<AdapterId>> = self
            .tiers
            .device()
            .iter()
            .filter_map(|id| self.entries.get(id))
            .map(|e| Candidate {
                key: e.meta.id,
                frequency: e.freq.value(now),
                last_used: e.last_used,
                // Evicting keeps the host copy when the host tier has room; count a reload
                // from disk otherwise.
                reload_secs: reload(
                    if host_room(e.kept_bytes()) {
                        Tier::Host
                    } else {
                        Tier::Disk
                    },
                    e.meta.bytes,
                ),
                pages: self.entry_pages(e),
                queued: wanted.contains(&e.meta.id),
            })
            .collect();
        order(self.cfg.policy, &cands)
    }

    fn host_usage(&self) -> (usize, u64) {
        let t = self.tiers.totals();
        (t.host, t.host_bytes)
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
        let Some(pages) = self.entries.get(&id).map(|e| e.state.pages) else {
            return Ok(());
        };
        self.pool.insert(id, pages, kv_reserved)?;
        self.update(id, |e| {
            e.state.device = Device::Loading;
            e.prefetched = prefetch;
        });
        let s = &self.board.stats;
        s.loads.fetch_add(1, Ordering::Relaxed);
        if prefetch {
            s.prefetches.fetch_add(1, Ordering::Relaxed);
        }
        self.publish_one(id);
        Ok(())
    }

    /// Adapters whose every layer is on the device and that no queued request wants, least
    /// recently used first: what [`super::apply::apply`] evicts, one at a time, when the engine
    /// finds no run of consecutive pages for a load although the pages are there in number
    /// (KV blocks in use split them). A landed adapter's run is whole and freed at once; one
    /// still streaming keeps its pages until its copy ends, so it is not offered.
    pub fn idle_resident(&self, wanted: &HashSet<AdapterId>) -> Vec<AdapterId> {
        let mut idle: Vec<(f64, AdapterId)> = self
            .tiers
            .device()
            .iter()
            .filter(|id| !wanted.contains(id))
            .filter_map(|id| self.entries.get(id))
            .filter(|e| e.state.device == Device::Resident)
            .map(|e| (e.last_used, e.meta.id))
            .collect();
        idle.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1 .0.cmp(&b.1 .0)));
        idle.into_iter().map(|(_, id)| id).collect()
    }

    /// The engine refused `id`: its pages go back, it stays where it was.
    pub fn on_register_failed(&mut self, id: AdapterId) {
        self.pool.remove(id);
        self.update(id, |e| e.state.device = Device::Absent);
        self.publish_one(id);
    }

    /// The engine dropped `id` to make room: back to the host tier (or disk).
    pub fn on_evicted(&mut self, id: AdapterId, wanted: &HashSet<AdapterId>) {
        if self.pool.remove(id).is_none() {
            return;
        }
        self.update(id, |e| {
            e.state.device = Device::Absent;
            e.prefetched = false;
        });
        self.board.stats.evictions.fetch_add(1, Ordering::Relaxed);
        self.trim_host(wanted);
        self.publish_one(id);
    }

    /// The engine dropped `id` because its upload failed (a layer read from its file failed
    /// its check, or a copy failed): its pages go back, once (a second call finds none), and a
    /// host copy read in place from that file goes too, so a later request maps the file
    /// again (and is checked again) instead of uploading the copy that failed. A loader read
    /// still in flight reports as usual.
    pub fn on_upload_failed(&mut self, id: AdapterId, wanted: &HashSet<AdapterId>) {
        self.on_evicted(id, wanted);
        let mapped = |e: &Entry| e.host.as_ref().is_some_and(|h| h.is_mapped());
        if self.entries.get(&id).is_some_and(mapped) {
            self.update(id, |e| {
                if let Some(h) = e.host.take() {
                    thaw_runtime::upload::drop_later(h);
                }
            });
            self.publish_one(id);
        }
    }

    /// Updates streaming adapters from `landed(id) -> (landed, layers)`.
    pub fn refresh_landed(&mut self, landed: impl Fn(AdapterId) -> Option<(usize, usize)>) {
        let loading: Vec<AdapterId> = self.tiers.loading().iter().copied().collect();
        for id in loading {
            if let Some((l, n)) = landed(id) {
                self.board.set(
                    id,
                    Residence {
                        tier: Placed::Device,
                        landed_layers: l,
                    },
                );
                if l >= n {
                    self.update(id, |e| e.state.device = Device::Resident);
                    // The engine gives its host-store slot back by its next insert.
                    self.pool.mark_landed(id);
                }
            }
        }
    }

    /// The root `id`'s reads are confined to, if it was loaded under `--lora-root`.
    pub fn root(&self, id: AdapterId) -> Option<PathBuf> {
        self.entries.get(&id)?.meta.root.clone()
    }

    /// Marks `id` as being read from disk; its path, unless it needs no read.
    pub fn start_fetch(&mut self, id: AdapterId) -> Option<PathBuf> {
        let e = self.entries.get_mut(&id)?;
        if e.fetching || e.host.is_some() {
            return None;
        }
        e.fetching = true;
        e.map_refused = false;
        self.board.stats.fetches.fetch_add(1, Ordering::Relaxed);
        Some(e.meta.path.clone())
    }

    /// While `id` is being read from disk and has no host copy, unless its file was mapped and
    /// not served from during this read ([`Self::on_map_refused`]): its directory, root and
    /// bytes.
    pub fn disk_only_read(&self, id: AdapterId) -> Option<(PathBuf, Option<PathBuf>, u64)> {
        let e = self.entries.get(&id)?;
        (e.fetching && e.host.is_none() && !e.map_refused)
            .then(|| (e.meta.path.clone(), e.meta.root.clone(), e.meta.bytes))
    }

    /// `id`'s file, mapped while it is read, is not served from (it cannot be as is, or the
    /// policy waits for the read): the read in flight is not offered for mapping again.
    pub fn on_map_refused(&mut self, id: AdapterId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.map_refused = true;
        }
    }

    /// `id`, being read, is served from its mapped file meanwhile: `host` is its host copy
    /// until the read lands ([`Self::on_fetched`] replaces it, or drops it on failure).
    pub fn on_mapped(
        &mut self,
        id: AdapterId,
        host: Arc<LoraAdapter>,
        wanted: &HashSet<AdapterId>,
    ) {
        if !self.update(id, |e| e.host = Some(host)) {
            return;
        }
        self.board.stats.mapped.fetch_add(1, Ordering::Relaxed);
        self.trim_host(wanted);
        self.publish_one(id);
    }

    /// Expected bytes of `id`'s weights (a fetched copy must match).
    pub fn bytes(&self, id: AdapterId) -> Option<u64> {
        self.entries.get(&id).map(|e| e.meta.bytes)
    }

    /// `id`'s host copy's device image holds `bytes` of the upload arena
    /// ([`thaw_runtime::engine::Engine::stage_adapter`]): the host tier counts them with its
    /// heap copy, and trims to its bound. `wanted` as for [`MemoryManager::on_fetched`].
    pub fn on_staged(&mut self, id: AdapterId, bytes: u64, wanted: &HashSet<AdapterId>) {
        let changed = self
            .entries
            .get(&id)
            .is_some_and(|e| e.host.is_some() && e.image != bytes);
        if changed && self.update(id, |e| e.image = bytes) {
            self.trim_host(wanted);
            self.publish_one(id);
        }
    }

    /// A disk read finished. `wanted` are adapters of queued requests, kept over the bound.
    pub fn on_fetched(
        &mut self,
        id: AdapterId,
        host: Option<Arc<LoraAdapter>>,
        wanted: &HashSet<AdapterId>,
    ) {
        if !self.update(id, |e| {
            e.fetching = false;
            e.host = host;
        }) {
            return;
        }
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
            .tiers
            .host()
            .iter()
            .filter(|id| !wanted.contains(id))
            .filter_map(|id| self.entries.get(id))
            .map(|e| (e.last_used, e.meta.id, e.place().host_bytes()))
            .collect();
        lru.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id, bytes) in lru {
            if n <= self.cfg.host_max_adapters && b <= self.cfg.host_max_bytes {
                break;
            }
            // The host copy is freed on the reaper thread, not the engine thread's.
            self.update(id, |e| {
                if let Some(h) = e.host.take() {
                    thaw_runtime::upload::drop_later(h);
                }
            });
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
            (Device::Absent, Some(_)) => Placed::Host,
            (Device::Absent, None) => Placed::Disk,
            _ => Placed::Device,
        };
        let landed_layers = match e.state.device {
            Device::Resident => e.meta.num_layers,
            _ => self
                .board
                .residence(id)
                .filter(|r| r.tier == Placed::Device && e.state.device == Device::Loading)
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

    /// Publishes the upload arena's bytes (the host tier's encoded images among them).
    pub fn publish_arena(&self, u: thaw_runtime::upload::ArenaUsage) {
        let s = &self.board.stats;
        let set = |a: &std::sync::atomic::AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&s.arena_capacity_bytes, u.capacity as u64);
        set(&s.arena_used_bytes, u.used as u64);
        set(&s.arena_retained_bytes, u.retained as u64);
        set(&s.arena_encoded_bytes, u.encoded_bytes);
        set(&s.arena_reused_bytes, u.reused_bytes);
    }

    /// Publishes the budget's split; `kv_reserved` and `kv_used` are in pages.
    pub fn publish(&self, kv_reserved: usize, kv_used: usize) {
        let s = &self.board.stats;
        let t = self.tiers.totals();
        let set = |a: &std::sync::atomic::AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&s.kv_reserved_pages, kv_reserved as u64);
        set(&s.kv_used_pages, kv_used as u64);
        set(&s.adapter_pages, self.pool.adapter_pages() as u64);
        set(&s.device_adapters, t.device as u64);
        set(&s.device_bytes, t.device_bytes);
        set(&s.host_adapters, t.host as u64);
        set(&s.host_bytes, t.host_bytes);
        set(&s.disk_adapters, t.disk as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr() -> MemoryManager {
        MemoryManager::new(
            MemoryConfig {
                page_bytes: 1000,
                total_pages: 100,
                policy: EvictionPolicy::Cost,
                max_loras: 4,
                max_streaming_adapters: None,
                host_max_adapters: 1,
                host_max_bytes: 1 << 20,
            },
            Arc::new(Board::default()),
        )
    }

    fn meta(id: u32, bytes: u64, disk_secs: f64) -> AdapterMeta {
        AdapterMeta {
            id: AdapterId(id),
            path: PathBuf::from(format!("/nowhere/{id}")),
            root: None,
            bytes,
            num_layers: 2,
            disk_secs,
        }
    }

    /// The eviction score's reload cost is the performance model's load time from the tier the
    /// adapter would fall back to (host when the host tier has room for it, else disk), asked
    /// of the model the caller passes, not of a rate the manager keeps.
    #[test]
    fn reload_cost_comes_from_the_model_per_tier() {
        use crate::perf::Tier as From;
        let mut m = MemoryManager::new(
            MemoryConfig {
                host_max_adapters: 4,
                host_max_bytes: 2_500,
                ..mgr().cfg
            },
            Arc::new(Board::default()),
        );
        // Both take 3 pages; 1 would fit the host tier once evicted, 2 would not.
        m.register(meta(1, 2_100, 0.001), None);
        m.register(meta(2, 2_900, 0.001), None);
        for id in [1, 2] {
            m.on_registered(AdapterId(id), 0, false).unwrap();
        }
        let wanted = HashSet::new();
        let disk_dear = |tier: From, _: u64| if tier == From::Disk { 1.0 } else { 1e-3 };
        let host_dear = |tier: From, _: u64| if tier == From::Host { 1.0 } else { 1e-3 };
        // 2 is the more recent, so only the reload cost can put it first.
        assert_eq!(
            m.compute_order(&wanted, &disk_dear),
            vec![AdapterId(1), AdapterId(2)]
        );
        assert_eq!(
            m.compute_order(&wanted, &host_dear),
            vec![AdapterId(2), AdapterId(1)]
        );
    }

    /// An adapter the engine places in more pages than its bytes over the page size (CUDA's
    /// paged image) is counted at the engine's pages, in the pool and in eviction's view; in
    /// `fixed-slots` a slot stays a slot.
    #[test]
    fn pages_are_the_engines_when_it_places_the_adapter() {
        let mut m = mgr();
        m.register_placed(meta(1, 2_100, 0.001), None, Some(7));
        m.register_placed(meta(2, 2_100, 0.001), None, None);
        assert_eq!(m.state(AdapterId(1)).unwrap().pages, 7);
        assert_eq!(m.device_pages(AdapterId(1)), Some(7));
        assert_eq!(m.device_pages(AdapterId(2)), Some(m.pages_for(2_100)));
        m.on_registered(AdapterId(1), 0, false).unwrap();
        assert_eq!(m.pool().adapter_pages(), 7);
        let mut slots = MemoryManager::new(
            MemoryConfig {
                policy: EvictionPolicy::FixedSlots,
                ..mgr().cfg
            },
            Arc::new(Board::default()),
        );
        slots.register_placed(meta(1, 2_100, 0.001), None, Some(7));
        assert_eq!(
            slots.device_pages(AdapterId(1)),
            Some(slots.pages_for(2_100))
        );
    }

    #[test]
    fn published_split_counts_each_tier_once() {
        let mut m = mgr();
        for i in 0..5 {
            m.register(meta(i, 2_500, 0.001), None);
        }
        m.on_fetched(AdapterId(0), None, &HashSet::new());
        m.on_registered(AdapterId(3), 0, false).unwrap();
        m.publish(0, 0);
        let s = m.board().stats.snapshot();
        assert_eq!(
            (s.device_adapters, s.host_adapters, s.disk_adapters),
            (1, 0, 4)
        );
        assert_eq!((s.device_bytes, s.adapter_pages), (2_500, 3));
        m.on_evicted(AdapterId(3), &HashSet::new());
        assert!(!m.forget(AdapterId(4)) && !m.contains(AdapterId(4)));
        m.publish(0, 0);
        let s = m.board().stats.snapshot();
        assert_eq!(
            (s.device_adapters, s.disk_adapters, s.adapter_pages),
            (0, 4, 0)
        );
    }

    /// An adapter whose upload failed gives its pages back once (a second report frees
    /// nothing of another's), and a host copy mapped from the bad file goes with it; an owned
    /// copy (a copy that failed, not the file) stays in the host tier.
    #[test]
    fn a_failed_upload_frees_its_pages_once_and_drops_a_mapped_copy() {
        use crate::lora_open::tests::fixture;
        use thaw_runtime::model::ModelConfig;
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let dir = fixture().join("adapters/r4_qv");
        let mapped = Arc::new(LoraAdapter::map(&dir, &model).unwrap());
        let owned = Arc::new(LoraAdapter::load(&dir, &model).unwrap());
        let b = owned.size_bytes() as u64;
        let mut m = MemoryManager::new(
            MemoryConfig {
                host_max_adapters: 4,
                host_max_bytes: 4 * b,
                ..mgr().cfg
            },
            Arc::new(Board::default()),
        );
        let none = HashSet::new();
        m.register(meta(1, b, 0.001), None);
        m.register(meta(2, b, 0.001), Some(owned));
        m.register(meta(3, b, 0.001), None);
        assert!(m.start_fetch(AdapterId(1)).is_some());
        m.on_mapped(AdapterId(1), mapped, &none);
        for id in [1, 2, 3] {
            m.on_registered(AdapterId(id), 0, false).unwrap();
        }
        let pages = m.pool().adapter_pages();
        let one = m.state(AdapterId(1)).unwrap().pages;
        m.on_upload_failed(AdapterId(1), &none);
        assert_eq!(m.pool().adapter_pages(), pages - one);
        assert!(m.host_copy(AdapterId(1)).is_none(), "the mapped copy went");
        assert_eq!(m.state(AdapterId(1)).unwrap().device, Device::Absent);
        assert!(
            m.disk_only_read(AdapterId(1)).is_some(),
            "its read still reports"
        );
        m.on_upload_failed(AdapterId(1), &none);
        assert_eq!(m.pool().adapter_pages(), pages - one, "freed once");
        m.on_upload_failed(AdapterId(2), &none);
        assert_eq!(m.pool().adapter_pages(), pages - 2 * one);
        assert!(m.host_copy(AdapterId(2)).is_some(), "an owned copy stays");
    }

    /// A manager whose host tier holds at most `adapters` adapters and `bytes` bytes.
    fn host_mgr(adapters: usize, bytes: u64) -> MemoryManager {
        MemoryManager::new(
            MemoryConfig {
                host_max_adapters: adapters,
                host_max_bytes: bytes,
                ..mgr().cfg
            },
            Arc::new(Board::default()),
        )
    }

    /// The host tier's adapters and bytes, as published.
    fn host_bytes(m: &MemoryManager) -> (u64, u64) {
        m.publish(0, 0);
        let s = m.board().stats.snapshot();
        (s.host_adapters, s.host_bytes)
    }

    /// The host tier's bound counts each host copy's arena image with its heap bytes: two
    /// adapters whose heap copies fit `--max-cpu-lora-bytes` but not with their images keep
    /// only the one a queued request wants, and the published host bytes are heap + image.
    #[test]
    fn the_host_bound_counts_the_arena_image() {
        use crate::lora_open::tests::fixture;
        use thaw_runtime::model::ModelConfig;
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let a = Arc::new(LoraAdapter::load(&fixture().join("adapters/r4_qv"), &model).unwrap());
        let b = a.size_bytes() as u64;
        let mut m = host_mgr(4, 3 * b);
        m.register(meta(1, b, 0.001), Some(a.clone()));
        m.register(meta(2, b, 0.001), Some(a.clone()));
        assert_eq!(
            host_bytes(&m),
            (2, 2 * b),
            "heap copies only, before staging"
        );
        let image = b.next_multiple_of(256);
        m.on_staged(AdapterId(1), image, &HashSet::new());
        assert_eq!(host_bytes(&m), (2, 2 * b + image), "within the bound");
        let wanted = HashSet::from([AdapterId(2)]);
        m.on_staged(AdapterId(2), image, &wanted);
        assert_eq!(host_bytes(&m), (1, b + image), "over the bound: 1 trimmed");
        assert!(m.host_copy(AdapterId(1)).is_none() && m.host_copy(AdapterId(2)).is_some());
        // A trimmed adapter's image went with its copy: staging it again needs a copy.
        m.on_staged(AdapterId(1), image, &HashSet::new());
        assert_eq!(host_bytes(&m), (1, b + image));
        // Leaving the host tier (to the device) takes heap and image bytes out of it.
        m.on_registered(AdapterId(2), 0, false).unwrap();
        assert_eq!(host_bytes(&m), (0, 0));
    }

    /// A host copy read in place is the page cache's pages, not heap: the host tier counts
    /// only its arena image, so adapters whose heap copies would pass `--max-cpu-lora-bytes`
    /// stay within it; a heap copy taking over (the read into memory) counts its bytes again.
    #[test]
    fn a_host_copy_read_in_place_counts_only_its_image() {
        use crate::lora_open::tests::fixture;
        use thaw_runtime::model::ModelConfig;
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let dir = fixture().join("adapters/r4_qv");
        let a = Arc::new(LoraAdapter::load_in_place(&dir, &model).unwrap());
        let b = a.size_bytes() as u64;
        let image = b.next_multiple_of(256);
        let mut m = host_mgr(8, 3 * image);
        for id in 1..=3 {
            m.register(meta(id, b, 0.001), Some(a.clone()));
        }
        assert_eq!(host_bytes(&m), (3, 0), "no heap copy, no image yet");
        for id in 1..=3 {
            m.on_staged(AdapterId(id), image, &HashSet::new());
        }
        assert_eq!(host_bytes(&m), (3, 3 * image), "the images, nothing else");
        // A stand-in mapped from the file while its read runs is not heap either.
        m.register(meta(4, b, 0.001), None);
        m.start_fetch(AdapterId(4));
        let mapped = Arc::new(LoraAdapter::map(&dir, &model).unwrap());
        m.on_mapped(AdapterId(4), mapped, &HashSet::new());
        assert_eq!(host_bytes(&m), (4, 3 * image));
        // Its read lands held in memory (converted, say): heap bytes again, and over the
        // bound the least recently used host copy goes.
        let owned = Arc::new(LoraAdapter::load(&dir, &model).unwrap());
        m.on_fetched(AdapterId(4), Some(owned), &HashSet::from([AdapterId(4)]));
        assert_eq!(
            host_bytes(&m),
            (3, 2 * image + b),
            "one image trimmed for the heap copy"
        );
        assert!(m.host_copy(AdapterId(4)).is_some());
    }
}
