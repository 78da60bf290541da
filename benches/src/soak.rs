//! `thaw-bench soak`: endurance under load with faults (issue 13). Starts `thaw serve` on a
//! generated tiny model with N adapters, measures its sustainable rate, then for --minutes
//! sends Zipf-popular Poisson traffic at 70% of it while: an adapter is loaded and unloaded at
//! run time every few seconds, 5% of streams are dropped after their first chunk, a malformed
//! request goes out every second, and a CPU LoRA worker is SIGKILLed every 2 minutes. Prints,
//! per minute, good requests completed and failed, and the server's RSS, open fds, /dev/shm
//! entries, memfd segments, KV blocks, leases, live CPU workers and host-tier adapters; then
//! the same at idle after the load stops, against the values before it, and a PASS/FAIL line
//! (`soak_verdict`). The baseline is taken after a warm-up at the soak's own traffic, which
//! fills the bounded adapter caches (host tier, device slots) and the allocator's arenas, so a
//! full cache is not counted as growth. A table, never a test assertion.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Zipf};
use serde_json::json;
use thaw_server::procfs;

use crate::soak_verdict::{kills_due, verdict, Snapshot};

/// Options of `thaw-bench soak`.
#[derive(clap::Args, Clone, Debug)]
pub struct SoakArgs {
    /// Minutes of load.
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
    /// Adapters generated and served (Zipf popularity, exponent 1).
    #[arg(long, default_value_t = 1000)]
    pub adapters: usize,
    /// Requests per second [default: 70% of the rate measured at start].
    #[arg(long)]
    pub rate: Option<f64>,
    /// Tokens per request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// CPU LoRA workers of the server (the chaos thread SIGKILLs one at 60 s, then every 120 s).
    #[arg(long, default_value_t = 2)]
    pub lora_workers: usize,
    /// Seconds of the same traffic (no faults) before the baseline is taken.
    #[arg(long, default_value_t = 60.0)]
    pub warmup_secs: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Counters of one minute.
#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    failed: AtomicU64,
    refused: AtomicU64,
    dropped: AtomicU64,
    malformed_ok: AtomicU64,
}

impl Counts {
    fn take(&self) -> [u64; 5] {
        [
            &self.ok,
            &self.failed,
            &self.refused,
            &self.dropped,
            &self.malformed_ok,
        ]
        .map(|c| c.swap(0, Ordering::Relaxed))
    }
}

/// One HTTP/1.1 request (Connection: close); (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, out))
}

/// A streamed request read only up to its first chunk, then dropped.
fn drop_stream(addr: SocketAddr, body: &str) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while r.read_line(&mut line)? > 0 && !line.contains("data:") {
        line.clear();
    }
    Ok(())
}

fn metric(text: &str, name: &str) -> f64 {
    crate::load::metrics::metric_sum(text, name).unwrap_or(f64::NAN)
}

const MIB: f64 = 1024.0 * 1024.0;

fn kib_as_mib(kib: Option<u64>) -> f64 {
    kib.map_or(f64::NAN, |k| k as f64 / 1024.0)
}

