#!/usr/bin/env bash
# The GPU check of issue 27 in under 8 minutes on one H100/H200, with no Rust and no network:
#   1. the CUDA parity suite (cuda_parity, cuda_exchange);
#   2. the cold-start tables: adapters start on disk (page cache), then in host memory
#      (CaraServe's setting); policies cached / on-demand / cpu-assist / auto, one server each;
#      TTFT, TPOT, done/failed, what a miss waited for (split by reason from
#      RUST_LOG=info,thaw::request=debug), assisted steps (the step log) and rows (/metrics);
#   3. decode tok/s of the base model on a server started with default flags (the
#      --gpu-memory-utilization sizing), one stream and a batch.
# Executables come from benches/gpu/build.sh (gpu-bin/). Logs go under $OUT; the tables are
# printed and appended, with date and commit, to benches/results/cuda-h100.md (--results).
#
#   benches/gpu/run.sh                      on the GPU machine
#   benches/gpu/run.sh --device cpu         a short smoke run of the same steps on the CPU
#                                           backend (tiny model; tables go to $OUT only)
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
DEV=cuda
BIN=$root/gpu-bin
O=${OUT:-/tmp/out}
RESULTS=
WORK=${THAW_GPU_WORK:-/tmp/thaw-gpu-work}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEV=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --out) O=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    --workdir) WORK=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEV" in
  cuda)
    PRESET=llama-7b-shape ADAPTERS=36 RANK=64 REQS=32 RATE=2 PROMPT=128 OUTPUT=32 MAXLEN=1024
    # The small pool (--num-gpu-blocks-override) must hold fewer adapters than a pass uses,
    # so the second pass misses the device; its misses column says whether it did
    # (THAW_GPU_POOL_SMALL overrides).
    POOL_SMALL=${THAW_GPU_POOL_SMALL:-400} POOL_BIG=4096 MAX_LORAS=8 WORKERS=4 START_S=150 PASS_S=90
    DECODE_OUT=128 BATCH=32 LINK=()
    : "${RESULTS:=$root/benches/results/cuda-h100.md}"
    ;;
  cpu)
    # Pages of the tiny model are 4 KiB; a rank-16 q,k,v,o adapter takes 16. The small pool
    # holds one sequence of --max-model-len and about three adapters; the link is slow enough
    # that a copy costs more than a step.
    PRESET=tiny ADAPTERS=12 RANK=16 REQS=8 RATE=4 PROMPT=32 OUTPUT=8 MAXLEN=256
    POOL_SMALL=36 POOL_BIG=2000 MAX_LORAS=2 WORKERS=1 START_S=60 PASS_S=60
    DECODE_OUT=32 BATCH=8 LINK=(--emulated-link-gbps 0.005)
    : "${RESULTS:=$O/results-cpu.md}"
    ;;
  *) echo "--device must be cuda or cpu" >&2; exit 2 ;;
esac

mkdir -p "$O" "$WORK"
R=$O/runs
rm -rf "$R"
mkdir -p "$R"
chmod +x "$BIN"/* 2>/dev/null
for exe in thaw thaw-bench; do
  [ -x "$BIN/$exe" ] || { echo "$BIN/$exe is missing: run benches/gpu/build.sh first" >&2; exit 2; }
done
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export RUST_LOG=info,thaw::request=debug
t0=$(date +%s)
el() { echo "[+$(($(date +%s) - t0))s] $*"; }
now() { date +%s.%N; }
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
AD=$WORK/adapters-$PRESET-$ADAPTERS-r$RANK
gen() {
  if [ ! -f "$MD/config.json" ]; then
    "$BIN/thaw" gen-model --preset "$PRESET" --out "$MD" || return 1
  fi
  if [ "$(find "$AD" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l)" != "$ADAPTERS" ]; then
    rm -rf "$AD"
    "$BIN/thaw" gen-adapters --model "$MD" --count "$ADAPTERS" --ranks "$RANK" \
      --targets q,k,v,o --out "$AD" || return 1
  fi
  # Into the page cache: the "disk" tier of the tables is a warm page cache.
  cat "$MD"/*.safetensors "$AD"/*/*.safetensors >/dev/null
}
el "generating $PRESET and $ADAPTERS rank-$RANK adapters into $WORK (in the background)"
gen >"$O/gen.log" 2>&1 &
GEN=$!

