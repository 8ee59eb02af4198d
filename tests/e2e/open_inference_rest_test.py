"""The Open Inference Protocol's HTTP/REST form (KServe v2) on the real
attnserve binary's HTTP port (--http_address=127.0.0.1:0, the port read from
its log), called with `curl` and Python's urllib, against attnserve.v1's Attend
on the same server through the attnserve package.

The server runs without dynamic batching (--max_batch_tokens=0), so the same
inputs compute the same bits on either API: infer's outputs and attention maps
(JSON numbers, FP32 printed to read back exactly) are compared bit for bit
with Attend's for fresh random inputs, nested and flat "data", FP32 and BF16.
Also: health, readiness and metadata, the protocol's error object for bad
JSON (400), an unknown model (404) and a body over --http_max_body_bytes (413,
the server serving on), bearer tokens (401 without one), and a silent
connection closed by --http_request_timeout_ms.

  open_inference_rest_test.py --server <attnserve> --proto_dir <repo>/proto
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import unittest
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--server", required=True)
PARSER.add_argument("--proto_dir", required=True)
ARGS, UNITTEST_ARGS = PARSER.parse_known_args()

D_MODEL, NUM_HEADS = 768, 12  # the built-in model
MAX_BODY = 1 << 20
TOKEN = "rest-test-token-7c2d"


def curl(url, *args):
    """(HTTP status, body) of `curl` on url."""
    out = subprocess.run(["curl", "-sS", "--max-time", "60", "-w", "\n%{http_code}", *args, url],
                         capture_output=True, text=True, check=True).stdout
    body, _, status = out.rpartition("\n")
    return int(status), body


def http(url, body=None, headers=None):
    """(HTTP status, parsed JSON body or None) of a GET (body None) or a JSON POST."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={
        **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    return status, (json.loads(text) if text else None)


def bits(array):
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


class RestServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import attnserve
        cls.server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0",
                                    f"--http_max_body_bytes={MAX_BODY}",
                                    "--http_request_timeout_ms=1000")
        cls.server.wait_serving()
        assert cls.server.http_port, "attnserve did not log its HTTP port"
        cls.base = f"http://127.0.0.1:{cls.server.http_port}"
        cls.client = attnserve.Client(cls.server.target)
        cls.rng = np.random.default_rng()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def infer(self, body, model="default"):
        return http(f"{self.base}/v2/models/{model}/infer", body)

    def test_health_readiness_and_metadata_with_curl(self):
        status, body = curl(f"{self.base}/v2/health/live")
        self.assertEqual((status, json.loads(body)), (200, {"live": True}))
        status, body = curl(f"{self.base}/v2/health/ready")
        self.assertEqual((status, json.loads(body)), (200, {"ready": True}))
        status, body = curl(f"{self.base}/v2/models/default/ready")
        self.assertEqual((status, json.loads(body)), (200, {"name": "default", "ready": True}))
        status, body = curl(f"{self.base}/v2")
        self.assertEqual(status, 200)
        meta = json.loads(body)
        self.assertEqual(set(meta), {"name", "version", "extensions"})
        self.assertEqual(meta["name"], "attnserve")
        self.assertIsInstance(meta["extensions"], list)
        for path in ["/v2/models/default", "/v2/models/default/versions/1"]:
            status, body = curl(self.base + path)
            self.assertEqual(status, 200, body)
            model = json.loads(body)
            self.assertEqual(model["name"], "default")
            self.assertLessEqual({"name", "platform", "inputs", "outputs"}, set(model))
            inputs = {t["name"]: t for t in model["inputs"]}
            self.assertEqual(inputs["hidden_states"]["shape"][-1], D_MODEL)
            self.assertIn("output", {t["name"] for t in model["outputs"]})

    def test_infer_matches_attend_bit_for_bit(self):
        x = self.rng.standard_normal((2, 5, D_MODEL)).astype(np.float32)
        expected = self.client.attend(x, causal=True, maps="mean")
        body = {"id": "r-1", "parameters": {"causal": True, "attention_maps": "mean"},
                "inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": list(x.shape),
                            "data": x.tolist()}],  # nested, as the shape
                "outputs": [{"name": "output"}, {"name": "attention_maps"}]}
        status, reply = self.infer(body)
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply["id"], "r-1")
        self.assertEqual(reply["model_name"], "default")
        outputs = {o["name"]: o for o in reply["outputs"]}
        self.assertEqual(list(outputs), ["output", "attention_maps"])
        self.assertEqual(outputs["output"]["shape"], list(x.shape))
        # Each number is the shortest decimal that reads back to its FP32 value.
        out = np.array(outputs["output"]["data"], dtype=np.float32)
        np.testing.assert_array_equal(bits(out).reshape(x.shape), bits(expected.output))
        maps = np.array(outputs["attention_maps"]["data"], dtype=np.float32)
        self.assertEqual(outputs["attention_maps"]["shape"], list(expected.maps.shape))
        np.testing.assert_array_equal(bits(maps).reshape(expected.maps.shape), bits(expected.maps))

        # Flat data, sent with curl from a file: the same bits.
        body["inputs"][0]["data"] = x.reshape(-1).tolist()
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(body, f)
            f.flush()
            status, text = curl(f"{self.base}/v2/models/default/infer", "-H",
                                "Content-Type: application/json", "--data-binary", f"@{f.name}")
        self.assertEqual(status, 200, text)
        flat = {o["name"]: o for o in json.loads(text)["outputs"]}
        np.testing.assert_array_equal(bits(flat["output"]["data"]).reshape(x.shape),
                                      bits(expected.output))

    def test_bf16_inputs_and_outputs_match_attend(self):
        x = harness.bf16_round(self.rng.standard_normal((1, 7, D_MODEL)).astype(np.float32))
        expected = self.client.attend(x, input_dtype="bf16", output_dtype="bf16")
        status, reply = self.infer({
            "parameters": {"output_dtype": "BF16"},
            "inputs": [{"name": "hidden_states", "datatype": "BF16", "shape": list(x.shape),
                        "data": x.reshape(-1).tolist()}]})
        self.assertEqual(status, 200, reply)
        (output,) = reply["outputs"]
        self.assertEqual(output["datatype"], "BF16")
        np.testing.assert_array_equal(bits(output["data"]).reshape(x.shape), bits(expected.output))

    def test_errors_are_the_protocols_error_object(self):
        status, reply = self.infer(b"{not json")
        self.assertEqual(status, 400)
        self.assertEqual(set(reply), {"error"})
        self.assertIn("request body: not valid JSON", reply["error"])
        status, reply = self.infer({"inputs": [{"name": "hidden_states", "datatype": "FP32",
                                                "shape": [1, 2, D_MODEL], "data": [1, 2]}]})
        self.assertEqual(status, 400)
        self.assertTrue(reply["error"].startswith("inputs[0].data: 2 value(s) for shape"), reply)
        x = np.zeros((1, 1, D_MODEL), np.float32)
        status, reply = self.infer({"inputs": [{"name": "hidden_states", "datatype": "FP32",
                                                "shape": [1, 1, D_MODEL], "data": x.tolist()}]},
                                   model="no-such-model")
        self.assertEqual(status, 404, reply)
        self.assertEqual(set(reply), {"error"})
        status, reply = http(f"{self.base}/v2/models/no-such-model")
        self.assertEqual(status, 404, reply)
        status, reply = http(f"{self.base}/v3")
        self.assertEqual(status, 404)
        self.assertEqual(set(reply), {"error"})

    def test_a_body_over_the_limit_is_413_and_the_server_serves_on(self):
        # curl sends "Expect: 100-continue" for a body this large: the 413
        # comes from the headers, before the body is sent.
        with tempfile.NamedTemporaryFile("wb", suffix=".json") as f:
            f.write(b'{"inputs": [' + b" " * MAX_BODY + b"]}")
            f.flush()
            status, text = curl(f"{self.base}/v2/models/default/infer", "-H",
                                "Content-Type: application/json", "--data-binary", f"@{f.name}")
        self.assertEqual(status, 413, text)
        self.assertIn("--http_max_body_bytes", json.loads(text)["error"])
        status, reply = http(f"{self.base}/v2/health/live")
        self.assertEqual((status, reply), (200, {"live": True}))

    def test_a_silent_connection_is_closed_by_the_request_timeout(self):
        with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=60) as s:
            # Headers begun, never finished. The server may answer an error
            # (JSON) before it closes; then the connection must end. The 60 s
            # socket timeout only bounds a failing test (recv then raises).
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            answer = b""
            try:
                while chunk := s.recv(4096):
                    answer += chunk
            except ConnectionResetError:
                pass
            if answer:
                head, _, body = answer.partition(b"\r\n\r\n")
                self.assertRegex(head.decode(), r"^HTTP/1\.[01] 4\d\d ")
                self.assertEqual(set(json.loads(body)), {"error"})


