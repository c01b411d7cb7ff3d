#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for a bounded time and fails if one crashes. Outside CI (scripts/test.sh does
# not call it): it needs the nightly toolchain and takes a few minutes more than SECONDS_PER_TARGET times the number
# of targets.
#
# Usage: [FUZZ_KEEP_MAX_BYTES=N] scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 60)
#
# Each target reads its committed corpus, fuzz/corpus/<target>/, which a run leaves as it is, and a working corpus,
# fuzz/target/corpus/<target>/ (not in git), which keeps what earlier runs found, receives what this run finds and is
# minimized afterwards (cargo fuzz cmin). Dictionaries: fuzz/dicts/<target>.dict. With FUZZ_KEEP_MAX_BYTES=N (512
# made the committed corpora), the fewest working inputs of at most N bytes that reach every code edge they reach
# beyond the committed corpus are then added to it (libFuzzer's -set_cover_merge=1 over edges), which keeps the
# committed corpora small.
#
# A crash (a panic, a failed check, a leak, more than 30 s on one input, more than 2 GB of memory) leaves its input
# in fuzz/artifacts/<target>/; `cargo +nightly fuzz run <target> <file>` in fuzz/ replays it.
set -euo pipefail

seconds="${1:-60}"
keep="${FUZZ_KEEP_MAX_BYTES:-}"
if ! [[ "$seconds" =~ ^[0-9]+$ && "$keep" =~ ^[0-9]*$ ]]; then
    echo "usage: [FUZZ_KEEP_MAX_BYTES=N] $0 [SECONDS_PER_TARGET]" >&2
    exit 2
fi
cd "$(dirname "$0")/../fuzz"

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
cargo +nightly fuzz build

failed=()
for target in $(cargo +nightly fuzz list); do
    work="target/corpus/$target"
    mkdir -p "$work" "corpus/$target"
    flags=(-timeout=30 -rss_limit_mb=2048)
    [[ -f "dicts/$target.dict" ]] && flags+=(-dict="dicts/$target.dict")
    echo "== $target: ${seconds}s"
    if ! cargo +nightly fuzz run "$target" "$work" "corpus/$target" -- "${flags[@]}" \
        -max_total_time="$seconds" -print_final_stats=1; then
        failed+=("$target")
        continue
    fi
    cargo +nightly fuzz cmin "$target" "$work"
    if [[ -n "$keep" ]]; then
        small="target/keep/$target"
        rm -rf "$small"
        mkdir -p "$small"
        find "$work" -type f -size -"$((keep + 1))"c -exec cp {} "$small" \;
        cargo +nightly fuzz run "$target" "corpus/$target" "$small" -- "${flags[@]}" -set_cover_merge=1 -use_counters=0
    fi
done

if ((${#failed[@]})); then
    echo "crashed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "no crash in ${seconds}s per target"
