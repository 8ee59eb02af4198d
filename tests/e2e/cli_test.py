#!/usr/bin/python3
"""The command lines of the real attnserve and attnctl binaries: --help (exit
0, no build machine paths), usage mistakes (exit 2, naming the flag), failed
calls and starts (exit 1), --version (the one version source, the git
revision, the build type, the libraries; the same in the server's log and
attnserve_build_info), --json of attend and models (checked against what the
server answers Python's grpcio), NumPy float64 input converted to float32, and
messages over a size limit named by their flag.

Usage: cli_test.py --server PATH/attnserve --attnctl PATH/attnctl
                   --proto_dir REPO/proto --repo REPO --build_type TYPE
"""
import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
import unittest.mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, metric, reference_attention, rel_error, run_tests_with_stubs,  # noqa: E402
                     seeded_weights, wait_serving)

ARGS = None


def run(binary, *args, timeout=120, env=None):
    """Runs a binary; (exit code, stdout, stderr)."""
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    return done.returncode, done.stdout, done.stderr


def version_fields(text):
    """{"program": ..., "version": ..., key: value...} of a --version text."""
    lines = text.splitlines()
    program, version = lines[0].split(" ")
    fields = {"program": program, "version": version}
    for line in lines[1:]:
        key, _, value = line.partition(": ")
        fields[key] = value
    return fields


def project_version():
    """The version the top-level CMakeLists.txt's project() declares."""
    with open(os.path.join(ARGS.repo, "CMakeLists.txt")) as f:
        m = re.search(r"project\(attnserve\s+VERSION\s+([0-9.]+)", f.read())
    assert m, "no project(attnserve VERSION ...) in CMakeLists.txt"
    return m.group(1)


def free_port():
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(server):
    import grpc
    import health_pb2
    import health_pb2_grpc
    with grpc.insecure_channel(server.target) as channel:
        wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
    return server


class Help(unittest.TestCase):
    def check_help(self, binary, *args):
        code, out, err = run(binary, *args)
        self.assertEqual(code, 0, err)
        self.assertIn("Usage:", out)
        self.assertIn("--max_receive_message_bytes", out)
        self.assertIn("--version", out)
        # Flags are not grouped under the build machine's source files.
        self.assertNotIn("Flags from", out)
        self.assertNotIn(os.path.realpath(ARGS.repo), out)
        self.assertIsNone(re.search(r"\S+\.(cc|h)\b", out), out)
        return out

    def test_help_exits_zero_and_names_no_source_path(self):
        for flag in ["--help", "-help", "-h", "--helpfull"]:
            with self.subTest(binary="attnserve", flag=flag):
                out = self.check_help(ARGS.server, flag)
                self.assertIn("--listen_address (default \"0.0.0.0:50051\")", out)
            with self.subTest(binary="attnctl", flag=flag):
                out = self.check_help(ARGS.attnctl, flag)
                self.assertIn("--target (default \"localhost:50051\")", out)
        out = self.check_help(ARGS.attnctl, "help")
        self.assertIn("Commands:", out)
        # --help after a command and next to a mistake still helps.
        self.check_help(ARGS.attnctl, "attend", "--no_such_flag", "--help")
        self.check_help(ARGS.server, "--max_batch=lots", "--help")


