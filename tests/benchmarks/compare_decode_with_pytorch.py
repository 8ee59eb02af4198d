#!/usr/bin/python3
"""attnserve's decode sessions beside what a user would write instead, side by side.

A program that prints tables, not a test. The real server (the build's
attnserve, built-in model: d_model 768, 12 heads, head_dim 64, no RoPE, seeded
weights) on a loopback port, with --compute_threads=T, against PyTorch in a
process of its own with torch.set_num_threads(T), in alternating rounds of one
run. For a micro-batch of --sessions sessions at --context tokens (one new token
each per step) and for one session, each peer decodes --steps steps (one
session: at least --single_steps):

  attnserve FP32 KV, BF16 KV  `attnctl bench --decode` (C++ client): every step
                              is one Extend message carrying the whole micro-batch
                              over gRPC (the faster honest client: the Python
                              package adds its own per-call cost)
  PyTorch, preallocated       the cache [B, H, Lmax, hd] allocated once and
                              written in place, one addmm for Q/K/V, batched
                              matmuls over the cache's first L rows, softmax,
                              one addmm for the output (FP32, PyTorch at its best
                              on this version: it has no scaled_dot_product_attention)
  PyTorch, torch.cat          the same with caches grown by torch.cat each step
                              (past_key_values as Hugging Face kept them)
  resend to Attend            each step sends the whole prefix plus the new token
                              to Attend (causal) and keeps the last row: what a
                              user of a stateless attention service does
                              (attnctl attend --causal; --resend_calls steps)

Columns: tokens/s, ms per step, the fraction of the bandwidth bound ((KV bytes
of every session + the layer's weight bytes once) / the read probe's GB/s: the
best of tests/benchmarks/decode_attention_benchmark's probes, run before each
peer's run in every round, a ceiling), the median over the rounds of each run's
fraction of the bound at the probe run just before it (on a host whose
bandwidth moves from one minute to the next: the share of what memory gave
then), and each peer's ms/step over attnserve FP32's.

Before timing, the peers are checked to compute the same thing: sessions
prefilled with fresh random hidden states, then one step; attnserve's step
output (FP32 and BF16 KV), PyTorch's two forms and Attend's last row against
a float64 NumPy reference of the seeded layer (relative Frobenius error;
tolerances: 1e-4 FP32, 2e-2 BF16 KV).

Over the wire (--over_the_wire): one session at --wire_context, FP32 KV, from one
client (Python grpcio), alternating call by call: the step's round trip p50 as
Extend calls and as ExtendStream messages (fed to grpcio's request iterator by
a StepFeeder: one slot, one lock), the empty-call round trip
(GetSession: no compute, no executor), the in-process step
(BM_ExtendStep/seqs:1/context:2048/d_model:768 of the benchmark binary) and the
ratio p50 / (in-process + empty call), whose target is <= 1.3. attnctl's
(C++) step p50s, unary and --stream, are printed beside them.

Usage:
  /usr/bin/python3 tests/benchmarks/compare_decode_with_pytorch.py [--build build]
      [--rounds 3] [--threads 2] [--sessions 32] [--context 2048] [--steps 32]
      [--single_steps 256]
      [--resend_calls 2] [--over_the_wire [--wire_steps 300]] [--quick]
Installs python3-torch (with OpenBLAS) through deploy/install_deps.sh when torch
cannot be imported.
"""
import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from harness import (Server, cpu_model, generate_stubs, reference_attention,  # noqa: E402
                     rel_error, seeded_weights, wait_serving)
from compare_with_pytorch import ensure_torch  # noqa: E402  (the same Debian torch)

D_MODEL, HEADS, HEAD_DIM = 768, 12, 64
FP32_TOLERANCE, BF16_KV_TOLERANCE = 1e-4, 2e-2


# --- PyTorch's two forms (run in a child process, and in this one for the check) ---

