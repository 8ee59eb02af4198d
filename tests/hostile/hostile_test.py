#!/usr/bin/python3
"""The hostile-client suite: attacks on the real attnserve binary, measured.

  hostile_test.py --server PATH/attnserve --proto_dir REPO/proto [--full] [--only REGEX]

Each attack gets a fresh server (loopback, free ports, an open-file limit of
its own) and runs for a bounded time and count from its own process
(attacks.py). Meanwhile a separate well-behaved client (good_client.py) calls
at a fixed rate -- Attend on a new connection every second, or GET /metrics
for the metrics-port attacks -- and this process samples the server's VmRSS
and open fds (/proc/PID/status, /proc/PID/fd) every 50 ms. After the attack
it waits for recovery: every good call for 2 s succeeds, and RSS and fds
are back within bounds; then an "after" window of good calls, then SIGTERM.

An attack passes when the server either
  - stayed alive: peak RSS within 1.5x its idle RSS plus the in-flight budget
    the test configures (--max_inflight_bytes; the transport's quota,
    --max_transport_bytes, is set below it), peak fds within its idle fds
    plus the attack's connections plus 64, recovered within the recovery
    wait, 95% of the good calls after recovery OK, fds back near idle, and
    SIGTERM then exits 0 within the lame-duck plus drain time (+10 s); or
  - exited with the watchdog's code 3 (the listener stopped accepting, or, in
    the direct rapid reset only, RSS passed --max_rss_bytes) for its
    supervisor to restart it,
and never "alive but deaf". Where the shipped defences are meant to keep
calls served during an attack (through the proxy: the idle flood and slow
bodies; direct: the /metrics slowloris), at least half of the good calls
during it must be OK (99% with --full). The short form (the default; CTest
hostile_short) asserts only that and prints no latency figures. --full runs
longer, larger attacks, adds runs without an attack (idle, and with one core
busy) as the comparison, requires the p99 of those served calls during and
after the attack within 3x the p99 of the run with one core busy (same path),
and prints the table with p99s (SECURITY.md quotes it).

Paths: "direct" (the client talks to attnserve) always; "proxy" (through the
shipped HAProxy configuration) once the tree has its launcher,
tests/deploy/haproxy_runner.py.
"""
import argparse
import bisect
import collections
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROXY_RUNNER = os.path.join(REPO, "tests", "deploy", "haproxy_runner.py")
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from harness import generate_stubs, wait_serving, wait_until  # noqa: E402

MIB = 1 << 20
PYTHON = "/usr/bin/python3"
WATCHDOG_EXIT = 3  # the server's exit code when its watchdog gives up (attnserve --help)
P99_FACTOR = 3  # the full form: p99 under attack vs. one core busy without one
RECOVERED_WINDOW = 2.0  # seconds in which every good call was OK: "answers again"


class Scale:
    """What the short and the full form use."""

    def __init__(self, full):
        self.full = full
        self.nofile = 4096 if full else 1024
        # The RSS bound is 1.5 x idle + the in-flight budget; the transport's
        # quota is set well below that budget (bodies still arriving are held
        # there, and admitted requests are not, so no attack here has both).
        self.inflight_bytes = (1 << 30) if full else 256 * MIB
        self.transport_bytes = 256 * MIB if full else 64 * MIB
        # The watchdog's memory bound: under the RSS bound (1.5 x idle + the
        # in-flight budget) by about half the idle level.
        self.max_rss_bytes = self.inflight_bytes + 32 * MIB
        self.good_rate = 20 if full else 10
        # The full form measures OK rates, so a call is late after 2 s; the
        # short form's rates (attacks' served_on) are looser and its calls
        # only need to end eventually.
        self.deadline = 2.0 if full else 10.0
        self.recovery_wait = 60.0 if full else 30.0
        self.after_seconds = 10.0 if full else 2.0
        self.drain_seconds = 5.0
        # Where an attack's row says good calls are served during it: the
        # share that must be OK. The full form: the target, 99%. The short
        # form's 4-5 s attacks see only 40-50 good calls on busy CI machines,
        # where a few slow ones are noise: half, which still fails the
        # starvation these defences stopped (15-17% OK before them).
        self.served_during = 0.99 if full else 0.5
        self.lame_duck_seconds = 0.5


