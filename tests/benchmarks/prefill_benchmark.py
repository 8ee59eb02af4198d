#!/usr/bin/python3
"""A session's prefill against the same tokens through Attend, on the server.

  tests/benchmarks/prefill_benchmark.py --server build/server/attnserve \\
      [--server2 OTHER/attnserve] [--tokens 2048] [--calls 10] [--rounds 2] \\
      [--server_flag=--prefill_chunk_tokens=0 ...]

For each server binary (two alternate round by round, to compare builds), a
fresh attnserve on a loopback port (the built-in model, d_model 768, 12 heads;
--server_flag adds flags), then through the Python package (client/python):

  - Attend of a (1, tokens, 768) array with causal=True, FP32 and (on a CPU
    with AVX512-BF16) BF16 compute;
  - a decode session opened, one Extend of the same (tokens, 768) array (the
    whole prefill; the server computes it in chunks of --prefill_chunk_tokens
    unless told otherwise), closed; FP32 and BF16 KV.

Prints, per binary and round, the median over the last calls - 2 calls of the
compute the response reports (timing.compute: for a chunked prefill the sum
of its rounds) and of the round trip. The CPU model goes on top.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
from harness import Server, cpu_model, machine_runs_bf16  # noqa: E402

import attnserve  # noqa: E402


def measure(client, kind, x, calls):
    """(compute ms, round trip ms) medians of `calls` calls of `kind`, the first two dropped."""
    compute, trip = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        if kind.startswith("Attend"):
            r = client.attend(x[None], causal=True, precision="bf16" if "BF16" in kind else "fp32")
        else:
            with client.open_session(kv_dtype="bf16" if "BF16" in kind else "fp32") as session:
                r = session.extend(x)
        trip.append((time.perf_counter() - t0) * 1e3)
        compute.append(r.timing.compute_seconds * 1e3)
    return statistics.median(compute[2:]), statistics.median(trip[2:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--server2", help="a second binary, alternated with --server")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server_flag", action="append", default=[])
    args = parser.parse_args()
    kinds = ["Attend causal FP32", "Extend prefill, FP32 KV", "Extend prefill, BF16 KV"]
    if machine_runs_bf16():
        kinds.insert(1, "Attend causal BF16")
    x = np.random.default_rng().standard_normal((args.tokens, 768)).astype(np.float32)
    print(f"CPU: {cpu_model()}; {args.tokens} tokens, {args.calls} calls each, medians of the last "
          f"{args.calls - 2}; server flags {args.server_flag}", flush=True)
    for round_ in range(args.rounds):
        for binary in [args.server] + ([args.server2] if args.server2 else []):
            server = Server(binary, f"--max_seq_len={max(args.tokens, 2048)}", *args.server_flag)
            try:
                client = attnserve.Client(server.target, timeout=600)
                client.wait_until_serving(timeout=60)
                for kind in kinds:
                    compute, trip = measure(client, kind, x, args.calls)
                    print(f"round {round_ + 1}  {binary}  {kind:26s} compute {compute:7.1f} ms  "
                          f"round trip {trip:7.1f} ms", flush=True)
                client.close()
            finally:
                server.stop()


if __name__ == "__main__":
    main()
