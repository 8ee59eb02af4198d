#!/usr/bin/python3
"""Decode sessions across replicas: three attnserve replicas behind the shipped
front proxy (Debian's HAProxy with deploy/haproxy/haproxy.cfg, unchanged), a
client that sends each session's calls with an `attnserve-routing-key` header,
and every answer naming its replica (`attnserve-replica`).

  - 60 sessions with random keys spread over all three replicas, and each
    session's steps all reach the replica that opened it; the sessions of one
    micro-batch share a key and so one replica;
  - one replica killed (SIGKILL) mid-run: only its sessions get NOT_FOUND (or
    UNAVAILABLE), each re-opened on a live replica decodes correctly (against
    the float64 reference of that replica's seeded weights), and the sessions
    on the survivors go on as if nothing happened;
  - the replica started again on its address: exactly the keys that were its
    own move back to it (consistent hashing; about a third), those sessions
    get NOT_FOUND there and are opened again; nobody else moves.

The Python package's routing_key and attnctl's --routing_key are checked the same
way: every call of a session reaches the replica that holds it.

Every loop is bounded in count and time; replicas and HAProxy are stopped in
finally blocks. Usage: session_routing_test.py --server PATH/attnserve
--attnctl PATH/attnctl --repo REPO
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import unittest
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, reference_attention, rel_error, run_tests_with_stubs,  # noqa: E402
                     seeded_weights, wait_until)
from haproxy_runner import HAProxy  # noqa: E402

ARGS = None
REPLICAS = 3
SESSIONS = 60
D_MODEL = 768
ROUTING_KEY = "attnserve-routing-key"
REPLICA = "attnserve-replica"
NOT_FOUND, UNAVAILABLE = 5, 14  # google.rpc.Code values of a step's status


def log(message):
    sys.stderr.write(f"session_routing: {message}\n")
    sys.stderr.flush()


class Replica:
    """One attnserve process named replicaN; `port` keeps its address across a restart."""

    def __init__(self, index, port=0):
        self.name = f"replica{index}"
        flags = ["--compute_threads=1", f"--replica_name={self.name}"]
        if port:
            flags.append(f"--listen_address=127.0.0.1:{port}")  # the last one given wins
        self.server = Server(ARGS.server, *flags)
        self.port = self.server.port
        self.server.wait_serving()

    def kill(self):
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait()


class Session:
    """A client's view of one session: its routing key, id, replica and tokens so far."""

    def __init__(self, key):
        self.key = key
        self.id = None
        self.replica = None
        self.tokens = np.zeros((0, D_MODEL), np.float32)


