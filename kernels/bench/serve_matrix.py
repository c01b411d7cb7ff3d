"""The served replay matrix (kernels/bench/serve_matrix_h200.sh): its helpers and its report. Python 3 stdlib only.

  scrape  --base URL --out FILE            GET /metrics once into FILE
  prefill --base URL --model NAME --tokens N --runs R --config C --out FILE
                                           R timed long-prompt requests (N distinct prompt tokens, one output token)
                                           after one warm-up; writes the prefill tokens/s of each
  report  --raw DIR --configs "off al3" --concurrency "1 4" --out DIR
                                           matrix.md (one table) and pareto.svg (one curve per config) from
                                           DIR/<config>_c<N>.json (sparkd-replay run reports) and the /metrics
                                           scrapes around each point, DIR/<config>_c<N>_metrics.txt

Every number of a replay point is the replay's own (its summary: ITL, TTFT, P90 interactivity = 1 / P90 ITL, total
tokens/s per GPU, pooled acceptance length); nothing is recomputed here. The engine phase times of a point are the
deltas of sparkd:engine_phase_seconds between the scrape before the point and the scrape after it, per device step
(delta sum of a phase / delta count of the step phase). A missing input is named on stderr and the exit status is 1
(the report is still written with what there is).
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time
import urllib.request
from xml.sax.saxutils import escape

PHASE = "sparkd:engine_phase_seconds"
# The phase columns of the table, in loop order; `commands` and `memory` are summed into `other`.
PHASE_COLUMNS = ["admit", "draft", "schedule", "step", "apply", "emit", "other", "idle"]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def http(url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def cmd_scrape(args):
    text = http(args.base + "/metrics", timeout=30)
    with open(args.out, "wb") as f:
        f.write(text)


def cmd_prefill(args):
    rng = random.Random(31)
    results = []
    for i in range(args.runs + 1):
        # Distinct ids every request, so the prefix cache never serves a prompt.
        prompt = [rng.randrange(1000, 100000) for _ in range(args.tokens)]
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        answer = json.loads(http(args.base + "/v1/completions", body))
        seconds = time.perf_counter() - t0
        prompt_tokens = answer.get("usage", {}).get("prompt_tokens")
        if prompt_tokens != args.tokens:
            sys.exit(f"prefill: the server counted {prompt_tokens} prompt tokens, not {args.tokens}: {answer}")
        row = {"warmup": i == 0, "seconds": seconds, "tokens_per_s": args.tokens / seconds}
        print(f"prefill {'warm-up' if i == 0 else i}: {args.tokens} tokens in {seconds * 1e3:.1f} ms = "
              f"{row['tokens_per_s']:.0f} tok/s", flush=True)
        results.append(row)
    timed = sorted(r["seconds"] for r in results if not r["warmup"])
    median = timed[len(timed) // 2]
    out = {"config": args.config, "prompt_tokens": args.tokens, "max_tokens": 1, "runs": results,
           "median_seconds": median, "median_tokens_per_s": args.tokens / median}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


def parse_metrics(path):
    """{(name, frozenset(labels)): value} of a Prometheus text exposition."""
    samples = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            m = SAMPLE.match(line)
            if not m:
                continue
            labels = frozenset((k, v) for k, v in LABEL.findall(m.group(2) or "") if k not in ("model_name", "engine"))
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def phase_totals(samples):
    """{phase: (sum seconds, count)} of the engine phase histogram."""
    out = {}
    for (name, labels), value in samples.items():
        if name in (PHASE + "_sum", PHASE + "_count"):
            phase = dict(labels).get("phase")
            s, c = out.get(phase, (0.0, 0.0))
            out[phase] = (s + value, c) if name.endswith("_sum") else (s, c + value)
    return out


def phases_per_step(before, after):
    """Mean ms per device step of each phase column between two scrapes; None without steps."""
    a, b = phase_totals(before), phase_totals(after)
    if "step" not in b:
        raise ValueError(f"{PHASE} has no step series: is the daemon older than the phase histograms?")
    delta = {p: (b[p][0] - a.get(p, (0, 0))[0], b[p][1] - a.get(p, (0, 0))[1]) for p in b}
    steps = delta["step"][1]
    if steps <= 0:
        return None
    ms = {p: 1e3 * s / steps for p, (s, _) in delta.items()}
    ms["other"] = ms.get("commands", 0.0) + ms.get("memory", 0.0)
    ms["steps"] = steps
    return ms


def phase_buckets(samples):
    """{phase: [(le, cumulative count)]} of the engine phase histogram, bounds ascending (+Inf last)."""
    out = {}
    for (name, labels), value in samples.items():
        if name == PHASE + "_bucket":
            d = dict(labels)
            out.setdefault(d.get("phase"), []).append((float(d["le"]), value))
    return {p: sorted(b) for p, b in out.items()}


def phase_tails(before, after, quantiles=(0.5, 0.9, 0.99), slow_s=0.005):
    """{phase: ({q: upper bound ms of the bucket holding quantile q}, samples, samples over slow_s)} between two
    scrapes: where a phase's time goes in its tail (a mean hides one 20 ms export among a thousand 50 µs laps)."""
    a, b = phase_buckets(before), phase_buckets(after)
    out = {}
    for phase, buckets in b.items():
        old = dict(a.get(phase, []))
        delta = [(le, n - old.get(le, 0.0)) for le, n in buckets]
        total = delta[-1][1] if delta else 0.0
        if total <= 0:
            continue
        qs = {q: next(1e3 * le for le, n in delta if n >= q * total) for q in quantiles}
        fast = max((n for le, n in delta if le <= slow_s), default=0.0)
        out[phase] = (qs, total, total - fast)
    return out


