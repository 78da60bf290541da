//! A CPU LoRA worker process for this crate's tests and benchmarks; the server runs the same
//! code as its hidden `thaw lora-worker` subcommand.

use clap::Parser;
use thaw_cpu_lora::{worker_main, WorkerArgs};

#[derive(Parser, Debug)]
#[command(
    name = "thaw-lora-worker",
    about = "CPU LoRA worker (spawned by the pool)"
)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

fn main() -> std::process::ExitCode {
    match worker_main(Cli::parse().args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("thaw-lora-worker: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
