#!/bin/bash
# Stress test binaries under contention (session 13, benches/results/ci-robustness.md).
# usage: benches/results/ci-stress.sh MODE REPS OUTDIR BIN...   (run inside /work/bin/busy)
#   BIN: a test target name (`faults`, `http_sigterm`, ...), `<crate>-lib` for unit tests, or
#   `<bin>-bin`; `all` for every test binary of the workspace.
#   MODE: none | hogs2 (two `yes` hogs on the 2 cores) | core0 (taskset -c 0 plus a hog pinned
#   there) | starve (hogs2, test at nice ${STARVE_NICE:-10}) | quota (own cgroup-v1 CPU group,
#   ${QUOTA_MS:-60} ms per ${PERIOD_MS:-200} ms; needs root).
# Builds nothing: run `cargo test --workspace --no-run` first. Stops starting runs after
# ${SECS:-540} s so one busy call stays under 10 minutes; hogs are killed on exit.
# Writes OUTDIR/summary.tsv (bin, rep, exit code, seconds) and keeps the log of each failure.
set -u
mode=$1; reps=$2; out=$3; shift 3
root=$(cd "$(dirname "$0")/../.." && pwd)
SECS=${SECS:-540}
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-2}
mkdir -p "$out"
bins="$out/bins.tsv"
(cd "$root" && cargo test --workspace --no-run --message-format=json 2>/dev/null) | python3 -c '
import sys, json, os
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        t = m["target"]; kind = t["kind"][0]
        name = t["name"] if kind == "test" else t["name"] + "-" + kind
        print(name + "\t" + m["executable"] + "\t" + os.path.dirname(m["manifest_path"]))
' > "$bins"
[ "$*" = all ] && set -- $(cut -f1 "$bins")
hogs=()
stop_hogs() { for p in "${hogs[@]}"; do kill "$p" 2>/dev/null; done; wait "${hogs[@]}" 2>/dev/null; hogs=(); }
trap stop_hogs EXIT
CG=/sys/fs/cgroup/cpu/thaw-ci-stress
case $mode in
  hogs2|starve) for i in 1 2; do yes >/dev/null & hogs+=($!); done ;;
  core0) taskset -c 0 yes >/dev/null & hogs+=($!) ;;
  quota) mkdir -p "$CG"
         echo $(( ${PERIOD_MS:-200} * 1000 )) > "$CG/cpu.cfs_period_us"
         echo $(( ${QUOTA_MS:-60} * 1000 )) > "$CG/cpu.cfs_quota_us" ;;
esac
t_end=$(( $(date +%s) + SECS ))
for name in "$@"; do
  line=$(awk -F'\t' -v n="$name" '$1==n' "$bins" | head -1)
  exe=$(cut -f2 <<<"$line"); cwd=$(cut -f3 <<<"$line")
  [ -z "$exe" ] && { echo "no test binary $name"; continue; }
  pre=()
  [ "$mode" = core0 ] && pre=(taskset -c 0)
  [ "$mode" = starve ] && pre=(nice -n "${STARVE_NICE:-10}")
  pass=0; fail=0
  for i in $(seq 1 "$reps"); do
    [ "$(date +%s)" -ge "$t_end" ] && { echo "$name: time up after $((pass + fail)) runs"; break; }
    t0=$(date +%s.%N)
    ( [ "$mode" = quota ] && echo $BASHPID > "$CG/cgroup.procs"
      cd "$cwd" && CARGO_MANIFEST_DIR="$cwd" timeout 300 "${pre[@]}" "$exe" ) > "$out/$name.$i.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%.1f\n' "$name" "$i" "$rc" "$(echo "$(date +%s.%N) - $t0" | bc)" >> "$out/summary.tsv"
    if [ $rc -eq 0 ]; then pass=$((pass + 1)); rm -f "$out/$name.$i.log"; else fail=$((fail + 1)); fi
  done
  echo "$name mode=$mode pass=$pass fail=$fail"
done
[ "$mode" = quota ] && rmdir "$CG" 2>/dev/null
exit 0
