#!/usr/bin/python3
"""End-to-end: the real attnserve binary called from Python's grpcio.

Stubs are generated at test time from the repository's proto and Debian's
grpc-proto files, with protoc and grpc_python_plugin. The Attend result is
checked against a NumPy float64 reference built from the documented seeded
weights (docs/seeded_weights.md), on fresh random inputs.

Usage: e2e_test.py --server PATH/attnserve --attnctl PATH/attnctl --proto_dir REPO/proto
"""
import argparse
import os
import signal
import sys
import tempfile
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, attend_stream, run_tests_with_stubs, metric,  # noqa: E402
                     reference_attention, rel_error, seeded_weights, wait_serving)

ARGS = None


class EndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2, health_pb2_grpc
        cls.grpc, cls.pb, cls.pb_grpc = grpc, attention_pb2, attention_pb2_grpc
        cls.health_pb, cls.health_grpc = health_pb2, health_pb2_grpc
        cls.server = Server(ARGS.server)
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_receive_message_length", 256 << 20)])
        cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        cls.health = health_pb2_grpc.HealthStub(cls.channel)
        wait_serving(cls.health, cls.health_pb)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    def request(self, x, maps):
        t = self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(x.shape),
                           raw_data=np.ascontiguousarray(x, dtype="<f4").tobytes())
        return self.pb.AttendRequest(model="default", hidden_states=t,
                                     attention_maps=self.pb.AttentionMapRequest(mode=maps))

    def test_health_reports_serving_for_the_server_and_the_service(self):
        for service in ["", "attnserve.v1.AttentionService"]:
            r = self.health.Check(self.health_pb.HealthCheckRequest(service=service), timeout=60)
            self.assertEqual(r.status, self.health_pb.HealthCheckResponse.SERVING, service)

    def test_reflection_lists_and_describes_the_service(self):
        import reflection_pb2, reflection_pb2_grpc
        from google.protobuf import descriptor_pb2
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="attnserve.v1.AttentionService")]
        responses = list(stub.ServerReflectionInfo(iter(requests), timeout=60))
        services = {s.name for s in responses[0].list_services_response.service}
        self.assertIn("attnserve.v1.AttentionService", services)
        self.assertIn("grpc.health.v1.Health", services)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in responses[1].file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service if s.name == "AttentionService"
                   for m in s.method}
        self.assertEqual(methods, {"Attend", "AttendStream", "ListModels", "GetModel", "LoadModel",
                                   "UnloadModel", "OpenSession", "Extend", "ExtendStream",
                                   "GetSession",
                                   "ForkSession", "TruncateSession", "CloseSession", "GetLatestAttention"})

    def test_list_models_reports_the_builtin_head_configuration(self):
        models = self.stub.ListModels(self.pb.ListModelsRequest(), timeout=60).models
        self.assertEqual([m.name for m in models], ["default"])
        h = models[0].head_config
        self.assertEqual((h.d_model, h.num_heads, h.num_kv_heads, h.head_dim), (768, 12, 12, 64))

    def test_attend_matches_numpy_reference(self):
        info = self.stub.GetModel(self.pb.GetModelRequest(name="default"), timeout=60)
        h = info.head_config
        weights = seeded_weights(self.server.seed, h.d_model, h.num_heads, h.num_kv_heads, h.head_dim)
        rng = np.random.default_rng()
        for batch, seq in [(1, 1), (2, 7), (3, 33)]:
            x = rng.standard_normal((batch, seq, h.d_model)).astype(np.float32)
            r = self.stub.Attend(self.request(x, self.pb.ATTENTION_MAP_MODE_PER_HEAD), timeout=60)
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

    def test_attend_stream_brings_maps_larger_than_grpcios_receive_limit(self):
        # A channel with grpcio's defaults: it takes no message over 4 MiB.
        # The maps, [4, 12, 256, 256] FP32, are 12.6 MB: Attend's one message
        # is refused by the client, AttendStream's chunks arrive and are put
        # back in place as they come.
        info = self.stub.GetModel(self.pb.GetModelRequest(name="default"), timeout=60)
        h = info.head_config
        weights = seeded_weights(self.server.seed, h.d_model, h.num_heads, h.num_kv_heads, h.head_dim)
        x = np.random.default_rng().standard_normal((4, 256, h.d_model)).astype(np.float32)
        request = self.request(x, self.pb.ATTENTION_MAP_MODE_PER_HEAD)
        with self.grpc.insecure_channel(self.server.target) as channel:
            stub = self.pb_grpc.AttentionServiceStub(channel)
            with self.assertRaises(self.grpc.RpcError) as refused:
                stub.Attend(request, timeout=60)
            self.assertEqual(refused.exception.code(), self.grpc.StatusCode.RESOURCE_EXHAUSTED)
            response, maps, chunks = attend_stream(stub, self.pb, request)
        self.assertGreaterEqual(chunks, 12)  # at most 1 MiB each
        out = np.frombuffer(response.output.raw_data, dtype="<f4").reshape(tuple(response.output.shape))
        ref_out, ref_maps = reference_attention(x, weights, h.num_heads, h.num_kv_heads, h.head_dim,
                                                h.scale)
        self.assertEqual(maps.shape, (4, h.num_heads, 256, 256))
        self.assertLessEqual(rel_error(out, ref_out), 1e-5)
        self.assertLessEqual(rel_error(maps, ref_maps), 1e-5)
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, atol=1e-5)

    def test_bytes_that_are_not_a_request_get_invalid_argument_naming_the_request(self):
        attend = self.channel.unary_unary("/attnserve.v1.AttentionService/Attend")
        for label, raw in [("garbage", b"\xff\xff\xff\xff\x0f"),
                           ("model not UTF-8", b"\x0a\x02\xff\xfe")]:
            with self.assertRaises(self.grpc.RpcError, msg=label) as caught:
                attend(raw, timeout=60)
            self.assertEqual(caught.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT, label)
            self.assertIn("request: not a valid attnserve.v1.AttendRequest", caught.exception.details())
        ok = self.stub.Attend(self.request(np.ones((1, 2, 768), np.float32),
                                           self.pb.ATTENTION_MAP_MODE_NONE), timeout=60)
        self.assertEqual(list(ok.output.shape), [1, 2, 768])

    def test_bad_input_names_the_field_and_the_server_keeps_serving(self):
        x = np.zeros((1, 4, 512), dtype=np.float32)
        with self.assertRaises(self.grpc.RpcError) as caught:
            self.stub.Attend(self.request(x, self.pb.ATTENTION_MAP_MODE_NONE), timeout=60)
        self.assertEqual(caught.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("hidden_states.shape[2] (d_model)", caught.exception.details())
        ok = self.stub.Attend(self.request(np.ones((1, 4, 768), np.float32),
                                           self.pb.ATTENTION_MAP_MODE_NONE), timeout=60)
        self.assertEqual(list(ok.output.shape), [1, 4, 768])


class Attnctl(unittest.TestCase):
    """The README's attnctl commands against the real server."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(ARGS.server)
        import grpc
        import health_pb2
        import health_pb2_grpc
        with grpc.insecure_channel(cls.server.target) as channel:
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def attnctl(self, *args):
        import subprocess
        done = subprocess.run([ARGS.attnctl, f"--target={self.server.target}", *args],
                              capture_output=True, text=True, timeout=60)
        return done.returncode, done.stdout + done.stderr

    def test_health_models_and_attend_print_what_the_readme_says(self):
        code, out = self.attnctl("health")
        self.assertEqual((code, out.strip()), (0, "SERVING"))
        code, out = self.attnctl("models")
        self.assertEqual(code, 0, out)
        self.assertIn("d_model 768, heads 12, kv heads 12, head_dim 64", out)
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "maps.png")
            code, out = self.attnctl("attend", "--model=default", "--batch=2", "--seq=8",
                                     "--maps=per-head", f"--maps_png={png}")
            self.assertEqual(code, 0, out)
            self.assertIn("output [2, 8, 768]", out)
            self.assertIn("attention maps [2, 12, 8, 8]", out)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        code, out = self.attnctl("attend", "--model=no-such-model")
        self.assertNotEqual(code, 0)
        self.assertIn("NOT_FOUND", out)


class Shutdown(unittest.TestCase):
    def test_sigterm_drains_calls_in_flight_refuses_new_ones_and_exits_zero(self):
        import grpc
        from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
        import health_pb2
        import health_pb2_grpc
        # The eight calls gather in one batch that never fills (a million
        # tokens) and waits up to 10 s from the first arrival for more: the
        # executor holds them, so they stay in flight until the signal however
        # slowly they upload or compute. The drain then waits out that delay
        # and computes them; its timeout leaves room for a busy machine. No
        # lame duck: new calls are refused from the signal on (a lame duck
        # still serves them).
        server = Server(ARGS.server, "--lame_duck_seconds=0", "--max_batch_tokens=1000000",
                        "--max_queue_delay_us=10000000", "--drain_timeout_seconds=300")
        try:
            channel = grpc.insecure_channel(server.target, options=[
                ("grpc.max_receive_message_length", 64 << 20)])
            stub = pb_grpc.AttentionServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            wait_serving(health, health_pb2)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=240)
            self.assertEqual(next(watch).status, health_pb2.HealthCheckResponse.SERVING)
            x = np.random.default_rng().standard_normal((8, 256, 768)).astype(np.float32)
            request = pb.AttendRequest(model="default", hidden_states=pb.Tensor(
                dtype=pb.DATA_TYPE_FP32, shape=list(x.shape), raw_data=x.tobytes()))
            futures = [stub.Attend.future(request, timeout=240) for _ in range(8)]
            # Signal only once the server reports all eight calls received
            # (in flight), not when we hope they have arrived.
            deadline = time.monotonic() + 120
            while metric(server.scrape(), "attnserve_requests_in_flight") < len(futures):
                self.assertLess(time.monotonic(), deadline, "the server never had all 8 calls in flight")
                failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
                self.assertEqual(failed, [], "a call failed before the signal")
                time.sleep(0.01)
            in_flight = sum(not f.done() for f in futures)
            server.proc.send_signal(signal.SIGTERM)
            # Health turns NOT_SERVING while the server still listens (the
            # drain), for Watch streams and for new Checks.
            self.assertEqual(next(watch).status, health_pb2.HealthCheckResponse.NOT_SERVING)
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60).status
            self.assertEqual(status, health_pb2.HealthCheckResponse.NOT_SERVING)
            with self.assertRaises(grpc.RpcError) as refused:
                stub.Attend(request, timeout=60)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)
            for f in futures:
                self.assertEqual(list(f.result().output.shape), [8, 256, 768])
            self.assertEqual(server.proc.wait(timeout=120), 0)
            self.assertGreater(in_flight, 0, "no call was in flight at SIGTERM; the test proved nothing")
            channel.close()
        finally:
            server.stop()

    def test_idle_server_with_an_open_watch_stops_promptly(self):
        import grpc
        import health_pb2
        import health_pb2_grpc
        server = Server(ARGS.server, "--lame_duck_seconds=0.2")
        try:
            channel = grpc.insecure_channel(server.target)
            health = health_pb2_grpc.HealthStub(channel)
            wait_serving(health, health_pb2)
            # The Watch asks for an hour: a server it held would still be
            # running long after the generous wait below (lame duck 0.2 s and
            # a flush of 0.5 s are all an idle server needs).
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3600)
            next(watch)
            server.proc.send_signal(signal.SIGTERM)
            self.assertEqual(server.proc.wait(timeout=120), 0)
            channel.close()
        finally:
            server.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--attnctl", required=True)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
