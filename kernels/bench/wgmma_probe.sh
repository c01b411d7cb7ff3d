#!/usr/bin/env bash
# The wgmma probe, on the GPU machine (nvcc, no Rust needed): builds kernels/bench/wgmma_probe.cu for sm_90a and runs
# it; the report goes to stdout and $OUT/wgmma_probe.txt. It asks whether wgmma keeps a token's bits whatever the batch.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-/tmp}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
"$NVCC" -gencode=arch=compute_90a,code=sm_90a -O2 -std=c++17 -o "$OUT/wgmma_probe" wgmma_probe.cu -lcuda
"$OUT/wgmma_probe" | tee "$OUT/wgmma_probe.txt"
