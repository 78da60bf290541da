#!/usr/bin/env python3
"""A dry run of the GPU lease scripts (lease.sh, and the run.sh / attn29.sh / tables.py /
peer29.py it calls), on a machine with no GPU, in seconds: everything that needs no GPU runs
for real, the rest is checked. `benches/gpu/lease.sh --dry-run ...` (or THAW_GPU_DRY_RUN=1)
runs it with lease.sh's own arguments:

    benches/gpu/lease.sh --bin gpu-bin --out /tmp/dry --part a --dry-run
    python3 benches/gpu/dryrun.py --bin gpu-bin --part b

lease.sh runs twice, with `--bin` pointing at shims named as benches/gpu/build.sh names its
executables, and with `date`, `sleep`, `timeout`, `curl`, `nvidia-smi` and `python3` shimmed:
  * "fast": every step returns at once, so every step runs and is checked;
  * "worst": every `timeout` runs out (the clock of `date +%s` moves on by its limit, and
    `sleep` moves it on too), so the steps' limits must add up within the part's limit
    (--limit; a 380 s, b 370 s, c 300 s, all 540 s: the device calls' own limits).
What each shim checks, against the real executables of --bin (build.sh's gpu-bin/, loose or
packed in bin.tar.gz):
  * thaw, thaw-bench: the subcommand and flags, by their own parser (clap) with `--help`
    appended; then `gen-model` writes the tiny preset, `gen-adapters` runs as asked,
    `thaw-bench gpu` runs `--quick` on the CPU (its real tables, for the scripts' sed and
    peer29.py), `thaw-bench load` writes a load.json in the shape of testdata/load.json (whose
    keys a thaw-bench unit test holds to the real report);
  * cuda_parity, cuda_exchange: the libtest flags (`--list` with them) and every name filter
    matches at least one test of the executable's list; an executable built without the cuda
    feature lists none, and only for a `cuda 0` build (BUILD, build.sh --cpu) the tests are
    then read from the source (tests/tests/NAME.rs and its #[path] modules), as said;
  * cuda_bench: its flags, by `cuda_bench ARGS --help`; for a `cuda 0` build (no cuda_bench)
    against the FLAGS list in runtime/examples/cuda_bench/main.rs;
  * every THAW_CUDA_ variable set for any executable is a switch of
    runtime/src/backend/kernel_select.rs (its `const ..: &str = "THAW_CUDA_.."`), with a
    value its Switch takes (the `on` / `off` names there, 1/0-style for on/off ones);
  * the transformers peer: its flags by transformers_gpu.py's own parse() (no torch needed);
  * tables.py and peer29.py run on what the shims wrote and must exit 0; every script passes
    `bash -n` (and shellcheck, when installed), every Python file `py_compile`; every
    `$BIN/NAME` the scripts call is a name build.sh gives; no `timeout 0` (no limit at all).
Exit 0 with "dry run: OK", else 1 with one line per problem, naming the script's flag,
filter, variable or executable.
"""
import argparse
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

from dryrun_shims import (CUDA_ONLY_EXES, CUDA_TEST_EXES, PEER_SCRIPT, build_names,
                          first_error, run_quiet, switches)

HERE = os.path.dirname(os.path.abspath(__file__))
PART_LIMIT_S = {"a": 380, "b": 370, "c": 300, "all": 540}


# ------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------
DATE_SHIM = """#!/bin/bash
# dry run: `date +%s` reads the simulated clock (ms in $THAW_GPU_DRY_STATE/clock)
if [ "$#" = 1 ] && { [ "$1" = +%s ] || [ "$1" = +%s.%N ]; }; then
  read -r c <"$THAW_GPU_DRY_STATE/clock"
  if [ "$1" = +%s ]; then echo $((c / 1000)); else printf '%d.%03d000000\\n' $((c / 1000)) $((c % 1000)); fi
  exit 0
fi
exec {real} "$@"
"""