class Attack:
    """One row of the table: an attacks.py command (or another program), the
    kind of good call measured beside it, and what the server needs for it."""

    def __init__(self, name, label, seconds, args=(), kind="grpc", connections=2,
                 server_flags=(), token=False, program=None, direct_peak_bounded=True,
                 served_on=()):
        self.name, self.label, self.seconds, self.args = name, label, seconds, list(args)
        # The paths on which good calls must be answered during the attack
        # too (Scale.served_during of them OK), not only after it.
        self.served_on = tuple(served_on)
        self.kind, self.connections, self.server_flags = kind, connections, list(server_flags)
        self.token, self.program = token, program
        # False where the peak of a direct attack is gRPC's alone to bound (a
        # flaw of Debian's gRPC 1.51 that no option of ours reaches): the peak
        # is reported, and RSS must come back within the bound (recovery).
        self.direct_peak_bounded = direct_peak_bounded

    def command(self, server):
        if self.program is not None:
            return self.program
        port = server.metrics_port if self.kind == "metrics" else server.port
        return [PYTHON, os.path.join(HERE, "attacks.py"), self.name, "--port", str(port),
                "--seconds", str(self.seconds), *self.args]


def attacks(scale):
    full = scale.full
    wrong_token = "not-a-valid-token"
    slow = (["--streams", "40", "--send_mib", "30", "--rate_mib", "128"] if full else
            ["--streams", "32", "--send_mib", "24", "--rate_mib", "256"])
    out = []
    if full:
        out += [Attack("baseline", "no attack (comparison)", 10, program=["/bin/sleep", "10"]),
                Attack("cpu_load", "one core busy, no attack (comparison: stress-ng --cpu 1)", 10,
                       program=["/usr/bin/stress-ng", "--cpu", "1", "--timeout", "10s", "--quiet"])]
    flood = scale.nofile + 256
    out += [
        Attack("idle_flood", f"idle TCP connections: {flood} against an fd limit of {scale.nofile}",
               20 if full else 4, ["--connections", str(flood)], connections=flood,
               served_on=("proxy",)),
        Attack("rapid_reset",
               f"HTTP/2 rapid reset: 2 connections, {'15000' if full else '5000'} streams/s",
               15 if full else 4, ["--connections", "2", "--rate", "15000" if full else "5000"],
               # CVE-2023-44487, unpatched in gRPC 1.51: a server short of CPU
               # falls behind the resets and its memory grows meanwhile.
               direct_peak_bounded=False),
        Attack("slow_bodies",
               f"slow bodies: {slow[1]} streams declaring 60 MiB, {slow[3]} MiB sent each",
               15 if full else 5, slow, connections=8, served_on=("proxy",)),
        Attack("slow_bodies", "slow bodies as above, --auth_tokens_file set, wrong token",
               15 if full else 5, slow + ["--token", wrong_token], connections=8, token=True,
               served_on=("proxy",)),
        Attack("huge_header", f"one {'64' if full else '4'} MiB header literal",
               20 if full else 5, ["--size_mib", "64" if full else "4"], connections=1),
        Attack("padded_varint", f"HPACK integer padded to {'4' if full else '1'} MiB",
               20 if full else 5, ["--size_mib", "4" if full else "1"], connections=1),
        Attack("continuation_flood",
               f"CONTINUATION flood: {'16' if full else '4'} MiB, header block never ended",
               20 if full else 5, ["--size_mib", "16" if full else "4"], connections=1),
        Attack("metrics_slowloris",
               "/metrics slowloris: 128 connections held (reopened when closed), a header line/s each",
               20 if full else 5, ["--connections", "128"], kind="metrics", connections=128,
               served_on=("direct",)),
        Attack("metrics_huge_headers",
               f"/metrics huge headers: {'16' if full else '4'} MiB header line, 4 at a time",
               20 if full else 5,
               ["--size_mib", "16" if full else "4", "--requests", "32" if full else "8"],
               kind="metrics", connections=4),
    ]
    return out


