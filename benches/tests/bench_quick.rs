//! Smoke runs of the HTTP benchmarks (`thaw-bench load --quick`, `thaw-bench cold-start
//! --quick`) against real `thaw serve` processes on loopback with a generated tiny model, so
//! they do not rot: the report has its structure and every request is accounted for.
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

fn thaw_bench() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_thaw-bench"))
}

/// `thaw` next to `thaw-bench` (cargo test --workspace builds it; build it here otherwise).
fn thaw() -> PathBuf {
    let bin = thaw_bench().with_file_name("thaw");
    if !bin.exists() {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "thaw-server", "--bin", "thaw"]);
        if bin.parent().is_some_and(|d| d.ends_with("release")) {
            cmd.arg("--release");
        }
        assert!(cmd.status().expect("cargo build").success());
    }
    bin
}

fn run_ok(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().expect("spawn");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{stdout}\n{}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A tiny model and six adapters (ranks 8…128) made by `thaw gen-model` / `gen-adapters`.
fn demo(dir: &Path) -> (PathBuf, PathBuf) {
    let (model, adapters) = (dir.join("model"), dir.join("adapters"));
    let p = |p: &Path| p.to_str().unwrap().to_string();
    run_ok(
        &thaw(),
        &["gen-model", "--preset", "tiny", "--out", &p(&model)],
    );
    run_ok(
        &thaw(),
        &[
            "gen-adapters",
            "--model",
            &p(&model),
            "--count",
            "6",
            "--out",
            &p(&adapters),
        ],
    );
    (model, adapters)
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.0.wait();
    }
}

/// Starts `thaw serve` on a free port and returns it with its base URL.
fn serve(model: &Path, adapters: &Path) -> (Serve, String) {
    let mut child = Command::new(thaw())
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .arg("--lora-dir")
        .arg(adapters)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn thaw serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let server = Serve(child);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "server exited early");
        if let Some(rest) = line.split("http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().to_string();
            std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
            return (server, format!("http://{addr}"));
        }
    }
}

/// Runs `thaw-bench SUB --quick --no-progress ARGS…` against the built `thaw` in a fresh
/// workdir; returns the printed table and the runs it wrote to `out/JSON`.
fn quick_run(sub: &str, args: &[&str], json: &str) -> (String, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let thaw_bin = thaw();
    let mut all = vec![sub, "--quick", "--no-progress"];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "--thaw-bin",
        thaw_bin.to_str().unwrap(),
        "--workdir",
        dir.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let table = run_ok(&thaw_bench(), &all);
    let runs: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join(json)).unwrap()).unwrap();
    (table, runs.as_array().unwrap().clone())
}

fn check_requests(run: &Value, sent: u64) {
    let s = &run["summary"];
    let (n, done, failed) = (
        s["sent"].as_u64().unwrap(),
        s["completed"].as_u64().unwrap(),
        s["failed"].as_u64().unwrap(),
    );
    assert_eq!(n, sent, "{s}");
    assert_eq!(
        n,
        done + failed,
        "every request is completed or failed: {s}"
    );
    assert_eq!(
        failed, 0,
        "loopback demo server fails nothing: {}",
        s["errors"]
    );
    let reqs = run["requests"].as_array().unwrap();
    assert_eq!(reqs.len() as u64, n);
    for r in reqs {
        assert!(r["error"].is_null(), "{r}");
        let (ttft, e2e) = (r["ttft_s"].as_f64().unwrap(), r["e2e_s"].as_f64().unwrap());
        assert!(ttft > 0.0 && ttft <= e2e, "{r}");
        assert_eq!(
            r["output_tokens"], r["max_tokens"],
            "ignore_eos forces the length: {r}"
        );
        assert_eq!(r["prompt_tokens"].as_u64(), Some(16), "{r}");
    }
    for key in ["ttft", "tpot", "e2e"] {
        for stat in ["mean", "p50", "p90", "p99", "max"] {
            assert!(s[key][stat].is_number(), "{key}.{stat} in {s}");
        }
    }
}

fn check_plots(dir: &Path, stem: &str) {
    let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("TTFT CDF"),
        "SVG has its text"
    );
}

