#!/usr/bin/env python3
"""Side-by-side CPU serving benchmark: `thaw serve` vs llama.cpp's `llama-server`.

Same real model (SmolLM2-135M-Instruct, the same precision on both: f32, bf16, Q8_0 or
Q4_K with --precisions), same three LoRA adapters (PEFT for thaw,
GGUF LoRA for llama.cpp, picked per request through llama-server's `lora` field), 32 greedy
output tokens with EOS ignored, over HTTP. Workloads (issue 15):
  single   1 request, 64-token prompt (SINGLE_SEQ of them one after another per round: one
           request is 32 tokens, under a second, too short to time alone)
  mixed8   8 concurrent requests, 64-token prompts, 3 adapters mixed
  mixed16  16 concurrent requests, 128-token prompts, 3 adapters mixed
Both servers stay up; the systems alternate within every round (the order flips each round),
rounds repeat, and the table reports median tok/s (completion tokens / wall time of the
workload) and the thaw/llama.cpp ratio. Prompts are seeded token ids, different in every
round and request, so neither server reuses a cached prefix.

Build the fixtures first (benches/peers/smollm2_hf.py) and llama-server (benches/peers/README.md).
Usage:
  python3 benches/peers/side_by_side.py --thaw target/release/thaw \
      --llama-server /work/peers/llama-build/bin/llama-server --peers /work/peers/smollm2 \
      --rounds 5 [--threads 2] [--precisions f32,bf16,q8_0,q4_k] [--q4]
Only the Python standard library is needed.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ADAPTERS = ["r8-qv", "r16-qkvo", "r64-qv"]
WORKLOADS = [("single", 1, 64), ("mixed8", 8, 64), ("mixed16", 16, 128)]
# Requests the single workload sends one after another in a round (each its own prompt).
SINGLE_SEQ = 4
OUT_TOKENS = 32


def post(url, body, timeout=600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_up(url, proc, what, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit(f"{what} did not come up in {timeout}s")


class Thaw:
    name = "thaw serve"

    def __init__(self, a, model_dir, port):
        self.url = f"http://127.0.0.1:{port}"
        mods = [f"{n}={a.peers}/adapters/{n}" for n in ADAPTERS]
        cmd = [a.thaw, "serve", "--model", model_dir, "--port", str(port), "--max-num-seqs", "16",
               "--max-model-len", "512", "--lora-modules", *mods] + a.thaw_args.split()
        self.log = open(f"{a.logdir}/thaw-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_up(self.url + "/health", self.proc, "thaw serve")
        self.cmd = " ".join(cmd)

    def complete(self, prompt, adapter):
        if adapter is None:  # the base model, by the name /v1/models lists first
            adapter = self.base = getattr(self, "base", None) or s_model(self)
        r = post(self.url + "/v1/completions", {
            "model": adapter, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0,
            "ignore_eos": True})
        return r["usage"]["completion_tokens"], r["choices"][0]["text"]


class Llama:
    name = "llama.cpp"

    def __init__(self, a, gguf, port, loras=True):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [a.llama_server, "-m", gguf, "--port", str(port), "-t", str(a.threads), "-tb",
               str(a.threads), "-np", "16", "-c", str(16 * 256), "--no-warmup"]
        if loras:
            for n in ADAPTERS:
                cmd += ["--lora", f"{a.peers}/gguf/lora-{n}.gguf"]
            cmd += ["--lora-init-without-apply"]
        self.loras = loras
        self.log = open(f"{a.logdir}/llama-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_up(self.url + "/health", self.proc, "llama-server")
        self.cmd = " ".join(cmd)

    def complete(self, prompt, adapter):
        body = {"prompt": prompt, "n_predict": OUT_TOKENS, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False}
        if self.loras:
            body["lora"] = [{"id": i, "scale": 1.0 if n == adapter else 0.0} for i, n in enumerate(ADAPTERS)]
        r = post(self.url + "/completion", body)
        return r["tokens_predicted"], r["content"]


def run_workload(sys_, n, plen, seed, with_adapters=True, seq=1):
    """Runs `n` concurrent requests, `seq` times one after another (each time new prompts);
    returns (tok/s, tokens, done, failed) over all of them. A request is done when it returned
    all OUT_TOKENS tokens; an error or a short answer counts as failed (and its first error is
    printed), so a row whose requests failed shows it instead of a rate."""
    if seq > 1:
        runs = [run_workload(sys_, n, plen, seed + 7919 * k, with_adapters) for k in range(seq)]
        # tok/s over the whole: tokens / Σ wall time (each run's wall time is tokens / rate).
        wall = sum(r[1] / r[0] for r in runs if r[0] > 0)
        toks = sum(r[1] for r in runs)
        return (toks / wall if wall > 0 else 0.0, toks, sum(r[2] for r in runs),
                sum(r[3] for r in runs))
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(plen)] for _ in range(n)]
    adapters = [ADAPTERS[i % 3] if with_adapters else None for i in range(n)]
    if n == 1 and with_adapters:
        adapters = [ADAPTERS[1]]
    toks = [0] * n
    errs = []

    def one(i):
        try:
            toks[i] = sys_.complete(prompts[i], adapters[i])[0]
        except Exception as e:  # counted as failed, reported below
            errs.append(repr(e))

    t0 = time.perf_counter()
    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    dt = time.perf_counter() - t0
    done = sum(1 for t in toks if t == OUT_TOKENS)
    failed = n - done
    if failed:
        why = errs[0] if errs else f"short answers: {sorted(set(toks))} tokens"
        print(f"# {sys_.name}: {failed} of {n} requests failed: {why}", flush=True)
    return sum(toks) / dt, sum(toks), done, failed


def server_args(doc, rounds):
    """The arguments every side-by-side script takes: both servers, the peers' files, rounds."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--thaw", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--peers", default="/work/peers/smollm2")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--thaw-args", default="", help="extra `thaw serve` flags")
    p.add_argument("--logdir", default="/tmp")
    return p


