//! The HTTP benchmark suite: an open-loop load generator for any OpenAI-compatible endpoint
//! (`thaw-bench load`), the cold-start policy comparison over `thaw serve`
//! (`thaw-bench cold-start`) and the scheduling-policy comparison across rates
//! (`thaw-bench scheduling`). Measures TTFT, TPOT and end-to-end latency at the client.
mod cache;
mod cache_tail;
mod chat;
mod cli;
mod client;
mod coldstart;
mod coldstart_metrics;
mod launch;
pub(crate) mod metrics;
pub(crate) mod plot;
mod prompts;
mod report;
mod runner;
mod scheduling;
mod scheduling_classes;
mod scheduling_report;
mod sweep;
pub(crate) mod workload;

pub use cache::{run_cache, run_cache_scale, CacheArgs, CacheScaleArgs};
pub use cli::{run as run_load, LoadArgs};
pub use coldstart::{default_thaw_bin, run as run_cold_start, ColdStartHttpArgs};
pub use scheduling::{run as run_scheduling, SchedulingArgs};
