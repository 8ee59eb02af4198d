#!/usr/bin/python3
"""What the wire costs: attnserve's round trip against a plain loopback socket.

  tests/benchmarks/transport_benchmark.py --server build/server/attnserve \\
      --attnctl build/client/attnctl --proto_dir proto [--calls 20] [--only REGEX] \\
      [--fault_rounds 150] [--grpc_floor build/tests/benchmarks/grpc_floor]

Starts attnserve (the built-in model, d_model 768, 12 heads) on a free loopback
port and, for each request below, one at a time:

  - Python, three ways taking turns call by call on one grpcio channel:
    "stubs", the raw generated stubs (a request built by hand, the response
    parsed by protobuf); "pkg/pb", the package through protobuf, as it was
    before attnserve._wire (messages.build_attend_request sent on the
    generated stub, messages.read_attend_response of protobuf's parse); and
    "package", attnserve.Client.attend as it is (the tensors written and read
    around the arrays' memory). For each: the median of each call's round trip
    minus the server's compute for that call (the response's timing.compute)
    over --calls calls;
  - C++ (attnctl attend --repeat, one call at a time on one connection, Attend
    or AttendStream): the median round trip and the median of each call's
    round trip minus its compute, over --calls calls after the warm-up ones
    (the median of all: attnctl's first call on a new connection reads its
    response in 8 KiB pieces, and a mean would count it);
  - the loopback socket: the median time a TCP connection on 127.0.0.1 with
    warm buffers takes to carry the same request bytes one way and the
    response bytes back (one process, a thread at each end);
  - gRPC's floor: the round trip of the same bytes through gRPC alone, a
    grpc_floor server (tests/benchmarks/grpc_floor.cc; --grpc_floor) answering
    from one buffer made at start, called by its C++ client (attnctl's call
    style and allocator) and by grpcio with raw bytes: no message built,
    parsed, validated or computed. The part of our transport above it is ours
    (copies, parses, hand-offs); the part below it is gRPC's on this machine.
    And "held": the same floor when the server holds each answer for the
    request's compute time (the median of the stubs' calls) with two threads
    reading memory meanwhile, as attnserve's compute does: what a call that
    waits for a compute costs at least, wake-ups and cold caches included;
  - the server's minor page faults per call (/proc/PID/stat at each Python
    call's start, over max(--calls, --fault_rounds) rounds: the timed ones and
    untimed ones after them): their mean against the response's size in 4 KiB
    pages, and how many calls faulted in more than 1% of those pages. The
    default 150 rounds make the Python part about seven times as long as 20
    (the maps rows about a minute and a half each on a 2-vCPU machine).

The Python ways share one process, whose allocator the package's first Client
sets to keep freed buffers (attnserve/_heap.py; ATTNSERVE_KEEP_FREED_BUFFERS=0
in the environment measures them without it). The header also prints what the
first touch of a fresh page costs on this machine (a fresh 8 MiB mapping
written a byte a page, less the same loop over the warm pages): the price of
every buffer an allocator hands back to the system and maps again.

The maps request runs four times: FP32 on the wire, then BF16 (output_dtype),
which halves the bytes, each as one Attend response and streamed (AttendStream:
the response, then the maps in chunks of at most 1 MiB, put back in place by
the client as they arrive; Python with harness.attend_stream and the package's
MapAssembler, C++ with attnctl
attend --stream_maps --repeat).

Prints per request: bytes (request + response), socket ms, gRPC's floor from
C++ and from grpcio, each at once and held (ms and ratio to the socket), the
server's compute (median of the stubs' calls), then for each Python way and for C++
the transport ms (round trip minus compute) and its ratio to the socket, and
the faults. The CPU model goes on top: compare figures of one run only.
"""
import argparse
import json
import mmap
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import (Server, attend_stream, cpu_model, generate_stubs, minor_faults,  # noqa: E402
                     to_tensor, wait_serving)

D_MODEL = 768
PAGE = 4096
WARM_UP_CALLS = 5
# name, batch, seq, maps, wire dtype of the output and maps, streamed
REQUESTS = [("B=8 S=128", 8, 128, "none", "fp32", False),
            ("B=1 S=512", 1, 512, "none", "fp32", False),
            ("B=1 S=2048", 1, 2048, "none", "fp32", False),
            ("B=4 S=512, per-head maps", 4, 512, "per-head", "fp32", False),
            ("  streamed", 4, 512, "per-head", "fp32", True),
            ("  BF16 on the wire", 4, 512, "per-head", "bf16", False),
            ("  BF16, streamed", 4, 512, "per-head", "bf16", True)]


