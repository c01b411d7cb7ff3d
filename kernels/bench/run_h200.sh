#!/usr/bin/env bash
# Everything the CUDA backend reports, in one device call (under 600 s), writing under $OUT:
#   log.txt            every command's output, in order
#   validate.json      sparkd validate --device cuda --config k3-tiny (ops, whole model, rollback, matrix)
#   bench_mini.json    sparkd bench --device cuda --config k3-mini (default GEMM, CUDA graphs; batches 1..64, each
#                      also timed with graphs off; verify 1..8, forced AL)
#   bench_before.json  batches 1, 8, 64 with the binary of the previous measurement ($BEFORE), for before/after
#   torch_mini.json    kernels/bench/torch_baseline.py at the same shapes (eager and CUDA-graphed)
#   serve.json         sparkd serve --device cuda --synthetic k3-mini --spec dspark: one SSE chat + a two-turn
#                      WebSocket session (kernels/bench/serve_check.py)
#   validate_tiny256.json, validate_mini.json  256 teacher-forced positions on k3-tiny; k3-mini (real widths)
#   bench_quick.json   k3-mini at batch 1, 8, 64 only, plus $QUICK_ARGS (only when named in ONLY)
#   bench_wide.json    k3-mini-wide (57 GB) load time and a short sweep (only when named in ONLY)
#   bench_long.json    k3-mini decode after 4,096-token prompts at batch 1 and 4: MLA split over the cache (only when
#                      named in ONLY)
# Binaries are built on the CPU host and carried: $BIN (sparkd and the GPU test binaries cuda_runner,
# cuda_sample, cuda_attn, cuda_gemm, cuda_drafter, cuda_moe, cuda_rows; optionally kc/ with CUBINs filled by
# the cuda_compile test and fallback/sparkd), $BEFORE/sparkd (and optionally its kc/); fla-core as a wheel in .whl/.
# When validation or a GPU test fails and $BIN/fallback/sparkd exists, the benchmarks run that binary instead (the
# log says so).
# ONLY="name ..." runs just those steps. Each step has its own time limit; a failed step is logged and the next
# one runs.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
BIN=${BIN:-.bin/final}
BEFORE=${BEFORE:-.bin/before}
. "$(dirname "$0")/device_env.sh" "$BIN" "$BEFORE"
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() { # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  echo "=== $(date -u +%FT%TZ) $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  return $rc
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; nproc; free -g; } >>"$LOG" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/site
fi

SPARKD="$BIN/sparkd"
FAILED=""
step validate 60 "$SPARKD" validate --device cuda --config k3-tiny --out "$OUT/validate.json"
want validate && ! grep -q '"pass": true' "$OUT/validate.json" 2>/dev/null && FAILED="$FAILED validate"
for t in cuda_runner cuda_sample cuda_attn cuda_gemm cuda_drafter cuda_moe cuda_rows; do
  if [ -x "$BIN/$t" ]; then
    step "$t" 40 "$BIN/$t" --test-threads=1 --nocapture --skip cuda_matches_the_cpu_reference || FAILED="$FAILED $t"
  fi
done
if [ -n "$FAILED" ] && [ -x "$BIN/fallback/sparkd" ]; then
  SPARKD="$BIN/fallback/sparkd"
  echo "=== FALLBACK: failed:$FAILED; the benchmarks use $SPARKD" | tee -a "$LOG"
fi
[ -x "$BIN/cuda_sample" ] && step sampling_time 30 "$BIN/cuda_sample" --ignored --nocapture sampling_step_time
[ -x "$BIN/cuda_drafter" ] && step draft_cost 30 "$BIN/cuda_drafter" --ignored --nocapture cuda_draft_cost
[ -x "$BIN/cuda_moe" ] && step moe_bandwidth 30 "$BIN/cuda_moe" --ignored --nocapture --test-threads=1
[ -x "$BIN/cuda_gemm" ] && step gemm_bandwidth 60 "$BIN/cuda_gemm" --ignored --nocapture gemm_bandwidth

step bench_mini 150 "$SPARKD" bench --device cuda --config k3-mini --steps 8 --prompt-len 64 --compare-eager \
  --out "$OUT/bench_mini.json"
step bench_before 75 "$BEFORE/sparkd" bench --device cuda --config k3-mini ${BEFORE_ARGS:-} --batch 1,8,64 --steps 8 \
  --prompt-len 64 --max-verify 0 --no-forced --out "$OUT/bench_before.json"
step torch_mini 80 python3 kernels/bench/torch_baseline.py --config k3-mini --prompt-len 64 --out "$OUT/torch_mini.json"

# The daemon on the GPU: k3-mini generated in memory with a DSpark drafter, one SSE chat and a two-turn WebSocket session.
if want serve_check; then
  "$SPARKD" serve --device cuda --synthetic k3-mini --spec dspark --port 8000 >"$OUT/serve_log.txt" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 60); do grep -q "listening on" "$OUT/serve_log.txt" && break; sleep 1; done
  step serve_check 30 python3 kernels/bench/serve_check.py --base http://127.0.0.1:8000 --out "$OUT/serve.json"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  cat "$OUT/serve_log.txt" >>"$LOG"; rm -f "$OUT/serve_log.txt"
fi

# Greedy agreement over 256 teacher-forced positions (k3-tiny), and real-width layers: k3-mini (8 layers at K3's
# widths) against the CPU reference with a small matrix (the CPU forward at 7,168 wide is the cost).
step validate_tiny256 60 "$SPARKD" validate --device cuda --config k3-tiny --positions 256 --batch 1 --max-window 1 \
  --out "$OUT/validate_tiny256.json"
step validate_mini "${MINI_LIMIT:-170}" "$SPARKD" validate --device cuda --config k3-mini \
  ${MINI_ARGS:---positions 256 --batch 1,4 --max-window 2} --out "$OUT/validate_mini.json"

[[ " ${ONLY:-} " == *" bench_quick "* ]] && step bench_quick 90 "$SPARKD" bench --device cuda --config k3-mini \
  --batch 1,8,64 --steps 8 --prompt-len 64 --max-verify 0 --no-forced ${QUICK_ARGS:-} --out "$OUT/bench_quick.json"
[[ " ${ONLY:-} " == *" bench_wide "* ]] && step bench_wide 80 "$SPARKD" bench --device cuda --config k3-mini-wide --batch 1,8,64 --steps 4 \
  --prompt-len 16 --max-verify 0 --no-forced --out "$OUT/bench_wide.json"
[[ " ${ONLY:-} " == *" bench_long "* ]] && step bench_long 150 "$SPARKD" bench --device cuda --config k3-mini --batch 1,4 \
  --steps 8 --prompt-len 4096 --max-verify 0 --no-forced --out "$OUT/bench_long.json"
grep "^===" "$LOG"