# --- 1. parity -----------------------------------------------------------------------------
el "parity"
if [ "$DEV" = cuda ]; then
  for t in cuda_parity:120 cuda_exchange:45; do
    exe=${t%%:*}
    if [ -x "$BIN/$exe" ]; then
      THAW_REQUIRE_GPU=1 timeout "${t##*:}" "$BIN/$exe" --test-threads=1 --nocapture \
        >"$O/parity-$exe.log" 2>&1
      echo "$exe: rc=$?"
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

# --- 2. cold start: one server per policy, a disk-tier pass then a host-tier pass ----------
port_of() { echo $((18600 + RANDOM % 2000)); }
metric() {  # metric URL NAME: the sample's value, 0 when absent
  curl -s "$1/metrics" | awk -v n="$2" '$1 == n { v = $2 } END { print v + 0 }'
}
pass() {  # pass POLICY NAME URL LOGFILE: one measured pass of the workload
  local p=$1 name=$2 url=$3 log=$4 d=$R/$1/$2
  mkdir -p "$d"
  wc -l <"$log" >"$d/log-from"
  metric "$url" thaw_cpu_assisted_rows_total >"$d/rows-before"
  now >"$d/t-start"
  timeout "$PASS_S" "$BIN/thaw-bench" load --url "$url" --requests "$REQS" \
    --popularity distinct --rate "$RATE" --prompt-len "$PROMPT" --output-len "$OUTPUT" \
    --seed 7 --out "$d" --no-progress >"$d/load.out" 2>&1
  echo "  $name pass: rc=$? ($(grep -cE '' "$d/load.out") lines in $d/load.out)"
  now >"$d/t-end"
  metric "$url" thaw_cpu_assisted_rows_total >"$d/rows-after"
  wc -l <"$log" >"$d/log-to"
}
policy_run() {  # policy_run POLICY
  local p=$1 port url log
  mkdir -p "$R/$p"
  port=$(port_of)
  url=http://127.0.0.1:$port
  log=$R/$p/serve.log
  local pool=$POOL_SMALL loras=$MAX_LORAS
  if [ "$p" = cached ]; then pool=$POOL_BIG loras=$ADAPTERS; fi
  el "cold start: $p (--max-loras $loras, $pool pages)"
  timeout $((START_S + 2 * PASS_S + 30)) "$BIN/thaw" serve --device "$DEV" --model "$MD" \
    --lora-dir "$AD" --port "$port" --cold-start "$p" --max-loras "$loras" \
    --max-cpu-loras 64 --max-cpu-lora-bytes 34359738368 --max-model-len "$MAXLEN" \
    --num-gpu-blocks-override "$pool" --lora-workers "$WORKERS" "${LINK[@]}" \
    --dump-cost-model "$R/$p/cost.json" >"$log" 2>&1 &
  local sp=$!
  for _ in $(seq 1 $((START_S * 2))); do
    curl -sf "$url/health" >/dev/null && break
    kill -0 $sp 2>/dev/null || break
    sleep 0.5
  done
  if ! curl -sf "$url/health" >/dev/null; then
    echo "  $p: the server did not start; its log ends:"
    tail -15 "$log"
    kill -TERM $sp 2>/dev/null
    wait $sp 2>/dev/null
    return
  fi
  echo "  up after $(($(date +%s) - t0))s"
  # First pass: every adapter starts on disk (page cache). Second pass, same requests: every
  # adapter is in the host tier and, with the small pool, mostly no longer on the device.
  pass "$p" disk "$url" "$log"
  pass "$p" host "$url" "$log"
  kill -TERM $sp 2>/dev/null
  wait $sp 2>/dev/null
}
for p in cached on-demand cpu-assist auto; do
  policy_run $p
done

# --- 3. decode tok/s, on a server started with default flags --------------------------------
el "decode: thaw serve --device $DEV with default flags (--gpu-memory-utilization sizing)"
port=$(port_of)
url=http://127.0.0.1:$port
if [ "$DEV" = cuda ]; then pool_args=(); else pool_args=(--device-memory-bytes 67108864); fi
timeout $((START_S + 90)) "$BIN/thaw" serve --device "$DEV" --model "$MD" --port "$port" \
  "${pool_args[@]}" >"$R/decode-serve.log" 2>&1 &
sp=$!
for _ in $(seq 1 $((START_S * 2))); do
  curl -sf "$url/health" >/dev/null && break
  kill -0 $sp 2>/dev/null || break
  sleep 0.5
