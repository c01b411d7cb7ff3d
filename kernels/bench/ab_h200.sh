#!/usr/bin/env bash
# Interleaved A/B of several builds in one device call (under 600 s), writing under $OUT:
#   log.txt              every command's output, in order
#   runs.tar.gz          bench_<name>_<r>.json: sparkd bench --batch $BATCHES ... for build <name>, round <r> (rounds
#                        interleave builds), and validate_<name>.json per validated build: one archive, because the
#                        device tool brings back at most 8 files and log.txt must be among them
#   ncu.txt              per-kernel ncu durations, or NCU_METRICS (only with NCU_KERNELS set)
# Builds are directories carried to the device, each holding what a step needs: sparkd (bench, validate), the GPU
# test binaries named in TESTS, and optionally kc/ (CUBINs filled by the cuda_compile test). The first build is the
# baseline; every later one is validated first (sparkd validate and the TESTS binaries). A build may be named with
# environment settings, `dir@VAR=VALUE[,VAR=VALUE...]`: every command of that entry runs with them, and its files
# are named `<dir's name>_<VALUE>...` (one lab build A/B'd against itself in several modes).
#   BUILDS="dir ..."   the builds, baseline first (required)
#   ROUNDS             bench rounds (default 2)
#   BATCHES            batches of the bench (default 1,8,64)
#   PROMPT_LEN         prompt tokens of every row before the timed steps (default 64; 4096 times long-context decode)
#   TESTS              GPU test binaries run on every non-baseline build (default: cuda_moe cuda_runner)
#   MOE_BANDWIDTH=1    also `cuda_moe --ignored routed_expert_bandwidth` for every build, ROUNDS times, interleaved
#   NCU_KERNELS=regex  also ncu per-kernel durations of a --batch $NCU_BATCH bench (default 64) for every build;
#                      NCU_METRICS (comma-separated, default gpu__time_duration.sum) names other metrics, e.g.
#                      l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
#   CHECKPOINT=DIR     bench k3-mini from a synthetic checkpoint in DIR (`sparkd bench --model`, the same weights),
#                      written once by the first build's `sparkd synth` unless DIR holds its index (synth writes it
#                      last): each bench and ncu run then loads the weights instead of generating them. Every build's
#                      sparkd must know --model.
#   OPS="op ..."       bench ops (e.g. mla.attention kda.recurrence) whose ms per step the summary prints too
# Examples: BUILDS=".bin/base .bin/new" MOE_BANDWIDTH=1 bash kernels/bench/ab_h200.sh
#           BUILDS=".bin/lab .bin/lab@SPARKD_LAB_X=2 .bin/lab@SPARKD_LAB_X=3" bash kernels/bench/ab_h200.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: "${BUILDS:?BUILDS names the build directories, baseline first}"
ROUNDS=${ROUNDS:-2}
BATCHES=${BATCHES:-1,8,64}
PROMPT_LEN=${PROMPT_LEN:-64}
TESTS=${TESTS:-cuda_moe cuda_runner}
dir() { echo "${1%%@*}"; }
# The entry's settings, space-separated for env(1) (none for a plain directory).
settings() { case "$1" in *@*) echo "${1#*@}" | tr ',' ' ' ;; esac; }
name() { # the directory's name, then _VALUE per setting, with any character but [A-Za-z0-9._-] as _ (the device
  # tool brings back only files with plain names)
  local n s
  n=$(basename "$(dir "$1")")
  for s in $(settings "$1"); do n="${n}_${s#*=}"; done
  echo "$n" | tr -c 'A-Za-z0-9._\n-' '_'
}
# shellcheck disable=SC2046 # one word per build directory
. "$(dirname "$0")/device_env.sh" $(for b in $BUILDS; do dir "$b"; done)
run() { # run LIMIT_S BUILD CMD...: CMD with BUILD's settings
  local limit=$1 build=$2; shift 2
  # shellcheck disable=SC2046 # one word per setting
  set -- $(settings "$build") "$@"
  echo "=== $(date -u +%T) $*" >>"$LOG"
  timeout "$limit" env "$@" >>"$LOG" 2>&1
  echo "=== rc=$?" >>"$LOG"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } >>"$LOG" 2>&1

