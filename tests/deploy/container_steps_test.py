#!/usr/bin/python3
"""The Dockerfile's steps after the build, run here since CI has no Docker
engine: `cmake --install ... --strip` into the image's prefix (a temporary
folder standing in for /opt/attnserve), then the final stage's ENTRYPOINT and
CMD as the image's USER (when the test runs as root; on loopback and free
ports instead of 0.0.0.0:50051), its HEALTHCHECK command until healthy, and
STOPSIGNAL: the check turns unhealthy while the server drains, and the server
exits 0.

Usage: container_steps_test.py --repo REPO --build_dir BUILD
"""
import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ARGS = None


def dockerfile():
    """What the test needs of the Dockerfile, continuations joined."""
    with open(os.path.join(ARGS.repo, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    final = text[text.rindex("\nFROM "):]
    install = re.search(r"cmake --install (\S+) --prefix (\S+)( --strip)?", text)
    copy = re.search(r"^COPY --from=\S+ (\S+) (\S+)$", final, re.M)
    health = re.search(r"^HEALTHCHECK (.*?)CMD (.*)$", final, re.M)
    return {
        "prefix": install.group(2),
        "strip": bool(install.group(3)),
        "copied": (copy.group(1), copy.group(2)),
        "user": re.findall(r"^USER (\S+)$", final, re.M)[-1],
        "entrypoint": json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", final, re.M).group(1)),
        "cmd": json.loads(re.search(r"^CMD (\[.*\])$", final, re.M).group(1)),
        "healthcheck_options": health.group(1).split(),
        "healthcheck": json.loads(health.group(2)),
        "stopsignal": re.search(r"^STOPSIGNAL (\S+)$", final, re.M).group(1),
    }


def seconds(text):
    m = re.match(r"^([0-9.]+)(ms|s|m)$", text)
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60}[m.group(2)]


class ContainerSteps(unittest.TestCase):
    def test_installed_binaries_serve_as_the_image_user_and_pass_the_healthcheck(self):
        d = dockerfile()
        self.assertEqual(d["copied"], (d["prefix"], d["prefix"]), "the runtime stage copies the install prefix")
        work = tempfile.mkdtemp(prefix="attnserve-image-")
        os.chmod(work, 0o755)  # the image user must reach the binaries
        prefix = work + d["prefix"]
        install = ["cmake", "--install", ARGS.build_dir, "--prefix", prefix] + (["--strip"] if d["strip"] else [])
        done = subprocess.run(install, capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        installed = sorted(os.path.relpath(os.path.join(r, f), prefix) for r, _, fs in os.walk(prefix) for f in fs)
        self.assertEqual(installed, ["bin/attnctl", "bin/attnserve"])
        for p in [work] + [os.path.join(work, *d["prefix"].strip("/").split("/")[:n])
                           for n in range(1, len(d["prefix"].strip("/").split("/")) + 1)]:
            os.chmod(p, 0o755)

        def in_image(command):
            """A command of the image, with its paths under the temporary prefix,
            run as the image's USER when we are root."""
            command = [c.replace(d["prefix"], prefix, 1) if c.startswith(d["prefix"]) else c for c in command]
            if os.getuid() == 0:
                uid, _, gid = d["user"].partition(":")
                return ["setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups"] + command
            return command

        # The image serves on 0.0.0.0:50051 and :9464; the test on free loopback ports.
        args = [a for a in d["cmd"] if not a.startswith(("--listen_address=", "--metrics_address="))]
        self.assertEqual(len(args), len(d["cmd"]) - 2, d["cmd"])
        server_cmd = in_image(d["entrypoint"] + args + [
            "--listen_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0", "--compute_threads=1",
            "--lame_duck_seconds=2"])
        server = subprocess.Popen(server_cmd, stderr=subprocess.PIPE, text=True)
        lines = []

        def pump():
            for line in server.stderr:
                lines.append(line)
                sys.stderr.write("  [attnserve] " + line)

        pump_thread = threading.Thread(target=pump, daemon=True)
        pump_thread.start()
        try:
            deadline = time.monotonic() + 120  # generous: the machine may be busy
            port = None
            while port is None and time.monotonic() < deadline and server.poll() is None:
                for line in list(lines):
                    m = re.search(r"listening on port (\d+)", line)
                    if m:
                        port = int(m.group(1))
                time.sleep(0.02)
            self.assertIsNotNone(port, "".join(lines))
            if os.getuid() == 0:
                with open(f"/proc/{server.pid}/status") as f:
                    uid_line = [l for l in f if l.startswith("Uid:")][0]
                self.assertEqual(uid_line.split()[1], d["user"].split(":")[0], "the server runs as the image user")

            health = [c if not c.startswith("--target=") else f"--target=127.0.0.1:{port}" for c in d["healthcheck"]]
            self.assertNotEqual(health, d["healthcheck"], "HEALTHCHECK names no --target")
            options = dict(o[2:].split("=", 1) for o in d["healthcheck_options"])
            timeout = seconds(options.get("timeout", "30s"))
            start_period = seconds(options.get("start-period", "0s"))

            def check():
                r = subprocess.run(in_image(health), capture_output=True, text=True, timeout=timeout + 5)
                return r.returncode, (r.stdout + r.stderr).strip()

            deadline = time.monotonic() + max(start_period, 120)
            code, out = check()
            while code != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
                code, out = check()
            self.assertEqual((code, out), (0, "SERVING"), f"HEALTHCHECK {shlex.join(health)}")

            server.send_signal(getattr(signal, d["stopsignal"]))
            # Unhealthy from the signal on (NOT_SERVING in the lame duck, then gone); generous on a busy machine.
            deadline = time.monotonic() + 60
            code, out = check()
            while code == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
                code, out = check()
            self.assertNotEqual(code, 0, "HEALTHCHECK still passes while the server drains")
            self.assertEqual(server.wait(timeout=40), 0, "".join(lines))
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            pump_thread.join(timeout=5)
            server.stderr.close()
            subprocess.run(["rm", "-rf", work], check=False)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--build_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
