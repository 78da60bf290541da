#!/usr/bin/env bash
# The GPU check of issue 27 in under 8 minutes on one H100/H200, with no Rust and no network:
#   1. the CUDA parity suite (cuda_parity, cuda_exchange; cuda_parity includes issue 29's
#      graph-captured against eager decode, graph_captured_decode_gives_the_eager_tokens);
#   2. the cold-start tables, one server per policy (cached / on-demand / cpu-assist / auto):
#      a pass whose adapters start in host memory (CaraServe's setting), then one whose
#      adapters start on disk (page cache warm); TTFT, TPOT, done/failed, what a miss waited for
#      (split by reason from RUST_LOG=info,thaw::request=debug), assisted steps (the step log)
#      and rows (/metrics);
#   3. decode tok/s of the base model on a server started with default flags (the
#      --gpu-memory-utilization sizing) at batch 1, 8, 32 and 64.
# Every step's timeout comes out of one budget (THAW_GPU_BUDGET_S, 450 s on CUDA), so the
# script ends, tables printed, within it whatever hangs; a step with no time left is reported
# as skipped. Executables come from benches/gpu/build.sh (gpu-bin/, or its bin.tar.gz). Logs
# go under $OUT; the tables are printed and appended, with date and commit, to
# benches/results/cuda-h100.md (--results).
#
# The tiers: the servers read every --lora-dir adapter at start, warm the first --max-loras
# onto the device and keep the most recently read in the host tier up to --max-cpu-lora-bytes,
# which run.sh sizes to hold exactly one pass of adapters. So of 2 × REQS + MAX_LORAS adapters
# (in the server's order) the first MAX_LORAS start on the device (unused), the next REQS on
# disk and the last REQS in host memory: the host pass uses the last group, then the disk pass
# the middle one (--first-adapter), each request a distinct adapter.
#
#   benches/gpu/run.sh                      on the GPU machine
#   benches/gpu/run.sh --device cpu         a short smoke run of the same steps on the CPU
#                                           backend (tiny model; tables go to $OUT only)
#   benches/gpu/run.sh --kernels            also the SGMV/BGMV and attention tables of issue 29
#                                           (cuda_bench --smoke), if the budget has room
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
DEV=cuda
BIN=$root/gpu-bin
O=${OUT:-/tmp/out}
RESULTS=
WORK=${THAW_GPU_WORK:-/tmp/thaw-gpu-work}
KERNELS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEV=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --out) O=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    --workdir) WORK=$2; shift 2 ;;
    --kernels) KERNELS=1; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEV" in
  cuda)
    PRESET=llama-7b-shape RANK=64 REQS=32 RATE=2 PROMPT=128 OUTPUT=32 MAXLEN=1024
    # The small pool (--num-gpu-blocks-override, 8 MiB bf16 pages) holds a few adapters of
    # 128 MiB beside the KV; --max-loras caps those on the device anyway.
    POOL_SMALL=${THAW_GPU_POOL_SMALL:-400} POOL_BIG=4096 MAX_LORAS=8 WORKERS=4
    DECODE_OUT=128 LINK=()
    BUDGET_S=${THAW_GPU_BUDGET_S:-450}
    : "${RESULTS:=$root/benches/results/cuda-h100.md}"
    ;;
  cpu)
    # Pages of the tiny model are 4 KiB; a rank-16 q,k,v,o adapter takes 16. The small pool
    # holds one sequence of --max-model-len and about three adapters; the link is slow enough
    # that a copy costs more than a step.
    PRESET=tiny RANK=16 REQS=8 RATE=4 PROMPT=32 OUTPUT=8 MAXLEN=256
    POOL_SMALL=36 POOL_BIG=2000 MAX_LORAS=2 WORKERS=1
    DECODE_OUT=32 LINK=(--emulated-link-gbps 0.005)
    BUDGET_S=${THAW_GPU_BUDGET_S:-900}
    : "${RESULTS:=$O/results-cpu.md}"
    ;;
  *) echo "--device must be cuda or cpu" >&2; exit 2 ;;
