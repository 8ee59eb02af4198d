#!/usr/bin/python3
"""Writes the seed corpus of npy_fuzzer (cli/npy.h's ParseNpy) into
tests/fuzz/npy_corpus/.

valid_* seeds are written by NumPy itself (numpy.lib.format.write_array) in
format versions 1.0, 2.0 and 3.0, float32 and float64, shapes (S, D),
(1, S, D), a scalar, an empty array, and what the parser converts (big-endian,
float16, Fortran order, booleans) or reads as it is (a NaN: the explorer
refuses it after parsing): ParseNpy must accept each. invalid_* seeds are
malformed files (a version 4.0, a header with an unknown key, data one byte
short, a shape whose size overflows int64, a complex dtype): ParseNpy must
refuse each, naming the file. Rerun after changing the parser:
tests/fuzz/make_npy_corpus.py
"""
import io
import pathlib
import struct

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "npy_corpus"


def npy(array, version):
    out = io.BytesIO()
    np.lib.format.write_array(out, array, version=version)
    return out.getvalue()


def by_hand(header, data=b"", version=(1, 0)):
    """A .npy file with `header` (a dict literal) as written, padded like NumPy."""
    text = header.encode("latin1")
    length_bytes = 2 if version[0] == 1 else 4
    pad = (64 - (8 + length_bytes + len(text) + 1) % 64) % 64
    text += b" " * pad + b"\n"
    length = struct.pack("<H" if length_bytes == 2 else "<I", len(text))
    return b"\x93NUMPY" + bytes(version) + length + text + data


def main():
    OUT.mkdir(exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    rng = np.random.default_rng(22)
    seeds = {}
    for version in [(1, 0), (2, 0), (3, 0)]:
        v = version[0]
        seeds[f"valid_v{v}_f4_2d"] = npy(rng.standard_normal((5, 8)).astype("<f4"), version)
        seeds[f"valid_v{v}_f8_3d"] = npy(rng.standard_normal((1, 4, 6)).astype("<f8"), version)
    seeds["valid_v1_scalar"] = npy(np.array(1.5, dtype="<f4"), (1, 0))
    seeds["valid_v1_empty"] = npy(np.zeros((0, 3), dtype="<f4"), (1, 0))
    seeds["valid_v1_big_endian"] = npy(rng.standard_normal((2, 3)).astype(">f4"), (1, 0))
    seeds["valid_v1_float16"] = npy(rng.standard_normal((2, 3)).astype("<f2"), (1, 0))
    seeds["valid_v1_fortran_order"] = npy(np.asfortranarray(rng.standard_normal((2, 3)).astype("<f4")),
                                          (1, 0))
    seeds["valid_v1_bool"] = npy(rng.standard_normal((2, 3)) > 0, (1, 0))
    seeds["valid_v1_nan"] = npy(np.array([[1.0, np.nan]], dtype="<f4"), (1, 0))
    # Found by libFuzzer: no elements, although the first two dimensions pass the limit.
    seeds["valid_v1_zero_dim_after_large"] = by_hand(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (42949672, 32, 0), }")
    seeds["invalid_complex"] = npy(np.ones((2,), dtype="<c8"), (1, 0))
    seeds["invalid_version_4"] = by_hand("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }",
                                         b"\0\0\0\0", version=(4, 0))
    seeds["invalid_unknown_key"] = by_hand(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1, }", b"\0\0\0\0")
    seeds["invalid_short_data"] = by_hand("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                                          b"\0" * 7)
    seeds["invalid_huge_dims"] = by_hand(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }")
    for name, data in seeds.items():
        (OUT / name).write_bytes(data)


if __name__ == "__main__":
    main()
