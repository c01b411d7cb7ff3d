"""Drives a running `sparkd serve` with constrained and unconstrained streamed chat completions at one concurrency
and reports what each kind costs per token: the client's inter-chunk times (ITL), tokens per second per request,
finish reasons, and whether every constrained reply is valid (JSON that matches the schema; a required tool call
whose arguments match the function's parameters). The engine's own view comes from /metrics, read before and after:
`sparkd:constraint_mask_seconds` (host time computing one step's masks, asked once the forward is launched) and the
`step` phase of `sparkd:engine_phase_seconds`.

Kinds (the same prompt and max_tokens; each request seeded by its index, temperature 0.8):
  plain    no constraint (the baseline)
  schema   response_format json_schema (strict), a schema whose replies end well inside max_tokens
  tool     tools with tool_choice required (the call's arguments follow the function's schema)

Prints one summary line; --out writes the whole report as JSON.

Usage: python3 constrained_check.py --base http://127.0.0.1:8000 --concurrency 4 --requests 16 [--out r.json]
"""

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

from serve_check import sse_events

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 8},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                             "required": ["city", "days"], "additionalProperties": False}}}


def is_person(v):
    return (isinstance(v, dict) and set(v) == {"name", "age", "tags", "ok"}
            and isinstance(v["name"], str) and len(v["name"]) <= 6
            and isinstance(v["age"], int) and 0 <= v["age"] <= 120
            and isinstance(v["tags"], list) and len(v["tags"]) <= 3 and all(t in ("a", "b", "c") for t in v["tags"])
            and isinstance(v["ok"], bool))


def is_weather(v):
    return (isinstance(v, dict) and set(v) == {"city", "days"} and isinstance(v["city"], str)
            and len(v["city"]) <= 8 and isinstance(v["days"], int) and 1 <= v["days"] <= 7)


def body_of(kind, model, index, max_tokens):
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.8, "seed": index,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Describe someone, then check the weather where they live."}]}
    if kind == "schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    elif kind == "tool":
        body["tools"] = [TOOL]
        body["tool_choice"] = "required"
    return body


async def one(session, base, kind, model, index, max_tokens):
    t0 = time.perf_counter()
    times, text, args, finish, usage = [], "", {}, None, None
    async with session.post(f"{base}/v1/chat/completions", json=body_of(kind, model, index, max_tokens)) as r:
        if r.status != 200:
            return {"kind": kind, "status": r.status, "error": (await r.text())[:300]}
        async for ev in sse_events(r):
            usage = ev.get("usage") or usage
            for ch in ev.get("choices", []):
                delta = ch.get("delta", {})
                got = False
                if delta.get("content"):
                    text += delta["content"]
                    got = True
                for call in delta.get("tool_calls") or []:
                    i = call.get("index", 0)
                    args[i] = args.get(i, "") + (call.get("function", {}).get("arguments") or "")
                    got = True
                if got:
                    times.append(time.perf_counter())
                finish = ch.get("finish_reason") or finish
    valid = None
    try:
        if kind == "schema":
            valid = is_person(json.loads(text))
        elif kind == "tool":
            valid = len(args) >= 1 and all(is_weather(json.loads(a)) for a in args.values())
    except ValueError:
        valid = False
    tokens = (usage or {}).get("completion_tokens", len(times))
    span = times[-1] - times[0] if len(times) > 1 else None
    return {"kind": kind, "status": 200, "finish": finish, "valid": valid, "tokens": tokens, "chunks": len(times),
            "ttft_s": times[0] - t0 if times else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])],
            "tokens_per_s": (tokens - 1) / span if span and tokens > 1 else None}


def metric_sums(text, name, label=None):
    """(sum, count) of histogram `name` (with `label` in its labels, if given) in a /metrics text."""
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{name}_{part}") and (label is None or label in line):
                total[part] += float(line.rsplit(" ", 1)[1])
    return total["sum"], total["count"]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kinds", default="plain schema tool")
    ap.add_argument("--out")
    args = ap.parse_args()
    report = {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.get(f"{args.base}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        # The first constrained request builds the tokenizer's description for llguidance: not timed.
        await one(s, args.base, "schema", model, 10_000, 8)
        for kind in args.kinds.split():
            async with s.get(f"{args.base}/metrics") as r:
                before = await r.text()
            gate = asyncio.Semaphore(args.concurrency)

            async def run(i, kind=kind):
                async with gate:
                    return await one(s, args.base, kind, model, i, args.max_tokens)

            t0 = time.perf_counter()
            results = await asyncio.gather(*(run(i) for i in range(args.requests)))
            wall = time.perf_counter() - t0
            async with s.get(f"{args.base}/metrics") as r:
                after = await r.text()
            ok = [x for x in results if x["status"] == 200]
            itl = [t for x in ok for t in x["itl_s"]]
            mask = [a - b for a, b in zip(metric_sums(after, "sparkd:constraint_mask_seconds"),
                                          metric_sums(before, "sparkd:constraint_mask_seconds"))]
            step = [a - b for a, b in zip(metric_sums(after, "sparkd:engine_phase_seconds", 'phase="step"'),
                                          metric_sums(before, "sparkd:engine_phase_seconds", 'phase="step"'))]
            rates = [x["tokens_per_s"] for x in ok if x["tokens_per_s"]]
            report[kind] = {
                "ok": len(ok), "errors": [x for x in results if x["status"] != 200][:3],
                "valid": sum(1 for x in ok if x["valid"]) if kind != "plain" else None,
                "finish": {f: sum(1 for x in ok if x["finish"] == f) for f in {x["finish"] for x in ok}},
                "tokens_mean": statistics.mean(x["tokens"] for x in ok) if ok else None,
                "itl_p50_ms": 1e3 * pct(itl, 0.5) if itl else None,
                "itl_p90_ms": 1e3 * pct(itl, 0.9) if itl else None,
                "tokens_per_s_per_request_p50": pct(rates, 0.5),
                "tokens_total_per_s": sum(x["tokens"] for x in ok) / wall,
                "mask_steps": mask[1], "mask_ms_per_step": 1e3 * mask[0] / mask[1] if mask[1] else None,
                "step_phase_ms": 1e3 * step[0] / step[1] if step[1] else None,
                "sample_reply": next((x for x in ok), None) and {k: v for k, v in ok[0].items() if k != "itl_s"},
            }
    if args.out:
        open(args.out, "w").write(json.dumps(report, indent=1))
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    print("; ".join(f"{kind}: ok {v['ok']} valid {v['valid']} finish {v['finish']} itl p50/p90 "
                    f"{fmt(v['itl_p50_ms'], '.2f')}/{fmt(v['itl_p90_ms'], '.2f')} ms, "
                    f"{fmt(v['tokens_per_s_per_request_p50'], '.1f')} tok/s/request, "
                    f"mask {fmt(v['mask_ms_per_step'], '.3f')} ms/step over {v['mask_steps']:.0f} steps, "
                    f"step phase {fmt(v['step_phase_ms'], '.2f')} ms"
                    for kind, v in report.items() if isinstance(v, dict)))


if __name__ == "__main__":
    asyncio.run(main())
