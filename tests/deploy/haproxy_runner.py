"""The shipped front proxy (deploy/haproxy/haproxy.cfg, unchanged) run by a
test on this machine: Debian's HAProxy as a plain foreground process
(`haproxy -db -f deploy/haproxy/haproxy.cfg`) in front of attnserve replicas
on loopback, on free loopback ports.

    from haproxy_runner import HAProxy
    with HAProxy(repo, ["127.0.0.1:50051", "127.0.0.1:50052"]) as proxy:
        proxy.wait_replicas_up(2)              # health checks passed
        channel = grpc.insecure_channel(proxy.address)
        ...
        proxy.metrics()                        # HAProxy's /metrics, parsed
        proxy.upstream_connections()           # {replica: TCP connections}
        proxy.log_text()                       # what HAProxy printed

HAProxy(repo, replicas) starts it and returns once both its ports accept
connections (it raises AssertionError with HAProxy's output if it does not
start within `timeout` seconds). `replicas` are 1 to 4 "host:port" addresses
(the config's ATTNSERVE_REPLICA_1..4); the config's every limit applies as
shipped. The process is stopped (SIGTERM, then SIGKILL) by stop(), by leaving
the with block, or at interpreter exit, whichever comes first.

Every client of a test connects from 127.0.0.1 unless it binds another
loopback address: the proxy's per-address limits (100 connections open, 200
opened per 10 s) then count them together. A test that floods the proxy and
also measures good calls should send one of the two from another address
(127.0.0.2) so that the limits meet only the flood.
"""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

CONFIG = ("deploy", "haproxy", "haproxy.cfg")
MAX_REPLICAS = 4
BACKEND = "replicas"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_binary():
    return shutil.which("haproxy") or "/usr/sbin/haproxy"


def config_path(repo):
    return os.path.join(repo, *CONFIG)


def replica_environment(replicas, grpc_port, stats_port):
    """The environment that points the shipped config at fixed replicas and
    binds its listeners to loopback ports."""
    assert 1 <= len(replicas) <= MAX_REPLICAS, f"1 to {MAX_REPLICAS} replicas, got {len(replicas)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    for i, address in enumerate(replicas, 1):
        env[f"ATTNSERVE_REPLICA_{i}"] = address
    env["ATTNSERVE_PROXY_BIND"] = f"127.0.0.1:{grpc_port}"
    env["ATTNSERVE_PROXY_STATS_BIND"] = f"127.0.0.1:{stats_port}"
    return env


def parse_exposition(text):
    """[(name, {label: value}, value)] of a Prometheus text exposition."""
    samples = []
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if m:
            samples.append((m.group(1), dict(label_re.findall(m.group(2) or "")), float(m.group(3))))
    return samples


class HAProxy:
    """One HAProxy process running the shipped config; see the module's
    docstring. Not thread-safe: one test thread drives it."""

    def __init__(self, repo, replicas, timeout=30):
        self.replicas = list(replicas)
        self.binary = haproxy_binary()
        self.config = config_path(repo)
        self.work = tempfile.mkdtemp(prefix="attnserve-haproxy-")
        self.proc = None
        self._output = None
        atexit.register(self.cleanup)
        # A probed free port can be taken before HAProxy binds it: try again.
        for _ in range(3):
            self.port, self.stats_port = free_port(), free_port()
            self.env = replica_environment(self.replicas, self.port, self.stats_port)
            check = subprocess.run([self.binary, "-c", "-f", self.config], env=self.env,
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, f"haproxy -c: {check.stdout}{check.stderr}"
            self._output = open(os.path.join(self.work, "haproxy.log"), "w")
            self.proc = subprocess.Popen([self.binary, "-db", "-f", self.config], env=self.env,
                                         stdout=self._output, stderr=subprocess.STDOUT)
            if self._wait_accepting(timeout):
                self.address = f"127.0.0.1:{self.port}"
                return
            self.stop()
        raise AssertionError(f"haproxy did not start: {self.log_text()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()

    def _wait_accepting(self, timeout):
        deadline = time.monotonic() + timeout
        pending = [self.port, self.stats_port]
        while pending and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", pending[0]), timeout=1):
                    pending.pop(0)
            except OSError:
                time.sleep(0.05)
        return not pending

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def metrics_text(self, timeout=10):
        """HAProxy's Prometheus exposition (its stats frontend's /metrics)."""
        import urllib.request
        url = f"http://127.0.0.1:{self.stats_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()

    def metrics(self):
        """[(name, labels, value)] of metrics_text()."""
        return parse_exposition(self.metrics_text())

    def server_states(self):
        """{server name (replica1..): True when UP} of the replicas backend."""
        states = {}
        for name, labels, value in self.metrics():
            if name == "haproxy_server_status" and labels.get("proxy") == BACKEND:
                if "state" in labels:  # one series per state, 1 for the current one
                    if value == 1:
                        states[labels["server"]] = labels["state"] == "UP"
                else:
                    states[labels["server"]] = value == 1
        return states

    def server_counter(self, metric, **labels):
        """{server name: value} of a per-server metric of the replicas
        backend, summed over the series matching `labels` (all when none)."""
        totals = {}
        for name, series, value in self.metrics():
            if (name == metric and series.get("proxy") == BACKEND
                    and all(series.get(k) == v for k, v in labels.items())):
                totals[series["server"]] = totals.get(series["server"], 0) + value
        return totals

    def checks_passed(self):
        """{server name: True when its last health check passed (L7OK)}.
        HAProxy counts a server UP from start-up, before its first check
        has ended: this tells a replica UP by a check from one UP by
        default."""
        passed = {}
        for name, labels, value in self.metrics():
            if (name == "haproxy_server_check_status" and labels.get("proxy") == BACKEND
                    and value == 1):
                passed[labels["server"]] = labels.get("state") == "L7OK"
        return passed

    def wait_replicas_up(self, count, timeout=60):
        """Waits until `count` replicas are UP with a passed health check."""
        deadline = time.monotonic() + timeout
        states = {}
        while time.monotonic() < deadline:
            assert self.running(), f"haproxy exited: {self.log_text()}"
            states, passed = self.server_states(), self.checks_passed()
            if sum(up and passed.get(name, False) for name, up in states.items()) >= count:
                return states
            time.sleep(0.1)
        raise AssertionError(f"{count} replicas never UP in haproxy: {states}\n{self.log_text()}")

    def upstream_connections(self):
        """{replica "host:port": established TCP connections HAProxy holds to
        it}, read from /proc (its sockets' inodes against /proc/net/tcp)."""
        inodes = set()
        fd_dir = f"/proc/{self.proc.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            m = re.match(r"socket:\[(\d+)\]", link)
            if m:
                inodes.add(m.group(1))
        counts = {r: 0 for r in self.replicas}
        ports = {int(r.rsplit(":", 1)[1]): r for r in self.replicas}
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                remote_port = int(fields[2].split(":")[1], 16)
                if fields[3] == "01" and fields[9] in inodes and remote_port in ports:
                    counts[ports[remote_port]] += 1
        return counts

    def log_text(self):
        path = os.path.join(self.work, "haproxy.log")
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
        return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._output is not None:
            self._output.close()
            self._output = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)
