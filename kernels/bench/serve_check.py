"""Drives a running `sparkd serve` once: a greedy and a sampled (temperature, top-p, log-probabilities) streaming
chat completion over SSE, then a two-turn
WebSocket Responses session (the second turn continues the first by previous_response_id).
Prints one JSON object with what came back and how long it took (time to first token, tokens/s).

Usage: python3 serve_check.py --base http://127.0.0.1:8000 [--out serve.json]
"""

import argparse
import asyncio
import json
import time

import aiohttp


async def sse_events(response):
    """The parsed `data:` events of an SSE response, up to `[DONE]` (comments and other lines skipped)."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def chat_stream(session, base, model, max_tokens, sampling=None):
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a haiku about GPUs."}]}
    body.update(sampling or {})
    t0 = time.perf_counter()
    first, chunks, text, usage, logprobs = None, 0, "", None, 0
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        status = r.status
        async for ev in sse_events(r):
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                logprobs += len((ch.get("logprobs") or {}).get("content") or [])
                delta = ch.get("delta", {}).get("content") or ""
                if delta:
                    first = first or time.perf_counter()
                    chunks += 1
                    text += delta
    t1 = time.perf_counter()
    out_tokens = (usage or {}).get("completion_tokens", chunks)
    return {"status": status, "ttft_s": (first - t0) if first else None, "total_s": t1 - t0, "chunks": chunks,
            "usage": usage, "text": text[:200], "logprob_entries": logprobs,
            "decode_tokens_per_s": (out_tokens - 1) / (t1 - first) if first and out_tokens > 1 and t1 > first else None}


async def ws_turn(ws, msg):
    t0 = time.perf_counter()
    await ws.send_json(msg)
    first, deltas, text, types = None, 0, "", []
    while True:
        ev = await ws.receive_json(timeout=300)
        types.append(ev.get("type"))
        if ev.get("type") == "response.output_text.delta":
            first = first or time.perf_counter()
            deltas += 1
            text += ev.get("delta", "")
        if ev.get("type") in ("response.completed", "response.incomplete", "error"):
            resp = ev.get("response", ev)
            return {"final_type": ev.get("type"), "id": resp.get("id"), "usage": resp.get("usage"),
                    "previous_response_id": resp.get("previous_response_id"), "deltas": deltas,
                    "ttft_s": (first - t0) if first else None, "total_s": time.perf_counter() - t0,
                    "event_types": sorted(set(t for t in types if t)), "text": text[:200],
                    "error": ev if ev.get("type") == "error" else None}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    report = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.get(f"{args.base}/v1/models") as r:
            models = await r.json()
        model = models["data"][0]["id"]
        report["model"] = model
        report["chat_stream"] = await chat_stream(s, args.base, model, args.max_tokens)
        report["chat_stream_sampled"] = await chat_stream(
            s, args.base, model, args.max_tokens,
            {"temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": True, "top_logprobs": 3})
        async with s.ws_connect(f"{args.base.replace('http', 'ws', 1)}/v1/responses") as ws:
            t1 = await ws_turn(ws, {"type": "response.create", "stream_id": "main", "model": model,
                                    "instructions": "You are a coding agent.", "input": "List the files.",
                                    "max_output_tokens": args.max_tokens, "temperature": 0})
            t2 = await ws_turn(ws, {"type": "response.create", "stream_id": "main", "model": model,
                                    "previous_response_id": t1["id"], "input": "Now read main.rs.",
                                    "max_output_tokens": args.max_tokens, "temperature": 0})
        report["ws_turns"] = [t1, t2]
        async with s.get(f"{args.base}/metrics") as r:
            metrics = await r.text()
        report["metrics_sample"] = [l for l in metrics.splitlines()
                                    if l.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                                     "vllm:prefix_cache_hits", "sparkd:"))][:20]
    text = json.dumps(report, indent=1)
    if args.out:
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    asyncio.run(main())
