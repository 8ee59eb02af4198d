#!/usr/bin/python3
"""A newcomer's first command, as the README writes it.

Reads the first command of the README's first code block (the serve command),
runs it from the repository's root exactly as written -- it installs what is
missing, builds and starts the server -- adding only loopback gRPC and metrics
addresses on free ports (read back from its log). Then waits for health
SERVING, makes one Attend call on the built-in model (checked against a NumPy
float64 reference of its documented seeded weights), runs the README's Python
client steps as written (a virtual environment where it says, the attnserve
package pip-installed into it offline, the program run by its interpreter;
only the address changed), scrapes /metrics once,
sends SIGTERM and requires exit status 0. `--help` on the same command must
answer at once, before and after the build, without installing or building.
Prints the time to SERVING, with the script's own split into package check
and build.

deploy/test.sh runs this on the clean checkout (CI); it is not a CTest test
because it builds a tree of its own (build-serve/, Release, as users get it).

Usage: serve_command_test.py --repo REPO [--timeout_minutes 60]
"""
import argparse
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
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (run_tests_with_stubs, metric, parse_exposition, reference_attention, rel_error,  # noqa: E402
                     seeded_weights, wait_serving)

ARGS = None


def readme_serve_command(readme_path):
    """The first command line of the README's first fenced code block, without its comment."""
    with open(readme_path) as f:
        text = f.read()
    block = re.search(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    assert block, "the README has no code block"
    for line in block.group(1).splitlines():
        command = line.split("#", 1)[0].strip()
        if command:
            return command
    raise AssertionError("the README's first code block has no command")


def readme_python_client(readme_path):
    """The README's Python steps: (shell lines that set the package up, packages they install, the line that runs
    client.py, the client program)."""
    with open(readme_path) as f:
        text = f.read()
    section = text[text.index("From Python:"):]
    shell = re.search(r"^```sh\n(.*?)^```", section, re.M | re.S).group(1)
    program = re.search(r"^```python\n(.*?)^```", section, re.M | re.S).group(1)
    shell = re.sub(r"\\\n\s*", "", shell)  # join continuation lines
    lines = [line.strip() for line in shell.splitlines() if line.strip()]
    installs = [line for line in lines if line.startswith("apt-get install")]
    packages = [word for line in installs for word in line.split()[2:] if not word.startswith("-")]
    runs = [line for line in lines if "client.py" in line]
    steps = [line for line in lines if line not in installs and line not in runs]
    return steps, packages, runs, program


class ServeCommand(unittest.TestCase):
    def serve_help(self, command):
        """`<serve command> --help`: exit 0 at once, its own usage, nothing installed or built."""
        build_dir_existed = os.path.exists(os.path.join(ARGS.repo, "build-serve"))
        ran = subprocess.run(shlex.split(command) + ["--help"], cwd=ARGS.repo, capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        self.assertEqual(ran.returncode, 0, ran.stderr)
        self.assertIn("built-in model", ran.stdout)
        self.assertNotIn("install_deps.sh", ran.stdout + ran.stderr, "--help must not install anything")
        self.assertEqual(os.path.exists(os.path.join(ARGS.repo, "build-serve")), build_dir_existed,
                         "--help must not build anything")
        return ran.stdout

    def run_readme_python_client(self, port):
        """Runs the README's Python steps as written: its packages must be installed already (deploy/test.sh
        installs them), its set-up lines run in the repository's root with HOME a fresh folder (the virtual
        environment goes where they say), and its client program, saved as client.py in that folder, runs there by
        the README's own command -- only its address changed to the test's port."""
        steps, packages, runs, program = readme_python_client(os.path.join(ARGS.repo, "README.md"))
        self.assertTrue(packages and steps and len(runs) == 1 and program, "the README's Python section lost a step")
        for package in packages:
            installed = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
            self.assertIn("install ok installed", installed.stdout, f"the README's Python step needs {package}")
        home = tempfile.mkdtemp(prefix="attnserve-readme-home-")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["HOME"] = home
        for step in steps:
            subprocess.run(["bash", "-c", step], cwd=ARGS.repo, env=env, check=True)
        self.assertIn("localhost:50051", program)
        with open(os.path.join(home, "client.py"), "w") as f:
            f.write(program.replace("localhost:50051", f"127.0.0.1:{port}"))
        ran = subprocess.run(["bash", "-c", runs[0]], cwd=home, env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(ran.returncode, 0, ran.stderr)
        self.assertEqual(ran.stdout.strip(), "(2, 16, 768) (2, 12, 16, 16)")

    def test_readme_serve_command_serves_the_builtin_model_and_exits_zero_on_sigterm(self):
        command = readme_serve_command(os.path.join(ARGS.repo, "README.md"))
        self.assertIn("serve", command, f"the README's first command should start the service: {command!r}")
        self.serve_help(command)
        argv = shlex.split(command) + ["--listen_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0"]
        print(f"serve_command_test: running {' '.join(argv)!r} in {ARGS.repo}", flush=True)
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ARGS.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, stdin=subprocess.DEVNULL)
        ports = {}
        listening = threading.Event()
        log = []

        def pump():
            for line in proc.stdout:
                log.append(line)
                sys.stdout.write("  | " + line)
                sys.stdout.flush()
                for key, pattern in (("grpc", r"listening on port (\d+)"), ("metrics", r"metrics on port (\d+)")):
                    m = re.search(pattern, line)
                    if m:
                        ports[key] = int(m.group(1))
                if "grpc" in ports and "metrics" in ports:
                    listening.set()
            listening.set()  # the process ended: stop waiting

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            # Installing and building from nothing takes minutes; the log moves all along.
            listening.wait(ARGS.timeout_minutes * 60)
            if "grpc" not in ports or "metrics" not in ports:
                reader.join(timeout=60)
                self.fail(f"the serve command did not start serving (ports seen: {ports}, exit status "
                          f"{proc.poll()}); its last lines:\n" + "".join(log[-40:]))

            import grpc
            from attnserve.v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
            import health_pb2, health_pb2_grpc
            channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}")
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2, timeout=300)
            to_serving = time.monotonic() - started
            print(f"serve_command_test: SERVING {to_serving:.0f} s after the command started", flush=True)

            stub = pb_grpc.AttentionServiceStub(channel)
            cfg = stub.GetModel(pb.GetModelRequest(name="default"), timeout=60).head_config
            rng = np.random.default_rng()
            x = rng.standard_normal((2, 8, cfg.d_model)).astype("<f4")
            r = stub.Attend(pb.AttendRequest(
                model="default",
                hidden_states=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=x.shape, raw_data=x.tobytes())),
                timeout=120)
            out = np.frombuffer(r.output.raw_data, "<f4").reshape(tuple(r.output.shape))
            # The serve command starts the built-in model with the default seed (0).
            weights = seeded_weights(0, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            ref, _ = reference_attention(x, weights, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.scale)
            self.assertLessEqual(rel_error(out, ref), 1e-5)

            self.run_readme_python_client(ports["grpc"])

            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=60) as page:
                self.assertEqual(page.status, 200)
                samples = parse_exposition(page.read().decode())
            # This test's call and the README client's.
            self.assertEqual(metric(samples, "attnserve_requests_total", method="Attend", code="OK"), 2.0)

            proc.send_signal(signal.SIGTERM)
            self.assertEqual(proc.wait(timeout=120), 0, "attnserve's exit status after SIGTERM")
            # Once the server is built, --help shows its flags too.
            self.assertIn("--listen_address", self.serve_help(command))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(timeout=10)
            proc.stdout.close()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--timeout_minutes", type=float, default=60)
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(os.path.join(ARGS.repo, "proto"), rest)


if __name__ == "__main__":
    main()
