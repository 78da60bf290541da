#!/usr/bin/env python3
"""Prefix caching side by side (issue 28): `thaw serve` (automatic prefix caching) vs llama.cpp's
`llama-server` (`cache_prompt`), each with caching on and off, on the real SmolLM2 fixture.

One run starts the four servers one after another (thaw on, llama.cpp on, thaw off, llama.cpp
off) and drives each with the same `thaw-bench load --multi-turn` command: conversations of
--turns turns with a --system-prompt-len-token system prompt, the earlier turns and answers
sent again with each new --prompt-len-token user message, --output-len-token answers
(`ignore_eos`), conversations starting as a Poisson process at --rate / turns, greedy, over
/v1/chat/completions with streaming. Prompts are text from SmolLM2's tokenizer, the same for
every server (same seed). Both serve the base model (llama-server's /v1/models lists no
adapters). The table has TTFT P50/P99 at the client, and the prompt tokens each server reports
as cached (`usage.prompt_tokens_details.cached_tokens`, which both fill) over all prompt
tokens: the hit rate.

Usage:
  python3 benches/peers/prefix_cache_side_by_side.py --thaw target/debug/thaw \
      --thaw-bench target/debug/thaw-bench \
      --llama-server /work/peers/llama-build/bin/llama-server --peers /work/peers/smollm2
Only the Python standard library is needed.
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import server_args, wait_up  # noqa: E402


def start(cmd, health, what, log):
    f = open(log, "w")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    wait_up(health, p, what)
    return p


def main():
    p = server_args(__doc__, 1)
    p.add_argument("--thaw-bench", required=True)
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    p.add_argument("--ctx", type=int, default=2048, help="context of both servers, tokens")
    p.add_argument("--requests", type=int, default=16, help="turns in all, per server")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=500)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s (turns)")
    p.add_argument("--port", type=int, default=28620)
    p.add_argument("--out", default="/tmp/prefix-side-by-side")
    a = p.parse_args()
    hf = f"{a.peers}/hf-{a.precision}"
    gguf = f"{a.peers}/gguf/model-{a.precision}.gguf"
    tok = f"{a.peers}/hf-f32/tokenizer.json"
    os.makedirs(a.out, exist_ok=True)
    systems = [
        ("thaw serve", "on", [a.thaw, "serve", "--model", hf, "--max-model-len", str(a.ctx),
                              "--max-num-seqs", "16"] + a.thaw_args.split()),
        ("llama.cpp", "on", [a.llama_server, "-m", gguf, "-t", str(a.threads), "-tb",
                             str(a.threads), "-np", "4", "-c", str(4 * a.ctx), "--no-warmup",
                             "--cache-prompt"]),
        ("thaw serve", "off", [a.thaw, "serve", "--model", hf, "--max-model-len", str(a.ctx),
                               "--max-num-seqs", "16", "--no-enable-prefix-caching"]
         + a.thaw_args.split()),
        ("llama.cpp", "off", [a.llama_server, "-m", gguf, "-t", str(a.threads), "-tb",
                              str(a.threads), "-np", "4", "-c", str(4 * a.ctx), "--no-warmup",
                              "--no-cache-prompt"]),
    ]
    rows = []
    for i, (name, mode, cmd) in enumerate(systems):
        port = a.port + i
        cmd = cmd + ["--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        proc = start(cmd, url + "/health", name, f"{a.out}/server-{i}.log")
        out = f"{a.out}/run-{i}"
        bench = [a.thaw_bench, "load", "--url", url, "--multi-turn", "--popularity", "base", "--turns", str(a.turns),
                 "--system-prompt-len", str(a.system_prompt_len), "--prompt-len",
                 str(a.prompt_len), "--output-len", str(a.output_len), "--requests",
                 str(a.requests), "--rates", str(a.rate), "--tokenizer", tok, "--max-model-len",
                 str(a.ctx), "--request-timeout", "300", "--no-progress", "--out", out]
        load = os.getloadavg()[0]
        t0 = time.time()
        r = subprocess.run(bench, capture_output=True, text=True)
        print(f"# {name}, caching {mode}: {' '.join(cmd)}\n# load average {load:.1f} at the "
              f"start, {time.time() - t0:.0f} s", flush=True)
        if r.returncode != 0:
            print(r.stdout + r.stderr)
        proc.terminate()
        proc.wait()
        if r.returncode != 0:
            sys.exit(f"thaw-bench failed against {name}")
        rep = json.load(open(f"{out}/load-sweep.json"))
        run = rep["runs"][0]
        s = run["summary"]
        hit = run.get("usage_hit_rate")
        rows.append((name, mode, s["ttft"]["p50"] * 1e3, s["ttft"]["p99"] * 1e3,
                     s["tpot"]["p50"] * 1e3, hit, s["completed"], s["failed"], load))
        if i == 0:
            print("# thaw-bench: " + " ".join(bench))
    print(f"\n{a.requests} turns per server ({a.turns}-turn conversations, {a.system_prompt_len}"
          f"-token system prompt, {a.prompt_len}-token user messages, {a.output_len}-token "
          f"answers) at {a.rate} req/s, SmolLM2-135M {a.precision}, base model; llama.cpp "
          f"{a.threads} threads")
    print("| server | caching | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | hit rate (usage) "
          "| done/failed | load avg at start |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m, p50, p99, tpot, hit, done, failed, load in rows:
        h = "-" if hit is None else f"{hit * 100:.1f}%"
        print(f"| {n} | {m} | {p50:.0f} | {p99:.0f} | {tpot:.1f} | {h} | {done}/{failed} "
              f"| {load:.1f} |")
    by = {(r[0], r[1]): r for r in rows}
    for n in ("thaw serve", "llama.cpp"):
        on, off = by[(n, "on")], by[(n, "off")]
        print(f"{n}: TTFT P50 on / off = {on[2] / off[2]:.2f}x, P99 {on[3] / off[3]:.2f}x")
    t, l = by[("thaw serve", "on")], by[("llama.cpp", "on")]
    print(f"caching on, thaw / llama.cpp: TTFT P50 {t[2] / l[2]:.2f}x, P99 {t[3] / l[3]:.2f}x")


if __name__ == "__main__":
    main()