# Bash, not Python: the scripts' wait loops call these tens of times.
SLEEP_SHIM = """#!/bin/bash
# dry run: in the worst case `sleep S` moves the simulated clock on by S, at once
[ "$(cat "$THAW_GPU_DRY_STATE/mode")" = worst ] || exit 0
ms=$(awk -v s="${1%s}" 'BEGIN { printf "%d", s * 1000 }')
{
  flock 9
  read -r c <"$THAW_GPU_DRY_STATE/clock"
  echo $((c + ms)) >"$THAW_GPU_DRY_STATE/clock"
} 9>>"$THAW_GPU_DRY_STATE/clock.lock"
"""
CURL_SHIM = """#!/bin/bash
# dry run: the server's /health and /metrics. Fast: up at once, every adapter on the device.
# Worst: up just before half its limit (the clock moves on to then), adapters never arrive.
url=
for a in "$@"; do case "$a" in http*) url=$a ;; esac; done
worst=0
[ "$(cat "$THAW_GPU_DRY_STATE/mode")" = worst ] && worst=1
case "$url" in
  */metrics)
    echo "thaw_cpu_assisted_rows_total 0"
    if [ $worst = 1 ]; then echo 'thaw_adapters{tier="device"} 0'; else echo 'thaw_adapters{tier="device"} 1000000'; fi
    ;;
  *)
    if [ $worst = 1 ] && [ -f "$THAW_GPU_DRY_STATE/up_at" ]; then
      {
        flock 9
        read -r c <"$THAW_GPU_DRY_STATE/clock"
        read -r up <"$THAW_GPU_DRY_STATE/up_at"
        [ "$c" -lt "$up" ] && echo "$up" >"$THAW_GPU_DRY_STATE/clock"
      } 9>>"$THAW_GPU_DRY_STATE/clock.lock"
    fi
    echo ok
    ;;
esac
"""


def write_exe(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def real_bin_dir(bin_dir, work):
    """--bin, or the executables unpacked from its bin.tar.gz (build.sh packs big ones)."""
    packed = os.path.join(bin_dir, "bin.tar.gz")
    if os.path.isfile(packed):
        out = os.path.join(work, "realbin")
        os.makedirs(out, exist_ok=True)
        with tarfile.open(packed) as t:
            try:
                t.extractall(out, filter="data")
            except TypeError:  # a Python without extraction filters
                t.extractall(out)
        return out
    return os.path.abspath(bin_dir)


def build_cuda(bin_dir):
    try:
        text = open(os.path.join(bin_dir, "BUILD")).read()
    except OSError:
        return "?"
    m = re.search(r"^cuda (\d)", text, re.M)
    return m.group(1) if m else "?"


def one_pass(a, mode, names, sw, real, cuda, work):
    st_dir = os.path.join(work, mode)
    shim_path = os.path.join(st_dir, "path")
    shim_bin = os.path.join(st_dir, "bin")
    out = os.path.join(a.out, mode)
    for d in (shim_path, shim_bin, out):
        os.makedirs(d, exist_ok=True)
    me = os.path.join(HERE, "dryrun_shims.py")
    py = sys.executable
    cfg = {"mode": mode, "real_bin": real, "cuda": cuda, "root": a.root, "scripts": a.scripts,
           "python": py, "switches": {k: (sorted(v) if isinstance(v, set) else v)
                                      for k, v in sw.items()}}
    json.dump(cfg, open(os.path.join(st_dir, "config.json"), "w"))
    with open(os.path.join(st_dir, "clock"), "w") as f:
        f.write("0")
    for n in names:
        write_exe(os.path.join(shim_bin, n), f'#!/bin/sh\nexec "{py}" "{me}" "bin:{n}" "$@"\n')
    if os.path.isfile(os.path.join(a.bin, "BUILD")):
        shutil.copy(os.path.join(a.bin, "BUILD"), shim_bin)
    with open(os.path.join(st_dir, "mode"), "w") as f:
        f.write(mode)
    write_exe(os.path.join(shim_path, "sleep"), SLEEP_SHIM)
    write_exe(os.path.join(shim_path, "curl"), CURL_SHIM)
    for n in ("timeout", "nvidia-smi", "python3", "peer-python"):
        write_exe(os.path.join(shim_path, n), f'#!/bin/sh\nexec "{py}" "{me}" {n} "$@"\n')
    write_exe(os.path.join(shim_path, "date"), DATE_SHIM.replace("{real}", shutil.which("date")))
    env = dict(os.environ)
    env.pop("THAW_GPU_DRY_RUN", None)
    for k in list(env):
        if k.startswith("THAW_CUDA_") or k.startswith("THAW_GPU_"):
            env.pop(k)
    env.update(PATH=shim_path + os.pathsep + env.get("PATH", ""), THAW_GPU_DRY_STATE=st_dir,
               THAW_PEER_PYTHON=os.path.join(shim_path, "peer-python"),
               THAW_GPU_WORK=os.path.join(st_dir, "work"), OUT=out)
    cmd = ["bash", os.path.join(a.scripts, "lease.sh"), "--bin", shim_bin, "--out", out,
           "--part", a.part]
    if a.budget:
        cmd += ["--budget", str(a.budget)]
    with open(os.path.join(out, "lease.log"), "w") as log:
        rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             timeout=a.wall_limit)
    clock_s = int(open(os.path.join(st_dir, "clock")).read()) / 1000

    def lines(name):
        try:
            return [ln.rstrip("\n") for ln in open(os.path.join(st_dir, name)) if ln.strip()]
        except OSError:
            return []

    calls = [json.loads(ln) for ln in lines("calls.jsonl")]
    findings = list(dict.fromkeys(lines("findings")))
    if mode == "fast":
        # Every step ran and every pass has a result: a table row without one is the
        # scripts' or tables.py's problem.
        for d, _, files in os.walk(out):
            for f in files:
                if f == "tables.md" and "no result" in open(os.path.join(d, f)).read():
                    findings.append(f"{os.path.join(d, f)}: a row says `no result` though every "
                                    f"step ran")
    if rc != 0:
        findings.append(f"lease.sh --part {a.part} exited {rc} (see {out}/lease.log)")
    return findings, list(dict.fromkeys(lines("notes"))), calls, clock_s, out


