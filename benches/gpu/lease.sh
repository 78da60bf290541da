#!/usr/bin/env bash
# One short GPU lease (15 minutes of device time, a machine start included): what the open GPU
# issues (27, 29) still need measured, in two calls of one budget each (--budget), so both fit:
#   --part a (default budget 360 s): steps 1 and 2;   --part b (default 400 s): step 3;
#   --part all (540 s): the three in one call, step 3 then gets what is left.
# Executables from benches/gpu/build.sh (gpu-bin/, carried as `carry: ["gpu-bin"]`); logs and
# tables under --out ($OUT).
#   1. the CUDA parity suite, whole, with the defaults, then its opt-in tests with every opt-in
#      switch on (issue 29's kernels that are not defaults yet: THAW_CUDA_GROUP_GEMM,
#      THAW_CUDA_ROPE_FOLD, THAW_CUDA_WIDE_NORM, THAW_CUDA_DEVICE_ARGMAX, THAW_CUDA_GEMV,
#      THAW_CUDA_LORA_SLICES, THAW_CUDA_ATTN_OCCUPANCY, THAW_CUDA_CUBLASLT, THAW_CUDA_BF16_ACT,
#      THAW_CUDA_PREFILL_FA);
#   2. issue 27's cold-start tables (run.sh, cached / auto / on-demand, host tier then disk
#      tier, 16 requests a pass) and decode tok/s with default flags;
#   3. issue 29 (attn29.sh, its parity step skipped): the kernel tables (cuda_bench --attn,
#      --gemv, --lora-slices, --lt), the whole model with the defaults ("on") against every opt-in
#      switch ("opt-in") at a 128-token context, the op profile of decode and prefill, and the
#      transformers peer side by side (with 300 s or more for the step).
# Steps with too little time left say "skipped". Every figure printed names its step's log.
#   benches/gpu/lease.sh --bin gpu-bin --out "$OUT" --part a    then    ... --part b
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
  a) : "${BUDGET_S:=360}" ;;
  b) : "${BUDGET_S:=400}" ;;
  all) : "${BUDGET_S:=540}" ;;
  *) echo "--part: a, b or all, not $PART" >&2; exit 2 ;;
esac
mkdir -p "$O"
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }
el() { echo "[lease +$(($(date +%s) - t0))s] $*"; }
cat "$BIN/BUILD" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

OPT_ON=(THAW_CUDA_GROUP_GEMM=1 THAW_CUDA_ROPE_FOLD=1 THAW_CUDA_WIDE_NORM=1 THAW_CUDA_DEVICE_ARGMAX=1
  THAW_CUDA_GEMV=1 THAW_CUDA_LORA_SLICES=1 THAW_CUDA_ATTN_OCCUPANCY=1
  THAW_CUDA_CUBLASLT=1 THAW_CUDA_BF16_ACT=1 THAW_CUDA_PREFILL_FA=1)

if [ "$PART" != b ]; then
# --- 1. parity ---------------------------------------------------------------------------------
lim=$(($(left) < 120 ? $(left) : 120))
el "cuda_parity, defaults (limit ${lim}s)"
THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 --nocapture \
  >"$O/lease-parity.log" 2>&1
echo "cuda_parity (defaults): rc=$?"
grep -E "^test .*(ok|FAILED|ignored)$|test result" "$O/lease-parity.log" | tail -40
lim=$(($(left) < 60 ? $(left) : 60))
el "cuda_parity opt_in, every opt-in switch on: ${OPT_ON[*]} (limit ${lim}s)"
env "${OPT_ON[@]}" THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 \
  --nocapture opt_in >"$O/lease-parity-opt-in.log" 2>&1
echo "cuda_parity opt_in (opt-in switches on): rc=$?"
grep -E "^test .*(ok|FAILED|ignored)$|test result" "$O/lease-parity-opt-in.log" | tail -20

# --- 2. issue 27 ----------------------------------------------------------------------------------
b=$(($(left) - 5))
[ "$PART" = all ] && b=$((b - 150))
if [ "$b" -ge 150 ]; then
  b=$((b < 260 ? b : 260))
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
[ "$PART" = a ] && { el "done (part a)"; exit 0; }
# --- 3. issue 29 ----------------------------------------------------------------------------------
b=$(($(left) - 5))
if [ "$b" -ge 90 ]; then
  el "issue 29: attn29.sh on vs opt-in, op profile (budget ${b}s)"
  THAW_GPU_29_MODES="on opt-in" THAW_GPU_29_OP_S=60 THAW_GPU_29_SKIP_PARITY=1 \
    THAW_GPU_29_PEER_S=$((b >= 300 ? 100 : 0)) \
    "$here/attn29.sh" --bin "$BIN" --out "$O/attn29" --budget "$b" --prompt-len 128 \
    >"$O/lease-attn29.log" 2>&1
  echo "attn29.sh: rc=$?"
  grep -E "^\||^#" "$O/lease-attn29.log" | tail -60
else
  echo "issue 29's attn29.sh: skipped, $(left) s left"
fi
el "done"
