#!/usr/bin/env python3
"""Offline check of the engine's step-time fit and of where a request's TTFT goes, from the
step logs `thaw serve --dump-cost-model PATH` writes (PATH.steps.jsonl).

usage: simulate-steplog.py RUN_DIR...   (each holding cost-N.json, cost-N.steps.jsonl, load.json)

Per server: the least-squares refit of the four rate columns (tokens, decode rows, SGMV
Σrank, BGMV rows·max rank) over the logged steps and its RMS / mean step, the same with
candidate regressors added (Σ decode KV context; sequences prefilled; first step after idle,
i.e. starting >= the dump's after_idle_gap_s after the previous step ended; the last two
together are the dump's six columns), how much of the squared error the worst 2% of steps
hold, and the dump's own numbers.
Per run: server-side TTFT (arrival at the engine → first token) split into wait-to-plan and
plan-to-first, and the client's TTFT minus it (HTTP and client).
"""
import glob
import json
import sys

import numpy as np


def load(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def design(steps, extra):
    return np.array([[1.0, s["tokens"], s["decode"],
                      0 if s["bgmv"] else s["rank_rows"],
                      s["lora_rows"] * s["max_rank"] if s["bgmv"] else 0]
                     + [e(s) for e in extra] for s in steps])


def after_idle(steps, gap):
    """1 for a step that starts >= gap after the previous one ended (or is the first)."""
    out, prev_end = [], None
    for s in steps:
        out.append(1.0 if prev_end is None or s["t"] - prev_end >= gap else 0.0)
        prev_end = s["t"] + s["elapsed_s"]
    return out


def prefills(s):
    # Older logs lack the count: a step with prompt rows prefills one sequence or more.
    return s.get("prefills", 1 if s["tokens"] > s["decode"] else 0)


CANDIDATES = [
    ("4 columns", []),
    ("+ decode KV context", [lambda s: s["decode_ctx"]]),
    ("+ prefills", [prefills]),
    ("+ after idle", [lambda s: s["_idle"]]),
    ("+ prefills + after idle (the dump's 6)", [prefills, lambda s: s["_idle"]]),
]

for run in sys.argv[1:]:
    firsts = []
    for log in sorted(glob.glob(f"{run}/cost-?.steps.jsonl")):
        lines = load(log)
        steps = [l for l in lines if l["kind"] == "step"]
        firsts += [l for l in lines if l["kind"] == "first"]
        dump = json.load(open(log.replace(".steps.jsonl", ".json")))
        layers = dump["perf"]["num_layers"]
        gap = dump["perf"].get("after_idle_gap_s", 0.02)
        for s, i in zip(steps, after_idle(steps, gap)):
            s["_idle"] = i
        y = np.array([s["elapsed_s"] / layers for s in steps])
        out = []
        for name, extra in CANDIDATES:
            a = design(steps, extra)
            c, *_ = np.linalg.lstsq(a, y, rcond=None)
            r = y - a @ c
            extra_ms = ", ".join(f"{v * layers * 1e3:.1f}" for v in c[5:])
            out.append(f"{name} {np.sqrt(np.mean(r ** 2)) / y.mean() * 100:.1f}%"
                       + (f" ({extra_ms} ms/step)" if extra else ""))
            if not extra:
                sq = np.sort(r ** 2)[::-1]
                k = max(1, len(sq) // 50)
                worst = sq[:k].sum() / sq.sum() * 100
                rest = np.sqrt(sq[k:].mean()) / y.mean() * 100
        print(f"{log}: {len(steps)} steps; refit RMS/mean: " + ", ".join(out))
        print(f"  worst 2% of steps hold {worst:.0f}% of the squared error (RMS without them "
              f"{rest:.1f}%); dump: fit_rms_rel {dump['perf']['fit_rms_rel'] * 100:.1f}%, "
              f"{dump['steps_observed']} steps; per step: prefill "
              f"{dump['perf'].get('layer_per_prefill_s', 0) * layers * 1e3:.1f} ms, after idle "
              f"{dump['perf'].get('layer_after_idle_s', 0) * layers * 1e3:.1f} ms "
              f"({sum(s['_idle'] for s in steps):.0f} steps after idle)")
    q = np.array([f["planned"] - f["arrived"] for f in firsts])
    p = np.array([f["first_token"] - f["planned"] for f in firsts])
    t = q + p
    client = np.array([r["ttft_s"] for r in json.load(open(f"{run}/load.json"))["requests"]
                       if r["ttft_s"] is not None])
    print(f"{run}: server-side TTFT mean {t.mean() * 1e3:.1f} ms, P99 "
          f"{np.quantile(t, 0.99) * 1e3:.1f} ms (wait-to-plan {q.mean() * 1e3:.1f}, "
          f"plan-to-first {p.mean() * 1e3:.1f}); client mean {client.mean() * 1e3:.1f} ms, "
          f"P99 {np.quantile(client, 0.99) * 1e3:.1f} ms: HTTP + client "
          f"{(client.mean() - t.mean()) * 1e3:.1f} ms")
