#!/usr/bin/env python3
"""Writes the seed corpus of attend_request_fuzzer into tests/fuzz/corpus/.

Each seed is an AttendRequest in protobuf text format, encoded with
`protoc --encode`: valid requests of every kind (padded, packed, cross,
causal, masks, projected heads, ad-hoc layers, map subsets) and corrupt
bytes. Rerun after changing the API:  tests/fuzz/make_corpus.py
"""
import pathlib
import struct
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = HERE / "corpus"
D = 768  # the built-in model's d_model


def raw(values, fmt="<f"):
    data = b"".join(struct.pack(fmt, v) for v in values)
    return '"' + "".join("\\%03o" % b for b in data) + '"'


def bf16(values):
    return raw([struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in values], "<H")


def tensor(shape, dtype="DATA_TYPE_FP32", floats=False, fn=None):
    n = 1
    for d in shape:
        n *= d
    vals = [((i * 7) % 13 - 6) / 8.0 for i in range(n)]
    dims = " ".join("shape: %d" % d for d in shape)
    if floats:
        return "{ dtype: %s %s float_data: [%s] }" % (dtype, dims, ", ".join(map(str, vals)))
    if dtype == "DATA_TYPE_BF16":
        data = bf16(vals)
    elif dtype == "DATA_TYPE_BOOL":
        data = '"' + "".join("\\%03o" % (1 if (fn or (lambda i: i % 3))(i) else 0) for i in range(n)) + '"'
    else:
        data = raw(vals)
    return "{ dtype: %s %s raw_data: %s }" % (dtype, dims, data)


def adhoc_weights(d, q, kv, ctx=None):
    ctx = ctx or d
    return ("inline_weights { w_q: %s b_q: %s w_k: %s b_k: %s w_v: %s b_v: %s w_o: %s b_o: %s }" %
            (tensor([d, q]), tensor([q]), tensor([ctx, kv]), tensor([kv]), tensor([ctx, kv]),
             tensor([kv]), tensor([q, d]), tensor([d])))