def first_touch_us_per_page(size=8 << 20, rounds=3):
    """Median over `rounds` fresh anonymous mappings of `size` bytes: the time
    to write one byte in each 4 KiB page, less the same writes once the pages
    are there, per page (us)."""
    costs = []
    for _ in range(rounds):
        with mmap.mmap(-1, size) as m:
            t0 = time.perf_counter()
            for offset in range(0, size, 4096):
                m[offset] = 1
            t1 = time.perf_counter()
            for offset in range(0, size, 4096):
                m[offset] = 2
            t2 = time.perf_counter()
        costs.append(((t1 - t0) - (t2 - t1)) / (size // 4096) * 1e6)
    return statistics.median(costs)


def socket_round_trip_ms(request_bytes, response_bytes, calls):
    """Median ms for request_bytes one way and response_bytes back over a
    loopback TCP connection, buffers allocated once and reused."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    request, response = bytearray(request_bytes), bytearray(response_bytes)

    def receive(sock, buffer):
        view, got = memoryview(buffer), 0
        while got < len(buffer):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("closed")
            got += n

    def serve():
        peer, _ = listener.accept()
        peer_request = bytearray(request_bytes)
        with peer:
            for _ in range(calls + 2):
                receive(peer, peer_request)
                peer.sendall(response)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(listener.getsockname()) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reply = bytearray(response_bytes)
        for i in range(calls + 2):
            t0 = time.perf_counter()
            client.sendall(request)
            receive(client, reply)
            if i >= 2:  # two warm-up trips
                times.append(time.perf_counter() - t0)
    thread.join()
    listener.close()
    return statistics.median(times) * 1e3


def python_ways(client, stub, pb, batch, seq, maps, dtype, streamed):
    """({way: call}, request bytes), each call one Attend (or AttendStream) of the same request
    returning (compute seconds, response bytes): the raw generated stubs, the
    package through protobuf (its way before attnserve._wire: the request built
    with protobuf's setters and serialized by protobuf, the response parsed by
    protobuf and read from raw_data), and the package as it is
    (client.attend)."""
    from attnserve import messages
    x = np.random.default_rng(0).standard_normal((batch, seq, D_MODEL)).astype(np.float32)
    request = pb.AttendRequest(model="default", hidden_states=to_tensor(pb, x),
                               attention_maps=pb.AttentionMapRequest(
                                   mode=pb.ATTENTION_MAP_MODE_PER_HEAD if maps == "per-head"
                                   else pb.ATTENTION_MAP_MODE_NONE),
                               output_dtype=pb.DATA_TYPE_BF16 if dtype == "bf16" else pb.DATA_TYPE_FP32)
    map_bytes = 2 if dtype == "bf16" else 4
    arguments = dict(maps=None if maps == "none" else maps, output_dtype=dtype)

    def stubs():
        if not streamed:
            response = stub.Attend(request, timeout=600)
            return response.timing.compute.ToNanoseconds() * 1e-9, response.ByteSize()
        response, maps_array, _ = attend_stream(stub, pb, request, timeout=600)
        return response.timing.compute.ToNanoseconds() * 1e-9, response.ByteSize() + maps_array.size * map_bytes

    def through_protobuf():
        wire = messages.build_attend_request(x, **arguments)
        if not streamed:
            result = messages.read_attend_response(client.stub.Attend(wire, timeout=600))
        else:
            assembler = messages.MapAssembler()
            for message in client.stub.AttendStream(wire, timeout=600):
                assembler.add(message)
            result = assembler.result()
        return result.timing.compute_seconds, 0

    def package():
        return client.attend(x, stream_maps=streamed, timeout=600, **arguments).timing.compute_seconds, 0

    return {"stubs": stubs, "package via protobuf": through_protobuf, "package": package}, request.ByteSize()


def python_calls(ways, calls, pid, warm_up_calls, fault_rounds):
    """{way: (median round trip ms, median of each call's round trip less its
    compute ms, median compute ms)}, the response's bytes, and the server's
    minor faults of each call: after `warm_up_calls` of each way, the ways
    taking turns call by call (a slow spell of the machine hits them all; the
    server's threads each reach a steady state first: its allocator then
    reuses the buffers of earlier calls), `calls` timed rounds, and untimed ones
    after them up to max(calls, fault_rounds) rounds for the faults. A call's
    faults are those from its start to the next call's start (what the server
    does after answering counts too). Now and then one call faults in a whole
    buffer of fresh pages (docs/measurements.md, "The server's page faults,
    counted over 450 calls"): over 60 calls one such call read as 13 faults a
    call, so the mean needs the longer count."""
    for call in ways.values():
        for _ in range(warm_up_calls):
            call()
    trips = {way: [] for way in ways}
    transports = {way: [] for way in ways}
    computes = {way: [] for way in ways}
    size = 0
    starts = []  # the server's fault count at each call's start, and after the last
    for round_index in range(max(calls, fault_rounds)):
        for way, call in ways.items():
            starts.append(minor_faults(pid))
            t0 = time.perf_counter()
            compute, got = call()
            trip = time.perf_counter() - t0
            if round_index >= calls:
                continue
            trips[way].append(trip)
            transports[way].append(trip - compute)
            computes[way].append(compute)
            size = max(size, got)
    starts.append(minor_faults(pid))
    faults = [after - before for before, after in zip(starts, starts[1:])]
    return ({way: (statistics.median(trips[way]) * 1e3, statistics.median(transports[way]) * 1e3,
                   statistics.median(computes[way]) * 1e3) for way in ways}, size, faults)


class GrpcFloor:
    """gRPC's own cost of carrying a request's and a response's bytes: a
    grpc_floor server (tests/benchmarks/grpc_floor.cc: it answers from one
    buffer made at start, never reading the request), called by grpc_floor's
    own C++ client and by grpcio with raw bytes (no message built or parsed on
    either end). What any gRPC service's transport costs at least here."""

    METHOD = "/attnserve.floor.Floor/Carry"

    def __init__(self, binary):
        self.binary = binary
        self.proc = subprocess.Popen([binary, "serve"], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        found = re.search(r"port (\d+)", line)
        if not found:
            self.proc.kill()
            raise RuntimeError(f"grpc_floor serve did not say its port: {line!r}")
        self.target = f"127.0.0.1:{found.group(1)}"

    def cc_ms(self, request_bytes, response_bytes, calls, hold_ms=0.0):
        """grpc_floor call: the median round trip, one call at a time on one
        connection, after attnctl's number of warm-up calls; with hold_ms, the
        server holds each answer that long with both cores reading memory (as
        a compute would), and the figure is the round trip less the hold."""
        done = subprocess.run([self.binary, "call", f"--target={self.target}",
                               f"--request_bytes={request_bytes}", f"--response_bytes={response_bytes}",
                               f"--calls={calls}", f"--warm_up_calls={WARM_UP_CALLS}",
                               f"--hold_us={round(hold_ms * 1e3)}", "--hold_mode=busy"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"grpc_floor call failed: {done.stderr[-500:]}")
        return json.loads(done.stdout)["median_ms"]

    def python_ms(self, grpc, request_bytes, response_bytes, calls, warm_up_calls, hold_ms=0.0):
        """The same from grpcio in this process (the package's allocator
        setting applies to it as to the Python ways): bytes in, bytes out."""
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        payload = b"q" * request_bytes
        metadata = (("response-bytes", str(response_bytes)), ("hold-us", str(round(hold_ms * 1e3))),
                    ("hold-mode", "busy"))
        times = []
        with grpc.insecure_channel(self.target, options=options) as channel:
            call = channel.unary_unary(self.METHOD)
            for i in range(warm_up_calls + calls):
                t0 = time.perf_counter()
                got = call(payload, metadata=metadata, timeout=600)
                if i >= warm_up_calls:
                    times.append(time.perf_counter() - t0 - hold_ms * 1e-3)
                if len(got) != response_bytes:
                    raise RuntimeError(f"grpc_floor answered {len(got)} bytes, not {response_bytes}")
        return statistics.median(times) * 1e3

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def attnctl_calls(attnctl, target, batch, seq, maps, dtype, streamed, calls):
    """(median round trip ms, that minus the median of each call's round trip
    less its compute) from attnctl attend --repeat (--stream_maps: through
    AttendStream), on one connection, one call at a time."""
    done = subprocess.run([attnctl, "attend", f"--target={target}", *(["--stream_maps"] if streamed else []),
                           f"--repeat={calls + WARM_UP_CALLS}", f"--batch={batch}",
                           f"--seq={seq}", f"--maps={maps}", f"--output_dtype={dtype}", "--json"],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"attnctl attend failed: {done.stderr[-500:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    trip = report["latency_ms"]["p50"]
    return trip, trip - report["transport_ms"]["p50"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the attnserve binary")
    parser.add_argument("--attnctl", required=True, help="the attnctl binary")
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only", default="", help="the requests whose name matches this regex")
    parser.add_argument("--fault_rounds", type=int, default=150,
                        help="rounds of the Python ways (three calls each) whose server page faults are "
                        "counted: the timed ones, then untimed ones up to this many")
    parser.add_argument("--warm_up_calls", type=int, default=WARM_UP_CALLS,
                        help="uncounted calls of each Python way before the counted ones (the server's "
                        "allocator reaches its steady state over the first few dozen calls of a size)")
    parser.add_argument("--grpc_floor", default="",
                        help="the grpc_floor binary (default: beside --attnctl's build, "
                        "tests/benchmarks/grpc_floor; the floor columns are left out when there is none)")
    args = parser.parse_args()
    floor_binary = args.grpc_floor or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(args.attnctl))), "tests", "benchmarks", "grpc_floor")
    if args.grpc_floor and not os.access(floor_binary, os.X_OK):
        parser.error(f"--grpc_floor: {floor_binary} is not an executable")
    floor = GrpcFloor(floor_binary) if os.access(floor_binary, os.X_OK) else None
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, args.proto_dir)
        import grpc
        import health_pb2
        import health_pb2_grpc
        from attnserve.v1 import attention_pb2 as pb
        from attnserve.v1 import attention_pb2_grpc
        import attnserve
        server = Server(args.server, "--max_receive_message_bytes=1073741824",
                        "--max_send_message_bytes=1073741824")
        try:
            options = [("grpc.max_receive_message_length", 1 << 30),
                       ("grpc.max_send_message_length", 1 << 30)]
            with grpc.insecure_channel(server.target, options=options) as channel:
                wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                client = attnserve.Client(server.target, timeout=600, max_receive_message_bytes=1 << 30)
                print(f"first touch of a fresh page: {first_touch_us_per_page():.2f} us; the package's allocator "
                      f"setting: {attnserve._heap.keep_freed_buffers()}")
                print(f"CPU: {cpu_model()}; {args.calls} calls per request and way, one at a time, the Python "
                      "ways taking turns; medians; transport = round trip - the server's compute "
                      "(Python: each call's; C++: attnctl's); ratio = transport / socket; faults: the "
                      f"server's, mean over the Python ways' {max(args.calls, args.fault_rounds)} rounds; "
                      "gRPC floor: grpc_floor's round trip for the same bytes (C++ and grpcio, no message "
                      "built or parsed), ratio to the socket; held: the same with the answer held for the "
                      "request's compute, both cores reading memory meanwhile (round trip less the hold)")
                print(f"{'request':26} {'bytes':>9} {'socket':>8} | {'floor C++':>9} {'ratio':>5} | "
                      f"{'held':>8} {'ratio':>5} | {'floor py':>8} {'ratio':>5} | {'held':>8} {'ratio':>5} | "
                      f"{'compute':>8} | {'stubs':>8} {'ratio':>5} | "
                      f"{'pkg/pb':>8} {'ratio':>5} | {'package':>8} {'ratio':>5} | {'C++':>8} {'ratio':>5} | "
                      f"{'faults/call':>11} {'% of pages':>10} {'calls > 1%':>12}")
                for name, batch, seq, maps, dtype, streamed in REQUESTS:
                    if args.only and not re.search(args.only, name):
                        continue
                    ways, req_bytes = python_ways(client, stub, pb, batch, seq, maps, dtype, streamed)
                    measured, resp_bytes, call_faults = python_calls(
                        ways, args.calls, server.proc.pid, args.warm_up_calls, args.fault_rounds)
                    sock = socket_round_trip_ms(req_bytes, resp_bytes, args.calls)
                    cc_trip, cc_compute = attnctl_calls(args.attnctl, server.target, batch, seq, maps,
                                                        dtype, streamed, args.calls)
                    compute = measured["stubs"][2]
                    floor_columns = " | ".join(["        -     -"] * 4)
                    if floor:
                        floors = [floor.cc_ms(req_bytes, resp_bytes, args.calls),
                                  floor.cc_ms(req_bytes, resp_bytes, args.calls, hold_ms=compute),
                                  floor.python_ms(grpc, req_bytes, resp_bytes, args.calls, args.warm_up_calls),
                                  floor.python_ms(grpc, req_bytes, resp_bytes, args.calls, args.warm_up_calls,
                                                  hold_ms=compute)]
                        floor_columns = " | ".join(f"{ms:7.2f}ms {ms / sock:5.2f}" for ms in floors)
                    columns = " | ".join(f"{measured[way][1]:7.2f}ms {measured[way][1] / sock:5.2f}"
                                         for way in ("stubs", "package via protobuf", "package"))
                    cc_transport = cc_trip - cc_compute
                    pages = resp_bytes / PAGE
                    faults = statistics.mean(call_faults)
                    over = sum(1 for f in call_faults if f > pages / 100)
                    print(f"{name:26} {(req_bytes + resp_bytes) / 1e6:8.1f}M {sock:7.2f}ms | {floor_columns} | "
                          f"{compute:7.2f}ms | "
                          f"{columns} | {cc_transport:7.2f}ms {cc_transport / sock:5.2f} | {faults:11.1f} "
                          f"{100 * faults / pages:9.2f}% {over:4d} of {len(call_faults):<4d}", flush=True)
                client.close()
        finally:
            server.stop()
            if floor:
                floor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
