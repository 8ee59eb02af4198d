#!/usr/bin/python3
"""attnserve's core beside PyTorch's nn.MultiheadAttention, side by side.

A program that prints one table, not a test. For each shape it runs, alternately
and each in a process of its own with the same thread count, our benchmark binary
(tests/benchmarks/attention_layer_benchmark, one shape per process) and a torch
nn.MultiheadAttention forward (Debian's python3-torch, at its best settings:
torch.set_num_threads(threads), OMP_WAIT_POLICY=PASSIVE for FP32, a BF16 module
for BF16, need_weights=False unless maps are asked for), then prints medians:

  shape, mode, precision, our ms, PyTorch ms, ratio (PyTorch ms / our ms),
  our fraction of oneDNN's matmul ceiling (2048^3, same precision, same process),
  the floor (BM_ProjectionsAlone: the layer's two projection matmuls alone in
  oneDNN plus the attention's FLOPs at the ceiling: no layer built on these
  matmuls runs faster) and the best ratio (PyTorch ms / floor ms) any such
  layer could show, peak RSS of our process and of torch's.

With --over_the_wire, the same shapes (without maps) also go through the real
server (the build's attnserve, default flags, on a loopback port) from attnctl
in each round: the round trip's median, its ratio to the server's own compute
time, and PyTorch ms / round trip -- the layer over gRPC against PyTorch's
in-process. The server gets the built-in model for D=768 H=12 and an ad-hoc
seeded layer otherwise; BF16 rows send, compute and return BF16.

Usage:
  /usr/bin/python3 tests/benchmarks/compare_with_pytorch.py [--build build]
      [--rounds 3] [--threads 2] [--shapes 8x128x768x12,...] [--quick]
      [--over_the_wire [--wire_calls 30]]
Installs python3-torch (with OpenBLAS) through deploy/install_deps.sh when torch
cannot be imported.
"""
import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from harness import Server, cpu_model  # noqa: E402

# (B, S, D, H, Hkv, mode, precision); mode: "none" (no maps), "causal", "maps".
DEFAULT_CASES = [
    (8, 128, 768, 12, 12, "none", "fp32"),
    (1, 512, 768, 12, 12, "none", "fp32"),
    (1, 2048, 768, 12, 12, "none", "fp32"),
    (1, 4096, 1024, 16, 16, "none", "fp32"),
    (1, 2048, 768, 12, 12, "causal", "fp32"),
    (1, 4096, 1024, 16, 16, "causal", "fp32"),
    (8, 128, 768, 12, 12, "maps", "fp32"),
    (1, 512, 768, 12, 12, "maps", "fp32"),
    (1, 2048, 768, 12, 12, "maps", "fp32"),
    (8, 128, 768, 12, 12, "none", "bf16"),
    (1, 512, 768, 12, 12, "none", "bf16"),
    (1, 2048, 768, 12, 12, "none", "bf16"),
    (1, 4096, 1024, 16, 16, "none", "bf16"),
]
QUICK_CASES = [(2, 16, 64, 4, 4, "none", "fp32")]

FLAGS = {"none": 0, "causal": 1, "maps": 4}

TORCH_CHILD = r"""
import json, resource, statistics, sys, time, torch
b, s, d, h, mode, precision, threads, reps = json.loads(sys.argv[1])
torch.set_num_threads(threads)
dtype = torch.bfloat16 if precision == "bf16" else torch.float32
mha = torch.nn.MultiheadAttention(d, h, batch_first=True).eval().to(dtype)
x = torch.randn(b, s, d).to(dtype)
mask = None
if mode == "causal":
    mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1).to(dtype)
need = mode == "maps"
times = []
with torch.inference_mode():
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mha(x, x, x, attn_mask=mask, need_weights=need, average_attn_weights=False)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"ms": statistics.median(times), "rss_mb": rss}))
"""


def ensure_torch():
    try:
        subprocess.run(["/usr/bin/python3", "-c", "import torch"], check=True,
                       capture_output=True)
    except subprocess.CalledProcessError:
        print("installing python3-torch (deploy/install_deps.sh)", file=sys.stderr)
        subprocess.run(["bash", os.path.join(ROOT, "deploy", "install_deps.sh")], check=True)


def run_ours(binary, case, threads, reps):
    b, s, d, h, hkv, mode, precision = case
    flags = FLAGS[mode] | (2 if precision == "bf16" else 0)
    name = f"BM_AttentionLayer/B:{b}/S:{s}/D:{d}/H:{h}/Hkv:{hkv}/flags:{flags}/"
    args = [binary, f"--benchmark_filter=^{name}", "--benchmark_format=json",
            f"--benchmark_repetitions={reps}", "--benchmark_min_time=0.2"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env).stdout
    runs = [r for r in json.loads(out)["benchmarks"] if r.get("run_type") == "iteration"]
    if not runs:
        raise RuntimeError(f"our benchmark did not run {name} (a shape outside its list?)")
    floor_name = name.replace("BM_AttentionLayer/", "BM_ProjectionsAlone/")
    out = subprocess.run([binary, f"--benchmark_filter=^{floor_name}", "--benchmark_format=json",
                          "--benchmark_min_time=0.1"],
                         check=True, capture_output=True, text=True, env=env).stdout
    floors = [r["bound_ms"] for r in json.loads(out)["benchmarks"]
              if r.get("run_type") == "iteration"]
    return {
        "ms": statistics.median(r["real_time"] for r in runs),
        "of_ceiling": statistics.median(r["of_ceiling"] for r in runs),
        "rss_mb": max(r["peak_rss_mb"] for r in runs),
        "path": runs[0].get("label", ""),
        "floor_ms": floors[0] if floors else float("nan"),
    }


