#!/usr/bin/env python3
"""Batch 1 split into prefill and decode: `side_by_side.py`'s `single` workload (same servers,
flags and request: adapter r16-qkvo, 64-token prompt, 32 greedy tokens), with thaw's answer
streamed (time to first token, then ms per token) and llama.cpp's own `timings`. The systems
rotate each round; `--with-off` adds a second thaw with `THAW_ROW_STREAM=0` (the interleaved
one-row order, issue 30) for an A/B of one binary.
Usage:
  python3 benches/peers/batch1_split.py --thaw target/release/thaw \
      --llama-server /work/peers/llama-build/bin/llama-server --precision f32 --rounds 6 [--with-off]
"""
import sys, json, time, random, urllib.request, argparse
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import side_by_side as sbs

def thaw_stream(s, prompt, adapter):
    body = {"model": adapter, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(s.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter(); times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and b"[DONE]" not in line:
                times.append(time.perf_counter())
    t1 = time.perf_counter()
    return t1 - t0, times[0] - t0, (times[-1] - times[0]) / max(1, len(times) - 1), len(times)

def llama_one(s, prompt, adapter):
    body = {"prompt": prompt, "n_predict": 32, "temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
            "lora": [{"id": i, "scale": 1.0 if n == adapter else 0.0} for i, n in enumerate(sbs.ADAPTERS)]}
    t0 = time.perf_counter(); r = sbs.post(s.url + "/completion", body); t1 = time.perf_counter()
    t = r["timings"]
    return t1 - t0, t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3 / t["predicted_n"], r["tokens_predicted"]

p = sbs.server_args("b1", 5)
p.add_argument("--precision", default="f32")
p.add_argument("--only", default="")
p.add_argument("--with-off", action="store_true")
a = p.parse_args()
thaw_model, gguf = sbs.PRECISIONS[a.precision]
systems = []
if a.only != "llama":
    systems.append(sbs.Thaw(a, f"{a.peers}/{thaw_model}", 18631))
if a.with_off:
    import os
    os.environ["THAW_ROW_STREAM"] = "0"
    t = sbs.Thaw(a, f"{a.peers}/{thaw_model}", 18633); t.name = "thaw RS=0"
    del os.environ["THAW_ROW_STREAM"]
    systems.append(t)
if a.only != "thaw":
    systems.append(sbs.Llama(a, f"{a.peers}/{gguf}", 18632))
rng = random.Random(7)
for s in systems:  # warm-up
    pr = [rng.randrange(100, 40000) for _ in range(64)]
    (thaw_stream if isinstance(s, sbs.Thaw) else llama_one)(s, pr, "r16-qkvo")
res = {s.name: [] for s in systems}
for rnd in range(a.rounds):
    pr = [rng.randrange(100, 40000) for _ in range(64)]
    for s in (systems[rnd % len(systems):] + systems[:rnd % len(systems)]):
        f = thaw_stream if isinstance(s, sbs.Thaw) else llama_one
        wall, pre, per, n = f(s, pr, "r16-qkvo")
        res[s.name].append((wall, pre, per))
        print(f"{rnd} {s.name:10} wall {wall*1e3:7.1f} ms  {32/wall:6.1f} tok/s  prefill/ttft {pre*1e3:6.1f} ms  decode {per*1e3:6.2f} ms/tok ({1/per:6.1f} tok/s) n={n}", flush=True)
import statistics as st
for k, v in res.items():
    print(f"MEDIAN {a.precision} {k:10} {32/st.median(x[0] for x in v):6.1f} tok/s  prefill {st.median(x[1] for x in v)*1e3:6.1f} ms  decode {st.median(x[2] for x in v)*1e3:6.2f} ms/tok")
for s in systems:
    s.proc.terminate(); s.proc.wait()
