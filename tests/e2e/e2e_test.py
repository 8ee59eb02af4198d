#!/usr/bin/python3
"""End-to-end: the real attnserve binary called from Python's grpcio.

Stubs are generated at test time from the repository's proto and Debian's
grpc-proto files, with protoc and grpc_python_plugin. The Attend result is
checked against a NumPy float64 reference built from the documented seeded
weights (docs/seeded_weights.md), on fresh random inputs.

Usage: e2e_test.py --server PATH/attnserve --proto_dir REPO/proto
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

ARGS = None
GRPC_PROTO_DIR = "/usr/share/grpc-proto"


def generate_stubs(out_dir):
    def protoc(include, proto):
        subprocess.run(
            ["protoc", f"-I{include}", f"--python_out={out_dir}", f"--grpc_out={out_dir}",
             "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", os.path.join(include, proto)],
            check=True)

    protoc(ARGS.proto_dir, "attnserve/v1/attention.proto")
    open(os.path.join(out_dir, "attnserve", "__init__.py"), "a").close()
    open(os.path.join(out_dir, "attnserve", "v1", "__init__.py"), "a").close()
    # The standard protos are compiled as top-level modules (health_pb2,
    # reflection_pb2): a "grpc/" package here would hide grpcio's own.
    for proto in ["grpc/health/v1/health.proto", "grpc/reflection/v1alpha/reflection.proto"]:
        flat = os.path.join(out_dir, "flat")
        os.makedirs(flat, exist_ok=True)
        with open(os.path.join(GRPC_PROTO_DIR, proto)) as src, \
                open(os.path.join(flat, os.path.basename(proto)), "w") as dst:
            dst.write(src.read())
        protoc(flat, os.path.basename(proto))
    sys.path.insert(0, out_dir)


# --- The reference: docs/seeded_weights.md, reimplemented independently ---

def seeded_uniform(seed, stream, n):
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (np.full(n, seed, dtype=np.uint64)
             + np.full(n, stream, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
             + i * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)


def seeded_weights(seed, d_model, num_heads, num_kv_heads, head_dim):
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shapes = [(d_model, q), (q,), (d_model, kv), (kv,), (d_model, kv), (kv,), (q, d_model), (d_model,)]
    fan_ins = [d_model] * 6 + [q, q]
    weights = []
    for stream, (shape, fan_in) in enumerate(zip(shapes, fan_ins)):
        u = seeded_uniform(seed, stream, int(np.prod(shape)))
        weights.append(((2.0 * u - 1.0) * (1.0 / np.sqrt(float(fan_in)))).astype(np.float32).reshape(shape))
    return weights


def reference_attention(x, weights, num_heads, num_kv_heads, head_dim, scale):
    """x: [batch, seq, d_model]; returns output and per-head maps, float64."""
    w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o = [w.astype(np.float64) for w in weights]
    x = x.astype(np.float64)
    batch, seq, _ = x.shape
    q = (x @ w_q + b_q).reshape(batch, seq, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = (x @ w_k + b_k).reshape(batch, seq, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (x @ w_v + b_v).reshape(batch, seq, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    group = num_heads // num_kv_heads
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head_dim)
    return ctx @ w_o + b_o, p


def rel_error(actual, expected):
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


class Server:
    """The attnserve binary on a free loopback port."""

    def __init__(self, *flags):
        self.seed = int(np.random.default_rng().integers(0, 2**63))
        self.proc = subprocess.Popen(
            [ARGS.server, "--listen_address=127.0.0.1:0", f"--builtin_model_seed={self.seed}", *flags],
            stderr=subprocess.PIPE, text=True)
        self.log = []
        port_seen = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                sys.stderr.write("  [attnserve] " + line)
                m = re.search(r"listening on port (\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    port_seen.set()

        threading.Thread(target=pump, daemon=True).start()
        if not port_seen.wait(60):
            self.proc.kill()
            raise RuntimeError("attnserve did not report its port")
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()


class EndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2, health_pb2_grpc
        cls.grpc, cls.pb, cls.pb_grpc = grpc, attention_pb2, attention_pb2_grpc
        cls.health_pb, cls.health_grpc = health_pb2, health_pb2_grpc
        cls.server = Server()
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_receive_message_length", 256 << 20)])
        cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        cls.health = health_pb2_grpc.HealthStub(cls.channel)
        cls.wait_serving(cls.health, cls.health_pb)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    @staticmethod
    def wait_serving(health, health_pb, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = health.Check(health_pb.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb.HealthCheckResponse.SERVING:
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.05)
        raise AssertionError("attnserve never became SERVING")

    def request(self, x, maps):
        t = self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(x.shape),
                           raw_data=np.ascontiguousarray(x, dtype="<f4").tobytes())
        return self.pb.AttendRequest(model="default", hidden_states=t,
                                     attention_maps=self.pb.AttentionMapRequest(mode=maps))

    def test_health_reports_serving_for_the_server_and_the_service(self):
        for service in ["", "attnserve.v1.AttentionService"]:
            r = self.health.Check(self.health_pb.HealthCheckRequest(service=service), timeout=5)
            self.assertEqual(r.status, self.health_pb.HealthCheckResponse.SERVING, service)

    def test_reflection_lists_and_describes_the_service(self):
        import reflection_pb2, reflection_pb2_grpc
        from google.protobuf import descriptor_pb2
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="attnserve.v1.AttentionService")]
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
        services = {s.name for s in responses[0].list_services_response.service}
        self.assertIn("attnserve.v1.AttentionService", services)
        self.assertIn("grpc.health.v1.Health", services)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in responses[1].file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service if s.name == "AttentionService"
                   for m in s.method}
        self.assertEqual(methods, {"Attend", "ListModels", "GetModel"})

    def test_list_models_reports_the_builtin_head_configuration(self):
        models = self.stub.ListModels(self.pb.ListModelsRequest(), timeout=10).models
        self.assertEqual([m.name for m in models], ["default"])
        h = models[0].head_config
        self.assertEqual((h.d_model, h.num_heads, h.num_kv_heads, h.head_dim), (768, 12, 12, 64))

    def test_attend_matches_numpy_reference(self):
        info = self.stub.GetModel(self.pb.GetModelRequest(name="default"), timeout=10)
        h = info.head_config
        weights = seeded_weights(self.server.seed, h.d_model, h.num_heads, h.num_kv_heads, h.head_dim)
        rng = np.random.default_rng()
        for batch, seq in [(1, 1), (2, 7), (3, 33)]:
            x = rng.standard_normal((batch, seq, h.d_model)).astype(np.float32)
            r = self.stub.Attend(self.request(x, self.pb.ATTENTION_MAP_MODE_PER_HEAD), timeout=30)
            out = np.frombuffer(r.output.raw_data, dtype="<f4").reshape(tuple(r.output.shape))
            maps = np.frombuffer(r.attention_maps.raw_data, dtype="<f4").reshape(
                tuple(r.attention_maps.shape))
            ref_out, ref_maps = reference_attention(x, weights, h.num_heads, h.num_kv_heads,
                                                    h.head_dim, h.scale)
            self.assertEqual(out.shape, (batch, seq, h.d_model))
            self.assertEqual(maps.shape, (batch, h.num_heads, seq, seq))
            self.assertLessEqual(rel_error(out, ref_out), 1e-5, (batch, seq))
            self.assertLessEqual(rel_error(maps, ref_maps), 1e-5, (batch, seq))
            np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=1e-5)
            self.assertEqual(r.kernel_path, "fp32/materialized")

    def test_bad_input_names_the_field_and_the_server_keeps_serving(self):
        x = np.zeros((1, 4, 512), dtype=np.float32)
        with self.assertRaises(self.grpc.RpcError) as caught:
            self.stub.Attend(self.request(x, self.pb.ATTENTION_MAP_MODE_NONE), timeout=10)
        self.assertEqual(caught.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("hidden_states.shape[2] (d_model)", caught.exception.details())
        ok = self.stub.Attend(self.request(np.ones((1, 4, 768), np.float32),
                                           self.pb.ATTENTION_MAP_MODE_NONE), timeout=10)
        self.assertEqual(list(ok.output.shape), [1, 4, 768])


class Shutdown(unittest.TestCase):
    def test_sigterm_drains_calls_in_flight_refuses_new_ones_and_exits_zero(self):
        import grpc
        from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
        import health_pb2, health_pb2_grpc
        server = Server()
        try:
            channel = grpc.insecure_channel(server.target, options=[
                ("grpc.max_receive_message_length", 64 << 20)])
            stub = pb_grpc.AttentionServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            EndToEnd.wait_serving(health, health_pb2)
            x = np.random.default_rng().standard_normal((8, 256, 768)).astype(np.float32)
            request = pb.AttendRequest(model="default", hidden_states=pb.Tensor(
                dtype=pb.DATA_TYPE_FP32, shape=list(x.shape), raw_data=x.tobytes()))
            # Enough queued work that calls are still in flight when the signal lands.
            futures = [stub.Attend.future(request, timeout=120) for _ in range(8)]
            time.sleep(0.3)
            in_flight = sum(not f.done() for f in futures)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                self.assertNotEqual(status, health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE)
            with self.assertRaises(grpc.RpcError) as refused:
                stub.Attend(request, timeout=10)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)
            for f in futures:
                self.assertEqual(list(f.result().output.shape), [8, 256, 768])
            self.assertEqual(server.proc.wait(timeout=60), 0)
            self.assertGreater(in_flight, 0, "no call was in flight at SIGTERM; the test proved nothing")
            channel.close()
        finally:
            server.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs)
        unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
