//! `thaw-bench`: Thaw's benchmarks. Each subcommand prints a table; none asserts a time.
use clap::{Parser, Subcommand};

mod engine_bench;

#[derive(Parser, Debug)]
#[command(
    name = "thaw-bench",
    about = "Thaw benchmarks: tables, never pass/fail on time"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// CPU engine prefill/decode throughput with 0, 1 and N distinct adapters in the batch.
    Engine(engine_bench::EngineBenchArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Engine(args) => {
            let rows = engine_bench::run(&args)?;
            println!("{}", engine_bench::table(&args, &rows));
        }
    }
    Ok(())
}
