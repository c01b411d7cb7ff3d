#!/usr/bin/env bash
# AIPerf (the AgentX reference client) replaying Weka traces against `sparkd serve --device null`.
# Not part of the default CI run: it installs aiperf==0.13.0 from PyPI (about 1.2 GB, ~2 min the first time).
#
# What it checks: AIPerf finishes with exit status 0, reports no request errors, completed requests > 0, and
# parsed the daemon's `usage` (prompt tokens) including cached tokens (usage_prompt_cache_read_tokens > 0).
# Facts used (shared/reference/aiperf-offline.md): the tokenizer goes into a fake HF-cache layout so that
# HF_HUB_OFFLINE=1 works (§3 Fix A); plain weka_trace with --ignore-trace-delays is the quick functional mode
# (§4 run E); the dataset mmap cache is redirected so nothing is left in the home folder (§5).
#
# Environment: SPARKD_BIN (default: built with cargo into CARGO_TARGET_DIR), SPARKD_WORKLOADS (default
# ../shared/workloads next to the repository root), AIPERF_VENV (default $CARGO_TARGET_DIR/aiperf-venv, or
# target/aiperf-venv), AIPERF_DURATION (seconds, default 20), AIPERF_TRACES (default three small traces).
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
venv="${AIPERF_VENV:-$target/aiperf-venv}"
workloads="${SPARKD_WORKLOADS:-$root/../shared/workloads}"
duration="${AIPERF_DURATION:-20}"
traces="${AIPERF_TRACES:-trace_0538.json trace_0291.json trace_0277.json}"

if [ ! -d "$workloads/weka-kv-cache-tester" ]; then
    echo "SKIPPED: no Weka traces under $workloads (set SPARKD_WORKLOADS)"
    exit 0
fi

# 1. aiperf, pinned, installed once.
if ! "$venv/bin/aiperf" --version 2>/dev/null | grep -q "0.13.0"; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "aiperf==0.13.0"
fi

# 2. The daemon binary and its tokenizer, as a Hugging Face folder inside a fake HF cache.
bin="${SPARKD_BIN:-}"
if [ -z "$bin" ]; then
    (cd "$root" && CARGO_TARGET_DIR="$target" cargo build --quiet -p sparkd --bin sparkd)
    bin="$target/debug/sparkd"
fi
work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
snapshot="$work/hf/hub/models--local--sparkd-tok/snapshots/0000000000000000000000000000000000000000"
mkdir -p "$snapshot" "$work/hf/hub/models--local--sparkd-tok/refs" "$work/traces" "$work/mmap"
printf '0000000000000000000000000000000000000000' > "$work/hf/hub/models--local--sparkd-tok/refs/main"
"$bin" tokenizer --export "$snapshot" > /dev/null
for t in $traces; do cp "$workloads/weka-kv-cache-tester/$t" "$work/traces/"; done

# 3. The daemon on a free loopback port (it logs "listening on http://HOST:PORT").
"$bin" serve --device null --host 127.0.0.1 --port 0 2> "$work/sparkd.log" &
server_pid=$!
port=""
for _ in $(seq 1 600); do
    port="$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$work/sparkd.log" | head -n1)"
    [ -n "$port" ] && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/sparkd.log"; echo "sparkd exited before listening"; exit 1; }
    sleep 0.1
done
[ -n "$port" ] || { echo "sparkd did not start listening"; exit 1; }

# 4. AIPerf: plain weka_trace replay, back to back, bounded by time.
HF_HOME="$work/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 AIPERF_DATASET_MMAP_CACHE_DIR="$work/mmap" \
    "$venv/bin/aiperf" profile --url "http://127.0.0.1:$port" --endpoint-type chat --streaming \
    --model k3-tiny --tokenizer local/sparkd-tok --custom-dataset-type weka_trace --input-file "$work/traces/" \
    --concurrency 2 --benchmark-duration "$duration" --ignore-trace-delays --random-seed 42 \
    --use-server-token-count --artifact-dir "$work/artifacts" --ui-type simple

# 5. Checks on AIPerf's own export.
"$venv/bin/python" - "$work/artifacts/profile_export_aiperf.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
def avg(key):
    v = r.get(key)
    return v.get("avg") if isinstance(v, dict) else v
completed = avg("completed_request_count") or avg("request_count") or 0
errors = r.get("error_summary") or []
error_rate = avg("request_error_rate") or 0
prompt = avg("usage_prompt_tokens") or 0
cached = avg("usage_prompt_cache_read_tokens") or 0
print(f"aiperf: {completed} requests, error rate {error_rate}%, usage prompt tokens avg {prompt}, "
      f"cached avg {cached}, cache read {avg('overall_usage_prompt_cache_read_pct')}%")
problems = []
if completed <= 0: problems.append("no request completed")
if errors or error_rate: problems.append(f"errors: {errors}")
if prompt <= 0: problems.append("AIPerf parsed no usage.prompt_tokens")
if cached <= 0: problems.append("AIPerf parsed no usage.prompt_tokens_details.cached_tokens")
if problems:
    sys.exit("FAILED: " + "; ".join(problems))
print("aiperf replay OK")
EOF