HS = "model: 'default' hidden_states: " + tensor([1, 2, D], "DATA_TYPE_BF16")
VALID = {
    "padded_fp32": "model: 'default' hidden_states: %s" % tensor([1, 2, D]),
    "padded_bf16_lengths": "model: 'default' hidden_states: %s sequence_lengths: [2, 1]" % tensor([2, 2, D], "DATA_TYPE_BF16"),
    "padded_float_data": "model: 'default' hidden_states: %s" % tensor([1, 1, D], floats=True),
    "packed": "model: 'default' hidden_states: %s sequence_lengths: [1, 2]" % tensor([3, D], "DATA_TYPE_BF16"),
    "cross": "%s context: %s" % (HS, tensor([1, 3, D], "DATA_TYPE_BF16")),
    "cross_packed": ("model: 'default' hidden_states: %s sequence_lengths: [1, 1] context: %s context_lengths: [2, 1]" %
                     (tensor([2, D], "DATA_TYPE_BF16"), tensor([3, D], "DATA_TYPE_BF16"))),
    "causal": HS + " causal: true",
    "mask_allowed": HS + " mask { kind: KIND_ALLOWED values: %s }" % tensor([1, 2, 2], "DATA_TYPE_BOOL"),
    "mask_additive": HS + " mask { kind: KIND_ADDITIVE values: %s }" % tensor([1, 2, 2]),
    "mask_broadcast": HS + " mask { kind: KIND_ALLOWED values: %s }" % tensor([1, 1, 2], "DATA_TYPE_BOOL", fn=lambda i: 1),
    "head_mask": HS + " head_mask: [1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0.5]",
    "maps_per_head": HS + " attention_maps { mode: ATTENTION_MAP_MODE_PER_HEAD }",
    "maps_mean_stats": HS + " attention_maps { mode: ATTENTION_MAP_MODE_MEAN head_statistics: true }",
    "maps_subset": HS + " attention_maps { mode: ATTENTION_MAP_MODE_PER_HEAD heads: [0, 11] query_rows: [1] }",
    "bf16_precision_output": HS + " precision: PRECISION_BF16 output_dtype: DATA_TYPE_BF16",
    "projected": ("layer { head_config { num_heads: 2 num_kv_heads: 1 head_dim: 4 } } projected { q: %s k: %s v: %s }" %
                  (tensor([1, 2, 3, 4]), tensor([1, 1, 5, 4]), tensor([1, 1, 5, 4]))),
    "projected_maps": ("layer { head_config { num_heads: 2 head_dim: 4 scale: 0.5 } } projected { q: %s k: %s v: %s } causal: true attention_maps { mode: ATTENTION_MAP_MODE_PER_HEAD }" %
                       (tensor([1, 2, 3, 4]), tensor([1, 2, 3, 4]), tensor([1, 2, 3, 4]))),
    "adhoc_seed": "layer { head_config { d_model: 8 num_heads: 2 head_dim: 4 } seed: 7 } hidden_states: %s" % tensor([1, 3, 8]),
    "adhoc_gqa_rotary": ("layer { head_config { d_model: 16 num_heads: 4 num_kv_heads: 2 head_dim: 4 rotary { rotary_dim: 4 theta: 10000 } } seed: 1 } hidden_states: %s causal: true position_offsets: [3]" %
                         tensor([1, 3, 16])),
    "adhoc_inline": "layer { head_config { d_model: 8 num_heads: 2 head_dim: 4 } %s } hidden_states: %s" % (adhoc_weights(8, 8, 8), tensor([1, 2, 8])),
    "adhoc_cross_context_dim": ("layer { head_config { d_model: 8 num_heads: 2 head_dim: 4 context_dim: 4 } %s } hidden_states: %s context: %s" %
                                (adhoc_weights(8, 8, 8, 4), tensor([1, 2, 8]), tensor([1, 3, 4]))),
}
INVALID = {
    "unknown_model": HS.replace("'default'", "'nope'"),
    "model_and_layer": "layer { head_config { d_model: 8 num_heads: 2 head_dim: 4 } seed: 1 } " + HS,
    "wrong_width": "model: 'default' hidden_states: " + tensor([1, 2, 8]),
    "huge_shape": "model: 'default' hidden_states { dtype: DATA_TYPE_FP32 shape: 4611686018427387904 shape: 4 shape: 768 raw_data: 'x' }",
    "negative_dim": "model: 'default' hidden_states { dtype: DATA_TYPE_BF16 shape: -1 shape: 2 shape: 768 }",
    "short_raw_data": "model: 'default' hidden_states { dtype: DATA_TYPE_FP32 shape: 1 shape: 2 shape: 768 raw_data: 'abc' }",
    "lengths_mismatch": "model: 'default' hidden_states: %s sequence_lengths: [2, 2]" % tensor([3, D], "DATA_TYPE_BF16"),
    "over_max_seq": "model: 'default' hidden_states { dtype: DATA_TYPE_BF16 shape: 1 shape: 100000 shape: 768 raw_data: 'x' }",
    "bad_mask_shape": HS + " mask { kind: KIND_ALLOWED values: %s }" % tensor([1, 3, 2], "DATA_TYPE_BOOL"),
    "bad_map_head": HS + " attention_maps { mode: ATTENTION_MAP_MODE_PER_HEAD heads: [12] }",
    "adhoc_huge_heads": "layer { head_config { d_model: 8 num_heads: 2147483647 head_dim: 2147483647 } seed: 1 } hidden_states: %s" % tensor([1, 1, 8]),
}
CORRUPT = {
    "empty": b"",
    "truncated_varint": b"\x12\x80",
    "bad_wire_type": b"\x0f\x01\x02",
    "length_overrun": b"\x12\xff\xff\xff\xff\x0f\x08\x01",
    "deep_nesting": b"\x6a\x02\x0a\x00" * 8,
    "garbage": bytes(range(256)),
}


def main():
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*"):
        old.unlink()
    proto_dir = REPO / "proto"
    for prefix, table in (("valid", VALID), ("invalid", INVALID)):
        for name, text in table.items():
            data = subprocess.run(
                ["protoc", "-I", str(proto_dir), "-I", "/usr/include",
                 "--encode=attnserve.v1.AttendRequest", "attnserve/v1/attention.proto"],
                input=text.encode(), check=True, capture_output=True).stdout
            (OUT / ("%s_%s" % (prefix, name))).write_bytes(data)
    for name, data in CORRUPT.items():
        (OUT / ("corrupt_%s" % name)).write_bytes(data)
    print("wrote %d seeds to %s" % (len(VALID) + len(INVALID) + len(CORRUPT), OUT))


if __name__ == "__main__":
    main()