class TorchDecoder:
    """One attention layer decoding B sequences with a KV cache in PyTorch.
    weights: [w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o] as [in, out] arrays.
    form "prealloc": caches [B, H, max_len, hd] written in place; "cat": caches
    grown with torch.cat each step."""

    def __init__(self, torch, weights, batch, max_len, form, scale):
        self.torch, self.form, self.scale, self.batch = torch, form, scale, batch
        w = [torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in weights]
        self.w_qkv = torch.cat([w[0], w[2], w[4]], dim=1).contiguous()  # [D, 3D]
        self.b_qkv = torch.cat([w[1], w[3], w[5]]).contiguous()
        self.w_o, self.b_o = w[6].contiguous(), w[7].contiguous()
        if form == "prealloc":
            self.k = torch.empty(batch, HEADS, max_len, HEAD_DIM)
            self.v = torch.empty(batch, HEADS, max_len, HEAD_DIM)
        else:
            self.k = torch.empty(batch, HEADS, 0, HEAD_DIM)
            self.v = torch.empty(batch, HEADS, 0, HEAD_DIM)
        self.length = 0

    def load(self, k, v):
        """Puts cached keys and values [B, H, L, hd] in the cache."""
        n = k.shape[2]
        if self.form == "prealloc":
            self.k[:, :, :n] = k
            self.v[:, :, :n] = v
        else:
            self.k, self.v = k.contiguous().clone(), v.contiguous().clone()
        self.length = n

    def project_kv(self, x):
        """Keys and values [B, H, n, hd] of hidden states x [B, n, D]."""
        qkv = x @ self.w_qkv + self.b_qkv
        b, n, _ = x.shape
        k = qkv[..., D_MODEL:2 * D_MODEL].reshape(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        v = qkv[..., 2 * D_MODEL:].reshape(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        return k, v

    def step(self, x):
        """One new token per sequence: x [B, D] -> output [B, D]."""
        torch = self.torch
        qkv = torch.addmm(self.b_qkv, x, self.w_qkv)  # [B, 3D]
        q = qkv[:, :D_MODEL].reshape(self.batch, HEADS, 1, HEAD_DIM)
        k = qkv[:, D_MODEL:2 * D_MODEL].reshape(self.batch, HEADS, 1, HEAD_DIM)
        v = qkv[:, 2 * D_MODEL:].reshape(self.batch, HEADS, 1, HEAD_DIM)
        n = self.length + 1
        if self.form == "prealloc":
            self.k[:, :, self.length:n] = k
            self.v[:, :, self.length:n] = v
            keys, values = self.k[:, :, :n], self.v[:, :, :n]
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            keys, values = self.k, self.v
        self.length = n
        scores = torch.matmul(q, keys.transpose(2, 3)).mul_(self.scale)  # [B, H, 1, n]
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, values).reshape(self.batch, D_MODEL)
        return torch.addmm(self.b_o, context, self.w_o)


def torch_child(spec):
    """Times one PyTorch form: spec [form, batch, context, steps, threads].
    Prints {"step_ms": [...]} (each step's wall time)."""
    import torch
    form, batch, context, steps, threads = spec
    torch.set_num_threads(threads)
    rng = np.random.default_rng()
    scale = 1.0 / np.sqrt(HEAD_DIM)
    weights = [rng.uniform(-0.03, 0.03, s).astype(np.float32) for s in
               [(D_MODEL, D_MODEL), (D_MODEL,)] * 4]
    dec = TorchDecoder(torch, weights, batch, context + steps + 2, form, scale)
    times = []
    with torch.inference_mode():
        # The cached context: values do not change the time; fill as a prefill would.
        dec.load(torch.randn(batch, HEADS, context - 2, HEAD_DIM),
                 torch.randn(batch, HEADS, context - 2, HEAD_DIM))
        x = torch.randn(batch, D_MODEL)
        for i in range(steps + 2):  # two warm-up steps: the context is `context` at the first timed
            t0 = time.perf_counter()
            dec.step(x)
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"step_ms": times}))


def run_torch(form, batch, context, steps, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch_child",
                          json.dumps([form, batch, context, steps, threads])],
                         check=True, capture_output=True, text=True, env=env).stdout
    times = json.loads(out.strip().splitlines()[-1])["step_ms"]
    return sum(times) / len(times)  # mean ms per step, as attnctl's tokens/s


# --- attnserve ---

def attnctl_decode(attnctl, target, sessions, context, steps, kv_dtype, stream=False):
    args = [attnctl, "bench", "--decode", f"--target={target}", f"--sessions={sessions}",
            f"--context={context}", f"--steps={steps}", f"--kv_dtype={kv_dtype}", "--json",
            "--timeout_seconds=300"]
    if stream:
        args.append("--stream")
    return json.loads(run_attnctl(args))


