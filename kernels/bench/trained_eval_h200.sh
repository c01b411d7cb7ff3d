#!/usr/bin/env bash
# Issue 37: the trained embedded model (k3-tiny-trained) measured on the GPU in one device call, with no forced
# acceptance: `sparkd spec-eval` (DSpark acceptance and calibration per position, every method's AL on code
# continuations of held-out standard-library files), then the served replay (serve_matrix_h200.sh) for spec off,
# dspark, suffix and ngram at c=1 and 4.
# Staging (CPU host; BIN about 25 MB):
#   SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/t cuda_runner && rm .bin/t/cuda_runner
#   cargo build --release -p sparkd-workloads && cp target/release/sparkd-replay .bin/t/ && strip .bin/t/sparkd-replay
#   tar czf .bin/t/workloads.tgz -C ../shared/workloads/weka-kv-cache-tester .
#   xz -T2 .bin/t/sparkd                    (the binary holds the 26 MB artifact; it travels compressed)
#   the held-out files of `sparkd corpus` copied into .bin/t/held/ with a held.txt listing them
# Device (carry .bin/t): BIN=.bin/t bash kernels/bench/trained_eval_h200.sh
# Writes under $OUT: spec_eval.json, spec_eval.txt, reliability.svg, and the matrix's log.txt, matrix.md, raw.tar.gz.
set -u
OUT=${OUT:-/tmp/out}
BIN=${BIN:?BIN names the staged folder}
PROMPTS=${PROMPTS:-16}
BUDGET_S=${BUDGET_S:-540}
T0=$(date +%s)
mkdir -p "$OUT"
[ -f "$BIN/sparkd.xz" ] && xz -d -k -f "$BIN/sparkd.xz"
chmod +x "$BIN/sparkd"
. kernels/bench/device_env.sh "$BIN"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/spec_eval.txt"
timeout 200 "$BIN/sparkd" spec-eval --device cuda --files "$BIN/held/held.txt" --prompts "$PROMPTS" \
  --out "$OUT/spec_eval.json" --svg "$OUT/reliability.svg" 2>&1 | grep -v " INFO " | tee -a "$OUT/spec_eval.txt"
LEFT=$(( BUDGET_S - ($(date +%s) - T0) ))
echo "spec-eval done at +$(( $(date +%s) - T0 )) s; $LEFT s left for the replay" | tee -a "$OUT/spec_eval.txt"
MODEL=k3-tiny-trained CONFIGS="off dspark suffix ngram" CONCURRENCY="1 4" DURATION=${DURATION:-10} START_S=20 \
  PREFILL_RUNS=0 BUDGET_S=$LEFT bash kernels/bench/serve_matrix_h200.sh
