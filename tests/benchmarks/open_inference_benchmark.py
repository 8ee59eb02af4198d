#!/usr/bin/python3
"""What the Open Inference Protocol costs beside attnserve.v1: round trips.

  tests/benchmarks/open_inference_benchmark.py --server build/server/attnserve [--rounds 5]

Starts attnserve (the built-in model, d_model 768, 12 heads) with its HTTP port
on free loopback ports and times calls one at a time, for B=1 S=16 and B=8
S=128 FP32 hidden states without maps, four ways:

  - attnserve.v1: Attend through the generated stub, raw bytes in and out;
  - OIP gRPC raw: inference.GRPCInferenceService/ModelInfer with
    raw_input_contents (the answer in raw_output_contents), what tritonclient
    and most protocol clients send;
  - OIP gRPC typed: ModelInfer with fp32_contents (the answer typed too);
  - OIP REST: POST /v2/models/default/infer with JSON tensors on one kept-alive
    connection, the answer parsed (json.loads) and made an array. The request
    body is encoded once before timing (how long encoding takes is printed
    apart): the round trip is what the server and the wire add.

Each round runs every way in a block, in an order that rotates from round to
round, so a slow spell of the machine hits them all. Prints each way's median
round trip (p50) over all rounds and its ratio to Attend's, with the CPU model:
compare figures of one run only.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import PACKAGE_DIR, Server, cpu_model, generate_open_inference_stubs  # noqa: E402

sys.path.insert(0, PACKAGE_DIR)
import grpc  # noqa: E402
from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc  # noqa: E402

D_MODEL = 768
# name, batch, seq, calls per block (gRPC ways), calls per block (REST)
SHAPES = [("B=1 S=16", 1, 16, 200, 100), ("B=8 S=128", 8, 128, 20, 4)]
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", -1)]


def ways(server, oip, oip_grpc, channel):
    attend_stub = pb_grpc.AttentionServiceStub(channel)
    oip_stub = oip_grpc.GRPCInferenceServiceStub(channel)

    def attend(x):
        r = attend_stub.Attend(pb.AttendRequest(
            model="default",
            hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes())), timeout=60)
        return np.frombuffer(r.output.raw_data, "<f4").reshape(tuple(r.output.shape))

    def oip_raw(x):
        request = oip.ModelInferRequest(model_name="default")
        request.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
        request.raw_input_contents.append(x.tobytes())
        r = oip_stub.ModelInfer(request, timeout=60)
        return np.frombuffer(r.raw_output_contents[0], "<f4").reshape(tuple(r.outputs[0].shape))

    def oip_typed(x):
        request = oip.ModelInferRequest(model_name="default")
        tensor = request.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
        tensor.contents.fp32_contents.extend(x.ravel())
        r = oip_stub.ModelInfer(request, timeout=60)
        return np.asarray(r.outputs[0].contents.fp32_contents, np.float32).reshape(tuple(r.outputs[0].shape))

    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    bodies = {}

    def rest(x):
        body = bodies[x.shape]
        connection.request("POST", "/v2/models/default/infer", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        assert response.status == 200, (response.status, data[:300])
        out = json.loads(data)["outputs"][0]
        return np.asarray(out["data"], np.float32).reshape(out["shape"])

    def encode(x):
        return json.dumps({"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape),
                                       "data": x.ravel().tolist()}]}).encode()

    return {"attnserve.v1 Attend": attend, "OIP gRPC raw": oip_raw, "OIP gRPC typed": oip_typed,
            "OIP REST JSON": rest}, bodies, encode, connection


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="path to the attnserve binary")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f} (a busy machine widens every figure)")
    # --max_batch_tokens=0: every call alone, so the ways compare the same compute.
    server = Server(args.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0", "--max_seq_len=512")
    try:
        server.wait_serving()
        assert server.http_port, "no 'HTTP on port N' line"
        with tempfile.TemporaryDirectory() as stubs:
            oip, oip_grpc = generate_open_inference_stubs(stubs)
            channel = grpc.insecure_channel(server.target, options=OPTIONS)
            calls, bodies, encode, connection = ways(server, oip, oip_grpc, channel)
            rng = np.random.default_rng()
            for name, batch, seq, n_grpc, n_rest in SHAPES:
                x = rng.standard_normal((batch, seq, D_MODEL)).astype(np.float32)
                start = time.perf_counter()
                bodies[x.shape] = encode(x)
                encode_s = time.perf_counter() - start
                reference = calls["attnserve.v1 Attend"](x)
                for way, call in calls.items():  # warm-up, and every way answers the same
                    out = call(x)
                    assert out.shape == reference.shape and np.array_equal(out, reference), way
                times = {way: [] for way in calls}
                order = list(calls)
                for r in range(args.rounds):
                    for way in order[r % len(order):] + order[:r % len(order)]:
                        n = n_rest if "REST" in way else n_grpc
                        for _ in range(n):
                            start = time.perf_counter()
                            calls[way](x)
                            times[way].append(time.perf_counter() - start)
                base = statistics.median(times["attnserve.v1 Attend"])
                print(f"\n{name} (FP32, {x.nbytes / 1e6:.2f} MB in and out; JSON body {len(bodies[x.shape]) / 1e6:.2f}"
                      f" MB, encoded in {encode_s * 1e3:.1f} ms, not timed):")
                for way, t in times.items():
                    p50 = statistics.median(t)
                    print(f"  {way:22s} p50 {p50 * 1e3:8.3f} ms  {p50 / base:6.2f}x Attend  ({len(t)} calls)")
            connection.close()
            channel.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