class RestServerWithTokens(unittest.TestCase):
    def test_infer_and_metadata_need_the_token_health_does_not(self):
        with tempfile.NamedTemporaryFile("w", suffix=".tokens") as tokens:
            tokens.write(TOKEN + "\n")
            tokens.flush()
            server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--max_batch_tokens=0",
                                    f"--auth_tokens_file={tokens.name}")
            try:
                server.wait_serving()
                base = f"http://127.0.0.1:{server.http_port}"
                x = np.ones((1, 2, D_MODEL), np.float32)
                body = {"inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [1, 2, D_MODEL],
                                    "data": x.tolist()}]}
                status, reply = http(f"{base}/v2/models/default/infer", body)
                self.assertEqual(status, 401, reply)
                self.assertEqual(set(reply), {"error"})
                status, reply = http(f"{base}/v2/models/default/infer", body,
                                     {"Authorization": "Bearer wrong"})
                self.assertEqual(status, 401)
                status, reply = http(f"{base}/v2/models/default")
                self.assertEqual(status, 401, reply)
                auth = {"Authorization": f"Bearer {TOKEN}"}
                status, reply = http(f"{base}/v2/models/default", headers=auth)
                self.assertEqual(status, 200, reply)
                status, reply = http(f"{base}/v2/models/default/infer", body, auth)
                self.assertEqual(status, 200, reply)
                self.assertEqual(reply["outputs"][0]["shape"], [1, 2, D_MODEL])
                status, body = curl(f"{base}/v2/health/live")
                self.assertEqual(status, 200)
            finally:
                server.stop()


class RestServerDrain(unittest.TestCase):
    def test_sigterm_stops_readiness_then_new_requests_and_the_process_exits_0(self):
        server = harness.Server(ARGS.server, "--http_address=127.0.0.1:0", "--lame_duck_seconds=1")
        try:
            server.wait_serving()
            base = f"http://127.0.0.1:{server.http_port}"
            self.assertEqual(http(f"{base}/v2/health/ready"), (200, {"ready": True}))
            server.proc.send_signal(signal.SIGTERM)

            def no_longer_ready():
                try:
                    return http(f"{base}/v2/health/ready")[0] in (400, 503)
                except OSError:  # stopped listening: the drain went by
                    return True

            harness.wait_until("/v2/health/ready no longer 200 after SIGTERM", no_longer_ready, 60)
            self.assertEqual(server.proc.wait(timeout=60), 0)
        finally:
            server.stop()


if __name__ == "__main__":
    harness.run_tests_with_stubs(ARGS.proto_dir, UNITTEST_ARGS)
