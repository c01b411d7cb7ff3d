#!/usr/bin/env bash
# The served replay matrix of issue 31, in parts of at most one device call (600 s) each: the whole matrix (4 configs x
# 4 concurrencies, with each lane's warm-up) needs about 25 minutes, so a call names its part with CONFIGS and
# CONCURRENCY and the plan refuses a part that does not fit BUDGET_S. For each server config, `sparkd serve` on a
# free loopback port, a long-prompt prefill point (first config only), then `sparkd-replay run --transport ws` at
# each concurrency with /metrics scraped after every point (the engine phase histograms), then the daemon stopped.
# Writes under $OUT (the device tool brings back at most 8 files):
#   log.txt       every command's output, in order, with the planned and the spent time
#   matrix.md     config x concurrency: ITL, TTFT, P90 interactivity, throughput, acceptance length, engine phases
#   pareto.svg    P90 interactivity (tok/s/user) against total throughput (tok/s/GPU), one curve per config
#   raw.tar.gz    raw/: <config>_c<N>.json (the replay's run reports), <config>_c<N>_metrics.txt (/metrics after
#                 the point; <config>_c0_metrics.txt before the first), <config>_serve.log, prefill.json, plan.txt;
#                 `tar xzf raw.tar.gz && python3 kernels/bench/serve_matrix.py report --raw raw --configs "off al3 al6
#                 dspark" --concurrency "1 4 16 64" --out .` rebuilds
#                 matrix.md and pareto.svg anywhere
# Staging BIN on the CPU host (git-ignored .bin/; about 20 MB with one test binary):
#   SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels bash kernels/bench/stage.sh .bin/m cuda_runner
#   cargo build --release -p sparkd-workloads && cp target/release/sparkd-replay .bin/m/ && strip .bin/m/sparkd-replay
#   tar czf .bin/m/workloads.tgz -C ../shared/workloads/weka-kv-cache-tester .   (the 40 Weka traces: 35 MB, 2 MB packed)
# then, in one device call per part (carry .bin/m): BIN=.bin/m CONFIGS="off al3" CONCURRENCY="1 4 16" \
#   bash kernels/bench/serve_matrix_h200.sh   (c=64 alone takes a call per config or two)
# Server configs (CONFIGS, in this order by default):
#   off      no speculation
#   sync     no speculation, each step waiting for the one before (--async-scheduling off; only when asked)
#   al3      --spec dspark --spec-synthetic-al 3 (forced mean acceptance length 3)
#   al6      --spec dspark --spec-synthetic-al 6
#   dspark   --spec dspark with its default budget (the drafter's own drafts)
#   suffix, ngram, hybrid   --spec suffix / ngram / hybrid with their default budgets (no forced acceptance)
# Settings (environment):
#   BIN=DIR          staged binaries: sparkd, sparkd-replay, kc/ (kernel cache, kernels/bench/stage.sh) (required)
#   WORKLOADS=PATH   trace folder or .tar.gz/.tgz of one (default: $BIN/workloads, else $BIN/workloads.tgz); the
#                    device machine has no ../shared, so the traces travel with BIN
#   CONCURRENCY      "1 4 16 64"        DURATION  12 (profiling seconds per point, whole seconds)
#   GRACE            3 (seconds in-flight requests may take after a point's stop)
#   TOKEN_SCALE 0.1, TIME_SCALE 0.05    (the replay's --token-scale / --time-scale)
#   REPLAY_ARGS      more `sparkd-replay run` flags for every point (e.g. --no-warmup)
#   DEVICE cuda, MODEL k3-mini          (`sparkd serve --device $DEVICE --synthetic $MODEL`)
#   SERVE_ARGS       more `sparkd serve` flags for every config
#   PREFILL_TOKENS 4096, PREFILL_RUNS 3 (timed long-prompt requests after one warm-up; 0 runs: no prefill point)
#   START_S 60       planned daemon start (weights generated at start); START_LIMIT 180 (give up after)
#   BUDGET_S 590     the call's time: the plan must fit, and a point that would end past it is skipped (logged)
# The plan counts, per point, the replay's warm-up primers (every lane first prefills its context before its sampled
# start turn: 1 s + 2.8 s per lane; at token scale 0.1 a lane's context is about 12,000 tokens, and the c=16 points
# of 2026-12-03 spent about 42 s in warm-up, so the old 0.1 s per lane let the point's own time limit kill the c=64
# replay in its warm-up), 1 s of trace loading, DURATION and GRACE; per config START_S and 3 s to stop; 2 s per
# prefill request; 5 s for the report. The log prints the real start and point times, to correct the plan with.
# Dry run on the CPU: DEVICE=cpu MODEL=k3-tiny CONCURRENCY="1 2" DURATION=3 TOKEN_SCALE=0.02 START_S=10 \
#   PREFILL_TOKENS=256 BIN=/tmp/bin OUT=/tmp/matrix bash kernels/bench/serve_matrix_h200.sh
set -u
BIN=${BIN:?BIN names the staged folder holding sparkd and sparkd-replay}
OUT=${OUT:-/tmp/out}
CONFIGS=${CONFIGS:-off al3 al6 dspark}
CONCURRENCY=${CONCURRENCY:-1 4 16 64}
DURATION=${DURATION:-12}
GRACE=${GRACE:-3}
TOKEN_SCALE=${TOKEN_SCALE:-0.1}
TIME_SCALE=${TIME_SCALE:-0.05}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-k3-mini}
SERVE_ARGS=${SERVE_ARGS:-}
REPLAY_ARGS=${REPLAY_ARGS:-}
PREFILL_TOKENS=${PREFILL_TOKENS:-4096}
PREFILL_RUNS=${PREFILL_RUNS:-3}
START_S=${START_S:-60}
START_LIMIT=${START_LIMIT:-180}
BUDGET_S=${BUDGET_S:-590}
# The daemon serves on one GPU (per-GPU throughput in the reports); a CPU dry run has none, so plain tok/s.
REPLAY_GPUS=""
[ "$DEVICE" = cuda ] && REPLAY_GPUS="--gpus 1"
# Planning constants (seconds; see above).
PRIMER_S=1 PRIMER_LANE_DS=28 PREP_S=1 STOP_S=3 PREFILL_REQ_S=2 REPORT_S=5
HERE=$(cd "$(dirname "$0")" && pwd)
RAW="$OUT/raw"
LOG="$OUT/log.txt"
mkdir -p "$RAW"
T0=$(date +%s)
log() { echo "=== $(date -u +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
die() { log "FAILED: $*"; exit 1; }

for exe in sparkd sparkd-replay; do [ -x "$BIN/$exe" ] || die "$BIN/$exe is missing"; done
WORKLOADS=${WORKLOADS:-$([ -d "$BIN/workloads" ] && echo "$BIN/workloads" || echo "$BIN/workloads.tgz")}
case "$WORKLOADS" in
  *.tgz | *.tar.gz)
    [ -f "$WORKLOADS" ] || die "no traces: $WORKLOADS is missing (stage the Weka traces as \$BIN/workloads/ or .tgz)"
    rm -rf /tmp/serve_matrix_traces && mkdir -p /tmp/serve_matrix_traces
    tar xzf "$WORKLOADS" -C /tmp/serve_matrix_traces || die "unpacking $WORKLOADS"
    TRACES=/tmp/serve_matrix_traces ;;
  *) TRACES=$WORKLOADS ;;
