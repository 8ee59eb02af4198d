#!/usr/bin/python3
"""Forks of one long prefix: what they hold and how fast they step.

Starts the build's attnserve (port 0, the built-in model: 12 KV heads of 64,
blocks of --kv_block_tokens=32), opens a session, prefills it with --prefix
tokens, forks it --forks times and reads the KV cache right after forking
(attnserve_kv_cache_blocks, _shared_blocks, _used_bytes and each fork's
GetSession kv_blocks), then after one decode step on every fork. Expected
(a count from the block size, not a measurement): right after forking, the
prefix's blocks once (ceil(prefix / 32)) and every one of them shared; after
a step on each fork, at most one more block per fork (a fresh block when the
prefix fills its blocks, else a copy of the partial last one).

Then a decode step on a fork against one on an unshared session prefilled
with the same tokens, alternating step by step from one Python client
(Extend unary, p50 of --steps each): the ratio is printed. The two sessions
get the same new tokens, so their outputs must agree (relative error <= 1e-6:
the fork's step reads the shared blocks and must compute what the unshared
session computes).

With --check (the CI test), exits 1 unless the block counts are as expected
and the outputs agree, for a block-aligned prefix and for one that is not;
the timing is printed, never checked.

Usage:
  /usr/bin/python3 tests/benchmarks/fork_sharing.py [--build build]
      [--forks 64] [--prefix 2048] [--steps 200] [--check]
"""
import argparse
import atexit
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from harness import Server, generate_stubs, metric, rel_error, wait_serving, wait_until  # noqa: E402

BLOCK_TOKENS = 32