class UsageErrors(unittest.TestCase):
    def check_usage_error(self, binary, args, *expected):
        code, out, err = run(binary, *args)
        self.assertEqual(code, 2, f"{binary} {args}: {out}{err}")
        self.assertEqual(out, "", "usage errors go to stderr")
        for text in expected:
            self.assertIn(text, err)
        self.assertIn("--help", err)

    def test_unknown_flags_exit_two_naming_the_flag(self):
        self.check_usage_error(ARGS.server, ["--max_recieve_message_bytes=5"],
                               "unknown flag --max_recieve_message_bytes",
                               "did you mean --max_receive_message_bytes?")
        self.check_usage_error(ARGS.attnctl, ["models", "--taget=127.0.0.1:1"],
                               "unknown flag --taget", "did you mean --target?")
        self.check_usage_error(ARGS.attnctl, ["attend", "--xyzzy"], "unknown flag --xyzzy")

    def test_bad_values_exit_two_naming_the_flag(self):
        self.check_usage_error(ARGS.server, ["--max_batch=lots"], "--max_batch: bad value 'lots'")
        self.check_usage_error(ARGS.server, ["--access_log=maybe"], "--access_log: bad value")
        self.check_usage_error(ARGS.server, ["--openmp_spin_us=-5"],
                               "--openmp_spin_us must be 0 to 100000, not -5")
        self.check_usage_error(ARGS.attnctl, ["attend", "--batch=two"], "--batch: bad value 'two'")
        self.check_usage_error(ARGS.attnctl, ["models", "--target"], "--target needs a value")
        self.check_usage_error(ARGS.attnctl, ["models", "--version=3"], "--version takes no value")
        self.check_usage_error(ARGS.attnctl, ["models", "--nojson=1"], "--nojson takes no value")
        # Values that parse but cannot work, found before any call (nothing
        # listens on the target: a call would fail with exit 1 instead).
        target = f"--target=127.0.0.1:{free_port()}"
        self.check_usage_error(ARGS.attnctl, ["attend", target, "--maps=sideways"], "maps")
        self.check_usage_error(ARGS.attnctl, ["attend", target, "--repeat=0"], "--repeat")
        self.check_usage_error(ARGS.attnctl, ["models", target, "--lb_policy=random"], "lb_policy")
        self.check_usage_error(ARGS.attnctl, ["models", target, "--max_receive_message_bytes=0"],
                               "max_receive_message_bytes")

    def test_an_unknown_block_kernels_value_exits_two_naming_the_variable(self):
        # Read once at start-up, before anything listens.
        code, out, err = run(ARGS.server, "--listen_address=127.0.0.1:0",
                             "--metrics_address=127.0.0.1:0",
                             env={**os.environ, "ATTNSERVE_BLOCK_KERNELS": "fastest"})
        self.assertEqual(code, 2, out + err)
        self.assertIn("ATTNSERVE_BLOCK_KERNELS", err)
        self.assertIn('"fastest"', err)

    def test_bad_arguments_exit_two(self):
        self.check_usage_error(ARGS.server, ["serve"], "unexpected argument 'serve'")
        self.check_usage_error(ARGS.attnctl, [], "no command")
        self.check_usage_error(ARGS.attnctl, ["frobnicate"], "unknown command 'frobnicate'")
        self.check_usage_error(ARGS.attnctl, ["models", "extra"], "unexpected argument 'extra'")
        self.check_usage_error(ARGS.attnctl, ["session"], "session: which?", "extend")
        self.check_usage_error(ARGS.attnctl, ["session", "reopen"], "unknown verb 'reopen'")
        self.check_usage_error(ARGS.attnctl, ["session", "get", "now"],
                               "unexpected argument 'now'")
        # Flags that do not fit the verb, found before any call (nothing listens).
        target = f"--target=127.0.0.1:{free_port()}"
        for args, flag in [(["session", "get"], "--session_id"),
                           (["session", "extend", "--session_id=ab"], "--tokens"),
                           (["session", "extend", "--session_id=ab", "--tokens=2",
                             "--input=x.npy"], "--tokens"),
                           (["session", "truncate", "--session_id=ab"], "--length"),
                           (["session", "get", "--session_id=ab", "--tokens=2"], "--tokens"),
                           (["session", "get", "--session_id=ab", "--max_tokens=5"], "--max_tokens"),
                           (["session", "fork", "--session_id=ab", "--kv_dtype=bf16"], "--kv_dtype"),
                           (["session", "close", "--session_id=ab", "--precision=bf16"], "--precision"),
                           (["session", "get", "--session_id=ab", "--stats"], "--stats"),
                           (["session", "get", "--session_id=ab", "--save_maps=m.npy"],
                            "--save_maps"),
                           (["session", "open", "--model="], "--model"),
                           (["session", "open", "--kv_dtype=fp8"], "--kv_dtype")]:
            self.check_usage_error(ARGS.attnctl, [*args, target], flag)


class FailedWork(unittest.TestCase):
    def test_a_failed_call_exits_one(self):
        code, out, err = run(ARGS.attnctl, "models", f"--target=127.0.0.1:{free_port()}",
                             "--timeout_seconds=5", "--max_attempts=1")
        self.assertEqual(code, 1, out + err)
        self.assertRegex(err, r"^attnctl: (UNAVAILABLE|DEADLINE_EXCEEDED)")

    def test_a_server_that_cannot_start_exits_one(self):
        code, out, err = run(ARGS.server, "--listen_address=127.0.0.1:0",
                             "--metrics_address=127.0.0.1:0", "--tls_cert=/nonexistent/cert.pem",
                             "--tls_key=/nonexistent/key.pem")
        self.assertEqual(code, 1, out + err)
        self.assertIn("cannot start", err)
        self.assertIn("/nonexistent/cert.pem", err)


