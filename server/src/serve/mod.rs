//! `thaw serve`: flags and config file, start-up, and the serve/drain lifecycle.

mod args;
mod config;
mod dump;
pub mod idle_trim;
mod run;

pub use args::ServeArgs;
pub use config::{parse_lora_module, scan_lora_dir, FileConfig, LoraModules, ServeConfig};
pub use run::{run, shutdown_signal, Server, DEMO_MODEL_NAME};