class Forks:
    def __init__(self, server):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2, health_pb2_grpc
        self.server, self.pb = server, attention_pb2
        self.channel = grpc.insecure_channel(server.target)
        self.stub = attention_pb2_grpc.AttentionServiceStub(self.channel)
        wait_serving(health_pb2_grpc.HealthStub(self.channel), health_pb2)
        h = self.stub.GetModel(self.pb.GetModelRequest(name="default"), timeout=60).head_config
        self.d_model = h.d_model
        self.block_bytes = 2 * BLOCK_TOKENS * h.num_kv_heads * h.head_dim * 4  # FP32 K and V
        self.rng = np.random.default_rng()
        self.problems = []

    def expect(self, what, ok):
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.problems.append(what)

    def extend(self, sid, rows, expected):
        response = self.stub.Extend(self.pb.ExtendRequest(steps=[self.pb.ExtendStep(
            session_id=sid, expected_length=expected,
            hidden_states=self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(rows.shape),
                                         raw_data=np.ascontiguousarray(rows, "<f4").tobytes()))]),
            timeout=600)
        result = response.results[0]
        assert result.code == 0, result.message
        assert result.length == expected + len(rows), (result.length, expected, len(rows))
        return np.frombuffer(result.output.raw_data, "<f4").reshape(tuple(result.output.shape))

    def prefill(self, sid, x):
        for start in range(0, len(x), 512):
            self.extend(sid, x[start:start + 512], start)

    def open(self):
        return self.stub.OpenSession(self.pb.OpenSessionRequest(models=["default"]),
                                     timeout=60).session_id

    def close(self, sid):
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid), timeout=60)

    def kv(self):
        m = self.server.scrape()
        return (metric(m, "attnserve_kv_cache_blocks"), metric(m, "attnserve_kv_cache_shared_blocks"),
                metric(m, "attnserve_kv_cache_used_bytes"))

    def wait_blocks(self, blocks, shared):
        """The gauges once they show `blocks` and `shared` (or after 10 s, as they are)."""
        try:
            wait_until(f"{blocks} blocks, {shared} shared", lambda: self.kv()[:2] == (blocks, shared),
                       10)
        except AssertionError:
            pass
        return self.kv()

    def run(self, forks, prefix, steps):
        print(f"{forks} forks of a {prefix}-token prefix (blocks of {BLOCK_TOKENS} tokens, "
              f"{self.block_bytes} bytes FP32)")
        prefix_blocks = -(-prefix // BLOCK_TOKENS)
        x = self.rng.standard_normal((prefix, self.d_model), np.float32)
        parent = self.open()
        self.prefill(parent, x)
        children = [self.stub.ForkSession(self.pb.ForkSessionRequest(session_id=parent),
                                          timeout=60) for _ in range(forks)]
        blocks, shared, used = self.wait_blocks(prefix_blocks, prefix_blocks)
        print(f"right after forking: {blocks:.0f} blocks in use, {shared:.0f} shared, "
              f"{used / 2**20:.2f} MiB in use (the prefix alone: {prefix_blocks} blocks, "
              f"{prefix_blocks * self.block_bytes / 2**20:.2f} MiB; {forks + 1} unshared copies "
              f"would take {(forks + 1) * prefix_blocks * self.block_bytes / 2**20:.1f} MiB)")
        self.expect(f"blocks in use == the prefix's {prefix_blocks}", blocks == prefix_blocks)
        self.expect(f"all {prefix_blocks} shared", shared == prefix_blocks)
        self.expect("bytes in use == the prefix's blocks'",
                    used == prefix_blocks * self.block_bytes)
        self.expect(f"each fork describes the prefix's {prefix_blocks} blocks",
                    all(c.kv_blocks == prefix_blocks and c.layer_lengths[0] == prefix
                        for c in children))
        token = self.rng.standard_normal((1, self.d_model), np.float32)
        outputs = [self.extend(c.session_id, token, prefix) for c in children]
        blocks, shared, used = self.wait_blocks(prefix_blocks + forks,
                                                prefix_blocks - (prefix % BLOCK_TOKENS != 0))
        print(f"after one step on each fork: {blocks:.0f} blocks in use "
              f"({(blocks - prefix_blocks) / forks:.2f} more per fork), {shared:.0f} shared")
        self.expect("at most one more block per fork", blocks <= prefix_blocks + forks)
        # The unshared twin: the same prefix, the same token.
        twin = self.open()
        self.prefill(twin, x)
        expected = self.extend(twin, token, prefix)
        error = max(rel_error(o, expected.astype(np.float64)) for o in outputs)
        self.expect(f"each fork's step output == the unshared session's (max rel. error "
                    f"{error:.1e} <= 1e-6)", error <= 1e-6)
        fork = children[0].session_id
        for c in children[1:]:
            self.close(c.session_id)
        self.close(parent)  # the fork keeps the prefix's blocks
        fork_ms, twin_ms = [], []
        length = prefix + 1
        for _ in range(steps):
            row = self.rng.standard_normal((1, self.d_model), np.float32)
            for sid, times in ((fork, fork_ms), (twin, twin_ms)):
                t0 = time.perf_counter()
                self.extend(sid, row, length)
                times.append((time.perf_counter() - t0) * 1e3)
            length += 1
        self.close(fork)
        self.close(twin)
        f, t = statistics.median(fork_ms), statistics.median(twin_ms)
        print(f"decode step p50 over gRPC (Python client, {steps} alternating steps each, context "
              f"{prefix + 1}..{length}): fork {f:.3f} ms, unshared {t:.3f} ms, fork / unshared "
              f"{f / t:.3f}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--forks", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--check", action="store_true",
                        help="also a prefix that ends inside a block; exit 1 on a wrong count")
    args = parser.parse_args()
    server = Server(os.path.join(args.build, "server", "attnserve"), "--compute_threads=2",
                    f"--kv_block_tokens={BLOCK_TOKENS}", f"--max_sessions={2 * args.forks + 8}")
    atexit.register(server.stop)
    server.wait_serving(120)
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, os.path.join(ROOT, "proto"))
        forks = Forks(server)
        forks.run(args.forks, args.prefix, args.steps)
        if args.check and args.prefix % BLOCK_TOKENS == 0:
            forks.run(args.forks, args.prefix - BLOCK_TOKENS // 4, 2)
        forks.channel.close()
    server.stop()
    if args.check and forks.problems:
        sys.exit("fork sharing: " + "; ".join(forks.problems))


if __name__ == "__main__":
    main()