# Per precision: (thaw's model, llama.cpp's GGUF), relative to --peers. The GGUFs other than
# f32 and q4_1 come from llama-quantize (benches/peers/README.md).
PRECISIONS = {
    "f32": ("hf-f32", "gguf/model-f32.gguf"),
    "bf16": ("hf-bf16", "gguf/model-bf16.gguf"),
    "q8_0": ("gguf/model-q8_0.gguf", "gguf/model-q8_0.gguf"),
    "q4_k": ("gguf/model-q4_k.gguf", "gguf/model-q4_k.gguf"),
}


def start_pair(a, prec, port):
    thaw_model, gguf = PRECISIONS[prec]
    systems = [Thaw(a, f"{a.peers}/{thaw_model}", port), Llama(a, f"{a.peers}/{gguf}", port + 1)]
    for s in systems:
        print(f"# {prec}: {s.name}: {s.cmd}", flush=True)
    # Warm-up (adapters loaded, pages touched) and a look at the text.
    for s in systems:
        for ad in ADAPTERS:
            s.complete([100, 200, 300, 400], ad)
    msg = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    for s in systems:
        if isinstance(s, Thaw):
            r = post(s.url + "/v1/completions", {"model": s_model(s), "prompt": msg, "max_tokens": 24, "temperature": 0})
            print(f"# {prec}: {s.name} greedy (base): {r['choices'][0]['text']!r}")
        else:
            r = post(s.url + "/completion", {"prompt": msg, "n_predict": 24, "temperature": 0, "top_k": 1,
                                             "lora": [{"id": i, "scale": 0.0} for i in range(3)]})
            print(f"# {prec}: {s.name} greedy (base): {r['content']!r}")
    return systems


