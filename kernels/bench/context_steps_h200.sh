#!/usr/bin/env bash
# Issue 31: what long contexts do to the steps the engine plans. `sparkd bench --context-steps` on k3-mini at
# contexts up to the replay's longest (~98k tokens): one decode row, 16 decode rows, one 64-token prefill chunk,
# and 16 decode rows beside the chunk (the step the step-time limit plans at c=16), beside the start-up step-cost
# profile t(B) the limit predicts with; then the same with one decode row beside the chunk (c=1).
# Staging (CPU host): SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/d cuda_runner
# Device (carry .bin/d): BIN=.bin/d bash kernels/bench/context_steps_h200.sh
# Writes under $OUT: context_steps.txt (tables), context_b16.json, context_b1.json.
set -u
OUT=${OUT:-/tmp/out}
BIN=${BIN:?BIN names the staged folder}
CONTEXTS=${CONTEXTS:-0,4096,16384,49152,98304}
mkdir -p "$OUT"
. kernels/bench/device_env.sh "$BIN"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  for b in 16 1; do
    echo "=== --context-batch $b"
    timeout 200 "$BIN/sparkd" bench --device cuda --config k3-mini --context-steps "$CONTEXTS" --context-batch "$b" \
      --context-chunk 64 --out "$OUT/context_b$b.json"
    echo "rc=$?"
  done
} >"$OUT/context_steps.txt" 2>&1
cat "$OUT/context_steps.txt"
