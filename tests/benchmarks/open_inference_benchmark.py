#!/usr/bin/python3
"""What the Open Inference Protocol's ModelInfer costs beside attnserve.v1's Attend: the round trip.

  tests/benchmarks/open_inference_benchmark.py --server build/server/attnserve [--rounds 5]

Starts attnserve (the built-in model, d_model 768, 12 heads, --max_batch_tokens=0) on a free loopback port
and times calls one at a time, for B=1 S=16 and B=8 S=128 without maps, two ways on channels of their own,
both with the same float32 states as raw bytes:

  - Attend: an attnserve.v1 AttendRequest (hidden_states.raw_data);
  - ModelInfer: an inference.ModelInferRequest (raw_input_contents), stubs generated from
    proto/inference/open_inference.proto into a temporary folder.

The two alternate in blocks within each round (Attend, ModelInfer, ModelInfer, Attend, ...) so that a slow
spell of the machine hits both. Prints each way's median over all rounds, the ratio, and the median of the
per-round ratios, with the CPU model and the load average: compare figures of one run only.
"""
import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
from attnserve.v1 import attention_pb2 as pb  # noqa: E402
from attnserve.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

SHAPES = [(1, 16), (8, 128)]
D_MODEL = 768


def cpu_model():
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = re.search(r"model name\s*:\s*(.*)", info)
    family = re.search(r"cpu family\s*:\s*(\d+)", info)
    model = re.search(r"\nmodel\s*:\s*(\d+)", info)
    return f"{name.group(1) if name else '?'} (family {family.group(1) if family else '?'}, " \
           f"model {model.group(1) if model else '?'}), {os.cpu_count()} CPUs"


def start_server(binary):
    proc = subprocess.Popen([binary, "--listen_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                             "--max_batch_tokens=0"], stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        m = re.search(r"listening on port (\d+)", line)
        if m:
            port = int(m.group(1))
        if "SERVING (" in line:
            return proc, port
    raise RuntimeError("attnserve exited before SERVING")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per way per round (default: 60 for B=1 S=16, 10 for B=8 S=128)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    subprocess.run(["/usr/bin/protoc", f"-I{REPO}/proto", f"--python_out={tmp}", f"--grpc_out={tmp}",
                    "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                    f"{REPO}/proto/inference/open_inference.proto"], check=True)
    sys.path.insert(0, tmp)
    oip = importlib.import_module("inference.open_inference_pb2")
    oip_grpc = importlib.import_module("inference.open_inference_pb2_grpc")
    proc, port = start_server(args.server)
    print(cpu_model())
    try:
        options = [("grpc.max_receive_message_length", 1 << 30)]
        attend = pb_grpc.AttentionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=options)).Attend
        infer = oip_grpc.GRPCInferenceServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{port}", options=options)).ModelInfer
        rng = np.random.default_rng()
        for batch, seq in SHAPES:
            x = rng.standard_normal((batch, seq, D_MODEL)).astype("<f4")
            a_request = pb.AttendRequest(model="default", hidden_states=pb.Tensor(
                dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes()))
            o_request = oip.ModelInferRequest(model_name="default")
            o_request.inputs.add(name="hidden_states", datatype="FP32", shape=x.shape)
            o_request.raw_input_contents.append(x.tobytes())
            a_out = np.frombuffer(attend(a_request, timeout=60).output.raw_data, "<f4")
            o_out = np.frombuffer(infer(o_request, timeout=60).raw_output_contents[0], "<f4")
            assert np.array_equal(a_out, o_out), "the two ways disagree"
            calls = args.calls or (60 if batch == 1 else 10)
            times = {"Attend": [], "ModelInfer": []}
            ratios = []
            load = []
            for _ in range(args.rounds):
                load.append(os.getloadavg()[0])
                this_round = {"Attend": [], "ModelInfer": []}
                for order in (("Attend", "ModelInfer"), ("ModelInfer", "Attend")):
                    for way in order:
                        call, request = (attend, a_request) if way == "Attend" else (infer, o_request)
                        for _ in range(calls // 2):
                            start = time.perf_counter()
                            call(request, timeout=60)
                            this_round[way].append(time.perf_counter() - start)
                for way, values in this_round.items():
                    times[way].extend(values)
                ratios.append(statistics.median(this_round["ModelInfer"]) / statistics.median(this_round["Attend"]))
            a, o = statistics.median(times["Attend"]) * 1e3, statistics.median(times["ModelInfer"]) * 1e3
            print(f"B={batch} S={seq}: Attend p50 {a:.3f} ms, ModelInfer p50 {o:.3f} ms, ratio {o / a:.3f}, "
                  f"median of the rounds' ratios {statistics.median(ratios):.3f} "
                  f"({len(times['Attend'])} calls each; load average {min(load):.1f}-{max(load):.1f})")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