def main():
    p = server_args(__doc__, 5)
    p.add_argument("--workloads", default="single,mixed8,mixed16")
    p.add_argument("--precisions", default="f32",
                   help="comma list of " + ",".join(PRECISIONS) + " (one server pair at a time)")
    p.add_argument("--q4", action="store_true", help="also Q4_1 single stream (thaw serving the GGUF)")
    p.add_argument("--machine", default="2-core VM, shared",
                   help="printed above the table (e.g. '2-core VM, quiet' under /work/bin/quiet)")
    a = p.parse_args()
    wl = [w for w in WORKLOADS if w[0] in a.workloads.split(",")]
    precs = a.precisions.split(",")
    for prec in precs:
        if prec not in PRECISIONS:
            sys.exit(f"--precisions: unknown {prec!r}; choose from {', '.join(PRECISIONS)}")
    res = {}
    for pi, prec in enumerate(precs):
        systems = start_pair(a, prec, 18431 + 2 * pi)
        for w in wl:
            for s in systems:
                res[(prec, w[0], s.name)] = []
        for rnd in range(a.rounds):
            for wi, (name, n, plen) in enumerate(wl):
                order = systems if (rnd + wi) % 2 == 0 else systems[::-1]
                for s in order:
                    tps, toks, done, failed = run_workload(s, n, plen, seed=1000 * rnd + wi,
                                                           seq=SINGLE_SEQ if n == 1 else 1)
                    res[(prec, name, s.name)].append((tps, done, failed))
                    print(f"round {rnd} {prec:5} {name:8} {s.name:10} {tps:7.1f} tok/s, {done} done, {failed} failed",
                          flush=True)
        for s in systems:
            s.proc.terminate()
            s.proc.wait()
    q4 = None
    if a.q4:
        q4s = [Thaw(a, f"{a.peers}/gguf/model-q4_1.gguf", 18451),
               Llama(a, f"{a.peers}/gguf/model-q4_1.gguf", 18452, loras=False)]
        q4 = {s.name: [] for s in q4s}
        for s in q4s:
            run_workload(s, 1, 8, 7, with_adapters=False)
        for rnd in range(a.rounds):
            for s in (q4s if rnd % 2 == 0 else q4s[::-1]):
                tps, _, done, failed = run_workload(s, 1, 64, 5000 + rnd, with_adapters=False)
                q4[s.name].append((tps, done, failed))
                print(f"round {rnd} q4_1     {s.name:10} {tps:7.1f} tok/s, {done} done, {failed} failed",
                      flush=True)
        for s in q4s:
            s.proc.terminate()
    print(f"\n{a.machine}; {a.rounds} rounds, median tok/s (min-max); llama.cpp {a.threads} threads")
    print("tok/s cells: median (min-max) over rounds, then requests done/failed over all rounds; a row")
    print("with failed requests is not a result (its ratio is left out). 'vs own 1 request': the")
    print("workload's median tok/s over the same system's single-request median at that precision.")
    print("| precision | workload | thaw serve | llama.cpp llama-server | thaw / llama.cpp "
          "| thaw vs own 1 request | llama.cpp vs own 1 request |")
    print("|---|---|---|---|---|---|---|")
    label = {"single": f"1 request, 64-token prompt ({SINGLE_SEQ} in turn)", "mixed8": "8 requests, 3 adapters mixed",
             "mixed16": "16 requests, 128-token prompts, 3 adapters mixed"}
    for prec in precs:
        for w in wl:
            t, l = res[(prec, w[0], "thaw serve")], res[(prec, w[0], "llama.cpp")]
            own = [own_ratio(res.get((prec, w[0], sn)), res.get((prec, "single", sn)))
                   for sn in ("thaw serve", "llama.cpp")]
            print(f"| {prec} | {label[w[0]]} | {cell(t)} | {cell(l)} | {ratio(t, l)} | {own[0]} | {own[1]} |")
    if q4:
        t, l = q4["thaw serve"], q4["llama.cpp"]
        print(f"| q4_1 | 1 request, 64-token prompt, no adapter | {cell(t)} | {cell(l)} | {ratio(t, l)} | | |")


def own_ratio(runs, single):
    """A workload's median tok/s over the same system's single-request median."""
    if not runs or not single or any(r[2] for r in runs + single):
        return "n/a"
    return f"{statistics.median(r[0] for r in runs) / statistics.median(r[0] for r in single):.2f}x"


def cell(runs):
    """`median (min-max), D done / F failed` over a row's rounds of (tok/s, done, failed)."""
    tps = [r[0] for r in runs]
    done, failed = sum(r[1] for r in runs), sum(r[2] for r in runs)
    return (f"{statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f}), "
            f"{done} done / {failed} failed")


def ratio(t, l):
    if any(r[2] for r in t + l):
        return "n/a (requests failed)"
    return f"{statistics.median(r[0] for r in t) / statistics.median(r[0] for r in l):.2f}x"


def s_model(s):
    return json.loads(urllib.request.urlopen(s.url + "/v1/models").read())["data"][0]["id"]


if __name__ == "__main__":
    main()
