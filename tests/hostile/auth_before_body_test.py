#!/usr/bin/python3
"""Bearer tokens are checked before a request's body is read, on TLS.

With --auth_tokens_file and --tls_cert, attnserve checks each AttentionService
call's token in a gRPC auth metadata processor, from the call's headers: a
call with a wrong token ends UNAUTHENTICATED having sent at most a
flow-control window of its body. Against the real binary over real TLS:

  - the hostile client's slow bodies (tests/hostile/attacks.py slow_bodies,
    here 8 calls each declaring 60 MiB and offering 16 MiB, over TLS, with a
    wrong token): every call answered UNAUTHENTICATED, having sent a small
    part of the 16 MiB it offers (about a window, under 1 MiB a call on a
    quiet machine; the test allows a quarter of it, 4 MiB a call: the check
    runs on a gRPC thread, and on a loaded machine the server grants windows
    while it waits -- 1.0 MiB a call was seen under stress-ng);
  - the same calls to a plaintext server with the same tokens (gRPC runs no
    metadata processor there): the server reads their bodies (more than 8 MiB
    in all) before the handler refuses them, which is what the TLS check
    saves;
  - on the TLS server, the health service answers without a token and an
    Attend with a valid token succeeds (the check stops only what it should).

Usage: auth_before_body_test.py --server PATH/attnserve --proto_dir REPO/proto
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import Server, run_tests_with_stubs, wait_until  # noqa: E402

ARGS = None
STREAMS = 8
MIB = 1 << 20


def make_certificate(directory):
    """A self-signed certificate for localhost / 127.0.0.1 and its key."""
    cert, key = os.path.join(directory, "server.pem"), os.path.join(directory, "server.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def slow_bodies(port, tls):
    """attacks.py slow_bodies with a wrong token: its summary."""
    command = [sys.executable, os.path.join(HERE, "attacks.py"), "slow_bodies", "--port", str(port),
               "--seconds", "6", "--streams", str(STREAMS), "--streams_per_connection", "4",
               "--declared_mib", "60", "--send_mib", "16", "--rate_mib", "256",
               "--token", "not-a-valid-token"] + (["--tls"] if tls else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    sys.stderr.write(f"auth_before_body: {'TLS' if tls else 'plaintext'}: {summary}\n")
    return summary


class AuthBeforeBody(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.TemporaryDirectory()
        cls.cert, cls.key = make_certificate(cls.work.name)
        cls.token = os.urandom(16).hex()
        cls.tokens = os.path.join(cls.work.name, "tokens")
        with open(cls.tokens, "w") as f:
            f.write(cls.token + "\n")

    @classmethod
    def tearDownClass(cls):
        cls.work.cleanup()

    def server(self, tls):
        flags = ["--compute_threads=1", f"--auth_tokens_file={self.tokens}"]
        if tls:
            flags += [f"--tls_cert={self.cert}", f"--tls_key={self.key}"]
        server = Server(ARGS.server, *flags)
        self.addCleanup(server.stop)
        return server

    def test_on_tls_a_wrong_token_ends_the_call_before_its_body(self):
        summary = slow_bodies(self.server(tls=True).port, tls=True)
        self.assertEqual(summary["answered"], {"16": STREAMS}, summary)  # 16: UNAUTHENTICATED
        # Far less than the 16 MiB a call offers, which the plaintext server reads whole.
        self.assertLess(summary["mib_sent"], STREAMS * 4.0, summary)

    def test_in_plaintext_the_same_bodies_are_read_before_the_handler_refuses(self):
        summary = slow_bodies(self.server(tls=False).port, tls=False)
        self.assertGreater(summary["mib_sent"], STREAMS * 1.0, summary)

    def test_on_tls_health_needs_no_token_and_a_valid_token_is_served(self):
        import grpc
        import health_pb2
        import health_pb2_grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        server = self.server(tls=True)
        with open(self.cert, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = wait_until("SERVING over TLS", lambda: health.Check(
                health_pb2.HealthCheckRequest(service="attnserve.v1.AttentionService"),
                timeout=30).status == health_pb2.HealthCheckResponse.SERVING, 60)
            self.assertTrue(answer)
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            with self.assertRaises(grpc.RpcError) as refused:
                stub.ListModels(attention_pb2.ListModelsRequest(), timeout=30)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            models = stub.ListModels(attention_pb2.ListModelsRequest(), timeout=30,
                                     metadata=[("authorization", f"Bearer {self.token}")])
            self.assertIn("default", [m.name for m in models.models])


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
