//! Round-trip latency between the engine and one worker *process* through the exchange:
//! post a step, the worker wakes, reports it complete, the engine sees the result word.
//!
//! `cargo run --release -p thaw-ipc --example pingpong [round_trips]`
//!
//! Modes: `spin` (doorbell armed, both sides spin), `futex` (unarmed, both sides park in the
//! futex at once: spins = 1), `spin-then-futex` (the default strategy, unarmed). Prints
//! percentiles; asserts nothing.

use std::process::Command;
use std::time::{Duration, Instant};

use thaw_ipc::*;

const FD_VAR: &str = "THAW_PINGPONG_FD";

fn strategy(mode: &str) -> WaitStrategy {
    match mode {
        "spin" => WaitStrategy::Spin { yield_every: 0 },
        "futex" => WaitStrategy::SpinThenFutex {
            spins: 1,
            sleep_cap: Duration::from_secs(1),
        },
        _ => WaitStrategy::spin_then_futex(),
    }
}

/// Pins the calling process to `cpu` if it may run there (best effort), so the two sides
/// do not share a core.
fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

fn child(mode: &str) -> Result<()> {
    pin(1);
    let seg = Segment::from_inherited_env(FD_VAR, SegmentKind::Exchange)?;
    let mut port = WorkerPort::attach(Exchange::open(seg)?, WorkerId(0))?;
    let s = strategy(mode);
    loop {
        match port.wait_step(s, Some(Instant::now() + Duration::from_secs(10))) {
            WaitOutcome::Step(_) => port.complete(),
            WaitOutcome::Shutdown | WaitOutcome::TimedOut => return Ok(()),
        }
    }
}

fn run(mode: &str, n: usize) -> Result<()> {
    let cfg = ExchangeConfig {
        max_workers: 1,
        max_jobs: 1,
        max_inputs: 1,
        max_rows: 1,
        max_d_in: 1,
        max_d_out: 1,
    };
    let mut ex = Exchange::create(cfg)?;
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(["--child", mode]);
    ex.segment().inherit_into(&mut cmd, FD_VAR);
    let mut kid = cmd.spawn().expect("spawn worker process");
    pin(0);
    let s = strategy(mode);
    let mut times = Vec::with_capacity(n);
    let measured = measure(&mut ex, s, mode == "spin", n, &mut times);
    ex.shutdown();
    kid.wait().expect("wait worker");
    measured?;
    times.sort();
    let pct = |p: f64| {
        times[((times.len() as f64 * p) as usize).min(times.len() - 1)].as_secs_f64() * 1e6
    };
    let mean = times.iter().sum::<Duration>().as_secs_f64() * 1e6 / times.len() as f64;
    println!(
        "{mode:>16}: {n} round trips  p50 {:7.2} µs  p90 {:7.2} µs  p99 {:7.2} µs  mean {mean:7.2} µs",
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
    Ok(())
}

fn measure(
    ex: &mut Exchange,
    s: WaitStrategy,
    armed: bool,
    n: usize,
    times: &mut Vec<Duration>,
) -> Result<()> {
    if armed {
        ex.arm();
    }
    ex.set_jobs(&[])?;
    let mut seq = StepSeq(0);
    for i in 0..n + n / 10 {
        seq = seq.next();
        let t = Instant::now();
        ex.post_step(seq)?;
        ex.wait_results(seq, WorkerMask::first(1), s, t + Duration::from_secs(5))
            .unwrap_or_else(|late| panic!("worker {late:?} missed step {seq:?}"));
        if i >= n / 10 {
            times.push(t.elapsed()); // the first 10% warm up
        }
    }
    ex.disarm();
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        return child(&args[2]);
    }
    let n = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    println!(
        "engine <-> worker process round trip through the exchange ({} CPUs; engine pinned to \
         CPU 0, worker to CPU 1)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for mode in ["spin", "futex", "spin-then-futex"] {
        run(mode, n)?;
    }
    Ok(())
}
