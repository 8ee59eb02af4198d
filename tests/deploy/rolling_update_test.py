#!/usr/bin/python3
"""A rolling update behind the shipped front proxy loses no call.

Three attnserve replicas (the real binary, one shared model seed, the lame
duck and drain timeout of deploy/compose/docker-compose.yml) on loopback
behind deploy/haproxy/haproxy.cfg run by Debian's HAProxy
(tests/deploy/haproxy_runner.py); 32 concurrent Python grpcio clients, each
on a connection of its own with the retry policy attnctl uses (the defaults
of client/attention_client.h's RetryOptions: UNAVAILABLE retried), call
Attend without pause. The replicas are replaced one at a time: SIGTERM, wait
for the exit, a new process on the same port, wait until it is SERVING and
the proxy sends it calls again. At the end:

  - every call the clients made is counted by its final status and printed;
    every one that did not end OK is printed with its time (seconds from the
    start, beside the replacements' timeline) and message, and fails the test;
  - every OK answer equals the float64 reference of the seeded weights
    (relative error <= 1e-5) on a fresh random input;
  - every replica, the three first and the three new ones, served calls
    (their own /metrics);
  - the proxy held a bounded number of connections to each replica (read from
    /proc while the clients ran): calls share them, none is opened per call.

Every wait is bounded; processes are stopped in finally blocks.

Usage: rolling_update_test.py --server PATH/attnserve --repo REPO
"""
import argparse
import collections
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, HERE)
from harness import (Server, generate_stubs, metric, reference_attention, rel_error,  # noqa: E402
                     seeded_weights, wait_until)
from haproxy_runner import HAProxy  # noqa: E402

ARGS = None
REPLICAS = 3
CLIENTS = 32
SEQ = 8
# Calls each new replica serves before the next replacement (and the end).
CALLS_PER_NEW_REPLICA = 20
# Connections the proxy may hold to one replica: per HAProxy thread one or
# two in use (64 calls per replica at most, 100 streams per connection) plus
# at most 2 idle ones (pool-max-conn), plus a health check's.
MAX_UPSTREAM_CONNECTIONS_PER_THREAD = 3
CALL_TIMEOUT_SECONDS = 60


def log(message):
    sys.stderr.write(f"rolling_update: {message}\n")
    sys.stderr.flush()



def retry_options():
    """attnctl's retry policy: the defaults of client/attention_client.h's
    RetryOptions, read from the header (so the two cannot drift)."""
    with open(os.path.join(ARGS.repo, "client", "attention_client.h")) as f:
        text = f.read()
    block = re.search(r"struct RetryOptions \{(.*?)\};", text, re.S).group(1)

    def value(name):
        return float(re.search(rf"\b{name}\s*=\s*([0-9.]+)", block).group(1))

    return {"maxAttempts": int(value("max_attempts")),
            "initialBackoff": f"{value('initial_backoff_seconds')}s",
            "maxBackoff": f"{value('max_backoff_seconds')}s",
            "backoffMultiplier": value("backoff_multiplier"),
            "retryableStatusCodes": ["UNAVAILABLE"]}


def shutdown_flags():
    """The lame duck and drain timeout flags the shipped compose file gives
    attnserve: the replicas here stop as they do there."""
    with open(os.path.join(ARGS.repo, "deploy", "compose", "docker-compose.yml")) as f:
        text = f.read()
    flags = re.findall(r"^\s*- (--(?:lame_duck|drain_timeout)_seconds=\S+)$", text, re.M)
    assert len(flags) == 2, f"docker-compose.yml: {flags}"
    return flags


def service_config():
    return json.dumps({"methodConfig": [{"name": [{"service": "attnserve.v1.AttentionService"}],
                                         "retryPolicy": retry_options()}]})


