//! `thaw-server`: the `thaw` binary's library — HTTP API, scheduler, cache policy, router,
//! and the generators that make a model and adapters to serve without any download.
//!
//! Owns policy (what to run, cache, evict, where to route); it never touches a device
//! pointer — that is `thaw-runtime`'s job.

pub mod chat;
pub mod coldstart;
pub mod demo;
pub mod deploy;
pub mod emulated_step;
pub mod engine_loop;
pub mod engine_stats;
pub mod error;
pub mod gen;
pub mod generate;
pub mod http;
pub mod lora_open;
pub mod memory;
pub mod metrics;
pub mod metrics_protocol;
pub mod perf;
pub mod procfs;
pub mod registry;
pub mod scheduler;
pub mod serve;
