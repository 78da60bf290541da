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
    (--limit; a 360 s, b 400 s, all 540 s: the device calls' own limits).
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
import fcntl
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PART_LIMIT_S = {"a": 360, "b": 400, "all": 540}
# What build.sh ships only with the cuda feature, or whose tests exist only with it.
CUDA_ONLY_EXES = {"cuda_bench"}
CUDA_TEST_EXES = {"cuda_parity", "cuda_exchange"}
PEER_SCRIPT = "transformers_gpu.py"


# ------------------------------------------------------------------------------------------
# What the sources say
# ------------------------------------------------------------------------------------------
def build_names(scripts):
    """The executables build.sh puts into gpu-bin/ (its strip / pack list)."""
    text = open(os.path.join(scripts, "build.sh")).read()
    m = re.search(r"^for f in ([^;]+); do", text, re.M)
    if not m:
        raise SystemExit(f"{scripts}/build.sh: no `for f in ...; do` list of executables")
    return m.group(1).split()


def switches(root):
    """THAW_CUDA_ name -> accepted values (None: any value) from kernel_select.rs."""
    path = os.path.join(root, "runtime/src/backend/kernel_select.rs")
    text = open(path).read()
    consts = dict(re.findall(r'const (\w+): &str = "(THAW_CUDA_\w+)"', text))
    out = {name: None for name in consts.values()}
    for env_const, on, off in re.findall(
        r'Switch\s*\{\s*env:\s*(\w+),\s*on:\s*"([^"]*)",\s*off:\s*"([^"]*)"', text
    ):
        name = consts.get(env_const)
        if name is None:
            continue
        vals = {"", "auto"}
        if on == "1":
            vals |= {"1", "true", "on", "yes", "0", "false", "off", "no"}
        else:
            vals |= {on, off}
            if on == "split":
                vals.add("flash-decoding")
        out[name] = vals
    # The chunk switch takes a positive integer (or auto): kernel_select::split_min_chunk.
    for name in out:
        if name.endswith("_MIN_CHUNK"):
            out[name] = "positive integer"
    return out


def tests_from_source(root, exe):
    """libtest names of tests/tests/EXE.rs: top-level fns and `#[path] mod m;` modules."""
    main = os.path.join(root, "tests/tests", exe + ".rs")
    names = []

    def scan(path, prefix):
        text = open(path).read()
        for fn in re.findall(r"#\[test\]\s*(?:#\[[^\]]*\]\s*)*fn\s+(\w+)", text):
            names.append(prefix + fn)
        return text

    text = scan(main, "")
    for rel, mod in re.findall(r'#\[path\s*=\s*"([^"]+)"\]\s*mod\s+(\w+);', text):
        scan(os.path.join(os.path.dirname(main), rel), mod + "::")
    return names


def cuda_bench_flags(root):
    text = open(os.path.join(root, "runtime/examples/cuda_bench/main.rs")).read()
    m = re.search(r"const FLAGS: \[&str; \d+\] = \[([^\]]*)\]", text)
    if not m:
        return None
    return re.findall(r'"([^"]+)"', m.group(1))


# ------------------------------------------------------------------------------------------
# Shims (run as `dryrun.py shim NAME ARGS...` with THAW_GPU_DRY_STATE set)
# ------------------------------------------------------------------------------------------
class State:
    def __init__(self, path):
        self.path = path
        self.cfg = json.load(open(os.path.join(path, "config.json")))

    def finding(self, msg):
        with open(os.path.join(self.path, "findings"), "a") as f:
            f.write(msg.replace("\n", " ").strip() + "\n")

    def note(self, msg):
        with open(os.path.join(self.path, "notes"), "a") as f:
            f.write(msg.strip() + "\n")

    def record(self, **call):
        with open(os.path.join(self.path, "calls.jsonl"), "a") as f:
            f.write(json.dumps(call) + "\n")

    def advance(self, ms):
        with open(os.path.join(self.path, "clock.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with open(os.path.join(self.path, "clock")) as f:
                now = int(f.read().strip() or 0) + int(ms)
            with open(os.path.join(self.path, "clock"), "w") as f:
                f.write(str(now))

    @staticmethod
    def ancestors():
        """The command lines of this shim's parent, its parent, ... (up to 6)."""
        pid = os.getppid()
        for _ in range(6):
            try:
                args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                return
            yield [x.decode(errors="replace") for x in args]
            pid = int(stat.rsplit(")", 1)[1].split()[1])

    def caller(self):
        """The script that ran this shim: the nearest ancestor running a .sh."""
        for args in self.ancestors():
            for x in args:
                if x.endswith(".sh"):
                    return os.path.basename(x)
        return "?"

    def timed(self):
        """Whether this shim runs under the timeout shim (before the script that called it)."""
        for args in self.ancestors():
            if any(x.endswith(".sh") for x in args):
                return False
            if args[2:4] == ["shim", "timeout"]:
                return True
        return False


def opt(args, flag):
    """The value of `--flag V` or `--flag=V` in args."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def check_env(st, name, args):
    known = st.cfg["switches"]
    for k, v in sorted(os.environ.items()):
        if not k.startswith("THAW_CUDA_"):
            continue
        where = f"{st.caller()}: {name} {' '.join(args[:2])}"
        if k not in known:
            st.finding(f"{where}: {k}={v} is not a switch of runtime/src/backend/kernel_select.rs "
                       f"(known: {', '.join(sorted(known))})")
            continue
        ok = known[k]
        val = v.strip().lower()
        if ok == "positive integer":
            if val not in ("", "auto") and not (val.isdigit() and int(val) > 0):
                st.finding(f"{where}: {k}={v} is not a positive integer or auto")
        elif ok is not None and val not in ok:
            st.finding(f"{where}: {k}={v} is not a value it takes ({', '.join(sorted(ok))})")


def run_quiet(cmd, timeout=60):
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"{cmd[0]} did not answer in {timeout}s")


def first_error(text):
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln.strip()
    return lines[0].strip() if lines else "(no output)"


def refused(st, cmd, what):
    """Runs a parse-only command line; False when it exits 0, else the finding is kept."""
    r = run_quiet(cmd)
    if r.returncode == 0:
        return False
    st.finding(f"{st.caller()}: {what}: {first_error(r.stderr + r.stdout)}")
    return True


def real_exe(st, name):
    p = os.path.join(st.cfg["real_bin"], name)
    return p if os.path.isfile(p) else None


def sample_tables(st, model, op_profile):
    """Real `thaw-bench gpu` tables, from a --quick run on the CPU of the tiny model."""
    tb = real_exe(st, "thaw-bench")
    if tb is None:
        return
    cmd = [tb, "gpu", "--quick", "--device", "cpu"]
    if model and os.path.isfile(os.path.join(model, "config.json")):
        cmd += ["--model", model]
    if op_profile:
        cmd.append("--op-profile")
    r = run_quiet(cmd, timeout=120)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr[-2000:])
    if r.returncode != 0:
        st.finding(f"dry run: thaw-bench gpu --quick on the CPU (the sample tables) failed: "
                   f"{first_error(r.stderr)}")


def shim_clap(st, name, args):
    exe = real_exe(st, name)
    if exe is None:
        st.finding(f"{st.caller()}: {name} is not in --bin ({st.cfg['real_bin']})")
        return 127
    if refused(st, [exe] + args + ["--help"],
               f"`{name} {' '.join(args)}` is refused by its parser"):
        return 2
    sub = args[0] if args else ""
    if name == "thaw" and sub == "gen-model":
        out = opt(args, "--out")
        r = run_quiet([exe, "gen-model", "--preset", "tiny", "--out", out])
        sys.stderr.write(r.stderr[-1000:])
        return r.returncode
    if name == "thaw" and sub == "gen-adapters":
        r = run_quiet([exe] + args)
        sys.stderr.write(r.stderr[-1000:])
        return r.returncode
    if name == "thaw-bench" and sub == "gpu":
        sample_tables(st, opt(args, "--model"), "--op-profile" in args)
    elif name == "thaw-bench" and sub == "load":
        out = opt(args, "--out")
        n = int(opt(args, "--requests") or 1)
        report = json.load(open(os.path.join(st.cfg["scripts"], "testdata/load.json")))
        s = report["summary"]
        s["sent"] = s["completed"] = n
        s["failed"] = 0
        os.makedirs(out, exist_ok=True)
        json.dump(report, open(os.path.join(out, "load.json"), "w"), indent=1)
        print(f"dry run: {n} requests (sample load.json)")
    return 0


def libtest_split(args):
    """(flags, filters, exact, skips) of a libtest command line."""
    flags, filters, skips = [], [], []
    exact = False
    i = 0
    takes_value = {"--test-threads", "--skip", "--format", "--logfile", "--color", "-Z",
                   "--shuffle-seed", "--report-time"}
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            if a == "--exact":
                exact = True
            if a in takes_value and i + 1 < len(args):
                flags.append(args[i + 1])
                if a == "--skip":
                    skips.append(args[i + 1])
                i += 1
        else:
            filters.append(a)
        i += 1
    return flags, filters, exact, skips


def shim_libtest(st, name, args):
    exe = real_exe(st, name)
    cuda = st.cfg["cuda"]
    flags, filters, exact, skips = libtest_split(args)
    names = []
    if exe is not None:
        if refused(st, [exe] + flags + ["--list"],
                   f"`{name} {' '.join(args)}`: libtest refuses the flags"):
            return 2
        r = run_quiet([exe, "--list", "--format", "terse"])
        names = [ln[: -len(": test")] for ln in r.stdout.splitlines() if ln.endswith(": test")]
    elif not (cuda == "0" and name in CUDA_TEST_EXES):
        st.finding(f"{st.caller()}: {name} is not in --bin ({st.cfg['real_bin']})")
        return 127
    if not names:
        if cuda != "0":
            st.finding(f"{st.caller()}: {name} lists no test (built without --features cuda? "
                       f"BUILD says cuda {cuda})")
            return 1
        names = tests_from_source(st.cfg["root"], name)
        st.note(f"{name}: {'not in --bin' if exe is None else 'lists no test'} (a cuda 0 build): "
                f"its {len(names)} tests read from tests/tests/{name}.rs and its modules")

    def match(n, f):
        return n == f if exact else f in n

    picked = [n for n in names
              if (not filters or any(match(n, f) for f in filters))
              and not any(match(n, s) for s in skips)]
    for f in filters:
        if not any(match(n, f) for n in names):
            st.finding(f"{st.caller()}: {name} filter `{f}` matches no test of {name} "
                       f"({len(names)} tests)")
    if not picked:
        st.finding(f"{st.caller()}: `{name} {' '.join(args)}` runs no test")
    for n in picked:
        print(f"test {n} ... ok")
    print(f"test result: ok. {len(picked)} passed; 0 failed; 0 ignored (dry run)")
    return 0


def shim_cuda_bench(st, args):
    exe = real_exe(st, "cuda_bench")
    if exe is not None:
        if refused(st, [exe] + args + ["--help"], f"`cuda_bench {' '.join(args)}` is refused"):
            return 2
    elif st.cfg["cuda"] == "0":
        flags = cuda_bench_flags(st.cfg["root"])
        if flags is None:
            st.finding("runtime/examples/cuda_bench/main.rs: no `const FLAGS` list to check "
                       "cuda_bench's flags against")
            return 2
        st.note(f"cuda_bench: not in --bin (a cuda 0 build): flags checked against FLAGS "
                f"{flags} of runtime/examples/cuda_bench/main.rs")
        bad = [a for a in args if a not in flags]
        if bad:
            st.finding(f"{st.caller()}: cuda_bench does not take {' '.join(bad)} "
                       f"(FLAGS: {' '.join(flags)})")
            return 2
    else:
        st.finding(f"{st.caller()}: cuda_bench is not in --bin ({st.cfg['real_bin']})")
        return 127
    print(f"| dry run | cuda_bench {' '.join(args)} |\n|---|---|")
    return 0


def shim_peer_python(st, args):
    if args[:1] == ["-c"]:
        return 0  # "import torch, transformers": the dry run pretends it can
    rest = [a for a in args if a != "-u"]
    script, sargs = rest[0], rest[1:]
    if os.path.basename(script) != PEER_SCRIPT:
        st.finding(f"{st.caller()}: the peer python runs {script}, not {PEER_SCRIPT}")
        return 2
    r = run_quiet([st.cfg["python"], "-c",
                   "import importlib.util, sys\n"
                   "spec = importlib.util.spec_from_file_location('peer', sys.argv[1])\n"
                   "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                   "sys.argv = ['transformers_gpu.py'] + sys.argv[2:]\n"
                   "m.parse()\n", script] + sargs)
    if r.returncode != 0:
        st.finding(f"{st.caller()}: `{PEER_SCRIPT} {' '.join(sargs)}` is refused by its "
                   f"parser: {first_error(r.stderr)}")
        return 2
    # The peer prints the tables in thaw-bench gpu's format: a CPU run of it stands in.
    sample_tables(st, opt(sargs, "--model"), False)
    return 0


def shim_timeout(st, args):
    i = 0
    while (i < len(args) and args[i].startswith("-")
           and not re.fullmatch(r"-\d+(\.\d+)?[smhd]?", args[i])):
        if args[i] in ("-s", "-k", "--signal", "--kill-after"):
            i += 1
        i += 1
    dur, cmd = args[i], args[i + 1:]
    who = f"{st.caller()}: timeout {dur} {os.path.basename(cmd[0])} {' '.join(cmd[1:2])}"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", dur)
    if not m:
        st.finding(f"{who}: `{dur}` is not a duration timeout takes (it exits 125 and the step "
                   f"does not run)")
        return 125
    secs = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if secs <= 0:
        st.finding(f"{who}: a limit of 0 means no limit at all (the step could hang the lease)")
    server = os.path.basename(cmd[0]) == "thaw" and cmd[1:2] == ["serve"]
    st.record(kind="timeout", limit_s=secs, cmd=os.path.basename(cmd[0]), sub=cmd[1:2],
              caller=st.caller(), background=server)
    if server and st.cfg["mode"] == "worst":
        # The worst case for a server: it answers /health just before half its limit, the
        # longest the scripts wait for it (the curl shim moves the clock on to then).
        with open(os.path.join(st.path, "clock")) as f:
            now = int(f.read().strip() or 0)
        with open(os.path.join(st.path, "up_at"), "w") as f:
            f.write(str(now + max(int(secs) // 2 - 1, 0) * 1000))
    rc = subprocess.call(cmd)
    # The worst case: the step ran until killed. A server runs beside the passes it serves
    # (they have their own limits), so it moves the clock on by nothing.
    if st.cfg["mode"] == "worst" and not server:
        st.advance(secs * 1000)
    return rc


def shim_python3(st, args):
    r = subprocess.run([st.cfg["python"]] + args, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(r.stderr)
    st.record(kind="python", args=args, rc=r.returncode, caller=st.caller())
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        st.finding(f"{st.caller()}: `python3 {' '.join(os.path.basename(a) for a in args[:1])}` "
                   f"exited {r.returncode}: {tail[0]}")
    return r.returncode


def shim(name, args):
    st = State(os.environ["THAW_GPU_DRY_STATE"])
    if name.startswith("bin:"):
        exe = name[4:]
        check_env(st, exe, args)
        st.record(kind="exe", exe=exe, args=args, caller=st.caller(), timed=st.timed())
        if exe in ("thaw", "thaw-bench"):
            return shim_clap(st, exe, args)
        if exe in CUDA_TEST_EXES:
            return shim_libtest(st, exe, args)
        if exe == "cuda_bench":
            return shim_cuda_bench(st, args)
        return 0  # thaw-test-worker: cuda_exchange spawns it
    return {
        "timeout": shim_timeout,
        "nvidia-smi": lambda st, a: print("dry run (no GPU), 81559 MiB, 0.0") or 0,
        "python3": shim_python3,
        "peer-python": shim_peer_python,
    }[name](st, args)


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
    me = os.path.abspath(__file__)
    py = sys.executable
    cfg = {"mode": mode, "real_bin": real, "cuda": cuda, "root": a.root, "scripts": a.scripts,
           "python": py, "switches": {k: (sorted(v) if isinstance(v, set) else v)
                                      for k, v in sw.items()}}
    json.dump(cfg, open(os.path.join(st_dir, "config.json"), "w"))
    with open(os.path.join(st_dir, "clock"), "w") as f:
        f.write("0")
    for n in names:
        write_exe(os.path.join(shim_bin, n), f'#!/bin/sh\nexec "{py}" "{me}" shim "bin:{n}" "$@"\n')
    if os.path.isfile(os.path.join(a.bin, "BUILD")):
        shutil.copy(os.path.join(a.bin, "BUILD"), shim_bin)
    with open(os.path.join(st_dir, "mode"), "w") as f:
        f.write(mode)
    write_exe(os.path.join(shim_path, "sleep"), SLEEP_SHIM)
    write_exe(os.path.join(shim_path, "curl"), CURL_SHIM)
    for n in ("timeout", "nvidia-smi", "python3", "peer-python"):
        write_exe(os.path.join(shim_path, n), f'#!/bin/sh\nexec "{py}" "{me}" shim {n} "$@"\n')
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
    if argv[:1] == ["shim"]:
        return shim(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="build.sh's gpu-bin/ (loose or bin.tar.gz)")
    p.add_argument("--out", help="the lease's logs and tables, per pass (default: a temp dir)")
    p.add_argument("--part", default="all", choices=sorted(PART_LIMIT_S))
    p.add_argument("--budget", type=int, help="lease.sh --budget (default: lease.sh's)")
    p.add_argument("--limit", type=int,
                   help="seconds the part may take at worst (a 360, b 400, all 540)")
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