def run_attnctl(args):
    """attnctl's stdout; its stderr in the error when it fails."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def attnctl_resend(attnctl, target, sessions, context, calls):
    """Attend over the whole prefix plus the new token, causal: p50 ms per call."""
    args = [attnctl, "attend", f"--target={target}", f"--batch={sessions}", f"--seq={context + 1}",
            "--causal", f"--repeat={calls}", "--json", "--max_receive_message_bytes=2147483647",
            "--timeout_seconds=900"]  # 32 x 2049 causal takes 20-30 s on a busy 2-core machine
    return json.loads(run_attnctl(args))["latency_ms"]["p50"]


def run_benchmark(benchmark, threads, *flags):
    """The benchmark binary's JSON report (after the line it prints first). Its
    OpenMP threads sleep when idle, as the server's and torch's do here: on a
    shared machine spinning threads waiting on a descheduled one stretch a
    1-session step from 3 ms to 80 ms."""
    out = subprocess.run([benchmark, "--benchmark_format=json", *flags], check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads),
                                  OMP_WAIT_POLICY="PASSIVE")).stdout
    return json.loads(out[out.index("{"):])


def probe_gbps(benchmark, threads):
    """The read probe's best GB/s (decode_attention_benchmark's best of 20 runs)."""
    report = run_benchmark(benchmark, threads, "--benchmark_filter=^BM_ReadProbe",
                           "--benchmark_min_time=0.05")
    return float(report["context"]["read_probe_GBps"])


def in_process_step_ms(benchmark, threads, context, bf16):
    name = (f"BM_ExtendStep/seqs:1/context:{context}/d_model:{D_MODEL}/heads:{HEADS}/"
            f"kv_heads:{HEADS}/bf16_kv:{bf16}/")
    report = run_benchmark(benchmark, threads, f"--benchmark_filter=^{name}",
                           "--benchmark_repetitions=3", "--benchmark_min_time=0.3")
    runs = [r for r in report["benchmarks"] if r.get("run_type") == "iteration"]
    if not runs:
        raise RuntimeError(f"the benchmark did not run {name} (a shape outside its list?)")
    return statistics.median(r["step_us"] for r in runs) / 1e3


def bound_ms(sessions, context, kv_bytes_per_element, gbps):
    """The bandwidth bound of one step: every session's KV + the weights once."""
    kv = sessions * context * 2 * D_MODEL * kv_bytes_per_element
    weights = 4 * (4 * D_MODEL * D_MODEL + 4 * D_MODEL)
    return (kv + weights) / (gbps * 1e9) * 1e3