def run_torch(case, threads, reps):
    b, s, d, h, _, mode, precision = case
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if precision == "fp32":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run(
        ["/usr/bin/python3", "-c", TORCH_CHILD,
         json.dumps([b, s, d, h, mode, precision, threads, reps])],
        check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def attnctl_attend(attnctl, target, case, calls):
    """One attnctl process sending `calls` Attend calls of the case's shape:
    (round trip p50 ms, transport p50 ms = round trip less the server's compute)."""
    b, s, d, h, hkv, mode, precision = case
    layer = [] if (d, h, hkv) == (768, 12, 12) else [
        "--layer_seed=7", f"--d_model={d}", f"--num_heads={h}", f"--num_kv_heads={hkv}"]
    args = [attnctl, "attend", f"--target={target}", f"--batch={b}", f"--seq={s}", *layer,
            f"--precision={precision}", f"--output_dtype={precision}", f"--input_dtype={precision}",
            f"--repeat={calls}", "--json", "--max_receive_message_bytes=1073741824"]
    if mode == "causal":
        args.append("--causal")
    report = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    return report["latency_ms"]["p50"], report["transport_ms"]["p50"]


def start_server(build, threads, max_seq):
    """The build's attnserve on a free loopback port with `threads` compute
    threads, taking sequences of max_seq tokens, SERVING; stopped at this
    process' exit whatever happens."""
    server = Server(os.path.join(build, "server", "attnserve"), f"--compute_threads={threads}",
                    f"--max_seq_len={max(max_seq, 2048)}")
    atexit.register(server.stop)
    server.wait_serving(120)
    return server, os.path.join(build, "client", "attnctl")


def parse_shapes(text):
    cases = []
    for item in text.split(","):
        parts = item.split("x")
        b, s, d, h = (int(p) for p in parts[:4])
        mode = parts[4] if len(parts) > 4 else "none"
        precision = parts[5] if len(parts) > 5 else "fp32"
        cases.append((b, s, d, h, h, mode, precision))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3, help="alternations per shape")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", help="BxSxDxH[xmode[xprecision]],... (mode none|causal|maps)")
    parser.add_argument("--quick", action="store_true", help="one tiny shape (a smoke run)")
    parser.add_argument("--over_the_wire", action="store_true",
                        help="also time the shapes without maps through the real server")
    parser.add_argument("--wire_calls", type=int, default=30, help="calls per round over the wire")
    args = parser.parse_args()
    ensure_torch()
    binary = os.path.join(args.build, "tests", "benchmarks", "attention_layer_benchmark")
    cases = QUICK_CASES if args.quick else (
        parse_shapes(args.shapes) if args.shapes else DEFAULT_CASES)
    server = None
    if args.over_the_wire:
        server, attnctl = start_server(args.build, args.threads, max(c[1] for c in cases))
    header = ("shape", "mode", "precision", "ours ms", "PyTorch ms", "ratio", "of ceiling",
              "floor ms", "best ratio", "RSS ours MiB", "RSS torch MiB", "our path")
    if server:
        header += ("over gRPC ms", "round trip / compute", "PyTorch / over gRPC")
    rows = []
    for case in cases:
        ours, theirs, wire = [], [], []
        over_the_wire = server is not None and case[5] != "maps"
        if over_the_wire:
            attnctl_attend(attnctl, server.target, case, 3)  # the layer and its primitives, built
        for _ in range(args.rounds):
            ours.append(run_ours(binary, case, args.threads, args.reps))
            theirs.append(run_torch(case, args.threads, args.reps))
            if over_the_wire:
                wire.append(attnctl_attend(attnctl, server.target, case, args.wire_calls))
        our_ms = statistics.median(o["ms"] for o in ours)
        torch_ms = statistics.median(t["ms"] for t in theirs)
        b, s, d, h, _, mode, precision = case
        floor_ms = statistics.median(o["floor_ms"] for o in ours)
        rows.append((f"B={b} S={s} D={d} H={h}", mode, precision, f"{our_ms:.2f}",
                     f"{torch_ms:.2f}", f"{torch_ms / our_ms:.2f}x",
                     f"{100 * statistics.median(o['of_ceiling'] for o in ours):.0f}%",
                     f"{floor_ms:.2f}", f"{torch_ms / floor_ms:.2f}x",
                     f"{max(o['rss_mb'] for o in ours):.0f}",
                     f"{max(t['rss_mb'] for t in theirs):.0f}", ours[0]["path"]))
        if server:
            if wire:
                trip = statistics.median(w[0] for w in wire)
                compute = statistics.median(w[0] - w[1] for w in wire)
                rows[-1] += (f"{trip:.2f}", f"{trip / compute:.2f}", f"{torch_ms / trip:.2f}x")
            else:
                rows[-1] += ("", "", "")
    if server:
        server.stop()
    print(f"CPU: {cpu_model()}; {args.threads} threads; medians of {args.rounds} alternating rounds")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
