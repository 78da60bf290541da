#!/usr/bin/env python3
"""Ablation for the validation table (simulate.md): each run's dumps with the rate columns
refitted by plain least squares over their own step log without the prefill and after-idle
columns (those set to 0), written to OUT/RUN/cost-N.json beside a copy of load.json, for
`thaw-bench simulate --cost-model OUT/RUN/cost-0.json[,...] --replay OUT/RUN/load.json`.

usage: simulate-ablate.py RUNS_DIR OUT   (RUNS_DIR as simulate-validate.sh wrote it)
"""
import json, sys, os, glob, shutil, numpy as np
src, out = sys.argv[1], sys.argv[2]
for run in ["a1","b1","a2","b2"]:
    os.makedirs(f"{out}/{run}", exist_ok=True)
    shutil.copy(f"{src}/{run}/load.json", f"{out}/{run}/load.json")
    for log in sorted(glob.glob(f"{src}/{run}/cost-?.steps.jsonl")):
        d = json.load(open(log.replace(".steps.jsonl", ".json")))
        p = d["perf"]; L = p["num_layers"]
        S = [json.loads(l) for l in open(log) if l.strip()]
        S = [s for s in S if s["kind"] == "step" and not s["assisted"]]
        y = np.array([s["elapsed_s"] / L for s in S])
        X = np.array([[1, s["tokens"], s["decode"], 0 if s["bgmv"] else s["rank_rows"],
                       s["lora_rows"] * s["max_rank"] if s["bgmv"] else 0] for s in S], float)
        keep = [c for c in range(5) if np.ptp(X[:, c]) > 0 or c == 0]
        c, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        full = np.zeros(5); full[keep] = c
        names = ["layer_base_s", "layer_per_token_s", "layer_per_decode_s", "lora_sgmv_s", "lora_bgmv_s"]
        for k, n in enumerate(names):
            if k in keep:
                p[n] = max(float(full[k]), 0.0) if k != 2 else float(full[k])
        p["layer_per_prefill_s"] = 0.0; p["layer_after_idle_s"] = 0.0
        json.dump(d, open(f"{out}/{run}/" + os.path.basename(log).replace(".steps.jsonl", ".json"), "w"))
        print(run, os.path.basename(log), {n: round(p[n]*L*1e3, 4) for n in names})