/// The server's resources, in `soak_verdict::COLUMNS` order.
fn snapshot(addr: SocketAddr, pid: u32) -> Snapshot {
    let (fds, memfds) = procfs::fds(pid);
    let shm = std::fs::read_dir("/dev/shm").map_or(0, |d| d.count());
    let m = http(addr, "GET", "/metrics", "")
        .map(|(_, t)| t)
        .unwrap_or_default();
    [
        procfs::rss_mib(pid),
        fds as f64,
        shm as f64,
        memfds as f64,
        metric(&m, "thaw_kv_cache_used_blocks"),
        metric(&m, "thaw_adapter_leases"),
        procfs::live_children(pid).len() as f64,
        metric(&m, "thaw_adapters{tier=\"host\"}"),
        metric(&m, "thaw_heap_allocated_bytes") / MIB,
        metric(&m, "thaw_heap_held_bytes") / MIB,
        kib_as_mib(procfs::status_kib(pid, "RssAnon:")),
        kib_as_mib(procfs::status_kib(pid, "RssFile:")),
        kib_as_mib(procfs::status_kib(pid, "RssShmem:")),
    ]
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

fn start_server(args: &SoakArgs, root: &Path) -> anyhow::Result<(Serve, SocketAddr)> {
    let bin = crate::load::default_thaw_bin()?;
    anyhow::ensure!(
        bin.exists(),
        "{} not found; build it with `cargo build -p thaw-server --bin thaw`",
        bin.display()
    );
    let run = |a: &[&str]| -> anyhow::Result<()> {
        let st = Command::new(&bin).args(a).stdout(Stdio::null()).status()?;
        anyhow::ensure!(st.success(), "thaw {a:?} failed");
        Ok(())
    };
    let model = root.join("model");
    let adapters = root.join("adapters");
    let (m, a) = (model.to_str().unwrap(), adapters.to_str().unwrap());
    run(&["gen-model", "--preset", "tiny", "--out", m])?;
    let count = args.adapters.to_string();
    run(&[
        "gen-adapters",
        "--model",
        m,
        "--count",
        &count,
        "--ranks",
        "8,16",
        "--out",
        a,
    ])?;
    let mut child = Command::new(&bin)
        .args(["serve", "--model", m, "--lora-dir", a, "--port", "0"])
        .args([
            "--served-model-name",
            "base",
            "--allow-runtime-lora-updating",
        ])
        .args(["--lora-root", root.to_str().unwrap()])
        .args(["--lora-workers", &args.lora_workers.to_string()])
        .args(["--cold-start", "cpu-assist"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(root.join("serve.log"))?)
        .spawn()?;
    let stdout = child.stdout.take().context("server stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("http://").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let serve = Serve(child);
    let addr: SocketAddr = rx
        .recv_timeout(Duration::from_secs(600))
        .context("thaw serve did not start; see serve.log")?
        .parse()?;
    Ok((serve, addr))
}

fn body(model: &str, stream: bool, n: usize) -> String {
    json!({"model": model, "prompt": "the quick brown fox", "max_tokens": n,
           "ignore_eos": true, "stream": stream})
    .to_string()
}

/// Where and what the traffic goes to.
struct Traffic<'a> {
    addr: SocketAddr,
    names: &'a [String],
    rate: f64,
    max_tokens: usize,
}

/// Zipf/Poisson traffic for `secs`, 5% of it streams dropped after the first chunk; calls
/// `minute(k)` as each whole minute passes. Returns once every request has finished.
fn drive(
    t: &Traffic<'_>,
    secs: f64,
    counts: &Arc<Counts>,
    rng: &mut rand_chacha::ChaCha8Rng,
    mut minute: impl FnMut(u64),
) -> anyhow::Result<()> {
    let (addr, names, rate) = (t.addr, t.names, t.rate);
    let zipf = Zipf::new(names.len().max(1) as f64, 1.0)?;
    let gap = Exp::new(rate)?;
    let start = Instant::now();
    let total = Duration::from_secs_f64(secs);
    let mut next = start;
    let mut minutes = 1;
    let mut handles = Vec::new();
    while start.elapsed() < total {
        next += Duration::from_secs_f64(gap.sample(rng));
        if let Some(d) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let name = names[(zipf.sample(rng) as usize).saturating_sub(1)].clone();
        let drop_it = rng.random_bool(0.05);
        let c = counts.clone();
        let b = body(&name, drop_it, t.max_tokens);
        handles.push(std::thread::spawn(move || {
            if drop_it {
                let _ = drop_stream(addr, &b);
                c.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            match http(addr, "POST", "/v1/completions", &b) {
                Ok((200, _)) => c.ok.fetch_add(1, Ordering::Relaxed),
                Ok((429, _)) => c.refused.fetch_add(1, Ordering::Relaxed),
                _ => c.failed.fetch_add(1, Ordering::Relaxed),
            };
        }));
        handles.retain(|h| !h.is_finished());
        if start.elapsed() >= Duration::from_secs(60 * minutes) {
            minute(minutes);
            minutes += 1;
        }
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

/// Polls until KV blocks, leases and live workers are back at `before` (or 60 s pass).
fn settle(addr: SocketAddr, pid: u32, before: &Snapshot) -> Snapshot {
    let deadline = Instant::now() + Duration::from_secs(60);
    // The server trims its heap after two idle seconds; give it those first.
    std::thread::sleep(Duration::from_secs(4));
    let mut now = snapshot(addr, pid);
    while (now[4] != before[4] || now[5] != before[5] || now[6] != before[6])
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(500));
        now = snapshot(addr, pid);
    }
    now
}

/// Runs the soak and returns the table.
pub fn run(args: &SoakArgs) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let (serve, addr) = start_server(args, dir.path())?;
    let pid = serve.0.id();
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("adapters"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names.truncate(args.adapters);
    let names = Arc::new(names);
    // Sustainable rate: 8 closed-loop clients for 10 s over the same Zipf-popular adapters
    // as the soak (the base model alone runs faster than adapter traffic).
    let t = Instant::now();
    let done = AtomicU64::new(0);
    let zipf = Zipf::new(names.len().max(1) as f64, 1.0)?;
    std::thread::scope(|s| {
        for i in 0..8u64 {
            let (done, names, zipf) = (&done, &names, &zipf);
            s.spawn(move || {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed ^ ((i + 1) << 32));
                while t.elapsed() < Duration::from_secs(10) {
                    let name = &names[(zipf.sample(&mut rng) as usize).saturating_sub(1)];
                    let b = body(name, false, args.max_tokens);
                    if matches!(http(addr, "POST", "/v1/completions", &b), Ok((200, _))) {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let sustainable = done.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64();
    let rate = args.rate.unwrap_or(0.7 * sustainable).max(0.1);
    let counts = Arc::new(Counts::default());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let at_start = snapshot(addr, pid);
    let traffic = Traffic {
        addr,
        names: &names,
        rate,
        max_tokens: args.max_tokens,
    };
    drive(&traffic, args.warmup_secs, &counts, &mut rng, |_| {})?;
    let warm = counts.take();
    let before = settle(addr, pid, &at_start);

    let stop = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(std::sync::Mutex::new(Vec::<(u64, i32)>::new()));
    let chaos = {
        let (stop, counts, names, kills) =
            (stop.clone(), counts.clone(), names.clone(), kills.clone());
        let adapters = dir.path().join("adapters");
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut tick = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                tick += 1;
                if let Ok((400, _)) = http(addr, "POST", "/v1/completions", "{\"model\": [1, 2") {
                    counts.malformed_ok.fetch_add(1, Ordering::Relaxed);
                }
                if tick.is_multiple_of(4) {
                    let src = adapters.join(&names[(tick as usize / 4) % names.len()]);
                    let b = json!({"lora_name": "soak-extra", "lora_path": src}).to_string();
                    let _ = http(addr, "POST", "/v1/load_lora_adapter", &b);
                } else if tick % 4 == 2 {
                    let b = json!({"lora_name": "soak-extra"}).to_string();
                    let _ = http(addr, "POST", "/v1/unload_lora_adapter", &b);
                }
                let secs = start.elapsed().as_secs();
                if kills_due(secs) > kills.lock().unwrap().len() as u64 {
                    let w = procfs::live_children(pid).first().copied().unwrap_or(0);
                    if w > 0 {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(w),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                    eprintln!("soak: {secs} s: SIGKILL CPU worker pid {w}");
                    kills.lock().unwrap().push((secs, w));
                }
            }
        })
    };
    let mut out = format!(
        "soak: {} adapters, sustainable ≈ {sustainable:.1} req/s, sending {rate:.1} req/s of {} tokens (Zipf, Poisson) for {} min after a {:.0} s warm-up ({} ok, {} failed, {} 429); CPU backend, tiny model, {} CPU workers\n\n\
         | minute | good ok | good failed | 429 | streams dropped | malformed→400 | RSS MiB | fds | /dev/shm | memfds | KV blocks | leases | workers | host adapters | heap live MiB | heap held MiB | RSS anon | RSS file | RSS shmem |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        names.len(), args.max_tokens, args.minutes, args.warmup_secs, warm[0], warm[1], warm[2],
        args.lora_workers
    );
    let row = |label: &str, c: [u64; 5], s: Snapshot| {
        format!(
            "| {label} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            c[0], c[1], c[2], c[3], c[4], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9],
            s[10], s[11], s[12]
        )
    };
    out.push_str(&row("start", [0; 5], at_start));
    out.push_str(&row("before (warm)", [0; 5], before));
    let mut lost = warm[1];
    drive(&traffic, args.minutes * 60.0, &counts, &mut rng, |m| {
        let c = counts.take();
        lost += c[1];
        out.push_str(&row(&m.to_string(), c, snapshot(addr, pid)));
        eprint!("{}", out.lines().last().unwrap_or_default());
        eprintln!();
    })?;
    stop.store(true, Ordering::Relaxed);
    let _ = chaos.join();
    let c = counts.take();
    lost += c[1];
    out.push_str(&row("end", c, snapshot(addr, pid)));
    let after = settle(addr, pid, &before);
    out.push_str(&row("idle after", [0; 5], after));
    let kills = kills.lock().unwrap().clone();
    out.push_str(&format!(
        "\nworker SIGKILLs (load second, pid): {kills:?}; live workers at idle: {} of {} (pids {:?})\n",
        after[6], before[6], procfs::live_children(pid)
    ));
    out.push_str(&verdict(lost, &before, &after, kills.len()));
    out.push('\n');
    drop(serve);
    Ok(out)
}
