"""attnctl bench against the real attnserve binary: closed and open loop,
JSON and text results, progress on stderr, errors by status code when the
server sheds load, and flag mistakes refused before any call."""
import argparse
import json
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

ARGS = None


def wait_serving(server, timeout=120):
    """Polls `attnctl health` until the server is SERVING (its model warm)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run([ARGS.attnctl, "health", f"--target={server.target}",
                           "--timeout_seconds=10"], capture_output=True, timeout=60).returncode == 0:
            return server
        time.sleep(0.05)
    raise AssertionError("attnserve never became SERVING")


class BenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = wait_serving(harness.Server(ARGS.server))

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def bench(self, *flags, target=None):
        return subprocess.run(
            [ARGS.attnctl, "bench", f"--target={target or self.server.target}", *flags],
            capture_output=True, text=True, timeout=240)

    def test_closed_loop_json_counts_every_call(self):
        run = self.bench("--concurrency=4", "--requests=40", "--batch=1", "--seq=16", "--json")
        self.assertEqual(run.returncode, 0, run.stderr)
        r = json.loads(run.stdout)
        self.assertEqual(r["mode"], "closed")
        self.assertEqual(r["sent"], 40)
        self.assertEqual(r["ok"], 40)
        self.assertEqual(r["errors"], {})
        self.assertEqual(r["tokens_per_request"], 16)
        lat = r["latency_ms"]
        self.assertGreater(lat["p50"], 0)
        self.assertGreater(r["throughput_rps"], 0)
        self.assertGreaterEqual(r["server"]["batch_size"], 1)
        self.assertGreaterEqual(r["server"]["batch_tokens"], 16)

    def test_open_loop_sends_at_the_rate(self):
        # 40 calls at 80/s take about half a second whatever the answers; sent
        # back to back (closed loop), 40 calls of 8 tokens take a few ms.
        run = self.bench("--rate=80", "--requests=40", "--batch=1", "--seq=8", "--json")
        self.assertEqual(run.returncode, 0, run.stderr)
        r = json.loads(run.stdout)
        self.assertEqual(r["mode"], "open")
        self.assertEqual(r["ok"], 40)
        self.assertGreaterEqual(r["elapsed_seconds"], 39 / 80)

    def test_text_summary_and_progress_lines(self):
        run = self.bench("--concurrency=2", "--duration=3", "--batch=1", "--seq=8")
        self.assertEqual(run.returncode, 0, run.stderr)
        for word in ["throughput:", "p50", "p99", "max", "requests:"]:
            self.assertIn(word, run.stdout)
        # Not a terminal: a plain progress line every second.
        self.assertRegex(run.stderr, r"bench: \d+% \d+ calls")

    def test_overloaded_server_sheds_with_resource_exhausted(self):
        # The executor holds the first call's batch, which never fills (a
        # million tokens), for 5 s: the queue of 2 is full while the other
        # calls come, however fast or slow this machine computes. The calls'
        # deadline leaves room for the wait on a busy machine.
        small = harness.Server(ARGS.server, "--max_queued_requests=2", "--max_batch_tokens=1000000",
                               "--max_queue_delay_us=5000000")
        try:
            wait_serving(small)
            run = self.bench("--concurrency=32", "--requests=200", "--batch=1", "--seq=64",
                             "--timeout_seconds=100", "--json", target=small.target)
            self.assertEqual(run.returncode, 0, run.stderr)
            r = json.loads(run.stdout)
            self.assertGreater(r["ok"], 0)
            self.assertGreater(r["errors"].get("RESOURCE_EXHAUSTED", 0), 0, r)
            self.assertEqual(r["ok"] + sum(r["errors"].values()), 200)
            self.assertIsNone(small.proc.poll(), "the server must survive")
        finally:
            small.stop()

    def test_flag_mistakes_are_usage_errors_refused_before_any_call(self):
        # Exit 2 (a usage mistake), not 1 (a failed call); the message names the flag.
        run = self.bench("--concurrency=2", "--rate=5", "--requests=1")
        self.assertEqual(run.returncode, 2, run.stderr)
        self.assertIn("--concurrency or --rate", run.stderr)
        run = self.bench("--requests=1")
        self.assertEqual(run.returncode, 2, run.stderr)
        self.assertIn("--concurrency or --rate", run.stderr)
        run = self.bench("--concurrency=1", "--duration=-1")
        self.assertEqual(run.returncode, 2, run.stderr)
        self.assertIn("--duration", run.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], *rest])
