#!/usr/bin/env bash
# Prefix snapshots as device forks against whole-state exports (decision D80), in one device call of about 9 minutes:
#   1. `sparkd bench` at the replay's context (12,288 tokens, T = 1, batch 1 and 16): the step, and one state's
#      export / import / fork (harness::state_bench), what a snapshot costs the engine thread in each tier;
#   2. the served replay (serve_matrix_h200.sh), spec off at c = 1 and 16, with `--prefix-cache-device-bytes 0`
#      (every snapshot exported: the behaviour before D80) and with the default device tier, then forced AL 6 with
#      the device tier. The reports carry the engine phase tails, so a per-turn stall shows in `apply`.
# Staging (CPU host): SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/d cuda_runner, plus
# sparkd-replay and workloads.tgz as serve_matrix_h200.sh says; then, carrying .bin/d:
#   BIN=.bin/d bash kernels/bench/prefix_tier_h200.sh
# Writes under $OUT: bench.txt, exports.md, forks.md (matrix tables), runs.tar.gz (both matrices' logs and raw data).
set -u
BIN=${BIN:?BIN names the staged folder}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/device_env.sh" "$BIN"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/bench.txt" 2>&1
timeout 100 "$BIN/sparkd" bench --device cuda --config k3-mini --batch 1,16 --steps 6 --prompt-len 12288 \
  --temperature 1 --max-verify 0 --no-forced --no-draft >>"$OUT/bench.txt" 2>&1
echo "bench rc=$?" >>"$OUT/bench.txt"
RUNS=/tmp/prefix_runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
common=(DURATION=10 GRACE=2 START_S=45 PREFILL_RUNS=0 CONCURRENCY="1 16")
env BIN="$BIN" "${common[@]}" CONFIGS="off" SERVE_ARGS="--prefix-cache-device-bytes 0" BUDGET_S=200 \
  OUT="$RUNS/exports" bash "$HERE/serve_matrix_h200.sh"
env BIN="$BIN" "${common[@]}" CONFIGS="off al6" BUDGET_S=330 OUT="$RUNS/forks" bash "$HERE/serve_matrix_h200.sh"
cp "$RUNS/exports/matrix.md" "$OUT/exports.md" 2>/dev/null
cp "$RUNS/forks/matrix.md" "$OUT/forks.md" 2>/dev/null
tar czf "$OUT/runs.tar.gz" -C "$RUNS" .
