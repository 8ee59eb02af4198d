#!/usr/bin/python3
"""The front proxy's configuration, deploy/haproxy/haproxy.cfg, run by
Debian's HAProxy 2.6:

  - `haproxy -c` accepts it without a warning for DNS-discovered replicas and
    for one to four fixed ones, with and without TLS, and refuses to start
    without replicas, naming the variables to set;
  - its gRPC health check, raw HTTP/2 bytes in tcp-check rules, is a valid
    grpc.health.v1.Health/Check call for attnserve.v1.AttentionService (the
    bytes decoded by python3-h2's HTTP/2 server state machine, HPACK decoder
    and the health proto), and its expect rules pass a SERVING answer and
    nothing else (answers made by that HTTP/2 stack, matched as HAProxy does:
    a regex on the upper-case hex of what came back);
  - against the real binary: a SERVING replica is UP; a listener that accepts
    connections but speaks no gRPC stays DOWN (the check is not a TCP
    connect); a replica in its lame duck, alive and listening but NOT_SERVING,
    is taken out within the config's detection time;
  - the per-client limits are in effect: HAProxy announces the configured
    streams per connection, refuses a header block larger than its buffer
    before the backend (a request within the limits gets the backend's 503:
    its one replica is down), and refuses the connection past the configured
    count from one address while another address still connects; against
    the real binary, an address holding its limit of calls in flight (bodies
    that never end) gets 429 for exactly the calls past it while a call from
    another address is served.

Usage: haproxy_config_test.py --server PATH/attnserve --repo REPO
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import hyperframe.frame

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, HERE)
from harness import Server, generate_stubs  # noqa: E402
from haproxy_runner import HAProxy, config_path, haproxy_binary  # noqa: E402

ARGS = None
SERVICE = "attnserve.v1.AttentionService"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def config_text():
    with open(config_path(ARGS.repo)) as f:
        return f.read()


def check(env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    done = subprocess.run([haproxy_binary(), "-c", "-f", config_path(ARGS.repo)], capture_output=True,
                          text=True, timeout=120, env=dict(clean, **env))
    return done.returncode, done.stdout + done.stderr


def health_check_rules():
    """(the bytes the tcp-check rules send, [the rbinary regexes they expect])."""
    text = config_text()
    sent = b"".join(bytes.fromhex(h) for h in re.findall(r"^\s*tcp-check send-binary ([0-9a-f]+)", text, re.M))
    expects = re.findall(r"^\s*tcp-check expect (?:min-recv \d+ )?rbinary (\S+)", text, re.M)
    return sent, expects


def frames(data):
    """The HTTP/2 frames in `data`, parsed by hyperframe."""
    out = []
    while data:
        frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        out.append(frame)
        data = data[9 + length:]
    return out


def matches(regex, response):
    """HAProxy's rbinary: the regex searched in the upper-case hex of the bytes."""
    return re.search(regex, response.hex().upper()) is not None


class Config(unittest.TestCase):
    def test_haproxy_accepts_it_without_warnings_for_dns_and_for_one_to_four_fixed_replicas(self):
        envs = [{"ATTNSERVE_REPLICAS_DNS": "attnserve:50051"}]
        for n in range(1, 5):
            envs.append({f"ATTNSERVE_REPLICA_{i}": f"127.0.0.1:{50050 + i}" for i in range(1, n + 1)})
        for env in envs:
            code, out = check(env)
            self.assertEqual(code, 0, f"{env}: {out}")
            self.assertNotIn("WARNING", out, env)

    def test_without_replicas_it_refuses_to_start_naming_the_variables(self):
        code, out = check({})
        self.assertNotEqual(code, 0, out)
        self.assertIn("set ATTNSERVE_REPLICAS_DNS (name:port) or ATTNSERVE_REPLICA_1 (host:port)", out)

    def test_a_certificate_adds_a_tls_listener_for_h2(self):
        self.assertRegex(config_text(), r'(?m)^\s*bind "\$\{ATTNSERVE_PROXY_TLS_BIND-:\d+\}" ssl crt '
                                        r'"\$\{ATTNSERVE_PROXY_TLS_CERT\}" alpn h2$')
        with tempfile.TemporaryDirectory() as work:
            key, cert = os.path.join(work, "key.pem"), os.path.join(work, "cert.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                            "-out", cert, "-days", "1", "-subj", "/CN=attnserve"],
                           check=True, capture_output=True, timeout=120)
            pem = os.path.join(work, "proxy.pem")
            with open(pem, "w") as out, open(cert) as c, open(key) as k:
                out.write(c.read() + k.read())
            code, out = check({"ATTNSERVE_REPLICA_1": "127.0.0.1:50051", "ATTNSERVE_PROXY_TLS_CERT": pem})
            self.assertEqual(code, 0, out)
            self.assertNotIn("WARNING", out)
            code, out = check({"ATTNSERVE_REPLICA_1": "127.0.0.1:50051",
                               "ATTNSERVE_PROXY_TLS_CERT": os.path.join(work, "missing.pem")})
            self.assertNotEqual(code, 0, "a missing certificate must stop it")