def static_checks(a, names, sw, work):
    found = []
    scripts = sorted(f for f in os.listdir(a.scripts) if f.endswith(".sh"))
    for s in scripts:
        r = run_quiet(["bash", "-n", os.path.join(a.scripts, s)])
        if r.returncode != 0:
            found.append(f"{s}: bash -n: {first_error(r.stderr)}")
    sc = shutil.which("shellcheck")
    if sc:
        r = run_quiet([sc] + [os.path.join(a.scripts, s) for s in scripts])
        if r.returncode != 0:
            found.append("shellcheck: " + " ".join(
                ln for ln in r.stdout.splitlines() if ln.startswith("In "))[:500])
    pys = [os.path.join(a.scripts, f) for f in sorted(os.listdir(a.scripts)) if f.endswith(".py")]
    pys.append(os.path.join(a.root, "benches/peers", PEER_SCRIPT))
    for p in pys:
        try:
            py_compile.compile(p, cfile=os.path.join(work, "pyc", os.path.basename(p) + "c"),
                               doraise=True)
        except py_compile.PyCompileError as e:
            found.append(f"{os.path.basename(p)}: py_compile: {e.msg.strip().splitlines()[-1]}")
    texts = {s: open(os.path.join(a.scripts, s)).read() for s in scripts}
    for s in scripts:
        text = texts[s]
        if s != "build.sh":
            for n in sorted(set(re.findall(r'\$BIN/([A-Za-z0-9_.-]+)', text)) - {"BUILD",
                                                                                 "bin.tar.gz"}):
                if n not in names:
                    found.append(f"{s}: calls $BIN/{n}, which build.sh does not ship "
                                 f"({' '.join(names)})")
        # The scripts' own knobs: one set for a step but read by no script is a typo.
        for v in sorted(set(re.findall(r"\b(THAW_GPU_[A-Z0-9_]+)=", text))):
            if not any(re.search(r"\$\{?" + v + r"\b", t) for t in texts.values()):
                found.append(f"{s}: sets {v}, which no script in {a.scripts} reads")
        # Variables set in any step, run or not in this dry run.
        for v in sorted(set(re.findall(r"\b(THAW_CUDA_[A-Z0-9_]+)=", text))):
            if v not in sw:
                found.append(f"{s}: sets {v}, not a switch of kernel_select.rs")
    return found