def tails_table(points):
    """Markdown: per point and phase, the p50 / p90 / p99 bucket bounds and the laps slower than 5 ms."""
    rows = ["| config | c | phase | laps | p50 ms | p90 ms | p99 ms | laps > 5 ms |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        for phase, (qs, total, slow) in sorted((p.get("tails") or {}).items()):
            if phase == "idle":
                continue
            rows.append(f"| {p['config']} | {p['c']} | {phase} | {total:.0f} | {qs[0.5]:g} | {qs[0.9]:g} | "
                        f"{qs[0.99]:g} | {slow:.0f} |")
    return "\n".join(rows)


class Missing(Exception):
    pass


def load_point(raw, config, c, previous_metrics):
    path = os.path.join(raw, f"{config}_c{c}.json")
    if not os.path.exists(path):
        raise Missing(path)
    with open(path) as f:
        report = json.load(f)
    if "summary" not in report or report.get("config", {}).get("concurrency") != c:
        raise Missing(f"{path} is not a single-run report at concurrency {c}")
    point = {"config": config, "c": c, "summary": report["summary"], "run": report["config"], "phases": None,
             "phase_note": ""}
    metrics = os.path.join(raw, f"{config}_c{c}_metrics.txt")
    if os.path.exists(metrics) and previous_metrics and os.path.exists(previous_metrics):
        before, after = parse_metrics(previous_metrics), parse_metrics(metrics)
        point["phases"] = phases_per_step(before, after)
        point["tails"] = phase_tails(before, after)
    else:
        point["phase_note"] = f"no /metrics scrapes around {path}"
    return point, metrics


def fmt(v, digits=1):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def per_gpu(points):
    """True when every point's replay knew the GPU count (`sparkd-replay run --gpus`; a CPU dry run has none)."""
    return all(p["summary"].get("total_tokens_per_s_per_gpu") is not None for p in points)


def tput(s, kind, gpu):
    """Total or output throughput of a summary: per GPU when `gpu`, else for the whole server."""
    return s[f"{kind}_tokens_per_s_per_gpu"] if gpu else s[f"{kind}_tokens_per_s"]


def table(points, configs):
    gpu = per_gpu(points)
    unit = "tok/s/GPU" if gpu else "tok/s"
    head = ["config", "c", "ok/err", "ITL p50 ms", "ITL p90 ms", "TTFT p50 ms", "P90 interactivity tok/s/user",
            f"total {unit}", f"output {unit}", "AL"] + [f"{p} ms/step" for p in PHASE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg in configs:
        for p in (p for p in points if p["config"] == cfg):
            s = p["summary"]
            if not s["successful"]:
                lines.append(f"| {cfg} | {p['c']} | 0/{s['errors']} | no request finished |" + " |" * (len(head) - 4))
                continue
            spec = s.get("spec") or {}
            al = spec.get("acceptance_length") if spec.get("num_spec_steps") else None
            ph = p["phases"] or {}
            row = [cfg, str(p["c"]), f"{s['successful']}/{s['errors']}", fmt(s["itl_s"]["p50"] * 1e3, 2),
                   fmt(s["itl_s"]["p90"] * 1e3, 2), fmt(s["ttft_s"]["p50"] * 1e3, 1), fmt(s["p90_interactivity"], 1),
                   fmt(tput(s, "total", gpu), 0), fmt(tput(s, "output", gpu), 0), fmt(al, 2)]
            row += [fmt(ph.get(col), 3) for col in PHASE_COLUMNS]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def nice_ticks(hi, n=5):
    """Ticks 0, step, ... covering [0, hi] with a 1-2-5 step."""
    hi = hi if hi > 0 else 1.0
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step - 1e-9)) + 1)]


