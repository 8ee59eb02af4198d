#!/usr/bin/python3
"""Parity with PyTorch: the running attnserve against torch on the same inputs.

torch.nn.MultiheadAttention (batch_first, key_padding_mask, attn_mask,
need_weights with average_attn_weights both ways, kdim/vdim for
cross-attention) and explicit torch ops for grouped-query attention, RoPE and
head masks. Each configuration is random and fresh; the layer's weights travel
inline (LayerSpec.inline_weights), so the server runs exactly torch's weights.

Compared: the output rows of every real (non-padding) query, and the
attention weights of those rows. Tolerances: FP32 relative Frobenius error
<= 1e-5, BF16 <= 2e-2.

Usage: torch_parity_test.py --server PATH/attnserve --proto_dir REPO/proto [--trials N]
"""
import argparse
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Server, from_tensor, run_tests_with_stubs, machine_runs_bf16, rel_error,  # noqa: E402
                     to_tensor, wait_serving)

ARGS = None
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2


def rotate_half_rope(t, positions, rotary_dim, theta):
    """Llama RoPE on t [batch, heads, seq, head_dim]; positions [batch, seq]."""
    import torch
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / rotary_dim))
    angles = positions[:, None, :, None].double() * inv_freq  # [b, 1, s, half]
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2, rest = t[..., :half], t[..., half:rotary_dim], t[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def explicit_torch_attention(x, ctx, w, cfg, q_len, kv_len, causal, allowed, head_mask, offsets):
    """The layer in explicit torch ops, float64. x [b, s, d], ctx [b, t, dc] or None.
    w: dict of [in, out] weights. Returns output [b, s, d] and weights [b, h, s, t]."""
    import torch
    d, h, kvh, hd = cfg["d_model"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    src = x if ctx is None else ctx
    b, s, _ = x.shape
    t = src.shape[1]
    q = (x @ w["w_q"] + w["b_q"]).view(b, s, h, hd).transpose(1, 2)
    k = (src @ w["w_k"] + w["b_k"]).view(b, t, kvh, hd).transpose(1, 2)
    v = (src @ w["w_v"] + w["b_v"]).view(b, t, kvh, hd).transpose(1, 2)
    if cfg["rotary_dim"]:
        q_pos = torch.arange(s)[None, :] + offsets[:, None]
        k_pos = torch.arange(t)[None, :] + (offsets[:, None] if ctx is None else 0)
        q = rotate_half_rope(q, q_pos, cfg["rotary_dim"], cfg["theta"])
        k = rotate_half_rope(k, k_pos, cfg["rotary_dim"], cfg["theta"])
    group = h // kvh
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * cfg["scale"]
    ok = torch.ones(b, 1, s, t, dtype=torch.bool)
    ok &= (torch.arange(t)[None, :] < kv_len[:, None])[:, None, None, :]
    if causal:
        ok &= torch.ones(s, t, dtype=torch.bool).tril()[None, None]
    if allowed is not None:
        ok &= allowed[:, None]
    scores = scores.masked_fill(~ok, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: weights 0 (attnserve's rule)
    p = p * head_mask[None, :, None, None]
    ctx_heads = (p @ v).transpose(1, 2).reshape(b, s, h * hd)
    return ctx_heads @ w["w_o"] + w["b_o"], p


class TorchParity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc
        import torch
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
        import health_pb2
        import health_pb2_grpc
        torch.set_num_threads(2)
        cls.torch, cls.pb = torch, attention_pb2
        cls.server = Server(ARGS.server)
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
        cls.stub = attention_pb2_grpc.AttentionServiceStub(cls.channel)
        wait_serving(health_pb2_grpc.HealthStub(cls.channel), health_pb2)
        cls.rng = np.random.default_rng()
        print(f"torch {torch.__version__}, trials {ARGS.trials}", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    def layer_spec(self, cfg, w):
        pb = self.pb
        head = pb.HeadConfig(d_model=cfg["d_model"], num_heads=cfg["num_heads"],
                             num_kv_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"],
                             scale=cfg["scale"], context_dim=cfg.get("context_dim", 0),
                             rotary=pb.RotaryConfig(rotary_dim=cfg.get("rotary_dim", 0),
                                                    theta=cfg.get("theta", 0.0)))
        weights = pb.LayerWeights(**{name: to_tensor(pb, w[name].detach().numpy().astype(np.float32))
                                     for name in ["w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o"]})
        return pb.LayerSpec(head_config=head, inline_weights=weights)

    def lengths(self, batch, max_len):
        n = self.rng.integers(1, max_len + 1, size=batch)
        n[self.rng.integers(batch)] = max_len  # the padded length is the longest
        return n

    def compare(self, label, ours, theirs, q_len, tolerance):
        """Compares rows of real queries: ours/theirs [batch, (heads,) seq, ...]."""
        for b, n in enumerate(q_len):
            a, e = ours[b][..., :n, :], theirs[b][..., :n, :]
            if np.linalg.norm(e) == 0:
                self.assertLessEqual(float(np.abs(a).max()), 1e-6, f"{label} b={b}")
            else:
                self.assertLessEqual(rel_error(a, e), tolerance, f"{label} b={b}")

    def test_multihead_attention_module(self):
        torch, pb = self.torch, self.pb
        for trial in range(ARGS.trials):
            heads = int(self.rng.choice([1, 2, 4, 8]))
            d = heads * int(self.rng.choice([4, 8, 16]))
            batch, seq = int(self.rng.integers(1, 4)), int(self.rng.integers(1, 10))
            kind = self.rng.choice(["self", "causal", "cross"])
            kdim = int(self.rng.choice([d, 24])) if kind == "cross" else d
            ctx_len = int(self.rng.integers(1, 12)) if kind == "cross" else seq
            average = bool(self.rng.integers(2))
            label = f"trial {trial}: {kind} d={d} h={heads} b={batch} s={seq} t={ctx_len} kdim={kdim} avg={average}"
            with self.subTest(label):
                mha = torch.nn.MultiheadAttention(d, heads, batch_first=True, kdim=kdim, vdim=kdim)
                with torch.no_grad():
                    for p in mha.parameters():
                        p.copy_(torch.randn_like(p) * 0.2)
                x = torch.randn(batch, seq, d)
                ctx = torch.randn(batch, ctx_len, kdim) if kind == "cross" else x
                kv_len = self.lengths(batch, ctx_len)
                q_len = kv_len if kind != "cross" else np.full(batch, seq)
                key_padding = torch.arange(ctx_len)[None, :] >= torch.as_tensor(kv_len)[:, None]
                attn_mask = None
                allowed = np.ones((1, seq, ctx_len), bool)
                if kind == "causal":
                    attn_mask = torch.ones(seq, ctx_len, dtype=torch.bool).triu(1)  # True = masked
                elif self.rng.integers(2):
                    blocked = self.rng.random((seq, ctx_len)) < 0.3
                    blocked[:, 0] = False  # no row fully masked (torch would give NaN)
                    attn_mask = torch.as_tensor(blocked)
                    allowed = ~blocked[None]
                out, weights = mha(x, ctx, ctx, key_padding_mask=key_padding, attn_mask=attn_mask,
                                   need_weights=True, average_attn_weights=average)

                if mha._qkv_same_embed_dim:
                    wq, wk, wv = mha.in_proj_weight.chunk(3)
                else:
                    wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
                bq, bk, bv = mha.in_proj_bias.chunk(3)
                w = {"w_q": wq.T, "b_q": bq, "w_k": wk.T, "b_k": bk, "w_v": wv.T, "b_v": bv,
                     "w_o": mha.out_proj.weight.T, "b_o": mha.out_proj.bias}
                cfg = {"d_model": d, "num_heads": heads, "num_kv_heads": heads,
                       "head_dim": d // heads, "scale": 1.0 / np.sqrt(d // heads),
                       "context_dim": kdim if kdim != d else 0}
                request = pb.AttendRequest(
                    layer=self.layer_spec(cfg, w), hidden_states=to_tensor(pb, x.numpy()),
                    causal=kind == "causal",
                    attention_maps=pb.AttentionMapRequest(
                        mode=pb.ATTENTION_MAP_MODE_MEAN if average else pb.ATTENTION_MAP_MODE_PER_HEAD))
                if kind == "cross":
                    request.context.CopyFrom(to_tensor(pb, ctx.numpy()))
                    request.context_lengths.extend(int(n) for n in kv_len)
                else:
                    request.sequence_lengths.extend(int(n) for n in kv_len)
                if attn_mask is not None and kind != "causal":
                    request.mask.kind = pb.AttentionMask.KIND_ALLOWED
                    request.mask.values.CopyFrom(to_tensor(pb, allowed))
                r = self.stub.Attend(request, timeout=60)
                self.compare(label + " output", from_tensor(pb, r.output),
                             out.detach().numpy().astype(np.float64), q_len, FP32_TOLERANCE)
                self.compare(label + " weights", from_tensor(pb, r.attention_maps),
                             weights.detach().numpy().astype(np.float64), q_len, FP32_TOLERANCE)

    def test_grouped_query_rope_and_head_mask_in_explicit_torch_ops(self):
        torch, pb = self.torch, self.pb
        for trial in range(ARGS.trials):
            kv_heads = int(self.rng.choice([1, 2, 4]))
            heads = kv_heads * int(self.rng.choice([1, 2, 4]))
            head_dim = int(self.rng.choice([4, 8, 16]))
            d = int(self.rng.choice([heads * head_dim, 48]))
            rotary_dim = int(self.rng.choice([0, head_dim, head_dim // 2])) // 2 * 2
            theta = float(self.rng.choice([10000.0, 500.0]))
            batch, seq = int(self.rng.integers(1, 4)), int(self.rng.integers(1, 10))
            causal = bool(self.rng.integers(2))
            packed = bool(self.rng.integers(2))
            label = (f"trial {trial}: d={d} h={heads} kv={kv_heads} hd={head_dim} rot={rotary_dim} "
                     f"causal={causal} packed={packed} b={batch} s={seq}")
            with self.subTest(label):
                cfg = {"d_model": d, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                       "scale": float(self.rng.choice([1.0 / np.sqrt(head_dim), 0.3])),
                       "rotary_dim": rotary_dim, "theta": theta}
                q_w, kv_w = heads * head_dim, kv_heads * head_dim
                w = {"w_q": torch.randn(d, q_w) * 0.2, "b_q": torch.randn(q_w) * 0.2,
                     "w_k": torch.randn(d, kv_w) * 0.2, "b_k": torch.randn(kv_w) * 0.2,
                     "w_v": torch.randn(d, kv_w) * 0.2, "b_v": torch.randn(kv_w) * 0.2,
                     "w_o": torch.randn(q_w, d) * 0.2, "b_o": torch.randn(d) * 0.2}
                lengths = self.lengths(batch, seq)
                x = torch.randn(batch, seq, d)
                head_mask = torch.ones(heads)
                head_mask[int(self.rng.integers(heads))] = 0.0
                head_mask[int(self.rng.integers(heads))] *= 0.5
                offsets = torch.as_tensor(self.rng.integers(0, 50, size=batch))
                w64 = {k: v.double() for k, v in w.items()}
                expected, probs = explicit_torch_attention(
                    x.double(), None, w64, cfg, torch.as_tensor(lengths), torch.as_tensor(lengths),
                    causal, None, head_mask.double(), offsets)

                if packed:
                    rows = np.concatenate([x[b, :n].numpy() for b, n in enumerate(lengths)])
                    hidden = to_tensor(pb, rows)
                else:
                    hidden = to_tensor(pb, x.numpy())
                request = pb.AttendRequest(
                    layer=self.layer_spec(cfg, w), hidden_states=hidden, causal=causal,
                    sequence_lengths=[int(n) for n in lengths], head_mask=head_mask.tolist(),
                    attention_maps=pb.AttentionMapRequest(mode=pb.ATTENTION_MAP_MODE_PER_HEAD))
                if rotary_dim:
                    request.position_offsets.extend(int(o) for o in offsets)
                r = self.stub.Attend(request, timeout=60)
                out = from_tensor(pb, r.output)
                if packed:
                    starts = np.concatenate([[0], np.cumsum(lengths)])
                    padded = np.zeros((batch, seq, d), np.float32)
                    for b, n in enumerate(lengths):
                        padded[b, :n] = out[starts[b]:starts[b] + n]
                    out = padded
                self.compare(label + " output", out, expected.numpy(), lengths, FP32_TOLERANCE)
                self.compare(label + " weights", from_tensor(pb, r.attention_maps), probs.numpy(), lengths,
                             FP32_TOLERANCE)

    def test_bf16_compute_against_torch(self):
        torch, pb = self.torch, self.pb
        for trial in range(max(2, ARGS.trials // 4)):
            d, heads, batch, seq = 64, 4, 2, int(self.rng.integers(4, 33))
            label = f"bf16 trial {trial}: s={seq}"
            with self.subTest(label):
                mha = torch.nn.MultiheadAttention(d, heads, batch_first=True)
                with torch.no_grad():
                    for p in mha.parameters():
                        p.copy_(torch.randn_like(p) * 0.2)
                x = torch.randn(batch, seq, d)
                expected, _ = mha(x, x, x, need_weights=False)
                wq, wk, wv = mha.in_proj_weight.chunk(3)
                bq, bk, bv = mha.in_proj_bias.chunk(3)
                w = {"w_q": wq.T, "b_q": bq, "w_k": wk.T, "b_k": bk, "w_v": wv.T, "b_v": bv,
                     "w_o": mha.out_proj.weight.T, "b_o": mha.out_proj.bias}
                cfg = {"d_model": d, "num_heads": heads, "num_kv_heads": heads, "head_dim": d // heads,
                       "scale": 1.0 / np.sqrt(d // heads)}
                r = self.stub.Attend(pb.AttendRequest(
                    layer=self.layer_spec(cfg, w), hidden_states=to_tensor(pb, x.numpy()),
                    precision=pb.PRECISION_BF16, output_dtype=pb.DATA_TYPE_BF16), timeout=60)
                # BF16 where this machine runs it; elsewhere an FP32 run that says
                # so (never a skip: on a BF16 machine an FP32 answer fails).
                bf16 = machine_runs_bf16()
                self.assertEqual(r.precision, pb.PRECISION_BF16 if bf16 else pb.PRECISION_FP32, label)
                self.assertTrue(r.kernel_path.startswith("bf16" if bf16 else "fp32"), r.kernel_path)
                # (BF16 output either way: the bound holds its rounding too.)
                self.assertLessEqual(rel_error(from_tensor(pb, r.output), expected.detach().numpy()),
                                     BF16_TOLERANCE, label)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--trials", type=int, default=40, help="random configurations per test")
    ARGS, rest = parser.parse_known_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("torch_parity_test: python3-torch is missing (deploy/install_deps.sh installs it)")
    run_tests_with_stubs(ARGS.proto_dir, rest)


if __name__ == "__main__":
    main()