class SessionsAcrossReplicas(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        cls.grpc, cls.pb = grpc, attention_pb2
        cls.replicas = {}
        cls.proxy = None
        try:
            for i in range(1, REPLICAS + 1):
                replica = Replica(i)
                cls.replicas[replica.name] = replica
            cls.proxy = HAProxy(ARGS.repo, [f"127.0.0.1:{r.port}" for r in cls.replicas.values()])
            cls.proxy.wait_replicas_up(REPLICAS)
            cls.channel = grpc.insecure_channel(cls.proxy.address)
            cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "channel", None):
            cls.channel.close()
        if cls.proxy:
            cls.proxy.stop()
        for replica in cls.replicas.values():
            replica.server.stop()

    # --- the client: every call carries its session's routing key ---

    def call(self, method, request, key):
        response, call = method.with_call(request, metadata=((ROUTING_KEY, key),), timeout=60)
        return response, dict(call.initial_metadata()).get(REPLICA)

    def open(self, session):
        response, replica = self.call(self.stub.OpenSession,
                                      self.pb.OpenSessionRequest(models=["default"]), session.key)
        session.id, session.replica = response.session_id, replica
        session.tokens = np.zeros((0, D_MODEL), np.float32)
        self.assertIn(replica, self.replicas, "the answer names no known replica")

    def step_request(self, session, rows):
        return self.pb.ExtendStep(
            session_id=session.id, expected_length=len(session.tokens),
            hidden_states=self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(rows.shape),
                                         raw_data=np.ascontiguousarray(rows, "<f4").tobytes()))

    def extend(self, sessions, rows_list):
        """One Extend carrying a step for each session (all with the first one's
        key): [(code, message, output rows or None)] and the replica that answered."""
        request = self.pb.ExtendRequest(
            steps=[self.step_request(s, rows) for s, rows in zip(sessions, rows_list)])
        response, replica = self.call(self.stub.Extend, request, sessions[0].key)
        results = []
        for session, rows, result in zip(sessions, rows_list, response.results):
            output = None
            if result.code == 0:
                session.tokens = np.concatenate([session.tokens, rows])
                output = np.frombuffer(result.output.raw_data, "<f4").reshape(tuple(result.output.shape))
            results.append((result.code, result.message, output))
        return results, replica

    def check_output(self, session, replica, output, n):
        """The new rows against the float64 causal reference of `replica`'s weights."""
        server = self.replicas[replica].server
        weights = seeded_weights(server.seed, D_MODEL, 12, 12, 64)
        reference, _ = reference_attention(session.tokens[None], weights, 12, 12, 64, 0.125, causal=True)
        self.assertLessEqual(rel_error(output, reference[0, -n:]), 1e-5,
                             f"session {session.key} on {replica}")

    def decode(self, session, rng, n=1):
        """One step of n new tokens on its own: (code, message, replica)."""
        rows = rng.standard_normal((n, D_MODEL)).astype(np.float32)
        [(code, message, output)], replica = self.extend([session], [rows])
        if code == 0:
            self.check_output(session, replica, output, n)
        return code, message, replica

    # --- the scenario ---

    def test_sessions_stay_on_their_replica_through_a_loss_and_a_return(self):
        rng = np.random.default_rng()
        sessions = [Session(uuid.uuid4().hex) for _ in range(SESSIONS)]
        for session in sessions:
            self.open(session)
            for n in (4, 1, 1):  # a prefill, then two decode steps
                code, message, replica = self.decode(session, rng, n)
                self.assertEqual(code, 0, message)
                self.assertEqual(replica, session.replica, f"session {session.key} moved")
        placed = {name: [s for s in sessions if s.replica == name] for name in self.replicas}
        log("sessions per replica: " + ", ".join(f"{k} {len(v)}" for k, v in placed.items()))
        for name, members in placed.items():
            self.assertGreaterEqual(len(members), 5, f"{name} holds too few of {SESSIONS} sessions")

        # A replica dies mid-run.
        lost = "replica2"
        lost_port = self.replicas[lost].port
        self.replicas[lost].kill()
        wait_until(f"the proxy to see {lost} down", lambda: not self.proxy.server_states().get(lost), 30)
        for session in sessions:
            code, message, replica = self.decode(session, rng)
            if session.replica == lost:
                self.assertIn(code, (NOT_FOUND, UNAVAILABLE), f"{session.key} on the lost {lost}: {message}")
                self.assertNotEqual(replica, lost)
                self.open(session)  # opened again: lands on a live replica and decodes
                self.assertNotEqual(session.replica, lost)
                for n in (3, 1):
                    code, message, replica = self.decode(session, rng, n)
                    self.assertEqual(code, 0, message)
                    self.assertEqual(replica, session.replica)
            else:
                self.assertEqual(code, 0, f"{session.key} on {session.replica} noticed: {message}; "
                                          f"the proxy's replicas: {self.proxy.server_states()}")
                self.assertEqual(replica, session.replica)

        # It comes back on its address: only the keys that were its own move back.
        self.replicas[lost].server.stop()
        self.replicas[lost] = Replica(2, port=lost_port)
        self.proxy.wait_replicas_up(REPLICAS)
        moved = []
        for session in sessions:
            code, message, replica = self.decode(session, rng)
            if code != 0:
                self.assertEqual(code, NOT_FOUND, message)
                self.assertEqual(replica, lost, f"{session.key} moved elsewhere than to {lost}")
                moved.append(session)
                self.open(session)
                self.assertEqual(session.replica, lost)
                code, message, replica = self.decode(session, rng, 2)
                self.assertEqual(code, 0, message)
            else:
                self.assertEqual(replica, session.replica)
        log(f"{len(moved)} of {SESSIONS} keys moved back to {lost}")
        self.assertEqual({s.key for s in moved}, {s.key for s in placed[lost]},
                         "exactly the keys that were the returning replica's own move back to it")

    def test_the_sessions_of_a_micro_batch_share_a_key_and_a_replica(self):
        rng = np.random.default_rng()
        key = uuid.uuid4().hex
        group = [Session(key) for _ in range(4)]
        for session in group:
            self.open(session)
        self.assertEqual(len({s.replica for s in group}), 1, "one key, one replica")
        for n in (5, 1, 1):
            rows_list = [rng.standard_normal((n, D_MODEL)).astype(np.float32) for _ in group]
            results, replica = self.extend(group, rows_list)
            self.assertEqual(replica, group[0].replica)
            for session, (code, message, output) in zip(group, results):
                self.assertEqual(code, 0, message)
                self.check_output(session, replica, output, n)

    def test_the_python_packages_routing_key_keeps_each_sessions_calls_on_its_replica(self):
        # attnserve.Client.open_session(routing_key=...): every call of the
        # session and of its forks carries the key. A call that reached another
        # replica would find no such session (NOT_FOUND), and the outputs are
        # checked against the weights of the replica that opened the session.
        import attnserve
        rng = np.random.default_rng()
        with attnserve.Client(self.proxy.address, timeout=60) as client:
            sessions = [client.open_session(routing_key=uuid.uuid4().hex) for _ in range(12)]
            self.assertLessEqual({s.replica for s in sessions}, set(self.replicas))
            self.assertGreaterEqual(len({s.replica for s in sessions}), 2, "12 keys on one replica")
            for session in sessions:
                tokens = np.zeros((0, D_MODEL), np.float32)
                for n in (3, 1, 1):
                    rows = rng.standard_normal((n, D_MODEL)).astype(np.float32)
                    tokens = np.concatenate([tokens, rows])
                    output = session.extend(rows).output
                    mirror = Session(session.routing_key)
                    mirror.tokens = tokens
                    self.check_output(mirror, session.replica, output, n)
                self.assertEqual(list(session.info().layer_lengths), [5])
                fork = session.fork()
                self.assertEqual((fork.routing_key, fork.replica), (session.routing_key, session.replica))
                fork.truncate(4)
                rows = rng.standard_normal((1, D_MODEL)).astype(np.float32)
                mirror = Session(session.routing_key)
                mirror.tokens = np.concatenate([tokens[:4], rows])
                self.check_output(mirror, session.replica, fork.extend(rows).output, 1)
                fork.close()
                session.close()
            # A micro-batch: the sessions of one key share a replica and a call.
            key = uuid.uuid4().hex
            group = [client.open_session(routing_key=key) for _ in range(3)]
            self.assertEqual(len({s.replica for s in group}), 1)
            results = client.extend([s.step(rng.standard_normal((2, D_MODEL)).astype(np.float32)) for s in group])
            self.assertEqual([r.ok for r in results], [True] * 3)
            other = client.open_session(routing_key=uuid.uuid4().hex)
            with self.assertRaisesRegex(ValueError, "different routing keys"):
                client.extend([group[0].step(np.zeros((1, D_MODEL), np.float32)),
                               other.step(np.zeros((1, D_MODEL), np.float32))])
            with self.assertRaisesRegex(ValueError, "routing_key"):
                client.open_session(routing_key="bad\nkey")
            for s in group + [other]:
                s.close()

    def attnctl(self, key, *args):
        """attnctl through the proxy with --routing_key=key: (exit code, stdout, stderr)."""
        done = subprocess.run([ARGS.attnctl, f"--target={self.proxy.address}", "--timeout_seconds=60",
                               f"--routing_key={key}", *args],
                              capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout, done.stderr

    def holder(self, session_id):
        """The replica that holds the session, asked of each replica directly."""
        import grpc
        from attnserve.v1 import attention_pb2_grpc
        holders = []
        for name, replica in self.replicas.items():
            with grpc.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
                stub = attention_pb2_grpc.AttentionServiceStub(channel)
                try:
                    stub.GetSession(self.pb.GetSessionRequest(session_id=session_id), timeout=60)
                    holders.append(name)
                except grpc.RpcError as error:
                    self.assertEqual(error.code(), grpc.StatusCode.NOT_FOUND, error.details())
        self.assertEqual(len(holders), 1, f"session {session_id} held by {holders}")
        return holders[0]

    def test_attnctls_routing_key_keeps_a_sessions_commands_on_its_replica(self):
        # Each attnctl command is its own process and connection: only the key
        # brings a session's commands back to the replica that opened it.
        # Another key placed on another replica finds no such session there.
        keys = {}  # replica -> a key the proxy places there
        for _ in range(60):
            probe = Session(uuid.uuid4().hex)
            self.open(probe)
            keys.setdefault(probe.replica, probe.key)
            if len(keys) == REPLICAS:
                break
        self.assertEqual(len(keys), REPLICAS, f"60 keys reached only {sorted(keys)}")
        for replica, key in sorted(keys.items()):
            code, out, err = self.attnctl(key, "session", "open", "--model=default", "--json")
            self.assertEqual(code, 0, err)
            session_id = json.loads(out)["session_id"]
            self.assertEqual(self.holder(session_id), replica)
            for n in (4, 1, 1):
                code, out, err = self.attnctl(key, "session", "extend", f"--session_id={session_id}",
                                              f"--tokens={n}", "--json")
                self.assertEqual(code, 0, f"extend through {key}: {err}")
            code, out, err = self.attnctl(key, "session", "get", f"--session_id={session_id}", "--json")
            self.assertEqual(code, 0, err)
            self.assertEqual([int(n) for n in json.loads(out)["layer_lengths"]], [6])
            other = keys[next(r for r in sorted(keys) if r != replica)]
            code, out, err = self.attnctl(other, "session", "extend", f"--session_id={session_id}",
                                          "--tokens=1")
            self.assertNotEqual(code, 0, "a key placed on another replica found the session")
            self.assertIn("NOT_FOUND", err)
            code, out, err = self.attnctl(key, "session", "close", f"--session_id={session_id}")
            self.assertEqual(code, 0, err)
        code, out, err = self.attnctl("two\nlines", "session", "get", "--session_id=x")
        self.assertEqual(code, 2, err)
        self.assertIn("routing_key", err)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(os.path.join(ARGS.repo, "proto"), rest)


if __name__ == "__main__":
    main()
