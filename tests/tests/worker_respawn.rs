//! A CPU LoRA worker killed while the server is idle is replaced without any traffic (issue
//! 13): the engine loop supervises the pool on a timer, so the server's capacity does not
//! silently shrink until the next LoRA request happens to need a worker. Then the server
//! still answers an adapter request, through the replacement.
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::procfs;
use thaw_tests::http::{request, spawn_serve, ServeChild};
use thaw_tests::test_preset;

/// How long a replacement may take: the loop checks every 250 ms and a worker starts in well
/// under a second; the rest is slack for a loaded CI machine.
const REPLACED_WITHIN: Duration = Duration::from_secs(10);

fn start(dir: &std::path::Path) -> (ServeChild, SocketAddr) {
    let model = dir.join("model");
    gen::write_model(&test_preset(), &model, &GenModelOptions::default()).expect("gen-model");
    gen::write_adapters(&GenAdaptersOptions {
        model_dir: model.clone(),
        out_dir: dir.join("adapters"),
        count: 4,
        ranks: vec![8],
        targets: vec![Projection::Q, Projection::V],
        seed: 7,
        ..Default::default()
    })
    .expect("gen-adapters");
    spawn_serve(
        &model,
        &dir.join("adapters"),
        &["--lora-workers", "1", "--cold-start", "cpu-assist"],
    )
}

/// Polls until `pid` has exactly one live child other than `old`; its pid, or what was seen.
fn wait_for_worker(pid: u32, old: Option<i32>, within: Duration) -> Result<i32, Vec<i32>> {
    let deadline = Instant::now() + within;
    loop {
        let live = procfs::live_children(pid);
        if let [w] = live[..] {
            if Some(w) != old {
                return Ok(w);
            }
        }
        if Instant::now() > deadline {
            return Err(live);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn worker_killed_while_idle_is_replaced_without_traffic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (serve, addr) = start(dir.path());
    let pid = serve.0.id();
    let mut worker = wait_for_worker(pid, None, Duration::from_secs(30))
        .unwrap_or_else(|live| panic!("no CPU LoRA worker after start-up: {live:?}"));

    // Twice: the supervision keeps working after a respawn. No request is sent meanwhile.
    for round in 0..2 {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(worker),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("SIGKILL the worker");
        let killed = Instant::now();
        let replacement =
            wait_for_worker(pid, Some(worker), REPLACED_WITHIN).unwrap_or_else(|live| {
                panic!(
                "round {round}: worker {worker} was SIGKILLed while idle and not replaced within \
                 {REPLACED_WITHIN:?} (live children: {live:?})"
            )
            });
        eprintln!(
            "round {round}: worker {worker} → {replacement} after {:.0} ms idle",
            killed.elapsed().as_secs_f64() * 1e3
        );
        worker = replacement;
    }

    // The server still serves an adapter request, and the replacement is still alive.
    let body = json!({"model": "adapter-000-r8", "prompt": "the quick brown fox",
                      "max_tokens": 4, "ignore_eos": true});
    let r = request(addr, "POST", "/v1/completions", Some(&body.to_string()));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(procfs::live_children(pid), vec![worker]);
}
