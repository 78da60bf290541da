//! The adapter registry: adapter names → slots with their tier, generation and counters, and
//! the RAII [`AdapterLease`] that pins an adapter while requests use it.
//!
//! Tiers: `disk` (known, not in memory), `host` (in the host store — the cold-start issue
//! fills it), `device` (registered with the engine; on the CPU backend, with every layer
//! landed). At most `--max-loras` adapters are device-resident: a request for a disk-tier
//! adapter (a cache miss) loads it off the engine thread and evicts the least recently used
//! unleased one. Parsing and validation always run on a blocking task; the engine thread
//! only receives the finished `Arc<LoraAdapter>`.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use thaw_runtime::adapter::{AdapterError, LoraAdapter};
use thaw_runtime::ids::{AdapterId, Generation};
use thaw_runtime::model::ModelConfig;

use crate::engine_loop::EngineHandle;
use crate::error::ServerError;
use crate::metrics::Metrics;

/// Where an adapter currently lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Disk,
    Host,
    Device,
}

impl Tier {
    /// Gauge value in /metrics.
    pub fn code(self) -> u8 {
        match self {
            Tier::Disk => 0,
            Tier::Host => 1,
            Tier::Device => 2,
        }
    }
}

/// Adapter limits from the command line.
#[derive(Clone, Debug)]
pub struct AdapterLimits {
    /// `--max-lora-rank`.
    pub max_lora_rank: usize,
    /// `--max-loras`: device-resident adapters.
    pub max_loras: usize,
    /// `--max-cpu-loras`: host-tier adapters (used by the cold-start tiers).
    pub max_cpu_loras: usize,
    /// How long an unload waits for requests still using the adapter.
    pub unload_wait: Duration,
}

/// Mutable residency of a slot.
#[derive(Clone, Debug)]
struct Residency {
    tier: Tier,
    /// A disk → device load is in flight (counts toward `--max-loras`).
    loading: bool,
    landed_layers: usize,
    last_used: Instant,
    load_secs: Option<f64>,
}

/// Per-adapter counters.
#[derive(Debug, Default)]
pub struct AdapterCounters {
    pub requests: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Rows computed by CPU workers while the adapter streamed in (cold-start issue; 0 now).
    pub cpu_assisted_rows: AtomicU64,
}

/// One loaded generation of a named adapter.
#[derive(Debug)]
pub struct AdapterSlot {
    pub name: String,
    pub id: AdapterId,
    pub generation: Generation,
    pub path: PathBuf,
    pub rank: usize,
    pub targets: Vec<&'static str>,
    pub num_layers: usize,
    pub size_bytes: usize,
    /// Unix seconds of the load.
    pub created: u64,
    residency: Mutex<Residency>,
    leases: AtomicUsize,
    load_lock: tokio::sync::Mutex<()>,
    pub counters: AdapterCounters,
}

/// A snapshot of a slot for /v1/models and /metrics.
#[derive(Clone, Debug)]
pub struct AdapterView {
    pub name: String,
    pub id: AdapterId,
    pub generation: Generation,
    pub path: PathBuf,
    pub rank: usize,
    pub targets: Vec<&'static str>,
    pub num_layers: usize,
    pub size_bytes: usize,
    pub created: u64,
    pub tier: Tier,
    pub landed_layers: usize,
    pub load_secs: Option<f64>,
    pub leases: usize,
    pub requests: u64,
    pub hits: u64,
    pub misses: u64,
    pub cpu_assisted_rows: u64,
    /// Unloaded or replaced, waiting for its last requests.
    pub retiring: bool,
}

impl AdapterSlot {
    fn residency(&self) -> MutexGuard<'_, Residency> {
        self.residency.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn leases(&self) -> usize {
        self.leases.load(Ordering::SeqCst)
    }

    pub fn tier(&self) -> Tier {
        self.residency().tier
    }

    fn view(&self, retiring: bool) -> AdapterView {
        let r = self.residency().clone();
        AdapterView {
            name: self.name.clone(),
            id: self.id,
            generation: self.generation,
            path: self.path.clone(),
            rank: self.rank,
            targets: self.targets.clone(),
            num_layers: self.num_layers,
            size_bytes: self.size_bytes,
            created: self.created,
            tier: r.tier,
            landed_layers: r.landed_layers,
            load_secs: r.load_secs,
            leases: self.leases(),
            requests: self.counters.requests.load(Ordering::Relaxed),
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            cpu_assisted_rows: self.counters.cpu_assisted_rows.load(Ordering::Relaxed),
            retiring,
        }
    }
}

/// Pins an adapter: while any lease lives the adapter is neither evicted nor unregistered.
/// Dropping the lease is the only way to release it.
#[derive(Debug)]
pub struct AdapterLease {
    slot: Arc<AdapterSlot>,
}

impl AdapterLease {
    fn new(slot: Arc<AdapterSlot>) -> Self {
        slot.leases.fetch_add(1, Ordering::SeqCst);
        Self { slot }
    }

