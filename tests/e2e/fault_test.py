#!/usr/bin/python3
"""Faults against the real attnserve binary, called from Python's grpcio.

Each case drives one kind of fault and measures what the server did: the status
every call got (client side, and the server's own attnserve_requests_total),
the answers received, the process's CPU time (/proc/<pid>/stat), its memory
(VmRSS, VmHWM from /proc/<pid>/status) and exit code. Assertions are on
behaviour (codes, answers, exit code, a memory bound). Some cases rely on
compute being slower than the client: calls on S=2048 with maps are cancelled
mid-compute and a 50 ms deadline expires before they finish, and the server's
CPU over an idle second afterwards must be under 5% of a core. At the end it
prints a table: case, what each request got, what was lost (each case fails
when anything started was not answered, so "nothing" is what its assertions
proved).

Usage: fault_test.py --server PATH/attnserve --proto_dir REPO/proto [unittest args]
"""
import argparse
import os
import signal
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, from_tensor, run_tests_with_stubs, metric, reference_attention,  # noqa: E402
                     rel_error, seeded_weights, to_tensor, wait_serving)

ARGS = None
ROWS = []  # (case, what the requests got, what was lost)
D_MODEL = 768  # the built-in model's width
NUM_HEADS, HEAD_DIM = 12, 64  # and its heads
# What the server promises for a request run in a batch (README, "Serving
# under load"): its output equals the same request run alone within 1e-6
# relative (Frobenius norm; often bit for bit, but not promised), and the
# double-precision reference within FP32's 1e-5 -- as
# tests/server/api/batching_service_test.cc checks in process.
BATCHED_VS_SOLO = 1e-6
FP32_VS_REFERENCE = 1e-5
# Bound on the growth of the server's peak RSS (VmHWM) while it refuses the
# memory bombs: the largest bomb's own bytes are 3.2 MB; what it asks for is GBs.
BOMB_HWM_BOUND_KIB = 32 * 1024


def record(case, got, lost="nothing"):
    ROWS.append((case, got, lost))


def codes(samples_before, samples_after, method="Attend"):
    """{code: count} of calls the server finished between two scrapes."""
    out = {}
    for (name, labels), value in samples_after.items():
        if name != "attnserve_requests_total" or dict(labels).get("method") != method:
            continue
        delta = value - samples_before.get((name, labels), 0.0)
        if delta:
            out[dict(labels)["code"]] = int(delta)
    return out


def summary(counts):
    return ", ".join(f"{n} {code}" for code, n in sorted(counts.items(), key=lambda kv: -kv[1]))


