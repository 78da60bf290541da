#!/usr/bin/env python3
"""The shims of benches/gpu/dryrun.py (see its docstring): what the sources say (build.sh's
executables, kernel_select.rs's switches, the cuda test names, cuda_bench's flags) and the
stand-ins the dry run puts on PATH and into --bin, run as
`dryrun_shims.py NAME ARGS...` with THAW_GPU_DRY_STATE naming the pass's state directory.
Standard library only.
"""
import fcntl
import json
import os
import re
import subprocess
import sys

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
# Shims (run as `dryrun_shims.py NAME ARGS...` with THAW_GPU_DRY_STATE set)
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
            if args[1:3] == [os.path.abspath(__file__), "timeout"]:
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


if __name__ == "__main__":
    sys.exit(shim(sys.argv[1], sys.argv[2:]))
