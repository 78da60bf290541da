#!/usr/bin/env bash
# One short GPU lease (15 minutes of device time, a machine start included): what the GPU
# issues (29 open, 27 blocked on a GPU) still need measured, in calls of one budget each
# (--budget), so a and b fit one lease with its start (1-2 minutes) and c where time is left:
#   --part a (default budget 380 s): step 1;   --part b (default 370 s): step 3;
#   --part c (default 300 s): step 2;   --part all (540 s): the three, 2 only where 150 s
#   are left for 3 after it.
# Executables from benches/gpu/build.sh (gpu-bin/, carried as `carry: ["gpu-bin"]`); logs and
# tables under --out ($OUT).
#   1. the CUDA parity suite, whole, with the defaults (all thirteen of issue 29's kernels; about
#      250 s on an H200 in session 24, with the nine below then off), then its opt_in tests with
#      the nine that became defaults after session 24 all off (OPT_OFF: THAW_CUDA_GROUP_GEMM,
#      THAW_CUDA_ROPE_FOLD, THAW_CUDA_WIDE_NORM, THAW_CUDA_DEVICE_ARGMAX, THAW_CUDA_GEMV,
#      THAW_CUDA_LORA_SLICES, THAW_CUDA_ATTN_OCCUPANCY, THAW_CUDA_CUBLASLT, THAW_CUDA_BF16_ACT
#      `=0`), so the paths they replace, which `0` still selects, keep being proven;
#   2. issue 27's cold-start tables (run.sh, cached / auto / on-demand, host tier then disk
#      tier, 16 requests a pass) and decode tok/s with default flags;
#   3. issue 29 (attn29.sh, its parity step skipped): the kernel tables (cuda_bench --attn,
#      --gemv, --lora-slices, --lt), the whole model with the nine off ("off9": the defaults
#      before session 24) against the defaults ("on") and against the defaults with the two
#      opt-in kernels on ("new": THAW_CUDA_PREFILL_FA, THAW_CUDA_LORA_SMALL) at a 128-token
#      context, the SGMV / BGMV table at batches 1/16/64 and ranks 16/64 with device times, the
#      op profile of decode and prefill ("on", "new"), and the transformers peer side by side
#      (with 300 s or more for the step).
# Steps with too little time left say "skipped". Every figure printed names its step's log.
#   benches/gpu/lease.sh --bin gpu-bin --out "$OUT" --part a    then    ... --part b   (then c)
# Before the lease, on the build machine (no GPU, seconds): the same with --dry-run (or
# THAW_GPU_DRY_RUN=1) runs benches/gpu/dryrun.py: every step with its executables, flags, test
# filters, THAW_CUDA_ switches and Python scripts checked, and its timeouts summed at worst.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
BIN=$root/gpu-bin
O=${OUT:-/tmp/out}
BUDGET_S=
PART=all
DRY=${THAW_GPU_DRY_RUN:-0}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --out) O=$2; shift 2 ;;
    --budget) BUDGET_S=$2; shift 2 ;;
    --part) PART=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -uo pipefail/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$DRY" = 1 ]; then
  exec python3 "$here/dryrun.py" --bin "$BIN" --out "$O" --part "$PART" ${BUDGET_S:+--budget "$BUDGET_S"}
fi
case "$PART" in
  a) : "${BUDGET_S:=380}" ;;
  b) : "${BUDGET_S:=370}" ;;
  c) : "${BUDGET_S:=300}" ;;
  all) : "${BUDGET_S:=540}" ;;
  *) echo "--part: a, b, c or all, not $PART" >&2; exit 2 ;;
esac
mkdir -p "$O"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }
el() { echo "[lease +$(($(date +%s) - t0))s] $*"; }
cat "$BIN/BUILD" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

OPT_OFF=(THAW_CUDA_GROUP_GEMM=0 THAW_CUDA_ROPE_FOLD=0 THAW_CUDA_WIDE_NORM=0 THAW_CUDA_DEVICE_ARGMAX=0
  THAW_CUDA_GEMV=0 THAW_CUDA_LORA_SLICES=0 THAW_CUDA_ATTN_OCCUPANCY=0
  THAW_CUDA_CUBLASLT=0 THAW_CUDA_BF16_ACT=0)

