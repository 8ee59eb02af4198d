#!/usr/bin/python3
"""What the Python package costs beside raw stubs: Attend's round trip.

  tests/benchmarks/python_client_benchmark.py --server build/server/attnserve [--rounds 5]

Starts attnserve (the built-in model, d_model 768, 12 heads) on a free loopback
port and times Attend calls one at a time, for B=1 S=16, B=8 S=128 and B=1
S=2048 without maps, two ways on channels of their own:

  - raw stubs: the generated AttentionServiceStub with an AttendRequest built
    by hand (float32 bytes) and the output read with np.frombuffer, as a user
    of the bare generated code writes it;
  - the package: attnserve.Client(...).attend(x) on the same float32 array,
    which returns an AttendResult (output, timing, kernel path, precision).

The two alternate in blocks within each round (raw, package, package, raw, ...)
so that a slow spell of the machine hits both. Prints each way's median round
trip over all rounds, the difference and the ratio, the median of the
per-round ratios, and the client-side time per call (request built and
response read, without the network) measured apart: the package's, the
package's through protobuf as before attnserve._wire (the round-trip ways
of that are in transport_benchmark.py), and the raw stubs'. The CPU model
goes on top: compare figures of one run only.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import PACKAGE_DIR, Server, cpu_model  # noqa: E402

sys.path.insert(0, PACKAGE_DIR)
import attnserve  # noqa: E402
import grpc  # noqa: E402
from attnserve import _wire, messages  # noqa: E402
from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc  # noqa: E402

D_MODEL = 768
SHAPES = [("B=1 S=16", 1, 16, 400), ("B=8 S=128", 8, 128, 40), ("B=1 S=2048", 1, 2048, 20)]  # name, batch,
# seq, calls per block
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", -1)]


def raw_call(stub, x):
    """One Attend through the bare generated stub; returns the output array."""
    r = stub.Attend(pb.AttendRequest(
        model="default",
        hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes())), timeout=60)
    return np.frombuffer(r.output.raw_data, "<f4").reshape(tuple(r.output.shape))


def timed(call, x, n):
    """Round trips of n calls, seconds each."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - start)
    return times


def client_side_seconds(x, n=200):
    """Median time per call on the client's own side, the request built and
    serialized and a response of the same size parsed and read: (the package
    as it is, the package through protobuf as before attnserve._wire, raw
    stubs)."""
    response = pb.AttendResponse(model="default", kernel_path="fp32/blocked",
                                 output=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes()))
    wire = response.SerializeToString()
    times, before = [], []
    for _ in range(n):
        start = time.perf_counter()
        _wire.serialize(messages.build_attend_wire(x))
        messages.read_attend_response(_wire.parse_attend_response(wire))
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        messages.build_attend_request(x).SerializeToString()
        messages.read_attend_response(pb.AttendResponse.FromString(wire))
        before.append(time.perf_counter() - start)
    raw = []
    for _ in range(n):
        start = time.perf_counter()
        pb.AttendRequest(model="default", hidden_states=pb.Tensor(
            dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes())).SerializeToString()
        r = pb.AttendResponse.FromString(wire)
        np.frombuffer(r.output.raw_data, "<f4").reshape(tuple(r.output.shape))
        raw.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(before), statistics.median(raw)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    print(f"attnserve package {attnserve.__version__}, grpcio {grpc.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}")
    server = Server(args.server)
    try:
        client = attnserve.Client(server.target, timeout=60)
        client.wait_until_serving(timeout=120)
        channel = grpc.insecure_channel(server.target, options=OPTIONS)
        stub = pb_grpc.AttentionServiceStub(channel)
        # The third way runs the raw code on the package's channel: it tells the
        # package's Python apart from its channel (set-up, health watch).
        ways = {"raw stubs": lambda x: raw_call(stub, x), "package": lambda x: client.attend(x).output,
                "raw on the package's channel": lambda x: raw_call(client.stub, x)}
        rng = np.random.default_rng()
        inputs = {name: rng.standard_normal((b, s, D_MODEL)).astype(np.float32) for name, b, s, _ in SHAPES}
        for name, _, _, n in SHAPES:  # warm-up: connections, the server's primitives and caches
            for call in ways.values():
                timed(call, inputs[name], max(5, n // 10))
        times = {(name, way): [] for name, *_ in SHAPES for way in ways}
        ratios = {name: [] for name, *_ in SHAPES}
        for round_ in range(args.rounds):
            for name, _, _, n in SHAPES:
                order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
                medians = {}
                for way in order + order[::-1]:  # ABBA within the round
                    t = timed(ways[way], inputs[name], n // 2)
                    times[(name, way)] += t
                    medians.setdefault(way, []).extend(t)
                ratios[name].append(statistics.median(medians["package"]) / statistics.median(medians["raw stubs"]))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        print(f"\nRound-trip p50 over {args.rounds} rounds, one call at a time (B x S x {D_MODEL}, no maps):")
        print("| request | calls per way | raw stubs p50 | package p50 | difference | ratio | median of per-round "
              "ratios | raw code on the package's channel p50 | own side per call: package (through protobuf; "
          "raw stubs) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, *_ in SHAPES:
            raw = statistics.median(times[(name, "raw stubs")])
            package = statistics.median(times[(name, "package")])
            own, before_own, raw_own = client_side_seconds(inputs[name])
            print(f"| {name} | {len(times[(name, 'package')])} | {raw * 1e3:.3f} ms | {package * 1e3:.3f} ms | "
                  f"{(package - raw) * 1e6:+.0f} us | {package / raw:.3f} | {statistics.median(ratios[name]):.3f} | "
                  f"{statistics.median(times[(name, 'raw on the package' + chr(39) + 's channel')]) * 1e3:.3f} ms | "
                  f"{own * 1e6:.0f} us ({before_own * 1e6:.0f} us; {raw_own * 1e6:.0f} us) |")
        channel.close()
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
