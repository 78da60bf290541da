//! `thaw serve` settings: the resolved [`ServeConfig`], and the TOML file (`--config`) that
//! says the same things as the flags. Flags override the file; the file overrides defaults.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Everything `thaw serve` needs, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeConfig {
    /// HF model directory; None serves the embedded demo.
    pub model: Option<PathBuf>,
    pub host: String,
    pub port: u16,
    /// Adapters to load at start-up, (name, path).
    pub lora_modules: Vec<(String, PathBuf)>,
    /// A directory whose subdirectories are adapters named after them.
    pub lora_dir: Option<PathBuf>,
    pub max_lora_rank: usize,
    pub max_loras: usize,
    pub max_cpu_loras: usize,
    pub max_cpu_lora_bytes: u64,
    /// The CPU backend's emulated device memory (KV and adapters).
    pub device_memory_bytes: u64,
    /// vLLM's `--gpu-memory-utilization` (CUDA backend).
    pub gpu_memory_utilization: f64,
    pub adapter_eviction: crate::memory::EvictionPolicy,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// None: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub max_queued_requests: usize,
    pub shutdown_timeout: Duration,
    pub served_model_name: Vec<String>,
    pub block_size: usize,
    /// None: sized from --max-num-seqs × --max-model-len within a memory budget.
    pub num_gpu_blocks_override: Option<usize>,
    pub max_request_body_bytes: usize,
    /// How long an unload waits for requests still using the adapter.
    pub unload_timeout: Duration,
    pub seed: u64,
    pub lora_kernel: String,
    pub cold_start: crate::coldstart::ColdStartPolicy,
    pub scheduling_policy: crate::scheduler::SchedulingPolicy,
    /// Milliseconds; None: no rank-aware cap.
    pub tpot_slo_ms: Option<f64>,
    /// Milliseconds a request waits under mlq before it goes first (the starvation bound).
    pub mlq_max_wait_ms: f64,
    /// Under mlq, protect the oldest large request (see `scheduler::mlq::protect`).
    pub mlq_protect: bool,
    /// The memory layer's bounded bypass of a head waiting for memory (false: strict order).
    pub admission_bypass: bool,
    /// Reuse the KV of cached prefixes, keyed by adapter generation (vLLM V1's default).
    pub enable_prefix_caching: bool,
    /// How the KV cache stores K and V (`--kv-cache-dtype`).
    pub kv_cache_dtype: thaw_runtime::backend::cpu_kv::KvCacheDtype,
    /// Decode steps as CUDA graphs (`--cuda-graphs`; `--enforce-eager` keeps them off).
    pub cuda_graphs: bool,
    /// Largest decode batch captured; None: `max_num_seqs`.
    pub cuda_graph_max_bs: Option<usize>,
    /// How admission charges KV: on demand (default) or the `max-tokens` benchmark baseline.
    pub kv_reservation: crate::scheduler::KvReservation,
    pub emulated_link_gbps: f64,
    pub emulated_link_latency_us: f64,
    /// `--emulated-step-time`: a step never returns before this floor of its shape (bench-only;
    /// None: off).
    pub emulated_step_time: Option<crate::emulated_step::StepFloor>,
    pub lora_workers: usize,
    /// Where to write the fitted cost model (JSON) every few seconds and at shutdown.
    pub dump_cost_model: Option<PathBuf>,
    /// API keys every `/v1/*` request must present as a bearer token; empty: no auth.
    pub api_keys: Vec<String>,
    /// Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served.
    pub allow_runtime_lora_updating: bool,
    /// Runtime adapter loads must resolve inside this directory.
    pub lora_root: Option<PathBuf>,
    pub device: thaw_runtime::backend::DeviceKind,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            model: None,
            host: "127.0.0.1".into(),
            port: 8000,
            lora_modules: Vec::new(),
            lora_dir: None,
            max_lora_rank: 256,
            max_loras: 16,
            max_cpu_loras: 64,
            max_cpu_lora_bytes: 4 << 30,
            device_memory_bytes: 512 << 20,
            gpu_memory_utilization: 0.9,
            adapter_eviction: crate::memory::EvictionPolicy::Cost,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            max_queued_requests: 1024,
            shutdown_timeout: Duration::from_secs(30),
            served_model_name: Vec::new(),
            block_size: 16,
            num_gpu_blocks_override: None,
            max_request_body_bytes: 16 << 20,
            unload_timeout: Duration::from_secs(10),
            seed: 0,
            lora_kernel: "sgmv".into(),
            cold_start: crate::coldstart::ColdStartPolicy::Auto,
            scheduling_policy: crate::scheduler::SchedulingPolicy::Fcfs,
            tpot_slo_ms: None,
            mlq_max_wait_ms: 30_000.0,
            mlq_protect: true,
            admission_bypass: true,
            enable_prefix_caching: true,
            kv_cache_dtype: Default::default(),
            cuda_graphs: false,
            cuda_graph_max_bs: None,
            kv_reservation: crate::scheduler::KvReservation::OnDemand,
            emulated_link_gbps: 25.0,
            emulated_link_latency_us: 10.0,
            emulated_step_time: None,
            lora_workers: default_lora_workers(),
            dump_cost_model: None,
            api_keys: Vec::new(),
            allow_runtime_lora_updating: false,
            lora_root: None,
            device: thaw_runtime::backend::DeviceKind::Auto,
        }
    }
}

