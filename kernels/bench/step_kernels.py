#!/usr/bin/env python3
"""One decode step of `sparkd bench`, kernel by kernel, from an ncu CSV: time, DRAM bytes and bandwidth of each
launch, then the launches grouped by kernel. ncu runs the kernels one at a time, so every time is the kernel alone
(no overlap with the side lane, no dependent-launch overlap): the sum is an upper bound of the step's device time.

Make the CSV on the GPU machine (about a minute for k3-mini at one token):
  ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
      --csv --page raw sparkd bench --device cuda --model CHECKPOINT --batch 1 --steps 1 --prompt-len 64 \\
      --max-verify 0 --no-forced > ncu_step.csv
then: python3 kernels/bench/step_kernels.py ncu_step.csv [--bound-mb 20]

The step is the last one in the file: from the last `embed_gather` launch to the `sample_rows` after it. Launches
that move at least --bound-mb MB count as bandwidth-bound (GEMMs, experts); the rest as latency-bound.
"""
import argparse
import csv
import io
import sys
from collections import OrderedDict

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")


def launches(path):
    """Every profiled launch in file order: (name, stream, grid, µs, MB moved)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(io.StringIO("".join(line for line in f if line.startswith('"')))))
    if not rows:
        sys.exit(f"{path}: no ncu CSV rows (was it made with --csv --page raw?)")
    col = {name: i for i, name in enumerate(rows[0])}
    missing = [m for m in ("Kernel Name", "Stream", "Grid Size") + METRICS if m not in col]
    if missing:
        sys.exit(f"{path}: the CSV lacks {', '.join(missing)} (see this script's --help for the ncu command)")

    def number(text):
        return float(text.replace(",", "")) if text else 0.0

    out = []
    for r in rows[1:]:
        if not r[col["Kernel Name"]] or r[col["Kernel Name"]] == "Kernel Name" or not r[col["Stream"]].isdigit():
            continue  # the units row
        mb = (number(r[col["dram__bytes_read.sum"]]) + number(r[col["dram__bytes_write.sum"]])) / 1e6
        us = number(r[col["gpu__time_duration.sum"]]) / 1e3
        out.append((r[col["Kernel Name"]], r[col["Stream"]], r[col["Grid Size"]], us, mb))
    return out


def last_step(all_launches):
    starts = [i for i, launch in enumerate(all_launches) if launch[0] == "embed_gather"]
    if not starts:
        sys.exit("no embed_gather launch: not a decode step of sparkd bench")
    first = starts[-1]
    end = next((i for i in range(first, len(all_launches)) if all_launches[i][0] == "sample_rows"), None)
    return all_launches[first : (end + 1 if end is not None else len(all_launches))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--bound-mb", type=float, default=20.0)
    args = ap.parse_args()
    step = last_step(launches(args.csv))
    print("kernel | stream | grid | µs | MB | TB/s")
    for name, stream, grid, us, mb in step:
        print(f"{name} | {stream} | {grid} | {us:.1f} | {mb:.2f} | {mb / us if us else 0:.2f}")
    lanes = OrderedDict()
    for _, stream, _, us, _ in step:
        lanes[stream] = lanes.get(stream, 0.0) + us
    print("\nµs per stream (kernels alone, summed): " + ", ".join(f"{s}: {t:.1f}" for s, t in lanes.items()))
    main_lane = step[0][1]
    groups = OrderedDict()
    for name, stream, _, us, mb in step:
        if stream != main_lane:
            continue
        key = "bandwidth-bound launches" if mb >= args.bound_mb else name
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += us
        g[2] += mb
    print(f"\nmain lane ({main_lane}) by kernel, latency-bound below {args.bound_mb:g} MB:")
    print("kernel | launches | µs | MB | TB/s")
    for key, (n, us, mb) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{key} | {n} | {us:.1f} | {mb:.1f} | {mb / us if us else 0:.2f}")


if __name__ == "__main__":
    main()
