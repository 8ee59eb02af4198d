#!/usr/bin/python3
"""Memory after load: the real attnserve binary's resident memory after a burst
of concurrent calls falls back to within 1.25x of its level after a warm-up at
the same shapes, within 30 s of the burst's end.

  1. warm-up: one client calls each shape a few times; the RSS then (idle) is
     the baseline;
  2. burst: --clients concurrent clients call the same shapes for --seconds;
  3. after: RSS sampled every 0.5 s until it is within --ratio x baseline, or
     30 s have passed.

Prints the RSS timeline and one summary line. With --measure it only prints
(no assertion): docs/measurements.md compares the allocators with it
(an attnserve built with -DATTNSERVE_MALLOC=system against the default).

Usage: memory_return_test.py --server PATH/attnserve --proto_dir proto
                             [--clients 64] [--seconds 10] [--ratio 1.25] [--measure]
"""
import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Server, generate_stubs, stop_process, to_tensor, wait_serving  # noqa: E402

# Shapes of the calls (batch, seq), each with the built-in model's d_model 768.
SHAPES = [(1, 128), (4, 256), (2, 512)]
RECOVERY_SECONDS = 30


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--ratio", type=float, default=1.25)
    parser.add_argument("--measure", action="store_true", help="print only, assert nothing")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, args.proto_dir)
        import grpc
        import health_pb2
        import health_pb2_grpc
        from attnserve.v1 import attention_pb2 as pb
        from attnserve.v1 import attention_pb2_grpc as rpc

        rng = np.random.default_rng()
        requests = []
        for batch, seq in SHAPES:
            x = rng.standard_normal((batch, seq, 768)).astype(np.float32)
            requests.append(pb.AttendRequest(model="default", hidden_states=to_tensor(pb, x)))

        # The in-flight budget and queue admit the whole burst at once.
        server = Server(args.server, f"--max_queued_requests={args.clients * 2}")
        failures = []
        try:
            channel = grpc.insecure_channel(server.target)
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
            stub = rpc.AttentionServiceStub(channel)
            for _ in range(3):
                for request in requests:
                    stub.Attend(request, timeout=120)
            baseline = rss_bytes(server.proc.pid)

            stop = time.monotonic() + args.seconds
            counts = {"ok": 0, "failed": 0}
            lock = threading.Lock()
            peak = [baseline]

            def client(i):
                own = grpc.insecure_channel(server.target)  # a connection per client, as in a fleet
                own_stub = rpc.AttentionServiceStub(own)
                n = i
                while time.monotonic() < stop:
                    try:
                        own_stub.Attend(requests[n % len(requests)], timeout=300)
                        ok = True
                    except grpc.RpcError:
                        ok = False
                    n += 1
                    with lock:
                        counts["ok" if ok else "failed"] += 1
                own.close()

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak[0] = max(peak[0], rss_bytes(server.proc.pid))
                time.sleep(0.2)
            for t in threads:
                t.join()
            end = time.monotonic()
            timeline = []
            recovered_after = None
            while time.monotonic() - end < RECOVERY_SECONDS:
                rss = rss_bytes(server.proc.pid)
                timeline.append((time.monotonic() - end, rss))
                if rss <= args.ratio * baseline:
                    recovered_after = time.monotonic() - end
                    break
                time.sleep(0.5)
            mib = 1 << 20
            print(f"calls in the burst: {counts['ok']} OK, {counts['failed']} failed "
                  f"({args.clients} clients, {args.seconds:g} s, shapes {SHAPES})")
            print("after the burst: " + ", ".join(f"{t:.1f}s {r / mib:.0f} MiB" for t, r in timeline))
            print(f"RSS baseline {baseline / mib:.0f} MiB, peak {peak[0] / mib:.0f} MiB, "
                  f"last {timeline[-1][1] / mib:.0f} MiB; within {args.ratio}x of the baseline "
                  + (f"after {recovered_after:.1f} s" if recovered_after is not None
                     else f"NOT within {RECOVERY_SECONDS} s"))
            if peak[0] <= args.ratio * baseline:
                failures.append(f"the burst did not raise RSS above {args.ratio}x the baseline "
                                "(nothing to fall back from: a bigger burst is needed)")
            if counts["failed"]:
                failures.append(f"{counts['failed']} calls of the burst failed")
            if recovered_after is None:
                failures.append(f"RSS did not fall within {args.ratio}x of the baseline in "
                                f"{RECOVERY_SECONDS} s")
            channel.close()
        finally:
            stop_process(server.proc)
    if failures and not args.measure:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
