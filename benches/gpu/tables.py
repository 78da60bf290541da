#!/usr/bin/env python3
"""The tables of benches/gpu/run.sh, in the format of benches/results/cuda-h100.md.

Reads RUNS/<policy>/{serve.log, cost.steps.jsonl, host/, disk/} and RUNS/decode-b<N>/ as run.sh
leaves them; prints markdown. Each pass directory holds the client's load.json, the server
log's line range of the pass (log-from, log-to), its wall-clock window (t-start, t-end) and
thaw_cpu_assisted_rows_total before and after it.
"""
import argparse
import json
import os
import re
import statistics
import sys
from datetime import datetime, timezone

POLICIES = ["cached", "on-demand", "cpu-assist", "auto"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\S+)")


def read(path, default=None):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def num(path, default=0.0):
    try:
        return float(read(path, ""))
    except ValueError:
        return default


def first_tokens(log, start, end):
    """The `first token` request-log lines of lines [start, end) of the server log."""
    rows = []
    try:
        with open(log, errors="replace") as f:
            lines = f.readlines()[int(start):int(end)]
    except (OSError, ValueError):
        return rows
    for line in lines:
        line = ANSI.sub("", line)
        if "first token" not in line:
            continue
        rows.append(dict(FIELD.findall(line)))
    return rows


def waits(rows):
    """(mean ms per wait reason over the requests, largest first: 'disk 358 + batch 127';
    requests whose adapter was not on the device at arrival; requests logged)."""
    misses = sum(1 for r in rows if r.get("hit") == "false")
    keys = sorted({k for r in rows for k in r if k.endswith("_ms") and k != "ttft_ms"})
    parts = []
    for k in keys:
        vals = []
        for r in rows:
            try:
                vals.append(float(r.get(k, "0")))
            except ValueError:
                pass
        if vals and statistics.mean(vals) >= 0.05:
            parts.append((statistics.mean(vals), k[:-3]))
    parts.sort(reverse=True)
    text = " + ".join(f"{name} {v:.1f}" for v, name in parts) or "—"
    return text, misses, len(rows)


def starts(rows):
    """How the pass's requests started: 'N / M', N started before their adapter landed with
    their step waiting for its layers (`layer_wait=true` in the request log), M held by the
    cold-start gate for the copy for a step or more (`held=true`); '?' for a server too old to
    log them."""
    if not any("layer_wait" in r for r in rows):
        return "?"
    n = sum(1 for r in rows if r.get("layer_wait") == "true")
    m = sum(1 for r in rows if r.get("held") == "true")
    return f"{n} / {m}"


def assisted_steps(steps_file, t0, t1):
    """(assisted steps, steps) of the step log within the pass's wall-clock window."""
    n = a = 0
    try:
        with open(steps_file) as f:
            for line in f:
                try:
                    s = json.loads(line)
                except ValueError:
                    continue
                if s.get("kind") != "step" or not (t0 <= s.get("t", 0) <= t1):
                    continue
                n += 1
                a += bool(s.get("assisted"))
    except OSError:
        return None, None
    return a, n


def summary(pass_dir):
    try:
        with open(os.path.join(pass_dir, "load.json")) as f:
            return json.load(f)["summary"]
    except (OSError, ValueError, KeyError):
        return None


def ms(v):
    return f"{v * 1e3:.1f}" if v >= 0.01 else f"{v * 1e3:.2f}"