class ServerProcess:
    """attnserve on 127.0.0.1 free ports under an open-file limit of nofile
    (soft and hard), its stderr kept (the last lines) and scanned for its ports."""

    def __init__(self, binary, flags, nofile):
        def limit_files():
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([binary, *flags], stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, preexec_fn=limit_files)
        self.pid = self.proc.pid
        self.port = self.metrics_port = None
        self.tail = collections.deque(maxlen=40)
        self.lines = 0
        self.emfile_lines = 0
        self.watchdog_line = None  # (time.monotonic(), the watchdog's log line) once it trips
        ports = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines += 1
                self.tail.append(line.rstrip("\n"))
                self.emfile_lines += "Too many open files" in line
                if self.watchdog_line is None and "watchdog: " in line:
                    self.watchdog_line = (time.monotonic(), line.strip())
                m = re.search(r"listening on port (\d+)", line)
                if m:
                    self.port = int(m.group(1))
                m = re.search(r"metrics on port (\d+)", line)
                if m:
                    self.metrics_port = int(m.group(1))
                if self.port and self.metrics_port:
                    ports.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 60
        while not ports.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("attnserve did not start:\n" + "\n".join(self.tail))
        self.target = f"127.0.0.1:{self.port}"

    def sample(self):
        """(VmRSS KiB, open fds, CPU seconds), or None once the process is gone."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return rss, fds, cpu
        except (OSError, StopIteration, IndexError, ValueError):
            return None

    def exit_code(self):
        return self.proc.poll()

    def terminate(self, timeout):
        """SIGTERM; (exit code or None if still running after timeout, seconds)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - start

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Monitor:
    """Samples a server every 50 ms in a thread: [(t, rss KiB, fds, cpu s)]."""

    def __init__(self, server):
        self.server, self.samples = server, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            s = self.server.sample()
            if s is None:
                return
            self.samples.append((time.monotonic(), *s))
            self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def latest(self):
        return self.samples[-1] if self.samples else None

    def window(self, t0, t1):
        return [s for s in self.samples if t0 <= s[0] <= t1]


