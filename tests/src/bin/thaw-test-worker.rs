//! A CPU LoRA worker process for the cross-crate tests (the server runs the same code as its
//! hidden `thaw lora-worker` subcommand).
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "thaw-test-worker",
    about = "CPU LoRA worker (spawned by the pool)"
)]
struct Cli {
    #[command(flatten)]
    args: thaw_cpu_lora::WorkerArgs,
}

fn main() -> std::process::ExitCode {
    match thaw_cpu_lora::worker_main(Cli::parse().args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("thaw-test-worker: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