/// `lora_modules` in TOML: a table `{name = "path"}` or a list of `"name=path"`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum LoraModules {
    Table(BTreeMap<String, PathBuf>),
    List(Vec<String>),
}

/// The TOML config file: every key is a flag's name with `_` for `-`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub model: Option<PathBuf>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub lora_modules: Option<LoraModules>,
    pub lora_dir: Option<PathBuf>,
    pub max_lora_rank: Option<usize>,
    pub max_loras: Option<usize>,
    pub max_cpu_loras: Option<usize>,
    pub max_cpu_lora_bytes: Option<u64>,
    pub device_memory_bytes: Option<u64>,
    pub gpu_memory_utilization: Option<f64>,
    pub adapter_eviction: Option<crate::memory::EvictionPolicy>,
    pub max_num_seqs: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    pub max_model_len: Option<usize>,
    pub max_queued_requests: Option<usize>,
    /// Seconds.
    pub shutdown_timeout: Option<f64>,
    pub served_model_name: Option<Vec<String>>,
    pub block_size: Option<usize>,
    pub num_gpu_blocks_override: Option<usize>,
    pub max_request_body_bytes: Option<usize>,
    /// Seconds.
    pub unload_timeout: Option<f64>,
    pub seed: Option<u64>,
    pub lora_kernel: Option<String>,
    pub cold_start: Option<crate::coldstart::ColdStartPolicy>,
    pub scheduling_policy: Option<crate::scheduler::SchedulingPolicy>,
    pub tpot_slo_ms: Option<f64>,
    pub mlq_max_wait_ms: Option<f64>,
    pub mlq_protect: Option<bool>,
    pub admission_bypass: Option<bool>,
    pub enable_prefix_caching: Option<bool>,
    /// auto, fp16 or bf16.
    pub kv_cache_dtype: Option<String>,
    pub cuda_graphs: Option<bool>,
    pub enforce_eager: Option<bool>,
    pub cuda_graph_max_bs: Option<usize>,
    pub kv_reservation: Option<crate::scheduler::KvReservation>,
    pub emulated_link_gbps: Option<f64>,
    pub emulated_link_latency_us: Option<f64>,
    pub lora_workers: Option<usize>,
    pub dump_cost_model: Option<PathBuf>,
    /// One key or a list.
    pub api_key: Option<OneOrMany>,
    pub allow_runtime_lora_updating: Option<bool>,
    pub lora_root: Option<PathBuf>,
    /// auto, cpu or cuda.
    pub device: Option<String>,
}

/// A TOML value that is one string or a list of strings.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// One worker per core but the engine's, at most four.
pub fn default_lora_workers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .min(4)
}

impl FileConfig {
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing the config file {}", path.display()))
    }
}

/// Parses `name=path`.
pub fn parse_lora_module(s: &str) -> anyhow::Result<(String, PathBuf)> {
    match s.split_once('=') {
        Some((n, p)) if !n.trim().is_empty() && !p.trim().is_empty() => {
            Ok((n.trim().to_string(), PathBuf::from(p.trim())))
        }
        _ => bail!("--lora-modules expects name=path, got `{s}`"),
    }
}

impl LoraModules {
    pub fn into_pairs(self) -> anyhow::Result<Vec<(String, PathBuf)>> {
        match self {
            LoraModules::Table(t) => Ok(t.into_iter().collect()),
            LoraModules::List(v) => v.iter().map(|s| parse_lora_module(s)).collect(),
        }
    }
}

/// Subdirectories of `dir` holding an `adapter_config.json`, named after themselves, sorted.
pub fn scan_lora_dir(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in
        std::fs::read_dir(dir).with_context(|| format!("reading --lora-dir {}", dir.display()))?
    {
        let p = e?.path();
        if p.join("adapter_config.json").is_file() {
            if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
                out.push((name.to_string(), p.clone()));
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_says_what_flags_say() {
        let f: FileConfig = toml::from_str(
            r#"
            model = "/m"
            port = 9000
            lora_modules = { a = "/a", b = "/b" }
            max_loras = 4
            shutdown_timeout = 2.5
            served_model_name = ["base"]
            "#,
        )
        .unwrap();
        assert_eq!(f.port, Some(9000));
        assert_eq!(
            f.lora_modules.unwrap().into_pairs().unwrap(),
            vec![
                ("a".to_string(), PathBuf::from("/a")),
                ("b".to_string(), PathBuf::from("/b"))
            ]
        );
        let l: FileConfig = toml::from_str("lora_modules = [\"x=/x\"]").unwrap();
        assert_eq!(l.lora_modules.unwrap().into_pairs().unwrap()[0].0, "x");
        assert!(
            toml::from_str::<FileConfig>("max_lorass = 3").is_err(),
            "typos are errors"
        );
        assert!(parse_lora_module("noequals").is_err());
    }
}
