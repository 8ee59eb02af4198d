#!/usr/bin/python3
"""Memory a server holds with several models loaded and idle, after each has served.

Writes a model repository of --models PyTorch-layout models (d_model --d_model, --heads heads, FP32 weights),
starts the attnserve binary on it (loopback, free ports), sends every model one Attend of --batch sequences of
--seq tokens (FP32, no maps: the blocked route; with --maps also one with per-head maps: the materialized route),
waits until the server reports no call in flight, and prints the process's resident memory beside the weights'
bytes. Run it with two builds' binaries to compare (docs/measurements.md).

  tests/benchmarks/idle_models_rss.py build/server/attnserve [--models 8] [--batch 4] [--seq 512] [--maps]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from harness import Server, generate_stubs, metric, to_tensor, wait_serving, write_safetensors  # noqa: E402


def write_repository(repo, models, d, heads, rng):
    for i in range(models):
        folder = os.path.join(repo, f"layer{i}")
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"layout": "torch_mha", "prefix": "attn.", "d_model": d, "num_heads": heads}, f)
        tensors = {
            "attn.in_proj_weight": ((rng.standard_normal((3 * d, d)) * 0.05).astype(np.float32), "F32"),
            "attn.in_proj_bias": (np.zeros(3 * d, np.float32), "F32"),
            "attn.out_proj.weight": ((rng.standard_normal((d, d)) * 0.05).astype(np.float32), "F32"),
            "attn.out_proj.bias": (np.zeros(d, np.float32), "F32"),
        }
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    return models * 4 * (4 * d * d + 4 * d)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server")
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--maps", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        stubs = os.path.join(tmp, "stubs")
        os.makedirs(stubs)
        generate_stubs(stubs, os.path.join(ROOT, "proto"))
        import grpc
        import health_pb2
        import health_pb2_grpc
        from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc
        repo = os.path.join(tmp, "repo")
        weight_bytes = write_repository(repo, args.models, args.d_model, args.heads, rng)
        server = Server(args.server, f"--model_repository={repo}",
                        "--max_receive_message_bytes=268435456", "--max_send_message_bytes=268435456")
        try:
            channel = grpc.insecure_channel(server.target, options=[
                ("grpc.max_receive_message_length", 1 << 28), ("grpc.max_send_message_length", 1 << 28)])
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            x = rng.standard_normal((args.batch, args.seq, args.d_model)).astype(np.float32)
            before = server.memory_kib()
            for i in range(args.models):
                stub.Attend(pb.AttendRequest(model=f"layer{i}", hidden_states=to_tensor(pb, x)), timeout=600)
                if args.maps:
                    stub.Attend(pb.AttendRequest(
                        model=f"layer{i}", hidden_states=to_tensor(pb, x),
                        attention_maps=pb.AttentionMapRequest(mode=pb.ATTENTION_MAP_MODE_PER_HEAD)),
                        timeout=600)
            deadline = time.monotonic() + 60
            while metric(server.scrape(), "attnserve_requests_in_flight") not in (0, 0.0):
                if time.monotonic() > deadline:
                    raise RuntimeError("calls still in flight after 60 s")
                time.sleep(0.1)
            after = server.memory_kib()
        finally:
            server.stop()
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    print(f"CPU: {cpu}; {args.models} models d_model {args.d_model}, {args.heads} heads; "
          f"each served B={args.batch} S={args.seq}{' with and without maps' if args.maps else ''}")
    print(f"weights: {weight_bytes / 2**20:.0f} MiB")
    print(f"RSS loaded, before serving: {before['VmRSS'] / 1024:.0f} MiB")
    print(f"RSS idle after serving:     {after['VmRSS'] / 1024:.0f} MiB (peak {after['VmHWM'] / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
