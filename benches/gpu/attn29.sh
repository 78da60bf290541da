#!/usr/bin/env bash
# Issue 29's kernels on the GPU machine, within one budget (--budget, default 300 s), each
# step's timeout taken from what is left of it. All thirteen of issue 29's kernels are the CUDA
# backend's defaults: flash-decoding, the tensor-core prefill, Punica's SGMV / BGMV and the fused
# kernels, and since session 24's H200 run the nine that were opt-in (grouped products, RoPE
# folded into the KV write, wide norms, device argmax, the small-batch GEMV, sliced LoRA, the
# occupancy decode, cuBLASLt, 16-bit activations); OFF below turns all thirteen off, OFF9 the
# nine only (the defaults before session 24).
#   1. the CUDA parity suite with the defaults (the thirteen variables set empty, whatever the
#      caller's environment: the new kernels wherever they serve a backend, the classic ones
#      where not, e.g. the tensor-core prefill for an f32 cache), against the CPU oracle; its
#      tests of the classic kernels set them explicitly, and its attn29 tests compare engine
#      steps with greedy tokens identical to the classic kernels';
#   2. cuda_bench --attn: one layer's decode attention (classic vs flash-decoding, context
#      512/2048/8192, batch 1/8/32) and prefill attention TFLOP/s (classic vs tensor cores vs
#      the opt-in FA kernel, THAW_CUDA_PREFILL_FA, with two and with one query head a block; 128,
#      512 and 2048 tokens, and 2048 after a 2048 prefix); then cuda_bench --gemv: products of
#      1-8 rows, cast + cuBLAS vs the small-batch GEMV (THAW_CUDA_GEMV); then
#      cuda_bench --lora-slices: q/k/v and gate/up LoRA per module vs one launch pair per
#      group (THAW_CUDA_LORA_SLICES); then cuda_bench --lt: cublasGemmEx vs cuBLASLt products
#      (THAW_CUDA_CUBLASLT, bias epilogue) at rows 1/8/32/128/2048 on Llama-7B's shapes; then
#      cuda_bench --act16: the MLP block (gate/up, SwiGLU, down) with f32 against 16-bit
#      activations (THAW_CUDA_BF16_ACT);
#   3. thaw-bench gpu on the whole model, off (OFF: all thirteen classic) then off9 (OFF9: the
#      four on, the nine off, OPT_OFF below: the defaults before session 24) then on (ON: all
#      thirteen asked for explicitly, so a shape they cannot serve is an error, not a silent
#      fallback; off9 vs on measures exactly the nine) then new (ON plus the two kernels still
#      opt-in, THAW_CUDA_PREFILL_FA and THAW_CUDA_LORA_SMALL: on vs new measures exactly them):
#      decode tokens/s at a long context (--prompt-len, default 2048) at batch 1 and 8 (and
#      32, eager and CUDA graphs, in "on" and "new": ROWS_ON below), prefill TFLOP/s at 128
#      and 2048 tokens, and the SGMV / BGMV table: batch 1, rank 16 in "off" and
#      "off9"; batches 1/16/64, ranks 16/64 in "on" and "new" (LORA_ON below: issue 29's
#      bandwidth goal is about batch >= 16; each row has its wall clock and its device time;
#      "new" adds the one-launch rows). THAW_GPU_29_MODES picks the runs (default
#      "off off9 on new"; e.g. "on new" on a short lease); they share what is left. The parity
#      suite of step 1 runs these kernels' own tests (cuda_parity's opt_in::*, prefill_fa::*,
#      lora_small::*, which switch them on and off explicitly) whatever the variables say.
#   4. where each op's time goes at batch 1 (thaw-bench gpu --op-profile, 0 and 1 rank-16
#      adapters, and prefill of 128 and 2048 tokens), "on" then "new": where the FA prefill
#      and the one-launch LoRA move the step's time. THAW_GPU_29_OP_S seconds are kept for it out of step 3's share (default
#      60; 0 skips it). The profile times a q/k/v or gate/up group module by module, so step 3's
#      decode tok/s, not this table, measures the grouped products.
#   5. the transformers + PyTorch peer on the same model (benches/peers/transformers_gpu.py,
#      static KV cache, uncompiled) beside thaw-bench gpu with the default kernels: decode tok/s
#      at batch 1/8/32 and prefill ms at 128 and 2048 tokens, side by side (peer29.py).
#      THAW_GPU_29_PEER_S seconds are kept for it out of steps 3 and 4 (default 120; 0 skips).
# run.sh's issue-29 block calls it with what is left of its budget; on a short lease run it alone
# (it generates the model when --model is not given):
#   benches/gpu/attn29.sh --bin gpu-bin --out "$OUT" [--model DIR] [--budget S] [--prompt-len N]
# THAW_GPU_29_SKIP_PARITY=1 skips step 1 (a caller that ran the suite already: lease.sh).
# THAW_GPU_ON_EXTRA overrides some of ON in the "on" run (see ON below).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
BIN=$root/gpu-bin
O=${OUT:-/tmp/out}
WORK=${THAW_GPU_WORK:-/tmp/thaw-gpu-work}
MD=
BUDGET_S=300
PROMPT=2048
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --out) O=$2; shift 2 ;;
    --model) MD=$2; shift 2 ;;
    --workdir) WORK=$2; shift 2 ;;
    --budget) BUDGET_S=$2; shift 2 ;;
    --prompt-len) PROMPT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo pipefail/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$O" "$WORK"
