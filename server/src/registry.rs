//! The adapter registry: adapter names → slots with their generation, metadata and counters,
//! and the RAII [`AdapterLease`] that pins an adapter while requests use it.
//!
//! Where an adapter lives (disk, host, device) is the memory manager's business
//! ([`crate::memory`]): the registry tells it about new and retired adapters through a
//! [`NoticeSink`] and reads tiers from its [`Board`]. A request takes a lease and is queued;
//! the scheduler admits it once its adapter can be on the device, so no request is refused
//! for lack of adapter memory. Parsing and validation run on a blocking task.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use thaw_runtime::adapter::{AdapterError, LoraAdapter};
use thaw_runtime::ids::{AdapterId, Generation};
use thaw_runtime::model::ModelConfig;

use crate::error::ServerError;
pub use crate::memory::Tier;
use crate::memory::{AdapterMeta, Board, Notice, NoticeSink};
use crate::metrics::Metrics;

/// Adapter limits from the command line.
#[derive(Clone, Debug)]
pub struct AdapterLimits {
    /// `--max-lora-rank`.
    pub max_lora_rank: usize,
    /// `--max-loras`: distinct adapters in one batch (and the adapters warmed at start-up).
    pub max_loras: usize,
    /// `--max-cpu-loras`: host-tier adapters.
    pub max_cpu_loras: usize,
    /// How long an unload waits for requests still using the adapter.
    pub unload_wait: Duration,
    /// Device memory adapters and KV share; an adapter larger than it is refused.
    pub device_budget_bytes: u64,
    /// The `fixed-slots` baseline: refuse (429) a request whose adapter is not resident while
    /// every one of `--max-loras` slots is leased, as the server did before the pool.
    pub fixed_slots: bool,
    /// The one dtype the backend computes adapters from, if it reads only one: reads convert
    /// to it on the blocking pool, so sizes and the host tier hold what the device will.
    pub lora_dtype: Option<thaw_runtime::adapter::WeightDtype>,
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
    /// Seconds the registration's disk read and validation took.
    pub load_secs: f64,
    leases: AtomicUsize,
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
    pub fn leases(&self) -> usize {
        self.leases.load(Ordering::SeqCst)
    }

    fn view(&self, board: &Board, retiring: bool) -> AdapterView {
        let r = board.residence(self.id);
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
            tier: r.map_or(Tier::Disk, |r| r.tier),
            landed_layers: r.map_or(0, |r| r.landed_layers),
            load_secs: Some(self.load_secs),
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
    /// Unloaded or replaced generations still leased.
    retiring: Vec<Arc<AdapterSlot>>,
    generations: BTreeMap<String, u32>,
    next_id: u32,
}

/// All adapters the server knows.
pub struct Registry {
    inner: Mutex<Inner>,
    sink: Arc<dyn NoticeSink>,
    board: Arc<Board>,
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
        sink: Arc<dyn NoticeSink>,
        board: Arc<Board>,
        model: ModelConfig,
        limits: AdapterLimits,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Mutex::default(),
            sink,
            board,
            model,
            limits,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads and validates an adapter on a blocking task.
    async fn read<F>(&self, name: &str, read: F) -> Result<(Arc<LoraAdapter>, f64), ServerError>
    where
        F: FnOnce(&ModelConfig) -> Result<LoraAdapter, ServerError> + Send + 'static,
    {
        let model = self.model.clone();
        let start = Instant::now();
        let dtype = self.limits.lora_dtype;
        let adapter = tokio::task::spawn_blocking(move || {
            read(&model).map(|a| match dtype {
                Some(d) => a.into_dtype(d),
                None => a,
            })
        })
        .await
        .map_err(|e| ServerError::Internal(format!("adapter loader task failed: {e}")))??;
        let rank = adapter.max_rank();
        if rank > self.limits.max_lora_rank {
            return Err(ServerError::RankTooLarge {
                name: name.to_string(),
                rank,
                max: self.limits.max_lora_rank,
            });
        }
        let bytes = adapter.size_bytes() as u64;
        if bytes >= self.limits.device_budget_bytes {
            return Err(ServerError::invalid(
                "lora_path",
                format!(
                    "adapter `{name}` needs {bytes} bytes of device memory but the whole budget \
                     is {}; restart with a larger --device-memory-bytes",
                    self.limits.device_budget_bytes
                ),
            ));
        }
        Ok((Arc::new(adapter), start.elapsed().as_secs_f64()))
    }