esac
ls "$TRACES"/*.json >/dev/null 2>&1 || die "no traces: $TRACES holds no .json trace"

config_args() { # the `sparkd serve` flags of one server config
  case "$1" in
    off) echo "" ;;
    sync) echo "--async-scheduling off" ;;
    al3) echo "--spec dspark --spec-synthetic-al 3" ;;
    al6) echo "--spec dspark --spec-synthetic-al 6" ;;
    dspark) echo "--spec dspark" ;;
    suffix) echo "--spec suffix" ;;
    ngram) echo "--spec ngram" ;;
    hybrid) echo "--spec hybrid" ;;
    *) return 1 ;;
  esac
}
for c in $CONFIGS; do config_args "$c" >/dev/null || die "unknown config $c (off, sync, al3, al6, dspark, suffix, ngram, hybrid)"; done
for v in DURATION GRACE START_S START_LIMIT BUDGET_S PREFILL_TOKENS PREFILL_RUNS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be whole seconds or a count, found ${!v}"
done

# The plan: every config starts a daemon, runs every point, stops; the first config also runs the prefill point.
point_s() { # the planned seconds of one point at concurrency $1
  echo $(( PRIMER_S + (PRIMER_LANE_DS * $1 + 9) / 10 + PREP_S + DURATION + GRACE ))
}
for c in $CONCURRENCY; do [[ $c =~ ^[1-9][0-9]*$ ]] || die "CONCURRENCY holds $c, not a concurrency"; done
NCONFIGS=$(echo $CONFIGS | wc -w)
POINTS_S=0
for c in $CONCURRENCY; do POINTS_S=$(( POINTS_S + $(point_s "$c") )); done
CONFIG_S=$(( START_S + POINTS_S + STOP_S ))
PREFILL_S=$(( PREFILL_RUNS > 0 ? (PREFILL_RUNS + 1) * PREFILL_REQ_S : 0 ))
PLANNED=$(( NCONFIGS * CONFIG_S + PREFILL_S + REPORT_S ))
{
  echo "configs: $CONFIGS; concurrency: $CONCURRENCY; $DURATION s per point, $GRACE s grace; token scale" \
    "$TOKEN_SCALE, time scale $TIME_SCALE; $DEVICE $MODEL; traces $TRACES"
  echo "planned: $NCONFIGS configs x ($START_S s start + $POINTS_S s of points ($(for c in $CONCURRENCY; do
    echo -n "c=$c $(point_s "$c") s "; done | sed 's/ $//')) + $STOP_S s stop) + $PREFILL_S s prefill + $REPORT_S s" \
    "report = $PLANNED s of $BUDGET_S s"
} | tee "$RAW/plan.txt" | tee -a "$LOG"
[ "$PLANNED" -le "$BUDGET_S" ] || die "the plan ($PLANNED s) does not fit BUDGET_S=$BUDGET_S: fewer configs, points or seconds"
[ "$DEVICE" = cuda ] && . "$HERE/device_env.sh" "$BIN"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null; nproc; } >>"$LOG" 2>&1
DEADLINE=$(( T0 + BUDGET_S - REPORT_S ))

SERVER=""
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=""
}
trap stop_server EXIT
scrape() { python3 "$HERE/serve_matrix.py" scrape --base "$BASE" --out "$1" >>"$LOG" 2>&1 || log "scrape $1 failed"; }

first=1
for cfg in $CONFIGS; do
  first_point_s=$(point_s "${CONCURRENCY%% *}")
  if [ $(( $(date +%s) + START_S + first_point_s + STOP_S )) -gt "$DEADLINE" ]; then
    log "$cfg skipped: no time left for a start and one point"
    continue
  fi
  # shellcheck disable=SC2046 # one word per flag
  set -- $(config_args "$cfg") $SERVE_ARGS
  log "$cfg: sparkd serve --device $DEVICE --synthetic $MODEL --port 0 $*"
  t_start=$(date +%s)
  "$BIN/sparkd" serve --device "$DEVICE" --synthetic "$MODEL" --host 127.0.0.1 --port 0 \
    --served-model-name matrix "$@" >"$RAW/${cfg}_serve.log" 2>&1 &
  SERVER=$!
  BASE=""
  for _ in $(seq 1 $(( START_LIMIT * 2 ))); do
    BASE=$(grep -o 'listening on http://[0-9.:]*' "$RAW/${cfg}_serve.log" | head -1 | sed 's/listening on //')
    [ -n "$BASE" ] && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.5
  done
  if [ -z "$BASE" ]; then
    log "$cfg: the daemon did not start (see raw/${cfg}_serve.log)"
    tail -5 "$RAW/${cfg}_serve.log" >>"$LOG"
    stop_server
    continue
  fi
  log "$cfg: ready at $BASE after $(( $(date +%s) - t_start )) s (planned $START_S s)"
  if [ $first = 1 ] && [ "$PREFILL_RUNS" -gt 0 ]; then
    timeout $(( PREFILL_S + 30 )) python3 "$HERE/serve_matrix.py" prefill --base "$BASE" --model matrix \
      --tokens "$PREFILL_TOKENS" --runs "$PREFILL_RUNS" --config "$cfg" --out "$RAW/prefill.json" >>"$LOG" 2>&1 ||
      log "$cfg: the prefill point failed"
    log "$cfg: prefill point done"
  fi
  first=0
  scrape "$RAW/${cfg}_c0_metrics.txt"
  for c in $CONCURRENCY; do
    planned=$(point_s "$c")
    if [ $(( $(date +%s) + planned + STOP_S )) -gt "$DEADLINE" ]; then
      log "$cfg c=$c skipped: it would end past the budget"
      continue
    fi
    log "$cfg c=$c: sparkd-replay run --concurrency $c --duration $DURATION (planned $planned s)"
    limit=$(( DEADLINE - $(date +%s) - STOP_S ))
    [ "$limit" -gt $(( planned + 60 )) ] && limit=$(( planned + 60 ))
    timeout "$limit" "$BIN/sparkd-replay" run --url "$BASE" --traces "$TRACES" --transport ws --model matrix $REPLAY_GPUS \
      --concurrency "$c" --duration "$DURATION" --grace "$GRACE" --token-scale "$TOKEN_SCALE" \
      --time-scale "$TIME_SCALE" --quiet $REPLAY_ARGS --out "$RAW/${cfg}_c${c}.json" >>"$LOG" 2>&1 || log "$cfg c=$c: the replay failed"
    scrape "$RAW/${cfg}_c${c}_metrics.txt"
  done
  stop_server
  log "$cfg: stopped"
done

log "report"
python3 "$HERE/serve_matrix.py" report --raw "$RAW" --configs "$CONFIGS" --concurrency "$CONCURRENCY" --out "$OUT" \
  >>"$LOG" 2>&1
rc=$?
cat "$OUT/matrix.md" 2>/dev/null
tar czf "$OUT/raw.tar.gz" -C "$OUT" raw && rm -rf "$RAW"
log "done in $(( $(date +%s) - T0 )) s (planned $PLANNED s), report rc=$rc"
exit $rc