class HealthCheckBytes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import health_pb2
        cls.health_pb = health_pb2
        cls.sent, cls.expects = health_check_rules()

    def test_the_check_is_one_grpc_health_call_for_the_attention_service(self):
        self.assertTrue(self.sent.startswith(PREFACE))
        parsed = frames(self.sent[len(PREFACE):])
        self.assertEqual([type(f).__name__ for f in parsed], ["SettingsFrame", "HeadersFrame", "DataFrame"])
        headers, data = parsed[1], parsed[2]
        self.assertEqual((headers.stream_id, headers.flags), (1, {"END_HEADERS"}))
        self.assertEqual(hpack.Decoder().decode(headers.data), [
            (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
            (":authority", "attnserve"), ("content-type", "application/grpc"), ("te", "trailers")])
        self.assertEqual((data.stream_id, data.flags), (1, {"END_STREAM"}))
        self.assertEqual(data.data[0], 0, "not compressed")
        length = int.from_bytes(data.data[1:5], "big")
        self.assertEqual(length, len(data.data) - 5)
        request = self.health_pb.HealthCheckRequest.FromString(data.data[5:])
        self.assertEqual(request.service, SERVICE)

        # An HTTP/2 server (python3-h2's state machine) takes it as one
        # complete request.
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        events = server.receive_data(self.sent)
        kinds = [type(e).__name__ for e in events]
        self.assertEqual(kinds, ["RemoteSettingsChanged", "RequestReceived", "DataReceived", "StreamEnded"])

    def answer(self, status=None, grpc_status=0):
        """What an HTTP/2 server (python3-h2) sends back to the check: a
        HealthCheckResponse with `status` then trailers, or, without a status,
        a trailers-only error answer with `grpc_status`."""
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                                      header_encoding="utf-8"))
        server.initiate_connection()
        server.receive_data(self.sent)
        if status is None:
            server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc"),
                                    ("grpc-status", str(grpc_status))], end_stream=True)
        else:
            message = self.health_pb.HealthCheckResponse(status=status).SerializeToString()
            server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
            server.send_data(1, b"\0" + len(message).to_bytes(4, "big") + message)
            server.send_headers(1, [("grpc-status", "0")], end_stream=True)
        return server.data_to_send()

    def test_the_expect_rules_pass_serving_and_nothing_else(self):
        self.assertEqual(len(self.expects), 2)
        ended, serving = self.expects
        r = self.health_pb.HealthCheckResponse
        answers = {"SERVING": self.answer(r.SERVING), "NOT_SERVING": self.answer(r.NOT_SERVING),
                   "UNKNOWN": self.answer(r.UNKNOWN), "SERVICE_UNKNOWN": self.answer(r.SERVICE_UNKNOWN),
                   "NOT_FOUND (trailers only)": self.answer(grpc_status=5),
                   "UNAVAILABLE (trailers only)": self.answer(grpc_status=14)}
        for name, response in answers.items():
            self.assertTrue(matches(ended, response), f"{name}: the first rule must see the call end")
            self.assertEqual(matches(serving, response), name == "SERVING", name)
        # Until the trailers' frame has come, the first rule keeps waiting
        # (and the DATA frame before it has come whole once it matches).
        complete = answers["SERVING"]
        trailers = frames(complete)[-1]
        self.assertEqual((type(trailers).__name__, trailers.flags), ("HeadersFrame", {"END_STREAM", "END_HEADERS"}))
        before_trailers = complete[:len(complete) - 9 - len(trailers.data)]
        self.assertFalse(matches(ended, before_trailers))
        self.assertTrue(matches(serving, before_trailers))


def replica_state(proxy):
    return proxy.server_states().get("replica1")


