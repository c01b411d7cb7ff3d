#!/usr/bin/env bash
# Constrained output served on the GPU: for each server config, `sparkd serve` on a free loopback port, then
# kernels/bench/constrained_check.py at each concurrency (plain, JSON-schema and required-tool-call requests: ITL,
# validity, the engine's mask time per step and step phase from /metrics), then the daemon stopped.
# Writes under $OUT: log.txt, <config>_c<N>.json, <config>_serve.log.
# Settings (environment):
#   BIN=DIR        staged binaries (kernels/bench/stage.sh): sparkd, kc/ (required)
#   CONFIGS        "off dspark al3" (off: no speculation; sync: no speculation and no step launched ahead, the
#                  plain requests' fair baseline, since a constrained step is never launched ahead; dspark: --spec dspark with its own drafts; al3: --spec dspark
#                  --spec-synthetic-al 3, forced acceptance, which emits several tokens per step)
#   CONCURRENCY    "1 8"     REQUESTS 16 (per kind and point)     MAX_TOKENS 96
#   DEVICE cuda, MODEL k3-mini, SERVE_ARGS (more `sparkd serve` flags), START_LIMIT 180
# Dry run on the CPU: DEVICE=cpu MODEL=k3-tiny CONFIGS=off CONCURRENCY=2 REQUESTS=4 BIN=target/release-like-dir \
#   PYTHON=/path/to/python-with-aiohttp OUT=/tmp/c bash kernels/bench/constrained_h200.sh
set -u
BIN=${BIN:?BIN names the staged folder holding sparkd}
OUT=${OUT:-/tmp/out}
CONFIGS=${CONFIGS:-off dspark al3}
CONCURRENCY=${CONCURRENCY:-1 8}
REQUESTS=${REQUESTS:-16}
MAX_TOKENS=${MAX_TOKENS:-96}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-k3-mini}
SERVE_ARGS=${SERVE_ARGS:-}
START_LIMIT=${START_LIMIT:-180}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
LOG="$OUT/log.txt"
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "=== $(date -u +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
config_args() {
  case "$1" in
    off) echo "--spec off" ;;
    sync) echo "--spec off --async-scheduling off" ;;
    dspark) echo "--spec dspark" ;;
    al3) echo "--spec dspark --spec-synthetic-al 3" ;;
    *) echo "unknown config $1" >&2; return 1 ;;
  esac
}
SERVER=""
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -INT "$SERVER" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=""
}
trap stop_server EXIT
for cfg in $CONFIGS; do
  # shellcheck disable=SC2046 # one word per flag
  set -- $(config_args "$cfg") $SERVE_ARGS
  log "$cfg: sparkd serve --device $DEVICE --synthetic $MODEL --port 0 $*"
  "$BIN/sparkd" serve --device "$DEVICE" --synthetic "$MODEL" --host 127.0.0.1 --port 0 "$@" \
    >"$OUT/${cfg}_serve.log" 2>&1 &
  SERVER=$!
  BASE=""
  for _ in $(seq 1 $(( START_LIMIT * 2 ))); do
    BASE=$(grep -o 'listening on http://[0-9.:]*' "$OUT/${cfg}_serve.log" | head -1 | sed 's/listening on //')
    [ -n "$BASE" ] && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.5
  done
  if [ -z "$BASE" ]; then
    log "$cfg: the daemon did not start"
    tail -5 "$OUT/${cfg}_serve.log" >>"$LOG"
    stop_server
    continue
  fi
  log "$cfg: ready at $BASE"
  for c in $CONCURRENCY; do
    line=$(timeout 240 "$PYTHON" "$HERE/constrained_check.py" --base "$BASE" --concurrency "$c" \
      --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --out "$OUT/${cfg}_c${c}.json" 2>>"$LOG") ||
      log "$cfg c=$c failed"
    log "$cfg c=$c: $line"
  done
  stop_server
done
log "done"
