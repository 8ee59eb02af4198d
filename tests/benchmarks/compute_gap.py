#!/usr/bin/python3
"""Does the server compute as fast as the core does in-process?

  tests/benchmarks/compute_gap.py --server build/server/attnserve \\
      --benchmark build/tests/benchmarks/attention_layer_benchmark --proto_dir proto \\
      [--rounds 3] [--calls 30] [--only REGEX] [--server_env NAME=VALUE ...]

For each shape (the built-in model's d_model 768, 12 heads; FP32, and BF16 on a
CPU with AVX512-BF16), alternating in each round which goes first:

  - in-process: attention_layer_benchmark's BM_AttentionLayer at that shape
    (one Forward per iteration on a kept workspace; real time);
  - server: a fresh attnserve on a loopback port, 5 warm-up calls and then
    --calls Attend calls one at a time; the median of the compute the
    response reports (timing.compute: the compute executor's whole batch,
    output buffers and conversions included). The server is stopped before the
    in-process run, so neither competes with the other for the 2 cores.

Prints per shape the medians over rounds and server / in-process. --server_env
sets variables for the server only (e.g. OMP_WAIT_POLICY=ACTIVE, to compare
with the server's default PASSIVE). The CPU model goes on top.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import (Server, cpu_model, generate_stubs, machine_runs_bf16, stop_process,  # noqa: E402
                     to_tensor, wait_serving)

D_MODEL = 768
SHAPES = [(1, 16), (8, 128), (1, 512), (1, 2048)]  # (batch, seq)
WARM_UP_CALLS = 5


def benchmark_name(batch, seq, bf16):
    return f"BM_AttentionLayer/B:{batch}/S:{seq}/D:{D_MODEL}/H:12/Hkv:12/flags:{2 if bf16 else 0}/real_time"


def in_process_ms(binary, shapes, precisions):
    """{(batch, seq, precision): ms per forward} from one benchmark process."""
    names = {benchmark_name(b, s, p == "bf16"): (b, s, p) for b, s in shapes for p in precisions}
    pattern = "^(" + "|".join(n.replace("/real_time", "") for n in names) + ")/real_time$"
    out = subprocess.run([binary, f"--benchmark_filter={pattern}", "--benchmark_min_time=0.3",
                          "--benchmark_format=json"], check=True, capture_output=True, text=True).stdout
    times = {}
    for bench in json.loads(out)["benchmarks"]:
        if bench["name"] in names and "error_occurred" not in bench:
            times[names[bench["name"]]] = bench["real_time"]
    return times


def server_ms(binary, shapes, precisions, calls, env):
    """{(batch, seq, precision): median timing.compute ms} from a fresh server."""
    import grpc
    import health_pb2
    import health_pb2_grpc
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as rpc
    server = Server(binary, env=env)
    times = {}
    try:
        with grpc.insecure_channel(server.target, options=[
                ("grpc.max_receive_message_length", 1 << 30)]) as channel:
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
            stub = rpc.AttentionServiceStub(channel)
            rng = np.random.default_rng()
            for batch, seq in shapes:
                for precision in precisions:
                    x = rng.standard_normal((batch, seq, D_MODEL)).astype(np.float32)
                    request = pb.AttendRequest(
                        model="default", hidden_states=to_tensor(pb, x),
                        precision=pb.PRECISION_BF16 if precision == "bf16" else pb.PRECISION_FP32)
                    computes = []
                    for i in range(WARM_UP_CALLS + calls):
                        response = stub.Attend(request, timeout=600)
                        if i >= WARM_UP_CALLS:
                            computes.append(response.timing.compute.ToNanoseconds() * 1e-6)
                    times[(batch, seq, precision)] = statistics.median(computes)
    finally:
        stop_process(server.proc)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--benchmark", required=True, help="attention_layer_benchmark")
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--only", default="", help="shapes whose name ('B=1 S=16') matches")
    parser.add_argument("--server_env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.server_env)
    precisions = ["fp32", "bf16"] if machine_runs_bf16() else ["fp32"]
    shapes = [(b, s) for b, s in SHAPES if re.search(args.only, f"B={b} S={s}")]
    samples = {"in-process": {}, "server": {}}
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, args.proto_dir)
        for r in range(args.rounds):
            runs = [("in-process", lambda: in_process_ms(args.benchmark, shapes, precisions)),
                    ("server", lambda: server_ms(args.server, shapes, precisions, args.calls, env))]
            for label, run in (runs if r % 2 == 0 else runs[::-1]):
                print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
                started = time.monotonic()
                for key, ms in run().items():
                    samples[label].setdefault(key, []).append(ms)
                print(f"  {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print(f"CPU: {cpu_model()}; {args.rounds} alternating rounds, medians; server env "
          f"{env or '(default)'}")
    print(f"{'shape':14} {'precision':9} {'in-process':>11} {'server':>11} {'server/in-process':>18}")
    for batch, seq in shapes:
        for precision in precisions:
            key = (batch, seq, precision)
            if key not in samples["in-process"] or key not in samples["server"]:
                continue
            a = statistics.median(samples["in-process"][key])
            b = statistics.median(samples["server"][key])
            print(f"{f'B={batch} S={seq}':14} {precision:9} {a:9.3f}ms {b:9.3f}ms {b / a:18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
