"""Shared by the Python end-to-end tests: the attnserve Python package
(client/python) and stubs of the standard protos generated at test time, the
real attnserve binary on a free loopback port, tensor helpers."""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import numpy as np

GRPC_PROTO_DIR = "/usr/share/grpc-proto"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(REPO, "client", "python")


def generate_stubs(out_dir, proto_dir, package_from_checkout=True):
    """Makes attnserve's generated code importable (`from attnserve.v1 import
    attention_pb2`): the attnserve package's, checked against proto_dir (the
    repository's proto/) first -- AssertionError when client/python/generate.sh
    has not been run since the proto changed. package_from_checkout: import the
    package from this checkout's client/python (False: the one installed in
    this interpreter, e.g. a virtual environment's). Compiles the standard
    health and reflection protos into out_dir with protoc and
    grpc_python_plugin, as top-level modules (health_pb2, reflection_pb2), and
    puts out_dir on sys.path."""
    assert os.path.samefile(proto_dir, os.path.join(REPO, "proto")), \
        f"{proto_dir}: the attnserve package is generated from {REPO}/proto"
    check = subprocess.run([os.path.join(PACKAGE_DIR, "generate.sh"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    if package_from_checkout:
        sys.path.insert(0, PACKAGE_DIR)
    # The standard protos are compiled as top-level modules: a "grpc/" package
    # here would hide grpcio's own. (The package's own health calls keep their
    # messages out of the default descriptor pool, so these do not clash.)
    flat = os.path.join(out_dir, "flat")
    os.makedirs(flat, exist_ok=True)
    for proto in ["grpc/health/v1/health.proto", "grpc/reflection/v1alpha/reflection.proto"]:
        with open(os.path.join(GRPC_PROTO_DIR, proto)) as src, \
                open(os.path.join(flat, os.path.basename(proto)), "w") as dst:
            dst.write(src.read())
        subprocess.run(
            ["/usr/bin/protoc", f"-I{flat}", f"--python_out={out_dir}", f"--grpc_out={out_dir}",
             "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", os.path.join(flat, os.path.basename(proto))],
            check=True)
    sys.path.insert(0, out_dir)


def generate_open_inference_stubs(out_dir, proto_dir=os.path.join(REPO, "proto")):
    """Compiles the Open Inference Protocol's proto (proto_dir/inference/
    open_inference.proto) into out_dir with Debian's protoc and
    grpc_python_plugin, puts out_dir on sys.path and returns the modules
    (inference.open_inference_pb2, inference.open_inference_pb2_grpc). The
    attnserve package does not carry them: a protocol client brings its own."""
    import importlib
    subprocess.run(
        ["/usr/bin/protoc", f"-I{proto_dir}", f"--python_out={out_dir}", f"--grpc_out={out_dir}",
         "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         os.path.join(proto_dir, "inference", "open_inference.proto")], check=True)
    sys.path.insert(0, out_dir)
    return (importlib.import_module("inference.open_inference_pb2"),
            importlib.import_module("inference.open_inference_pb2_grpc"))


def run_tests_with_stubs(proto_dir, unittest_args, exit=True, package_from_checkout=True):
    """Generates the stubs into a temporary folder (removed afterwards) and runs
    the calling script's tests with the remaining command-line arguments;
    returns the unittest program when exit is False."""
    with tempfile.TemporaryDirectory() as stubs:
        generate_stubs(stubs, proto_dir, package_from_checkout)
        return unittest.main(module="__main__", argv=[sys.argv[0], "-v", *unittest_args], exit=exit)


# --- The reference: docs/seeded_weights.md, reimplemented independently ---

def seeded_uniform(seed, stream, n):
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (np.full(n, seed, dtype=np.uint64)
             + np.full(n, stream, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
             + i * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)


def seeded_weights(seed, d_model, num_heads, num_kv_heads, head_dim, context_dim=None):
    c = context_dim or d_model  # self-attention: the keys' and values' input is d_model wide
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shapes = [(d_model, q), (q,), (c, kv), (kv,), (c, kv), (kv,), (q, d_model), (d_model,)]
    fan_ins = [d_model] * 2 + [c] * 4 + [q, q]
    weights = []
    for stream, (shape, fan_in) in enumerate(zip(shapes, fan_ins)):
        u = seeded_uniform(seed, stream, int(np.prod(shape)))
        weights.append(((2.0 * u - 1.0) * (1.0 / np.sqrt(float(fan_in)))).astype(np.float32).reshape(shape))
    return weights


def reference_attention(x, weights, num_heads, num_kv_heads, head_dim, scale, causal=False):
    """x: [batch, seq, d_model]; returns output and per-head maps, float64.
    causal: query i sees keys j <= i only."""
    w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o = [w.astype(np.float64) for w in weights]
    x = x.astype(np.float64)
    batch, seq, _ = x.shape
    q = (x @ w_q + b_q).reshape(batch, seq, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = (x @ w_k + b_k).reshape(batch, seq, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (x @ w_v + b_v).reshape(batch, seq, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    group = num_heads // num_kv_heads
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head_dim)
    return ctx @ w_o + b_o, p


def rel_error(actual, expected):
    """Relative Frobenius error ||actual - expected|| / ||expected||."""
    return float(np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected))


def cpu_model():
    """The CPU's model name, family and model, and the vCPU count, for benchmark output."""
    with open("/proc/cpuinfo") as f:
        info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
    return f"{info['model name'].strip()} (family {info['cpu family'].strip()}, " \
           f"model {info['model'].strip()}), {os.cpu_count()} vCPUs"


def minor_faults(pid):
    """The minor page faults process `pid` has taken (/proc/PID/stat field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


class Server:
    """The attnserve binary on a free loopback port (port 0, read from its log);
    `env`: variables set for it on top of this process' environment."""

    def __init__(self, binary, *flags, env=None):
        self.seed = int(np.random.default_rng().integers(0, 2**63))
        self.proc = subprocess.Popen(
            # Metrics on a free loopback port too: the default 0.0.0.0:9464
            # would clash between tests running side by side.
            [binary, "--listen_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
             f"--builtin_model_seed={self.seed}", *flags],
            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.log = []
        self.metrics_port = None
        self.http_port = None  # with --http_address
        port_seen = threading.Event()
        self._metrics_seen = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                sys.stderr.write("  [attnserve] " + line)
                m = re.search(r"listening on port (\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    port_seen.set()
                m = re.search(r"HTTP on port (\d+)", line)
                if m:
                    self.http_port = int(m.group(1))
                m = re.search(r"metrics on port (\d+)", line)
                if m:
                    self.metrics_port = int(m.group(1))
                    self._metrics_seen.set()

        threading.Thread(target=pump, daemon=True).start()
        if not port_seen.wait(60):
            self.proc.kill()
            raise RuntimeError("attnserve did not report its port")
        self.target = f"127.0.0.1:{self.port}"

    def logged_serving(self):
        """Whether the server has logged that it serves (its models loaded and warm)."""
        return any("SERVING (" in line for line in list(self.log))

    def wait_serving(self, timeout=60):
        """Waits until the server logs that it serves (AssertionError after `timeout` s)."""
        wait_until("attnserve SERVING", self.logged_serving, timeout)

    def scrape_text(self):
        """The server's /metrics exposition text (once its metrics port is known)."""
        if not self._metrics_seen.wait(60):
            raise RuntimeError("attnserve did not report its metrics port")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200, response.status
            return response.read().decode()

    def scrape(self):
        """The server's /metrics as {(name, frozenset(labels.items())): value}."""
        return parse_exposition(self.scrape_text())

    def cpu_seconds(self):
        """User + system CPU time the server process has used (/proc/<pid>/stat)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            # Fields after the command name, which is in parentheses.
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_kib(self):
        """{"VmRSS": KiB, "VmHWM": KiB} of the server process (/proc/<pid>/status)."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0])
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def parse_exposition(text):
    """{(name, frozenset(labels.items())): value} of a Prometheus text exposition."""
    samples = {}
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        assert m, f"unparsable exposition line: {line!r}"
        labels = frozenset(label_re.findall(m.group(2) or ""))
        samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def metric(samples, name, **labels):
    """One sample of a parse_exposition result, 0.0 when the series is absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_until(what, check, timeout, interval=0.05):
    """Polls check() until it returns something true (returned) or `timeout`
    seconds pass (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_process(proc, timeout=10):
    """SIGTERM, then SIGKILL after `timeout` seconds; waits for the process."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_serving(health_stub, health_pb, timeout=60):
    """Polls grpc.health.v1 Check("") until SERVING."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = health_stub.Check(health_pb.HealthCheckRequest(service=""), timeout=2)
            if r.status == health_pb.HealthCheckResponse.SERVING:
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.05)
    raise AssertionError("attnserve never became SERVING")


def to_tensor(pb, array, dtype=None):
    """A numpy array as an attnserve Tensor (raw little-endian bytes; bool
    arrays as BOOL, anything else FP32, or BF16 with dtype="bf16"): the
    package's encoding (`pb` is the generated module, kept for the callers)."""
    from attnserve import tensors
    return tensors.encode(array, dtype)


def from_tensor(pb, tensor):
    """An attnserve Tensor (FP32 or BF16, raw or float_data) as a float32 array
    (FP32 raw data: a read-only view): the package's decoding."""
    from attnserve import tensors
    return tensors.decode(tensor)


def attend_stream(stub, pb, request, timeout=60):
    """Calls AttendStream and puts the maps back in place as they arrive (the
    package's MapAssembler): (response, maps as a float32 array or None,
    chunks). The response is the first message's (its attention_maps carry no
    values)."""
    from attnserve.messages import MapAssembler
    assembler, chunks = MapAssembler(), 0
    for message in stub.AttendStream(request, timeout=timeout):
        assembler.add(message)
        chunks += message.HasField("map_chunk")
    result = assembler.result()
    return result.message, result.maps, chunks


def bf16_round(array):
    """float32 values rounded to the nearest bfloat16 (ties to even), as
    float32: the package's rounding (its own test holds it to an independent
    one)."""
    from attnserve import tensors
    return tensors.bf16_round(array)


# oneDNN ISAs (ONEDNN_MAX_CPU_ISA values) below avx512_core_bf16.
_ISAS_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_MIC", "AVX512_MIC_4OPS",
                    "AVX512_CORE", "AVX512_CORE_VNNI"}


def machine_runs_bf16(environ=os.environ):
    """Whether a server started with `environ` must run BF16 requests in BF16,
    read apart from the server: /proc/cpuinfo shows AVX-512 F/BW/DQ/VL and
    avx512_bf16, and ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) does not cap
    oneDNN below avx512_core_bf16 -- the rule core::Bf16Supported() follows."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    has = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"} <= flags
    cap = environ.get("ONEDNN_MAX_CPU_ISA", environ.get("DNNL_MAX_CPU_ISA", ""))
    return has and cap.upper() not in _ISAS_BELOW_BF16


def write_safetensors(path, tensors, metadata=None):
    """Writes a safetensors file: tensors maps name -> (array, dtype) with dtype
    "F32", "F16" or "BF16" (values converted from the array, rounded to nearest
    even), or name -> (raw bytes, dtype, shape) for anything else."""
    import json
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, spec in tensors.items():
        if isinstance(spec[0], (bytes, bytearray)):
            data, dtype, shape = spec
        else:
            array, dtype = spec
            array = np.asarray(array, np.float32)
            shape = list(array.shape)
            if dtype == "F32":
                data = array.astype("<f4").tobytes()
            elif dtype == "F16":
                data = array.astype("<f2").tobytes()
            elif dtype == "BF16":
                data = (bf16_round(array).view("<u4") >> 16).astype("<u2").tobytes()
            else:
                raise ValueError(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