esac
# A short lease (under 8 minutes) can narrow the run: THAW_GPU_POLICIES (comma list, in run
# order), THAW_GPU_REQS (requests per pass), THAW_GPU_DECODE_BATCHES (comma list),
# THAW_GPU_SKIP_PARITY=1, THAW_GPU_SKIP_29=1 (the issue-29 block at the end); and what the
# budget keeps back: THAW_GPU_POLICY_MIN_S (per policy, kept from parity: 60) and
# THAW_GPU_DECODE_RESERVE_S (the decode step: 75; about 45 does batches 1, 8 and 32).
POLICIES=(cached on-demand cpu-assist auto)
DECODE_BATCHES=(1 8 32 64)
[ -n "${THAW_GPU_POLICIES:-}" ] && IFS=, read -r -a POLICIES <<<"$THAW_GPU_POLICIES"
[ -n "${THAW_GPU_DECODE_BATCHES:-}" ] && IFS=, read -r -a DECODE_BATCHES <<<"$THAW_GPU_DECODE_BATCHES"
REQS=${THAW_GPU_REQS:-$REQS}
ADAPTERS=$((MAX_LORAS + 2 * REQS))
HOST_FIRST=$((MAX_LORAS + REQS))
DISK_FIRST=$MAX_LORAS
# Seconds kept for the decode step (server start + the bursts) and the tables.
DECODE_RESERVE=${THAW_GPU_DECODE_RESERVE_S:-75}
TAIL_RESERVE=10

mkdir -p "$O" "$WORK"
R=$O/runs
rm -rf "$R"
mkdir -p "$R"
if [ ! -x "$BIN/thaw" ] && [ -f "$BIN/bin.tar.gz" ]; then
  # build.sh packs the executables when loose they would pass the 64 MiB a lease carries.
  mkdir -p "$WORK/bin"
  tar xzf "$BIN/bin.tar.gz" -C "$WORK/bin" || { echo "unpacking $BIN/bin.tar.gz failed" >&2; exit 2; }
  cp "$BIN/BUILD" "$WORK/bin/" 2>/dev/null
  BIN=$WORK/bin
fi
chmod +x "$BIN"/* 2>/dev/null
for exe in thaw thaw-bench; do
  [ -x "$BIN/$exe" ] || { echo "$BIN/$exe is missing: run benches/gpu/build.sh first" >&2; exit 2; }
done
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export RUST_LOG=info,thaw::request=debug
t0=$(date +%s)
el() { echo "[+$(($(date +%s) - t0))s] $*"; }
now() { date +%s.%N; }
left() { echo $((BUDGET_S - ($(date +%s) - t0))); }
# cap WANT RESERVE: WANT seconds, or fewer so that RESERVE seconds of the budget stay (0: none)
cap() {
  local l=$(($(left) - $2))
  if [ "$l" -lt "$1" ]; then echo $((l > 0 ? l : 0)); else echo "$1"; fi
}
BUILD=$(tr '\n' ' ' <"$BIN/BUILD" 2>/dev/null || echo "commit unknown")
if [ "$DEV" = cuda ]; then
  GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)
else
  GPU="CPU backend, $(nproc) cores (emulated link ${LINK[1]} GB/s)"
fi
echo "device: $GPU"
echo "executables: $BUILD"

# --- model and adapters, generated while the parity suite runs (CPU work only) ------------
MD=$WORK/model-$PRESET
AD=$WORK/adapters-$PRESET-$ADAPTERS-r$RANK-bf16
gen() {
  if [ ! -f "$MD/config.json" ]; then
    "$BIN/thaw" gen-model --preset "$PRESET" --out "$MD" || return 1
  fi
  if [ "$(find "$AD" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l)" != "$ADAPTERS" ]; then
    rm -rf "$AD"
    # bf16 files: the host tier holds them as stored on both backends, so run.sh can size it.
    "$BIN/thaw" gen-adapters --model "$MD" --count "$ADAPTERS" --ranks "$RANK" \
      --targets q,k,v,o --dtype bf16 --out "$AD" || return 1
  fi
  # Into the page cache: the "disk" tier of the tables is a warm page cache.
  cat "$MD"/*.safetensors "$AD"/*/*.safetensors >/dev/null
}
el "generating $PRESET and $ADAPTERS rank-$RANK adapters into $WORK (in the background)"
gen >"$O/gen.log" 2>&1 &
GEN=$!

# --- 1. parity -----------------------------------------------------------------------------
el "parity"
if [ "${THAW_GPU_SKIP_PARITY:-0}" = 1 ]; then
  echo "skipped (THAW_GPU_SKIP_PARITY=1)"
