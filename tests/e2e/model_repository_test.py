#!/usr/bin/python3
"""Checkpoints users already have, loaded by the running attnserve from a
--model_repository, and managed at run time.

Each layout is written from known weights: a real torch.nn.MultiheadAttention
state_dict (compared with the module's own output), a BERT-style state dict of
several layers built from torch.nn.Linear modules (layer 3 selected by its
prefix), GPT-2's fused Conv1D c_attn and a Llama layer with grouped-query heads
and RoPE (compared with a float64 reference in explicit torch ops, the one the
PyTorch parity test uses), in FP32, FP16 and BF16. Tolerances: relative
Frobenius error <= 1e-5 against the weights the checkpoint holds (for FP16 and
BF16 checkpoints: the rounded weights, which the server converts exactly).

Then: corrupt checkpoints each fail their model with a reason while the
others answer (among them a well-formed one declaring 208 GiB of weights, over
--max_model_bytes: the server starts and lives; and, with a budget that lets it
through, a server whose address space is limited runs out of memory loading it
and fails that model alone); LoadModel/UnloadModel/ListModels through attnctl with an admin
token; and the load time of a BERT-base-sized layer (printed).

Usage: model_repository_test.py --server PATH/attnserve --attnctl PATH/attnctl --proto_dir REPO/proto
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, bf16_round, from_tensor, run_tests_with_stubs, rel_error,  # noqa: E402
                     to_tensor, wait_serving, write_safetensors)
from torch_parity_test import explicit_torch_attention  # noqa: E402

ARGS = None
TOLERANCE = 1e-5
ADMIN_TOKEN = "admin-7c1e55d0a9"
USER_TOKEN = "user-2b8f14e6c3"


def rounded(array, dtype):
    array = np.asarray(array, np.float32)
    if dtype == "F16":
        return array.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return bf16_round(array)
    return array


# A Llama layer of a plausible configuration whose checkpoint declares 208 GiB
# of weights as FP32 (q_proj.weight and o_proj.weight [393216, 65536], 96 GiB
# each), and the bytes the server counts for it (its zero biases included).
HUGE_CONFIG = {"layout": "llama", "prefix": "model.layers.0.self_attn.", "d_model": 65536,
               "num_heads": 96, "num_kv_heads": 8, "head_dim": 4096}
HUGE_SHAPES = {"q_proj.weight": [393216, 65536], "k_proj.weight": [32768, 65536],
               "v_proj.weight": [32768, 65536], "o_proj.weight": [65536, 393216]}
HUGE_FP32_BYTES = 4 * (sum(r * c for r, c in HUGE_SHAPES.values()) + 393216 + 2 * 32768 + 65536)
MAX_MODEL_BYTES = 3 << 30  # the servers' --max_model_bytes (not its default: the messages show it is used)


def write_huge_model(repo, name):
    folder = os.path.join(repo, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(HUGE_CONFIG, f)
    write_sparse_safetensors(os.path.join(folder, "model.safetensors"),
                             {HUGE_CONFIG["prefix"] + n: ("F32", shape) for n, shape in HUGE_SHAPES.items()})


def write_sparse_safetensors(path, tensors):
    """A well-formed safetensors file whose header declares `tensors` (name ->
    (dtype, shape)), extended to the size the header needs without writing
    the data (a sparse file: no disk blocks)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = int(np.prod(shape)) * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.truncate(8 + len(text) + offset)


def attention_stub(channel):
    from attnserve.v1 import attention_pb2_grpc
    return attention_pb2_grpc.AttentionServiceStub(channel)


def write_model(repo, name, config, tensors):
    folder = os.path.join(repo, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(folder, config.get("weights", "model.safetensors")), tensors)