class Check:
    """The peers' first step against a float64 reference of the seeded layer."""

    def __init__(self, server):
        import grpc
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2, health_pb2_grpc
        self.pb = attention_pb2
        self.channel = grpc.insecure_channel(server.target, options=[
            ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.max_send_message_length", 2**31 - 1)])
        self.stub = attention_pb2_grpc.AttentionServiceStub(self.channel)
        wait_serving(health_pb2_grpc.HealthStub(self.channel), health_pb2)
        h = self.stub.GetModel(self.pb.GetModelRequest(name="default"), timeout=60).head_config
        assert (h.d_model, h.num_heads, h.num_kv_heads, h.head_dim) == (D_MODEL, HEADS, HEADS,
                                                                        HEAD_DIM), h
        assert not h.rotary.rotary_dim, "the check's reference has no RoPE"
        self.scale = h.scale
        self.weights = seeded_weights(server.seed, D_MODEL, HEADS, HEADS, HEAD_DIM)

    def tensor(self, rows):
        return self.pb.Tensor(dtype=self.pb.DATA_TYPE_FP32, shape=list(rows.shape),
                              raw_data=np.ascontiguousarray(rows, "<f4").tobytes())

    @staticmethod
    def array(tensor):
        return np.frombuffer(tensor.raw_data, "<f4").reshape(tuple(tensor.shape))

    def open(self, kv_dtype):
        return self.stub.OpenSession(self.pb.OpenSessionRequest(
            models=["default"], kv_dtype=kv_dtype), timeout=60).session_id

    def extend(self, ids, rows, expected):
        request = self.pb.ExtendRequest(steps=[
            self.pb.ExtendStep(session_id=i, expected_length=expected, hidden_states=self.tensor(r))
            for i, r in zip(ids, rows)])
        response = self.stub.Extend(request, timeout=600)
        for r in response.results:
            assert r.code == 0, r.message
        return [self.array(r.output) for r in response.results]

    def run(self, sessions, context, threads):
        """Returns the rows of the check's table (peer, error, tolerance)."""
        import torch
        torch.set_num_threads(threads)
        x = np.random.default_rng().standard_normal((sessions, context + 1, D_MODEL)).astype(
            np.float32)
        expected = np.stack([reference_attention(x[b:b + 1], self.weights, HEADS, HEADS, HEAD_DIM,
                                                 self.scale, causal=True)[0][0, -1]
                             for b in range(sessions)])
        rows = []
        for name, dtype, tol in [("attnserve FP32 KV", self.pb.DATA_TYPE_FP32, FP32_TOLERANCE),
                                 ("attnserve BF16 KV", self.pb.DATA_TYPE_BF16, BF16_KV_TOLERANCE)]:
            ids = [self.open(dtype) for _ in range(sessions)]
            for start in range(0, context, 512):
                self.extend(ids, x[:, start:min(context, start + 512)], start)
            got = np.stack([o[0] for o in self.extend(ids, x[:, context:context + 1], context)])
            for i in ids:
                self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=i), timeout=60)
            rows.append((name, rel_error(got, expected), tol))
        with torch.inference_mode():
            for form in ("prealloc", "cat"):
                dec = TorchDecoder(torch, self.weights, sessions, context + 1, form, self.scale)
                dec.load(*dec.project_kv(torch.from_numpy(x[:, :context])))
                got = dec.step(torch.from_numpy(x[:, context])).numpy()
                rows.append((f"PyTorch, {form}", rel_error(got, expected), FP32_TOLERANCE))
        response = self.stub.Attend(self.pb.AttendRequest(
            model="default", hidden_states=self.tensor(x), causal=True), timeout=600)
        rows.append(("resend to Attend", rel_error(self.array(response.output)[:, -1], expected),
                     FP32_TOLERANCE))
        return rows

    def wire_ms(self, context, calls):
        """One session at `context` from this Python client: the p50s of
        GetSession (the empty call: no compute, it reads the session's
        description), of an Extend call of one token and of one message of one
        token on an ExtendStream (the messages handed to grpcio's request
        iterator by a StepFeeder), alternating call by call. Each message is
        built before its timing starts, as a decoder has its hidden states
        before it sends them."""
        sid = self.open(self.pb.DATA_TYPE_FP32)
        rng = np.random.default_rng()
        for start in range(0, context, 512):
            n = min(context, start + 512) - start
            self.extend([sid], rng.standard_normal((1, n, D_MODEL), np.float32), start)
        feeder = StepFeeder()
        responses = self.stub.ExtendStream(feeder, timeout=600)
        empty, unary, streamed = [], [], []
        length = context
        row = rng.standard_normal((1, D_MODEL), np.float32)

        def step_request():
            return self.pb.ExtendRequest(steps=[self.pb.ExtendStep(
                session_id=sid, expected_length=length, hidden_states=self.tensor(row))])

        for _ in range(calls):
            t0 = time.perf_counter()
            self.stub.GetSession(self.pb.GetSessionRequest(session_id=sid), timeout=60)
            empty.append((time.perf_counter() - t0) * 1e3)
            request = step_request()
            t0 = time.perf_counter()
            response = self.stub.Extend(request, timeout=60)
            unary.append((time.perf_counter() - t0) * 1e3)
            assert response.results[0].code == 0, response.results[0].message
            length += 1
            request = step_request()
            t0 = time.perf_counter()
            feeder.put(request)
            response = next(responses)
            streamed.append((time.perf_counter() - t0) * 1e3)
            assert response.results[0].code == 0, response.results[0].message
            length += 1
        feeder.close()
        for _ in responses:
            pass
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid), timeout=60)
        return statistics.median(empty), statistics.median(unary), statistics.median(streamed)


