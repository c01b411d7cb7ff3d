#!/usr/bin/env python3
"""Speculative decoding measured through the daemon: starts `sparkd serve` once per setting, sends
`--batch` concurrent greedy /v1/completions requests (token prompts, ignore_eos), and prints, per
setting and batch, the wall tokens/s of the batch and the target steps per generated token
(from each response's usage and `metrics.speculative_decoding`).

Usage: scripts/spec_daemon_bench.py SPARKD_BIN [--batch 1,8] [--max-tokens 61]
Only the standard library; the server listens on an ephemeral loopback port.
"""

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request

SETTINGS = {
    "off": [],
    "dspark AL6 l7": ["--spec", "dspark", "--num-spec-tokens", "7", "--spec-synthetic-al", "6"],
    "suffix AL6 l7": ["--spec", "suffix", "--num-spec-tokens", "7", "--spec-synthetic-al", "6"],
}


def start(binary, extra):
    proc = subprocess.Popen(
        [binary, "serve", "--device", "cpu", "--port", "0", *extra],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "listening on http://" in line:
            port = int(line.rsplit(":", 1)[1])
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"sparkd exited before listening ({proc.wait()})")


def post(base, body):
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def target_steps(response):
    """Steps that produced the response's tokens: each verify step emits accepted + 1 tokens, each step
    without drafts (the prefill's first token included) emits one."""
    tokens = response["usage"]["completion_tokens"]
    spec = response.get("metrics", {}).get("speculative_decoding", {})
    verify = spec.get("num_spec_steps", 0)
    plain = tokens - verify - spec.get("num_accepted_draft_tokens", 0)
    return verify + plain


def run_batch(base, batch, max_tokens):
    results = [None] * batch

    def one(i):
        prompt = [(j * 7919 + i * 104729 + 13) % 100000 for j in range(32)]
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        results[i] = post(base, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    steps = sum(target_steps(r) for r in results)
    al = [r["metrics"]["speculative_decoding"]["mean_acceptance_length"] for r in results if "metrics" in r]
    return tokens / seconds, steps / tokens, (sum(al) / len(al) if al else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=61)
    args = ap.parse_args()
    print("setting          batch  tok/s   steps/token  AL")
    for name, extra in SETTINGS.items():
        proc, base = start(args.binary, extra)
        try:
            run_batch(base, 1, 7)  # warm-up
            for batch in [int(b) for b in args.batch.split(",")]:
                tps, spt, al = run_batch(base, batch, args.max_tokens)
                al_text = f"{al:.3f}" if al is not None else "-"
                print(f"{name:16} {batch:5}  {tps:6.1f}  {spt:11.3f}  {al_text}")
                sys.stdout.flush()
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