class AgainstTheServer(unittest.TestCase):
    """The health check against the real binary, and a listener that is not one."""

    def test_a_serving_replica_is_up_and_a_non_grpc_listener_stays_down(self):
        # Accepts connections, reads what comes and never answers.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        stop = threading.Event()

        def accept():
            listener.settimeout(0.2)
            held = []
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])
                except OSError:
                    pass
            for c in held:
                c.close()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        server = Server(ARGS.server, "--compute_threads=1")
        try:
            silent = f"127.0.0.1:{listener.getsockname()[1]}"
            with HAProxy(ARGS.repo, [server.target, silent]) as proxy:
                # HAProxy counts a server UP until its first check ends; the
                # silent listener's ends when the check times out.
                deadline = time.monotonic() + 60
                while proxy.server_states().get("replica2") is not False:
                    self.assertLess(time.monotonic(), deadline, "the silent listener was never DOWN")
                    time.sleep(0.1)
                self.assertRegex(proxy.log_text(), r"replica2 is DOWN, reason: Layer7 timeout")
                # Long enough for several more checks of it (rise 2) to fail,
                # while the real replica's pass.
                deadline = time.monotonic() + 8
                serving_seen = False
                while time.monotonic() < deadline:
                    states = proxy.server_states()
                    self.assertFalse(states.get("replica2"), "a listener that speaks no gRPC passed")
                    serving_seen |= bool(states.get("replica1"))
                    time.sleep(0.2)
                self.assertTrue(serving_seen, "the serving replica was never UP")
        finally:
            stop.set()
            thread.join(timeout=5)
            listener.close()
            server.stop()

    def test_a_replica_in_its_lame_duck_is_taken_out_while_it_still_listens(self):
        server = Server(ARGS.server, "--compute_threads=1", "--lame_duck_seconds=60")
        try:
            with HAProxy(ARGS.repo, [server.target]) as proxy:
                proxy.wait_replicas_up(1, timeout=120)
                server.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                while replica_state(proxy):
                    self.assertLess(time.monotonic() - signalled, 60, "still UP after 60 s of lame duck")
                    time.sleep(0.05)
                taken_out = time.monotonic() - signalled
                sys.stderr.write(f"haproxy_config: NOT_SERVING replica taken out {taken_out:.2f} s after "
                                 f"SIGTERM\n")
                self.assertIsNone(server.proc.poll(), "the replica exited: the check proves nothing")
                with socket.create_connection(("127.0.0.1", server.port), timeout=5):
                    pass  # still listening: the check read its health, not the port
                self.assertIn("replica1 is DOWN", proxy.log_text())
        finally:
            server.stop()


class CallsInFlightPerAddress(unittest.TestCase):
    """The per-address limit on calls in flight, against the real binary."""

    def test_one_address_past_its_calls_in_flight_gets_429_while_another_is_served(self):
        import grpc
        import health_pb2
        import health_pb2_grpc
        limit = int(re.search(r"sc1_trackers\(calls_per_address\) gt (\d+)", config_text()).group(1))
        extra = 8
        server = Server(ARGS.server, "--compute_threads=1")
        try:
            with HAProxy(ARGS.repo, [server.target]) as proxy:
                proxy.wait_replicas_up(1, timeout=120)
                # From 127.0.0.2, limit + extra calls whose bodies never end
                # (each sends 64 KiB of a declared 4 MiB message: past the
                # proxy's 16 KiB buffer, so each goes on to the replica and
                # stays in flight) for 10 s, then it prints what it saw.
                attacker = subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "..", "hostile", "attacks.py"), "slow_bodies",
                     "--port", str(proxy.port), "--source", "127.0.0.2", "--seconds", "10",
                     "--streams", str(limit + extra), "--streams_per_connection", "8",
                     "--declared_mib", "4", "--send_mib", "0.0625", "--rate_mib", "64"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    deadline = time.monotonic() + 60
                    held = 0
                    while held < limit:
                        if attacker.poll() is not None:
                            self.fail(f"the attacker ended first: {attacker.communicate()}\n{proxy.log_text()}")
                        self.assertLess(time.monotonic(), deadline, "the attacker's calls never reached the replica")
                        time.sleep(0.1)
                        held = proxy.server_counter("haproxy_server_current_sessions").get("replica1", 0)
                    self.assertEqual(held, limit, "the replica holds more of one address's calls than the limit")
                    # The address at its limit: a call from 127.0.0.1 is served.
                    with grpc.insecure_channel(proxy.address) as channel:
                        answer = health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
                    self.assertEqual(answer.status, health_pb2.HealthCheckResponse.SERVING)
                    self.assertIsNone(attacker.poll(), "the attacker's 10 s ended before the check: on a "
                                                       "machine this slow the test shows nothing")
                finally:
                    out, err = attacker.communicate(timeout=120)
                self.assertEqual(attacker.returncode, 0, err)
                answered = json.loads(out.strip().splitlines()[-1])["answered"]
                self.assertEqual(answered, {"http 429": extra},
                                 f"the {extra} calls past the limit, and only they, must be refused")
        finally:
            server.stop()


