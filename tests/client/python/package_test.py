#!/usr/bin/python3
"""The attnserve Python package (client/python) against the real attnserve
binary: every check calls the server through the package, on fresh random
inputs, and compares with a NumPy float64 reference of the built-in model's
documented seeded weights (tests/e2e/harness.py's reference_attention and
seeded_weights, which are independent of the package: they are the oracle;
the harness's tensor and BF16 helpers are the package's own).

Tolerances: FP32 relative Frobenius error <= 1e-5 (as the e2e suite's); BF16
compute <= 2e-2 (as the e2e suite's); BF16 on the wire (inputs rounded, outputs
rounded) <= 5e-3 against the reference fed the same rounded inputs (this
file's own bound: the output's rounding alone is at most 2^-9 relative).

Run by install_test.py inside a fresh virtual environment where the package was
pip-installed (--installed then requires that the package comes from there);
by hand, with the package from the checkout:

  PYTHONPATH=client/python /usr/bin/python3 tests/client/python/package_test.py \\
      --server build/server/attnserve
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "e2e"))
from harness import (Server, machine_runs_bf16, metric, parse_exposition, reference_attention, rel_error,  # noqa: E402
                     wait_until,
                     seeded_weights, write_safetensors)

import attnserve  # noqa: E402
import attnserve.aio  # noqa: E402
import google.protobuf.message  # noqa: E402
import grpc  # noqa: E402

ARGS = None
D_MODEL, HEADS, HEAD_DIM = 768, 12, 64


def independent_bf16_words(values):
    """The bfloat16 nearest each float32 value, ties to even, chosen among the
    two neighbours by float64 distance (no bit tricks): the oracle of the
    package's rounding."""
    out = []
    for v in np.asarray(values, np.float32).ravel():
        if np.isnan(v):
            out.append(None)
            continue
        if np.isinf(v):
            out.append(int(np.float32(v).view(np.uint32)) >> 16)
            continue
        bits = int(np.float32(v).view(np.uint32))
        low = bits & 0xFFFF0000  # truncated towards zero
        high = low + 0x10000     # the next bfloat16 away from zero (may be infinity)
        low_value = float(np.uint32(low).view(np.float32))
        high_value = float(np.uint32(high & 0xFFFFFFFF).view(np.float32))
        d_low, d_high = abs(float(v) - low_value), abs(high_value - float(v))
        if np.isinf(high_value) and not np.isinf(v):
            # Past the largest bfloat16, IEEE rounds to infinity from the halfway point on.
            largest = float(np.uint32(0x7F7F0000).view(np.float32))
            halfway = largest + (2.0 ** 127) * 2.0 ** -8
            pick_high = abs(float(v)) >= halfway
        elif d_low != d_high:
            pick_high = d_high < d_low
        else:
            pick_high = (low >> 16) & 1 == 1  # a tie: the even one
        out.append((high if pick_high else low) >> 16)
    return out


class WithoutServer(unittest.TestCase):
    def test_the_package_comes_from_where_it_should(self):
        where = os.path.realpath(attnserve.__file__)
        checkout = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "client", "python"))
        if ARGS.installed:
            self.assertFalse(where.startswith(checkout + os.sep), f"{where}: not the installed package")
            self.assertTrue(where.startswith(os.path.realpath(sys.prefix)), f"{where} is outside {sys.prefix}")
        self.assertRegex(attnserve.__version__, r"^\d+\.\d+\.\d+$")
        # The generated .pyi ships with the package.
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(attnserve.v1.attention_pb2.__file__),
                                                    "attention_pb2.pyi")))

    def test_a_client_keeps_freed_buffers_for_reuse(self):
        """The first Client sets glibc's allocator to keep freed blocks
        (attnserve/_heap.py): 24 MB allocated, touched and freed again and
        again faults its pages in once, not on every round. Each case runs in
        a fresh process (the setting is the process's); the opt-out shows the
        refaults the setting removes."""
        script = (
            "import resource, sys, numpy as np, attnserve\n"
            "client = attnserve.Client('127.0.0.1:1')  # no call: the channel connects lazily\n"
            "from attnserve import _heap\n"
            "state = _heap._state  # what the client decided (None: it never looked)\n"
            "faults = []\n"
            "for _ in range(6):\n"
            "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    a = np.ones(12 << 20, np.uint8); b = np.ones(12 << 20, np.uint8); del a, b\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n"
            "print(state, max(faults[2:]), sep='|')\n")

        def run(**env):
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                  env={**os.environ, **env})
            self.assertEqual(done.returncode, 0, done.stderr)
            state, faults = done.stdout.strip().split("|")
            return state, int(faults)

        pages = (24 << 20) // 4096
        state, faults = run()
        self.assertEqual(state, "kept")
        self.assertLess(faults, pages // 20, "freed blocks were given back and faulted in again")
        state, faults = run(ATTNSERVE_KEEP_FREED_BUFFERS="0")
        self.assertEqual(state, "ATTNSERVE_KEEP_FREED_BUFFERS=0")
        self.assertGreater(faults, pages // 10, "glibc's defaults no longer give such blocks back: "
                           "the setting may no longer be needed")
        state, _ = run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")
        self.assertEqual(state, "GLIBC_TUNABLES sets malloc")

    def test_bf16_rounding_matches_an_independent_rounding(self):
        rng = np.random.default_rng()
        values = np.concatenate([
            rng.standard_normal(4000).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 4000),
            # Exact ties (the dropped half is 0x8000), both parities.
            (np.arange(1000, dtype=np.uint32) * np.uint32(0x10000) + np.uint32(0x3F808000)).view(np.float32),
            # Just below and above ties.
            (np.arange(500, dtype=np.uint32) * np.uint32(0x10000) + np.uint32(0x40007FFF)).view(np.float32),
            (np.arange(500, dtype=np.uint32) * np.uint32(0x10000) + np.uint32(0x40008001)).view(np.float32),
            np.array([0.0, -0.0, 1e-40, -1e-40, 3.39e38, 3.4e38, -3.4e38, np.finfo(np.float32).max, np.inf,
                      -np.inf, 1.0, -1.0], np.float32)])
        words = attnserve.to_bf16_words(values)
        self.assertEqual(words.dtype, np.dtype("<u2"))
        self.assertEqual(words.tolist(), independent_bf16_words(values))
        widened = attnserve.from_bf16_words(words)
        np.testing.assert_array_equal(widened, attnserve.bf16_round(values))
        np.testing.assert_array_equal(attnserve.to_bf16_words(widened), words)  # BF16 -> FP32 -> BF16 is exact
        # NaNs whose payload is in the dropped half stay NaN (rounding must not carry them into infinity).
        nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32).view(np.float32)
        self.assertTrue(np.isnan(attnserve.bf16_round(nans)).all())

    def test_any_real_dtype_travels_as_float32(self):
        from attnserve import tensors
        for dtype in (np.float16, np.float32, np.float64, np.int32):
            x = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
            tensor = tensors.encode(x)
            self.assertEqual(tensor.dtype, attnserve.v1.attention_pb2.DATA_TYPE_FP32)
            np.testing.assert_array_equal(tensors.decode(tensor), x.astype(np.float32))
        with self.assertRaises(TypeError):
            tensors.encode(np.zeros(3, np.complex64))

    def test_fields_and_flags_are_read_from_server_messages(self):
        cases = [("hidden_states.shape[2] (d_model): expected 768, got 512", "hidden_states.shape[2]", None),
                 ("steps[1].hidden_states: sequence 0 holds nan at position 3", "steps[1].hidden_states", None),
                 ("request: needs about 3 GiB of scratch, over --max_scratch_bytes", "request", "--max_scratch_bytes"),
                 ("model: no model named 'x' is loaded", "model", None),
                 ("session 0123abcd: closed", None, None),
                 ("the model repository has no folder 'x'", None, None)]
        for message, field, flag in cases:
            error = attnserve.errors.error_for_status(3, message)
            self.assertIsInstance(error, attnserve.InvalidArgumentError)
            self.assertEqual((error.field, error.flag), (field, flag), message)
        self.assertIsInstance(attnserve.errors.error_for_status(5, "x"), attnserve.NotFoundError)
        self.assertEqual(attnserve.errors.error_for_status(5, "x").code, grpc.StatusCode.NOT_FOUND)


def address_in(data, part):
    """The address of `part`'s first occurrence in the bytes `data`."""
    return np.frombuffer(data, np.uint8).ctypes.data + data.find(part)


