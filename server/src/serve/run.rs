//! Starting `thaw serve`: load the model and tokenizer, start the engine thread, load the
//! start-up adapters, then serve HTTP until SIGTERM/SIGINT and drain.
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use thaw_runtime::backend::any::AnyBackend;
use thaw_runtime::residency::LinkModel;

use crate::coldstart::ColdStartPolicy;
use crate::engine_loop::{ColdStart, LoopConfig};
use crate::memory::budget::{kv_page_bytes, DeviceMemory};
use crate::memory::profile::{build_engine, Sizing};
use crate::memory::{Board, EvictionPolicy, Limits, MemoryConfig};
use thaw_runtime::backend::{Backend, LoraKernel};
use thaw_runtime::engine::{EngineConfig, HostModel};

use super::config::ServeConfig;
use crate::chat::ChatTemplate;
use crate::engine_loop;
use crate::http::{router, AppState};
use crate::metrics::Metrics;
use crate::registry::{AdapterLimits, Registry};
use crate::scheduler::SchedConfig;

/// A started server: state shared with the handlers, and the engine thread.
pub struct Server {
    pub state: Arc<AppState>,
    pub config: ServeConfig,
    engine_thread: Option<JoinHandle<()>>,
}

/// The demo's base model name.
pub const DEMO_MODEL_NAME: &str = "thaw-demo";

