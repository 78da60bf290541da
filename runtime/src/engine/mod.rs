//! The engine: owns the backend, the model's weights, the paged KV cache, the registered
//! adapters and the live sequences, and runs one [`StepPlan`] at a time.
//!
//! It decides nothing about *what* runs: the scheduler (in the server) builds the plan. A plan
//! may mix prefill chunks of any size with decode tokens of many sequences, each with its own
//! adapter or none; rows of one adapter are made contiguous once per step (Punica's segments).
//!
//! ```no_run
//! # use thaw_runtime::{engine::*, backend::cpu::CpuBackend, ids::SeqId};
//! # fn main() -> thaw_runtime::error::Result<()> {
//! let model = HostModel::load(std::path::Path::new("demo-model"))?;
//! let backend = CpuBackend::new(&model.config);
//! let mut engine = Engine::new(backend, model, EngineConfig::default())?;
//! engine.add_sequence(SeqId(1), SequenceParams { prompt: vec![1, 2, 3], ..Default::default() })?;
//! let plan = StepPlan { items: vec![PlanItem { seq: SeqId(1), num_tokens: 3 }], return_logits: false };
//! let out = engine.step(&plan)?;
//! # Ok(()) }
//! ```
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use thaw_cpu_lora::LoraPool;
use thaw_ipc::AdapterHandle;
use thaw_kernels::cpu::KvLayout;

use crate::adapter::LoraAdapter;
use crate::backend::{Backend, LoraBatch, LoraKernel, LoraLayout, LoraLoad, StepLayout};
use crate::error::{Result, RuntimeError};
use crate::ids::{AdapterId, SeqId};
use crate::kv::{BlockAllocator, KvUsage};
use crate::model::ModelConfig;
use crate::residency::LoadPriority;
use crate::sampling::{Sampler, SamplerScratch};

mod assist;
mod assist_device;
mod forward;
mod from_disk;
mod graphs;
pub mod greedy;
mod land_wait;
mod paged;
mod prefix;
mod prompt;
mod sequence;
mod weights;

pub use assist::AssistProfile;
pub use graphs::GraphStats;
pub use land_wait::UnlandedLayers;
pub use prefix::PrefixStats;
pub use sequence::{FinishReason, PlanItem, SeqOutput, SequenceParams, StepPlan};
pub use weights::{HostLayer, HostModel};

use assist::{Assist, AssistBuffers, AssistPath};
use forward::Workspace;
use sequence::Sequence;
use weights::DeviceModel;

/// Engine sizing and kernel choices.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub kv_block_size: usize,
    /// Physical KV blocks (per layer).
    pub num_kv_blocks: usize,
    /// Most rows (tokens) one step may carry; activation buffers are sized for it once.
    pub max_batch_tokens: usize,
    /// Most sequences one step may carry.
    pub max_batch_seqs: usize,
    /// Context limit; None = the model's `max_position_embeddings`.
    pub max_context: Option<usize>,
    pub lora_kernel: LoraKernel,
    /// Seed for requests that bring none.
    pub seed: u64,
    /// Reuse the KV of full blocks of an earlier request with the same prefix under the same
    /// adapter generation (vLLM's automatic prefix caching, `--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// Decode steps as CUDA graphs captured per batch-size bucket, as vLLM does
    /// (`thaw serve --cuda-graphs`; `--enforce-eager` keeps them off). Backends without
    /// graphs (the CPU one) ignore it. See `backend::graph_plan`.
    pub cuda_graphs: bool,
    /// Largest decode batch captured (`--cuda-graph-max-bs`); `None`: `max_batch_seqs`.
    /// Larger batches run eagerly.
    pub cuda_graph_max_bs: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_block_size: 16,
            num_kv_blocks: 1024,
            max_batch_tokens: 2048,
            max_batch_seqs: 256,
            max_context: None,
            lora_kernel: LoraKernel::Sgmv,
            seed: 0,
            enable_prefix_caching: false,
            cuda_graphs: false,
            cuda_graph_max_bs: None,
        }
    }
}

