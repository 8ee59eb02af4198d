#!/usr/bin/python3
"""The well-behaved client of the hostile-client suite, in a process of its own
(so that neither the attacker nor the measuring process takes its CPU).

  good_client.py --kind grpc --target 127.0.0.1:PORT --stubs DIR --seed SEED [--token T]
  good_client.py --kind metrics --target 127.0.0.1:METRICS_PORT

sends calls at a fixed rate (open loop: one every 1/--rate seconds whatever
the earlier ones are doing), each with a deadline, and prints one JSON line per
finished call: {"t": start (time.monotonic(), the same clock in every process),
"lat": seconds, "code": "OK" or what went wrong}. It stops when its standard
input closes or after --max_seconds, once its calls have finished.

grpc: Attend on the built-in model with one of four fresh random inputs
[1, 16, 768]; "OK" only when the output is the float64 reference of the
seeded weights (docs/seeded_weights.md) within 1e-5 relative, else
"WRONG_ANSWER". Every second it opens a new channel (its own TCP connection):
a server that still serves old connections but no longer accepts new ones
fails these calls.
metrics: GET /metrics on a new connection; "OK" for a 200 whose body holds
attnserve_ samples.
"""
import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
FP32_VS_REFERENCE = 1e-5  # as tests/e2e/fault_test.py: an FP32 answer against the float64 reference
D_MODEL, NUM_HEADS, HEAD_DIM = 768, 12, 64  # the built-in model


class Recorder:
    def __init__(self):
        self._lock = threading.Lock()
        self.outstanding = 0

    def started(self):
        with self._lock:
            self.outstanding += 1

    def finished(self, t0, code):
        line = json.dumps({"t": t0, "lat": time.monotonic() - t0, "code": code})
        with self._lock:
            self.outstanding -= 1
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def grpc_caller(a, recorder):
    """A function that starts one Attend call and records it when it ends."""
    from harness import PACKAGE_DIR, from_tensor, reference_attention, rel_error, seeded_weights, to_tensor
    # The attnserve package (its generated code) from the checkout, as the
    # parent process has it (harness.generate_stubs); --stubs for the rest.
    sys.path[:0] = [a.stubs, PACKAGE_DIR]
    import grpc
    import numpy as np
    from attnserve.v1 import attention_pb2, attention_pb2_grpc

    rng = np.random.default_rng()
    weights = seeded_weights(a.seed, D_MODEL, NUM_HEADS, NUM_HEADS, HEAD_DIM)
    cases = []
    for _ in range(4):
        x = rng.standard_normal((1, 16, D_MODEL)).astype(np.float32)
        expected = reference_attention(x, weights, NUM_HEADS, NUM_HEADS, HEAD_DIM,
                                       1.0 / np.sqrt(HEAD_DIM))[0]
        request = attention_pb2.AttendRequest(model="default",
                                              hidden_states=to_tensor(attention_pb2, x))
        cases.append((request, expected))
    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else None
    state = {"channel": None, "opened": 0.0, "old": [], "n": 0}

    def channel():
        now = time.monotonic()
        if state["channel"] is None or now - state["opened"] >= 1.0:
            if state["channel"] is not None:
                state["old"].append((now, state["channel"]))
            # A channel of its own (no shared subchannel): a new TCP connection.
            state["channel"] = grpc.insecure_channel(a.target, options=[
                ("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)])
            state["stub"] = attention_pb2_grpc.AttentionServiceStub(state["channel"])
            state["opened"] = now
        # Channels whose calls have all ended (past their deadline) are closed.
        while state["old"] and now - state["old"][0][0] > a.deadline + 2:
            state["old"].pop(0)[1].close()
        return state["stub"]

    def call():
        request, expected = cases[state["n"] % len(cases)]
        state["n"] += 1
        stub = channel()
        t0 = time.monotonic()
        recorder.started()
        future = stub.Attend.future(request, timeout=a.deadline, metadata=metadata)

        def done(f):
            try:
                out = from_tensor(attention_pb2, f.result().output)
                code = "OK" if rel_error(out, expected) <= FP32_VS_REFERENCE else "WRONG_ANSWER"
            except grpc.RpcError as e:
                code = e.code().name
            except grpc.FutureCancelledError:
                code = "CANCELLED_BY_CLIENT"
            except Exception as e:  # noqa: BLE001 -- recorded, never lost
                code = f"CLIENT_ERROR {e.__class__.__name__}"
            recorder.finished(t0, code)

        future.add_done_callback(done)

    def close():
        for _, c in state["old"]:
            c.close()
        if state["channel"] is not None:
            state["channel"].close()

    return call, close


def metrics_caller(a, recorder):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=32)
    url = f"http://{a.target}/metrics"

    def one(t0):
        try:
            with urllib.request.urlopen(url, timeout=a.deadline) as response:
                body = response.read()
            code = "OK" if response.status == 200 and b"attnserve_" in body else "BAD_BODY"
        except urllib.error.HTTPError as e:
            code = f"HTTP_{e.code}"
        except urllib.error.URLError as e:
            code = f"URL_ERROR {getattr(e.reason, '__class__', type(e)).__name__}"
        except (TimeoutError, OSError) as e:
            code = f"ERROR {e.__class__.__name__}"
        recorder.finished(t0, code)

    def call():
        t0 = time.monotonic()
        recorder.started()
        pool.submit(one, t0)

    return call, lambda: pool.shutdown(wait=False, cancel_futures=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["grpc", "metrics"], required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--stubs", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--rate", type=float, default=10)
    parser.add_argument("--deadline", type=float, default=10)
    parser.add_argument("--max_seconds", type=float, default=600)
    a = parser.parse_args()
    if not a.target.startswith(("127.", "localhost:")):
        sys.exit("good_client.py: only loopback targets")
    stop = threading.Event()

    def watch_stdin():
        sys.stdin.read()  # returns when the parent closes our stdin
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    recorder = Recorder()
    call, close = (grpc_caller if a.kind == "grpc" else metrics_caller)(a, recorder)
    start = time.monotonic()
    end = start + a.max_seconds
    i = 0
    while not stop.is_set() and time.monotonic() < end:
        if recorder.outstanding < a.rate * a.deadline * 2:
            call()
        else:
            recorder.started()
            recorder.finished(time.monotonic(), "CLIENT_BACKLOG")
        i += 1
        stop.wait(max(0.0, start + i / a.rate - time.monotonic()))
    # The calls started finish within their deadline.
    deadline = time.monotonic() + a.deadline + 5
    while recorder.outstanding > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    close()


if __name__ == "__main__":
    main()