class Replica:
    """One attnserve process; `port` 0 picks a free one, a number reuses it."""

    def __init__(self, name, seed, port=0):
        self.name = name
        self.server = Server(ARGS.server, "--compute_threads=1", *shutdown_flags(),
                             f"--builtin_model_seed={seed}", f"--listen_address=127.0.0.1:{port}")
        self.port = self.server.port
        self.address = f"127.0.0.1:{self.port}"
        self.last_ok = 0

    def ok_calls(self):
        """Attend calls it answered OK (its /metrics); remembered, so the
        count read last before the process exits stays known."""
        try:
            samples = self.server.scrape()
        except OSError:
            return self.last_ok
        self.last_ok = max(self.last_ok, int(metric(samples, "attnserve_requests_total",
                                                    code="OK", method="Attend")))
        return self.last_ok

    def serving(self):
        return self.server.logged_serving()

    def stop(self):
        self.server.stop()


class Clients:
    """CLIENTS threads calling Attend through the proxy until stopped; each
    call's (start time, end time, status, message) is recorded."""

    def __init__(self, grpc, pb, pb_grpc, target, request, expected, start):
        self.grpc, self.request, self.expected, self.start = grpc, request, expected, start
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.calls = []            # (start s, end s, status name, message)
        self.wrong_answers = []    # (time s, relative error)
        self.channels = []
        self.threads = []
        options = [("grpc.service_config", service_config()), ("grpc.enable_retries", 1),
                   ("grpc.use_local_subchannel_pool", 1),  # a connection per client
                   ("grpc.max_receive_message_length", 64 << 20)]
        for _ in range(CLIENTS):
            channel = grpc.insecure_channel(target, options=options)
            self.channels.append(channel)
            stub = pb_grpc.AttentionServiceStub(channel)
            self.threads.append(threading.Thread(target=self._run, args=(stub,), daemon=True))
        for t in self.threads:
            t.start()

    def _run(self, stub):
        while not self.stop_event.is_set():
            begin = time.monotonic() - self.start
            try:
                reply = stub.Attend(self.request, timeout=CALL_TIMEOUT_SECONDS)
                status, message = "OK", ""
                out = np.frombuffer(reply.output.raw_data, dtype="<f4").reshape(tuple(reply.output.shape))
                error = rel_error(out, self.expected) if out.shape == self.expected.shape else float("inf")
                if error > 1e-5:
                    with self.lock:
                        self.wrong_answers.append((begin, error))
            except self.grpc.RpcError as e:
                status, message = e.code().name, e.details()
            with self.lock:
                self.calls.append((begin, time.monotonic() - self.start, status, message))

    def count(self):
        with self.lock:
            return len(self.calls)

    def stop(self, timeout):
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=timeout)
        alive = sum(t.is_alive() for t in self.threads)
        for c in self.channels:
            c.close()
        return alive