if [ "$PART" = a ] || [ "$PART" = all ]; then
# --- 1. parity ---------------------------------------------------------------------------------
# The tests no GPU has run yet (new kernels, tests changed since the last lease) first, so a
# limit cut falls on ones a GPU has passed; then the rest. Both with the defaults.
FIRST=(prefill_fa lora_small defaults host_overhead lt:: residual16:: gemv::)
SKIP=()
for f in "${FIRST[@]}"; do SKIP+=(--skip "$f"); done
lim=$(($(left) - 200 < 150 ? $(left) - 200 : 150))
el "cuda_parity, defaults, untried first: ${FIRST[*]} (limit ${lim}s)"
THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 --nocapture "${FIRST[@]}" \
  >"$O/lease-parity-first.log" 2>&1
echo "cuda_parity (defaults, untried first): rc=$?"
grep -E "^test .*(ok|FAILED|ignored)$|test result" "$O/lease-parity-first.log" | tail -30
lim=$(($(left) - 65 < 200 ? $(left) - 65 : 200))
el "cuda_parity, defaults, the rest (limit ${lim}s)"
THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 --nocapture "${SKIP[@]}" \
  >"$O/lease-parity.log" 2>&1
echo "cuda_parity (defaults, the rest): rc=$?"
grep -E "^test .*(ok|FAILED|ignored)$|test result" "$O/lease-parity.log" | tail -40
lim=$(($(left) < 60 ? $(left) : 60))
el "cuda_parity opt_in, the nine off: ${OPT_OFF[*]} (limit ${lim}s)"
env "${OPT_OFF[@]}" THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 \
  --nocapture opt_in >"$O/lease-parity-opt-in.log" 2>&1
echo "cuda_parity opt_in (the nine off): rc=$?"
grep -E "^test .*(ok|FAILED|ignored)$|test result" "$O/lease-parity-opt-in.log" | tail -20

fi
if [ "$PART" = c ] || [ "$PART" = all ]; then
# --- 2. issue 27 ----------------------------------------------------------------------------------
b=$(($(left) - 5))
[ "$PART" = all ] && b=$((b - 150))
if [ "$b" -ge 150 ]; then
  b=$((b < 295 ? b : 295))
  el "issue 27: run.sh cached,auto,on-demand (budget ${b}s)"
  THAW_GPU_BUDGET_S=$b THAW_GPU_REQS=16 THAW_GPU_SKIP_29=1 THAW_GPU_SKIP_PARITY=1 \
    THAW_GPU_POLICIES=cached,auto,on-demand THAW_GPU_POLICY_MIN_S=50 \
    THAW_GPU_DECODE_RESERVE_S=45 THAW_GPU_DECODE_BATCHES=1,8,32 \
    "$here/run.sh" --bin "$BIN" --out "$O/run27" --results "$O/results-27.md" \
    >"$O/lease-run27.log" 2>&1
  echo "run.sh: rc=$?"
  grep -E "^\|" "$O/lease-run27.log" | tail -30
else
  echo "issue 27's run.sh: skipped, $(left) s left"
fi

fi
if [ "$PART" = b ] || [ "$PART" = all ]; then
# --- 3. issue 29 ----------------------------------------------------------------------------------
b=$(($(left) - 5))
if [ "$b" -ge 90 ]; then
  el "issue 29: attn29.sh off9 vs on vs new, op profile (budget ${b}s)"
  THAW_GPU_29_MODES="off9 on new" THAW_GPU_29_OP_S=60 THAW_GPU_29_SKIP_PARITY=1 \
    THAW_GPU_29_PEER_S=$((b >= 300 ? 100 : 0)) \
    "$here/attn29.sh" --bin "$BIN" --out "$O/attn29" --budget "$b" --prompt-len 128 \
    >"$O/lease-attn29.log" 2>&1
  echo "attn29.sh: rc=$?"
  grep -E "^\||^#" "$O/lease-attn29.log" | tail -60
else
  echo "issue 29's attn29.sh: skipped, $(left) s left"
fi
fi
el "done"
