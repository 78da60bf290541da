#!/usr/bin/env bash
# Issue 14 item 4: the simulator's validation runs against real `thaw serve` instances.
#
# usage: simulate-validate.sh OUT THAW THAW_BENCH MODEL ADAPTERS REQUESTS RUN...
#   RUN is NAME:INSTANCES:RATE (req/s over all instances), e.g. a1:1:0.5 b2:2:2.0
#   MODEL / ADAPTERS: `thaw gen-model --preset small --out MODEL`,
#                     `thaw gen-adapters --model MODEL --count 12 --ranks 8,16,32,64 --out ADAPTERS`
#
# Per run, in OUT/NAME: instance i is `thaw serve` pinned to core i at nice -10, no CPU LoRA
# worker, dumping its cost model (cost-i.json, cost-i.history.jsonl, cost-i.steps.jsonl);
# `thaw-bench load` sends REQUESTS requests round-robin over the instances (trace arrivals and
# lengths, Azure conversation trace scaled by 0.05, default seed) and writes load.json; then the
# servers are stopped (SIGTERM: they write their final dump). Then, offline:
#   thaw-bench simulate --cost-model OUT/NAME/cost-0.json[,OUT/NAME/cost-1.json] \
#     --replay OUT/NAME/load.json
set -euo pipefail
out=$1 thaw=$2 bench=$3 model=$4 adapters=$5 requests=$6
shift 6
trace=${TRACE:-/work/shared/traces/AzureLLMInferenceTrace_conv.csv}
mkdir -p "$out"
for run in "$@"; do
    IFS=: read -r name inst rate <<<"$run"
    dir=$out/$name
    mkdir -p "$dir"
    pids=()
    urls=()
    for ((i = 0; i < inst; i++)); do
        port=$((8140 + i))
        nice -n -10 taskset -c "$i" "$thaw" serve --model "$model" --lora-dir "$adapters" \
            --max-loras 4 --max-cpu-loras 8 --max-num-seqs 16 --lora-workers 0 \
            --port "$port" --dump-cost-model "$dir/cost-$i.json" >"$dir/serve-$i.log" 2>&1 &
        pids+=($!)
        urls+=("http://127.0.0.1:$port")
    done
    for u in "${urls[@]}"; do
        for _ in $(seq 1 300); do
            curl -sf "$u/health" >/dev/null && break
            sleep 0.1
        done
    done
    started=$(date +%s.%N)
    url=$(IFS=,; echo "${urls[*]}")
    "$bench" load --url "$url" --requests "$requests" --arrivals trace --lengths trace \
        --length-scale 0.05 --trace "$trace" --rate "$rate" --out "$dir" >"$dir/load.txt" 2>&1
    echo "$name: $inst instance(s) at $rate req/s, load took $(echo "$(date +%s.%N) - $started" | bc) s"
    for p in "${pids[@]}"; do kill -TERM "$p"; done
    for p in "${pids[@]}"; do wait "$p" || true; done
    grep -E "done|failed" "$dir/load.txt" | head -3 || true
done
