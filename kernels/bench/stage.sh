#!/usr/bin/env bash
# Stages a build of the current tree for a GPU machine without a Rust toolchain, into DIR (git-ignored, e.g. .bin/x):
#   DIR/sparkd            the release daemon (stripped)
#   DIR/<test>            the GPU test binaries named (default: all of them), stripped
#   DIR/kc/*.cubin        the kernel cache filled by NVRTC here (the cuda_compile test), so the device does not compile
# Then carry DIR to the device and run kernels/bench/run_h200.sh (BIN=DIR) or kernels/bench/ab_h200.sh (BUILDS=...).
# Needs NVRTC here: SPARKD_NVRTC_WHEELS names a folder holding nvidia/cu13/{lib,include} (the nvidia-cuda-nvrtc wheel).
# A CUBIN's cache key includes the include path it was compiled with, and run_h200.sh / ab_h200.sh point
# /work/nvrtc-wheels/nvidia/cu13/include at the device's headers, so stage with SPARKD_NVRTC_WHEELS=/work/nvrtc-wheels
# for the device to find the cache (otherwise it compiles the kernels itself at start-up).
# Usage: SPARKD_NVRTC_WHEELS=/path/to/wheels bash kernels/bench/stage.sh DIR [test ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:?usage: stage.sh DIR [test ...]}
shift
TESTS=("$@")
[ ${#TESTS[@]} -eq 0 ] && TESTS=(cuda_runner cuda_sample cuda_attn cuda_gemm cuda_drafter cuda_moe cuda_rows)
: "${SPARKD_NVRTC_WHEELS:?SPARKD_NVRTC_WHEELS names the folder with nvidia/cu13 (NVRTC) for filling the kernel cache}"
cargo build --release -p sparkd
rm -rf "$DIR" && mkdir -p "$DIR/kc"
cp "${CARGO_TARGET_DIR:-target}/release/sparkd" "$DIR/" && strip "$DIR/sparkd"
for t in "${TESTS[@]}"; do
  exe=$(cargo test -p sparkd-kernels --no-run --test "$t" --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -1)
  [ -n "$exe" ] || { echo "no test binary for $t" >&2; exit 1; }
  cp "$exe" "$DIR/$t" && strip "$DIR/$t"
done
SPARKD_FILL_KERNEL_CACHE="$(cd "$DIR" && pwd)/kc" cargo test -p sparkd-kernels --test cuda_compile \
  the_kernel_cache_can_be_filled 2>&1 | grep "test result"
ls "$DIR/kc"/*.cubin >/dev/null 2>&1 || { echo "the kernel cache under $DIR/kc is empty" >&2; exit 1; }
du -sh "$DIR"