class RollingUpdate(unittest.TestCase):
    def test_replacing_every_replica_under_32_clients_loses_no_call(self):
        import grpc
        from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc

        seed = int(np.random.default_rng().integers(0, 2**63))
        start = time.monotonic()
        timeline = []

        def event(text):
            timeline.append((time.monotonic() - start, text))
            log(f"{timeline[-1][0]:7.2f} s  {text}")

        replicas, retired, proxy, clients = [], [], None, None
        try:
            for i in range(REPLICAS):
                replicas.append(Replica(f"replica{i + 1}", seed))
            for r in replicas:
                wait_until(f"{r.name} SERVING", r.serving, 120)
            request, expected = fresh_request(grpc, pb, pb_grpc, replicas[0].address, seed)
            proxy = HAProxy(ARGS.repo, [r.address for r in replicas])
            threads = int(sum(v for name, _, v in proxy.metrics() if name == "haproxy_process_nbthread"))
            self.assertGreater(threads, 0, "haproxy_process_nbthread")
            proxy.wait_replicas_up(REPLICAS, timeout=60)
            event(f"3 replicas {[r.address for r in replicas]} UP behind haproxy {proxy.address} "
                  f"({threads} threads)")

            clients = Clients(grpc, pb, pb_grpc, proxy.address, request, expected, start)
            wait_until("every replica serving calls", lambda: all(r.ok_calls() > 0 for r in replicas), 120)
            event(f"{CLIENTS} clients calling; calls so far {clients.count()}")

            peak = collections.Counter()

            def sample_connections():
                for address, n in proxy.upstream_connections().items():
                    peak[address] = max(peak[address], n)

            for i in range(REPLICAS):
                old = replicas[i]
                self.assertGreater(old.ok_calls(), 0, f"{old.name} served nothing before its replacement")
                sample_connections()
                old.server.proc.send_signal(signal.SIGTERM)
                event(f"SIGTERM {old.name} (pid {old.server.proc.pid}, {old.ok_calls()} OK calls)")
                deadline = time.monotonic() + 90
                while old.server.proc.poll() is None and time.monotonic() < deadline:
                    old.ok_calls()
                    sample_connections()
                    time.sleep(0.1)
                code = old.server.proc.wait(timeout=max(1, deadline - time.monotonic()))
                event(f"{old.name} exited with {code} after {old.last_ok} OK calls")
                self.assertEqual(code, 0, f"{old.name} exit code")
                retired.append(old)

                new = Replica(f"{old.name}'", seed, port=old.port)
                replicas[i] = new
                event(f"{new.name} started on port {new.port} (pid {new.server.proc.pid})")
                wait_until(f"{new.name} SERVING", new.serving, 120)
                event(f"{new.name} SERVING")
                proxy.wait_replicas_up(REPLICAS, timeout=60)
                event(f"{new.name} UP in haproxy")
                wait_until(f"{new.name} serving calls", lambda: new.ok_calls() >= CALLS_PER_NEW_REPLICA, 120)
                sample_connections()
                event(f"{new.name} served {new.ok_calls()} OK calls")

            stuck = clients.stop(timeout=CALL_TIMEOUT_SECONDS + 10)
            event(f"clients stopped after {clients.count()} calls")
            self.assertEqual(stuck, 0, "client threads still in a call")

            statuses = collections.Counter(status for _, _, status, _ in clients.calls)
            log(f"calls by final status: {dict(statuses)}")
            served = {r.name: r.last_ok for r in retired} | {r.name: r.ok_calls() for r in replicas}
            log(f"OK calls per replica (its /metrics): {served}")
            log(f"peak connections from haproxy per replica: {dict(peak)} (bound "
                f"{MAX_UPSTREAM_CONNECTIONS_PER_THREAD * threads}: {threads} threads)")
            failures = [c for c in clients.calls if c[2] != "OK"]
            for begin, end, status, message in failures:
                log(f"  call {begin:7.2f}-{end:7.2f} s: {status}: {message}")
            if failures:
                log("timeline:\n" + "\n".join(f"  {t:7.2f} s  {e}" for t, e in timeline))
                log("haproxy's log:\n" + proxy.log_text())

            self.assertEqual(failures, [], f"calls lost: {dict(statuses)}")
            self.assertEqual(clients.wrong_answers, [], "OK answers differing from the reference")
            self.assertGreater(statuses["OK"], 0)
            for name, count in served.items():
                self.assertGreater(count, 0, f"{name} served no call")
            for address, n in peak.items():
                self.assertGreater(n, 0, f"no connection from haproxy to {address} was ever seen")
                self.assertLessEqual(n, MAX_UPSTREAM_CONNECTIONS_PER_THREAD * threads, address)
        finally:
            if clients is not None:
                clients.stop(timeout=5)
            if proxy is not None:
                proxy.cleanup()
            for r in replicas + retired:
                r.stop()


def fresh_request(grpc, pb, pb_grpc, target, seed):
    """An Attend request on a fresh random input for the built-in model (its
    head configuration asked of a replica), and its float64 reference output
    from the seeded weights every replica shares."""
    with grpc.insecure_channel(target) as channel:
        h = pb_grpc.AttentionServiceStub(channel).GetModel(pb.GetModelRequest(name="default"),
                                                           timeout=60).head_config
    x = np.random.default_rng().standard_normal((1, SEQ, h.d_model)).astype(np.float32)
    weights = seeded_weights(seed, h.d_model, h.num_heads, h.num_kv_heads, h.head_dim)
    expected, _ = reference_attention(x, weights, h.num_heads, h.num_kv_heads, h.head_dim, h.scale)
    request = pb.AttendRequest(model="default", hidden_states=pb.Tensor(
        dtype=pb.DATA_TYPE_FP32, shape=list(x.shape), raw_data=x.tobytes()))
    return request, expected


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