/// The engine for one model on one backend.
pub struct Engine<B: Backend> {
    backend: B,
    config: ModelConfig,
    cfg: EngineConfig,
    model: DeviceModel<B>,
    kv: Vec<B::KvLayer>,
    blocks: BlockAllocator,
    adapters: HashMap<AdapterId, EngineAdapter<B>>,
    pool: Option<LoraPool>,
    /// Adapters holding a slot of the pool's host store: those with a layer not yet landed
    /// when last looked at ([`Engine::release_landed`]).
    in_store: Vec<AdapterId>,
    /// Streaming adapters the host store had no room for: reserved again at every step.
    store_wanted: Vec<AdapterId>,
    assist_buf: AssistBuffers,
    generations: u32,
    seqs: HashMap<SeqId, Sequence>,
    ws: Workspace<B>,
    layout: StepLayout,
    lora_layout: LoraLayout,
    sampler_scratch: SamplerScratch,
    logits: Vec<f32>,
    /// Whether all-greedy steps bring back token ids instead of logits ([`greedy`]).
    greedy_ids: bool,
    /// Per step: what the sampling rows brought back, and the ids when that was ids.
    fetch: greedy::Fetch,
    ids: Vec<u32>,
    /// Steps that brought back greedy ids instead of logits.
    id_steps: u64,
    next_seed: u64,
    /// Per step: the adapters in `lora_layout` index order, and the sequence of each
    /// `layout.seqs` entry and of each `layout.logit_rows` entry.
    step_adapter_ids: Vec<AdapterId>,
    seq_order: Vec<SeqId>,
    sample_order: Vec<SeqId>,
    landed: Vec<usize>,
    /// What a step does with its adapters' layers not landed at its start, for adapters not
    /// marked otherwise ([`Engine::set_adapter_unlanded`]).
    unlanded: UnlandedLayers,
    /// Time steps spent waiting for layers to land ([`UnlandedLayers::Wait`]).
    layer_wait: Duration,
    rows_assisted: u64,
    /// Per step: rows whose logits score the next prompt token, and (sequence, that token).
    prompt_rows: Vec<usize>,
    prompt_targets: Vec<(SeqId, u32)>,
    prompt_logits: Vec<f32>,
    prefix_stats: PrefixStats,
    /// CUDA-graph state, while graphs are on and the backend has them.
    graphs: Option<graphs::EngineGraphs>,
}

