#!/usr/bin/env python3
"""Compares two builds' attention_layer_benchmark binaries shape by shape.

Runs the two binaries alternately (A B, B A, A B, ...), each round over every benchmark the filter selects, and prints
per benchmark the median real time of each, B/A, and the CPU model. Alternating shares the machine's drifts between
the two; medians drop the outlier rounds. A row is flagged when B's median differs from A's by more than --tolerance.

  tests/benchmarks/ab_compare.py BEFORE_BIN AFTER_BIN [--rounds 5] [--filter '^BM_AttentionLayer/']
                                 [--min-time 0.2] [--tolerance 0.05]

Exit status 0 when every row is within the tolerance, 1 otherwise (2 on a usage or run error).
"""
import argparse
import json
import statistics
import subprocess
import sys


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def run(binary, pattern, min_time):
    out = subprocess.run(
        [binary, f"--benchmark_filter={pattern}", f"--benchmark_min_time={min_time}",
         "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    times = {}
    for bench in json.loads(out)["benchmarks"]:
        if bench.get("run_type") == "aggregate" or "error_occurred" in bench:
            continue
        times[bench["name"]] = bench["real_time"]
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--filter", default="^BM_AttentionLayer/")
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    samples = {"before": {}, "after": {}}
    pair = (("before", args.before), ("after", args.after))
    for r in range(args.rounds):
        # A B, B A, A B, ...: neither build always runs first in its round.
        for label, binary in (pair if r % 2 == 0 else pair[::-1]):
            print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
            for name, t in run(binary, args.filter, args.min_time).items():
                samples[label].setdefault(name, []).append(t)
    print(f"CPU: {cpu_model()}; {args.rounds} alternating rounds; real time per iteration (ms), medians")
    print(f"{'benchmark':70} {'before':>10} {'after':>10} {'after/before':>13}")
    worst = 0.0
    for name in samples["before"]:
        if name not in samples["after"]:
            continue
        a = statistics.median(samples["before"][name])
        b = statistics.median(samples["after"][name])
        ratio = b / a
        worst = max(worst, abs(ratio - 1))
        flag = "" if abs(ratio - 1) <= args.tolerance else "  <-- outside tolerance"
        print(f"{name:70} {a:10.3f} {b:10.3f} {ratio:13.3f}{flag}")
    print(f"largest difference: {worst * 100:.1f}% (tolerance {args.tolerance * 100:.0f}%)")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(e.stderr, file=sys.stderr)
        sys.exit(2)