def tensor_of(values, dtype="fp32"):
    """The Tensor message of an array built directly with protobuf, values
    encoded independently of the package (BF16 by independent_bf16_words)."""
    pb = attnserve.v1.attention_pb2
    values = np.asarray(values)
    if values.dtype == np.bool_:
        return pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=values.shape, raw_data=values.astype(np.uint8).tobytes())
    if dtype == "bf16":
        words = np.array(independent_bf16_words(values), np.uint16).astype("<u2")
        return pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=values.shape, raw_data=words.tobytes())
    return pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=values.shape, raw_data=values.astype("<f4").tobytes())


def _varint(value):
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number, wire_type, payload):
    """A protobuf field written by hand: payload an int (varint) or bytes (length-delimited)."""
    if wire_type == 0:
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class WireFormat(unittest.TestCase):
    """Attend's requests and responses as the package writes and reads them
    itself (attnserve._wire): protobuf's parse of the package's request bytes
    is the message built with protobuf's setters from the same arrays, and the
    package's reading of a response equals its reading of protobuf's parse."""

    def setUp(self):
        from attnserve import _wire
        self.rng = np.random.default_rng()
        self.pb = attnserve.v1.attention_pb2
        # The in-place reader takes responses of every size here (by default
        # protobuf parses the small ones: test_small_responses_...).
        self.addCleanup(setattr, _wire, "IN_PLACE_MIN_BYTES", _wire.IN_PLACE_MIN_BYTES)
        _wire.IN_PLACE_MIN_BYTES = 0

    def normal(self, *shape):
        return self.rng.standard_normal(shape)

    def test_attend_requests_parse_to_the_message_protobufs_setters_build(self):
        from attnserve import messages
        pb = self.pb
        x, context = self.normal(2, 7, D_MODEL), self.normal(2, 5, D_MODEL).astype(np.float32)
        bool_mask, float_mask = self.rng.random((2, 1, 5)) < 0.5, self.normal(1, 7, 7).astype(np.float32)
        q, kv = self.normal(1, HEADS, 4, HEAD_DIM).astype(np.float32), self.normal(1, HEADS, 6, HEAD_DIM)
        transposed = self.normal(D_MODEL, 3, 2).astype(np.float32).T  # not C-contiguous
        big_endian = self.normal(1, 3, D_MODEL).astype(">f4")
        small_bf16 = self.normal(1, 3, D_MODEL)
        cases = [  # (name, package arguments, the reference message)
            ("FP32, ragged, causal, maps, statistics, every scalar",
             dict(x=x, lengths=[7, 4], causal=True, maps="per-head", heads=[0, 3], rows=[1], stats=True,
                  precision="bf16", output_dtype="bf16", position_offsets=[3, 0], head_mask=[1.0, 0.5]),
             pb.AttendRequest(model="default", hidden_states=tensor_of(x), sequence_lengths=[7, 4], causal=True,
                              attention_maps=pb.AttentionMapRequest(
                                  mode=pb.ATTENTION_MAP_MODE_PER_HEAD, heads=[0, 3], query_rows=[1],
                                  head_statistics=True),
                              precision=pb.PRECISION_BF16, output_dtype=pb.DATA_TYPE_BF16,
                              position_offsets=[3, 0], head_mask=[1.0, 0.5])),
            ("BF16 on the wire, cross-attention, a bool mask",
             dict(x=small_bf16, input_dtype="bf16", context=context[:1, :, :], context_lengths=[4],
                  mask=bool_mask[:1], maps="mean"),
             pb.AttendRequest(model="default", hidden_states=tensor_of(small_bf16, "bf16"),
                              context=tensor_of(context[:1], "bf16"), context_lengths=[4],
                              mask=pb.AttentionMask(kind=pb.AttentionMask.KIND_ALLOWED, values=tensor_of(
                                  bool_mask[:1])),
                              attention_maps=pb.AttentionMapRequest(mode=pb.ATTENTION_MAP_MODE_MEAN))),
            ("an additive mask, cross-attention in FP32",
             dict(x=x, mask=float_mask, context=context),
             pb.AttendRequest(model="default", hidden_states=tensor_of(x), context=tensor_of(context),
                              mask=pb.AttentionMask(kind=pb.AttentionMask.KIND_ADDITIVE,
                                                    values=tensor_of(float_mask)))),
            ("projected heads, no model's states",
             dict(projected=(q, kv, kv)),
             pb.AttendRequest(model="default", projected=pb.ProjectedHeads(
                 q=tensor_of(q), k=tensor_of(kv), v=tensor_of(kv)))),
            ("an ad-hoc layer, a non-contiguous and a big-endian array",
             dict(x=transposed, layer=pb.LayerSpec(seed=7, head_config=pb.HeadConfig(d_model=2))),
             pb.AttendRequest(hidden_states=tensor_of(transposed),
                              layer=pb.LayerSpec(seed=7, head_config=pb.HeadConfig(d_model=2)))),
            ("big-endian", dict(x=big_endian), pb.AttendRequest(model="default", hidden_states=tensor_of(big_endian))),
            ("empty shapes", dict(x=np.zeros((0, D_MODEL)), packed=True, mask=np.zeros((1, 0, 3), bool)),
             pb.AttendRequest(model="default", hidden_states=tensor_of(np.zeros((0, D_MODEL))),
                              mask=pb.AttentionMask(kind=pb.AttentionMask.KIND_ALLOWED,
                                                    values=tensor_of(np.zeros((1, 0, 3), bool))))),
            ("a zero-sized sequence", dict(x=np.zeros((1, 0, D_MODEL), np.float32)),
             pb.AttendRequest(model="default", hidden_states=tensor_of(np.zeros((1, 0, D_MODEL))))),
            ("nothing but a model", dict(model="m"), pb.AttendRequest(model="m")),
        ]
        for name, kwargs, reference in cases:
            with self.subTest(name):
                wire = messages.build_attend_wire(**kwargs)
                parsed = pb.AttendRequest.FromString(wire.SerializeToString())
                self.assertEqual(parsed, reference)
                self.assertEqual(parsed.SerializeToString(deterministic=True),
                                 reference.SerializeToString(deterministic=True))
                self.assertEqual(messages.build_attend_request(**kwargs), reference)
                self.assertEqual(len(wire.SerializeToString()), reference.ByteSize())

    def random_response(self, output_dtype="fp32", maps=None, stats=False, shape=(2, 5, D_MODEL)):
        """An AttendResponse with random values (BF16 words: any 16 bits)."""
        pb = self.pb

        def tensor(dtype, shape):
            if dtype == "bf16":
                words = self.rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).astype("<u2")
                return pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=shape, raw_data=words.tobytes())
            return tensor_of(self.rng.standard_normal(shape))

        response = pb.AttendResponse(model="default", kernel_path="fp32/blocked", precision=pb.PRECISION_FP32,
                                     output=tensor(output_dtype, shape))
        response.timing.compute.FromNanoseconds(int(self.rng.integers(1, 10 ** 9)))
        response.timing.batch_size = 3
        if maps is not None:
            response.attention_maps.CopyFrom(tensor(maps, (shape[0], HEADS, shape[1], shape[1])))
        if stats:
            for name in ("entropy", "max_weight", "contribution"):
                getattr(response.head_statistics, name).CopyFrom(tensor("fp32", (shape[0], HEADS)))
        return response

    def assert_same_result(self, got, want):
        for name in ("output", "maps", "output_words", "maps_words"):
            a, b = getattr(got, name), getattr(want, name)
            self.assertEqual(a is None, b is None, name)
            if a is not None:
                self.assertEqual((a.dtype, a.shape, a.tobytes()), (b.dtype, b.shape, b.tobytes()), name)
        self.assertEqual(got.stats is None, want.stats is None)
        if got.stats is not None:
            for name in ("entropy", "max_weight", "contribution"):
                np.testing.assert_array_equal(getattr(got.stats, name), getattr(want.stats, name))
        self.assertEqual((got.timing, got.kernel_path, got.precision, got.model),
                         (want.timing, want.kernel_path, want.precision, want.model))
        self.assertEqual(got.message, want.message)

    def test_attend_responses_are_read_in_place_as_protobuf_reads_them(self):
        from attnserve import _wire, messages
        pb = self.pb
        cases = [("FP32", self.random_response()),
                 ("BF16 output, FP32 maps, statistics", self.random_response("bf16", "fp32", True)),
                 ("FP32 output, BF16 maps", self.random_response("fp32", "bf16", shape=(1, 3, D_MODEL))),
                 ("empty output", self.random_response(shape=(0, D_MODEL))),
                 ("no output at all", pb.AttendResponse(model="m", kernel_path="k"))]
        for name, response in cases:
            data = response.SerializeToString()
            # The same fields in the opposite order, each its own piece (protobuf allows any order).
            reversed_data = b"".join(pb.AttendResponse(**{f.name: v}).SerializeToString()
                                     for f, v in reversed(response.ListFields()))
            for layout, wire_bytes in (("protobuf's order", data), ("reversed", reversed_data)):
                for words in (False, True):
                    with self.subTest(name, layout=layout, bf16_words=words):
                        fast = _wire.parse_attend_response(wire_bytes)
                        self.assertIsInstance(fast, _wire.WireMessage)
                        got = messages.read_attend_response(fast, words)
                        self.assert_same_result(got, messages.read_attend_response(
                            pb.AttendResponse.FromString(wire_bytes), words))
                        self.assertEqual(got.message, response)
                        if got.output is not None and got.output.size and response.output.dtype == 1:
                            # Read-only and aligned: a view of the received bytes (no copy) where
                            # they are aligned.
                            self.assertFalse(got.output.flags.writeable)
                            self.assertTrue(got.output.flags.aligned)
                            self.assertEqual(np.shares_memory(got.output, np.frombuffer(wire_bytes, np.uint8)),
                                             address_in(wire_bytes, response.output.raw_data) % 4 == 0)

    def test_arrays_read_in_place_are_aligned_wherever_the_bytes_fall(self):
        # The server writes the big tensors last (after the model's name, for
        # one): names of 1-4 characters put the output's bytes at every offset
        # modulo 4.
        from attnserve import _wire, messages
        pb = self.pb
        x = self.normal(1, 3, D_MODEL).astype(np.float32)
        offsets = set()
        for name in ("m", "mo", "mod", "mode"):
            for dtype in (pb.DATA_TYPE_FP32, pb.DATA_TYPE_BF16):
                values = tensor_of(x, "fp32" if dtype == pb.DATA_TYPE_FP32 else "bf16")
                data = (pb.AttendResponse(model=name).SerializeToString() +
                        pb.AttendResponse(output=values).SerializeToString())
                offsets.add(address_in(data, values.raw_data) % 4)
                with self.subTest(model=name, dtype=dtype):
                    got = messages.read_attend_response(_wire.parse_attend_response(data), True)
                    # FP32 output and BF16 words are read in place (BF16 output is widened anew).
                    in_place = got.output if dtype == pb.DATA_TYPE_FP32 else got.output_words
                    self.assertTrue(got.output.flags.aligned)
                    self.assertTrue(in_place.flags.aligned)
                    self.assertFalse(in_place.flags.writeable)
                    expected = messages.read_attend_response(pb.AttendResponse.FromString(data), True)
                    np.testing.assert_array_equal(got.output, expected.output)
        self.assertEqual(offsets, {0, 1, 2, 3})  # every offset was met

    def test_a_response_the_fast_reader_does_not_expect_is_read_by_protobuf(self):
        from attnserve import _wire, messages
        pb = self.pb
        response = self.random_response("fp32", "fp32", True, shape=(1, 3, D_MODEL))
        data = response.SerializeToString()
        output = response.output
        shape = b"".join(_varint(d) for d in output.shape)
        head = _field(1, 0, output.dtype) + _field(2, 2, shape)
        cases = [
            ("an unknown field", data + _field(99, 0, 5)),
            ("an unknown field inside the output",
             _field(2, 2, head + _field(3, 2, output.raw_data) + _field(9, 0, 1))),
            ("the output in two occurrences (merged)",
             pb.AttendResponse(model="m").SerializeToString() + _field(2, 2, head) +
             _field(2, 2, _field(3, 2, output.raw_data))),
            ("float_data", _field(2, 2, _field(1, 0, 1) + _field(2, 2, b"\x03") +
                                  _field(4, 2, np.ones(3, "<f4").tobytes()))),
            ("an unpacked shape", _field(2, 2, _field(1, 0, 1) + b"".join(_field(2, 0, d) for d in (1, 3)) +
                                         _field(3, 2, np.arange(3, dtype="<f4").tobytes()))),
            ("a known field with another wire type", data + _field(4, 0, 1)),
            ("a negative dtype", _field(2, 2, _field(1, 0, (1 << 64) - 1) + _field(2, 2, b"\x02") +
                                        _field(3, 2, bytes(8)))),
            ("the raw data twice", _field(2, 2, head + _field(3, 2, bytes(12)) + _field(3, 2, output.raw_data))),
        ]
        for name, wire_bytes in cases:
            with self.subTest(name):
                parsed = pb.AttendResponse.FromString(wire_bytes)
                got = _wire.parse_attend_response(wire_bytes)
                self.assertIsInstance(got, pb.AttendResponse)
                self.assertEqual(got, parsed)
                self.assert_same_result(messages.read_attend_response(got, True),
                                        messages.read_attend_response(parsed, True))
        for cut in (1, 7, len(data) // 2, len(data) - 1):  # truncated: protobuf's DecodeError, as before
            with self.subTest(truncated_at=cut):
                with self.assertRaises(google.protobuf.message.DecodeError):
                    _wire.parse_attend_response(data[:cut])

    def test_small_responses_are_left_to_protobuf(self):
        from attnserve import _wire
        _wire.IN_PLACE_MIN_BYTES = 64 << 10
        small = self.random_response(shape=(1, 4, D_MODEL)).SerializeToString()  # 12 KiB
        large = self.random_response(shape=(1, 32, D_MODEL)).SerializeToString()  # 96 KiB
        self.assertIsInstance(_wire.parse_attend_response(small), self.pb.AttendResponse)
        self.assertIsInstance(_wire.parse_attend_response(large), _wire.WireMessage)

    def random_extend_response(self, dtype):
        """An ExtendResponse of four results: FP32 or BF16 outputs, one with
        maps, one with statistics, one failed step (no tensors)."""
        pb = self.pb
        response = pb.ExtendResponse(kernel_path="fp32/blocked", precision=pb.PRECISION_FP32)
        response.timing.compute.FromNanoseconds(int(self.rng.integers(1, 10 ** 9)))
        for i, (n, length) in enumerate([(3, 10), (1, 4), (0, 0), (40, 40)]):
            result = response.results.add(length=length, replayed=i == 1)
            if i == 2:
                result.code, result.message = 9, "steps[2]: expected_length 7, the layer holds 8"
                continue
            other = self.random_response(dtype, dtype if i == 0 else None, shape=(1, n, D_MODEL))
            result.output.CopyFrom(other.output)
            if i == 0:
                result.attention_maps.CopyFrom(other.attention_maps)
            if i == 3:
                result.head_statistics.entropy.CopyFrom(tensor_of(self.rng.random((HEADS, n))))
                result.head_statistics.max_weight.CopyFrom(tensor_of(self.rng.random((HEADS, n))))
        return response

    def assert_same_steps(self, got, want):
        self.assertEqual(len(got), len(want))
        for a, b in zip(got, want):
            for name in ("output", "maps", "output_words", "maps_words"):
                x, y = getattr(a, name), getattr(b, name)
                self.assertEqual(x is None, y is None, name)
                if x is not None:
                    self.assertEqual((x.dtype, x.shape, x.tobytes()), (y.dtype, y.shape, y.tobytes()), name)
            self.assertEqual((type(a.error), str(a.error), a.length, a.replayed, a.timing, a.kernel_path, a.precision),
                             (type(b.error), str(b.error), b.length, b.replayed, b.timing, b.kernel_path, b.precision))
            self.assertEqual(a.stats is None, b.stats is None)
            if a.stats is not None:
                np.testing.assert_array_equal(a.stats.entropy, b.stats.entropy)
                np.testing.assert_array_equal(a.stats.max_weight, b.stats.max_weight)

    def test_extend_responses_are_read_in_place_as_protobuf_reads_them(self):
        from attnserve import _wire, messages
        pb = self.pb
        for dtype in ("fp32", "bf16"):
            response = self.random_extend_response(dtype)
            data = response.SerializeToString()
            for words in (False, True):
                with self.subTest(dtype=dtype, bf16_words=words):
                    fast = _wire.parse_extend_response(data)
                    self.assertIsInstance(fast, _wire.WireMessage)
                    self.assertEqual(fast.message, response)
                    got = messages.read_extend_response(fast, words)
                    self.assert_same_steps(got, messages.read_extend_response(pb.ExtendResponse.FromString(data),
                                                                              words))
                    if dtype == "fp32":  # in place where aligned
                        self.assertTrue(got[3].output.flags.aligned)
                        self.assertEqual(np.shares_memory(got[3].output, np.frombuffer(data, np.uint8)),
                                         address_in(data, response.results[3].output.raw_data) % 4 == 0)
        # An unknown field inside a result, or a result's output in two occurrences: protobuf reads it.
        response = self.random_extend_response("fp32")
        first = response.results[0]
        split = pb.ExtendResult(output=pb.Tensor(dtype=first.output.dtype, shape=first.output.shape))
        merged = _field(1, 2, split.SerializeToString() + _field(3, 2, _field(3, 2, first.output.raw_data)))
        for name, data in [("unknown", response.SerializeToString() + _field(1, 2, _field(12, 0, 1))),
                           ("merged", merged)]:
            with self.subTest(name):
                got = _wire.parse_extend_response(data)
                self.assertIsInstance(got, pb.ExtendResponse)
                self.assertEqual(got, pb.ExtendResponse.FromString(data))

    def test_streamed_map_chunks_are_read_in_place_as_protobuf_reads_them(self):
        from attnserve import _wire, messages
        pb = self.pb
        for dtype in ("fp32", "bf16"):
            batch, seq, rows = 2, 6, 4  # two chunks of rows per sequence
            head = self.random_response(dtype, dtype, shape=(batch, seq, D_MODEL))
            maps = head.attention_maps
            full = (np.frombuffer(maps.raw_data, "<u2" if dtype == "bf16" else "<f4")
                    .reshape(batch, HEADS, seq, seq))
            head.attention_maps.ClearField("raw_data")  # the stream's response carries the maps' shape only
            stream = [pb.AttendStreamResponse(response=head).SerializeToString()]
            for b in range(batch):
                for first in range(0, seq, rows):
                    part = full[b:b + 1, :, first:first + rows]
                    stream.append(pb.AttendStreamResponse(map_chunk=pb.AttentionMapChunk(
                        sequence=b, first_head=0, first_row=first, maps=pb.Tensor(
                            dtype=maps.dtype, shape=part.shape, raw_data=part.tobytes()))).SerializeToString())
            for words in (False, True):
                with self.subTest(dtype=dtype, bf16_words=words):
                    fast, slow = messages.MapAssembler(words), messages.MapAssembler(words)
                    for data in stream:
                        message = _wire.parse_attend_stream_response(data)
                        self.assertIsInstance(message, _wire.WireMessage)
                        fast.add(message)
                        slow.add(pb.AttendStreamResponse.FromString(data))
                    self.assert_same_result(fast.result(), slow.result())
        # Both parts of the oneof in one message: protobuf keeps the last, and reads it.
        both = stream[1] + stream[0]
        self.assertIsInstance(_wire.parse_attend_stream_response(both), pb.AttendStreamResponse)
        self.assertEqual(_wire.parse_attend_stream_response(both), pb.AttendStreamResponse.FromString(both))

    def test_extend_requests_parse_to_the_message_protobufs_setters_build(self):
        from attnserve import _wire, messages
        pb = self.pb
        cases = [(n, dtype, least) for n, dtype in [(1, None), (3, "bf16"), (600, None), (0, None)]
                 for least in (0, 64 << 10)]  # every request framed by the package; only 600 tokens' (1.8 MB)
        for n, dtype, least in cases:
            _wire.IN_PLACE_MIN_BYTES = least
            xs = [self.normal(n, D_MODEL), self.normal(n, D_MODEL).astype(np.float32)]
            steps = [("s0", 0, 5, xs[0], True, [1.0, 0.0], True), ("s1", 2, 0, xs[1], False, None)]
            reference = pb.ExtendRequest(precision=pb.PRECISION_BF16, steps=[
                pb.ExtendStep(session_id="s0", layer=0, expected_length=5, hidden_states=tensor_of(xs[0], dtype),
                              attention_maps=True, head_mask=[1.0, 0.0], head_statistics=True),
                pb.ExtendStep(session_id="s1", layer=2, expected_length=0, hidden_states=tensor_of(xs[1], dtype))])
            with self.subTest(tokens=n, input_dtype=dtype, in_place_min_bytes=least):
                wire = messages.build_extend_wire(steps, "bf16", dtype)
                self.assertEqual(isinstance(wire, _wire.MessageWire), n == 600 or least == 0)
                self.assertEqual(pb.ExtendRequest.FromString(wire.SerializeToString()), reference)
                self.assertEqual(messages.build_extend_request(steps, "bf16", dtype), reference)


# The name the test server answers with in its attnserve-replica header.
REPLICA = "package-test-replica"


class AgainstServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # --access_log: the server then returns each call's x-request-id.
        cls.server = Server(ARGS.server, "--max_seq_len=512", "--access_log", f"--replica_name={REPLICA}")
        cls.client = attnserve.Client(cls.server.target, timeout=120)
        cls.client.wait_until_serving(timeout=120)
        cls.weights = seeded_weights(cls.server.seed, D_MODEL, HEADS, HEADS, HEAD_DIM)
        cls.rng = np.random.default_rng()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def reference(self, x, causal=False):
        return reference_attention(x, self.weights, HEADS, HEADS, HEAD_DIM, HEAD_DIM ** -0.5, causal=causal)

    def test_attend_on_a_float64_array_matches_the_reference(self):
        x = self.rng.standard_normal((2, 16, D_MODEL))  # float64: sent as float32
        r = self.client.attend(x, maps="per-head")
        self.assertEqual((r.output.shape, r.maps.shape), ((2, 16, D_MODEL), (2, HEADS, 16, 16)))
        self.assertEqual((r.output.dtype, r.maps.dtype), (np.float32, np.float32))
        ref_out, ref_maps = self.reference(x.astype(np.float32))
        self.assertLessEqual(rel_error(r.output, ref_out), 1e-5)
        self.assertLessEqual(rel_error(r.maps, ref_maps), 1e-5)
        np.testing.assert_allclose(r.maps.sum(axis=-1), 1.0, atol=1e-5)
        self.assertEqual((r.kernel_path, r.precision, r.model), ("fp32/materialized", "fp32", "default"))
        self.assertGreater(r.timing.compute_seconds, 0)
        self.assertGreaterEqual(r.timing.batch_size, 1)
        self.assertIsNone(r.stats)
        plain = self.client.attend(x)  # no maps: the blocked path
        self.assertIsNone(plain.maps)
        self.assertEqual(plain.kernel_path, "fp32/blocked")
        self.assertLessEqual(rel_error(plain.output, ref_out), 1e-5)

    def test_models_health_and_model(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("attnserve.v1.AttentionService"), "SERVING")
        models = self.client.models()
        self.assertEqual([m.name for m in models], ["default"])
        m = self.client.model("default")
        self.assertEqual((m.state, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim),
                         ("READY", D_MODEL, HEADS, HEADS, HEAD_DIM))
        self.assertEqual(m.max_seq_len, 512)
        self.assertIn("fp32", m.input_dtypes)

    def test_errors_keep_the_status_code_and_the_field(self):
        with self.assertRaises(attnserve.InvalidArgumentError) as caught:
            self.client.attend(np.zeros((1, 4, 512), np.float32))
        e = caught.exception
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(e.field, "hidden_states.shape[2]")
        self.assertIn("d_model", e.message)
        self.assertRegex(e.request_id or "", r"^[A-Za-z0-9._:-]+$")  # the access log's id
        self.assertIsInstance(e.__cause__, grpc.RpcError)
        with self.assertRaises(attnserve.InvalidArgumentError) as caught:
            self.client.attend(np.zeros((1, 513, D_MODEL), np.float32))
        self.assertEqual((caught.exception.field, caught.exception.flag), ("hidden_states.shape[1]", "--max_seq_len"))
        with self.assertRaises(attnserve.NotFoundError) as caught:
            self.client.attend(np.zeros((1, 4, D_MODEL), np.float32), model="no-such-model")
        self.assertEqual(caught.exception.field, "model")
        with self.assertRaises(attnserve.NotFoundError):
            self.client.model("no-such-model")
        with self.assertRaises(attnserve.InvalidArgumentError) as caught:
            self.client.attend(np.zeros((1, 4, D_MODEL), np.float32), maps="per-head", heads=[HEADS])
        self.assertTrue(caught.exception.field.startswith("attention_maps.heads"), caught.exception.field)
        with self.assertRaises(ValueError):  # refused before any call
            self.client.attend(np.zeros((1, 4, D_MODEL)), maps="everything")
        # The client's own deadline.
        with self.assertRaises(attnserve.DeadlineExceededError):
            self.client.attend(np.zeros((8, 512, D_MODEL), np.float32), timeout=1e-4)

    def test_bf16_in_and_out(self):
        x = self.rng.standard_normal((2, 24, D_MODEL)).astype(np.float32)
        rounded = np.array([np.uint32(w) << np.uint32(16) for w in independent_bf16_words(x)],
                           np.uint32).view(np.float32).reshape(x.shape)
        ref_out, ref_maps = self.reference(rounded)
        r = self.client.attend(x, input_dtype="bf16", output_dtype="bf16", maps="per-head", bf16_words=True)
        self.assertEqual((r.output.dtype, r.output_words.dtype), (np.float32, np.dtype("<u2")))
        self.assertEqual(r.output_words.shape, r.output.shape)
        np.testing.assert_array_equal(attnserve.from_bf16_words(r.output_words), r.output)
        np.testing.assert_array_equal(attnserve.from_bf16_words(r.maps_words), r.maps)
        self.assertLessEqual(rel_error(r.output, ref_out), 5e-3)
        self.assertLessEqual(rel_error(r.maps, ref_maps), 5e-3)
        self.assertEqual(r.precision, "fp32")
        # Without bf16_words the words are not kept; FP32 output has none.
        self.assertIsNone(self.client.attend(x, output_dtype="bf16").output_words)
        self.assertIsNone(self.client.attend(x, bf16_words=True).output_words)
        # BF16 compute where the machine has it (the result says which ran).
        r = self.client.attend(x, precision="bf16")
        self.assertEqual(r.precision, "bf16" if machine_runs_bf16() else "fp32")
        self.assertLessEqual(rel_error(r.output, self.reference(x)[0]), 2e-2)

    def test_packed_and_padded_ragged_batches_with_causal_attention(self):
        lengths = [3, 5, 8]
        sequences = [self.rng.standard_normal((n, D_MODEL)).astype(np.float32) for n in lengths]
        packed = self.client.attend(np.concatenate(sequences), lengths=lengths, packed=True, causal=True)
        padded_x = np.zeros((3, 8, D_MODEL), np.float32)
        for i, s in enumerate(sequences):
            padded_x[i, :len(s)] = s
        padded = self.client.attend(padded_x, lengths=lengths, causal=True, maps="per-head")
        self.assertEqual(packed.output.shape, (16, D_MODEL))
        offset = 0
        for i, s in enumerate(sequences):
            ref_out, ref_maps = self.reference(s[None], causal=True)
            n = len(s)
            self.assertLessEqual(rel_error(packed.output[offset:offset + n], ref_out[0]), 1e-5, i)
            self.assertLessEqual(rel_error(padded.output[i, :n], ref_out[0]), 1e-5, i)
            self.assertLessEqual(rel_error(padded.maps[i, :, :n, :n], ref_maps[0]), 1e-5, i)
            self.assertFalse(padded.output[i, n:].any(), "padding is 0 in the output")
            offset += n
        with self.assertRaises(ValueError):
            self.client.attend(padded_x, lengths=lengths, packed=True)

    def test_bool_and_float_masks_say_what_causal_says(self):
        x = self.rng.standard_normal((2, 9, D_MODEL))
        ref_out, _ = self.reference(x.astype(np.float32), causal=True)
        lower = np.tril(np.ones((9, 9), bool))[None]  # [1, seq_q, seq_kv]: True = may attend
        additive = np.where(lower, 0.0, -np.inf)      # float64: added to the scores
        for label, kwargs in [("bool", dict(mask=lower)), ("float", dict(mask=additive)),
                              ("uint8 allowed", dict(mask=lower.astype(np.uint8), mask_kind="allowed"))]:
            self.assertLessEqual(rel_error(self.client.attend(x, **kwargs).output, ref_out), 1e-5, label)
        with self.assertRaises(ValueError):  # an integer mask could mean either: the kind must be said
            self.client.attend(x, mask=lower.astype(np.uint8))

    def test_projected_heads_run_the_attention_core_alone(self):
        q = self.rng.standard_normal((2, HEADS, 5, HEAD_DIM))
        k, v = (self.rng.standard_normal((2, HEADS, 7, HEAD_DIM)) for _ in range(2))
        r = self.client.attend(projected=(q, k, v), maps="per-head")
        scores = (q.astype(np.float32).astype(np.float64) @ k.astype(np.float32).astype(np.float64)
                  .transpose(0, 1, 3, 2)) * HEAD_DIM ** -0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        self.assertEqual(r.output.shape, (2, HEADS, 5, HEAD_DIM))
        self.assertLessEqual(rel_error(r.output, p @ v.astype(np.float32).astype(np.float64)), 1e-5)
        self.assertLessEqual(rel_error(r.maps, p), 1e-5)

    def test_cross_attention_to_context_states(self):
        x = self.rng.standard_normal((2, 4, D_MODEL)).astype(np.float32)
        context = self.rng.standard_normal((2, 6, D_MODEL)).astype(np.float32)
        r = self.client.attend(x, context=context, context_lengths=[6, 3], maps="per-head")
        w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o = [w.astype(np.float64) for w in self.weights]
        for b, n in enumerate([6, 3]):  # keys and values from the context's first n states
            heads = lambda a: a.reshape(len(a), HEADS, HEAD_DIM).transpose(1, 0, 2)  # noqa: E731
            q, k, v = heads(x[b] @ w_q + b_q), heads(context[b, :n] @ w_k + b_k), heads(context[b, :n] @ w_v + b_v)
            s = q @ k.transpose(0, 2, 1) * HEAD_DIM ** -0.5
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out = (p @ v).transpose(1, 0, 2).reshape(4, HEADS * HEAD_DIM) @ w_o + b_o
            self.assertLessEqual(rel_error(r.output[b], out), 1e-5, b)
            self.assertLessEqual(rel_error(r.maps[b, :, :, :n], p), 1e-5, b)

    def test_map_subsets_mean_maps_and_head_statistics(self):
        x = self.rng.standard_normal((2, 10, D_MODEL)).astype(np.float32)
        _, ref_maps = self.reference(x)
        subset = self.client.attend(x, maps="per-head", heads=[3, 0], rows=[1, 4])
        self.assertLessEqual(rel_error(subset.maps, ref_maps[:, [3, 0]][:, :, [1, 4]]), 1e-5)
        mean = self.client.attend(x, maps="mean")
        self.assertEqual(mean.maps.shape, (2, 10, 10))
        self.assertLessEqual(rel_error(mean.maps, ref_maps.mean(axis=1)), 1e-5)
        stats = self.client.attend(x, stats=True).stats
        entropy = -(ref_maps * np.log(np.where(ref_maps > 0, ref_maps, 1.0))).sum(-1).mean(-1)
        self.assertEqual(stats.entropy.shape, (2, HEADS))
        self.assertLessEqual(rel_error(stats.entropy, entropy), 1e-5)
        self.assertLessEqual(rel_error(stats.max_weight, ref_maps.max(-1).mean(-1)), 1e-5)
        # contribution[b, h] = ||head_h W^O_h||_F, head_h = P_h V_h (float64).
        _, _, _, _, w_v, b_v, w_o, _ = [w.astype(np.float64) for w in self.weights]
        contribution = np.empty((2, HEADS))
        for b in range(2):
            v = (x[b].astype(np.float64) @ w_v + b_v).reshape(10, HEADS, HEAD_DIM).transpose(1, 0, 2)
            for h in range(HEADS):
                head = ref_maps[b, h] @ v[h]
                contribution[b, h] = np.linalg.norm(head @ w_o[h * HEAD_DIM:(h + 1) * HEAD_DIM])
        self.assertEqual(stats.contribution.shape, (2, HEADS))
        self.assertLessEqual(rel_error(stats.contribution, contribution), 1e-5)
        # A head mask that removes head 5: its contribution is 0.
        gated = self.client.attend(x, stats=True, head_mask=[0.0 if h == 5 else 1.0 for h in range(HEADS)])
        self.assertTrue((gated.stats.contribution[:, 5] == 0).all())

    def test_streamed_maps_arrive_past_a_4_mib_receive_limit(self):
        x = self.rng.standard_normal((4, 256, D_MODEL)).astype(np.float32)  # maps: 12.6 MB
        ref_out, ref_maps = self.reference(x)
        with attnserve.Client(self.server.target, timeout=120, max_receive_message_bytes=4 << 20) as small:
            with self.assertRaises(attnserve.ResourceExhaustedError):
                small.attend(x, maps="per-head")
            r = small.attend(x, maps="per-head", stream_maps=True)
            words = small.attend(x, maps="mean", output_dtype="bf16", bf16_words=True, stream_maps=True)
        self.assertLessEqual(rel_error(r.output, ref_out), 1e-5)
        self.assertLessEqual(rel_error(r.maps, ref_maps), 1e-5)
        np.testing.assert_array_equal(attnserve.from_bf16_words(words.maps_words), words.maps)
        self.assertLessEqual(rel_error(words.maps, ref_maps.mean(axis=1)), 5e-3)

    def reference_rows(self, sequence, first, n):
        return self.reference(sequence[None], causal=True)[0][0, first:first + n]

    def test_a_session_prefills_decodes_forks_and_closes(self):
        # 40 tokens (123 kB): the prefill's request and response go through attnserve._wire's framing.
        prompt = self.rng.standard_normal((40, D_MODEL)).astype(np.float32)
        with self.client.open_session() as session:
            self.assertRegex(session.id, r"^[0-9a-f]{32}$")
            self.assertEqual((session.routing_key, session.replica), (None, REPLICA))
            step = session.extend(prompt, maps=True)
            self.assertLessEqual(rel_error(step.output, self.reference_rows(prompt, 0, 40)), 1e-5)
            self.assertEqual(step.maps.shape, (HEADS, 40, 40))
            self.assertEqual((step.length, session.lengths, step.kernel_path), (40, [40], "fp32/paged"))
            sequence = prompt
            for _ in range(4):
                token = self.rng.standard_normal((1, D_MODEL)).astype(np.float32)
                before = len(sequence)
                sequence = np.concatenate([sequence, token])
                step = session.extend(token)
                self.assertLessEqual(rel_error(step.output, self.reference_rows(sequence, before, 1)), 1e-5)
            self.assertEqual(session.info().layer_lengths, (44,))
            # A fork shares the prefix and diverges.
            fork = session.fork()
            self.assertEqual(fork.lengths, [44])
            a, b = (self.rng.standard_normal((2, D_MODEL)).astype(np.float32) for _ in range(2))
            out_a, out_b = session.extend(a).output, fork.extend(b).output
            self.assertLessEqual(rel_error(out_a, self.reference_rows(np.concatenate([sequence, a]), 44, 2)), 1e-5)
            self.assertLessEqual(rel_error(out_b, self.reference_rows(np.concatenate([sequence, b]), 44, 2)), 1e-5)
            # A lost answer: the same step again is replayed, not appended twice.
            session.lengths[0] = 44
            again = session.extend(a)
            self.assertTrue(again.replayed)
            np.testing.assert_array_equal(again.output, out_a)
            self.assertEqual(session.truncate(10).layer_lengths, (10,))
            self.assertEqual(session.lengths, [10])
            fork.close()
            with self.assertRaises(attnserve.NotFoundError):
                fork.extend(b)
        with self.assertRaises(attnserve.NotFoundError):  # closed by the with block
            session.info()

    def test_a_steps_head_statistics_are_each_new_rows_under_a_head_mask(self):
        """stats=True: entropy and max weight of each new row of each head,
        float32 [heads, n], of the weights after head_mask, against the float64
        reference's gated rows (FP32 KV 1e-5, BF16 KV 2e-2); the maps are not sent
        unless asked for."""
        gates = np.ones(HEADS)
        gates[[2, 5, 7]] = (0.0, 0.5, 1.5)
        for kv_dtype, tolerance in (("fp32", 1e-5), ("bf16", 2e-2)):
            with self.client.open_session(kv_dtype=kv_dtype) as session:
                sequence = np.zeros((0, D_MODEL), np.float32)
                for n, maps in ((7, False), (1, False), (3, True)):
                    x = self.rng.standard_normal((n, D_MODEL)).astype(np.float32)
                    before = len(sequence)
                    sequence = np.concatenate([sequence, x])
                    step = session.extend(x, head_mask=gates, stats=True, maps=maps)
                    self.assertEqual(step.stats.entropy.shape, (HEADS, n))
                    self.assertEqual(step.stats.max_weight.shape, (HEADS, n))
                    self.assertIsNone(step.stats.contribution)
                    self.assertEqual(step.maps is not None, maps)
                    p = self.reference(sequence[None], causal=True)[1][0, :, before:]  # [heads, n, L]
                    gated = p * gates[:, None, None]
                    with np.errstate(divide="ignore", invalid="ignore"):
                        terms = np.where(gated > 0, -gated * np.log(gated), 0.0)
                    self.assertLessEqual(rel_error(step.stats.entropy, terms.sum(axis=-1)), tolerance)
                    self.assertLessEqual(rel_error(step.stats.max_weight, gated.max(axis=-1)), tolerance)
                    np.testing.assert_array_equal(step.stats.entropy[2], 0.0)
                    if maps:
                        self.assertLessEqual(rel_error(step.maps, gated), tolerance)
                # Without stats=True, none come back.
                self.assertIsNone(session.extend(self.rng.standard_normal((1, D_MODEL)).astype(np.float32)).stats)

    def test_a_micro_batch_reports_each_steps_own_error(self):
        sessions = [self.client.open_session(kv_dtype="bf16") for _ in range(3)]
        xs = [self.rng.standard_normal((n, D_MODEL)).astype(np.float32) for n in (2, 3, 4)]
        steps = [sessions[0].step(xs[0]), sessions[1].step(np.zeros((3, 100), np.float32)), sessions[2].step(xs[2])]
        results = self.client.extend(steps)
        self.assertEqual([r.ok for r in results], [True, False, True])
        self.assertIsInstance(results[1].error, attnserve.InvalidArgumentError)
        self.assertTrue(results[1].error.field.startswith("steps[1].hidden_states"), results[1].error.field)
        self.assertEqual([s.lengths for s in sessions], [[2], [0], [4]])
        for i in (0, 2):  # BF16 keys and values
            self.assertLessEqual(rel_error(results[i].output, self.reference_rows(xs[i], 0, len(xs[i]))), 2e-2)
        with self.assertRaises(attnserve.InvalidArgumentError) as caught:
            sessions[1].extend(np.zeros((1, 100), np.float32))
        self.assertTrue(caught.exception.field.startswith("steps[0].hidden_states"))
        for s in sessions:
            s.close()

    def test_the_asyncio_client(self):
        x = self.rng.standard_normal((3, 20, D_MODEL)).astype(np.float32)
        prompt = self.rng.standard_normal((5, D_MODEL)).astype(np.float32)

        async def main():
            async with attnserve.aio.Client(self.server.target, timeout=120) as client:
                await client.wait_until_serving()
                self.assertEqual(await client.health(), "SERVING")
                self.assertEqual((await client.model()).d_model, D_MODEL)
                results = await asyncio.gather(*[client.attend(x[i:i + 1], maps="mean") for i in range(3)])
                # What is sent is x as it was when attend was called: overwritten once attend waits for
                # the answer (grpc.aio serializes in a task of its own, later), x still goes out whole.
                scratch = x.copy()
                pending = asyncio.ensure_future(client.attend(scratch))
                await asyncio.sleep(0)  # one turn of the loop: attend runs up to its first wait
                scratch[:] = 0
                overwritten = await pending
                streamed = await client.attend(x, maps="per-head", stream_maps=True)
                with self.assertRaises(attnserve.NotFoundError) as caught:
                    await client.attend(x, model="no-such-model")
                async with await client.open_session(routing_key="key-1") as session:
                    self.assertEqual((session.routing_key, session.replica), ("key-1", REPLICA))
                    step = await session.extend(prompt, maps=True)
                    info = await session.info()
                    latest = await session.latest_attention()
                    fork = await session.fork()
                    self.assertEqual((fork.routing_key, fork.replica), ("key-1", REPLICA))
                    await fork.close()
                return results, streamed, caught.exception, step, info, latest, overwritten

        results, streamed, error, step, info, latest, overwritten = asyncio.run(main())
        ref_out, ref_maps = self.reference(x)
        self.assertLessEqual(rel_error(overwritten.output, ref_out), 1e-5)
        for i, r in enumerate(results):
            self.assertLessEqual(rel_error(r.output[0], ref_out[i]), 1e-5)
            self.assertLessEqual(rel_error(r.maps[0], ref_maps[i].mean(axis=0)), 1e-5)
        self.assertLessEqual(rel_error(streamed.maps, ref_maps), 1e-5)
        self.assertEqual(error.field, "model")
        self.assertLessEqual(rel_error(step.output, self.reference_rows(prompt, 0, 5)), 1e-5)
        self.assertEqual(info.layer_lengths, (5,))
        self.assertEqual((latest.length, latest.position), (5, 4))
        np.testing.assert_allclose(latest.maps, step.maps[:, -1, :], rtol=0, atol=1e-6)


class WithTokens(unittest.TestCase):
    def test_the_token_goes_with_every_call(self):
        with tempfile.TemporaryDirectory() as tmp:
            tokens = os.path.join(tmp, "tokens.txt")
            with open(tokens, "w") as f:
                f.write("user-token-0123456789abcdef\n")
            server = Server(ARGS.server, f"--auth_tokens_file={tokens}")
            try:
                with attnserve.Client(server.target, timeout=120) as anonymous:
                    anonymous.wait_until_serving(timeout=120)  # health stays open
                    with self.assertRaises(attnserve.UnauthenticatedError):
                        anonymous.models()
                with attnserve.Client(server.target, token="user-token-0123456789abcdef", timeout=120) as client:
                    self.assertEqual([m.name for m in client.models()], ["default"])
                    self.assertEqual(client.attend(np.ones((1, 2, D_MODEL))).output.shape, (1, 2, D_MODEL))
                    with self.assertRaises(attnserve.PermissionDeniedError):  # not an admin token
                        client.load("m")
            finally:
                server.stop()


class WithModelRepository(unittest.TestCase):
    def test_load_attend_and_unload_a_repository_model(self):
        d, heads = 32, 4
        rng = np.random.default_rng()
        w = {"in_proj_weight": rng.standard_normal((3 * d, d)) * 0.2, "in_proj_bias": rng.standard_normal(3 * d) * 0.1,
             "out_proj.weight": rng.standard_normal((d, d)) * 0.2, "out_proj.bias": rng.standard_normal(d) * 0.1}
        w = {k: v.astype(np.float32) for k, v in w.items()}
        with tempfile.TemporaryDirectory() as repo:
            os.makedirs(os.path.join(repo, "small"))
            with open(os.path.join(repo, "small", "config.json"), "w") as f:
                json.dump({"layout": "torch_mha", "d_model": d, "num_heads": heads}, f)
            write_safetensors(os.path.join(repo, "small", "model.safetensors"),
                              {name: (value, "F32") for name, value in w.items()})
            server = Server(ARGS.server, f"--model_repository={repo}")
            try:
                with attnserve.Client(server.target, timeout=120) as client:
                    client.wait_until_serving(timeout=120)
                    self.assertEqual(client.model("small").state, "READY")
                    client.unload("small")
                    with self.assertRaises(attnserve.NotFoundError) as caught:
                        client.model("small")
                    self.assertEqual(caught.exception.field, "name")
                    with self.assertRaises(attnserve.NotFoundError):
                        client.attend(np.ones((1, 2, d)), model="small")
                    info = client.load("small")
                    self.assertEqual((info.name, info.state, info.d_model, info.num_heads), ("small", "READY", d, heads))
                    with self.assertRaises(attnserve.AlreadyExistsError):
                        client.load("small")
                    x = rng.standard_normal((2, 5, d)).astype(np.float32)
                    r = client.attend(x, model="small", maps="per-head")
                    q, k, v = np.split(w["in_proj_weight"], 3)
                    bq, bk, bv = np.split(w["in_proj_bias"], 3)
                    weights = [q.T, bq, k.T, bk, v.T, bv, w["out_proj.weight"].T, w["out_proj.bias"]]
                    ref_out, ref_maps = reference_attention(x, weights, heads, heads, d // heads, (d // heads) ** -0.5)
                    self.assertLessEqual(rel_error(r.output, ref_out), 1e-5)
                    self.assertLessEqual(rel_error(r.maps, ref_maps), 1e-5)
                    self.assertEqual(r.model, "small")
            finally:
                server.stop()

    def test_a_folder_of_layers_is_one_model_per_layer_and_a_session_runs_them_in_order(self):
        """config.json's "layers": one GPT-2 checkpoint holding 3 layers with different
        weights loads as the models net.0..net.2; a session opened over "net" runs each
        layer as its own weights' causal layer (float64 reference, FP32 1e-5), layer i
        fed layer i-1's output; load and unload take the folder."""
        d, heads, count = 32, 4, 3
        rng = np.random.default_rng()
        tensors, layers = {}, []
        for i in range(count):
            g = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
            c_attn, c_attn_b, c_proj, c_proj_b = g(d, 3 * d), g(3 * d), g(d, d), g(d)
            p = f"h.{i}.attn."
            tensors.update({p + "c_attn.weight": (c_attn, "F32"), p + "c_attn.bias": (c_attn_b, "F32"),
                            p + "c_proj.weight": (c_proj, "F32"), p + "c_proj.bias": (c_proj_b, "F32")})
            q, k, v = np.split(c_attn, 3, axis=1)  # Conv1D: [in, out], x W
            bq, bk, bv = np.split(c_attn_b, 3)
            layers.append([q, bq, k, bk, v, bv, c_proj, c_proj_b])
        with tempfile.TemporaryDirectory() as repo:
            os.makedirs(os.path.join(repo, "net"))
            with open(os.path.join(repo, "net", "config.json"), "w") as f:
                json.dump({"layout": "gpt2", "d_model": d, "num_heads": heads,
                           "layers": {"count": count, "prefix": "h.{layer}.attn."}}, f)
            write_safetensors(os.path.join(repo, "net", "model.safetensors"), tensors)
            server = Server(ARGS.server, f"--model_repository={repo}")
            try:
                with attnserve.Client(server.target, timeout=120) as client:
                    client.wait_until_serving(timeout=120)
                    self.assertEqual([m.name for m in client.models()], ["net.0", "net.1", "net.2"])
                    with client.open_session("net") as session:
                        self.assertEqual(list(session.models), ["net.0", "net.1", "net.2"])
                        inputs = [np.zeros((0, d), np.float32) for _ in range(count)]
                        for n in (4, 1, 2):
                            x = rng.standard_normal((n, d)).astype(np.float32)
                            for i in range(count):
                                before = len(inputs[i])
                                inputs[i] = np.concatenate([inputs[i], x])
                                step = session.extend(x, layer=i)
                                ref, _ = reference_attention(inputs[i][None], layers[i], heads, heads, d // heads,
                                                             (d // heads) ** -0.5, causal=True)
                                self.assertLessEqual(rel_error(step.output, ref[0, before:]), 1e-5, f"layer {i}")
                                x = step.output  # the next layer's input
                    with self.assertRaises(attnserve.FailedPreconditionError):
                        client.unload("net.1")
                    client.unload("net")
                    self.assertEqual(client.models(), [])
                    loaded = client.load("net")
                    self.assertEqual([m.name for m in loaded], ["net.0", "net.1", "net.2"])
                    self.assertEqual({m.state for m in loaded}, {"READY"})
            finally:
                server.stop()


def rope_half(t, positions, theta=10000.0):
    """Llama RoPE (rotate-half, over all of head_dim) on t [heads, seq, hd], float64."""
    hd = t.shape[-1]
    half = hd // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / hd)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq  # [seq, half]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = t[..., :half], t[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def nearest_bf16(values):
    """float64 values rounded through float32 to the nearest bfloat16 (ties
    to even), by integer rounding of the float32 bits (finite values)."""
    bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


class LatestAttention(unittest.TestCase):
    """Session.latest_attention (GetLatestAttention) against the real server:
    after a prefill and each of 3 decode steps, the maps equal the last row
    of that step's Extend maps (to 1e-6) and a float64 reference of the
    latest token's query over every cached key, from the hidden states and
    the models' weights (RoPE at the session's positions, GQA): within 1e-5
    with FP32 KV, and 1e-3 with BF16 KV (the reference's keys rounded to
    BF16 as the cache stores them; the server's keys may round the other way
    where its FP32 projection differs from float64 in the last bit; measured:
    1.2e-7 against Extend's maps and 5.5e-7 against the reference, both KV
    precisions). Two
    models from a repository: Llama-layout with GQA (4 query heads, 2 KV
    heads) and RoPE, and a torch MultiheadAttention one (MHA, no RoPE).
    Forks read as their parent; a truncate makes the read
    FAILED_PRECONDITION until the next step; another token gets NOT_FOUND."""
    D = 64
    TOKEN, OTHER = "latest-token-0123456789abcdef", "other-token-0123456789abcdef"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        repo = cls.tmp.name
        rng = np.random.default_rng()
        d, g = cls.D, lambda *shape: (rng.standard_normal(shape) * 0.25).astype(np.float32)  # noqa: E731
        # Llama: q/k/v/o_proj [out, in], no biases; 4 heads of 16, 2 KV heads, RoPE over head_dim.
        q, k, v, o = g(64, d), g(32, d), g(32, d), g(d, 64)
        p = "model.layers.0.self_attn."
        os.makedirs(os.path.join(repo, "gqa_rope"))
        with open(os.path.join(repo, "gqa_rope", "config.json"), "w") as f:
            json.dump({"layout": "llama", "prefix": p, "d_model": d, "num_heads": 4, "num_kv_heads": 2,
                       "rotary": {"dim": 16, "theta": 10000.0}}, f)
        write_safetensors(os.path.join(repo, "gqa_rope", "model.safetensors"),
                          {p + "q_proj.weight": (q, "F32"), p + "k_proj.weight": (k, "F32"),
                           p + "v_proj.weight": (v, "F32"), p + "o_proj.weight": (o, "F32")})
        # torch nn.MultiheadAttention: 8 heads of 8, biases, no RoPE.
        w_in, b_in, w_out, b_out = g(3 * d, d), g(3 * d), g(d, d), g(d)
        os.makedirs(os.path.join(repo, "mha"))
        with open(os.path.join(repo, "mha", "config.json"), "w") as f:
            json.dump({"layout": "torch_mha", "d_model": d, "num_heads": 8}, f)
        write_safetensors(os.path.join(repo, "mha", "model.safetensors"),
                          {"in_proj_weight": (w_in, "F32"), "in_proj_bias": (b_in, "F32"),
                           "out_proj.weight": (w_out, "F32"), "out_proj.bias": (b_out, "F32")})
        # name: (w_q [d, q], b_q, w_k [d, kv], b_k, heads, kv_heads, rope)
        cls.models = {
            "gqa_rope": (q.T, np.zeros(64), k.T, np.zeros(32), 4, 2, True),
            "mha": (w_in[:d].T, b_in[:d], w_in[d:2 * d].T, b_in[d:2 * d], 8, 8, False),
        }
        tokens = os.path.join(repo, "tokens.txt")
        with open(tokens, "w") as f:
            f.write(f"{cls.TOKEN}\n{cls.OTHER}\n")
        cls.server = Server(ARGS.server, f"--model_repository={repo}", f"--auth_tokens_file={tokens}",
                            "--access_log", f"--replica_name={REPLICA}")
        cls.client = attnserve.Client(cls.server.target, token=cls.TOKEN, timeout=120)
        cls.client.wait_until_serving(timeout=120)
        cls.rng = rng

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        cls.tmp.cleanup()

    def reference(self, model, xs, first_position, bf16_kv):
        """float64 softmax of the last token's query over every key, [heads, L]."""
        w_q, b_q, w_k, b_k, heads, kv_heads, rope = self.models[model]
        x = np.asarray(xs, np.float64)
        hd = w_q.shape[1] // heads
        q = (x[-1:] @ w_q.astype(np.float64) + b_q).reshape(1, heads, hd).transpose(1, 0, 2)
        k = (x @ w_k.astype(np.float64) + b_k).reshape(len(x), kv_heads, hd).transpose(1, 0, 2)
        if rope:
            positions = first_position + np.arange(len(x))
            q, k = rope_half(q, positions[-1:]), rope_half(k, positions)
        if bf16_kv:
            k = nearest_bf16(k)
        k = np.repeat(k, heads // kv_heads, axis=0)
        scores = (q @ k.transpose(0, 2, 1))[:, 0, :] / np.sqrt(hd)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)

    def check(self, session, model, xs, step, first_position, bf16_kv):
        read = session.latest_attention()
        heads = self.models[model][4]
        self.assertEqual((read.length, read.position, read.layer), (len(xs), first_position + len(xs) - 1, 0))
        self.assertEqual(read.maps.shape, (heads, len(xs)))
        self.assertEqual((read.entropy.shape, read.max_weight.shape), ((heads,), (heads,)))
        np.testing.assert_allclose(read.maps, step.maps[:, -1, :], rtol=0, atol=1e-6)
        ref = self.reference(model, xs, first_position, bf16_kv)
        np.testing.assert_allclose(read.maps, ref, rtol=0, atol=1e-3 if bf16_kv else 1e-5)
        np.testing.assert_allclose(read.maps.sum(axis=-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(read.max_weight, ref.max(axis=-1), atol=1e-3 if bf16_kv else 1e-5)
        ref_entropy = -(ref * np.log(np.maximum(ref, 1e-300))).sum(axis=-1)
        np.testing.assert_allclose(read.entropy, ref_entropy, atol=1e-2 if bf16_kv else 1e-4)
        return read

    def test_reads_the_latest_tokens_attention_after_every_step(self):
        for model in self.models:
            for kv_dtype in ("fp32", "bf16"):
                with self.subTest(model=model, kv_dtype=kv_dtype):
                    bf16_kv = kv_dtype == "bf16"
                    first_position = int(self.rng.integers(0, 50))
                    with self.client.open_session(model, kv_dtype=kv_dtype, first_position=first_position) as s:
                        with self.assertRaises(attnserve.FailedPreconditionError):  # no tokens yet
                            s.latest_attention()
                        xs = self.rng.standard_normal((7, self.D)).astype(np.float32)
                        step = s.extend(xs, maps=True)
                        self.check(s, model, xs, step, first_position, bf16_kv)
                        for _ in range(3):
                            x = self.rng.standard_normal((1, self.D)).astype(np.float32)
                            xs = np.concatenate([xs, x])
                            step = s.extend(x, maps=True)
                            read = self.check(s, model, xs, step, first_position, bf16_kv)

                        # A fork reads as its parent, also after the parent moves on.
                        with s.fork() as fork:
                            np.testing.assert_array_equal(fork.latest_attention().maps, read.maps)
                            s.extend(self.rng.standard_normal((1, self.D)).astype(np.float32))
                            np.testing.assert_array_equal(fork.latest_attention().maps, read.maps)
                        s.truncate(len(xs))  # drop the token the fork did not see

                        # Truncated below the latest token: FAILED_PRECONDITION until a step.
                        s.truncate(len(xs) - 1)
                        with self.assertRaises(attnserve.FailedPreconditionError) as caught:
                            s.latest_attention()
                        self.assertIn("extend it by a token first", str(caught.exception))
                        x = self.rng.standard_normal((1, self.D)).astype(np.float32)
                        xs = np.concatenate([xs[:-1], x])
                        step = s.extend(x, maps=True)
                        self.check(s, model, xs, step, first_position, bf16_kv)

                        with self.assertRaises(attnserve.InvalidArgumentError) as caught:
                            s.latest_attention(layer=1)
                        self.assertEqual(caught.exception.field, "layer")

    def test_the_read_is_observed_as_the_other_session_calls(self):
        with self.client.open_session("gqa_rope") as s:
            s.extend(self.rng.standard_normal((2, self.D)).astype(np.float32))
            request = attnserve.v1.attention_pb2.LatestAttentionRequest(session_id=s.id, layer=0)
            response, call = self.client.stub.GetLatestAttention.with_call(
                request, metadata=[("authorization", f"Bearer {self.TOKEN}")], timeout=60)
            self.assertEqual(response.length, 2)
            self.assertIn(("attnserve-replica", REPLICA), call.initial_metadata())
            with self.assertRaises(grpc.RpcError) as caught:  # no token
                self.client.stub.GetLatestAttention(request, timeout=60)
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        wait_until("the read's access log line", lambda: any(
            '"method":"GetLatestAttention"' in line and '"code":"OK"' in line for line in list(self.server.log)), 60)
        wait_until("the read's request counter", lambda: metric(
            parse_exposition(self.server.scrape_text()), "attnserve_requests_total", method="GetLatestAttention",
            code="UNAUTHENTICATED") == 1, 60)

    def test_another_token_gets_not_found(self):
        with self.client.open_session("mha") as s:
            s.extend(self.rng.standard_normal((3, self.D)).astype(np.float32))
            self.assertEqual(s.latest_attention().length, 3)
            with attnserve.Client(self.server.target, token=self.OTHER, timeout=120) as other:
                theirs = attnserve.Session(other, s.info())
                with self.assertRaises(attnserve.NotFoundError) as caught:
                    theirs.latest_attention()
                self.assertIn("unknown session", str(caught.exception))


class WithTls(unittest.TestCase):
    def test_tls_with_the_servers_ca_and_a_client_certificate(self):
        with tempfile.TemporaryDirectory() as tmp:
            def openssl(*argv):
                subprocess.run(["openssl", *argv], cwd=tmp, check=True, capture_output=True)
            ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            openssl("req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=test-ca")
            with open(os.path.join(tmp, "server.ext"), "w") as f:
                f.write("subjectAltName=DNS:attnserve.test\n")
            for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
                openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
                openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                        "-CAcreateserial", "-days", "2", *ext, "-out", f"{name}.pem")
            path = lambda name: os.path.join(tmp, name)  # noqa: E731
            server = Server(ARGS.server, f"--tls_cert={path('server.pem')}", f"--tls_key={path('server.key')}",
                            f"--tls_client_ca={path('ca.pem')}")
            try:
                # The certificate names attnserve.test, not the address: server_name says which to expect.
                tls = attnserve.Tls(ca=path("ca.pem"), cert=path("client.pem"), key=path("client.key"),
                                    server_name="attnserve.test")
                with attnserve.Client(server.target, tls=tls, timeout=120) as client:
                    client.wait_until_serving(timeout=120)
                    self.assertEqual(client.attend(np.ones((1, 2, D_MODEL))).output.shape, (1, 2, D_MODEL))
                with open(path("ca.pem"), "rb") as f:  # PEM bytes work as well as paths
                    no_client_cert = attnserve.Tls(ca=f.read(), server_name="attnserve.test")
                for tls in (no_client_cert, None):
                    with attnserve.Client(server.target, tls=tls, timeout=120) as client:
                        with self.assertRaises(attnserve.UnavailableError):
                            client.models()
            finally:
                server.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--installed", action="store_true",
                        help="require the package to be the one installed in this interpreter's environment")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0], "-v", *rest])


if __name__ == "__main__":
    main()
