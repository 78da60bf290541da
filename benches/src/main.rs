//! `thaw-bench`: Thaw's benchmarks. Each subcommand prints a table; none asserts a time.
use clap::{Parser, Subcommand};

mod adapter_land;
mod adapter_load;
mod coldstart_bench;
mod engine_bench;
mod engine_real;
mod gpu;
mod load;
mod lora_bench;
mod lora_decode;
mod lora_socket;
mod quant_bench;
mod quant_step;
mod simulate;
mod soak;
mod soak_verdict;
mod trace;
mod upload_stall;

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
    /// GPU speed (issue 29): decode tok/s and achieved bandwidth at batch 1/8/32/64 with 0, 1
    /// and N adapters, prefill TFLOP/s, the SGMV/BGMV table, against the device's roofline.
    /// `--device cpu --quick` runs a seconds-long version on the CPU backend.
    Gpu(Box<gpu::GpuArgs>),
    /// CPU engine prefill/decode throughput with 0, 1 and N distinct adapters in the batch.
    Engine(engine_bench::EngineBenchArgs),
    /// One-sequence decode step on a real model, step by step in one process: the base model,
    /// an adapter with its deltas beside the base products, and after them (the old path).
    LoraDecode(lora_decode::LoraDecodeArgs),
    /// CPU LoRA invocation round trip: shared memory (spin, futex) vs a UNIX socket, 1…N workers.
    LoraIpc(lora_bench::LoraIpcArgs),
    /// CPU LoRA prefill on 1…N worker processes vs one process with N threads.
    LoraScaling(lora_bench::LoraScalingArgs),
    /// The four --cold-start policies on the engine (CPU backend, emulated link): TTFT/TPOT/E2E
    /// with overheads relative to `cached`.
    ColdStartEngine(coldstart_bench::ColdStartArgs),
    /// The disk -> host read of adapters (`LoraAdapter::load`), alone and queued on 1…N
    /// loader threads, page cache warm: ms per adapter and GB/s.
    AdapterLoad(adapter_load::AdapterLoadArgs),
    /// TPOT of running requests while distinct cold adapters load (host tier and disk), and
    /// the engine thread's adapter work per load and per layer (CPU backend, emulated link).
    UploadStall(upload_stall::UploadStallArgs),
    /// Open-loop load against an OpenAI-compatible server: Poisson / gamma / trace arrivals,
    /// adapter popularity, TTFT / TPOT / E2E at the client; table, JSON and CDF plots.
    Load(load::LoadArgs),
    /// `thaw serve` once per --cold-start policy on the same model, adapters and workload;
    /// TTFT / TPOT / E2E side by side with overheads relative to `cached`.
    ColdStart(Box<load::ColdStartHttpArgs>),
    /// N Thaw instances behind a router, simulated with the cost model `thaw serve
    /// --dump-cost-model` wrote: P50/P99 TTFT, SLO attainment, goodput and adapter loads/s per
    /// router (random, least-queue, the EPP's LoRA affinity, rank+residency) and cluster size.
    Simulate(Box<simulate::SimulateArgs>),
    /// `thaw serve` per --scheduling-policy (and --variant), the same workload at rising rates,
    /// interleaved and repeated (Chameleon Fig. 10): P50/P99 TTFT, P99 TBT, throughput at SLO.
    Scheduling(Box<load::SchedulingArgs>),
    /// Adapter cache (issue 11): `thaw serve` per --adapter-eviction policy (lru, cost,
    /// fixed-slots) at loads up to the sustainable rate; hit rate, TTFT P50/P99, done/failed.
    Cache(Box<load::CacheArgs>),
    /// Throughput and server memory with 1 … 10,000 registered adapters (uniform popularity).
    CacheScale(Box<load::CacheScaleArgs>),
    /// Endurance: `thaw serve` under 70% load over many adapters with faults (runtime
    /// loads/unloads, dropped streams, malformed requests, killed CPU workers); per-minute
    /// requests, RSS, fds, shared-memory segments, KV blocks and leases.
    Soak(soak::SoakArgs),
    /// `y = x·Wᵀ` per stored weight format (f32, f16, bf16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) on
    /// SmolLM2-135M's shapes, decode and prefill row counts, side by side; with `--model`, the
    /// whole engine per precision at batches 1/8/16 with mixed adapters (tok/s, vs batch 1).
    WeightFormats(quant_bench::WeightFormatsArgs),
    /// A CPU LoRA worker process (spawned by the benchmarks' pool).
    #[command(hide = true)]
    LoraWorker(thaw_cpu_lora::WorkerArgs),
    /// The socket-baseline worker of `lora-ipc`.
    #[command(hide = true)]
    LoraSocketWorker(lora_socket::SocketWorkerArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Engine(args) if args.model.is_some() => {
            let real = engine_real::RealArgs {
                model: args.model.clone().unwrap_or_default(),
                loras: args.loras.clone(),
                batches: args.batches.clone(),
                threads: args.threads.clone(),
                simd: args.simd.iter().map(|s| s.level()).collect(),
                prompt_len: args.prompt_len,
                decode_steps: args.decode_steps,
                reps: args.reps,
            };
            let rows = engine_real::run(&real)?;
            println!("{}", engine_real::table(&real, &rows));
        }
        Cmd::Engine(args) => {
            let rows = engine_bench::run(&args)?;
            println!("{}", engine_bench::table(&args, &rows));
        }
        Cmd::Gpu(args) => {
            let report = gpu::run(&args)?;
            print!("{}", gpu::table(&args, &report));
        }
        Cmd::LoraDecode(args) => {
            let ms = lora_decode::run(&args)?;
            println!("{}", lora_decode::table(&args, &ms));
        }
        Cmd::LoraIpc(args) => {
            let rows = lora_bench::run_ipc(&args)?;
            println!("{}", lora_bench::ipc_table(&args, &rows));
        }
        Cmd::LoraScaling(args) => {
            let report = lora_bench::run_scaling(&args)?;
            println!("{}", lora_bench::scaling_table(&args, &report));
        }
        Cmd::ColdStartEngine(args) => {
            let ex = coldstart_bench::run(&args)?;
            println!("{}", coldstart_bench::table(&ex));
        }
        Cmd::AdapterLoad(args) => print!("{}", adapter_load::run(&args)?),
        Cmd::UploadStall(args) => print!("{}", upload_stall::run(&args)?.1),
        Cmd::Load(args) => print!("{}", load::run_load(&args)?),
        Cmd::ColdStart(args) => print!("{}", load::run_cold_start(&args)?),
        Cmd::Simulate(args) => print!("{}", simulate::run(&args)?.1),
        Cmd::Scheduling(args) => print!("{}", load::run_scheduling(&args)?),
        Cmd::Cache(args) => print!("{}", load::run_cache(&args)?),
        Cmd::CacheScale(args) => print!("{}", load::run_cache_scale(&args)?),
        Cmd::Soak(args) => print!("{}", soak::run(&args)?),
        Cmd::WeightFormats(args) if !args.model.is_empty() => {
            let rows = quant_step::run(&args)?;
            print!("{}", quant_step::table(&args, &rows));
        }
        Cmd::WeightFormats(args) => print!("{}", quant_bench::run(&args)?),
        Cmd::LoraWorker(args) => thaw_cpu_lora::worker_main(args)?,
        Cmd::LoraSocketWorker(args) => lora_socket::run_worker(&args)?,
    }
    Ok(())
}
