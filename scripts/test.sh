#!/usr/bin/env bash
# The project's test command (README "Pass the tests"): installs what the tests need, idempotently,
# checks formatting (rustfmt) and lints (clippy, warnings as errors), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
# A clean checkout builds once: incremental caches would only double the target folder (CI's disk is small).
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi

# Python clients used by black-box tests (the `openai` package as a streaming client, `tokenizers` and
# `transformers` to check the exported Hugging Face tokenizer). Installed only when missing.
if command -v python3 >/dev/null 2>&1; then
    python3 -c "import openai, tokenizers, transformers, jinja2" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check openai tokenizers transformers jinja2
    # NVRTC 13.0 and the CUDA headers, so the kernel compile check (kernels/tests/cuda_compile.rs) runs without a GPU.
    [ -e target/nvrtc-wheels/nvidia/cu13/lib/libnvrtc.so.13 ] || python3 -m pip install --quiet --disable-pip-version-check --target target/nvrtc-wheels "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" || true
    export SPARKD_NVRTC_WHEELS="$PWD/target/nvrtc-wheels"
fi

# Debian's Prometheus (tests/tests/dashboards.rs evaluates every dashboard panel and rule against a real one, and
# runs promtool), Chromium (the replay's HTML report is rendered headless) and nginx (tests/tests/affinity_nginx.rs
# puts two daemons behind it). Installed only when missing.
missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Formatting and lints before the tests; the toolchain's rustfmt and clippy are added only when missing.
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

cargo build --workspace --bins
cargo test --workspace --no-fail-fast