def main(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="build.sh's gpu-bin/ (loose or bin.tar.gz)")
    p.add_argument("--out", help="the lease's logs and tables, per pass (default: a temp dir)")
    p.add_argument("--part", default="all", choices=sorted(PART_LIMIT_S))
    p.add_argument("--budget", type=int, help="lease.sh --budget (default: lease.sh's)")
    p.add_argument("--limit", type=int,
                   help="seconds the part may take at worst (a 380, b 370, c 300, all 540)")
    p.add_argument("--scripts", default=HERE, help="where lease.sh and its scripts are")
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(HERE)),
                   help="the checkout whose sources name the switches and tests")
    p.add_argument("--wall-limit", type=int, default=300, help="real seconds a pass may take")
    p.add_argument("--modes", default="fast,worst",
                   help="the passes: fast (every step checked), worst (the limits summed)")
    a = p.parse_args(argv)
    a.scripts = os.path.abspath(a.scripts)
    a.root = os.path.abspath(a.root)
    limit = a.limit or PART_LIMIT_S[a.part]
    work = tempfile.mkdtemp(prefix="thaw-gpu-dry-")
    keep = a.out is None
    a.out = os.path.abspath(a.out or os.path.join(work, "out"))
    try:
        return run_checks(a, limit, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def run_checks(a, limit, work):
    names = build_names(a.scripts)
    sw = switches(a.root)
    real = real_bin_dir(a.bin, work)
    cuda = build_cuda(a.bin)
    findings = static_checks(a, names, sw, work)
    notes = []
    for n in names:
        if os.path.isfile(os.path.join(real, n)):
            continue
        if cuda == "0" and n in CUDA_ONLY_EXES | CUDA_TEST_EXES:
            notes.append(f"{n}: not in --bin; a cuda 0 build may lack it")
        else:
            findings.append(f"{n}: build.sh ships it, but it is not in --bin ({real})")
    report = []
    for mode in a.modes.split(","):
        f, n, calls, clock_s, out = one_pass(a, mode, names, sw, real, cuda, work)
        findings += [x for x in f if x not in findings]
        notes += [x for x in n if x not in notes]
        exes = [c for c in calls if c["kind"] == "exe"]
        tos = [c for c in calls if c["kind"] == "timeout"]
        report.append(f"{mode}: {len(exes)} executable calls, {len(tos)} timeouts, "
                      f"simulated clock at the end {clock_s:.0f} s (logs: {out})")
        if mode == "worst":
            for c in tos:
                report.append(f"  {c['caller']}: timeout {c['limit_s']:.0f} {c['cmd']} "
                              f"{' '.join(c['sub'])}{' (background server)' if c['background'] else ''}")
            if clock_s > limit:
                findings.append(f"--part {a.part}: with every step running to its timeout the "
                                f"lease takes {clock_s:.0f} s, over its {limit} s")
        if mode == "fast":
            ran = {c["exe"] for c in exes}
            report.append(f"  executables called: {' '.join(sorted(ran))}")
            unused = [n for n in names if n not in ran and n != "thaw-test-worker"]
            if unused:
                report.append(f"  shipped by build.sh, never run by --part {a.part}: "
                              f"{' '.join(unused)}")
            untimed = sorted({f"{c['caller']}: {c['exe']} {' '.join(c['args'][:1])}"
                              for c in exes if not c["timed"]})
            for u in untimed:
                report.append(f"  no timeout (its time comes out of the later steps'): {u}")
    print(f"dry run of lease.sh --part {a.part} (--bin {a.bin}, BUILD cuda {cuda}, "
          f"{len(sw)} THAW_CUDA_ switches in kernel_select.rs)")
    for ln in report:
        print(ln)
    for ln in notes:
        print("note: " + ln)
    if findings:
        for ln in findings:
            print("FAIL: " + ln)
        print(f"dry run: {len(findings)} problem(s)")
        return 1
    print("dry run: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
