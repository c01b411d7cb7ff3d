#!/usr/bin/env bash
# Same bits on the H200, in one device call (under 600 s), for a change that must not move any number: build $NEW
# runs run_h200.sh's correctness steps (validate, every GPU test binary, serve_check, validate_tiny256), then build
# $BASE runs the same two validations, and the reports are compared field by field without their timings.
# Writes under $OUT: log.txt, validate.json, validate_base.json, validate_tiny256.json, validate_tiny256_base.json,
# serve.json; prints "IDENTICAL to base" or the differences.
# Usage: NEW=.bin/new BASE=.bin/base bash kernels/bench/same_bits_h200.sh (builds staged by kernels/bench/stage.sh)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NEW=${NEW:?}; BASE=${BASE:?}
BIN=$NEW BEFORE=$BASE ONLY="validate cuda_runner cuda_sample cuda_attn cuda_gemm cuda_drafter cuda_moe cuda_rows serve_check validate_tiny256" \
  bash kernels/bench/run_h200.sh
. kernels/bench/device_env.sh "$NEW" "$BASE"
timeout 60 "$BASE/sparkd" validate --device cuda --config k3-tiny --out "$OUT/validate_base.json" >>"$OUT/log.txt" 2>&1
timeout 60 "$BASE/sparkd" validate --device cuda --config k3-tiny --positions 256 --batch 1 --max-window 1 \
  --out "$OUT/validate_tiny256_base.json" >>"$OUT/log.txt" 2>&1
python3 - "$OUT" <<'PY'
import json, sys, os
o = sys.argv[1]
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if not any(t in k for t in ("ms", "time", "seconds", "device", "elapsed"))}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
for a, b in (("validate.json", "validate_base.json"), ("validate_tiny256.json", "validate_tiny256_base.json")):
    try:
        A, B = strip(json.load(open(os.path.join(o, a)))), strip(json.load(open(os.path.join(o, b))))
        print(a, "IDENTICAL to base" if A == B else "DIFFERS from base")
        if A != B:
            sa, sb = json.dumps(A, indent=1).splitlines(), json.dumps(B, indent=1).splitlines()
            import difflib
            print("\n".join(list(difflib.unified_diff(sb, sa, lineterm=""))[:80]))
    except Exception as e:
        print(a, "compare failed:", e)
PY