/// A registered adapter: its host copy, its device slot, and its place in the host store
/// (only while some layer is still streaming: the workers compute only layers not on the
/// device, so a fully landed adapter needs no slot).
struct EngineAdapter<B: Backend> {
    host: Arc<LoraAdapter>,
    dev: B::Lora,
    store: Option<AdapterHandle>,
    /// What steps do with its layers not landed (None: the engine's default).
    unlanded: Option<UnlandedLayers>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, model: HostModel, cfg: EngineConfig) -> Result<Self> {
        let config = model.config.clone();
        if cfg.max_batch_tokens == 0 || cfg.max_batch_seqs == 0 || cfg.kv_block_size == 0 {
            return Err(RuntimeError::InvalidRequest(
                "max_batch_tokens, max_batch_seqs and kv_block_size must be positive".into(),
            ));
        }
        let kv_layout = KvLayout {
            block_size: cfg.kv_block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        let kv = (0..config.num_layers)
            .map(|_| backend.alloc_kv_layer(kv_layout, cfg.num_kv_blocks))
            .collect::<Result<Vec<_>>>()?;
        let ws = Workspace::new(&backend, &config, &cfg)?;
        let model = DeviceModel::upload(&backend, model)?;
        let max_context = graphs::max_context(&config, &cfg);
        let graphs =
            graphs::EngineGraphs::new(&backend, &config, &cfg, max_context, ws.logit_cap());
        Ok(Self {
            blocks: BlockAllocator::new(cfg.num_kv_blocks, cfg.kv_block_size),
            next_seed: cfg.seed,
            backend,
            config,
            cfg,
            model,
            kv,
            adapters: HashMap::new(),
            pool: None,
            in_store: Vec::new(),
            store_wanted: Vec::new(),
            assist_buf: AssistBuffers::default(),
            generations: 0,
            seqs: HashMap::new(),
            ws,
            layout: StepLayout::default(),
            lora_layout: LoraLayout::default(),
            sampler_scratch: SamplerScratch::default(),
            logits: Vec::new(),
            greedy_ids: greedy::enabled_by_env(),
            fetch: greedy::Fetch::Logits,
            ids: Vec::new(),
            id_steps: 0,
            step_adapter_ids: Vec::new(),
            seq_order: Vec::new(),
            sample_order: Vec::new(),
            landed: Vec::new(),
            unlanded: UnlandedLayers::default(),
            layer_wait: Duration::ZERO,
            rows_assisted: 0,
            prompt_rows: Vec::new(),
            prompt_targets: Vec::new(),
            prompt_logits: Vec::new(),
            prefix_stats: PrefixStats::default(),
            graphs,
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn engine_config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The batched-LoRA kernel the next steps use (the scheduler picks it per step from its
    /// performance model; both compute the same deltas).
    pub fn set_lora_kernel(&mut self, kernel: LoraKernel) {
        self.cfg.lora_kernel = kernel;
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Largest total length (prompt + generated) a sequence may reach.
    pub fn max_context(&self) -> usize {
        graphs::max_context(&self.config, &self.cfg)
    }

    pub fn kv_usage(&self) -> KvUsage {
        self.blocks.usage()
    }

    /// Replaces the KV cache with one of `num_blocks` blocks (sizing the cache after a memory
    /// profile, as vLLM does); only while no sequence is live, since their blocks would go.
    pub fn resize_kv(&mut self, num_blocks: usize) -> Result<()> {
        if !self.seqs.is_empty() {
            return Err(RuntimeError::InvalidRequest(format!(
                "cannot resize the KV cache while {} sequences are live",
                self.seqs.len()
            )));
        }
        // Adapter images placed in the KV buffers would lose their memory.
        if self.blocks.adapter_blocks() > 0 {
            return Err(RuntimeError::InvalidRequest(format!(
                "cannot resize the KV cache while adapters hold {} of its blocks; unregister \
                 them first",
                self.blocks.adapter_blocks()
            )));
        }
        let layout = KvLayout {
            block_size: self.cfg.kv_block_size,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        };
        // Free the old cache first: on a device the new one needs that memory.
        self.kv.clear();
        self.kv = (0..self.config.num_layers)
            .map(|_| self.backend.alloc_kv_layer(layout, num_blocks))
            .collect::<Result<Vec<_>>>()?;
        self.blocks = BlockAllocator::new(num_blocks, self.cfg.kv_block_size);
        self.cfg.num_kv_blocks = num_blocks;
        if let Some(g) = &mut self.graphs {
            g.kv_resized(num_blocks);
            self.backend.graph_reset();
        }
        Ok(())
    }

    /// Additional KV blocks `seq` needs to compute `num_tokens` more tokens.
    pub fn blocks_needed(&self, seq: SeqId, num_tokens: usize) -> Result<usize> {
        let s = self
            .seqs
            .get(&seq)
            .ok_or(RuntimeError::UnknownSequence(seq))?;
        Ok(self
            .blocks
            .blocks_for(s.computed + num_tokens)
            .saturating_sub(s.kv.len()))
    }

    /// Makes an adapter available to sequences, copied whole to the device (the `cached`
    /// oracle, and the plain CPU backend). On the CPU backend it is resident at once; on a
    /// GPU its bytes go through the upload pipeline like a streamed adapter's (the engine
    /// thread never packs them), so its layers land shortly after: the `cached` policy holds
    /// its requests until they have, and [`Engine::wait_adapters_landed`] waits for them.
    pub fn register_adapter(&mut self, id: AdapterId, adapter: Arc<LoraAdapter>) -> Result<()> {
        let dev = self.device_lora(&adapter, LoraLoad::Whole)?;
        self.insert_adapter(id, adapter, dev)
    }

    /// Blocks until every layer of every registered adapter is on the device, or `timeout`
    /// passes (tests and benchmarks that need resident adapters; the serving loop never waits).
    pub fn wait_adapters_landed(&self, timeout: std::time::Duration) -> Result<()> {
        let t0 = std::time::Instant::now();
        loop {
            let pending = self
                .adapters
                .iter()
                .find(|(_, a)| self.backend.landed_layers(&a.dev) < a.host.num_layers());
            let Some((id, a)) = pending else {
                return Ok(());
            };
            if t0.elapsed() > timeout {
                return Err(RuntimeError::Backend(format!(
                    "adapter {id}'s layers did not all land within {timeout:?} ({} of {}); a \
                     copy failed or the copy stream is stuck (see the log)",
                    self.backend.landed_layers(&a.dev),
                    a.host.num_layers()
                )));
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Makes an adapter available at once while its copy engine streams it to the device,
    /// layer 0 first; until a layer lands, that layer's deltas are computed on the CPU.
    pub fn register_adapter_streaming(
        &mut self,
        id: AdapterId,
        adapter: Arc<LoraAdapter>,
    ) -> Result<()> {
        let dev = self.device_lora(&adapter, LoraLoad::Stream(LoadPriority::Demand))?;
        self.insert_adapter(id, adapter, dev)
    }

    /// [`Engine::register_adapter_streaming`] for an adapter a waiting request will need: its
    /// copy yields the link to every demand load until a sequence uses it
    /// ([`Engine::add_sequence`] promotes it).
    pub fn prefetch_adapter(&mut self, id: AdapterId, adapter: Arc<LoraAdapter>) -> Result<()> {
        let dev = self.device_lora(&adapter, LoraLoad::Stream(LoadPriority::Prefetch))?;
        self.insert_adapter(id, adapter, dev)
    }

    fn insert_adapter(
        &mut self,
        id: AdapterId,
        host: Arc<LoraAdapter>,
        dev: B::Lora,
    ) -> Result<()> {
        let users = self.adapter_users(id);
        if users > 0 {
            return Err(RuntimeError::AdapterInUse(id, users));
        }
        self.drop_from_store(id);
        // Landed adapters give their slots back first: the store holds only adapters still
        // streaming, so its capacity bounds those, not the device cache.
        self.release_landed();
        let streaming = self.backend.landed_layers(&dev) < host.num_layers();
        let store = match &mut self.pool {
            Some(pool) if streaming => {
                self.generations += 1;
                // O(layers) here; the bytes are copied on the background thread and the
                // entry published at a later step (`release_landed`).
                let h = from_disk::store_insert(pool, id, self.generations, &host)?;
                match h {
                    Some(_) => self.in_store.push(id),
                    None => {
                        tracing::debug!(
                            adapter = id.0,
                            "host adapter store full: assisted on the engine thread until it has room"
                        );
                        self.store_wanted.push(id);
                    }
                }
                h
            }
            _ => None,
        };
        let a = EngineAdapter {
            host,
            dev,
            store,
            unlanded: None,
        };
        self.adapters.insert(id, a);
        Ok(())
    }

    fn drop_from_store(&mut self, id: AdapterId) {
        if let (Some(pool), Some(a)) = (&mut self.pool, self.adapters.get_mut(&id)) {
            if let Some(h) = a.store.take() {
                pool.store_mut().remove(h);
            }
        }
        self.in_store.retain(|&x| x != id);
        self.store_wanted.retain(|&x| x != id);
    }

    /// Gives back the host-store slot of every adapter whose layers have all landed; returns
    /// how many. The workers compute only layers not yet on the device and landing is
    /// monotonic, so no later job needs the slot; a re-registration after eviction inserts
    /// the adapter anew under a new generation, so a stale handle never leases another
    /// adapter's bytes. Between steps no worker job is in flight; a job left by a failed step
    /// still holds its lease, and the store reuses the bytes only once that lease is dropped
    /// (the store's `RETIRED` state). Called at every step and before every insert; it also
    /// publishes the host-store entries filled since the last call, and reserves entries for
    /// streaming adapters the store had no room for until now.
    pub fn release_landed(&mut self) -> usize {
        let Some(pool) = self.pool.as_mut() else {
            return 0;
        };
        // Host-store entries whose bytes the background thread finished copying go live.
        pool.store_mut().settle();
        let before = self.in_store.len();
        let (adapters, backend) = (&mut self.adapters, &self.backend);
        self.in_store.retain(|id| {
            let Some(a) = adapters.get_mut(id) else {
                return false;
            };
            if backend.landed_layers(&a.dev) < a.host.num_layers() {
                return true;
            }
            if let Some(h) = a.store.take() {
                pool.store_mut().remove(h);
            }
            false
        });
        let released = before - self.in_store.len();
        // Adapters the store had no room for: again now, unless they landed meanwhile.
        let (in_store, generations) = (&mut self.in_store, &mut self.generations);
        self.store_wanted.retain(|id| {
            let Some(a) = adapters.get_mut(id) else {
                return false;
            };
            if backend.landed_layers(&a.dev) >= a.host.num_layers() {
                return false;
            }
            *generations += 1;
            match from_disk::store_insert(pool, *id, *generations, &a.host) {
                Ok(Some(h)) => {
                    a.store = Some(h);
                    in_store.push(*id);
                    false
                }
                Ok(None) => true,
                Err(e) => {
                    tracing::warn!(adapter = id.0, "host adapter store: {e}");
                    false
                }
            }
        });
        released
    }

    /// What steps do with a layer of their adapters that has not landed when they start:
    /// compute it on the CPU (the default) or wait for it in the forward and compute it on the
    /// device ([`UnlandedLayers`]; `on-demand` lets a request run once waiting costs the step
    /// little). The default of every adapter not marked by [`Engine::set_adapter_unlanded`].
    pub fn set_unlanded_layers(&mut self, u: UnlandedLayers) {
        self.unlanded = u;
    }

    /// What steps do with the layers of adapter `id` not landed, whatever the default: one
    /// step may wait for one adapter's layers and assist another's (`auto` starts a request
    /// whose copy it chose to wait for once waiting in the step costs little). Kept until the
    /// adapter is unregistered or marked again.
    pub fn set_adapter_unlanded(&mut self, id: AdapterId, u: UnlandedLayers) -> Result<()> {
        let a = self
            .adapters
            .get_mut(&id)
            .ok_or(RuntimeError::UnknownAdapter(id))?;
        a.unlanded = Some(u);
        Ok(())
    }

    /// Time steps have spent so far waiting for adapter layers to land.
    pub fn layer_wait(&self) -> Duration {
        self.layer_wait
    }

    /// Adapters holding a slot of the workers' host store (those still streaming).
    pub fn adapters_in_store(&self) -> usize {
        self.in_store.len()
    }

    /// Hands the engine a pool of CPU LoRA workers: from now on cold layers are computed by
    /// the workers from the shared host store instead of on the engine thread.
    pub fn attach_pool(&mut self, mut pool: LoraPool) -> Result<()> {
        for (id, a) in self.adapters.iter_mut() {
            if self.backend.landed_layers(&a.dev) >= a.host.num_layers() {
                continue;
            }
            self.generations += 1;
            a.store = from_disk::store_insert(&mut pool, *id, self.generations, &a.host)?;
            match a.store {
                Some(_) => self.in_store.push(*id),
                None => self.store_wanted.push(*id),
            }
        }
        // SAFETY: the pool, owner of the exchange's mapping, stays in `self.pool` until
        // `detach_pool`, which unmaps first; and `backend` is declared before `pool`, so on
        // drop the registration goes first.
        let mapped = unsafe { self.backend.map_assist_exchange(pool.exchange()) };
        self.assist_buf.device.mapped = match mapped {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!("CPU assist exports and merges through the host: {e}");
                false
            }
        };
        self.pool = Some(pool);
        Ok(())
    }

    /// The attached worker pool, if any.
    pub fn pool(&self) -> Option<&LoraPool> {
        self.pool.as_ref()
    }

    /// Supervises the worker pool between steps: reaps workers that died and starts their
    /// replacements, so a killed worker is replaced without waiting for the next LoRA step.
    /// A no-op without a pool.
    pub fn tend_pool(&mut self) -> Result<()> {
        if let Some(pool) = self.pool.as_mut() {
            pool.health_check()
                .map_err(|e| RuntimeError::Backend(format!("CPU LoRA workers: {e}")))?;
        }
        Ok(())
    }

    /// Takes the worker pool back (e.g. to shut it down).
    pub fn detach_pool(&mut self) -> Option<LoraPool> {
        let mut pool = self.pool.take()?;
        self.backend.unmap_assist_exchange();
        self.assist_buf.device.mapped = false;
        for a in self.adapters.values_mut() {
            if let Some(h) = a.store.take() {
                pool.store_mut().remove(h);
            }
        }
        self.in_store.clear();
        self.store_wanted.clear();
        Some(pool)
    }

    /// Layers of adapter `id` on the device, and its layer count.
    pub fn adapter_landed(&self, id: AdapterId) -> Option<(usize, usize)> {
        self.adapters
            .get(&id)
            .map(|a| (self.backend.landed_layers(&a.dev), a.host.num_layers()))
    }

    /// The host copy of adapter `id` (what the CPU assists from and the cost model sizes).
    pub fn adapter_host(&self, id: AdapterId) -> Option<&Arc<LoraAdapter>> {
        self.adapters.get(&id).map(|a| &a.host)
    }

    /// Whether every layer of adapter `id` is on the device.
    pub fn adapter_resident(&self, id: AdapterId) -> bool {
        self.adapter_landed(id).is_some_and(|(l, n)| l >= n)
    }

    /// Row·modules whose LoRA delta the CPU computed since the engine started.
    pub fn rows_assisted(&self) -> u64 {
        self.rows_assisted
    }

    /// Where CPU-assisted steps spent the engine thread's time so far.
    pub fn assist_profile(&self) -> AssistProfile {
        self.assist_buf.profile
    }

    /// The backend (e.g. to read the emulated link's backlog).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Removes an adapter no live sequence uses.
    pub fn unregister_adapter(&mut self, id: AdapterId) -> Result<()> {
        let users = self.adapter_users(id);
        if users > 0 {
            return Err(RuntimeError::AdapterInUse(id, users));
        }
        self.drop_from_store(id);
        // Its cached KV was computed with weights that are going away.
        self.blocks.forget_adapter(id);
        let a = self
            .adapters
            .remove(&id)
            .ok_or(RuntimeError::UnknownAdapter(id))?;
        // The device copy first, then the host copy on the background thread: if this held the last
        // reference, freeing tens of megabytes is not the engine thread's work.
        drop(a.dev);
        crate::upload::drop_later(a.host);
        Ok(())
    }

    pub fn has_adapter(&self, id: AdapterId) -> bool {
        self.adapters.contains_key(&id)
    }

    /// Admits a sequence. KV blocks are taken lazily, step by step; with prefix caching on,
    /// the longest cached chain of its prompt's full blocks is shared at once. Returns the
    /// prompt tokens found cached (not computed again).
    pub fn add_sequence(&mut self, id: SeqId, p: SequenceParams) -> Result<usize> {
        if self.seqs.contains_key(&id) {
            return Err(RuntimeError::DuplicateSequence(id));
        }
        if p.prompt.is_empty() {
            return Err(RuntimeError::InvalidRequest(
                "the prompt is empty; send at least one token".into(),
            ));
        }
        if let Some(&bad) = p
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(RuntimeError::TokenOutOfRange {
                id: bad,
                vocab: self.config.vocab_size,
            });
        }
        if p.max_new_tokens == 0 {
            return Err(RuntimeError::InvalidRequest(
                "max_new_tokens must be at least 1".into(),
            ));
        }
        let len = p.prompt.len() + p.max_new_tokens;
        if len > self.max_context() {
            return Err(RuntimeError::ContextOverflow {
                seq: id,
                len,
                max: self.max_context(),
            });
        }
        let adapter = match p.adapter {
            Some(a) => Some(
                self.adapters
                    .get(&a)
                    .ok_or(RuntimeError::UnknownAdapter(a))?,
            ),
            None => None,
        };
        p.sampling.validate()?;
        if let Some(a) = adapter {
            // A sequence computes with it from now on: if its copy is still a queued
            // prefetch, it goes ahead of the other prefetches on the link.
            self.backend.promote_lora(&a.dev);
        }
        self.next_seed = self.next_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let prefix = self.prefix_key(&p);
        let seq = Sequence {
            prompt_len: p.prompt.len(),
            tokens: p.prompt,
            computed: 0,
            adapter: p.adapter,
            sampler: Sampler::new(p.sampling, self.next_seed),
            max_new_tokens: p.max_new_tokens,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            kv: self.blocks.empty(),
            prefix,
            prompt_logprobs: p.prompt_logprobs,
            prompt_scored: Vec::new(),
            hashes: Vec::new(),
            chain: Some(0),
            cached_tokens: 0,
            preempted: false,
        };
        self.seqs.insert(id, seq);
        Ok(self.share_cached_prefix(id))
    }

    /// Drops a sequence (finished elsewhere, or cancelled), freeing its KV blocks.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        self.seqs
            .remove(&id)
            .map(|_| ())
            .ok_or(RuntimeError::UnknownSequence(id))
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Tokens not yet computed for `seq` (its remaining prompt in prefill, 1 in decode).
    pub fn pending_tokens(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .seqs
            .get(&seq)
            .ok_or(RuntimeError::UnknownSequence(seq))?
            .pending())
    }

    /// Runs one step. Sequences that sample get a token; a finished one is removed and its KV
    /// freed. On error nothing has advanced (a sequence may keep blocks it grew into).
    pub fn step(&mut self, plan: &StepPlan) -> Result<Vec<SeqOutput>> {
        self.build_layout(plan)?;
        if self.layout.rows() == 0 {
            return Ok(Vec::new());
        }
        // Before the landed layers are read below: an adapter released here has every layer
        // landed, so no job of this step needs its slot.
        self.release_landed();
        let adapters: Vec<&B::Lora> = self
            .step_adapter_ids
            .iter()
            .map(|id| &self.adapters[id].dev)
            .collect();
        let host: Vec<&Arc<LoraAdapter>> = self
            .step_adapter_ids
            .iter()
            .map(|id| &self.adapters[id].host)
            .collect();
        // Only published entries: one still being filled cannot be leased by the workers.
        let handles: Vec<Option<AdapterHandle>> = self
            .step_adapter_ids
            .iter()
            .map(|id| {
                let live =
                    |h: &AdapterHandle| self.pool.as_ref().is_some_and(|p| p.store().is_live(*h));
                self.adapters[id].store.filter(live)
            })
            .collect();
        // Which layers are on the device is decided once, at the start of the step.
        self.landed.clear();
        self.landed
            .extend(adapters.iter().map(|a| self.backend.landed_layers(a)));
        let layers = self.config.num_layers;
        let unlanded = self.landed.iter().any(|&l| l < layers);
        // Layers not landed are waited for in the forward, or computed on the CPU, per adapter.
        let mut wait = unlanded
            .then(|| {
                let ids = &self.step_adapter_ids;
                let mode = |i: usize| self.adapters[&ids[i]].unlanded.unwrap_or(self.unlanded);
                let waits = |i| mode(i) == UnlandedLayers::Wait;
                land_wait::LayerWait::for_step(
                    &self.landed,
                    layers,
                    waits,
                    land_wait::LAYER_WAIT_LIMIT,
                )
            })
            .flatten();
        let waited = |i: usize| wait.as_ref().is_some_and(|w| w.waits(i));
        let cold = (0..self.landed.len()).any(|i| self.landed[i] < layers && !waited(i));
        // A warm decode step that fits a captured batch size is padded to it (graphs on).
        let max_rank = host.iter().map(|a| a.max_rank()).max().unwrap_or(0);
        let scores = !self.prompt_rows.is_empty();
        let graph = self.graphs.as_mut().and_then(|g| {
            let facts = (unlanded, scores, max_rank);
            let (layout, lora) = (&mut self.layout, &mut self.lora_layout);
            g.plan(&self.blocks, layout, lora, facts).map(|k| (g, k))
        });
        // The workers assist this step only if every cold adapter is readable in the host
        // store; otherwise (an entry still filling, for a step or a few) the engine thread
        // computes the cold deltas from the host copies, as without a pool.
        let on_pool = self.pool.is_some()
            && (0..self.landed.len())
                .all(|i| self.landed[i] >= layers || waited(i) || handles[i].is_some());
        let lora = LoraBatch {
            kernel: self.cfg.lora_kernel,
            layout: &self.lora_layout,
            adapters: &adapters,
            landed: &self.landed,
        };
        // Workers spin instead of sleeping while a step has CPU work: a futex wake per layer
        // and input would cost more than the work itself.
        if let (true, true, Some(pool)) = (cold, on_pool, &self.pool) {
            pool.arm();
        }
        // The workers' cores are busy while they assist: the backend computes alone then,
        // and on every core otherwise (inline assist runs on the engine thread itself).
        self.backend.set_cpu_assist(cold && on_pool);
        let mut assist = cold.then(|| Assist {
            path: match &mut self.pool {
                Some(pool) if on_pool => AssistPath::Pool {
                    pool,
                    handles: &handles,
                    ticket: None,
                },
                _ => AssistPath::Inline,
            },
            host: &host,
            buf: &mut self.assist_buf,
            rows_assisted: 0,
            on_pool: false,
        });
        // The step writes its blocks from here on: nothing it registers or releases is shared
        // or reused before `end_step` below.
        self.blocks.begin_step();
        self.backend.step_running(true);
        self.fetch = greedy::step_fetch(
            self.greedy_ids,
            plan.return_logits,
            self.sample_order
                .iter()
                .map(|s| greedy::row_needs_logits(self.seqs[s].sampler.params())),
        );
        let ids = (self.fetch == greedy::Fetch::Ids).then_some(&mut self.ids);
        let ran = match graph {
            Some((g, key)) => graphs::run(
                g,
                key,
                &mut self.backend,
                (&self.config, &self.model),
                &mut self.kv,
                &mut self.ws,
                (&self.layout, &lora),
                self.sample_order.len(),
                &mut self.logits,
                ids,
            ),
            None => forward::run(
                &mut self.backend,
                &self.config,
                &self.model,
                &mut self.kv,
                &mut self.ws,
                &self.layout,
                &lora,
                assist.as_mut(),
                wait.as_mut(),
                &mut self.logits,
                ids,
            ),
        };
        self.layer_wait += wait.map_or(Duration::ZERO, |w| w.waited);
        self.backend.step_running(false);
        self.rows_assisted += assist.map_or(0, |a| a.rows_assisted as u64);
        if let (true, true, Some(pool)) = (cold, on_pool, &self.pool) {
            pool.disarm();
        }
        if let Err(e) = ran {
            self.blocks.end_step();
            return Err(e);
        }
        self.score_prompt();
        let out = self.advance(plan.return_logits);
        self.blocks.end_step();
        Ok(out)
    }

    /// After the forward: advance every sequence, sample where the plan reached the end of
    /// the known tokens, and retire finished sequences.
    fn advance(&mut self, return_logits: bool) -> Vec<SeqOutput> {
        for (seq, slice) in self.seq_order.iter().zip(&self.layout.seqs) {
            let s = self.seqs.get_mut(seq).expect("planned sequences are live");
            s.computed += slice.rows.len();
            prefix::register_full_blocks(&self.blocks, s);
        }
        let vocab = self.config.vocab_size;
        let eos = &self.config.eos_token_ids;
        let max_context = self.max_context();
        let mut out = Vec::with_capacity(self.sample_order.len());
        let ids = self.fetch == greedy::Fetch::Ids;
        self.id_steps += ids as u64;
        for (i, seq) in self.sample_order.iter().enumerate() {
            // Ids: the step's rows are all greedy without logprobs and no logits were asked
            // for (`greedy::step_fetch`); no logits came back.
            let row: &[f32] = if ids {
                &[]
            } else {
                &self.logits[i * vocab..(i + 1) * vocab]
            };
            let s = self.seqs.get_mut(seq).expect("planned sequences are live");
            debug_assert!(
                s.prompt_logprobs.is_none()
                    || s.generated() > 0
                    || s.prompt_scored.len() == s.prompt_len - 1,
                "every prompt token after the first is scored before the first output"
            );
            let token = if ids {
                debug_assert!(!greedy::row_needs_logits(s.sampler.params()));
                crate::sampling::SampledToken::without_logprobs(self.ids[i])
            } else {
                s.sampler.sample(row, &mut self.sampler_scratch)
            };
            s.tokens.push(token.id);
            let stop =
                s.stop_token_ids.contains(&token.id) || (!s.ignore_eos && eos.contains(&token.id));
            let finish = if stop {
                Some(FinishReason::Stop(token.id))
            } else if s.generated() >= s.max_new_tokens || s.tokens.len() >= max_context {
                Some(FinishReason::Length)
            } else {
                None
            };
            out.push(SeqOutput {
                seq: *seq,
                token,
                finish,
                logits: return_logits.then(|| row.to_vec()),
                prompt_logprobs: std::mem::take(&mut s.prompt_scored),
            });
            if finish.is_some() {
                self.seqs.remove(seq);
            }
        }
        out
    }

    /// Validates the plan, orders its rows by adapter and grows KV, filling `self.layout`.
    fn build_layout(&mut self, plan: &StepPlan) -> Result<()> {
        self.layout.clear();
        self.lora_layout.clear();
        self.seq_order.clear();
        self.sample_order.clear();
        self.prompt_rows.clear();
        self.prompt_targets.clear();
        let mut total = 0usize;
        for (i, it) in plan.items.iter().enumerate() {
            let s = self
                .seqs
                .get(&it.seq)
                .ok_or(RuntimeError::UnknownSequence(it.seq))?;
            if it.num_tokens == 0 || it.num_tokens > s.pending() {
                return Err(RuntimeError::InvalidPlan(format!(
                    "sequence {} has {} pending token(s), plan asks for {}",
                    it.seq,
                    s.pending(),
                    it.num_tokens
                )));
            }
            if plan.items[..i].iter().any(|o| o.seq == it.seq) {
                return Err(RuntimeError::InvalidPlan(format!(
                    "sequence {} appears twice",
                    it.seq
                )));
            }
            total += it.num_tokens;
        }
        if total > self.cfg.max_batch_tokens || plan.items.len() > self.cfg.max_batch_seqs {
            return Err(RuntimeError::InvalidPlan(format!(
                "{} tokens in {} sequences exceed the step limits ({} tokens, {} sequences)",
                total,
                plan.items.len(),
                self.cfg.max_batch_tokens,
                self.cfg.max_batch_seqs
            )));
        }
        let needed: usize = plan
            .items
            .iter()
            .map(|it| self.blocks_needed(it.seq, it.num_tokens).unwrap_or(0))
            .sum();
        let usage = self.blocks.usage();
        if needed > usage.free_blocks() {
            return Err(RuntimeError::KvExhausted {
                needed,
                free: usage.free_blocks(),
                total: usage.total_blocks,
            });
        }
        // Rows of one adapter contiguous, in first-appearance order (stable within a group).
        let mut order: Vec<(Option<u32>, usize)> = Vec::with_capacity(plan.items.len());
        let mut step_adapters: Vec<AdapterId> = Vec::new();
        for (i, it) in plan.items.iter().enumerate() {
            let a = self.seqs[&it.seq].adapter;
            let idx = a.map(|a| match step_adapters.iter().position(|&x| x == a) {
                Some(p) => p as u32,
                None => {
                    step_adapters.push(a);
                    (step_adapters.len() - 1) as u32
                }
            });
            order.push((idx, i));
        }
        order.sort_by_key(|&(a, i)| (a.map_or(u32::MAX, |a| a), i));
        for (a, i) in order {
            let it = plan.items[i];
            let s = self.seqs.get_mut(&it.seq).expect("validated above");
            self.blocks.grow_to(&mut s.kv, s.computed + it.num_tokens)?;
            let r0 = self.layout.rows();
            let b0 = self.layout.block_tables.len();
            self.layout.block_tables.extend(s.kv.table());
            self.layout
                .token_ids
                .extend_from_slice(&s.tokens[s.computed..s.computed + it.num_tokens]);
            self.layout
                .positions
                .extend(s.computed..s.computed + it.num_tokens);
            let r1 = self.layout.rows();
            self.layout.seqs.push(crate::backend::SeqSlice {
                rows: r0..r1,
                start_pos: s.computed,
                blocks: b0..self.layout.block_tables.len(),
            });
            self.seq_order.push(it.seq);
            if s.computed + it.num_tokens == s.tokens.len() {
                self.layout.logit_rows.push(r1 - 1);
                self.sample_order.push(it.seq);
            }
            if s.prompt_logprobs.is_some() {
                // The row at position q scores prompt token q + 1, which may open the next
                // chunk: chunked and whole prefills score the same rows.
                let scored = (s.computed..s.computed + it.num_tokens)
                    .zip(r0..r1)
                    .take_while(|&(q, _)| q + 1 < s.prompt_len);
                for (q, r) in scored {
                    self.prompt_rows.push(r);
                    self.prompt_targets.push((it.seq, s.tokens[q + 1]));
                }
            }
            self.lora_layout.row_adapter.extend((r0..r1).map(|_| a));
            if let Some(a) = a {
                match self.lora_layout.segments.last_mut() {
                    Some((range, last)) if *last == a => range.end = r1,
                    _ => self.lora_layout.segments.push((r0..r1, a)),
                }
            }
        }
        self.step_adapter_ids = step_adapters;
        Ok(())
    }
}