if [ ! -x "$BIN/thaw-bench" ] && [ -f "$BIN/bin.tar.gz" ]; then
  mkdir -p "$WORK/bin"
  tar xzf "$BIN/bin.tar.gz" -C "$WORK/bin" || { echo "unpacking $BIN/bin.tar.gz failed" >&2; exit 2; }
  BIN=$WORK/bin
fi
chmod +x "$BIN"/* 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
el() { echo "[attn29 +$(($(date +%s) - t0))s] $*"; }
# cap WANT: WANT seconds, or what is left of the budget if less (0: none)
cap() {
  local l=$((BUDGET_S - ($(date +%s) - t0)))
  if [ "$l" -lt "$1" ]; then echo $((l > 0 ? l : 0)); else echo "$1"; fi
}
# The fifteen switches: empty = the defaults (every new kernel where it serves, the two opt-in
# ones off), OFF = the classic kernels, ON = the thirteen defaults asked for explicitly and the
# two opt-in off, OFF9 = the four on and the nine off, NEW = all fifteen on.
# Set on every run, so the caller's environment cannot leak into one.
OPT_OFF=(THAW_CUDA_GROUP_GEMM=0 THAW_CUDA_ROPE_FOLD=0 THAW_CUDA_WIDE_NORM=0 THAW_CUDA_GEMV=0
  THAW_CUDA_DEVICE_ARGMAX=0 THAW_CUDA_LORA_SLICES=0 THAW_CUDA_ATTN_OCCUPANCY=0
  THAW_CUDA_CUBLASLT=0 THAW_CUDA_BF16_ACT=0)
OPT_ON=(THAW_CUDA_GROUP_GEMM=1 THAW_CUDA_ROPE_FOLD=1 THAW_CUDA_WIDE_NORM=1 THAW_CUDA_GEMV=1
  THAW_CUDA_DEVICE_ARGMAX=1 THAW_CUDA_LORA_SLICES=1 THAW_CUDA_ATTN_OCCUPANCY=1
  THAW_CUDA_CUBLASLT=1 THAW_CUDA_BF16_ACT=1)
# The two kernels still opt-in (off unless 1): off in every run but "new".
NEW_OFF=(THAW_CUDA_PREFILL_FA=0 THAW_CUDA_LORA_SMALL=0)
NEW_ON=(THAW_CUDA_PREFILL_FA=1 THAW_CUDA_LORA_SMALL=1)
# The SGMV / BGMV table of step 3: batch 1 and rank 16 in "off" and "off9"; in "on" and "new"
# also the batches and ranks issue 29's bandwidth goal is about (batch >= 16).
LORA_OFF=(--lora-batches 1 --lora-ranks 16)
LORA_ON=(--lora-batches 1,16,64 --lora-ranks 16,64)
# The decode rows: batches 1 and 8, eager, in "off" and "off9"; in "on" and "new" also batch 32
# (issue 29's goal: 32 distinct rank-16 adapters at >= 90% of the base model's tokens/s) and
# every row again as CUDA graphs (`thaw serve --cuda-graphs`), where the host's launches leave.
ROWS_OFF=(--batches 1,8)
ROWS_ON=(--batches 1,8,32 --cuda-graphs)
DEFAULTS=(THAW_CUDA_ATTN_IMPL= THAW_CUDA_TC_PREFILL= THAW_CUDA_LORA_IMPL= THAW_CUDA_FUSED=
  THAW_CUDA_GROUP_GEMM= THAW_CUDA_ROPE_FOLD= THAW_CUDA_WIDE_NORM= THAW_CUDA_GEMV=
  THAW_CUDA_DEVICE_ARGMAX= THAW_CUDA_LORA_SLICES= THAW_CUDA_ATTN_OCCUPANCY=
  THAW_CUDA_CUBLASLT= THAW_CUDA_BF16_ACT= THAW_CUDA_PREFILL_FA= THAW_CUDA_LORA_SMALL=)
OFF=(THAW_CUDA_ATTN_IMPL=classic THAW_CUDA_TC_PREFILL=0 THAW_CUDA_LORA_IMPL=classic THAW_CUDA_FUSED=0
  "${OPT_OFF[@]}" "${NEW_OFF[@]}")
FOUR_ON=(THAW_CUDA_ATTN_IMPL=split THAW_CUDA_TC_PREFILL=1 THAW_CUDA_LORA_IMPL=punica THAW_CUDA_FUSED=1)
OFF9=("${FOUR_ON[@]}" "${OPT_OFF[@]}" "${NEW_OFF[@]}")
ON=("${FOUR_ON[@]}" "${OPT_ON[@]}" "${NEW_OFF[@]}")
NEW=("${FOUR_ON[@]}" "${OPT_ON[@]}" "${NEW_ON[@]}")
read -r -a MODES <<<"${THAW_GPU_29_MODES:-off off9 on new}"
# Overrides for the "on" run, later words win, e.g. THAW_GPU_ON_EXTRA="THAW_CUDA_GEMV=0".
# shellcheck disable=SC2206  # VAR=value words, split on purpose
[ -n "${THAW_GPU_ON_EXTRA:-}" ] && ON+=(${THAW_GPU_ON_EXTRA})

# --- 1. parity with the defaults --------------------------------------------------------------
lim=$(cap 120)
if [ "${THAW_GPU_29_SKIP_PARITY:-0}" = 1 ]; then
  echo "cuda_parity: skipped (THAW_GPU_29_SKIP_PARITY=1: the caller ran it)"
elif [ ! -x "$BIN/cuda_parity" ]; then
  echo "cuda_parity: missing from $BIN (benches/gpu/build.sh ships it)"
elif [ "$lim" -lt 20 ]; then
  echo "cuda_parity: skipped, out of time (budget ${BUDGET_S}s)"
else
  el "cuda_parity with the default kernels (limit ${lim}s)"
  env "${DEFAULTS[@]}" THAW_REQUIRE_GPU=1 timeout "$lim" "$BIN/cuda_parity" --test-threads=1 \
    --nocapture >"$O/attn29-parity.log" 2>&1
  echo "cuda_parity (the default kernels): rc=$? (limit ${lim}s)"
  grep -E "^test |test result|^attention|^tc prefill|^engine split|head_dim" \
    "$O/attn29-parity.log" | tail -60
fi

# --- 2. kernel tables ------------------------------------------------------------------------
# One cuda_bench table: `table FLAG FILE SHARE MIN` runs cuda_bench FLAG into $O/attn29-FILE.md
# within cap(SHARE) seconds, skipped where cuda_bench is missing or under MIN seconds are left.
table() {
  local lim
  lim=$(cap "$3")
  if [ -x "$BIN/cuda_bench" ] && [ "$lim" -ge "$4" ]; then
    el "cuda_bench $1 (limit ${lim}s)"
    env "${DEFAULTS[@]}" timeout "$lim" "$BIN/cuda_bench" "$1" >"$O/attn29-$2.md" 2>&1
    echo "cuda_bench $1: rc=$?"
    cat "$O/attn29-$2.md"
  else
    echo "cuda_bench $1: skipped (missing or under $4 s left)"
  fi
}
table --attn kernels 60 15
table --gemv gemv 30 10
table --act16 act16 30 10
table --lora-slices lora-slices 30 10
table --lt lt 40 10

# --- 3. the whole model, off then on ---------------------------------------------------------
if [ -z "$MD" ]; then
  MD=$WORK/model-llama-7b-shape
  if [ ! -f "$MD/config.json" ]; then
    el "generating llama-7b-shape into $MD"
    "$BIN/thaw" gen-model --preset llama-7b-shape --out "$MD" >"$O/attn29-gen.log" 2>&1 ||
      { echo "gen-model failed:"; tail -5 "$O/attn29-gen.log"; exit 1; }
  fi
fi
# The runs share what is left but step 4's reserve, evenly; all or none (one alone compares
# nothing).
OP_S=${THAW_GPU_29_OP_S:-60}
PEER_S=${THAW_GPU_29_PEER_S:-120}
PEER_PY=${THAW_PEER_PYTHON:-python3}
# No time kept for a peer that cannot run (step 5 says why).
"$PEER_PY" -c 'import torch, transformers' 2>/dev/null || PEER_OK=0
[ "${PEER_OK:-1}" = 1 ] || PEER_S=0
each=$(( (BUDGET_S - ($(date +%s) - t0) - OP_S - PEER_S) / ${#MODES[@]} ))
if [ ! -x "$BIN/thaw-bench" ]; then
  echo "thaw-bench gpu: missing from $BIN (benches/gpu/build.sh ships it)"
elif [ "$each" -lt 30 ]; then
  echo "thaw-bench gpu ${MODES[*]}: skipped, under ${#MODES[@]} × 30 s left (budget ${BUDGET_S}s)"
else
  for mode in "${MODES[@]}"; do
    case "$mode" in
      off) envs=("${OFF[@]}"); lora=("${LORA_OFF[@]}"); rows=("${ROWS_OFF[@]}") ;;
      off9) envs=("${OFF9[@]}"); lora=("${LORA_OFF[@]}"); rows=("${ROWS_OFF[@]}") ;;
      on) envs=("${ON[@]}"); lora=("${LORA_ON[@]}"); rows=("${ROWS_ON[@]}") ;;
      new) envs=("${NEW[@]}"); lora=("${LORA_ON[@]}"); rows=("${ROWS_ON[@]}") ;;
      *) echo "THAW_GPU_29_MODES: unknown run $mode (off, off9, on, new)"; continue ;;
    esac
    el "thaw-bench gpu, issue 29's kernels $mode: ${envs[*]} (limit ${each}s)"
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout "$each" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" \
      --device cuda "${rows[@]}" --ranks 16 --prompt-len "$PROMPT" --decode-steps 16 \
      --prefill-tokens 128,2048 --reps 2 "${lora[@]}" \
      ${THAW_GPU_BENCH_ARGS:-} >"$O/attn29-gpu-$mode.md" 2>"$O/attn29-gpu-$mode.log"
    echo "thaw-bench gpu ($mode): rc=$?"
    echo "### Issue 29's kernels $mode (${envs[*]}), decode after a $PROMPT-token prompt"
    cat "$O/attn29-gpu-$mode.md"
  done
fi

# --- 4. per-op profile at batch 1, on then new (the FA prefill's share of a prefill step) ------
op_each=$(( (BUDGET_S - ($(date +%s) - t0) - PEER_S) / 2 ))
if [ "$OP_S" -le 0 ] || [ ! -x "$BIN/thaw-bench" ]; then
  echo "op profile on/new: skipped (THAW_GPU_29_OP_S=$OP_S, or thaw-bench missing)"
elif [ "$op_each" -lt 20 ]; then
  echo "op profile on/new: skipped, under 2 × 20 s left (budget ${BUDGET_S}s)"
else
  for mode in on new; do
    if [ "$mode" = new ]; then envs=("${NEW[@]}"); else envs=("${ON[@]}"); fi
    el "thaw-bench gpu --op-profile, $mode (limit ${op_each}s)"
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout "$op_each" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" \
      --device cuda --batches 1 --ranks 16 --decode-steps 4 --op-profile --op-profile-steps 4 \
      --prefill-tokens 128,2048 --reps 1 --lora-batches 1 --lora-ranks 16 ${THAW_GPU_BENCH_ARGS:-} \
      >"$O/attn29-op-$mode.md" 2>"$O/attn29-op-$mode.log"
    echo "thaw-bench gpu --op-profile ($mode): rc=$?"
    echo "### Op profile, issue 29's kernels $mode (${envs[*]})"
    sed -n '/^### Op profile/,$p' "$O/attn29-op-$mode.md" | sed '/^### Prefill/,$d'
  done
fi

# --- 5. the transformers peer, side by side ----------------------------------------------------
# thaw-bench gpu with the default kernels, then benches/peers/transformers_gpu.py on the same
# model (static KV cache, uncompiled: no torch.compile per shape), decode at batch 1/8/32 after a
# $PROMPT-token prompt and prefill of 128 and 2048 tokens; then peer29.py's side-by-side table.
# What is left of the budget, 40% to thaw (model upload, 3 batches × 3 adapter mixes), 60% to
# the peer (model load, static-cache generate). THAW_GPU_29_PEER_S=0 skips it; THAW_PEER_PYTHON
# names the python with torch + transformers (default python3); THAW_PEER_CACHE=dynamic for a
# transformers without GenerationConfig.disable_compile.
peer_left=$((BUDGET_S - ($(date +%s) - t0)))
if [ "${PEER_OK:-1}" != 1 ]; then
  echo "transformers peer: skipped, $PEER_PY cannot import torch and transformers" \
    "(pip install torch transformers safetensors, or set THAW_PEER_PYTHON)"
elif [ "$PEER_S" -le 0 ]; then
  echo "transformers peer: skipped (THAW_GPU_29_PEER_S=0)"
elif [ "$peer_left" -lt 60 ] || [ ! -x "$BIN/thaw-bench" ]; then
  echo "transformers peer: skipped, under 60 s left (budget ${BUDGET_S}s), or thaw-bench missing"
else
  thaw_t=$((peer_left * 2 / 5))
  el "peer step: thaw-bench gpu, default kernels, batches 1,8,32 (limit ${thaw_t}s)"
  env "${DEFAULTS[@]}" timeout "$thaw_t" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" \
    --device cuda --batches 1,8,32 --ranks 16 --prompt-len "$PROMPT" --decode-steps 16 \
    --prefill-tokens 128,2048 --reps 2 --lora-batches 1 --lora-ranks 16 \
    >"$O/attn29-peer-thaw.md" 2>"$O/attn29-peer-thaw.log"
  rc=$?
  echo "thaw-bench gpu (peer step, default kernels): rc=$rc"
  [ "$rc" = 0 ] || grep -E "^Error|error" "$O/attn29-peer-thaw.log" | head -3
  peer_t=$(cap 600)
  if [ "$peer_t" -lt 30 ]; then
    echo "transformers peer: skipped, under 30 s left (budget ${BUDGET_S}s)"
  else
    el "peer step: transformers_gpu.py, static cache, eager (limit ${peer_t}s)"
    timeout "$peer_t" "$PEER_PY" -u "$root/benches/peers/transformers_gpu.py" --model "$MD" \
      --device cuda --eager --cache "${THAW_PEER_CACHE:-static}" --batches 1,8,32 \
      --prompt-len "$PROMPT" --decode-steps 16 --prefill-tokens 128,2048 --reps 2 \
      >"$O/attn29-peer.md" 2>"$O/attn29-peer.log"
    rc=$?
    echo "transformers peer (cache ${THAW_PEER_CACHE:-static}): rc=$rc (a timeout leaves the rows it printed)"
    tail -3 "$O/attn29-peer.log"
    # A transformers too old to run a static cache uncompiled says so: the dynamic cache then.
    peer_t=$(cap 600)
    if [ "$rc" != 0 ] && grep -q disable_compile "$O/attn29-peer.log" && [ "$peer_t" -ge 30 ]; then
      el "peer step: transformers_gpu.py, dynamic cache, eager (limit ${peer_t}s)"
      timeout "$peer_t" "$PEER_PY" -u "$root/benches/peers/transformers_gpu.py" --model "$MD" \
        --device cuda --eager --cache dynamic --batches 1,8,32 --prompt-len "$PROMPT" \
        --decode-steps 16 --prefill-tokens 128,2048 --reps 2 \
        >"$O/attn29-peer.md" 2>"$O/attn29-peer.log"
      echo "transformers peer (cache dynamic): rc=$?"
    fi
  fi
  cat "$O/attn29-peer.md" 2>/dev/null
  python3 "$here/peer29.py" --thaw "$O/attn29-peer-thaw.md" --peer "$O/attn29-peer.md"
fi
el "done (budget ${BUDGET_S}s)"