class GoodCalls:
    """good_client.py in its own process; its results as they come."""

    def __init__(self, kind, target, scale, stubs, seed, token):
        cmd = [PYTHON, os.path.join(HERE, "good_client.py"), "--kind", kind, "--target", target,
               "--rate", str(scale.good_rate), "--deadline", str(scale.deadline),
               "--max_seconds", "900"]
        if kind == "grpc":
            cmd += ["--stubs", stubs, "--seed", str(seed)]
        if token:
            cmd += ["--token", token]
        self.deadline = scale.deadline
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.results = []  # (start, latency, code)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            r = json.loads(line)
            self.results.append((r["t"], r["lat"], r["code"]))

    def started_between(self, t0, t1):
        return sorted(r for r in list(self.results) if t0 <= r[0] < t1)

    def stop(self):
        """Closes its stdin; it finishes its calls (each within its deadline)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=self.deadline + 15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_FLAGS = {}


def server_flags(binary):
    """The --flags the server binary knows (from its --help), each once."""
    if binary not in _FLAGS:
        text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
        _FLAGS[binary] = set(re.findall(r"^\s+(--[a-z0-9_]+)", text, re.M))
    return _FLAGS[binary]


def first_recovered_call(calls, window):
    """Start time of the first OK call from which every call started within
    `window` seconds was OK (and that window is complete), or None."""
    failures = [t for t, _, code in calls if code != "OK"]
    if not calls:
        return None
    last = calls[-1][0]
    for t, _, code in calls:
        if t + window > last:
            return None
        if code != "OK":
            continue
        next_failure = bisect.bisect_left(failures, t)
        if next_failure == len(failures) or failures[next_failure] > t + window:
            return t
    return None


def p99(calls):
    lat = sorted(lat for _, lat, code in calls if code == "OK")
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None


def ok_rate(calls):
    return sum(code == "OK" for _, _, code in calls) / len(calls) if calls else None


def codes_of(calls):
    counts = collections.Counter(code for _, _, code in calls if code != "OK")
    return ", ".join(f"{n} {c}" for c, n in counts.most_common(3))


def server_command_flags(attack, scale, binary, seed, token_file):
    flags = ["--listen_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
             f"--builtin_model_seed={seed}", f"--max_inflight_bytes={scale.inflight_bytes}",
             f"--max_transport_bytes={scale.transport_bytes}", f"--min_open_files={scale.nofile}",
             "--watchdog_interval_seconds=1", "--watchdog_failures=3",
             f"--lame_duck_seconds={scale.lame_duck_seconds}",
             f"--drain_timeout_seconds={scale.drain_seconds}", *attack.server_flags,
             *ARGS.server_flag]
    if not attack.direct_peak_bounded:
        # As the shipped manifests do: memory past this for 3 s ends the
        # process (exit 3) for its supervisor to restart, where gRPC 1.51
        # alone would keep it (a direct rapid reset). Only here: elsewhere the
        # RSS bound is ours to keep, and an exit would hide a breach of it.
        flags.append(f"--max_rss_bytes={scale.max_rss_bytes}")
    if token_file:
        flags.append(f"--auth_tokens_file={token_file}")
    # A server from before a defence existed lacks its flag: run it without.
    return [f for f in flags if f.split("=", 1)[0] in server_flags(binary)]


def start_proxy(server):
    """The shipped HAProxy in front of the server, its replica UP."""
    sys.path.insert(0, os.path.dirname(PROXY_RUNNER))
    from haproxy_runner import HAProxy
    proxy = HAProxy(REPO, [server.target])
    proxy.wait_replicas_up(1)
    return proxy


def launch_attack(attack, server, proxy, row):
    """Runs the attacker to its end (killed if it overruns by 60 s); its
    summary goes in the row. Through the proxy it connects from 127.0.0.2 (the
    idle flood from 64 addresses on), so the proxy's per-address limits meet
    the attacker, not the good client."""
    command = attack.command(server)
    if proxy is not None and attack.program is None:
        port = command.index("--port") + 1
        command[port] = str(proxy.port)
        command += ["--source", "127.0.0.2"]
        if attack.name == "idle_flood":  # many clients: the proxy's per-address limit is not all
            command += ["--sources", "64"]
    attacker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    try:
        out, err = attacker.communicate(timeout=attack.seconds + 60)
    except subprocess.TimeoutExpired:
        attacker.kill()
        out, err = attacker.communicate()
        row["notes"].append("the attacker overran its time and was killed")
    lines = out.strip().splitlines()
    if attack.program is not None:
        row["attacker"] = " ".join(attack.program)
    else:
        row["attacker"] = lines[-1] if lines else f"(no summary; stderr: {err.strip()[-300:]})"


def wait_recovery(server, good, monitor, t_end, rss_bound, idle_fds, scale):
    """The time good calls (started after t_end) succeed again (all of them
    for RECOVERED_WINDOW seconds) and RSS and fds are back within bounds; None
    if not within the recovery wait or the server exits."""
    memory_ok_at = None
    deadline = t_end + scale.recovery_wait
    while time.monotonic() < deadline and server.exit_code() is None:
        s = monitor.latest()
        if memory_ok_at is None and s and s[0] > t_end and s[1] * 1024 <= rss_bound \
                and s[2] <= idle_fds + 32:
            memory_ok_at = s[0]
        calls_ok_at = first_recovered_call(good.started_between(t_end, float("inf")),
                                           RECOVERED_WINDOW)
        if calls_ok_at is not None and memory_ok_at is not None:
            return max(calls_ok_at, memory_ok_at)
        time.sleep(0.1)
    return None


def run_attack(attack, path, scale, binary, stubs, health):
    """Runs one attack and returns its row (a dict), the verdict included."""
    import grpc
    seed = random.randrange(2**63)
    token, tmp = "", tempfile.TemporaryDirectory()
    token_file = None
    if attack.token:
        token = "%032x" % random.getrandbits(128)
        token_file = os.path.join(tmp.name, "tokens")
        with open(token_file, "w") as f:
            f.write(token + "\n")
    flags = server_command_flags(attack, scale, binary, seed, token_file)
    row = {"attack": attack.label, "path": path, "problems": [], "notes": []}
    server = good = monitor = proxy = None
    try:
        server = ServerProcess(binary, flags, scale.nofile)
        channel = grpc.insecure_channel(server.target)
        wait_serving(health[1].HealthStub(channel), health[0])
        channel.close()
        if path == "proxy":
            proxy = start_proxy(server)
        target = (f"127.0.0.1:{server.metrics_port}" if attack.kind == "metrics" else
                  proxy.address if proxy else server.target)
        good = GoodCalls(attack.kind, target, scale, stubs, seed, token)
        wait_until("the first good calls",
                   lambda: sum(c == "OK" for _, _, c in good.results) >= 5, 120)
        idle = []
        for _ in range(10):  # the idle level: the most over half a second of good calls
            idle.append(server.sample())
            time.sleep(0.05)
        idle_rss = max(s[0] for s in idle if s) * 1024
        idle_fds = max(s[1] for s in idle if s)
        rss_bound = 1.5 * idle_rss + scale.inflight_bytes
        fds_bound = idle_fds + attack.connections + 64
        row.update(idle_rss=idle_rss, idle_fds=idle_fds, rss_bound=rss_bound)
        monitor = Monitor(server)

        t_attack = time.monotonic()
        launch_attack(attack, server, proxy, row)
        t_end = time.monotonic()
        row["attack_seconds"] = t_end - t_attack
        if proxy is not None:
            row["notes"].append(f"proxy's connections to attnserve at the attack's end: "
                                f"{sum(proxy.upstream_connections().values())}")
        recovered_at = wait_recovery(server, good, monitor, t_end, rss_bound, idle_fds, scale)
        after_end = (recovered_at or time.monotonic()) + scale.after_seconds
        while time.monotonic() < after_end and server.exit_code() is None:
            time.sleep(0.1)
        after_end = min(after_end, time.monotonic())
        good.stop()
        monitor.stop()
        if proxy is not None and not proxy.running():
            row["problems"].append("the proxy exited")

        during = good.started_between(t_attack, t_end)
        after = good.started_between(t_end, after_end)
        settled = good.started_between(recovered_at, after_end) if recovered_at else []
        samples = monitor.samples
        attack_samples = monitor.window(t_attack, t_end)
        row.update(
            ok_during=ok_rate(during), ok_after=ok_rate(after), p99_during=p99(during),
            p99_after=p99(after), failed_during=codes_of(during), failed_after=codes_of(after),
            peak_rss=max(s[1] for s in samples) * 1024 if samples else None,
            rss_after=samples[-1][1] * 1024 if samples else None,
            peak_fds=max(s[2] for s in samples) if samples else None,
            fds_after=samples[-1][2] if samples else None,
            cpu_attack=(attack_samples[-1][3] - attack_samples[0][3]) if len(attack_samples) > 1
            else None,
            recovery=(recovered_at - t_end) if recovered_at else None)
        peak_bounded = path == "proxy" or attack.direct_peak_bounded
        if path in attack.served_on and during and ok_rate(during) < scale.served_during:
            row["problems"].append(f"only {ok_rate(during):.1%} of good calls OK during the attack "
                                   f"(at least {scale.served_during:.0%} required: "
                                   f"{codes_of(during)})")
        judge_end(row, server, scale, rss_bound, fds_bound, settled, t_attack, peak_bounded)
    except Exception as e:  # noqa: BLE001 -- a broken run is a failed row, the others still run
        row["problems"].append(f"the run broke: {e.__class__.__name__}: {e}")
    finally:
        for p in (good, server):
            if p is not None:
                p.kill()
        if monitor is not None:
            monitor.stop()
        if proxy is not None:
            proxy.cleanup()
        tmp.cleanup()
    row["verdict"] = ("FAILED: " + "; ".join(row["problems"]) if row["problems"] else
                      "exited 3 (watchdog)" if row.get("exit") == WATCHDOG_EXIT else
                      "survived, peak RSS over the bound" if row.get("peak_over") else "survived")
    return row


def judge_end(row, server, scale, rss_bound, fds_bound, settled, t_attack, peak_bounded):
    """The server's end: exited (only the watchdog's code passes) or alive
    (the bounds, then SIGTERM must exit 0 within the drain)."""
    code = server.exit_code()
    if code is not None:
        row["exit"] = code
        if code == WATCHDOG_EXIT:
            row["notes"].append(f"exited {code} (watchdog), {row['attack_seconds']:.0f} s attack")
            if server.watchdog_line:
                t, line = server.watchdog_line
                row["notes"].append(f"{t - t_attack:.1f} s after the attack began: "
                                    f"{line.split('attnserve: ', 1)[-1]}")
        else:
            row["problems"].append(f"exited {code} (not the watchdog's {WATCHDOG_EXIT})")
    else:
        judge_alive(row, scale, rss_bound, fds_bound, settled, peak_bounded)
        code, took = server.terminate(scale.lame_duck_seconds + scale.drain_seconds + 10)
        row["sigterm"] = (code, took)
        if code != 0:
            row["problems"].append(
                f"SIGTERM: {'still running' if code is None else f'exit {code}'} after "
                f"{took:.0f} s (lame duck {scale.lame_duck_seconds:g} s + drain "
                f"{scale.drain_seconds:g} s + 10)")
    if server.emfile_lines:
        row["notes"].append(f"server logged 'Too many open files' {server.emfile_lines} times")
    if row["problems"]:
        row["notes"].append("server log tail: " + " | ".join(list(server.tail)[-5:]))


def judge_alive(row, scale, rss_bound, fds_bound, settled, peak_bounded):
    """The bounds a server that stayed alive must have kept (row's problems)."""
    if row["recovery"] is None:
        latest = f"RSS {row['rss_after'] / MIB:.0f} MiB (bound {rss_bound / MIB:.0f}), " \
                 f"{row['fds_after']} fds" if row["rss_after"] else "no sample"
        row["problems"].append(
            f"alive but not recovered {scale.recovery_wait:.0f} s after the attack (good calls "
            f"after it: {row['failed_after'] or 'too few OK in a row'}; {latest})")
    if row["peak_rss"] is not None and row["peak_rss"] > rss_bound:
        over = f"peak RSS {row['peak_rss'] / MIB:.0f} MiB over the bound {rss_bound / MIB:.0f} MiB"
        if peak_bounded:
            row["problems"].append(over)
        else:
            row["peak_over"] = True
            row["notes"].append(over + " (gRPC 1.51's to bound; not asserted)")
    if row["peak_fds"] is not None and row["peak_fds"] > fds_bound:
        row["problems"].append(f"peak fds {row['peak_fds']} over {fds_bound}")
    if row["recovery"] is not None and settled and ok_rate(settled) < 0.95:
        row["problems"].append(f"after recovery only {ok_rate(settled):.0%} of good calls OK "
                               f"({codes_of(settled)})")


def fmt_rate(x):
    return "-" if x is None else f"{x:.1%}"


def fmt_ms(x):
    return "-" if x is None else f"{x * 1000:.1f} ms"


def fmt_mib(x):
    return "-" if x is None else f"{x / MIB:.0f}"


def compare_p99s(rows):
    """The full form's latency target: where good calls must be served during
    an attack, their p99 during and after it within P99_FACTOR x the p99 of
    the run with one core busy and no attack, on the same path."""
    loaded = {r["path"]: r for r in rows if r.get("name") == "cpu_load"}
    for row in rows:
        reference = loaded.get(row["path"])
        if not row.get("served") or reference is None or not reference.get("p99_during"):
            continue
        limit = P99_FACTOR * max(reference["p99_during"], reference["p99_after"] or 0)
        for when in ("during", "after"):
            value = row.get(f"p99_{when}")
            if value is not None and value > limit:
                row["problems"].append(f"p99 {when} {value * 1e3:.0f} ms over {P99_FACTOR} x the "
                                       f"loaded run's ({limit * 1e3:.0f} ms)")
                row["verdict"] = "FAILED: " + "; ".join(row["problems"])


def print_table(rows, full):
    head = ["attack", "path", "OK during", "OK after"]
    if full:
        head += ["p99 during", "p99 after"]
    head += ["peak RSS MiB (bound)", "RSS after", "peak fds", "server CPU-s in attack",
             "recovery", "verdict"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = [r["attack"], r["path"], fmt_rate(r.get("ok_during")), fmt_rate(r.get("ok_after"))]
        if full:
            cells += [fmt_ms(r.get("p99_during")), fmt_ms(r.get("p99_after"))]
        rec = r.get("recovery")
        cells += [f"{fmt_mib(r.get('peak_rss'))} ({fmt_mib(r.get('rss_bound'))})",
                  fmt_mib(r.get("rss_after")), str(r.get("peak_fds", "-")),
                  "-" if r.get("cpu_attack") is None else f"{r['cpu_attack']:.1f}",
                  "-" if rec is None else f"{rec:.1f} s", r["verdict"]]
        print("| " + " | ".join(cells) + " |")
    print()
    for r in rows:
        failed = "; ".join(f"{w}: {r[k]}" for w, k in (("failed during", "failed_during"),
                                                          ("failed after", "failed_after"))
                           if r.get(k))
        print(f"- {r['attack']} ({r['path']}): attacker {r.get('attacker', '-')}"
              + (f"; good calls {failed}" if failed else "")
              + "".join(f"; {n}" for n in r["notes"]))
    sys.stdout.flush()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--full", action="store_true", help="longer attacks, the table with p99s")
    parser.add_argument("--only", default="",
                        help="run the attacks whose name or description matches this regex")
    parser.add_argument("--server_flag", action="append", default=[],
                        help="one more flag for every server started (repeatable)")
    parser.add_argument("--paths", default="direct,proxy",
                        help="direct, proxy or both (proxy: when the tree has its launcher)")
    ARGS = parser.parse_args()
    paths = [p for p in ARGS.paths.split(",") if p == "direct" or os.path.exists(PROXY_RUNNER)]
    scale = Scale(ARGS.full)
    # The attacker and the good client hold many sockets; they inherit this limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rows = []
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, ARGS.proto_dir)
        import health_pb2
        import health_pb2_grpc
        started = time.monotonic()
        for attack in attacks(scale):
            if ARGS.only and not re.search(ARGS.only, f"{attack.name} {attack.label}"):
                continue
            for path in paths:
                if path == "proxy" and attack.kind == "metrics":
                    continue  # the proxy does not carry the metrics port
                t0 = time.monotonic()
                row = run_attack(attack, path, scale, ARGS.server, stubs,
                                 (health_pb2, health_pb2_grpc))
                row["served"] = path in attack.served_on
                row["name"] = attack.name
                rows.append(row)
                print(f"{attack.label}, {path} ({time.monotonic() - t0:.0f} s): {row['verdict']}",
                      flush=True)
    compare_p99s(rows)
    print_table(rows, ARGS.full)
    wanted = {"--max_inflight_bytes", "--max_transport_bytes", "--min_open_files",
              "--watchdog_interval_seconds", "--watchdog_failures"}
    missing = sorted(wanted - server_flags(ARGS.server))
    if missing:
        print(f"this server has no {', '.join(missing)}: run without them")
    if "proxy" in ARGS.paths and not os.path.exists(PROXY_RUNNER):
        print("proxy path: not run (tests/deploy/haproxy_runner.py is not in the tree yet)")
    print(f"{len(rows)} attacks in {time.monotonic() - started:.0f} s on "
          f"{cpu_model()}, {time.strftime('%Y-%m-%d')}")
    passed = sum(not r["problems"] for r in rows)
    print(f"{passed} passed, {len(rows) - passed} failed")
    return 0 if passed == len(rows) else 1


def cpu_model():
    with open("/proc/cpuinfo") as f:
        info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
    return (f"{info['model name'].strip()} (family {info['cpu family'].strip()}, model "
            f"{info['model'].strip()}), {os.cpu_count()} vCPUs")


ARGS = None

if __name__ == "__main__":
    sys.exit(main())
