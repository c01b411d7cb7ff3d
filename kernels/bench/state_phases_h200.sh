#!/usr/bin/env bash
# Per-turn costs on one H200 (issue 31, deliverable 3), in one device call of about 6 minutes:
#   1. `sparkd bench` at the replay's context (12,288 tokens, sampled at T = 1, batch 1 and 16): the step, and one
#      state's export / import / fork (harness::state_bench), the moves a turn's admission, prefix snapshots and
#      kept-response offload make on the engine thread;
#   2. the served replay matrix, spec off and forced AL 6 at c = 1 and 16 (serve_matrix_h200.sh), whose report now
#      carries the engine phase tails: a per-request stall (a snapshot export, an offload) shows as laps over 5 ms
#      in `apply`, `admit` or `memory` instead of hiding in a mean per step.
# Staging (CPU host): SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/d1 cuda_runner, plus
# sparkd-replay and workloads.tgz as serve_matrix_h200.sh says; then, carrying .bin/d1:
#   BIN=.bin/d1 bash kernels/bench/state_phases_h200.sh
# Writes under $OUT: bench.txt, and serve_matrix_h200.sh's log.txt, matrix.md, pareto.svg, raw.tar.gz.
set -u
BIN=${BIN:?BIN names the staged folder}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/device_env.sh" "$BIN"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/bench.txt" 2>&1
timeout 150 "$BIN/sparkd" bench --device cuda --config k3-mini --batch 1,16 --steps 6 --prompt-len 12288 \
  --temperature 1 --max-verify 0 --no-forced --no-draft >>"$OUT/bench.txt" 2>&1
echo "bench rc=$?" >>"$OUT/bench.txt"
BIN=$BIN CONFIGS="off al6" CONCURRENCY="1 16" DURATION=10 GRACE=2 START_S=45 PREFILL_RUNS=0 BUDGET_S=400 \
  OUT=$OUT bash "$HERE/serve_matrix_h200.sh"
