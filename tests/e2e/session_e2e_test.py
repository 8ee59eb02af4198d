#!/usr/bin/python3
"""Decode sessions end to end: the real attnserve binary called from Python's
grpcio, as a decoder would call it.

A session over the built-in model takes a prompt (a prefill step), then
decode steps of one token; every step's output is checked against a NumPy
float64 reference of the causal layer over the whole sequence so far (the
documented seeded weights, fresh random inputs). Then a micro-batch drives
several sessions in one message per step, a lost answer is retried (replayed,
not appended twice), a fork diverges from its parent, the server's metrics
show the sessions, and after a restart the sessions are gone (NOT_FOUND).
ExtendStream (grpcio's stream-stream call) answers each message in order as
Extend would, refuses a bad step on its own and ends with the code of a
message that fails as a whole.

Usage: session_e2e_test.py --server PATH/attnserve --proto_dir REPO/proto
"""
import argparse
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, metric, reference_attention, rel_error,  # noqa: E402
                     run_tests_with_stubs, seeded_weights, wait_serving, wait_until)

ARGS = None
D_MODEL = 768


class DecodeSessions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2, health_pb2_grpc
        cls.grpc, cls.pb, cls.pb_grpc = grpc, attention_pb2, attention_pb2_grpc
        cls.health_pb, cls.health_grpc = health_pb2, health_pb2_grpc
        cls.start()

    @classmethod
    def start(cls):
        cls.server = Server(ARGS.server)
        cls.channel = cls.grpc.insecure_channel(cls.server.target)
        cls.stub = cls.pb_grpc.AttentionServiceStub(cls.channel)
        wait_serving(cls.health_grpc.HealthStub(cls.channel), cls.health_pb)
        h = cls.stub.GetModel(cls.pb.GetModelRequest(name="default"), timeout=60).head_config
        cls.head = h
        cls.weights = seeded_weights(cls.server.seed, h.d_model, h.num_heads, h.num_kv_heads,
                                     h.head_dim)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    def reference_rows(self, sequence, first, n):
        h = self.head
        out, _ = reference_attention(sequence[None], self.weights, h.num_heads, h.num_kv_heads,
                                     h.head_dim, h.scale, causal=True)
        return out[0, first:first + n]

    def step(self, session_id, expected, rows):
        return self.pb.ExtendStep(
            session_id=session_id, expected_length=expected,
            hidden_states=self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(rows.shape),
                                         raw_data=np.ascontiguousarray(rows, "<f4").tobytes()))

    def open(self):
        return self.stub.OpenSession(self.pb.OpenSessionRequest(models=["default"]),
                                     timeout=60).session_id

    @staticmethod
    def output(result):
        return np.frombuffer(result.output.raw_data, "<f4").reshape(tuple(result.output.shape))

    def test_a_decoder_prefills_then_decodes_one_token_at_a_time(self):
        rng = np.random.default_rng()
        session = self.open()
        sequence = rng.standard_normal((12, D_MODEL)).astype(np.float32)
        response = self.stub.Extend(self.pb.ExtendRequest(steps=[self.step(session, 0, sequence)]),
                                    timeout=60)
        result = response.results[0]
        self.assertEqual(result.code, 0, result.message)
        self.assertLessEqual(rel_error(self.output(result), self.reference_rows(sequence, 0, 12)),
                             1e-5)
        for _ in range(6):
            token = rng.standard_normal((1, D_MODEL)).astype(np.float32)
            before = len(sequence)
            sequence = np.concatenate([sequence, token])
            result = self.stub.Extend(
                self.pb.ExtendRequest(steps=[self.step(session, before, token)]),
                timeout=60).results[0]
            self.assertEqual(result.code, 0, result.message)
            self.assertEqual(result.length, before + 1)
            self.assertLessEqual(rel_error(self.output(result),
                                           self.reference_rows(sequence, before, 1)), 1e-5)
        info = self.stub.GetSession(self.pb.GetSessionRequest(session_id=session), timeout=60)
        self.assertEqual(list(info.layer_lengths), [18])

    def test_a_micro_batch_drives_many_sessions_with_one_message_per_step(self):
        rng = np.random.default_rng()
        sessions = [self.open() for _ in range(4)]
        sequences = [rng.standard_normal((n, D_MODEL)).astype(np.float32) for n in (3, 8, 1, 5)]
        prefill = self.pb.ExtendRequest(
            steps=[self.step(s, 0, x) for s, x in zip(sessions, sequences)])
        for result in self.stub.Extend(prefill, timeout=60).results:
            self.assertEqual(result.code, 0, result.message)
        for _ in range(3):
            tokens = [rng.standard_normal((1, D_MODEL)).astype(np.float32) for _ in sessions]
            request = self.pb.ExtendRequest(
                steps=[self.step(s, len(x), t) for s, x, t in zip(sessions, sequences, tokens)])
            results = self.stub.Extend(request, timeout=60).results
            for i, result in enumerate(results):
                self.assertEqual(result.code, 0, result.message)
                before = len(sequences[i])
                sequences[i] = np.concatenate([sequences[i], tokens[i]])
                self.assertLessEqual(rel_error(self.output(result),
                                               self.reference_rows(sequences[i], before, 1)), 1e-5)
            # The answer was "lost": the same message again replays it.
            again = self.stub.Extend(request, timeout=60).results
            for first, second in zip(results, again):
                self.assertTrue(second.replayed)
                self.assertEqual(first.output.raw_data, second.output.raw_data)
        # The gauges follow within a second (the sessions' upkeep).
        wait_until("attnserve_sessions to count the four sessions",
                   lambda: metric(self.server.scrape(), "attnserve_sessions") >= 4, timeout=60)

    def test_a_stream_answers_each_message_in_order_as_extend_would(self):
        rng = np.random.default_rng()
        sessions = [self.open() for _ in range(2)]
        sequences = [np.zeros((0, D_MODEL), np.float32) for _ in sessions]
        messages, expected = [], []
        for counts in [(6, 2), (1, 1), (1, 3), (1, 1)]:
            steps = []
            for i, n in enumerate(counts):
                x = rng.standard_normal((n, D_MODEL)).astype(np.float32)
                steps.append(self.step(sessions[i], len(sequences[i]), x))
                expected.append((i, len(sequences[i]), n))
                sequences[i] = np.concatenate([sequences[i], x])
            messages.append(self.pb.ExtendRequest(steps=steps))
        # A step of an unknown session is refused on its own; the stream goes on.
        unknown = self.step("f" * 32, 0, rng.standard_normal((1, D_MODEL)).astype(np.float32))
        messages.insert(2, self.pb.ExtendRequest(steps=[unknown]))
        responses = list(self.stub.ExtendStream(iter(messages), timeout=120))
        self.assertEqual(len(responses), len(messages))
        refused = responses.pop(2)
        self.assertEqual(refused.results[0].code, self.grpc.StatusCode.NOT_FOUND.value[0],
                         refused.results[0].message)
        results = [r for response in responses for r in response.results]
        self.assertEqual(len(results), len(expected))
        for result, (i, before, n) in zip(results, expected):
            self.assertEqual(result.code, 0, result.message)
            self.assertEqual(result.length, before + n)
            self.assertLessEqual(rel_error(self.output(result),
                                           self.reference_rows(sequences[i], before, n)), 1e-5)
        # A message that fails as a whole (no steps) ends the stream with its code.
        with self.assertRaises(self.grpc.RpcError) as failed:
            list(self.stub.ExtendStream(iter([self.pb.ExtendRequest()]), timeout=60))
        self.assertEqual(failed.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
        text = self.server.scrape()
        self.assertGreaterEqual(metric(text, "attnserve_requests_total", code="OK",
                                       method="ExtendStream"), 1)
        self.assertGreaterEqual(metric(text, "attnserve_requests_total", code="INVALID_ARGUMENT",
                                       method="ExtendStream"), 1)

    def test_sessions_do_not_survive_a_restart(self):
        session = self.open()
        self.channel.close()
        self.server.stop()
        type(self).start()
        with self.assertRaises(self.grpc.RpcError) as gone:
            self.stub.GetSession(self.pb.GetSessionRequest(session_id=session), timeout=60)
        self.assertEqual(gone.exception.code(), self.grpc.StatusCode.NOT_FOUND)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