def tick_label(v):
    return f"{v:,.0f}" if abs(v) >= 10 or v == 0 else f"{v:g}"


def pareto_svg(points, configs, title, subtitle):
    w, h, left, right, top, bottom = 800, 500, 80, 170, 40, 60
    pw, ph = w - left - right, h - top - bottom
    xs = [p["summary"]["p90_interactivity"] for p in points]
    gpu = per_gpu(points)
    ys = [tput(p["summary"], "total", gpu) for p in points]
    xt, yt = nice_ticks(max(xs, default=1) * 1.05), nice_ticks(max(ys, default=1) * 1.05)
    sx = lambda v: left + pw * v / xt[-1]  # noqa: E731
    sy = lambda v: top + ph - ph * v / yt[-1]  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left + pw / 2}" y="18" text-anchor="middle" font-size="15">{escape(title)}</text>',
           f'<text x="{left + pw / 2}" y="33" text-anchor="middle" fill="#555">{escape(subtitle)}</text>']
    for v in xt:
        x = sx(v)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{tick_label(v)}</text>')
    for v in yt:
        y = sy(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{tick_label(v)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 15}" text-anchor="middle">P90 interactivity (tokens/s/user)</text>')
    out.append(f'<text transform="translate(20 {top + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'total throughput ({"tokens/s per GPU" if gpu else "tokens/s"})</text>')
    for i, cfg in enumerate(configs):
        color = COLORS[i % len(COLORS)]
        mine = sorted((p for p in points if p["config"] == cfg), key=lambda p: p["c"])
        coords = [(sx(p["summary"]["p90_interactivity"]), sy(tput(p["summary"], "total", gpu)), p["c"])
                  for p in mine]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in coords)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y, c in coords:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"/>')
            out.append(f'<text x="{x + 6:.1f}" y="{y - 6:.1f}" fill="{color}">c={c}</text>')
        ly = top + 10 + 20 * i
        out.append(f'<line x1="{left + pw + 15}" y1="{ly}" x2="{left + pw + 40}" y2="{ly}" stroke="{color}" '
                   'stroke-width="2"/>')
        out.append(f'<circle cx="{left + pw + 27.5}" cy="{ly}" r="4" fill="{color}"/>')
        out.append(f'<text x="{left + pw + 46}" y="{ly + 4}">{escape(cfg)}{"" if mine else " (no data)"}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def subtitle(points):
    """The replay settings of the points (the first point's; a differing point is named)."""
    if not points:
        return "no data"
    keys = ("transport", "token_scale", "time_scale", "duration_s", "model")
    first = {k: points[0]["run"].get(k) for k in keys}
    odd = [f"{p['config']} c={p['c']}" for p in points if {k: p["run"].get(k) for k in keys} != first]
    text = (f"{first['transport']} transport, token scale {first['token_scale']}, time scale {first['time_scale']}, "
            f"{first['duration_s']:g} s per point")
    return text + (f"; other settings: {', '.join(odd)}" if odd else "")


def cmd_report(args):
    configs, concurrency = args.configs.split(), [int(c) for c in args.concurrency.split()]
    if not configs or not concurrency:
        sys.exit("report: --configs and --concurrency must name at least one each")
    missing, points, notes = [], [], []
    for cfg in configs:
        previous = os.path.join(args.raw, f"{cfg}_c0_metrics.txt")
        for c in concurrency:
            try:
                point, previous = load_point(args.raw, cfg, c, previous)
            except Missing as e:
                missing.append(str(e))
                previous = os.path.join(args.raw, f"{cfg}_c{c}_metrics.txt")
                continue
            if point["phase_note"]:
                notes.append(point["phase_note"])
            points.append(point)
    plan_path = os.path.join(args.raw, "plan.txt")
    plan = open(plan_path).read().strip() if os.path.exists(plan_path) else ""
    md = ["# Served replay matrix", ""]
    if plan:
        md += ["```", plan, "```", ""]
    md += [table(points, configs), "",
           "ITL, TTFT, P90 interactivity (1 / P90 of per-request mean ITL), throughput and AL (1 + accepted / verify "
           "rounds, pooled) are sparkd-replay's own summary numbers. Phase columns: mean ms per device step "
           "(sparkd:engine_phase_seconds over the point: delta sum of the phase / delta count of `step`); `step` is "
           "runner.step, the device forward with the verify fused in; `other` is commands + memory; `idle` is the "
           "engine blocked with no work.", ""]
    md += ["Engine phase tails over each point (`sparkd:engine_phase_seconds` bucket deltas; a quantile is the upper "
           "bound of the bucket that holds it):", "", tails_table(points), ""]
    prefill = os.path.join(args.raw, "prefill.json")
    if os.path.exists(prefill):
        with open(prefill) as f:
            p = json.load(f)
        timed = ", ".join(f"{r['tokens_per_s']:.0f}" for r in p["runs"] if not r["warmup"])
        md.append(f"Prefill ({p['config']} server, one request at a time): a {p['prompt_tokens']}-token prompt, one "
                  f"output token: median {p['median_seconds'] * 1e3:.1f} ms = {p['median_tokens_per_s']:.0f} tok/s "
                  f"(timed runs: {timed} tok/s; a warm-up run first).")
    else:
        md.append("Prefill: no prefill point (raw/prefill.json is absent).")
    md.append("")
    for m in missing:
        md.append(f"- missing: {m}")
    for n in notes:
        md.append(f"- {n}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "matrix.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    title = "sparkd served replay: P90 interactivity vs total throughput"
    plotted = [p for p in points if p["summary"]["successful"]]
    with open(os.path.join(args.out, "pareto.svg"), "w") as f:
        f.write(pareto_svg(plotted, configs, title, subtitle(points)))
    for m in missing:
        print(f"serve_matrix: missing {m}", file=sys.stderr)
    if missing or not points:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scrape")
    s.add_argument("--base", required=True)
    s.add_argument("--out", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("--raw", required=True)
    r.add_argument("--configs", required=True)
    r.add_argument("--concurrency", required=True)
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.command == "prefill" and args.runs < 1:
        ap.error("--runs must be at least 1")
    {"scrape": cmd_scrape, "prefill": cmd_prefill, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
