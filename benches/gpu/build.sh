#!/usr/bin/env bash
# Builds what benches/gpu/run.sh runs, on a machine with Rust (no GPU needed), and strips it
# into gpu-bin/ (ignored by git): thaw, thaw-bench, the cuda_parity / cuda_exchange test
# executables (with the worker cuda_exchange spawns, thaw-test-worker) and (with cuda) the
# cuda_bench example, with BUILD naming the commit and the date.
# Over 60 MiB stripped (THAW_GPU_BIN_MAX_MIB) they are packed into gpu-bin/bin.tar.gz, so what
# a device lease carries stays under its 64 MiB; run.sh unpacks it.
#
#   benches/gpu/build.sh          release, --features cuda (for an H100/H200)
#   benches/gpu/build.sh --cpu    without cuda (a smoke run here: run.sh --device cpu)
#   benches/gpu/build.sh --cpu --dev   the same from the dev profile (opt-level 2, faster to build)
#
# Then copy the checkout's gpu-bin/ and benches/gpu/ to the GPU machine and run
# `benches/gpu/run.sh` there (no Rust, no network).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
cuda=1
profile=release
for arg in "$@"; do
  case "$arg" in
    --cpu) cuda=0 ;;
    --dev) profile=dev ;;
    *) echo "usage: $0 [--cpu] [--dev]" >&2; exit 2 ;;
  esac
done
if [ "$profile" = dev ]; then dir=debug; else dir=release; fi
out=gpu-bin
mkdir -p "$out"
target=${CARGO_TARGET_DIR:-target}
if [ "$cuda" = 1 ]; then
  server_features=(--features thaw-server/cuda)
  test_features=(--features thaw-tests/cuda)
else
  server_features=()
  test_features=()
fi
cargo build --profile "$profile" -p thaw-server -p thaw-bench "${server_features[@]}"
cp "$target/$dir/thaw" "$target/$dir/thaw-bench" "$out/"
# The test executables' names carry a hash: ask cargo for them.
cargo test --profile "$profile" --no-run -p thaw-tests "${test_features[@]}" \
  --test cuda_parity --test cuda_exchange --message-format=json 2>/dev/null |
  python3 -c '
import json, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    name = (m.get("target") or {}).get("name")
    if exe and name in ("cuda_parity", "cuda_exchange", "thaw-test-worker"):
        shutil.copy(exe, sys.argv[1] + "/" + name)
        print("copied", name)
' "$out"
if [ "$cuda" = 1 ]; then
  # The kernel microbenchmarks (issue 29: SGMV/BGMV and decode attention, old vs new kernels).
  cargo build --profile "$profile" -p thaw-runtime --features cuda --example cuda_bench
  cp "$target/$dir/examples/cuda_bench" "$out/"
fi
strip "$out"/thaw "$out"/thaw-bench "$out"/cuda_parity "$out"/cuda_exchange "$out"/thaw-test-worker \
  "$out"/cuda_bench 2>/dev/null || true
rm -f "$out/bin.tar.gz"
# A device lease carries at most 64 MiB of ignored files: past the limit (default 60 MiB, to
# leave room for BUILD and the scripts' logs), pack the executables; run.sh unpacks them.
max_mib=${THAW_GPU_BIN_MAX_MIB:-60}
exes=()
for f in thaw thaw-bench cuda_parity cuda_exchange thaw-test-worker cuda_bench; do
  [ -f "$out/$f" ] && exes+=("$f")
done
total=$(cd "$out" && cat "${exes[@]}" | wc -c)
echo "executables: $((total / 1048576)) MiB stripped (${exes[*]})"
if [ "$total" -gt $((max_mib * 1048576)) ]; then
  tar czf "$out/bin.tar.gz" -C "$out" "${exes[@]}"
  (cd "$out" && rm -f "${exes[@]}")
  packed=$(wc -c <"$out/bin.tar.gz")
  echo "packed into $out/bin.tar.gz: $((packed / 1048576)) MiB"
  if [ "$packed" -gt $((64 * 1048576)) ]; then
    echo "$out/bin.tar.gz is over the 64 MiB a device lease carries" >&2
    exit 1
  fi
fi
{
  echo "commit $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- . ':!gpu-bin' || echo -dirty)"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "cuda $cuda, profile $profile"
} >"$out/BUILD"
cat "$out/BUILD"
ls -la "$out"