class StepFeeder:
    """The request iterator of a grpcio blocking stream-stream call, fed one
    message at a time: put(message) hands it to the iterator (grpcio's
    request thread, blocked in __next__), close() ends the stream. A single
    slot and one lock: the request thread wakes on one lock release, where a
    queue.Queue's get wakes through a condition (a new lock each wait, its
    mutex taken again on waking): the streamed step's p50 measured 0.97-1.14x
    unary's fed by a Queue, 0.95-1.05x fed by this, lower in 10 of 11
    alternated rounds (docs/measurements.md).
    One message in flight: put waits for nothing, so call it only after the
    previous message's response was read."""

    def __init__(self):
        self._ready = threading.Lock()
        self._ready.acquire()
        self._item = None

    def put(self, message):
        self._item = message
        self._ready.release()

    def close(self):
        self._ready.release()

    def __iter__(self):
        return self

    def __next__(self):
        self._ready.acquire()
        item, self._item = self._item, None
        if item is None:
            raise StopIteration
        return item


def print_table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--torch_child":
        torch_child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3, help="alternations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=32, help="the micro-batch")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per peer per round")
    parser.add_argument("--single_steps", type=int, default=256,
                        help="the same for one session (its steps are short: 32 of them are over "
                             "in about 50 ms, where one pause of the machine weighs on the mean)")
    parser.add_argument("--resend_calls", type=int, default=2, help="Attend calls per round")
    parser.add_argument("--over_the_wire", action="store_true",
                        help="also time one session's step round trip, unary and streamed")
    parser.add_argument("--wire_steps", type=int, default=300)
    parser.add_argument("--wire_context", type=int, default=2048,
                        help="the one session's context over the wire (a shape BM_ExtendStep runs)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, one round (a smoke run: 2 sessions at context 64)")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.context, args.steps, args.rounds = 2, 64, 2, 1
        args.single_steps = 2
        args.resend_calls, args.wire_steps = 1, 5  # the wire's shape stays (one session)
    ensure_torch()
    attnserve = os.path.join(args.build, "server", "attnserve")
    attnctl = os.path.join(args.build, "client", "attnctl")
    benchmark = os.path.join(args.build, "tests", "benchmarks", "decode_attention_benchmark")
    server = Server(attnserve, f"--compute_threads={args.threads}",
                    f"--max_seq_len={max(args.context + 1, 2048)}",
                    f"--max_session_tokens="
                    f"{max(args.context + max(args.steps, args.single_steps) + 8, 32768)}",
                    f"--kv_cache_bytes={4 << 30}", f"--max_receive_message_bytes={2**31 - 1}",
                    f"--max_send_message_bytes={2**31 - 1}", f"--max_request_bytes={8 << 30}",
                    f"--max_transport_bytes={4 << 30}")
    atexit.register(server.stop)
    server.wait_serving(120)
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, os.path.join(ROOT, "proto"))
        check = Check(server)
        check_rows = check.run(min(args.sessions, 2), args.context, args.threads)
    print(f"uptime: {os.getloadavg()}", file=sys.stderr)
    failed = [r for r in check_rows if not r[1] <= r[2]]

    batches = [args.sessions, 1] if args.sessions != 1 else [1]
    peers = ["attnserve FP32 KV", "attnserve BF16 KV", "PyTorch, preallocated",
             "PyTorch, torch.cat", "resend to Attend"]
    ms = {(b, p): [] for b in batches for p in peers}
    probes = []
    for b in batches:  # warm: the server's primitives for both shapes
        attnctl_decode(attnctl, server.target, b, min(args.context, 64), 2, "fp32")
    # Each peer's run also against a probe run just before it: on a host whose
    # bandwidth moves from one minute to the next, the share of what memory
    # gave then (the "probe just before" column) beside the share of the best
    # it gave.
    beside = {(b, p): [] for b in batches for p in peers}

    def measure(b, peer, run):
        probe = probe_gbps(benchmark, args.threads)
        probes.append(probe)
        m = run()
        ms[(b, peer)].append(m)
        element = 2 if peer == "attnserve BF16 KV" else 4
        beside[(b, peer)].append(bound_ms(b, args.context, element, probe) / m)

    for _ in range(args.rounds):
        for b in batches:
            steps = args.steps if b > 1 else max(args.steps, args.single_steps)
            for kv in ("fp32", "bf16"):
                measure(b, f"attnserve {kv.upper()} KV", lambda: 1e3 * b / attnctl_decode(
                    attnctl, server.target, b, args.context, steps, kv)["tokens_per_second"])
            measure(b, "PyTorch, preallocated",
                    lambda: run_torch("prealloc", b, args.context, steps, args.threads))
            measure(b, "PyTorch, torch.cat",
                    lambda: run_torch("cat", b, args.context, steps, args.threads))
            measure(b, "resend to Attend",
                    lambda: attnctl_resend(attnctl, server.target, b, args.context,
                                           args.resend_calls))
    gbps = max(probes)

    wire = None
    if args.over_the_wire:
        with tempfile.TemporaryDirectory() as stubs:
            generate_stubs(stubs, os.path.join(ROOT, "proto"))
            check = Check(server)
            c_unary, c_streamed, empty, unary, streamed, in_proc = [], [], [], [], [], []
            for _ in range(args.rounds):
                c_unary.append(attnctl_decode(attnctl, server.target, 1, args.wire_context,
                                              args.wire_steps, "fp32")["step_ms"]["p50"])
                c_streamed.append(attnctl_decode(attnctl, server.target, 1, args.wire_context,
                                                 args.wire_steps, "fp32", stream=True)
                                  ["step_ms"]["p50"])
                e, u, s = check.wire_ms(args.wire_context, args.wire_steps)
                empty.append(e)
                unary.append(u)
                streamed.append(s)
                in_proc.append(in_process_step_ms(benchmark, args.threads, args.wire_context, 0))
            check.channel.close()
        wire = [statistics.median(v) for v in (c_unary, c_streamed, empty, unary, streamed,
                                               in_proc)]

    server.stop()
    print(f"CPU: {cpu_model()}; {args.threads} threads (server --compute_threads, "
          f"torch.set_num_threads); medians of {args.rounds} alternating rounds; "
          f"read probe {gbps:.1f} GB/s (best of the {len(probes)} run before each peer's "
          f"runs); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print(f"Same computation: each peer's first step ({min(args.sessions, 2)} sessions at "
          f"context {args.context}) against a float64 NumPy reference (relative Frobenius error)")
    print_table(("peer", "error", "tolerance", "within"),
                [(n, f"{e:.2e}", f"{t:.0e}", "yes" if e <= t else "NO") for n, e, t in check_rows])
    print()
    header = ("sessions", "context", "peer", "tokens/s", "ms/step", "of bandwidth bound",
              "of the bound, probe just before", "ms/step / attnserve FP32 KV's")
    rows = []
    for b in batches:
        ours = statistics.median(ms[(b, "attnserve FP32 KV")])
        for p in peers:
            m = statistics.median(ms[(b, p)])
            element = 2 if p == "attnserve BF16 KV" else 4
            rows.append((str(b), str(args.context), p, f"{1e3 * b / m:.1f}", f"{m:.3f}",
                         f"{100 * bound_ms(b, args.context, element, gbps) / m:.1f}%",
                         f"{100 * statistics.median(beside[(b, p)]):.1f}%",
                         f"{m / ours:.2f}x"))
    print_table(header, rows)
    if wire:
        c_unary, c_streamed, empty, unary, streamed, in_proc = wire
        print()
        print(f"Over the wire: one session at context {args.wire_context}, FP32 KV; p50 of "
              f"{args.wire_steps} steps, median of {args.rounds} rounds; in-process step "
              f"(BM_ExtendStep) {in_proc:.3f} ms; empty call (GetSession, Python client) "
              f"{empty:.3f} ms")
        print_table(("client", "form", "step p50 ms", "p50 / (in-process + empty call)"), [
            ("Python grpcio", "Extend (unary)", f"{unary:.3f}", f"{unary / (in_proc + empty):.2f}"),
            ("Python grpcio", "ExtendStream", f"{streamed:.3f}",
             f"{streamed / (in_proc + empty):.2f}"),
            ("attnctl (C++)", "Extend (unary)", f"{c_unary:.3f}", "(empty call not timed in C++)"),
            ("attnctl (C++)", "ExtendStream", f"{c_streamed:.3f}", "")])
        print(f"streamed / unary: Python {streamed / unary:.2f}, attnctl {c_streamed / c_unary:.2f}")
    if failed:
        sys.exit(f"peers disagree: {failed}")


if __name__ == "__main__":
    main()