class ClientLimits(unittest.TestCase):
    """The per-client limits, on a proxy whose one replica address is closed
    (nothing reaches a replica here)."""

    def setUp(self):
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        self.addCleanup(closed.close)  # bound, never listening: connections are refused
        self.proxy = HAProxy(ARGS.repo, [f"127.0.0.1:{closed.getsockname()[1]}"])
        self.addCleanup(self.proxy.cleanup)
        self.sockets = []
        self.addCleanup(lambda: [s.close() for s in self.sockets])

    def connect(self, source="127.0.0.1"):
        """Opens a connection (kept open), sends the HTTP/2 preface and an
        empty SETTINGS, and returns HAProxy's first bytes (b"" when it closed
        the connection at once, which may reset it before connect() returns)."""
        try:
            s = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=10,
                                         source_address=(source, 0))
        except ConnectionResetError:
            return b""
        self.sockets.append(s)
        try:
            s.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            return s.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            return b""

    def test_the_proxy_announces_the_configured_streams_per_connection(self):
        limit = int(re.search(r"(?m)^\s*tune\.h2\.max-concurrent-streams (\d+)$", config_text()).group(1))
        client = h2.connection.H2Connection()
        client.initiate_connection()
        s = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=10)
        self.sockets.append(s)
        s.sendall(client.data_to_send())
        settings = None
        deadline = time.monotonic() + 30
        while settings is None and time.monotonic() < deadline:
            for e in client.receive_data(s.recv(65536)):
                if isinstance(e, h2.events.RemoteSettingsChanged):
                    settings = e.changed_settings
        self.assertIsNotNone(settings, "no SETTINGS from the proxy")
        self.assertEqual(settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value, limit)

    def call(self, extra_headers):
        """One gRPC-shaped request through the proxy with python3-h2; returns
        the :status answered, or the event that ended it instead (a stream
        reset, the connection ended)."""
        client = h2.connection.H2Connection()
        client.initiate_connection()
        s = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=10)
        self.sockets.append(s)
        client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "attnserve"),
                                (":path", "/attnserve.v1.AttentionService/Attend"),
                                ("content-type", "application/grpc"), ("te", "trailers"), *extra_headers])
        client.send_data(1, b"\0\0\0\0\0", end_stream=True)
        s.sendall(client.data_to_send())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            data = s.recv(65536)
            if not data:
                return "connection closed"
            for e in client.receive_data(data):
                if isinstance(e, h2.events.ResponseReceived) and e.stream_id == 1:
                    return dict(e.headers)[b":status"].decode()
                if isinstance(e, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    return type(e).__name__
            s.sendall(client.data_to_send())
        return "no answer"

    def test_a_header_block_past_the_buffer_is_refused_at_the_proxy(self):
        bufsize = int(re.search(r"(?m)^\s*tune\.bufsize (\d+)$", config_text()).group(1))
        # The control: a request within the limits goes on to the backend,
        # whose one replica is down: 503 from the proxy.
        self.assertEqual(self.call([("x-small", "a" * 100)]), "503")
        outcome = self.call([("x-large", "a" * bufsize)])
        self.assertIn(outcome, {"400", "431", "StreamReset", "ConnectionTerminated", "connection closed"},
                      "a header block over tune.bufsize must not reach the backend")

    def test_connections_past_the_limit_from_one_address_are_refused_and_other_addresses_connect(self):
        limit = int(re.search(r"tcp-request connection reject if \{ sc0_conn_cur gt (\d+) \}",
                              config_text()).group(1))
        for i in range(limit):
            self.assertNotEqual(self.connect(), b"", f"connection {i + 1} of {limit} refused")
        self.assertEqual(self.connect(), b"", f"connection {limit + 1} from one address was accepted")
        self.assertNotEqual(self.connect(source="127.0.0.2"), b"", "another address was refused too")


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, os.path.join(ARGS.repo, "proto"))
        unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