class Checkpoints:
    """The checkpoints of every layout and what each should compute."""

    def __init__(self, repo, torch, rng):
        self.repo, self.torch, self.rng = repo, torch, rng
        self.expected = {}  # name -> (cfg, weights [in, out] float64 torch tensors, causal)

    def add_reference(self, name, cfg, w, causal):
        t = self.torch
        self.expected[name] = (cfg, {k: t.tensor(np.asarray(v, np.float64)) for k, v in w.items()}, causal)

    def torch_mha(self, name, d, heads, dtype):
        torch = self.torch
        mha = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        with torch.no_grad():
            for p in mha.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
        state = {f"attn.{k}": (v.numpy(), dtype) for k, v in mha.state_dict().items()}
        write_model(self.repo, name, {"layout": "torch_mha", "prefix": "attn.", "d_model": d,
                                      "num_heads": heads}, state)
        if dtype == "F32":
            self.expected[name] = ("module", mha, False)
        else:
            sd = {k: rounded(v.numpy(), dtype) for k, v in mha.state_dict().items()}
            w = {"w_q": sd["in_proj_weight"][:d].T, "w_k": sd["in_proj_weight"][d:2 * d].T,
                 "w_v": sd["in_proj_weight"][2 * d:].T, "b_q": sd["in_proj_bias"][:d],
                 "b_k": sd["in_proj_bias"][d:2 * d], "b_v": sd["in_proj_bias"][2 * d:],
                 "w_o": sd["out_proj.weight"].T, "b_o": sd["out_proj.bias"]}
            self.add_reference(name, self.cfg(d, heads, heads), w, False)

    def cfg(self, d, heads, kv_heads, rotary_dim=0, theta=10000.0):
        hd = d // heads
        return {"d_model": d, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": hd,
                "scale": 1.0 / np.sqrt(hd), "rotary_dim": rotary_dim, "theta": theta}

    def bert(self, name, d, heads, layers, layer, dtype):
        """A BERT encoder's attention blocks from torch.nn.Linear modules; the
        config selects `layer` by its prefix."""
        torch = self.torch
        state, chosen = {}, None
        for i in range(layers):
            mods = {n: torch.nn.Linear(d, d) for n in ["self.query", "self.key", "self.value", "output.dense"]}
            with torch.no_grad():
                for m in mods.values():
                    m.weight.copy_(torch.randn_like(m.weight) * 0.2)
                    m.bias.copy_(torch.randn_like(m.bias) * 0.2)
            for n, m in mods.items():
                for k, v in m.state_dict().items():
                    state[f"bert.encoder.layer.{i}.attention.{n}.{k}"] = (v.numpy(), dtype)
            state[f"bert.encoder.layer.{i}.attention.output.LayerNorm.weight"] = (np.ones(d), dtype)
            if i == layer:
                chosen = mods
        write_model(self.repo, name, {"layout": "bert", "prefix": f"bert.encoder.layer.{layer}.attention.",
                                      "d_model": d, "num_heads": heads,
                                      "description": f"BERT layer {layer} of {layers}"}, state)
        r = {n: (rounded(m.weight.detach().numpy(), dtype), rounded(m.bias.detach().numpy(), dtype))
             for n, m in chosen.items()}
        w = {"w_q": r["self.query"][0].T, "b_q": r["self.query"][1], "w_k": r["self.key"][0].T,
             "b_k": r["self.key"][1], "w_v": r["self.value"][0].T, "b_v": r["self.value"][1],
             "w_o": r["output.dense"][0].T, "b_o": r["output.dense"][1]}
        self.add_reference(name, self.cfg(d, heads, heads), w, False)

    def gpt2(self, name, d, heads, dtype):
        g = lambda *shape: (self.rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
        c_attn_w, c_attn_b, c_proj_w, c_proj_b = g(d, 3 * d), g(3 * d), g(d, d), g(d)
        write_model(self.repo, name, {"layout": "gpt2", "prefix": "h.5.attn.", "d_model": d, "num_heads": heads},
                    {"h.5.attn.c_attn.weight": (c_attn_w, dtype), "h.5.attn.c_attn.bias": (c_attn_b, dtype),
                     "h.5.attn.c_proj.weight": (c_proj_w, dtype), "h.5.attn.c_proj.bias": (c_proj_b, dtype),
                     "h.5.attn.bias": (np.tril(np.ones((4, 4), np.float32)), "F32")})
        aw, ab = rounded(c_attn_w, dtype), rounded(c_attn_b, dtype)
        w = {"w_q": aw[:, :d], "w_k": aw[:, d:2 * d], "w_v": aw[:, 2 * d:], "b_q": ab[:d],
             "b_k": ab[d:2 * d], "b_v": ab[2 * d:], "w_o": rounded(c_proj_w, dtype),
             "b_o": rounded(c_proj_b, dtype)}
        self.add_reference(name, self.cfg(d, heads, heads), w, True)  # GPT-2 is causal by default

    def llama(self, name, d, heads, kv_heads, dtype):
        hd = d // heads
        g = lambda *shape: (self.rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
        q, k, v, o = g(heads * hd, d), g(kv_heads * hd, d), g(kv_heads * hd, d), g(d, heads * hd)
        p = "model.layers.7.self_attn."
        write_model(self.repo, name, {"layout": "llama", "prefix": p, "d_model": d, "num_heads": heads,
                                      "num_kv_heads": kv_heads, "rotary": {"dim": hd, "theta": 10000.0}},
                    {p + "q_proj.weight": (q, dtype), p + "k_proj.weight": (k, dtype),
                     p + "v_proj.weight": (v, dtype), p + "o_proj.weight": (o, dtype)})
        zeros = lambda n: np.zeros(n, np.float32)  # noqa: E731
        w = {"w_q": rounded(q, dtype).T, "w_k": rounded(k, dtype).T, "w_v": rounded(v, dtype).T,
             "w_o": rounded(o, dtype).T, "b_q": zeros(heads * hd), "b_k": zeros(kv_heads * hd),
             "b_v": zeros(kv_heads * hd), "b_o": zeros(d)}
        self.add_reference(name, self.cfg(d, heads, kv_heads, rotary_dim=hd), w, True)


class ModelRepositoryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        import torch
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2
        import health_pb2_grpc
        torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
        cls.torch, cls.pb, cls.grpc = torch, attention_pb2, grpc
        cls.tmp = tempfile.mkdtemp(prefix="attnserve_repo_")
        cls.repo = os.path.join(cls.tmp, "repo")
        os.makedirs(cls.repo)
        cls.rng = np.random.default_rng()
        ck = Checkpoints(cls.repo, torch, cls.rng)
        ck.torch_mha("mha", 64, 4, "F32")
        ck.torch_mha("mha_bf16", 32, 2, "BF16")
        ck.bert("bert_l3", 48, 4, 5, 3, "F32")
        ck.bert("bert_fp16", 32, 2, 2, 1, "F16")
        ck.gpt2("gpt2", 32, 4, "F32")
        ck.gpt2("gpt2_bf16", 32, 2, "BF16")
        ck.llama("llama_gqa", 64, 8, 2, "F32")
        ck.llama("llama_bf16", 32, 4, 1, "BF16")
        cls.expected = ck.expected
        cls.corrupt = cls.write_corrupt()
        tokens = os.path.join(cls.tmp, "tokens")
        with open(tokens, "w") as f:
            f.write(f"{USER_TOKEN}\nadmin:{ADMIN_TOKEN}\n")
        cls.server = Server(ARGS.server, f"--model_repository={cls.repo}", f"--auth_tokens_file={tokens}",
                            f"--max_model_bytes={MAX_MODEL_BYTES}")
        cls.channel = grpc.insecure_channel(cls.server.target)
        cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        wait_serving(health_pb2_grpc.HealthStub(cls.channel), health_pb2)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def write_corrupt(cls):
        """Model folders with one defect each -> the reason expected."""
        good = os.path.join(cls.repo, "gpt2")
        with open(os.path.join(good, "model.safetensors"), "rb") as f:
            data = f.read()
        with open(os.path.join(good, "config.json")) as f:
            config = json.load(f)
        cases = {
            "c_truncated": (data[:-10], config, "out of range, or the file is truncated"),
            "c_header_len": ((10**9).to_bytes(8, "little") + data[8:], config, "passes the end of the file"),
            "c_not_json": (len(b"{nope").to_bytes(8, "little") + b"{nope", config, "header is not valid JSON"),
            "c_bad_dtype": (None, config, "unknown dtype 'F99'"),
            "c_int_dtype": (None, config, "has dtype I32; weights must be F32, BF16 or F16"),
            "c_mis_shaped": (data, dict(config, d_model=64, num_heads=4),
                             "'h.5.attn.c_attn.weight' has shape [32, 96]; the head configuration needs [64, 192]"),
            "c_missing": (data, dict(config, prefix="h.6.attn."), "no tensor named 'h.6.attn.c_attn.weight'"),
            "c_huge": (None, HUGE_CONFIG, f"over --max_model_bytes ({MAX_MODEL_BYTES} bytes"),
        }
        for name, (blob, cfg, _) in cases.items():
            folder = os.path.join(cls.repo, name)
            os.makedirs(folder)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(cfg, f)
            path = os.path.join(folder, "model.safetensors")
            if name == "c_bad_dtype":
                write_safetensors(path, {"h.5.attn.c_attn.weight": (b"\0" * 16, "F99", [4])})
            elif name == "c_huge":
                write_huge_model(cls.repo, name)
            elif name == "c_int_dtype":
                write_safetensors(path, {"h.5.attn.c_attn.weight": (b"\0" * (32 * 96 * 4), "I32", [32, 96]),
                                         "h.5.attn.c_attn.bias": (np.zeros(96), "F32"),
                                         "h.5.attn.c_proj.weight": (np.zeros((32, 32)), "F32"),
                                         "h.5.attn.c_proj.bias": (np.zeros(32), "F32")})
            else:
                with open(path, "wb") as f:
                    f.write(blob)
        return {name: reason for name, (_, _, reason) in cases.items()}

    def md(self, token=USER_TOKEN):
        return [("authorization", f"Bearer {token}")]

    def attend(self, model, x, **kw):
        return self.stub.Attend(self.pb.AttendRequest(model=model, hidden_states=to_tensor(self.pb, x), **kw),
                                metadata=self.md(), timeout=60)

    def test_every_layout_matches_its_reference(self):
        torch = self.torch
        for name, (cfg, w, causal) in self.expected.items():
            with self.subTest(name):
                info = self.stub.GetModel(self.pb.GetModelRequest(name=name), metadata=self.md(), timeout=60)
                self.assertEqual(info.state, self.pb.MODEL_STATE_READY, info.failure_reason)
                self.assertEqual(info.causal, causal)
                d = info.head_config.d_model
                batch, seq = 2, int(self.rng.integers(3, 12))
                x = (self.rng.standard_normal((batch, seq, d)) * 0.5).astype(np.float32)
                out = from_tensor(self.pb, self.attend(name, x).output)
                if cfg == "module":
                    with torch.no_grad():
                        expected, _ = w(*(torch.tensor(x),) * 3, need_weights=False)
                    expected = expected.double().numpy()
                else:
                    n = torch.full((batch,), seq)
                    expected, _ = explicit_torch_attention(
                        torch.tensor(x, dtype=torch.float64), None, w, cfg, n, n, causal, None,
                        torch.ones(cfg["num_heads"], dtype=torch.float64), torch.zeros(batch, dtype=torch.long))
                    expected = expected.numpy()
                err = rel_error(out, expected)
                print(f"  {name}: relative error {err:.2e}", file=sys.stderr)
                self.assertLessEqual(err, TOLERANCE, name)

    def test_each_corrupt_checkpoint_fails_with_its_reason_and_others_answer(self):
        pb = self.pb
        models = {m.name: m for m in self.stub.ListModels(pb.ListModelsRequest(), metadata=self.md(),
                                                          timeout=60).models}
        x = np.zeros((1, 2, 32), np.float32)
        for name, reason in self.corrupt.items():
            with self.subTest(name):
                self.assertEqual(models[name].state, pb.MODEL_STATE_FAILED)
                self.assertIn(reason, models[name].failure_reason)
                self.assertIn(f"{name}/", models[name].failure_reason)  # names the file
                with self.assertRaises(self.grpc.RpcError) as e:
                    self.attend(name, x)
                self.assertEqual(e.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION)
                with self.assertRaises(self.grpc.RpcError) as e:
                    self.stub.LoadModel(pb.LoadModelRequest(name=name), metadata=self.md(ADMIN_TOKEN), timeout=60)
                self.assertEqual(e.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn(reason, e.exception.details())
                self.assertEqual(self.attend("gpt2", x).output.shape, [1, 2, 32])

    def test_a_checkpoint_declaring_96_gib_fails_its_model_and_the_server_lives(self):
        """The 208 GiB model was in the repository at start-up: the server
        started, the model is FAILED with the bytes it needs and the limit,
        nothing near its size was ever resident, and a LoadModel of it at run
        time answers the same while the other models serve."""
        pb = self.pb
        info = self.stub.GetModel(pb.GetModelRequest(name="c_huge"), metadata=self.md(), timeout=60)
        self.assertEqual(info.state, pb.MODEL_STATE_FAILED)
        self.assertIn(f"take {HUGE_FP32_BYTES} bytes as FP32", info.failure_reason)
        self.assertIn(f"over --max_model_bytes ({MAX_MODEL_BYTES} bytes", info.failure_reason)
        with self.assertRaises(self.grpc.RpcError) as e:
            self.stub.LoadModel(pb.LoadModelRequest(name="c_huge"), metadata=self.md(ADMIN_TOKEN), timeout=60)
        self.assertEqual(e.exception.code(), self.grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(f"take {HUGE_FP32_BYTES} bytes as FP32", e.exception.details())
        self.assertIsNone(self.server.proc.poll(), "attnserve exited")
        x = (self.rng.standard_normal((1, 3, 64)) * 0.5).astype(np.float32)
        self.assertEqual(self.attend("llama_gqa", x).output.shape, [1, 3, 64])
        peak_kib = self.server.memory_kib()["VmHWM"]
        print(f"  attnserve peak RSS with the 208 GiB model refused: {peak_kib / 1024:.0f} MiB", file=sys.stderr)
        self.assertLess(peak_kib, 1 << 20, "peak RSS passed 1 GiB")

    def test_running_out_of_memory_while_loading_fails_the_model_not_the_process(self):
        """With a budget that lets the 208 GiB model through, loading it runs
        out of memory (the server runs with its address space limited to
        16 GiB, so it does whatever the machine has): the model is FAILED with
        the tensor it could not hold, LoadModel of it answers
        RESOURCE_EXHAUSTED, and the process lives and serves its other model."""
        import health_pb2
        import health_pb2_grpc
        grpc, pb = self.grpc, self.pb
        repo = os.path.join(self.tmp, "oom_repo")
        os.makedirs(repo)
        Checkpoints(repo, self.torch, self.rng).gpt2("small", 32, 2, "F32")
        write_huge_model(repo, "huge")
        wrapper = os.path.join(self.tmp, "attnserve_16g")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nulimit -v {16 << 20}\nexec "{os.path.abspath(ARGS.server)}" "$@"\n')
        os.chmod(wrapper, 0o755)
        server = Server(wrapper, f"--model_repository={repo}", f"--max_model_bytes={1 << 40}")
        channel = None
        try:
            channel = grpc.insecure_channel(server.target)
            stub = attention_stub(channel)
            wait_serving(health_pb2_grpc.HealthStub(channel), health_pb2)
            info = stub.GetModel(pb.GetModelRequest(name="huge"), timeout=60)
            self.assertEqual(info.state, pb.MODEL_STATE_FAILED)
            self.assertIn("huge/model.safetensors: out of memory reading tensor "
                          "'model.layers.0.self_attn.q_proj.weight' (103079215104 bytes as FP32)",
                          info.failure_reason)
            with self.assertRaises(grpc.RpcError) as e:
                stub.LoadModel(pb.LoadModelRequest(name="huge"), timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("out of memory reading tensor", e.exception.details())
            self.assertIsNone(server.proc.poll(), "attnserve exited")
            x = (self.rng.standard_normal((1, 3, 32)) * 0.5).astype(np.float32)
            out = stub.Attend(pb.AttendRequest(model="small", hidden_states=to_tensor(pb, x)), timeout=60)
            self.assertEqual(out.output.shape, [1, 3, 32])
        finally:
            if channel is not None:
                channel.close()
            server.stop()

    def attnctl(self, *args, token=ADMIN_TOKEN):
        token_file = os.path.join(self.tmp, "admin_token" if token == ADMIN_TOKEN else "user_token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        proc = subprocess.run([ARGS.attnctl, *args, f"--target={self.server.target}", f"--token_file={token_file}"],
                              capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr

    def test_attnctl_loads_and_unloads_with_an_admin_token(self):
        folder = os.path.join(self.repo, "late")
        Checkpoints(self.repo, self.torch, self.rng).bert("late", 32, 2, 1, 0, "F32")
        code, out = self.attnctl("load", "--model=late", token=USER_TOKEN)
        self.assertNotEqual(code, 0)
        self.assertIn("PERMISSION_DENIED", out)
        code, out = self.attnctl("load", "--model=late")
        self.assertEqual(code, 0, out)
        self.assertIn("late  [READY]", out)
        code, out = self.attnctl("models", token=USER_TOKEN)
        self.assertEqual(code, 0, out)
        self.assertIn("c_truncated  [FAILED]", out)
        self.assertIn("late  [READY]", out)
        self.assertIn("gpt2  [READY] causal", out)
        code, out = self.attnctl("unload", "--model=late")
        self.assertEqual(code, 0, out)
        code, out = self.attnctl("model", "--model=late", token=USER_TOKEN)
        self.assertIn("NOT_FOUND", out)
        shutil.rmtree(folder)

    def test_load_time_of_a_bert_base_layer(self):
        """Prints the LoadModel time (read, convert, build, warm up) of a
        768-wide, 12-head BERT layer from a 12-layer checkpoint, per dtype."""
        for dtype in ["F32", "BF16"]:
            name = f"bert_base_{dtype.lower()}"
            start = time.monotonic()
            Checkpoints(self.repo, self.torch, self.rng).bert(name, 768, 12, 12, 3, dtype)
            written = time.monotonic() - start
            size = os.path.getsize(os.path.join(self.repo, name, "model.safetensors"))
            times = []
            for _ in range(3):
                start = time.monotonic()
                r = self.stub.LoadModel(self.pb.LoadModelRequest(name=name), metadata=self.md(ADMIN_TOKEN),
                                        timeout=120)
                times.append(time.monotonic() - start)
                self.assertEqual(r.model.state, self.pb.MODEL_STATE_READY)
                self.stub.UnloadModel(self.pb.UnloadModelRequest(name=name), metadata=self.md(ADMIN_TOKEN),
                                      timeout=60)
            print(f"  LoadModel {name} ({size / 2**20:.0f} MiB file, 12 layers, layer 3 loaded): "
                  f"median {sorted(times)[1] * 1000:.1f} ms of {[round(t * 1000, 1) for t in times]} "
                  f"(written in {written:.1f} s)", file=sys.stderr)
            shutil.rmtree(os.path.join(self.repo, name))


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    parser.add_argument("--proto_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("model_repository_test: python3-torch is missing (deploy/install_deps.sh installs it)")
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