class Version(unittest.TestCase):
    def check_version(self, binary, program):
        code, out, err = run(binary, "--version")
        self.assertEqual(code, 0, err)
        self.assertEqual(err, "")
        fields = version_fields(out)
        self.assertEqual(fields["program"], program)
        self.assertEqual(fields["version"], project_version())
        self.assertEqual(fields["build type"], ARGS.build_type or "unknown")
        revision = fields["revision"]
        if shutil.which("git") and subprocess.run(
                ["git", "-C", ARGS.repo, "rev-parse", "--show-toplevel"],
                capture_output=True).returncode == 0:
            # Built from this checkout: a commit of it (HEAD may have moved on
            # since the build), "-dirty" when tracked files had changed.
            m = re.fullmatch(r"([0-9a-f]{12})(-dirty)?", revision)
            self.assertIsNotNone(m, revision)
            self.assertEqual(subprocess.run(
                ["git", "-C", ARGS.repo, "merge-base", "--is-ancestor", m.group(1), "HEAD"]
            ).returncode, 0, f"{revision} is not a commit of this checkout")
        else:
            self.assertEqual(revision, "unknown")
        grpc_version = fields["gRPC"]
        self.assertRegex(grpc_version, r"^\d+\.\d+\.\d+$")
        if shutil.which("pkg-config"):
            installed = subprocess.run(["pkg-config", "--modversion", "grpc++"],
                                       capture_output=True, text=True)
            if installed.returncode == 0:
                self.assertEqual(grpc_version, installed.stdout.strip())
        return fields

    def test_attnserve_chooses_the_openmp_wait_before_libgomp_reads_it(self):
        """The running process' environment holds what its log says: a spin count
        for --openmp_spin_us, PASSIVE for 0, and the environment's own choice."""
        def started(*flags, env=None):
            server = serving(Server(ARGS.server, *flags, env=env))
            try:
                with open(f"/proc/{server.proc.pid}/environ", "rb") as f:
                    environ = dict(item.decode().split("=", 1)
                                   for item in f.read().split(b"\0") if b"=" in item)
                lines = [line for line in server.log if "OpenMP" in line]
                self.assertEqual(len(lines), 1, server.log)
                return environ, lines[0]
            finally:
                server.stop()
        # Whatever this test's own environment says, the server is to choose.
        clean = {name: value for name, value in os.environ.items()
                 if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "ATTNSERVE_OPENMP_WAIT_CHOICE")}
        for spin_us in (20, 100):
            with self.subTest(spin_us=spin_us):
                with unittest.mock.patch.dict(os.environ, clean, clear=True):
                    environ, line = started(f"--openmp_spin_us={spin_us}")
                count = int(environ["GOMP_SPINCOUNT"])
                m = re.search(r"spin (\d+)us before they sleep .*GOMP_SPINCOUNT=(\d+) at "
                              r"([0-9.]+) ns per spin iteration", line)
                self.assertIsNotNone(m, line)
                self.assertEqual(int(m.group(1)), spin_us)
                self.assertEqual(int(m.group(2)), count)
                # The count is the time over the measured cost, rounded; the log
                # rounds the cost to 0.1 ns, which moves the quotient by up to
                # count * 0.05 / ns.
                ns = max(float(m.group(3)), 1.0)
                self.assertAlmostEqual(count, spin_us * 1000 / ns, delta=1 + count * 0.05 / ns)
                self.assertNotIn("OMP_WAIT_POLICY", environ)
        with unittest.mock.patch.dict(os.environ, clean, clear=True):
            environ, line = started("--openmp_spin_us=0")
        self.assertEqual(environ.get("OMP_WAIT_POLICY"), "PASSIVE")
        self.assertNotIn("GOMP_SPINCOUNT", environ)
        self.assertIn("OMP_WAIT_POLICY=PASSIVE", line)
        with unittest.mock.patch.dict(os.environ, clean, clear=True):
            environ, line = started("--openmp_spin_us=100", env={"GOMP_SPINCOUNT": "7"})
        self.assertEqual(environ.get("GOMP_SPINCOUNT"), "7")
        self.assertNotIn("OMP_WAIT_POLICY", environ)
        self.assertIn("from the environment", line)
        self.assertIn("GOMP_SPINCOUNT 7", line)
        # An environment copied from a running server's carries its first
        # start's reason too: another process's, so not believed.
        with unittest.mock.patch.dict(os.environ, clean, clear=True):
            environ, line = started("--openmp_spin_us=100", env={
                "GOMP_SPINCOUNT": "7", "ATTNSERVE_OPENMP_WAIT_CHOICE": "1 copied from another server"})
        self.assertIn("from the environment", line)
        self.assertNotIn("copied", line)

    def test_attnctl_says_version_revision_build_type_and_grpc(self):
        fields = self.check_version(ARGS.attnctl, "attnctl")
        self.assertNotIn("oneDNN", fields)

    def test_attnserve_says_the_same_in_version_log_and_build_info(self):
        fields = self.check_version(ARGS.server, "attnserve")
        self.assertRegex(fields["oneDNN"], r"^\d+\.\d+\.\d+$")
        server = serving(Server(ARGS.server))
        try:
            log = "".join(server.log)
            self.assertIn(f"attnserve {fields['version']} (revision {fields['revision']}, "
                          f"{fields['build type']} build), oneDNN {fields['oneDNN']} on ", log)
            self.assertIn(f"gRPC {fields['gRPC']}", log)
            build = [dict(labels) for (name, labels) in server.scrape()
                     if name == "attnserve_build_info"]
            self.assertEqual(len(build), 1)
            self.assertEqual(build[0]["version"], fields["version"])
            self.assertEqual(build[0]["revision"], fields["revision"])
            self.assertEqual(build[0]["onednn_version"], fields["oneDNN"])
        finally:
            server.stop()


class WithServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        from attnserve.v1 import attention_pb2_grpc as pb_grpc
        cls.server = serving(Server(ARGS.server))
        cls.channel = grpc.insecure_channel(cls.server.target)
        cls.stub = pb_grpc.AttentionServiceStub(cls.channel)
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        cls.tmp.cleanup()

    def attnctl(self, *args):
        return run(ARGS.attnctl, *args, f"--target={self.server.target}")

    def test_models_json_is_what_the_server_answers(self):
        from google.protobuf import json_format
        from attnserve.v1 import attention_pb2 as pb

        def as_dict(message):
            return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                             including_default_value_fields=True)

        code, out, err = self.attnctl("models", "--json")
        self.assertEqual(code, 0, err)
        self.assertEqual(out.count("\n"), 1, "one JSON line")
        models = json.loads(out)
        self.assertEqual(models, as_dict(self.stub.ListModels(pb.ListModelsRequest(), timeout=30)))
        self.assertEqual(models["models"][0]["name"], "default")
        self.assertEqual(models["models"][0]["head_config"]["d_model"], 768)
        code, out, err = self.attnctl("model", "--model=default", "--json")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out),
                         as_dict(self.stub.GetModel(pb.GetModelRequest(name="default"), timeout=30)))

    def test_attend_json_and_float64_input_match_the_servers_answer(self):
        from attnserve.v1 import attention_pb2 as pb
        from harness import from_tensor, to_tensor
        rng = np.random.default_rng()
        batch, seq = int(rng.integers(1, 4)), int(rng.integers(3, 12))
        x = rng.standard_normal((batch, seq, 768))  # NumPy's default float64
        path = os.path.join(self.tmp.name, "x.npy")
        saved = os.path.join(self.tmp.name, "out.npy")
        np.save(path, x)
        code, out, err = self.attnctl("attend", f"--input={path}", "--stats", "--repeat=3",
                                      f"--save_output={saved}", "--json")
        self.assertEqual(code, 0, err)
        self.assertIn(f"attnctl: {path}: converted float64 -> float32", err)
        self.assertEqual(out.count("\n"), 1, "one JSON line")
        got = json.loads(out)

        # The same float32 inputs through Python's grpcio.
        answer = self.stub.Attend(pb.AttendRequest(
            model="default", hidden_states=to_tensor(pb, x.astype(np.float32)),
            attention_maps=pb.AttentionMapRequest(head_statistics=True)), timeout=60)
        self.assertEqual(got["model"], answer.model)
        self.assertEqual(got["kernel_path"], answer.kernel_path)
        self.assertEqual(got["precision"], pb.Precision.Name(answer.precision))
        self.assertEqual(got["output"], {"dtype": pb.DataType.Name(answer.output.dtype),
                                         "shape": [batch, seq, 768]})
        self.assertNotIn("attention_maps", got)
        for name in ["entropy", "max_weight", "contribution"]:
            expected = from_tensor(pb, getattr(answer.head_statistics, name))
            np.testing.assert_allclose(np.array(got["head_statistics"][name]), expected,
                                       rtol=1e-4, atol=1e-6, err_msg=name)
        # The output file holds the server's answer to the converted input.
        np.testing.assert_allclose(np.load(saved), from_tensor(pb, answer.output),
                                   rtol=1e-4, atol=1e-5)
        self.assertEqual(len(got["files"]), 1, got["files"])
        self.assertIn(saved, got["files"][0])
        self.assertEqual(got["calls"], 3)
        latency = got["latency_ms"]
        self.assertGreater(latency["p50"], 0)
        self.assertLessEqual(latency["p50"], latency["p90"])
        self.assertLessEqual(latency["p90"], latency["p99"])
        self.assertLessEqual(latency["p99"], latency["max"])
        self.assertGreaterEqual(got["server"]["batch_tokens"], batch * seq, got["server"])
        self.assertGreaterEqual(got["server"]["batch_size"], 1, got["server"])
        self.assertGreaterEqual(got["server"]["compute_ms"], 0)
        # Each call's round trip minus its compute: positive, under the trip.
        self.assertGreater(got["transport_ms"]["p50"], 0)
        self.assertLess(got["transport_ms"]["p50"], latency["max"])

    def test_stream_maps_brings_maps_over_the_clients_limit_and_saves_them_as_attend_does(self):
        # [1, 12, 512, 512] FP32 maps are 12.6 MB, over a 2 MB receive limit
        # that the 1.6 MB output is under: Attend's one message is refused,
        # AttendStream's chunks (1 MiB each) arrive.
        flags = ["--batch=1", "--seq=512", "--maps=per-head", "--seed=9",
                 "--max_receive_message_bytes=2000000"]
        code, out, err = self.attnctl("attend", *flags)
        self.assertEqual(code, 1, out + err)
        self.assertIn("RESOURCE_EXHAUSTED", err)
        streamed = os.path.join(self.tmp.name, "streamed.npy")
        code, out, err = self.attnctl("attend", *flags, "--stream_maps", f"--save_maps={streamed}")
        self.assertEqual(code, 0, out + err)
        self.assertIn("maps streamed in 12 chunks", out)  # one head (1 MiB) a chunk
        whole = os.path.join(self.tmp.name, "whole.npy")
        code, out, err = self.attnctl("attend", *flags[:-1], f"--save_maps={whole}")
        self.assertEqual(code, 0, out + err)
        np.testing.assert_array_equal(np.load(streamed), np.load(whole))
        self.assertEqual(np.load(streamed).shape, (1, 12, 512, 512))

    def test_bench_decode_drives_sessions_and_closes_them(self):
        code, out, err = self.attnctl("bench", "--decode", "--sessions=3", "--context=40",
                                      "--steps=5", "--prefill_chunk=16", "--json")
        self.assertEqual(code, 0, out + err)
        got = json.loads(out)
        self.assertEqual((got["mode"], got["sessions"], got["context"], got["steps"]),
                         ("decode", 3, 40, 5))
        self.assertGreater(got["tokens_per_second"], 0)
        self.assertLessEqual(got["step_ms"]["p50"], got["step_ms"]["max"])
        # tokens/s is over the timed calls alone (3 x 5 tokens over the 5 steps'
        # summed latencies, each at most max): the client drawing the next
        # step's inputs between them does not count.
        self.assertGreaterEqual(got["tokens_per_second"] * got["step_ms"]["max"] / 1e3,
                                3 * (1 - 1e-3))
        # The server's part before the compute lies within each step.
        self.assertGreaterEqual(got["server_queue_ms"]["p50"], 0)
        self.assertLessEqual(got["server_queue_ms"]["p50"], got["step_ms"]["p50"])
        self.assertTrue(got["kernel_path"].endswith("/paged"), got["kernel_path"])
        self.assertIn("bench --decode: 8 of 8 calls", err)  # 3 prefill chunks + 5 steps
        # Flag mistakes are the command line's (exit 2), before any call.
        code, _, err = self.attnctl("bench", "--decode", "--sessions=0")
        self.assertEqual(code, 2, err)
        self.assertIn("--sessions", err)

    def test_bench_decode_prefill_during_measures_steps_beside_a_long_prefill(self):
        text = self.server.scrape()
        before = metric(text, "attnserve_decode_batch_tokens_count", model="default")
        # 3000 tokens in one step: over --max_seq_len (2048), computed in chunks of 512.
        code, out, err = self.attnctl("bench", "--decode", "--sessions=2", "--context=16",
                                      "--steps=8", "--prefill_during=3000", "--json")
        self.assertEqual(code, 0, out + err)
        got = json.loads(out)
        mixed = got["prefill_during"]
        self.assertEqual(mixed["tokens"], 3000)
        self.assertGreater(mixed["call_ms"], 0)
        self.assertLessEqual(mixed["step_ms"]["p50"], mixed["step_ms"]["max"])
        self.assertGreaterEqual(mixed["steps_during"], 0)
        self.assertLessEqual(mixed["steps_during"], 6)  # of the 8 - 8/4 rounds after it began
        self.assertAlmostEqual(mixed["p99_ratio"],
                               mixed["step_ms"]["p99"] / got["step_ms"]["p99"], places=2)
        self.assertIn("bench --decode: 17 of 17 calls", err)  # 1 prefill chunk + 2 x 8 steps
        # Its 6 chunks were 6 core calls at least (decode rounds add theirs).
        after = metric(self.server.scrape(), "attnserve_decode_batch_tokens_count", model="default")
        self.assertGreaterEqual(after - before, 1 + 16 + 6)
        code, _, err = self.attnctl("bench", "--decode", "--prefill_during=-1")
        self.assertEqual(code, 2, err)
        self.assertIn("--prefill_during", err)

    def test_bench_decode_stream_sends_the_steps_on_one_stream(self):
        code, out, err = self.attnctl("bench", "--decode", "--sessions=2", "--context=20",
                                      "--steps=4", "--prefill_chunk=16", "--stream", "--json")
        self.assertEqual(code, 0, out + err)
        got = json.loads(out)
        self.assertEqual((got["form"], got["sessions"], got["steps"]), ("stream", 2, 4))
        self.assertGreaterEqual(got["overhead_ms"]["p50"], 0)
        text = self.server.scrape()
        self.assertGreaterEqual(metric(text, "attnserve_requests_total", code="OK",
                                       method="ExtendStream"), 1)
        # 2 prefill chunks and 4 steps, each a message answered on the stream.
        self.assertGreaterEqual(metric(text, "attnserve_decode_step_seconds_count",
                                       method="ExtendStream"), 6)

    def test_session_commands_open_extend_fork_truncate_and_close_a_session(self):
        from attnserve.v1 import attention_pb2 as pb
        code, out, err = self.attnctl("session", "open", "--model=default")
        self.assertEqual(code, 0, err)
        session = out.splitlines()[0]
        self.assertRegex(session, r"^[0-9a-f]{32}$", "the id alone on the first line")
        # Random tokens, then a file's rows; the output saved is what the
        # server answered, checked against the same step sent from Python.
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      "--tokens=4")
        self.assertEqual(code, 0, err)
        self.assertIn("4 tokens appended, length now 4", out)
        # --stats: each head's entropy / max weight of each new row, printed (the
        # values are checked against the float64 reference in session_service_test
        # and the package test; here the answer's shape and the printed table).
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      "--tokens=2", "--stats", "--json")
        self.assertEqual(code, 0, err)
        stats = json.loads(out)["results"][0]["head_statistics"]
        self.assertEqual(stats["entropy"]["shape"], ["12", "2"])
        code, out, err = self.attnctl("session", "truncate", f"--session_id={session}",
                                      "--length=4")
        self.assertEqual(code, 0, err)
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      "--tokens=2", "--stats")
        self.assertEqual(code, 0, err)
        self.assertIn("head statistics of the new rows (entropy nats / max weight):", out)
        rows = [line for line in out.splitlines() if line.startswith("  head ")]
        self.assertEqual(len(rows), 12)
        for line in rows:  # two rows each: entropy in [0, ln 6], max weight in (0, 1]
            pairs = [tuple(map(float, p.split("/"))) for p in line.split(":")[1].split()]
            self.assertEqual(len(pairs), 2, line)
            for entropy, max_weight in pairs:
                self.assertTrue(0.0 <= entropy <= np.log(6) + 1e-4, line)
                self.assertTrue(0.0 < max_weight <= 1.0, line)
        # The same step again (same seed, same expected length) is a replay,
        # which carries no statistics: said so, exit 0.
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      "--tokens=2", "--expected_length=4", "--stats")
        self.assertEqual(code, 0, out + err)
        self.assertIn("replayed", out)
        self.assertIn("no statistics on a replay", out)
        self.assertNotIn("head statistics of the new rows", out)
        code, out, err = self.attnctl("session", "truncate", f"--session_id={session}",
                                      "--length=4")
        self.assertEqual(code, 0, err)
        rows = np.random.default_rng().standard_normal((3, 768))  # float64: converted
        path = os.path.join(self.tmp.name, "rows.npy")
        saved = os.path.join(self.tmp.name, "out.npy")
        np.save(path, rows)
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      f"--input={path}", f"--save_output={saved}", "--json")
        self.assertEqual(code, 0, err)
        self.assertIn("float64", err)
        answer = json.loads(out)
        self.assertEqual(answer["results"][0]["length"], "7")
        # A fork at 7 tokens, given the same step from Python, answers the same.
        code, out, err = self.attnctl("session", "fork", f"--session_id={session}")
        self.assertEqual(code, 0, err)
        fork = out.splitlines()[0]
        self.assertNotEqual(fork, session)
        self.assertIn("layer lengths: 7", out)
        code, out, err = self.attnctl("session", "truncate", f"--session_id={fork}",
                                      "--length=4")
        self.assertEqual(code, 0, err)
        self.assertIn("layer lengths: 4", out)
        step = pb.ExtendStep(session_id=fork, expected_length=4, hidden_states=pb.Tensor(
            dtype=pb.DATA_TYPE_FP32, shape=[3, 768], raw_data=rows.astype("<f4").tobytes()))
        result = self.stub.Extend(pb.ExtendRequest(steps=[step]), timeout=60).results[0]
        self.assertEqual(result.code, 0, result.message)
        np.testing.assert_array_equal(
            np.load(saved), np.frombuffer(result.output.raw_data, "<f4").reshape(3, 768))
        code, out, err = self.attnctl("session", "get", f"--session_id={session}", "--json")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["layer_lengths"], ["7"])
        # A step the server refuses: exit 1 with its code and message.
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      "--tokens=1", "--expected_length=3")
        self.assertEqual(code, 1, out + err)
        self.assertIn("ABORTED", err)
        self.assertIn("steps[0]", err)
        for sid in (session, fork):
            code, out, err = self.attnctl("session", "close", f"--session_id={sid}")
            self.assertEqual((code, out), (0, f"closed {sid}\n"), err)
        code, out, err = self.attnctl("session", "get", f"--session_id={session}")
        self.assertEqual(code, 1, out + err)
        self.assertIn("NOT_FOUND", err)
        self.assertIn("closed", err)

    def test_session_latest_prints_what_the_latest_token_attends_to_and_saves_the_maps(self):
        # Against the float64 reference of the seeded built-in model (no RoPE):
        # the latest token's row of the causal maps over the rows sent.
        seed = int(np.random.default_rng().integers(0, 2**32))
        rows = np.random.default_rng(seed).standard_normal((6, 768)).astype(np.float32)
        path = os.path.join(self.tmp.name, "latest_rows.npy")
        maps_path = os.path.join(self.tmp.name, "latest_maps.npy")
        np.save(path, rows)
        code, out, err = self.attnctl("session", "open", "--model=default")
        self.assertEqual(code, 0, err)
        session = out.splitlines()[0]
        code, out, err = self.attnctl("session", "extend", f"--session_id={session}",
                                      f"--input={path}")
        self.assertEqual(code, 0, err)
        code, out, err = self.attnctl("session", "latest", f"--session_id={session}",
                                      f"--save_maps={maps_path}")
        self.assertEqual(code, 0, err)
        weights = seeded_weights(self.server.seed, 768, 12, 12, 64)
        _, p = reference_attention(rows[None], weights, 12, 12, 64, 1 / 8.0, causal=True)
        expected = p[0, :, -1, :]  # [heads, 6]
        maps = np.load(maps_path)
        self.assertEqual(maps.shape, (12, 6))
        self.assertLess(rel_error(maps, expected), 1e-5, f"rows seed {seed}")
        self.assertIn(f"{session} layer 0: the latest token (position 5) over 6 tokens, 12 heads", out)
        self.assertIn(f"maps saved to {maps_path} [12, 6]", out)
        heads = [line for line in out.splitlines() if line.startswith("  head ")]
        self.assertEqual(len(heads), 12)
        for h, line in enumerate(heads):
            stats, top = line.split(":", 1)[1].split(";")
            entropy, max_weight = map(float, stats.split())
            row = expected[h]
            self.assertAlmostEqual(entropy, -(row * np.log(row)).sum(), delta=2e-4)
            self.assertAlmostEqual(max_weight, row.max(), delta=2e-4)
            keys = [(int(k), float(w)) for k, w in
                    (pair.split(":") for pair in top.replace(": ", ":").split())]
            # The three largest weights, largest first (near-ties may swap
            # their keys between float32 and float64: compare the weights).
            self.assertEqual(len(keys), 3, line)
            self.assertEqual(len({k for k, _ in keys}), 3, line)
            largest = np.sort(row)[::-1][:3]
            for (k, w), reference_w in zip(keys, largest):
                self.assertAlmostEqual(w, row[k], delta=2e-4, msg=f"{line} (seed {seed})")
                self.assertAlmostEqual(w, reference_w, delta=2e-4, msg=f"{line} (seed {seed})")
        # A layer the session does not have: the server's INVALID_ARGUMENT;
        # a flag the verb does not take: a usage error before any call.
        code, out, err = self.attnctl("session", "latest", f"--session_id={session}", "--layer=1")
        self.assertEqual(code, 1, out + err)
        self.assertIn("INVALID_ARGUMENT", err)
        self.assertIn("layer", err)
        code, out, err = self.attnctl("session", "latest", f"--session_id={session}", "--tokens=2")
        self.assertEqual(code, 2, out + err)
        self.assertIn("--tokens: session latest does not take it", err)
        code, out, err = self.attnctl("session", "latest", f"--session_id={session}", "--layer=-2")
        self.assertEqual(code, 2, out + err)
        self.assertIn("--layer: must be >= 0", err)
        code, out, err = self.attnctl("session", "close", f"--session_id={session}")
        self.assertEqual(code, 0, err)

    def test_a_response_over_the_clients_limit_names_its_flag(self):
        # 16 tokens x 768 floats: about 49 KB of output, over a 10000-byte limit.
        code, out, err = self.attnctl("attend", "--batch=1", "--seq=16",
                                      "--max_receive_message_bytes=10000")
        self.assertEqual(code, 1, out + err)
        self.assertIn("RESOURCE_EXHAUSTED", err)
        self.assertIn("this client's limit of 10000 bytes (--max_receive_message_bytes)", err)
        self.assertIn("raise this client's --max_receive_message_bytes", err)
        self.assertNotIn("attnserve --max_receive_message_bytes", err)


class MessageLimit(unittest.TestCase):
    def test_a_request_over_the_servers_limit_names_the_servers_flag(self):
        limit = 65536
        server = serving(Server(ARGS.server, f"--max_receive_message_bytes={limit}"))
        try:
            # 4 x 64 tokens x 768 floats: about 786 KB of hidden states.
            code, out, err = run(ARGS.attnctl, "attend", f"--target={server.target}",
                                 "--batch=4", "--seq=64")
            self.assertEqual(code, 1, out + err)
            self.assertIn("RESOURCE_EXHAUSTED", err)
            self.assertIn(f"over the server's limit of {limit} bytes "
                          "(attnserve --max_receive_message_bytes)", err)
            self.assertIn("raise the server's --max_receive_message_bytes", err)
            self.assertIn("Received message larger than max (", err)
            # A request under the limit still works, and the server lives on.
            code, out, err = run(ARGS.attnctl, "attend", f"--target={server.target}",
                                 "--batch=1", "--seq=4")
            self.assertEqual(code, 0, err)
            self.assertIsNone(server.proc.poll())
        finally:
            server.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--build_type", default="")
    ARGS, rest = parser.parse_known_args()
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