first=1
for b in $BUILDS; do
  if [ $first = 1 ]; then first=0; continue; fi
  d=$(dir "$b")
  [ -x "$d/sparkd" ] &&
    run 60 "$b" "$d/sparkd" validate --device cuda --config k3-tiny --out "$OUT/validate_$(name "$b").json"
  for t in $TESTS; do
    [ -x "$d/$t" ] && run 60 "$b" "$d/$t" --test-threads=1 --nocapture --skip cuda_matches_the_cpu_reference
  done
done
if [ "${MOE_BANDWIDTH:-0}" = 1 ]; then
  for r in $(seq 1 "$ROUNDS"); do
    for b in $BUILDS; do
      d=$(dir "$b")
      [ -x "$d/cuda_moe" ] && run 30 "$b" "$d/cuda_moe" --ignored --nocapture --test-threads=1 routed_expert_bandwidth
    done
  done
fi
WEIGHTS=(--config k3-mini)
if [ -n "${CHECKPOINT:-}" ]; then
  writer=$(dir "${BUILDS%% *}")
  [ -f "$CHECKPOINT/model.safetensors.index.json" ] ||
    run 180 "$writer" "$writer/sparkd" synth --config k3-mini --seed 0 --out "$CHECKPOINT"
  if [ -f "$CHECKPOINT/model.safetensors.index.json" ]; then
    WEIGHTS=(--model "$CHECKPOINT")
  else
    echo "=== no checkpoint in $CHECKPOINT: benching the generated weights" >>"$LOG"
  fi
fi
for r in $(seq 1 "$ROUNDS"); do
  for b in $BUILDS; do
    d=$(dir "$b")
    [ -x "$d/sparkd" ] && run 90 "$b" "$d/sparkd" bench --device cuda "${WEIGHTS[@]}" --batch "$BATCHES" --steps 8 \
      --prompt-len "$PROMPT_LEN" --max-verify 0 --no-forced --out "$OUT/bench_$(name "$b")_$r.json"
  done
done
if [ -n "${NCU_KERNELS:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for b in $BUILDS; do
    echo "=== ncu $(name "$b")" >>"$OUT/ncu.txt"
    # shellcheck disable=SC2046 # one word per setting
    timeout 100 env $(settings "$b") "$NCU" --clock-control none --kernel-name "regex:$NCU_KERNELS" \
      --metrics "${NCU_METRICS:-gpu__time_duration.sum}" --print-summary per-kernel "$(dir "$b")/sparkd" bench --device cuda \
      "${WEIGHTS[@]}" --batch "${NCU_BATCH:-64}" --steps 2 --prompt-len "$PROMPT_LEN" --max-verify 0 --no-forced 2>&1 |
      grep -v "^==PROF==" >>"$OUT/ncu.txt"
  done
fi
grep -h "^===\|PASS\|FAIL\|test result\|GB/s" "$LOG"
# Step medians (and the OPS' ms per step, and the HBM floor fraction) per build and round.
# shellcheck disable=SC2086 # OPS is a list of op names
python3 - "$OUT" ${OPS:-} <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench_*.json"))):
    rows = json.load(open(f))["decode"]
    cells = []
    for r in rows:
        ops = {o["op"]: o["ms"] for o in r.get("by_op", [])}
        extra = "".join(f" {op} {ops[op]:.3f}" if op in ops else f" {op} -" for op in sys.argv[2:])
        cells.append(f"b{r['batch']} {r['step_ms_median']:.3f} ({100 * r['floor_fraction']:.1f}%){extra}")
    print(os.path.basename(f), " | ".join(cells))
PY
(cd "$OUT" && tar czf runs.tar.gz bench_*.json validate_*.json 2>/dev/null; rm -f bench_*.json validate_*.json)