def pass_row(runs, policy, tier, base):
    d = os.path.join(runs, policy, tier)
    s = summary(d)
    label = {"disk": "disk (page cache)", "host": "host memory"}[tier]
    if policy == "cached":
        label = "— (all resident)"
    if s is None:
        return f"| {label} | {policy} | no result (see {d}/load.out) | | | | | | | |"
    ttft, tpot = s["ttft"], s["tpot"]
    rel = ""
    if base and base["ttft"]["mean"] > 0 and policy != "cached":
        rel = f" ({ttft['mean'] / base['ttft']['mean']:.2f}×)"
    rows = first_tokens(
        os.path.join(runs, policy, "serve.log"),
        num(os.path.join(d, "log-from")),
        num(os.path.join(d, "log-to")),
    )
    w, misses, seen = waits(rows)
    a, n = assisted_steps(
        os.path.join(runs, policy, "cost.steps.jsonl"),
        num(os.path.join(d, "t-start")),
        num(os.path.join(d, "t-end")),
    )
    steps = "?" if a is None else f"{a}/{n}"
    assisted_rows = num(os.path.join(d, "rows-after")) - num(os.path.join(d, "rows-before"))
    return (
        f"| {label} | {policy} | {ms(ttft['mean'])} / {ms(ttft['p99'])}{rel} | {ms(tpot['mean'])} "
        f"| {s['completed']}/{s['failed']} | {misses}/{seen} | {w} | {starts(rows)} | {steps} "
        f"| {assisted_rows:.0f} |"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--device", default="?")
    ap.add_argument("--build", default="?")
    ap.add_argument("--workload", default="")
    a = ap.parse_args()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        f"## benches/gpu/run.sh on {a.device}, {date}",
        "",
        f"Executables: {a.build.strip()}. Workload: {a.workload}. Times in ms at the client; "
        "ratios against `cached` in the same pass. Misses: requests whose adapter was not on "
        "the device (nor loading) at arrival, of those logged. Waits: the request log's "
        "(`RUST_LOG=thaw::request=debug`), mean ms per reason over the pass's requests. "
        "Started waiting per layer / held: requests that ran before their adapter landed, their "
        "step waiting for its layers, and requests the cold-start gate held for the copy "
        "(request log). Assisted steps: steps of the pass in which CPU assist "
        "ran (step log), of all steps; rows: `thaw_cpu_assisted_rows_total` over the pass.",
        "",
    ]
    for tier, title in (
        ("host", "Adapters start in host memory (CaraServe's setting): the first pass of each server"),
        ("disk", "Adapters start on disk (page cache warm): the second pass, other adapters"),
    ):
        out += [
            f"### {title}",
            "",
            "| adapters start on | policy | TTFT mean / P99 ms | TPOT mean ms | done/failed "
            "| misses | a request waited for (mean ms) | started waiting per layer / held "
            "| assisted steps | assisted rows |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = summary(os.path.join(a.runs, "cached", tier))
        # The policies run.sh ran (THAW_GPU_POLICIES may pick fewer).
        ran = [p for p in POLICIES if os.path.isdir(os.path.join(a.runs, p))]
        out += [pass_row(a.runs, p, tier, base) for p in ran]
        out.append("")
    out += [
        "### Decode, base model, server started with default flags",
        "",
        "| batch | requests done | output tokens | TPOT mean ms | tok/s per stream | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    batches = sorted(
        int(d[len("decode-b"):])
        for d in os.listdir(a.runs)
        if d.startswith("decode-b") and d[len("decode-b"):].isdigit()
    ) if os.path.isdir(a.runs) else []
    if not batches:
        out.append("| — | no result | | | | |")
    for b in batches:
        s = summary(os.path.join(a.runs, f"decode-b{b}"))
        if s is None:
            out.append(f"| {b} | no result (see decode-b{b}/load.out) | | | | |")
            continue
        tpot = s["tpot"]["mean"]
        per = f"{1 / tpot:.1f}" if tpot > 0 else "—"
        out.append(
            f"| {b} | {s['completed']}/{s['sent']} | "
            f"{s['output_tokens_per_s'] * s['wall_s']:.0f} | {ms(tpot)} | {per} "
            f"| {s['output_tokens_per_s']:.1f} |"
        )
    log = read(os.path.join(a.runs, "decode-serve.log"), "")
    budget = [ANSI.sub("", l) for l in log.splitlines() if "device budget" in l]
    if budget:
        out += ["", f"Default sizing: `{budget[0].strip()[:300]}`"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