    pub fn id(&self) -> AdapterId {
        self.slot.id
    }

    pub fn slot(&self) -> &Arc<AdapterSlot> {
        &self.slot
    }
}

impl Clone for AdapterLease {
    fn clone(&self) -> Self {
        Self::new(self.slot.clone())
    }
}

impl Drop for AdapterLease {
    fn drop(&mut self) {
        self.slot.leases.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Inner {
    by_name: BTreeMap<String, Arc<AdapterSlot>>,
    /// Unloaded or replaced generations still leased or registered.
    retiring: Vec<Arc<AdapterSlot>>,
    generations: BTreeMap<String, u32>,
    next_id: u32,
}

/// All adapters the server knows.
pub struct Registry {
    inner: Mutex<Inner>,
    engine: EngineHandle,
    model: ModelConfig,
    pub limits: AdapterLimits,
    metrics: Arc<Metrics>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Registry {
    pub fn new(
        engine: EngineHandle,
        model: ModelConfig,
        limits: AdapterLimits,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Mutex::default(),
            engine,
            model,
            limits,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads and validates an adapter on a blocking task.
    async fn read(&self, name: &str, path: &Path) -> Result<(Arc<LoraAdapter>, f64), ServerError> {
        let model = self.model.clone();
        let p = path.to_path_buf();
        let start = Instant::now();
        let adapter = tokio::task::spawn_blocking(move || LoraAdapter::load(&p, &model))
            .await
            .map_err(|e| ServerError::Internal(format!("adapter loader task failed: {e}")))?
            .map_err(|source| ServerError::Adapter {
                name: name.to_string(),
                source,
            })?;
        let rank = adapter.max_rank();
        if rank > self.limits.max_lora_rank {
            return Err(ServerError::RankTooLarge {
                name: name.to_string(),
                rank,
                max: self.limits.max_lora_rank,
            });
        }
        Ok((Arc::new(adapter), start.elapsed().as_secs_f64()))
    }

    /// Loads `path` under `name` (a new generation if the name exists) and makes it
    /// device-resident if a slot is free or can be freed; otherwise it stays on disk and is
    /// loaded by its first request.
    pub async fn load(&self, name: &str, path: &Path) -> Result<AdapterView, ServerError> {
        if !path.exists() {
            return Err(ServerError::Adapter {
                name: name.to_string(),
                source: AdapterError::NotFound {
                    path: path.to_path_buf(),
                },
            });
        }
        let (adapter, secs) = self.read(name, path).await?;
        let slot = {
            let mut inner = self.lock();
            let generation = inner.generations.entry(name.to_string()).or_insert(0);
            *generation += 1;
            let generation = Generation(*generation);
            let id = AdapterId(inner.next_id);
            inner.next_id += 1;
            Arc::new(AdapterSlot {
                name: name.to_string(),
                id,
                generation,
                path: path.to_path_buf(),
                rank: adapter.max_rank(),
                targets: adapter.targets().iter().map(|m| m.hf_name()).collect(),
                num_layers: adapter.num_layers(),
                size_bytes: adapter.size_bytes_f32(),
                created: unix_now(),
                residency: Mutex::new(Residency {
                    tier: Tier::Disk,
                    loading: false,
                    landed_layers: 0,
                    last_used: Instant::now(),
                    load_secs: Some(secs),
                }),
                leases: AtomicUsize::new(0),
                load_lock: tokio::sync::Mutex::new(()),
                counters: AdapterCounters::default(),
            })
        };
        self.metrics.adapter_load.observe(secs);
        let guard = slot.load_lock.lock().await;
        let registered = self.make_resident(&slot, adapter, secs).await;
        drop(guard);
        let old = self.lock().by_name.insert(name.to_string(), slot.clone());
        if let Some(old) = old {
            self.retire(old);
        }
        if let Err(e) = registered {
            // No free device slot right now: the adapter stays on disk.
            tracing::info!("adapter `{name}` loaded to the disk tier: {e}");
        }
        Ok(slot.view(false))
    }

    /// Registers `adapter` for `slot` with the engine, evicting an unleased device adapter if
    /// `--max-loras` are resident. Call with `slot.load_lock` held.
    async fn make_resident(
        &self,
        slot: &Arc<AdapterSlot>,
        adapter: Arc<LoraAdapter>,
        secs: f64,
    ) -> Result<(), ServerError> {
        let victim_reply = {
            let inner = self.lock();
            let resident = |s: &&Arc<AdapterSlot>| {
                let r = s.residency();
                r.tier == Tier::Device || r.loading
            };
            let count = inner
                .by_name
                .values()
                .chain(&inner.retiring)
                .filter(resident)
                .count();
            let mut reply = None;
            if count >= self.limits.max_loras {
                let victim = inner
                    .by_name
                    .values()
                    .filter(|s| !Arc::ptr_eq(s, slot) && s.leases() == 0)
                    .filter(|s| s.residency().tier == Tier::Device)
                    .min_by_key(|s| s.residency().last_used)
                    .cloned();
                let Some(v) = victim else {
                    return Err(ServerError::NoAdapterSlot {
                        max: self.limits.max_loras,
                    });
                };
                {
                    let mut r = v.residency();
                    r.tier = Tier::Disk;
                    r.landed_layers = 0;
                }
                // Sent under the lock so the engine sees it before any later re-register.
                reply = Some((v.id, self.engine.unregister(v.id)?));
            }
            slot.residency().loading = true;
            reply
        };
        if let Some((id, rx)) = victim_reply {
            if let Ok(Err(e)) = rx.await {
                tracing::warn!("evicting adapter {id}: {e}");
            }
        }
        let res = self.engine.register(slot.id, adapter).await;
        let mut r = slot.residency();
        r.loading = false;
        if res.is_ok() {
            r.tier = Tier::Device;
            r.landed_layers = slot.num_layers;
            r.load_secs = Some(secs);
            r.last_used = Instant::now();
        }
        res
    }

    /// Leases the adapter `name` for a request, loading it to the device on a miss.
    pub async fn acquire(&self, name: &str) -> Result<Option<AdapterLease>, ServerError> {
        let lease = {
            let inner = self.lock();
            let Some(slot) = inner.by_name.get(name) else {
                return Ok(None);
            };
            AdapterLease::new(slot.clone())
        };
        let slot = lease.slot().clone();
        slot.counters.requests.fetch_add(1, Ordering::Relaxed);
        {
            let mut r = slot.residency();
            if r.tier == Tier::Device {
                r.last_used = Instant::now();
                slot.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(lease));
            }
        }
        slot.counters.misses.fetch_add(1, Ordering::Relaxed);
        let _guard = slot.load_lock.lock().await;
        if slot.tier() != Tier::Device {
            let (adapter, secs) = self.read(name, &slot.path).await?;
            self.metrics.adapter_load.observe(secs);
            self.make_resident(&slot, adapter, secs).await?;
        }
        Ok(Some(lease))
    }

    /// Unloads `name`: new requests get 404 at once; the engine drops the adapter when its
    /// last request ends. Waits up to `unload_wait` for that; past it, answers 409 and
    /// finishes in the background.
    pub async fn unload(&self, name: &str) -> Result<(), ServerError> {
        let slot = self
            .lock()
            .by_name
            .remove(name)
            .ok_or_else(|| ServerError::AdapterNotLoaded(name.to_string()))?;
        let deadline = Instant::now() + self.limits.unload_wait;
        while slot.leases() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let leases = slot.leases();
        if leases > 0 {
            self.retire(slot);
            return Err(ServerError::AdapterBusy {
                name: name.to_string(),
                requests: leases,
                waited_secs: self.limits.unload_wait.as_secs_f64(),
            });
        }
        drop_from_engine(&self.engine, &slot).await;
        Ok(())
    }

    /// Keeps a replaced or unloaded generation until its last lease is gone, then drops it
    /// from the engine.
    fn retire(&self, slot: Arc<AdapterSlot>) {
        self.lock().retiring.push(slot.clone());
        let engine = self.engine.clone();
        tokio::spawn(async move {
            while slot.leases() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            drop_from_engine(&engine, &slot).await;
        });
    }

    /// Drops finished retirees from the list (called at scrape time).
    fn prune(&self) {
        self.lock()
            .retiring
            .retain(|s| s.leases() > 0 || s.tier() == Tier::Device);
    }

    /// Every known adapter, including generations still draining.
    pub fn views(&self) -> Vec<AdapterView> {
        self.prune();
        let inner = self.lock();
        let mut views: Vec<AdapterView> = inner
            .by_name
            .values()
            .map(|s| s.view(false))
            .chain(inner.retiring.iter().map(|s| s.view(true)))
            .collect();
        // A device-tier adapter may still be streaming in, layer by layer.
        for v in &mut views {
            if v.tier == Tier::Device {
                if let Some((landed, _)) = self.engine.stats.landing(v.id) {
                    v.landed_layers = landed;
                }
            }
        }
        views
    }

    /// Live leases over all adapters (0 when idle).
    pub fn total_leases(&self) -> usize {
        let inner = self.lock();
        inner
            .by_name
            .values()
            .chain(&inner.retiring)
            .map(|s| s.leases())
            .sum()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.lock().by_name.contains_key(name)
    }
}

/// Moves a slot to the disk tier and unregisters it from the engine if it was resident.
async fn drop_from_engine(engine: &EngineHandle, slot: &Arc<AdapterSlot>) {
    let was_device = {
        let mut r = slot.residency();
        let d = r.tier == Tier::Device;
        r.tier = Tier::Disk;
        r.landed_layers = 0;
        d
    };
    if was_device {
        if let Ok(rx) = engine.unregister(slot.id) {
            if let Ok(Err(e)) = rx.await {
                tracing::warn!("unregistering adapter {}: {e}", slot.id);
            }
        }
    }
}
