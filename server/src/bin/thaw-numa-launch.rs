//! `thaw-numa-launch`: one `thaw serve` per GPU, each bound with numactl to its GPU's NUMA node
//! (cores and memory); see `thaw_server::deploy`. `--dry-run` prints the plan. With one
//! instance (e.g. `--gpus 1` from a systemd template) the launcher execs it, so the service
//! manager signals `thaw serve` directly; with several it starts them all, forwards
//! SIGTERM/SIGINT and stops the rest when one exits.
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use thaw_server::deploy::{self, parse_nvidia_smi_topo, PlanOptions};

#[derive(Debug, Parser)]
#[command(
    name = "thaw-numa-launch",
    about = "Start one `thaw serve` per GPU, bound to the GPU's NUMA node with numactl"
)]
struct Args {
    /// Print the topology and the command lines; start nothing.
    #[arg(long)]
    dry_run: bool,
    /// Root of the sysfs tree to read (tests use fixture trees).
    #[arg(long, default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Only these GPUs (CUDA indices in PCI bus order), e.g. --gpus 0,2 [default: all].
    #[arg(long, value_delimiter = ',')]
    gpus: Option<Vec<usize>>,
    /// The `thaw` executable [default: the one next to this launcher].
    #[arg(long)]
    thaw_bin: Option<PathBuf>,
    /// The numactl executable.
    #[arg(long, default_value = "numactl")]
    numactl: PathBuf,
    /// Address every instance listens on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Instance i listens on base-port + i.
    #[arg(long, default_value_t = 8000)]
    base_port: u16,
    /// At most this many CPU LoRA workers per instance [default: every core of its slice but
    /// the engine's].
    #[arg(long)]
    max_lora_workers: Option<usize>,
    /// Read `nvidia-smi topo -m` output from this file instead of running nvidia-smi.
    #[arg(long)]
    nvidia_smi_topo: Option<PathBuf>,
    /// Do not run nvidia-smi (it is skipped anyway with a --sysfs-root other than /sys).
    #[arg(long)]
    no_nvidia_smi: bool,
    /// Arguments for every `thaw serve`, after `--` (e.g. -- --model /models/llama --lora-dir /adapters).
    #[arg(last = true)]
    serve_args: Vec<String>,
}

fn smi_topo(args: &Args) -> anyhow::Result<String> {
    if let Some(f) = &args.nvidia_smi_topo {
        return std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()));
    }
    if args.no_nvidia_smi || args.sysfs_root != std::path::Path::new("/sys") {
        return Ok(String::new());
    }
    // Missing nvidia-smi is fine: sysfs alone usually knows.
    Ok(Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut topo = deploy::read_topology(&args.sysfs_root)?;
    topo.fill_unknown_nodes(&parse_nvidia_smi_topo(&smi_topo(&args)?));
    let thaw_bin = match &args.thaw_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("thaw"),
    };
    let instances = deploy::plan(
        &topo,
        &PlanOptions {
            thaw_bin,
            numactl: args.numactl.clone(),
            host: args.host.clone(),
            base_port: args.base_port,
            max_lora_workers: args.max_lora_workers,
            gpus: args.gpus.clone(),
            serve_args: args.serve_args.clone(),
        },
    )?;
    print!("{}", deploy::render_plan(&topo, &instances));
    if args.dry_run {
        return Ok(());
    }
    let numactl_ok = Command::new(&args.numactl)
        .arg("--show")
        .output()
        .is_ok_and(|o| o.status.success());
    anyhow::ensure!(
        numactl_ok,
        "`{} --show` failed: install numactl (apt-get install numactl) or pass --numactl PATH",
        args.numactl.display()
    );
    let command = |inst: &deploy::Instance| {
        let mut c = Command::new(&inst.argv[0]);
        c.args(&inst.argv[1..]).envs(inst.env.iter().cloned());
        c
    };
    if let [only] = instances.as_slice() {
        use std::os::unix::process::CommandExt;
        let e = command(only).exec();
        anyhow::bail!("exec {}: {e}", only.argv[0]);
    }
    let mut children: Vec<Child> = Vec::new();
    for inst in &instances {
        match command(inst).spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                terminate(&mut children);
                anyhow::bail!("starting instance for GPU {}: {e}", inst.gpu.index);
            }
        }
    }
    supervise(children)
}

/// Waits until a signal arrives or an instance exits, then stops the others.
fn supervise(mut children: Vec<Child>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let exited = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = term.recv() => return anyhow::Ok(None),
                _ = tokio::signal::ctrl_c() => return Ok(None),
                _ = tick.tick() => {
                    for (i, c) in children.iter_mut().enumerate() {
                        if let Some(status) = c.try_wait()? {
                            return Ok(Some((i, status)));
                        }
                    }
                }
            }
        }
    })?;
    terminate(&mut children);
    match exited {
        Some((i, status)) if !status.success() => {
            anyhow::bail!("instance {i} exited with {status}; stopped the others")
        }
        _ => Ok(()),
    }
}

/// SIGTERM to every child still running (they drain in-flight requests), then wait for them.
fn terminate(children: &mut [Child]) {
    for c in children.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            // std has no SIGTERM; kill(1) is on every system that has numactl.
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}
