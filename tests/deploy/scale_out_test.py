#!/usr/bin/python3
"""Scale-out on one machine: three attnserve replicas on 127.0.0.1 (free ports),
called through attnctl (the C++ client library)

  - with gRPC's client-side round_robin over all three (an ipv4: URI, or a
    comma-separated list), and
  - through Debian's nginx balancing gRPC (deploy/nginx/nginx.conf: grpc_pass
    to an upstream of the three) on a free loopback port, run as a plain
    process with its own prefix.

Each replica's own /metrics (attnserve_requests_total) says how many calls it
served. Stopping one replica in the middle of a run loses no call: a draining
replica answers UNAVAILABLE, which the client's retry policy sends elsewhere;
without retries the same stop fails calls (the control).

Every loop is bounded in count and time; replicas and nginx are stopped in
finally blocks.

Usage: scale_out_test.py --server PATH/attnserve --attnctl PATH/attnctl --repo REPO
"""
import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from harness import Server  # noqa: E402

ARGS = None
REPLICAS = 3
# Small requests: the runs measure where calls go, not compute.
ATTEND = ["attend", "--seq=8"]


def log(message):
    sys.stderr.write(f"scale_out: {message}\n")
    sys.stderr.flush()


def wait_until(what, check, timeout, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Replica:
    """One attnserve process: gRPC and metrics on free loopback ports."""

    def __init__(self, index, *flags):
        self.index = index
        self.server = Server(ARGS.server, "--compute_threads=1", *flags)
        self.port = self.server.port
        self.address = f"127.0.0.1:{self.port}"

        def metrics_port():
            for line in list(self.server.log):
                m = re.search(r"metrics on port (\d+)", line)
                if m:
                    return int(m.group(1))
            return None

        self.metrics_port = wait_until(f"replica {index}'s metrics port", metrics_port, 30)
        wait_until(f"replica {index} SERVING", lambda: any("SERVING (" in l for l in list(self.server.log)),
                   60)

    def attend_counts(self):
        """{code: attnserve_requests_total{method="Attend"}} from /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        counts = {}
        for labels, value in re.findall(r'^attnserve_requests_total\{([^}]*)\}\s+(\S+)$', text, re.M):
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if pairs.get("method") == "Attend":
                counts[pairs["code"]] = counts.get(pairs["code"], 0) + int(float(value))
        return counts

    def ok(self):
        return self.attend_counts().get("OK", 0)

    def running(self):
        return self.server.proc.poll() is None

    def terminate(self):
        """SIGTERM: lame duck, drain, exit 0."""
        self.server.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout=40):
        return self.server.proc.wait(timeout=timeout)

    def stop(self):
        self.server.stop()


def start_replicas(*flags):
    replicas = []
    try:
        for i in range(REPLICAS):
            replicas.append(Replica(i + 1, *flags))
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """Debian's nginx with deploy/nginx/nginx.conf, its upstream replaced by
    `upstreams` and its listen address by a free loopback port: a foreground
    process (one process, no master) with a temporary prefix."""

    def __init__(self, upstreams):
        self.binary = shutil.which("nginx") or "/usr/sbin/nginx"
        self.work = tempfile.mkdtemp(prefix="attnserve-nginx-")
        self.proc = None
        self.stderr = None
        with open(os.path.join(ARGS.repo, "deploy", "nginx", "nginx.conf")) as f:
            shipped = f.read()
        servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+( [^;]*)?;$", shipped, re.M)
        assert len(servers) == REPLICAS, "deploy/nginx/nginx.conf: expected one server line per replica"
        lines = iter(f"    server {u}{servers[0]};" for u in upstreams)
        config_text = re.sub(r"^\s*server 127\.0\.0\.1:\d+( [^;]*)?;$", lambda m: next(lines), shipped,
                             flags=re.M)
        config_text = config_text.replace("daemon off;", "daemon off;\nmaster_process off;", 1)
        for _ in range(3):  # a free port can be taken between the probe and nginx's bind
            self.port = free_port()
            text, listens = re.subn(r"listen 127\.0\.0\.1:\d+ http2;", f"listen 127.0.0.1:{self.port} http2;",
                                    config_text)
            assert listens == 1, "deploy/nginx/nginx.conf: expected one listen line"
            config = os.path.join(self.work, "nginx.conf")
            with open(config, "w") as f:
                f.write(text)
            test = subprocess.run([self.binary, "-t", "-e", "stderr", "-p", self.work, "-c", config],
                                  capture_output=True, text=True, timeout=30)
            assert test.returncode == 0, f"nginx -t: {test.stderr}"
            self.stderr = open(os.path.join(self.work, "stderr.log"), "w")
            self.proc = subprocess.Popen([self.binary, "-e", "stderr", "-p", self.work, "-c", config],
                                         stdout=subprocess.DEVNULL, stderr=self.stderr)
            if self._wait_listening():
                self.address = f"127.0.0.1:{self.port}"
                return
            self.stop()
        raise AssertionError(f"nginx did not start: {self.log()}")

    def _wait_listening(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def log(self):
        text = ""
        for name in ("stderr.log",):
            path = os.path.join(self.work, name)
            if os.path.exists(path):
                with open(path) as f:
                    text += f.read()
        return text

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def attnctl(*args, timeout=120):
    done = subprocess.run([ARGS.attnctl, *args], capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def ipv4_uri(replicas):
    return "ipv4:" + ",".join(r.address for r in replicas)


def spread(before, replicas):
    return [r.ok() - b for r, b in zip(replicas, before)]


class Balancing(unittest.TestCase):
    """Where the calls of one client go, read from each replica's metrics."""

    CALLS = 90

    @classmethod
    def setUpClass(cls):
        cls.replicas = start_replicas()

    @classmethod
    def tearDownClass(cls):
        for r in cls.replicas:
            r.stop()

    def run_and_spread(self, what, *args):
        before = [r.ok() for r in self.replicas]
        code, out = attnctl(*ATTEND, f"--repeat={self.CALLS}", *args)
        self.assertEqual(code, 0, out)
        self.assertIn(f"round trip over {self.CALLS} calls", out)
        counts = spread(before, self.replicas)
        log(f"{what}: calls per replica {counts} (of {self.CALLS})")
        self.assertEqual(sum(counts), self.CALLS)
        return counts

    def assertEven(self, counts):
        # round_robin starts on the replicas that are connected first; every
        # replica gets at least half its even share, and none double it.
        share = self.CALLS // REPLICAS
        for c in counts:
            self.assertGreaterEqual(c, share // 2, counts)
            self.assertLessEqual(c, 2 * share, counts)

    def test_round_robin_over_an_ipv4_uri_spreads_calls_over_every_replica(self):
        self.assertEven(self.run_and_spread("client-side round_robin, ipv4: URI",
                                            f"--target={ipv4_uri(self.replicas)}", "--lb_policy=round_robin"))

    def test_round_robin_over_a_comma_separated_list_spreads_calls_over_every_replica(self):
        target = ",".join(r.address for r in self.replicas)
        self.assertEven(self.run_and_spread("client-side round_robin, host:port list",
                                            f"--target={target}", "--lb_policy=round_robin"))

    def test_pick_first_sends_every_call_to_one_replica(self):
        counts = self.run_and_spread("pick_first (the control)", f"--target={ipv4_uri(self.replicas)}",
                                     "--lb_policy=pick_first")
        self.assertEqual(sorted(counts), [0] * (REPLICAS - 1) + [self.CALLS])

    def test_nginx_grpc_pass_spreads_calls_over_every_replica(self):
        nginx = Nginx([r.address for r in self.replicas])
        try:
            self.assertEven(self.run_and_spread("nginx grpc_pass upstream", f"--target={nginx.address}"))
            with open(os.path.join(nginx.work, "access.log")) as f:
                proxied = [l for l in f if "/attnserve.v1.AttentionService/Attend" in l]
            self.assertEqual(len(proxied), self.CALLS)
        finally:
            nginx.cleanup()


class StopAReplicaMidRun(unittest.TestCase):
    """A long attnctl run; once a third of it is done one replica is stopped.
    Every call must still succeed (attnctl stops at the first failed call and
    exits 1), and the survivors take over."""

    CALLS = 3000
    TIMEOUT = 240

    def run_with_a_stop(self, what, args, replicas, stop=Replica.terminate, takeover=True):
        """Runs attnctl with `args` and stops replicas[1] (`stop`) a third of the
        way through. Returns attnctl's exit code and output, and how many calls
        the stopped replica answered UNAVAILABLE while it drained."""
        victim, survivors = replicas[1], [replicas[0], replicas[2]]
        before = [r.ok() for r in replicas]
        proc = subprocess.Popen([ARGS.attnctl, *ATTEND, f"--repeat={self.CALLS}", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        unavailable = [0]
        victim_ok = [0]
        watcher = None
        try:
            wait_until("a third of the calls", lambda: proc.poll() is not None or
                       sum(spread(before, replicas)) >= self.CALLS // 3, 120, interval=0.05)
            self.assertIsNone(proc.poll(), "attnctl finished before the stop: the run proves nothing")
            at_stop = spread(before, replicas)
            stop(victim)

            # The victim's own count of the calls it refused while draining,
            # read until it exits (its metrics go with it).
            def watch():
                deadline = time.monotonic() + 60
                while victim.running() and time.monotonic() < deadline:
                    try:
                        counts = victim.attend_counts()
                        unavailable[0] = max(unavailable[0], counts.get("UNAVAILABLE", 0))
                        victim_ok[0] = max(victim_ok[0], counts.get("OK", 0) - before[1])
                    except OSError:
                        pass
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            out, _ = proc.communicate(timeout=self.TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        victim.wait()
        watcher.join(timeout=70)
        # The stopped replica's count is the last one read before it exited.
        total = [replicas[0].ok() - before[0], max(victim_ok[0], at_stop[1]), replicas[2].ok() - before[2]]
        gained = [total[0] - at_stop[0], total[2] - at_stop[2]]
        log(f"{what}: attnctl exit {proc.returncode}; OK calls per replica at the stop {at_stop}, "
            f"at the end {total} (sum {sum(total)} of {self.CALLS}); survivors' calls after the stop "
            f"{gained}; UNAVAILABLE answered by the stopped replica {unavailable[0]}")
        if takeover:
            self.assertTrue(all(g > 0 for g in gained), f"survivors took no calls after the stop: {gained}")
        self.assertGreater(at_stop[1], 0, "the stopped replica served nothing before the stop")
        return proc.returncode, out, unavailable[0]

    def test_round_robin_with_health_checking_loses_no_call(self):
        replicas = start_replicas()
        try:
            code, out, _ = self.run_with_a_stop(
                "round_robin + health checking + retries, SIGTERM",
                [f"--target={ipv4_uri(replicas)}", "--lb_policy=round_robin"], replicas)
            self.assertEqual(code, 0, out)
            self.assertIn(f"round trip over {self.CALLS} calls", out)
        finally:
            for r in replicas:
                r.stop()

    def test_retries_recover_the_calls_a_draining_replica_refuses(self):
        # No client-side health checking: calls keep reaching the replica in
        # its lame duck, which refuses them with UNAVAILABLE; each is retried.
        replicas = start_replicas()
        try:
            code, out, unavailable = self.run_with_a_stop(
                "round_robin + retries, no health checking, SIGTERM",
                [f"--target={ipv4_uri(replicas)}", "--lb_policy=round_robin", "--lb_health_check_service="],
                replicas)
            self.assertEqual(code, 0, out)
            self.assertIn(f"round trip over {self.CALLS} calls", out)
            self.assertGreater(unavailable, 0, "no call met the draining replica: nothing was retried")
        finally:
            for r in replicas:
                r.stop()

    def test_without_retries_the_same_stop_fails_calls(self):
        replicas = start_replicas()
        try:
            code, out, _ = self.run_with_a_stop(
                "round_robin, no retries, no health checking, SIGTERM (the control)",
                [f"--target={ipv4_uri(replicas)}", "--lb_policy=round_robin", "--lb_health_check_service=",
                 "--max_attempts=1"], replicas, takeover=False)
            self.assertEqual(code, 1, out)
            self.assertIn("UNAVAILABLE", out)
        finally:
            for r in replicas:
                r.stop()

    def test_round_robin_survives_a_replica_killed_outright(self):
        replicas = start_replicas()
        try:
            code, out, _ = self.run_with_a_stop(
                "round_robin + health checking + retries, SIGKILL",
                [f"--target={ipv4_uri(replicas)}", "--lb_policy=round_robin"], replicas,
                stop=lambda r: r.server.proc.kill())
            self.assertEqual(code, 0, out)
        finally:
            for r in replicas:
                r.stop()

    def test_behind_nginx_loses_no_call(self):
        replicas = start_replicas()
        nginx = None
        try:
            nginx = Nginx([r.address for r in replicas])
            code, out, unavailable = self.run_with_a_stop(
                "nginx grpc_pass + client retries, SIGTERM", [f"--target={nginx.address}"], replicas)
            self.assertEqual(code, 0, out + nginx.log())
            self.assertIn(f"round trip over {self.CALLS} calls", out)
        finally:
            if nginx is not None:
                nginx.cleanup()
            for r in replicas:
                r.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