class FaultCase(unittest.TestCase):
    """One server per test class; stubs and request builders."""
    FLAGS = ()

    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2
        import health_pb2_grpc
        cls.grpc, cls.pb = grpc, attention_pb2
        cls.health_pb = health_pb2
        cls.server = Server(ARGS.server, *cls.FLAGS)
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_receive_message_length", 512 << 20),
            ("grpc.max_send_message_length", 512 << 20)])
        cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        cls.health = health_pb2_grpc.HealthStub(cls.channel)
        wait_serving(cls.health, health_pb2)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    def request(self, x, maps=0, **fields):
        return self.pb.AttendRequest(model="default", hidden_states=to_tensor(self.pb, x),
                                     attention_maps=self.pb.AttentionMapRequest(mode=maps), **fields)

    def status_of(self, call):
        """(code name, response or None) of a finished future or a callable."""
        try:
            response = call.result() if hasattr(call, "result") else call()
            return "OK", response
        except self.grpc.RpcError as e:
            return e.code().name, e
        except self.grpc.FutureCancelledError as e:  # cancelled by this client
            return "CANCELLED", e

    def reference(self, x):
        """The built-in model's output for x [batch, seq, d_model] in float64,
        from the documented seeded weights (docs/seeded_weights.md)."""
        if getattr(self, "_weights", None) is None:
            type(self)._weights = seeded_weights(self.server.seed, D_MODEL, NUM_HEADS, NUM_HEADS,
                                                 HEAD_DIM)
        weights = self._weights
        return np.concatenate([
            reference_attention(x[b:b + 1], weights, NUM_HEADS, NUM_HEADS, HEAD_DIM,
                                1.0 / np.sqrt(HEAD_DIM))[0] for b in range(x.shape[0])])

    def assert_as_promised(self, out, solo, reference, what):
        """A batched (or repeated) answer against its solo answer and the reference."""
        self.assertLessEqual(rel_error(out, solo), BATCHED_VS_SOLO, what)
        self.assertLessEqual(rel_error(out, reference), FP32_VS_REFERENCE, what)

    def wait_idle_metrics(self, timeout=120):
        """Until the server reports no call in flight and nothing queued."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.server.scrape()
            if metric(s, "attnserve_requests_in_flight") == 0 and metric(s, "attnserve_queue_depth") == 0:
                return
            time.sleep(0.05)
        self.fail("calls still in flight")

    def idle_cpu_fraction(self, windows=10):
        """The lowest CPU use (seconds per second) of the server over up to
        `windows` one-second windows: the first window under 5% ends it."""
        lowest = float("inf")
        for _ in range(windows):
            before, start = self.server.cpu_seconds(), time.monotonic()
            time.sleep(1.0)
            fraction = (self.server.cpu_seconds() - before) / (time.monotonic() - start)
            lowest = min(lowest, fraction)
            if lowest < 0.05:
                break
        return lowest


class Cancellation(FaultCase):
    def test_cancel_mid_request_100_times_then_idle_and_the_next_call_is_right(self):
        rng = np.random.default_rng()
        # S=2048 with mean maps: long enough that most cancels land mid-compute.
        x = rng.standard_normal((1, 2048, D_MODEL)).astype(np.float32)
        big = self.request(x, maps=self.pb.ATTENTION_MAP_MODE_MEAN)
        probe = self.request(rng.standard_normal((2, 16, D_MODEL)).astype(np.float32))
        expected = from_tensor(self.pb, self.stub.Attend(probe, timeout=60).output).copy()
        before = self.server.scrape()
        client = {}
        for i in range(100):
            future = self.stub.Attend.future(big, timeout=120)
            time.sleep(float(rng.uniform(0.0, 0.25)))
            future.cancel()
            code, response = self.status_of(future)
            if code == "OK":
                self.assertEqual(list(response.output.shape), [1, 2048, D_MODEL])
            client[code] = client.get(code, 0) + 1
        self.wait_idle_metrics()
        after = self.server.scrape()
        server = codes(before, after)
        cpu = self.idle_cpu_fraction()
        code, response = self.status_of(lambda: self.stub.Attend(probe, timeout=60))
        self.assertEqual(code, "OK")
        self.assert_as_promised(from_tensor(self.pb, response.output), expected,
                                self.reference(from_tensor(self.pb, probe.hidden_states)),
                                "the call after the cancels")
        # Every call ended: cancelled or answered, nothing else.
        self.assertEqual(set(client) - {"CANCELLED", "OK"}, set(), client)
        self.assertEqual(sum(client.values()), 100)
        self.assertEqual(set(server) - {"CANCELLED", "OK"}, set(), server)
        self.assertGreater(server.get("CANCELLED", 0), 0, "no cancel reached the server; proved nothing")
        self.assertLess(cpu, 0.05, "the server kept computing after every call was cancelled")
        record("cancel mid-request x100 (S=2048, mean maps)",
               f"client: {summary(client)}; server: {summary(server)}; idle CPU after: "
               f"{cpu * 100:.1f}% of a core; next call OK, output as before and as the reference")

    def test_deadline_shorter_than_compute_is_deadline_exceeded_and_the_server_moves_on(self):
        rng = np.random.default_rng()
        big = self.request(rng.standard_normal((1, 2048, D_MODEL)).astype(np.float32),
                           maps=self.pb.ATTENTION_MAP_MODE_MEAN)
        before = self.server.scrape()
        client = {}
        for _ in range(10):
            code, _ = self.status_of(lambda: self.stub.Attend(big, timeout=0.05))
            client[code] = client.get(code, 0) + 1
        self.wait_idle_metrics()
        server = codes(before, self.server.scrape())
        cpu = self.idle_cpu_fraction()
        code, response = self.status_of(lambda: self.stub.Attend(big, timeout=120))
        self.assertEqual(client, {"DEADLINE_EXCEEDED": 10})
        # The server sees the deadline pass (or the client's cancel it causes).
        self.assertEqual(set(server) - {"DEADLINE_EXCEEDED", "CANCELLED"}, set(), server)
        self.assertEqual(code, "OK")
        self.assertEqual(list(response.output.shape), [1, 2048, D_MODEL])
        self.assertLess(cpu, 0.05)
        record("deadline 50 ms < compute x10 (S=2048)",
               f"client: {summary(client)}; server: {summary(server)}; idle CPU after: "
               f"{cpu * 100:.1f}% of a core; next call (no deadline) OK")


class NonFinite(FaultCase):
    def test_nan_and_inf_follow_the_policy_and_never_change_another_requests_result(self):
        rng = np.random.default_rng()
        good = [rng.standard_normal((2, 64, D_MODEL)).astype(np.float32) for _ in range(2)]
        solo = [from_tensor(self.pb, self.stub.Attend(self.request(x), timeout=60).output).copy()
                for x in good]

        def poisoned(value, where):
            x = good[0].copy()
            x[1, where, 5] = value
            return x

        padded = good[1].copy()
        padded[1, 40:, :] = 0.0
        padded_solo = from_tensor(self.pb, self.stub.Attend(
            self.request(padded, sequence_lengths=[64, 40]), timeout=60).output).copy()
        padded_nan = padded.copy()
        padded_nan[1, 40:, :] = np.nan
        mask = np.zeros((1, 64, 64), np.float32)
        cases = {
            "NaN in a token": (self.request(poisoned(np.nan, 7)), "INVALID_ARGUMENT"),
            "+Inf in a token": (self.request(poisoned(np.inf, 0)), "INVALID_ARGUMENT"),
            "-Inf in a token": (self.request(poisoned(-np.inf, 63)), "INVALID_ARGUMENT"),
            "NaN in padding": (self.request(padded_nan, sequence_lengths=[64, 40]), "OK"),
            "NaN in an additive mask": (self.request(good[0], mask=self.pb.AttentionMask(
                kind=self.pb.AttentionMask.KIND_ADDITIVE, values=to_tensor(self.pb, np.where(
                    np.arange(64) == 3, np.nan, mask))), ), "INVALID_ARGUMENT"),
            "+Inf in an additive mask": (self.request(good[0], mask=self.pb.AttentionMask(
                kind=self.pb.AttentionMask.KIND_ADDITIVE, values=to_tensor(self.pb, np.where(
                    np.arange(64) == 3, np.inf, mask))), ), "INVALID_ARGUMENT"),
            "NaN head-mask gate": (self.request(good[0], head_mask=[1.0] * 11 + [float("nan")]),
                                   "INVALID_ARGUMENT"),
        }
        # Everything at once, three rounds interleaved with the good requests,
        # so bad and good share the queue (and a batch, where requests batch).
        futures = []
        for _ in range(3):
            for name, (request, _) in cases.items():
                futures.append((name, self.stub.Attend.future(request, timeout=120)))
                futures.append(("good 0", self.stub.Attend.future(self.request(good[0]), timeout=120)))
            futures.append(("good 1", self.stub.Attend.future(self.request(good[1]), timeout=120)))
        got = {}
        worst = 0.0
        references = [self.reference(x) for x in good]
        padded_reference = [self.reference(padded[0:1])[0], self.reference(padded[1:2, :40])[0]]
        for name, future in futures:
            code, response = self.status_of(future)
            got.setdefault(name, set()).add(code)
            if name.startswith("good") and code == "OK":
                out = from_tensor(self.pb, response.output)
                which = int(name[-1])
                self.assert_as_promised(out, solo[which], references[which], name)
                worst = max(worst, rel_error(out, solo[which]))
            elif name == "NaN in padding" and code == "OK":
                # The padding is never read: the valid rows are as promised.
                out = from_tensor(self.pb, response.output)
                self.assertTrue(np.isfinite(out[1, :40]).all())
                self.assert_as_promised(out[0], padded_solo[0], padded_reference[0], name)
                self.assert_as_promised(out[1, :40], padded_solo[1, :40], padded_reference[1], name)
            elif code != "OK":
                self.assertTrue(any(field in response.details() for field in
                                    ("hidden_states", "mask", "head_mask")), response.details())
        for name, (_, expected) in cases.items():
            self.assertEqual(got[name], {expected}, name)
        self.assertEqual(got["good 0"], {"OK"})
        self.assertEqual(got["good 1"], {"OK"})
        # Each good answer was as promised (batched or not); a batch with a
        # non-finite member is covered by tests/server/api/batching_service_test.cc.
        record("NaN/Inf inputs, 3 rounds of 7 bad + 10 good concurrent",
               "; ".join(f"{name}: {'/'.join(sorted(got[name]))}" for name in cases)
               + f"; 30 good: OK, largest relative difference to solo {worst:g} "
               f"(promised <= {BATCHED_VS_SOLO:g}), each within {FP32_VS_REFERENCE:g} of the reference")


class Oversized(FaultCase):
    FLAGS = ("--max_receive_message_bytes=1048576", "--max_send_message_bytes=1048576")

    def test_oversized_requests_and_responses_are_refused_and_the_server_goes_on(self):
        rng = np.random.default_rng()
        too_big = self.request(rng.standard_normal((1, 400, D_MODEL)).astype(np.float32))  # 1.2 MB
        # 0.4 MB in, 12 x 128 x 128 x 4 = 0.8 MB of maps + 0.4 MB out.
        big_answer = self.request(rng.standard_normal((1, 128, D_MODEL)).astype(np.float32),
                                  maps=self.pb.ATTENTION_MAP_MODE_PER_HEAD)
        before = self.server.scrape()
        rss = self.server.memory_kib()
        c1, e1 = self.status_of(lambda: self.stub.Attend(too_big, timeout=30))
        c2, e2 = self.status_of(lambda: self.stub.Attend(big_answer, timeout=30))
        c3, ok = self.status_of(lambda: self.stub.Attend(
            self.request(rng.standard_normal((1, 128, D_MODEL)).astype(np.float32)), timeout=30))
        after = self.server.scrape()
        # The request: gRPC's own limit, checked before the server sees it.
        self.assertEqual(c1, "RESOURCE_EXHAUSTED")
        # The response can never fit this server's limit: the request's fault.
        self.assertEqual(c2, "INVALID_ARGUMENT")
        self.assertIn("--max_send_message_bytes", e2.details())
        self.assertEqual(c3, "OK")
        self.assertEqual(list(ok.output.shape), [1, 128, D_MODEL])
        # The refused answer was refused before compute: no compute was counted for it.
        computed = metric(after, "attnserve_tokens_total", model="default") - \
            metric(before, "attnserve_tokens_total", model="default")
        grew = self.server.memory_kib()["VmHWM"] - rss["VmHWM"]
        self.assertEqual(computed, 128)
        record("oversized request 1.2 MB > 1 MiB limit; response 1.2 MB > 1 MiB limit",
               f"request: {c1} (gRPC's limit); response: {c2} before compute; next call {c3}; "
               f"tokens computed: {int(computed)} (the next call's only); VmHWM +{grew} KiB")


class MemoryBombs(FaultCase):
    # An operator who allows 200k-token sequences: the bombs pass the length
    # limit and must be caught by the byte budgets.
    FLAGS = ("--max_seq_len=200000",)

    def layer(self, d_model, num_heads, seed=1):
        return self.pb.LayerSpec(head_config=self.pb.HeadConfig(d_model=d_model, num_heads=num_heads),
                                 seed=seed)

    def test_memory_bombs_are_refused_before_allocation_with_rss_unchanged(self):
        pb = self.pb
        seq = 100_000
        states = np.zeros((1, seq, 8), np.float32)  # 3.2 MB on the wire

        def small(**fields):
            return pb.AttendRequest(layer=self.layer(8, 1), **fields)

        bombs = {
            "seq 100k, per-head maps (40 GB)": (small(
                hidden_states=to_tensor(pb, states),
                attention_maps=pb.AttentionMapRequest(mode=pb.ATTENTION_MAP_MODE_PER_HEAD)),
                "INVALID_ARGUMENT"),
            # Statistics need the materialized scores (40 GB); without maps or
            # statistics the blocked path serves the same request in linear
            # memory, within the same RSS bound.
            "seq 100k, head statistics (scores 40 GB)": (small(
                hidden_states=to_tensor(pb, states),
                attention_maps=pb.AttentionMapRequest(head_statistics=True)), "INVALID_ARGUMENT"),
            "seq 100k, no maps (blocked path, linear memory)": (small(
                hidden_states=to_tensor(pb, states)), "OK"),
            "shape [64, 100k, 768], 16 bytes of data": (pb.AttendRequest(
                model="default", hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_FP32,
                                                         shape=[64, seq, D_MODEL], raw_data=b"\0" * 16)),
                "INVALID_ARGUMENT"),
            "shape [2^40, 2^40, 768] (overflows)": (pb.AttendRequest(
                model="default", hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_FP32,
                                                         shape=[1 << 40, 1 << 40, D_MODEL], raw_data=b"")),
                "INVALID_ARGUMENT"),
            "mask [1, 100k, 100k], no data": (pb.AttendRequest(
                model="default", hidden_states=to_tensor(pb, np.zeros((1, 4, D_MODEL), np.float32)),
                mask=pb.AttentionMask(kind=pb.AttentionMask.KIND_ALLOWED, values=pb.Tensor(
                    dtype=pb.DATA_TYPE_BOOL, shape=[1, seq, seq]))), "INVALID_ARGUMENT"),
            "packed lengths summing to 10^10": (small(
                hidden_states=to_tensor(pb, np.zeros((100, 8), np.float32)),
                sequence_lengths=[100_000] * 100_000), "INVALID_ARGUMENT"),
            "seeded layer d_model 8192 (1 GiB of weights)": (pb.AttendRequest(
                layer=self.layer(8192, 64), hidden_states=to_tensor(pb, np.zeros((1, 1, 8192), np.float32))),
                "INVALID_ARGUMENT"),
            "seeded layer d_model 2^20 (over the d_model limit)": (pb.AttendRequest(
                layer=self.layer(1 << 20, 1), hidden_states=to_tensor(pb, np.zeros((1, 1, 8), np.float32))),
                "INVALID_ARGUMENT"),
        }
        # The served one computes 10^10 scores: minutes on a busy machine (a
        # deadline is no place for a speed assumption). It runs once in the
        # measured rounds, the refusals three times.
        served = "seq 100k, no maps (blocked path, linear memory)"

        def timeout(name):
            return 1200 if name == served else 60

        # Warm up with an accepted request of the same layer, so that what
        # grows afterwards is what the bombs cost.
        warm = small(hidden_states=to_tensor(pb, np.ones((1, 512, 8), np.float32)))
        self.assertEqual(self.status_of(lambda: self.stub.Attend(warm, timeout=60))[0], "OK")
        for name, (request, _) in bombs.items():  # once, so that gRPC's buffers for 3 MB messages exist
            self.status_of(lambda: self.stub.Attend(request, timeout=timeout(name)))
        before = self.server.memory_kib()
        got = {}
        for rnd in range(3):
            for name, (request, _) in bombs.items():
                if name == served and rnd > 0:
                    continue
                code, error = self.status_of(lambda: self.stub.Attend(request, timeout=timeout(name)))
                got.setdefault(name, set()).add(code)
        after = self.server.memory_kib()
        code, _ = self.status_of(lambda: self.stub.Attend(warm, timeout=60))
        for name, (_, expected) in bombs.items():
            self.assertEqual(got[name], {expected}, name)
        self.assertEqual(code, "OK")
        self.assertLessEqual(after["VmHWM"] - before["VmHWM"], BOMB_HWM_BOUND_KIB)
        record("memory bombs x3 each, the served request x1 (--max_seq_len=200000)",
               "; ".join(f"{name}: {'/'.join(sorted(got[name]))}" for name in bombs)
               + f"; VmRSS {before['VmRSS']} -> {after['VmRSS']} KiB, VmHWM {before['VmHWM']} -> "
               f"{after['VmHWM']} KiB (bound +{BOMB_HWM_BOUND_KIB} KiB); next call OK")


class Sigterm(FaultCase):
    # The calls gather in one batch that never fills (a million tokens) and
    # waits up to 10 s from the first arrival for more: the executor holds
    # them, so all of them are in flight together before the signal however
    # slowly they upload or compute. The drain waits out that delay and
    # computes them; its timeout leaves room for a busy machine.
    # No lame duck: new calls are refused from the signal on (during a lame
    # duck the server still serves them).
    FLAGS = ("--lame_duck_seconds=0", "--max_batch_tokens=1000000", "--max_queue_delay_us=10000000",
             "--drain_timeout_seconds=300")

    @classmethod
    def tearDownClass(cls):  # the server is gone already
        cls.channel.close()
        cls.server.stop()

    def test_sigterm_under_load_answers_every_started_call_refuses_new_ones_exits_zero(self):
        rng = np.random.default_rng()
        inputs = [rng.standard_normal((2, 768, D_MODEL)).astype(np.float32) for _ in range(8)]
        requests = [self.request(x) for x in inputs]
        # Each request's solo answer, from the same server before the load.
        solo = [from_tensor(self.pb, self.stub.Attend(r, timeout=120).output).copy() for r in requests]
        watch = self.health.Watch(self.health_pb.HealthCheckRequest(service=""), timeout=600)
        self.assertEqual(next(watch).status, self.health_pb.HealthCheckResponse.SERVING)
        statuses = []
        seen = threading.Thread(target=lambda: statuses.extend(r.status for r in self._drain(watch)))
        seen.start()
        futures = [self.stub.Attend.future(r, timeout=400) for r in requests]
        # Every call has reached the server (counted in flight) before the signal.
        deadline = time.monotonic() + 60
        while metric(self.server.scrape(), "attnserve_requests_in_flight") < len(futures):
            self.assertLess(time.monotonic(), deadline, "the calls never all arrived")
            time.sleep(0.01)
        in_flight = sum(not f.done() for f in futures)
        self.server.proc.send_signal(signal.SIGTERM)
        new_codes = []
        deadline = time.monotonic() + 30
        while not statuses:  # until the server says NOT_SERVING
            self.assertLess(time.monotonic(), deadline, "health never said NOT_SERVING")
            time.sleep(0.01)
        for _ in range(3):
            new_codes.append(self.status_of(lambda: self.stub.Attend(requests[0], timeout=60))[0])
        answered = [self.status_of(f) for f in futures]
        exit_code = self.server.proc.wait(timeout=120)
        seen.join(timeout=10)
        for i, ((code, response), expected) in enumerate(zip(answered, solo)):
            self.assertEqual(code, "OK")
            self.assert_as_promised(from_tensor(self.pb, response.output), expected,
                                    self.reference(inputs[i]), f"call {i}")
        self.assertEqual(new_codes, ["UNAVAILABLE"] * 3)
        self.assertEqual(statuses[0], self.health_pb.HealthCheckResponse.NOT_SERVING)
        self.assertEqual(exit_code, 0)
        self.assertGreater(in_flight, 1, "calls were not in flight at SIGTERM; proved nothing")
        record("SIGTERM with 8 calls in flight ([2, 768, 768] each)",
               f"{in_flight} unfinished at the signal; health Watch: NOT_SERVING first; "
               f"8/8 started calls OK, as their solo answers and the reference; 3 new calls: "
               f"{'/'.join(sorted(set(new_codes)))}; exit code {exit_code}")

    @staticmethod
    def _drain(watch):
        try:
            yield from watch
        except Exception:  # the stream ends when the server goes away
            return


def print_table():
    if not ROWS:
        return
    print("\n| case | what the requests got | lost |\n|---|---|---|")
    for case, got, lost in ROWS:
        print(f"| {case} | {got} | {lost} |")


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    program = run_tests_with_stubs(ARGS.proto_dir, rest, exit=False)
    # A case records its row only once all its assertions held.
    for test, _ in program.result.failures + program.result.errors:
        record(test.id().rsplit(".", 1)[-1], "FAILED (see above)", "see above")
    print_table()
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