    /// Loads `path` under `name` (a new generation if the name exists). The memory manager
    /// keeps the parsed copy in the host tier if it has room and, while fewer than
    /// `--max-loras` adapters are on the device, makes it resident in idle memory.
    pub async fn load(&self, name: &str, path: &Path) -> Result<AdapterView, ServerError> {
        if !path.exists() {
            return Err(ServerError::Adapter {
                name: name.to_string(),
                source: AdapterError::NotFound {
                    path: path.to_path_buf(),
                },
            });
        }
        let (p, n) = (path.to_path_buf(), name.to_string());
        // Read in place (no heap copy: the host tier is the file's pages and its arena image).
        self.load_with(name, path, None, move |model| {
            LoraAdapter::load_host(&p, model, None)
                .map_err(|source| ServerError::Adapter { name: n, source })
        })
        .await
    }

    /// [`Registry::load`] with the first read done by `read` (on the blocking pool): a
    /// `--lora-root` load opens its files without following links, and with `root` given the
    /// loader's later re-reads (after the host copy was dropped) are confined the same way.
    pub async fn load_with<F>(
        &self,
        name: &str,
        path: &Path,
        root: Option<&Path>,
        read: F,
    ) -> Result<AdapterView, ServerError>
    where
        F: FnOnce(&ModelConfig) -> Result<LoraAdapter, ServerError> + Send + 'static,
    {
        let (adapter, secs) = self.read(name, read).await?;
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
                size_bytes: adapter.size_bytes(),
                created: unix_now(),
                load_secs: secs,
                leases: AtomicUsize::new(0),
                counters: AdapterCounters::default(),
            })
        };
        self.metrics.adapter_load.observe(secs);
        let (done, rx) = tokio::sync::oneshot::channel();
        self.sink.notify(Notice::Register {
            meta: AdapterMeta {
                id: slot.id,
                path: slot.path.clone(),
                root: root.map(Path::to_path_buf),
                bytes: slot.size_bytes as u64,
                num_layers: slot.num_layers,
                disk_secs: secs,
            },
            host: Some(adapter),
            warm: self.board.device_ids().len() < self.limits.max_loras,
            done: Some(done),
        })?;
        rx.await.map_err(|_| ServerError::SchedulerGone)?;
        let old = self.lock().by_name.insert(name.to_string(), slot.clone());
        if let Some(old) = old {
            self.retire(old);
        }
        Ok(slot.view(&self.board, false))
    }

    /// Leases the adapter `name` for a request; None if there is no such adapter. The request
    /// then waits in the scheduler's queue until its adapter can be on the device.
    pub async fn acquire(&self, name: &str) -> Result<Option<AdapterLease>, ServerError> {
        let inner = self.lock();
        let Some(slot) = inner.by_name.get(name) else {
            return Ok(None);
        };
        if self.limits.fixed_slots {
            self.check_fixed_slot(&inner, slot)?;
        }
        let lease = AdapterLease::new(slot.clone());
        slot.counters.requests.fetch_add(1, Ordering::Relaxed);
        Ok(Some(lease))
    }

    /// The `fixed-slots` baseline's refusal: not resident and every slot leased.
    fn check_fixed_slot(&self, inner: &Inner, slot: &AdapterSlot) -> Result<(), ServerError> {
        let device = self.board.device_ids();
        if device.contains(&slot.id) || device.len() < self.limits.max_loras {
            return Ok(());
        }
        let leased = |id: &AdapterId| {
            inner
                .by_name
                .values()
                .chain(&inner.retiring)
                .find(|s| s.id == *id)
                .is_none_or(|s| s.leases() > 0)
        };
        if device.iter().all(leased) {
            return Err(ServerError::NoAdapterSlot {
                max: self.limits.max_loras,
            });
        }
        Ok(())
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
        self.sink.notify(Notice::Retire(slot.id))
    }

    /// Keeps a replaced or unloaded generation until its last lease is gone, then has the
    /// memory manager drop it.
    fn retire(&self, slot: Arc<AdapterSlot>) {
        self.lock().retiring.push(slot.clone());
        let sink = self.sink.clone();
        tokio::spawn(async move {
            while slot.leases() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = sink.notify(Notice::Retire(slot.id));
        });
    }

    /// Drops finished retirees from the list (called at scrape time).
    fn prune(&self) {
        self.lock().retiring.retain(|s| s.leases() > 0);
    }

    /// Every known adapter, including generations still draining.
    pub fn views(&self) -> Vec<AdapterView> {
        self.prune();
        let inner = self.lock();
        inner
            .by_name
            .values()
            .map(|s| s.view(&self.board, false))
            .chain(inner.retiring.iter().map(|s| s.view(&self.board, true)))
            .collect()
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

    /// The memory manager's published state.
    pub fn board(&self) -> &Arc<Board> {
        &self.board
    }
}