elif [ "$DEV" = cuda ]; then
  # What the cold-start step needs at the least: a server start and two short passes each.
  cold_min=$((${#POLICIES[@]} * ${THAW_GPU_POLICY_MIN_S:-60}))
  for t in cuda_parity:120 cuda_exchange:45; do
    exe=${t%%:*}
    lim=$(cap "${t##*:}" $((cold_min + DECODE_RESERVE + TAIL_RESERVE)))
    if [ "$lim" -lt 10 ]; then
      echo "$exe: skipped, out of time (THAW_GPU_BUDGET_S=$BUDGET_S)"
    elif [ -x "$BIN/$exe" ]; then
      THAW_REQUIRE_GPU=1 THAW_TEST_WORKER=$BIN/thaw-test-worker \
        timeout "$lim" "$BIN/$exe" --test-threads=1 --nocapture \
        >"$O/parity-$exe.log" 2>&1
      echo "$exe: rc=$? (limit ${lim}s)"
      grep -E "^test |test result" "$O/parity-$exe.log" | tail -12
    else
      echo "$exe: missing from $BIN"
    fi
  done
else
  echo "skipped on the CPU backend (the parity suite compares CUDA with it)"
fi
wait "$GEN" || { el "generation failed:"; tail -20 "$O/gen.log"; exit 1; }
el "model and adapters ready"
# The host tier holds exactly one pass of adapters (REQS of the largest file, plus half of
# one: a file is its tensors plus a small header).
largest=$(find "$AD" -name '*.safetensors' -printf '%s\n' | sort -n | tail -1)
HOST_BYTES=$((REQS * largest + largest / 2))

# --- 2. cold start: one server per policy, a disk-tier pass then a host-tier pass ----------
port_of() { echo $((18600 + RANDOM % 2000)); }
metric() {  # metric URL NAME: the sample's value, 0 when absent
  curl -s "$1/metrics" | awk -v n="$2" '$1 == n { v = $2 } END { print v + 0 }'
}
pass() {  # pass POLICY NAME URL LOGFILE FIRST LIMIT: one measured pass of the workload
  local p=$1 name=$2 url=$3 log=$4 first=$5 lim=$6 d=$R/$1/$2
  mkdir -p "$d"
  wc -l <"$log" >"$d/log-from"
  metric "$url" thaw_cpu_assisted_rows_total >"$d/rows-before"
  now >"$d/t-start"
  timeout "$lim" "$BIN/thaw-bench" load --url "$url" --requests "$REQS" \
    --popularity distinct --first-adapter "$first" --rate "$RATE" --prompt-len "$PROMPT" \
    --output-len "$OUTPUT" --seed 7 --out "$d" --no-progress >"$d/load.out" 2>&1
  echo "  $name pass: rc=$? (limit ${lim}s, $(grep -cE '' "$d/load.out") lines in $d/load.out)"
  now >"$d/t-end"
  metric "$url" thaw_cpu_assisted_rows_total >"$d/rows-after"
  wc -l <"$log" >"$d/log-to"
}
policy_run() {  # policy_run POLICY SHARE: one server, both passes, within SHARE seconds
  local p=$1 share=$2 port url log start
  mkdir -p "$R/$p"
  port=$(port_of)
  url=http://127.0.0.1:$port
  log=$R/$p/serve.log
  local pool=$POOL_SMALL loras=$MAX_LORAS
  if [ "$p" = cached ]; then pool=$POOL_BIG loras=$ADAPTERS; fi
  start=$(date +%s)
  el "cold start: $p (--max-loras $loras, $pool pages, host tier $HOST_BYTES bytes, ${share}s)"
  timeout "$share" "$BIN/thaw" serve --device "$DEV" --model "$MD" \
    --lora-dir "$AD" --port "$port" --cold-start "$p" --max-loras "$loras" \
    --max-cpu-loras 64 --max-cpu-lora-bytes "$HOST_BYTES" --max-model-len "$MAXLEN" \
    --num-gpu-blocks-override "$pool" --lora-workers "$WORKERS" "${LINK[@]}" \
    --dump-cost-model "$R/$p/cost.json" >"$log" 2>&1 &
  local sp=$!
  # The server may take at most half the share to start; the passes split the rest.
  while [ $(($(date +%s) - start)) -lt $((share / 2)) ]; do
    curl -sf "$url/health" >/dev/null && break
    kill -0 $sp 2>/dev/null || break
    sleep 0.5
  done
  if ! curl -sf "$url/health" >/dev/null; then
    echo "  $p: the server did not start within $((share / 2))s; its log ends:"
    tail -15 "$log"
    kill -TERM $sp 2>/dev/null
    wait $sp 2>/dev/null
    return
  fi
  echo "  up after $(($(date +%s) - start))s"
  # The adapters warmed at start (--max-loras of them) reach the device before the passes
  # (at most 20 s), then two base-model requests, unmeasured: first-use costs (kernel
  # compilation, library initialisation, warm uploads) must not land in the first pass.
  # Each wait takes at most a quarter of what is left of the share (5 s kept for the server's
  # exit), so a server that starts late still ends within its share (benches/gpu/dryrun.py's
  # worst case); a pass with under 2 s left is skipped (`timeout 0` would set no limit).
  local warm=$((loras < ADAPTERS ? loras : ADAPTERS)) w0 rest wmax
  rest=$((share - ($(date +%s) - start) - 5))
  wmax=$((rest / 4 < 20 ? rest / 4 : 20))
  w0=$(date +%s)
  while [ $(($(date +%s) - w0)) -lt "$wmax" ]; do
    [ "$(metric "$url" 'thaw_adapters{tier="device"}' | cut -d. -f1)" -ge "$warm" ] && break
    sleep 0.5
  done
  echo "  $(metric "$url" 'thaw_adapters{tier="device"}') adapters on the device after $(($(date +%s) - w0))s"
  sleep 1
  rest=$((share - ($(date +%s) - start) - 5))
  wmax=$((rest / 4 < 20 ? rest / 4 : 20))
  if [ "$wmax" -ge 2 ]; then
    timeout "$wmax" "$BIN/thaw-bench" load --url "$url" --requests 2 --rate 1000 --popularity base \
      --prompt-len 16 --output-len 4 --seed 1 --out "$R/$p/warmup" --no-progress \
      >"$R/$p/warmup.out" 2>&1
  fi
  rest=$((share - ($(date +%s) - start) - 5))
  if [ $((rest / 2)) -ge 2 ]; then
    pass "$p" host "$url" "$log" "$HOST_FIRST" $((rest / 2))
  else
    echo "  host pass: skipped, out of the policy's ${share}s"
  fi
  rest=$((share - ($(date +%s) - start) - 5))
  if [ "$rest" -ge 2 ]; then
    pass "$p" disk "$url" "$log" "$DISK_FIRST" "$rest"
  else
    echo "  disk pass: skipped, out of the policy's ${share}s"
  fi
  kill -TERM $sp 2>/dev/null
  wait $sp 2>/dev/null
}
n=${#POLICIES[@]}
for p in "${POLICIES[@]}"; do
  share=$(( ($(left) - DECODE_RESERVE - TAIL_RESERVE) / n ))
  n=$((n - 1))
  if [ "$share" -lt 30 ]; then
    echo "  $p: skipped, out of time (THAW_GPU_BUDGET_S=$BUDGET_S)"
    continue
  fi
  policy_run "$p" "$share"
done

# --- 3. decode tok/s, on a server started with default flags --------------------------------
el "decode: thaw serve --device $DEV with default flags (--gpu-memory-utilization sizing)"
port=$(port_of)
url=http://127.0.0.1:$port
if [ "$DEV" = cuda ]; then pool_args=(); else pool_args=(--device-memory-bytes 67108864); fi
lim=$(cap "$DECODE_RESERVE" "$TAIL_RESERVE")
start=$(date +%s)
timeout "$lim" "$BIN/thaw" serve --device "$DEV" --model "$MD" --port "$port" \
  "${pool_args[@]}" >"$R/decode-serve.log" 2>&1 &
sp=$!
while [ $(($(date +%s) - start)) -lt $((lim * 2 / 3)) ]; do
  curl -sf "$url/health" >/dev/null && break
  kill -0 $sp 2>/dev/null || break
  sleep 0.5
done
if curl -sf "$url/health" >/dev/null; then
  echo "  up after $(($(date +%s) - start))s"
  grep -E "device budget|memory profile" "$R/decode-serve.log" | head -3
  for b in "${DECODE_BATCHES[@]}"; do
    rest=$((lim - ($(date +%s) - start) - 2))
    if [ "$rest" -lt 3 ]; then
      echo "  batch $b: skipped, out of time"
      continue
    fi
    mkdir -p "$R/decode-b$b"
    timeout "$rest" "$BIN/thaw-bench" load --url "$url" --requests "$b" --rate 100000 \
      --popularity base --prompt-len 16 --output-len "$DECODE_OUT" --seed "$b" \
      --out "$R/decode-b$b" --no-progress >"$R/decode-b$b/load.out" 2>&1
    echo "  batch $b: rc=$?"
  done
else
  echo "  the default-flags server did not start; its log ends:"
  tail -15 "$R/decode-serve.log"
fi
kill -TERM $sp 2>/dev/null
wait $sp 2>/dev/null

# --- 4. issue 29's kernel tables (new vs classic), only with time to spare ------------------
if [ "$KERNELS" = 1 ] && [ "$DEV" = cuda ]; then
  lim=$(cap 120 "$TAIL_RESERVE")
  if [ -x "$BIN/cuda_bench" ] && [ "$lim" -ge 30 ]; then
    el "kernels: cuda_bench --smoke (limit ${lim}s)"
    timeout "$lim" "$BIN/cuda_bench" --smoke >"$O/cuda_bench.log" 2>&1
    echo "cuda_bench: rc=$?"
    cat "$O/cuda_bench.log"
  else
    echo "kernels: skipped (cuda_bench missing or under 30 s left)"
  fi
fi

# --- tables ----------------------------------------------------------------------------------
el "tables"
python3 "$here/tables.py" "$R" --device "$GPU" --build "$BUILD" \
  --workload "$PRESET, $ADAPTERS bf16 adapters of rank $RANK (q,k,v,o), per pass $REQS requests with distinct adapters at $RATE req/s, prompt $PROMPT, output $OUTPUT, --max-model-len $MAXLEN, $WORKERS CPU LoRA workers, --max-loras $MAX_LORAS ($ADAPTERS for cached), pool $POOL_SMALL pages ($POOL_BIG for cached), host tier $HOST_BYTES bytes (one pass of adapters), budget ${BUDGET_S}s" \
  >"$O/tables.md"
cat "$O/tables.md"
cp "$O/tables.md" "$O/results-section.md"
{ echo; cat "$O/tables.md"; } >>"$RESULTS"
echo "appended to $RESULTS"
tar czf "$O/runs.tgz" -C "$O" runs 2>/dev/null
# === issue 29: GPU speed (thaw-bench gpu + the transformers peer) =========================
# One block, kept apart from the cold-start steps above: decode tok/s and achieved bandwidth
# at batch 1/8/32/64 with 0, 1 and N adapters (ranks 16, 64), the same decode rows again with
# CUDA graphs (--cuda-graphs: graph vs eager tok/s), prefill TFLOP/s, the SGMV/BGMV
# table, a per-op profile of decode steps at batch 1 and 32 and of 128- and 2048-token prefills (--op-profile), then the same model in transformers + PyTorch (eager: --eager, dynamic cache) when torch imports
# (THAW_PEER_PYTHON names its python; skipped with a note otherwise). Extra thaw-bench gpu
# flags: THAW_GPU_BENCH_ARGS (e.g. "--peak-gbs 2976 --peak-tflops 798").
if [ "${THAW_GPU_SKIP_29:-0}" = 1 ]; then
  el "issue 29 block skipped (THAW_GPU_SKIP_29=1); done (budget ${BUDGET_S}s)"
  exit 0
fi
el "issue 29: thaw-bench gpu on $MD"
# Both steps take what is left of the one budget (THAW_GPU_BUDGET_S): on a short lease, run
# this block on its own with a fresh budget in a second call.
if [ "$DEV" = cuda ]; then
  # The peer eager (no torch.compile per shape: batch 1/8/32/64 in about a minute).
  GB_ARGS=(--device cuda --cuda-graphs) PEER_ARGS=(--device cuda --eager --reps 2)
  GB_T=$(cap 240 60) PEER_T=$(cap 120 0)
else
  GB_ARGS=(--device cpu --quick --cuda-graphs) GB_T=$(cap 120 30) PEER_T=$(cap 300 0)
  # shellcheck disable=SC2054  # the commas are the peer's own list syntax
  PEER_ARGS=(--device cpu --eager --batches 1,4 --prompt-len 16 --decode-steps 2 --prefill-tokens 16,64 --reps 1)
fi
if [ "$GB_T" -gt 0 ]; then
  # shellcheck disable=SC2086
  timeout "$GB_T" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" "${GB_ARGS[@]}" \
    ${THAW_GPU_BENCH_ARGS:-} >"$O/gpu-bench.md" 2>"$O/gpu-bench.log"
  echo "thaw-bench gpu: rc=$?"
else
  echo "thaw-bench gpu: skipped, out of time (THAW_GPU_BUDGET_S=$BUDGET_S)" >"$O/gpu-bench.md"
fi
cat "$O/gpu-bench.md"
# Where a decode step's time goes, per op class (--op-profile: every backend op bracketed by
# CUDA events on the compute stream), at batch 1 and 32 with 0, 1 and 32 rank-16 adapters;
# the other tables of this call are cut to their smallest.
if [ "$DEV" = cuda ]; then
  # shellcheck disable=SC2054  # the commas are thaw-bench's own list syntax
  OP_ARGS=(--device cuda --batches 1,32 --ranks 16 --decode-steps 4 --op-profile-steps 4
    --prefill-tokens 128,2048 --reps 1 --lora-batches 1 --lora-ranks 16) OP_T=$(cap 120 0)
else
  OP_ARGS=(--device cpu --quick) OP_T=$(cap 60 0)
fi
if [ "$OP_T" -gt 0 ]; then
  el "issue 29: thaw-bench gpu --op-profile"
  timeout "$OP_T" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" "${OP_ARGS[@]}" \
    --op-profile >"$O/op-profile.md" 2>"$O/op-profile.log"
  echo "thaw-bench gpu --op-profile: rc=$?"
else
  echo "thaw-bench gpu --op-profile: skipped, out of time (THAW_GPU_BUDGET_S=$BUDGET_S)" >"$O/op-profile.md"
fi
# Only the op-profile tables (the rest repeats gpu-bench.md).
sed -n '/^### Op profile/,$p' "$O/op-profile.md" | sed '/^### Prefill/,$d' >"$O/op-profile-tables.md"
cat "$O/op-profile-tables.md"
PEER_PY=${THAW_PEER_PYTHON:-python3}
if [ "$PEER_T" -le 0 ]; then
  echo "transformers peer: skipped, out of time (THAW_GPU_BUDGET_S=$BUDGET_S)" | tee "$O/gpu-peer.md"
elif "$PEER_PY" -c 'import torch, transformers' 2>/dev/null; then
  el "issue 29: transformers peer"
  timeout "$PEER_T" "$PEER_PY" "$root/benches/peers/transformers_gpu.py" --model "$MD" \
    "${PEER_ARGS[@]}" >"$O/gpu-peer.md" 2>"$O/gpu-peer.log"
  echo "transformers peer: rc=$?"
  cat "$O/gpu-peer.md"
else
  echo "transformers peer skipped: $PEER_PY cannot import torch and transformers" \
    "(pip install torch transformers safetensors, or set THAW_PEER_PYTHON)" | tee "$O/gpu-peer.md"
fi
# Issue 29's kernels (flash-decoding, tensor-core prefill, Punica, fused, and the nine that
# became defaults after session 24: grouped products, RoPE folded into the KV write, wide norms,
# device argmax, GEMV, sliced LoRA, occupancy decode, cuBLASLt, 16-bit activations): parity
# with the defaults, the kernel tables, decode tok/s at a 2048-token context and prefill
# TFLOP/s with all thirteen off, then the nine off, then all on (benches/gpu/attn29.sh, which
# runs alone on a short lease).
A29_T=$(cap 300 0)
if [ "$DEV" = cuda ] && [ "$A29_T" -ge 30 ]; then
  el "issue 29: attention kernels (attn29.sh, budget ${A29_T}s)"
  "$here/attn29.sh" --bin "$BIN" --out "$O" --model "$MD" --workdir "$WORK" --budget "$A29_T" \
    >"$O/attn29.md" 2>&1
  cat "$O/attn29.md"
else
  echo "issue 29 attention kernels: skipped (CPU backend, or under 30 s left)" | tee "$O/attn29.md"
fi
{ echo; echo "## Issue 29: thaw-bench gpu and the transformers peer ($(date -u +%Y-%m-%d), $BUILD)";
  echo "Device: $GPU"; echo; cat "$O/gpu-bench.md"; echo; cat "$O/gpu-peer.md";
  echo; echo "### Op profile of decode steps (thaw-bench gpu --op-profile)"; cat "$O/op-profile-tables.md";
  echo; echo "### Attention kernels (attn29.sh)"; echo; cat "$O/attn29.md"; } >>"$RESULTS"
el "issue 29: appended to $RESULTS"
# === end issue 29 ============================================================================
el "done (budget ${BUDGET_S}s)"