impl Server {
    /// Loads everything; call inside a tokio runtime. Adapter failures at start-up are fatal.
    pub async fn start(mut config: ServeConfig) -> anyhow::Result<Self> {
        let (model_dir, default_name) = match &config.model {
            Some(m) => (m.clone(), m.display().to_string()),
            None => {
                let cache = crate::demo::cache_dir();
                let demo =
                    tokio::task::spawn_blocking(move || crate::demo::ensure_demo(&cache)).await??;
                for p in &demo.adapters {
                    if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
                        config.lora_modules.push((name.to_string(), p.clone()));
                    }
                }
                (demo.model, DEMO_MODEL_NAME.to_string())
            }
        };
        let served_names = if config.served_model_name.is_empty() {
            vec![default_name]
        } else {
            config.served_model_name.clone()
        };
        let dir = model_dir.clone();
        let (model, tokenizer) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let (model, tok) = HostModel::load_with_tokenizer(&dir)
                .with_context(|| format!("loading the model from {}", dir.display()))?;
            Ok((model, tok))
        })
        .await??;
        let mc = model.config.clone();
        let max_model_len = match config.max_model_len {
            Some(l) => {
                anyhow::ensure!(
                    l >= 2 && l <= mc.max_position_embeddings,
                    "--max-model-len {l} must be between 2 (a prompt token and a generated one) \
                     and the model's context of {}",
                    mc.max_position_embeddings
                );
                l
            }
            None => mc.max_position_embeddings,
        };
        let bs = config.block_size;
        let budget_fits = move |blocks: usize, page_bytes: u64| {
            anyhow::ensure!(
                blocks >= max_model_len.div_ceil(bs),
                "the device budget ({blocks} KV blocks of {page_bytes} bytes) cannot hold one \
                 sequence of --max-model-len {max_model_len}; raise --device-memory-bytes \
                 (--gpu-memory-utilization on CUDA) or lower --max-model-len"
            );
            Ok(())
        };
        // A page's bytes depend on the backend's KV element (f32 on the CPU, bf16 on CUDA):
        // the engine thread sizes it once the backend exists and reports it here.
        let page_bytes_out = Arc::new(std::sync::OnceLock::<u64>::new());
        let page_bytes_set = page_bytes_out.clone();
        let sched = SchedConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            block_size: bs,
            total_blocks: 0,
            kv_reservation: config.kv_reservation,
        };
        let ecfg = EngineConfig {
            kv_block_size: bs,
            num_kv_blocks: 0,
            max_batch_tokens: config.max_num_batched_tokens,
            max_batch_seqs: config.max_num_seqs,
            max_context: Some(max_model_len),
            lora_kernel: if config.lora_kernel == "bgmv" {
                LoraKernel::Bgmv
            } else {
                LoraKernel::Sgmv
            },
            seed: config.seed,
            enable_prefix_caching: config.enable_prefix_caching,
            cuda_graphs: config.cuda_graphs,
            cuda_graph_max_bs: config.cuda_graph_max_bs,
        };
        let metrics = Arc::new(Metrics::default());
        let cold_cfg = config.clone();
        let board = Arc::new(Board::default());
        // The engine thread answers with the budget it sized (a memory profile on CUDA).
        let (engine, thread, sched) = engine_loop::start(
            move || {
                let link = LinkModel {
                    gbps: cold_cfg.emulated_link_gbps,
                    latency_us: cold_cfg.emulated_link_latency_us,
                };
                let device = cold_cfg.device.resolve()?;
                // The upload arena is allocated (and pinned) once, here, sized like the host
                // tier: loader threads write adapters into it, the copy thread drains it.
                let arena = usize::try_from(cold_cfg.max_cpu_lora_bytes).unwrap_or(usize::MAX);
                let backend = AnyBackend::new(&device, &model.config, link)?
                    .with_kv_cache_dtype(cold_cfg.kv_cache_dtype)?
                    .with_upload_arena(arena)?;
                let block_bytes = kv_page_bytes(&model.config, bs, backend.kv_elem_bytes());
                let _ = page_bytes_set.set(block_bytes);
                // One pool of pages (a KV block each) for KV and adapters:
                // --num-gpu-blocks-override pages, or the device budget in pages (on CUDA the
                // memory profile below sizes it instead).
                let ecfg = EngineConfig {
                    num_kv_blocks: cold_cfg
                        .num_gpu_blocks_override
                        .unwrap_or((cold_cfg.device_memory_bytes / block_bytes) as usize),
                    ..ecfg
                };
                // On CUDA (a device that reports its memory), --gpu-memory-utilization sizes
                // the pool from a memory profile unless --num-gpu-blocks-override is given.
                let sizing = cold_cfg
                    .num_gpu_blocks_override
                    .is_none()
                    .then_some(Sizing {
                        utilization: cold_cfg.gpu_memory_utilization,
                        page_bytes: block_bytes,
                        min_pages: max_model_len.div_ceil(bs),
                    });
                let (mut engine, num_blocks) =
                    build_engine(backend, model, ecfg, sizing, |b: &AnyBackend| {
                        Ok(b.memory_info()?
                            .map(|(free, total)| DeviceMemory { free, total }))
                    })?;
                budget_fits(num_blocks, block_bytes)?;
                let sched = SchedConfig {
                    total_blocks: num_blocks,
                    ..sched
                };
                if cold_cfg.cold_start != ColdStartPolicy::Cached && cold_cfg.lora_workers > 0 {
                    // The engine thread keeps the first core; the workers take the next ones,
                    // so a spinning worker never shares a core with the engine.
                    if let Some(first) =
                        core_affinity::get_core_ids().and_then(|c| c.first().copied())
                    {
                        core_affinity::set_for_current(first);
                    }
                    engine.attach_pool(start_workers(&engine, &cold_cfg)?)?;
                }
                let cost = crate::coldstart::calibrate(&mut engine)?;
                tracing::info!(
                    policy = %cold_cfg.cold_start,
                    workers = cold_cfg.lora_workers,
                    device = engine.backend_name(),
                    link_gbps = cost.link.gbps,
                    link_latency_us = cost.link.latency_us,
                    "cold start"
                );
                let cold = ColdStart {
                    policy: cold_cfg.cold_start,
                    cost,
                };
                let memory = MemoryConfig {
                    page_bytes: block_bytes,
                    total_pages: num_blocks,
                    policy: cold_cfg.adapter_eviction,
                    max_loras: cold_cfg.max_loras,
                    // The workers' host store holds an adapter while it streams (sized for
                    // --max-cpu-loras of them); once landed it stays on the device without.
                    max_streaming_adapters: engine.pool().map(|_| cold_cfg.max_cpu_loras),
                    host_max_adapters: cold_cfg.max_cpu_loras,
                    host_max_bytes: cold_cfg.max_cpu_lora_bytes,
                };
                let limits = Limits {
                    max_loras: cold_cfg.max_loras,
                    max_num_seqs: cold_cfg.max_num_seqs,
                    bypass: cold_cfg.admission_bypass,
                    prefetch: true,
                    keep_idle: cold_cfg.adapter_eviction.keeps_idle(),
                };
                Ok((
                    engine,
                    LoopConfig {
                        sched,
                        cold,
                        memory,
                        limits,
                        scheduling: engine_loop::Scheduling {
                            policy: cold_cfg.scheduling_policy,
                            mlq: crate::scheduler::MlqConfig {
                                weights: crate::scheduler::WrsWeights {
                                    max_input: max_model_len,
                                    max_output: max_model_len,
                                    max_rank: cold_cfg.max_lora_rank,
                                    ..Default::default()
                                },
                                max_wait_s: cold_cfg.mlq_max_wait_ms / 1e3,
                                protect: cold_cfg.mlq_protect,
                                ..Default::default()
                            },
                            tpot_slo_s: cold_cfg.tpot_slo_ms.map(|ms| ms / 1e3),
                            auto_kernel: cold_cfg.lora_kernel == "auto",
                        },
                        emulated_step: cold_cfg.emulated_step_time,
                        step_log: cold_cfg
                            .dump_cost_model
                            .as_deref()
                            .map(crate::perf::steplog::steps_path),
                    },
                ))
            },
            config.max_queued_requests,
            metrics.clone(),
            board.clone(),
        )?;
        let registry = Arc::new(Registry::new(
            Arc::new(engine.clone()),
            board,
            mc.clone(),
            AdapterLimits {
                max_lora_rank: config.max_lora_rank,
                max_loras: config.max_loras,
                max_cpu_loras: config.max_cpu_loras,
                unload_wait: config.unload_timeout,
                device_budget_bytes: sched.total_blocks as u64
                    * page_bytes_out.get().copied().unwrap_or(0),
                fixed_slots: config.adapter_eviction == EvictionPolicy::FixedSlots,
                lora_dtype: engine.stats.lora_dtype.get().copied(),
            },
            metrics.clone(),
        ));
        for (name, path) in &config.lora_modules {
            registry.load(name, path).await.map_err(|e| {
                anyhow::anyhow!("loading adapter `{name}` from {}: {e}", path.display())
            })?;
        }
        let chat = match tokenizer.chat_template() {
            Some(src) => Some(
                ChatTemplate::new(src, tokenizer.bos_token(), tokenizer.eos_token())
                    .context("compiling the model's chat template")?,
            ),
            None => None,
        };
        let max_token_bytes = crate::http::max_token_bytes(&tokenizer);
        let state = Arc::new(AppState {
            engine,
            registry,
            tokenizer: Arc::new(tokenizer),
            max_token_bytes,
            chat,
            metrics,
            shutting_down: AtomicBool::new(false),
            served_names,
            model_root: model_dir.display().to_string(),
            max_model_len,
            vocab_size: mc.vocab_size,
            sched,
            max_body_bytes: config.max_request_body_bytes,
            created: crate::http::unix_now(),
            api_keys: crate::http::ApiKeys::new(config.api_keys.iter().map(|k| k.trim())),
            lora_access: crate::http::LoraAccess::new(
                config.allow_runtime_lora_updating,
                config.lora_root.as_deref(),
            )
            .with_context(|| match &config.lora_root {
                Some(r) => format!("resolving --lora-root {}", r.display()),
                None => String::new(),
            })?,
        });
        Ok(Self {
            state,
            config,
            engine_thread: Some(thread),
        })
    }

    pub fn router(&self) -> axum::Router {
        router(self.state.clone())
    }

    /// Serves on `listener` until `signal` resolves, then stops accepting, lets in-flight
    /// requests finish for up to `--shutdown-timeout` (aborting the rest) and stops the engine.
    pub async fn serve(
        mut self,
        listener: tokio::net::TcpListener,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let state = self.state.clone();
        let timeout = self.config.shutdown_timeout;
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let graceful = async move {
            let _ = stop_rx.wait_for(|v| *v).await;
        };
        let app = self.router();
        let trimmer = super::idle_trim::spawn(state.clone());
        let dumper = self
            .config
            .dump_cost_model
            .clone()
            .map(|p| super::dump::spawn_periodic(state.clone(), self.config.max_cpu_loras, p));
        let mut task = tokio::spawn(async move {
            // Tokens are small writes: without TCP_NODELAY, Nagle + delayed ACK add ~40 ms.
            use axum::serve::ListenerExt;
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!("could not set TCP_NODELAY: {e}");
                }
            });
            axum::serve(listener, app)
                .with_graceful_shutdown(graceful)
                .await
        });
        tokio::select! {
            r = &mut task => {
                r.context("the HTTP server task failed")??;
            }
            _ = signal => {
                tracing::info!(
                    "shutting down: no new requests; draining in-flight ones for up to {:.1} s",
                    timeout.as_secs_f64()
                );
                state.shutting_down.store(true, Ordering::SeqCst);
                state.engine.drain(Instant::now() + timeout);
                let _ = stop_tx.send(true);
                match tokio::time::timeout(timeout + Duration::from_secs(2), &mut task).await {
                    Ok(r) => r.context("the HTTP server task failed")??,
                    Err(_) => {
                        tracing::warn!("connections still open after the drain; closing them");
                        task.abort();
                    }
                }
            }
        }
        trimmer.abort();
        if let Some(d) = dumper {
            d.abort();
        }
        self.stop().await;
        if let Some(p) = &self.config.dump_cost_model {
            super::dump::write(&self.state, self.config.max_cpu_loras, p);
            tracing::info!("wrote the cost model to {}", p.display());
        }
        Ok(())
    }

    /// Stops the engine thread (aborting whatever is left) and waits for it briefly.
    pub async fn stop(&mut self) {
        self.state.shutting_down.store(true, Ordering::SeqCst);
        self.state.engine.shutdown();
        if let Some(t) = self.engine_thread.take() {
            let joined = tokio::task::spawn_blocking(move || t.join());
            if tokio::time::timeout(Duration::from_secs(5), joined)
                .await
                .is_err()
            {
                tracing::warn!("the engine thread did not stop within 5 s");
            }
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Threads of tokio's blocking pool, which tokenises prompts and reads adapters from disk.
/// Tokenising is CPU-bound, so threads beyond a few per core only queue on the cores; tokio's
/// default (512) let a burst of 1,000 queued requests grow the pool by dozens of threads whose
/// stacks glibc then caches, resident, after they exit (56 extra threads and idle RSS +24 MiB
/// after an overloaded 3-minute soak). Tasks beyond the cap wait in tokio's queue.
pub fn blocking_threads(cores: usize) -> usize {
    (2 * cores).clamp(4, 16)
}

/// `thaw serve`: blocks until shut down.
pub fn run(config: ServeConfig) -> anyhow::Result<()> {
    super::idle_trim::tune_allocator();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("thaw-http")
        .max_blocking_threads(blocking_threads(cores))
        .build()?;
    rt.block_on(async move {
        let demo = config.model.is_none();
        let addr = format!("{}:{}", config.host, config.port);
        let server = Server::start(config).await?;
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| {
                format!("binding {addr}; is another server using that port? pass --port")
            })?;
        let local: SocketAddr = listener.local_addr()?;
        print_banner(&server, local, demo);
        server.serve(listener, shutdown_signal()).await
    })
}

fn print_banner(server: &Server, addr: SocketAddr, demo: bool) {
    let s = &server.state;
    let adapters = s.registry.views();
    // The engine thread resolved the device the same way: CUDA when asked for or found.
    let backend = match server.config.device {
        thaw_runtime::backend::DeviceKind::Cuda => "CUDA",
        thaw_runtime::backend::DeviceKind::Auto if thaw_runtime::backend::cuda_available() => {
            "CUDA"
        }
        _ => "CPU",
    };
    println!(
        "thaw: serving `{}` with {} adapter(s) on http://{addr} ({backend} backend{})",
        s.base_name(),
        adapters.len(),
        if demo { ", embedded demo" } else { "" }
    );
    let model = adapters
        .first()
        .map(|a| a.name.clone())
        .unwrap_or_else(|| s.base_name().to_string());
    println!("try:");
    println!(
        "  curl http://{addr}/v1/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 16}}'"
    );
    println!("  curl http://{addr}/v1/models");
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// Spawns the CPU LoRA workers from this executable's hidden `lora-worker` subcommand, one per
/// core after the engine's, with an exchange sized for a full step of this model.
fn start_workers(
    engine: &crate::engine_loop::ServeEngine,
    cfg: &ServeConfig,
) -> anyhow::Result<thaw_cpu_lora::LoraPool> {
    let c = engine.model_config();
    let widest = c.hidden_size.max(c.intermediate_size).max(c.q_dim()) as u32;
    // Adapters reach the store in the dtype the backend computes them from (CUDA's weight
    // dtype: f32 files are converted on the loader threads), or as stored (CPU: f32 at most).
    let elem = engine
        .backend()
        .lora_dtype()
        .map_or(std::mem::size_of::<f32>(), |d| d.size());
    let store = thaw_ipc::HostStore::create(
        host_store_bytes(
            c,
            StoreBound {
                max_rank: cfg.max_lora_rank,
                adapters: cfg.max_cpu_loras,
                elem_bytes: elem,
                host_tier_bytes: cfg.max_cpu_lora_bytes,
            },
        ),
        cfg.max_cpu_loras.max(1) as u32 + 8,
    )
    .context("creating the shared host adapter store")?;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let worker_cores: Vec<usize> = cores
        .iter()
        .skip(1)
        .take(cfg.lora_workers)
        .map(|c| c.id)
        .collect();
    let pool = thaw_cpu_lora::LoraPool::new(
        thaw_cpu_lora::PoolConfig {
            cores: (!worker_cores.is_empty()).then_some(worker_cores),
            exchange: thaw_ipc::ExchangeConfig {
                max_rows: cfg.max_num_batched_tokens as u32,
                max_d_in: widest,
                max_d_out: widest,
                ..Default::default()
            },
            ..Default::default()
        },
        store,
    )
    .context("starting the CPU LoRA workers (thaw lora-worker)")?;
    Ok(pool)
}

/// What bounds the workers' host store.
#[derive(Copy, Clone, Debug)]
struct StoreBound {
    /// `--max-lora-rank`: the largest adapter accepted has it on every projection.
    max_rank: usize,
    /// `--max-cpu-loras`: adapters the store holds at once (those still streaming).
    adapters: usize,
    /// Bytes a weight of an adapter in the store: the backend's adapter dtype (2 on CUDA's
    /// bf16), or 4 where adapters keep their stored dtype (an f32 file stays f32).
    elem_bytes: usize,
    /// `--max-cpu-lora-bytes`: the host tier's bound on adapter bytes.
    host_tier_bytes: u64,
}

/// Arena bytes of the workers' host store: room for `adapters` of the largest adapter the
/// server accepts (`max_rank` on every projection of every layer, in `elem_bytes` a weight),
/// but no more than the host tier holds (`--max-cpu-lora-bytes`, plus each adapter's
/// descriptors and alignment): the store holds only adapters still streaming, which the host
/// tier holds too. Never below one largest adapter, so no accepted adapter is refused for
/// size. The store is a sparse memfd: only the pages adapters fill are committed.
fn host_store_bytes(c: &thaw_runtime::model::ModelConfig, b: StoreBound) -> u64 {
    let bytes = |n: usize| (n * b.elem_bytes) as u64;
    let layer = thaw_runtime::adapter::LoraModule::ALL.map(|m| {
        let (d_in, d_out) = c.module_shape(m);
        (bytes(b.max_rank * d_in), bytes(d_out * b.max_rank))
    });
    let n_layers = c.num_layers as u32;
    let largest = thaw_ipc::HostStore::footprint(n_layers, (0..c.num_layers).flat_map(|_| layer));
    // Descriptors plus the most alignment padding one adapter's factors can need.
    let overhead =
        thaw_ipc::HostStore::footprint(n_layers, (0..c.num_layers * layer.len()).map(|_| (1, 1)));
    let adapters = b.adapters.max(1) as u64;
    let by_tier = b.host_tier_bytes.saturating_add(adapters * overhead);
    (largest * adapters).min(by_tier).max(largest)
}

#[cfg(test)]
mod tests {
    use super::{blocking_threads, host_store_bytes, StoreBound};
    use crate::gen::{model_config, preset, write_adapters, write_model, GenAdaptersOptions};
    use thaw_runtime::adapter::LoraAdapter;
    use thaw_runtime::model::ModelConfig;

    fn config(name: &str) -> ModelConfig {
        let p = preset(name).unwrap();
        ModelConfig::from_json(&model_config(&p, p.default_dtype).to_string()).unwrap()
    }

    /// Two per core, at least four (a 1-core box still tokenises while an adapter loads), at
    /// most sixteen.
    #[test]
    fn blocking_pool_is_a_few_threads_per_core() {
        assert_eq!(blocking_threads(1), 4);
        assert_eq!(blocking_threads(2), 4);
        assert_eq!(blocking_threads(6), 12);
        assert_eq!(blocking_threads(64), 16);
    }

    fn bound(max_rank: usize, adapters: usize, elem_bytes: usize, tier: u64) -> StoreBound {
        StoreBound {
            max_rank,
            adapters,
            elem_bytes,
            host_tier_bytes: tier,
        }
    }

    /// The bound is exactly the store footprint of a max-rank adapter on every projection.
    #[test]
    fn host_store_fits_the_largest_accepted_adapter() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        write_model(&preset("tiny").unwrap(), &model, &Default::default()).unwrap();
        let written = write_adapters(&GenAdaptersOptions {
            model_dir: model.clone(),
            out_dir: dir.path().join("adapters"),
            count: 1,
            ranks: vec![16],
            ..Default::default()
        })
        .unwrap();
        let config = ModelConfig::from_dir(&model).unwrap();
        let a = LoraAdapter::load(&written[0], &config).unwrap();
        assert_eq!(
            a.iter().count(),
            7 * config.num_layers,
            "not every projection"
        );
        let elem = a.dtype().size();
        let footprint = thaw_ipc::HostStore::footprint(
            config.num_layers as u32,
            a.iter()
                .map(|(_, _, w)| (w.a.bytes().len() as u64, w.b.bytes().len() as u64)),
        );
        let big = u64::MAX;
        assert_eq!(
            host_store_bytes(&config, bound(16, 1, elem, big)),
            footprint
        );
        assert_eq!(
            host_store_bytes(&config, bound(16, 3, elem, big)),
            3 * footprint
        );
        assert!(host_store_bytes(&config, bound(8, 1, elem, big)) < footprint);
        // The one adapter always fits, whatever the host tier's bound.
        assert_eq!(host_store_bytes(&config, bound(16, 3, elem, 0)), footprint);
    }

    /// Llama-2-7B shapes at rank 256 on every projection: about 2.5 GB per f32 adapter, half
    /// that in CUDA's bf16. (A fixed 64 MB per adapter refused even rank-16 all-projection
    /// adapters of a 7B model.) With the defaults (64 adapters, a 4 GiB host tier) the store
    /// is the host tier's size plus descriptors and padding, not 64 × 2.5 GB.
    #[test]
    fn llama_7b_adapter_bound() {
        let c = config("llama-7b-shape");
        let big = u64::MAX;
        let per = host_store_bytes(&c, bound(256, 1, 4, big));
        assert!((2_500_000_000..2_600_000_000).contains(&per), "{per}");
        let bf16 = host_store_bytes(&c, bound(256, 1, 2, big));
        assert!(
            bf16 < per / 2 + (4 << 20) && bf16 > per / 2,
            "{bf16} vs {per}"
        );
        assert!(host_store_bytes(&c, bound(16, 1, 4, big)) > 64 << 20);
        let defaults = host_store_bytes(&c, bound(256, 64, 2, 4 << 30));
        assert!(
            defaults > 4 << 30 && defaults < (4 << 30) + 64 * (8 << 20),
            "{defaults}"
        );
        assert!(defaults < 64 * bf16 / 8);
    }

    /// Property: the store holds one largest adapter, never more than `adapters` of them,
    /// and never more than the host tier plus per-adapter overhead unless one adapter needs it;
    /// halving the element never grows it.
    #[test]
    fn host_store_bound_properties() {
        use proptest::prelude::*;
        let c = config("tiny");
        proptest!(|(rank in 1usize..64, n in 1usize..32, tier in 0u64..(64 << 20))| {
            let one = host_store_bytes(&c, bound(rank, 1, 4, u64::MAX));
            let got = host_store_bytes(&c, bound(rank, n, 4, tier));
            prop_assert!(got >= one);
            prop_assert!(got <= one * n as u64);
            // A tiny-model adapter's descriptors and padding are well under 1 MiB.
            prop_assert!(got <= one.max(tier + n as u64 * (1 << 20)));
            prop_assert!(host_store_bytes(&c, bound(rank, n, 2, tier)) <= got);
        });
    }
}
