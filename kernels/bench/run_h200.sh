#!/usr/bin/env bash
# Everything the CUDA backend reports, in one device call, writing under $OUT (at most 8 files):
#   log.txt              every command's output, in order
#   bench_mini.json      sparkd bench --device cuda --config k3-mini (batch-invariant GEMM, the served default)
#   torch_mini.json      kernels/bench/torch_baseline.py at the same shapes (eager and CUDA-graphed)
#   validate.json        sparkd validate --device cuda --config k3-tiny (ops, whole model, rollback, matrix)
#   serve.json           sparkd serve --device cuda --synthetic k3-mini, one SSE chat + a two-turn WebSocket session
#   bench_mini_cublas.json  the k3-mini sweep with cuBLAS GEMMs
#   bench_wide.json      k3-mini-wide (57 GB) load time and a short sweep
# Binaries are built on the CPU host and carried in .bin/ (sparkd, cuda_runner); fla-core as a wheel in .whl/.
# ONLY="name ..." runs just those steps (serve_check names the serve block).
# Each step has its own time limit so the whole script ends inside one 600 s call; a failed step is logged
# and the next one runs.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
BIN=${BIN:-.bin}
export SPARKD_KERNEL_CACHE=/tmp/kc
export PYTHONUNBUFFERED=1
# NVRTC and cuBLAS from the image's Python wheels, after the system's.
for d in $(python3 -c 'import nvidia, os; p=nvidia.__path__[0]; print(" ".join(os.path.join(p, x, "lib") for x in os.listdir(p)))' 2>/dev/null); do
  LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() { # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  echo "=== $(date -u +%FT%TZ) $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; nproc; free -g; } >>"$LOG" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/site
fi

step bench_mini 150 "$BIN/sparkd" bench --device cuda --config k3-mini --steps 8 --prompt-len 64 --out "$OUT/bench_mini.json"
step torch_mini 90 python3 kernels/bench/torch_baseline.py --config k3-mini --prompt-len 64 --out "$OUT/torch_mini.json"
step validate 60 "$BIN/sparkd" validate --device cuda --config k3-tiny --out "$OUT/validate.json"
step contract 30 "$BIN/cuda_runner" --test-threads=1 --skip cuda_matches_the_cpu_reference

# The daemon on the GPU: k3-mini generated in memory, one SSE chat and a two-turn WebSocket session.
if want serve_check; then
  "$BIN/sparkd" serve --device cuda --synthetic k3-mini --port 8000 >"$OUT/serve_log.txt" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 60); do grep -q "listening on" "$OUT/serve_log.txt" && break; sleep 1; done
  step serve_check 45 python3 kernels/bench/serve_check.py --base http://127.0.0.1:8000 --out "$OUT/serve.json"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  cat "$OUT/serve_log.txt" >>"$LOG"; rm -f "$OUT/serve_log.txt"
fi

step bench_mini_cublas 150 "$BIN/sparkd" bench --device cuda --config k3-mini --gemm cublas --steps 8 --prompt-len 64 \
  --max-verify 0 --no-forced --out "$OUT/bench_mini_cublas.json"
step bench_wide 80 "$BIN/sparkd" bench --device cuda --config k3-mini-wide --gemm cublas --batch 1,8,64 --steps 4 \
  --prompt-len 16 --max-verify 0 --no-forced --out "$OUT/bench_wide.json"
grep "^===" "$LOG"