#[test]
fn load_quick_accounts_for_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let (model, adapters) = demo(dir.path());
    let (_server, url) = serve(&model, &adapters);
    let out = dir.path().join("out");
    // The same server twice: the round-robin router's two "instances" (request i to URL i mod 2).
    let table = run_ok(
        &thaw_bench(),
        &[
            "load",
            "--quick",
            "--no-progress",
            "--url",
            &format!("{url},{url}"),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(table.contains("| run | sent | done | failed |"), "{table}");
    assert!(table.contains("| load | 12 | 12 | 0 |"), "{table}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("load.json")).unwrap()).unwrap();
    assert_eq!(report["bench"], "load");
    assert_eq!(report["server"]["adapters"].as_array().unwrap().len(), 6);
    assert!(report["prompts"]
        .as_str()
        .unwrap()
        .contains("tokenizer.json"));
    check_requests(&report, 12);
    // Rank power law: every request named one of the server's adapters.
    for (i, r) in report["requests"].as_array().unwrap().iter().enumerate() {
        assert!(r["model"].as_str().unwrap().starts_with("adapter-"), "{r}");
        assert_eq!(
            r["instance"].as_u64(),
            Some(i as u64 % 2),
            "round-robin: {r}"
        );
    }
    check_plots(&out, "load-cdf");
}

#[test]
fn cold_start_quick_compares_the_four_policies() {
    let help = run_ok(&thaw(), &["serve", "--help"]);
    if !help.contains("--cold-start") {
        eprintln!("skipped: this thaw serve has no --cold-start flag yet");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let table = run_ok(
        &thaw_bench(),
        &[
            "cold-start",
            "--quick",
            "--no-progress",
            "--thaw-bin",
            thaw().to_str().unwrap(),
            "--workdir",
            dir.path().to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    for p in ["cached", "on-demand", "cpu-assist", "auto"] {
        assert!(table.contains(&format!("| {p} |")), "{table}");
    }
    assert!(
        table.contains("(+") || table.contains("(-"),
        "overheads: {table}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("cold-start.json")).unwrap())
            .unwrap();
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4);
    for run in runs {
        check_requests(run, 12);
    }
    // The same plan for every policy: same adapters in the same order.
    let models = |r: &Value| -> Vec<Value> {
        r["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["model"].clone())
            .collect()
    };
    assert!(runs.iter().all(|r| models(r) == models(&runs[0])));
    check_plots(&out, "cold-start-cdf");
    assert!(out.join("serve-auto.log").exists());
}

/// The four policies on the same requests, against both baselines. The pool never refuses;
/// `no-cache` (S-LoRA's memory) keeps nothing on the device once the run is over, so every
/// load it made was dropped again, while `cost` still caches what it used.
#[test]
fn cache_quick_compares_the_eviction_policies() {
    let (table, runs) = quick_run(
        "cache",
        &[
            "--policies",
            "lru,cost,fixed-slots,no-cache",
            "--baseline",
            "fixed-slots,no-cache",
        ],
        "cache.json",
    );
    for p in ["lru", "cost", "fixed-slots", "no-cache"] {
        assert!(table.contains(&format!("| {p} |")), "{table}");
    }
    assert!(table.contains("| pooled P99 ms |"), "{table}");
    assert!(table.contains("| P99 vs fixed-slots |"), "{table}");
    assert!(
        table.contains("Against no-cache:") && table.contains("| paired P99 vs no-cache"),
        "{table}"
    );
    // Where the tail comes from, per policy: first uses against reuses, and by rank.
    assert!(
        table.contains("cost, TTFT over the rounds: first uses") && table.contains("r16 "),
        "{table}"
    );
    assert_eq!(runs.len(), 4);
    for r in &runs {
        let s = &r["summary"];
        assert_eq!(s["sent"], 12);
        // Every request's record is kept (the pooled P99 and the tail analysis read them).
        assert_eq!(r["records"].as_array().map(Vec::len), Some(12), "{r}");
        let completed = s["completed"].as_u64().unwrap();
        assert_eq!(completed + s["failed"].as_u64().unwrap(), 12);
        // A request fixed-slots refuses (429: every slot held by a running request, which
        // happens when requests overlap, as on a loaded machine) never reaches the adapter
        // cache; every admitted request looked its adapter up once.
        for rec in r["records"].as_array().unwrap() {
            if let Some(e) = rec["error"].as_str() {
                assert!(e.starts_with("HTTP 429"), "only 429 refusals fail: {rec}");
            }
        }
        let lookups = r["hits"].as_f64().unwrap() + r["misses"].as_f64().unwrap();
        assert_eq!(
            lookups, completed as f64,
            "every admitted request looked its adapter up once: {r}"
        );
    }
    // The pool never refuses, with or without a cache; only the fixed-slots baseline may.
    for i in [0, 1, 3] {
        assert_eq!(runs[i]["summary"]["failed"], 0, "{}", runs[i]);
    }
    let (cost, none) = (&runs[1], &runs[3]);
    assert_eq!(
        none["device_adapters_end"], 0.0,
        "no-cache kept adapters: {none}"
    );
    assert!(none["loads"].as_f64().unwrap() > 0.0, "{none}");
    assert_eq!(
        none["evictions"], none["loads"],
        "no-cache drops every adapter it loads once idle: {none}"
    );
    assert!(
        cost["device_adapters_end"].as_f64().unwrap() > 0.0,
        "cost caches idle adapters: {cost}"
    );
}

/// `--warmup-requests 6`: the same server serves 6 unmeasured requests before the measured 12,
/// its counters saw 6 lookups before the measured run, and the run's own counters and records
/// are the measured 12 only.
#[test]
fn cache_warmup_requests_run_on_the_measured_server_unmeasured() {
    let (table, runs) = quick_run(
        "cache",
        &["--policies", "cost", "--warmup-requests", "6"],
        "cache.json",
    );
    assert!(
        table.contains("6 unmeasured warm-up requests per run"),
        "{table}"
    );
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!(r["summary"]["sent"], 12, "{r}");
    assert_eq!(r["records"].as_array().map(Vec::len), Some(12), "{r}");
    assert_eq!(
        r["warmup_lookups"], 6.0,
        "the warm-up ran on the measured server: {r}"
    );
    let lookups = r["hits"].as_f64().unwrap() + r["misses"].as_f64().unwrap();
    assert_eq!(
        lookups, 12.0,
        "the run's counters are the measured requests': {r}"
    );
}

/// `--sustainable-token-rate`: each round offers that many tokens/s, and the table says so.
#[test]
fn cache_token_rate_sets_each_rounds_token_load() {
    let (table, runs) = quick_run(
        "cache",
        &["--policies", "cost", "--sustainable-token-rate", "900"],
        "cache.json",
    );
    assert!(
        table.contains("sustainable rate 900.00 tokens/s"),
        "{table}"
    );
    assert!(
        table.contains("offered per round (req/s, tokens/s): "),
        "{table}"
    );
    // Quick runs use Poisson arrivals, whose span is random: the exact scaling is the
    // workload's proptest; here every request ran at the token rate's request rate
    // (900 tokens/s ÷ 20 tokens per request = 45 req/s).
    assert!(table.contains("| 100% | cost | 900.00 |"), "{table}");
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["summary"]["completed"], 12, "{}", runs[0]);
}

/// `--probe-only --probe-repeats 3`: three bursts, each kept in cache.json, their throughputs
/// and spread in the header, the median as the rate, and no load runs.
#[test]
fn cache_probe_repeats_report_every_burst_and_their_median() {
    let (table, runs) = quick_run(
        "cache",
        &["--probe-only", "--probe-repeats", "3"],
        "cache.json",
    );
    assert_eq!(runs.len(), 3, "three probe bursts and nothing else");
    let mut rps: Vec<f64> = runs
        .iter()
        .map(|r| {
            assert!(r["label"].as_str().unwrap().contains("probe"), "{r}");
            r["summary"]["throughput_rps"].as_f64().unwrap()
        })
        .collect();
    for r in &rps {
        assert!(
            table.contains(&format!("{r:.1}")),
            "burst {r} not in: {table}"
        );
    }
    rps.sort_by(f64::total_cmp);
    assert!(
        table.contains(&format!(
            "sustainable rate {:.2} req/s (probe: median of 3 bursts",
            rps[1]
        )),
        "{table}"
    );
    assert!(
        !table.contains("| policy |"),
        "--probe-only runs no loads: {table}"
    );
}

#[test]
fn cache_scale_quick_reports_throughput_and_memory() {
    let (table, runs) = quick_run("cache-scale", &[], "cache-scale.json");
    assert!(table.contains("| 1 | 12/0 |"), "{table}");
    assert!(table.contains("| 20 | 12/0 |"), "{table}");
    for r in &runs {
        assert!(r["rss_end_kib"].as_u64().unwrap() > 0, "{r}");
    }
}

/// Runs `thaw-bench load --quick --no-progress ARGS… --url URL` against a fresh server and
/// returns the table and the sweep report.
fn load_sweep(args: &[&str]) -> (String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let (model, adapters) = demo(dir.path());
    let (_server, url) = serve(&model, &adapters);
    let out = dir.path().join("out");
    let mut all = vec!["load", "--quick", "--no-progress", "--url", &url];
    all.extend_from_slice(args);
    let out_s = out.to_str().unwrap().to_string();
    all.extend_from_slice(&["--out", &out_s]);
    let table = run_ok(&thaw_bench(), &all);
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("load-sweep.json")).unwrap())
            .unwrap();
    (table, report)
}

fn check_sweep_run(run: &Value, sent: u64) -> &Vec<Value> {
    let s = &run["summary"];
    assert_eq!(s["sent"].as_u64(), Some(sent), "{s}");
    assert_eq!(s["completed"].as_u64(), Some(sent), "{}", s["errors"]);
    assert_eq!(s["failed"].as_u64(), Some(0), "{}", s["errors"]);
    let reqs = run["records"].as_array().unwrap();
    assert_eq!(reqs.len() as u64, sent);
    for r in reqs {
        let (ttft, e2e) = (r["ttft_s"].as_f64().unwrap(), r["e2e_s"].as_f64().unwrap());
        assert!(ttft > 0.0 && ttft <= e2e, "{r}");
    }
    // The /metrics poller sampled the run (today's server has no prefix-cache counters:
    // those are absent, not zero).
    assert!(run["peaks"]["samples"].as_u64().unwrap() >= 1, "{run}");
    reqs
}

/// `--multi-turn`: 12 turns in conversations of 4 sent as chat messages; each turn's prompt
/// carries the system prompt and the earlier turns, so it is longer than the one before.
#[test]
fn load_quick_multi_turn_sends_growing_conversations() {
    let (table, report) = load_sweep(&["--multi-turn", "--popularity", "zipf"]);
    assert!(table.contains("multi-turn workload"), "{table}");
    assert!(table.contains("TTFT P50 / P99 by turn"), "{table}");
    assert!(table.contains("highest rate within the SLO"), "{table}");
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    let reqs = check_sweep_run(&runs[0], 12);
    for conv in reqs.chunks(4) {
        assert!(
            conv.iter().all(|r| r["model"] == conv[0]["model"]),
            "one adapter a conversation"
        );
        let prompts: Vec<u64> = conv
            .iter()
            .map(|r| r["prompt_tokens"].as_u64().unwrap())
            .collect();
        // A 64-token system prompt, then each turn adds an answer and a 16-token message
        // (the server's count of re-tokenized text can differ by a token or two).
        assert!(prompts[0] >= 64, "{prompts:?}");
        assert!(prompts.windows(2).all(|w| w[1] > w[0] + 16), "{prompts:?}");
        assert!(conv.iter().all(|r| r["output_tokens"] == 4), "{conv:?}");
    }
}

/// `--no-max-tokens --rates 10,20`: chat requests without max_tokens, each cut by the client
/// after its planned output; two rates, every request done, exactly its planned tokens.
#[test]
fn load_quick_no_max_tokens_sweeps_rates() {
    let (table, report) = load_sweep(&["--no-max-tokens", "--rates", "10,20"]);
    assert!(table.contains("no max_tokens sent"), "{table}");
    assert!(table.contains("| 10.00 | 12 | 12 | 0 |"), "{table}");
    assert!(table.contains("| 20.00 | 12 | 12 | 0 |"), "{table}");
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        for r in check_sweep_run(run, 12) {
            assert_eq!(
                r["output_tokens"], r["max_tokens"],
                "cut at the planned output: {r}"
            );
        }
    }
    assert!(report["ttft_slo_s"].as_f64().unwrap() > 0.0);
}