done
if curl -sf "$url/health" >/dev/null; then
  echo "  up after $(($(date +%s) - t0))s"
  grep -E "device budget|memory profile" "$R/decode-serve.log" | head -3
  mkdir -p "$R/decode-1" "$R/decode-batch"
  timeout 60 "$BIN/thaw-bench" load --url "$url" --requests 1 --rate 1 --popularity base \
    --prompt-len 16 --output-len "$DECODE_OUT" --seed 3 --out "$R/decode-1" --no-progress \
    >"$R/decode-1/load.out" 2>&1
  timeout 60 "$BIN/thaw-bench" load --url "$url" --requests "$BATCH" --rate 1000 \
    --popularity base --prompt-len 16 --output-len "$DECODE_OUT" --seed 4 --out "$R/decode-batch" --no-progress \
    >"$R/decode-batch/load.out" 2>&1
else
  echo "  the default-flags server did not start; its log ends:"
  tail -15 "$R/decode-serve.log"
fi
kill -TERM $sp 2>/dev/null
wait $sp 2>/dev/null

# --- tables ----------------------------------------------------------------------------------
el "tables"
python3 "$here/tables.py" "$R" --device "$GPU" --build "$BUILD" \
  --workload "$PRESET, $ADAPTERS adapters of rank $RANK (q,k,v,o), $REQS requests with distinct adapters at $RATE req/s, prompt $PROMPT, output $OUTPUT, --max-model-len $MAXLEN, $WORKERS CPU LoRA workers, --max-loras $MAX_LORAS ($ADAPTERS for cached), pool $POOL_SMALL pages ($POOL_BIG for cached)" \
  >"$O/tables.md"
cat "$O/tables.md"
cp "$O/tables.md" "$O/results-section.md"
{ echo; cat "$O/tables.md"; } >>"$RESULTS"
echo "appended to $RESULTS"
tar czf "$O/runs.tgz" -C "$O" runs 2>/dev/null
# === issue 29: GPU speed (thaw-bench gpu + the transformers peer) =========================
# One block, kept apart from the cold-start steps above: decode tok/s and achieved bandwidth
# at batch 1/8/32/64 with 0, 1 and N adapters (ranks 16, 64), prefill TFLOP/s, the SGMV/BGMV
# table, then the same model in transformers + PyTorch (static cache) when torch imports
# (THAW_PEER_PYTHON names its python; skipped with a note otherwise). Extra thaw-bench gpu
# flags: THAW_GPU_BENCH_ARGS (e.g. "--peak-gbs 2976 --peak-tflops 798").
el "issue 29: thaw-bench gpu on $MD"
if [ "$DEV" = cuda ]; then
  GB_ARGS=(--device cuda) PEER_ARGS=(--device cuda) GB_T=420 PEER_T=420
else
  GB_ARGS=(--device cpu --quick) GB_T=120 PEER_T=300
  PEER_ARGS=(--device cpu --batches 1,4 --prompt-len 16 --decode-steps 2 --prefill-tokens 16,64 --reps 1)
fi
# shellcheck disable=SC2086
timeout "$GB_T" "$BIN/thaw-bench" gpu --model "$MD" --workdir "$WORK" "${GB_ARGS[@]}" \
  ${THAW_GPU_BENCH_ARGS:-} >"$O/gpu-bench.md" 2>"$O/gpu-bench.log"
echo "thaw-bench gpu: rc=$?"
cat "$O/gpu-bench.md"
PEER_PY=${THAW_PEER_PYTHON:-python3}
if "$PEER_PY" -c 'import torch, transformers' 2>/dev/null; then
  el "issue 29: transformers peer"
  timeout "$PEER_T" "$PEER_PY" "$root/benches/peers/transformers_gpu.py" --model "$MD" \
    "${PEER_ARGS[@]}" >"$O/gpu-peer.md" 2>"$O/gpu-peer.log"
  echo "transformers peer: rc=$?"
  cat "$O/gpu-peer.md"
else
  echo "transformers peer skipped: $PEER_PY cannot import torch and transformers" \
    "(pip install torch transformers safetensors, or set THAW_PEER_PYTHON)" | tee "$O/gpu-peer.md"
fi
{ echo; echo "## Issue 29: thaw-bench gpu and the transformers peer ($(date -u +%Y-%m-%d), $BUILD)";
  echo "Device: $GPU"; echo; cat "$O/gpu-bench.md"; echo; cat "$O/gpu-peer.md"; } >>"$RESULTS"
el "issue 29: appended to $RESULTS"
# === end issue 29 ============================================================================
el "done"
