//! The HTTP benchmark suite: an open-loop load generator for any OpenAI-compatible endpoint
//! (`thaw-bench load`) and the cold-start policy comparison over `thaw serve`
//! (`thaw-bench cold-start`). Measures TTFT, TPOT and end-to-end latency at the client.
mod cli;
mod client;
mod coldstart;
pub(crate) mod plot;
mod prompts;
mod report;
mod runner;
pub(crate) mod workload;

pub use cli::{run as run_load, LoadArgs};
pub use coldstart::{run as run_cold_start, ColdStartHttpArgs};
