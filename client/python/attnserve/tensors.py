"""NumPy arrays to and from attnserve's wire tensors (`attnserve.v1.Tensor`).

Tensors travel as little-endian row-major bytes (`raw_data`) with a dtype and a
shape: FP32, BF16 (the upper half of a binary32, rounded to nearest, ties to
even) or BOOL (one byte per element, for masks). NumPy has no bfloat16, so BF16
values come back widened to float32 (exact: every BF16 value is a float32), and
their raw 16-bit words are available as uint16 arrays.
"""
import numpy as np

from . import _wire
from .v1 import attention_pb2 as pb

__all__ = ["bf16_round", "to_bf16_words", "from_bf16_words", "encode", "decode", "decode_words"]

_WIRE_DTYPES = {"fp32": pb.DATA_TYPE_FP32, "bf16": pb.DATA_TYPE_BF16}


def wire_dtype(name, what):
    """The DataType enum of "fp32" or "bf16" (None: FP32); ValueError naming `what` otherwise."""
    if name is None:
        return pb.DATA_TYPE_FP32
    try:
        return _WIRE_DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"{what}: {name!r} is not 'fp32' or 'bf16'") from None


def _as_float32(array, what):
    """`array` as a C-contiguous little-endian float32 array; any real dtype is
    converted (float64 and float16 rounded or widened as NumPy does)."""
    array = np.asarray(array)
    if array.dtype.kind not in "fiub":
        raise TypeError(f"{what}: cannot send an array of dtype {array.dtype} (real numbers only)")
    return np.ascontiguousarray(array, dtype="<f4")


def to_bf16_words(array):
    """The bfloat16 words (uint16) nearest to `array`'s values, ties to even.
    Values are first taken as float32 (float64 rounds once to float32); NaN
    stays NaN (a quiet one, sign kept) and values past BF16's range become
    infinities, as IEEE rounding has it."""
    f32 = _as_float32(array, "bf16")
    bits = f32.view("<u4")
    # Adding 0x7FFF plus the kept part's lowest bit, then dropping the low half,
    # rounds to nearest with ties to even; a carry into the exponent is right
    # (it rounds up to the next binade, or to infinity).
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    words = rounded.astype("<u2")
    nan = np.isnan(f32)
    if nan.any():  # the addition could carry a NaN's payload into infinity
        words[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return words.reshape(f32.shape)


def from_bf16_words(words):
    """bfloat16 words (uint16) widened to float32 (exactly)."""
    words = np.asarray(words, dtype="<u2")
    # Shifted straight into the result (astype then << made a second array of
    # the result's size: 50 MB for B=4 S=512 maps).
    widened = np.empty(words.shape, "<u4")
    np.left_shift(words, np.uint32(16), out=widened, dtype="<u4")
    return widened.view("<f4")


def bf16_round(array):
    """`array`'s values rounded to the nearest bfloat16 (ties to even), as float32."""
    return from_bf16_words(to_bf16_words(array))


def encode_wire(array, dtype=None, what="tensor"):
    """A NumPy array as a _wire.WireTensor: the Tensor encode() builds, its
    raw data still an array (the caller's own memory when `array` already is
    C-contiguous little-endian float32 or bool: nothing is copied here)."""
    array = np.asarray(array)
    if array.dtype == np.bool_:
        values, wire = np.ascontiguousarray(array), pb.DATA_TYPE_BOOL
    else:
        wire = wire_dtype(dtype, what)
        values = to_bf16_words(array) if wire == pb.DATA_TYPE_BF16 else _as_float32(array, what)
    return _wire.WireTensor(wire, array.shape, values.reshape(-1).view(np.uint8))


def encode(array, dtype=None, what="tensor"):
    """A NumPy array as a Tensor message. dtype: "fp32" (default) or "bf16" for
    the values on the wire; a bool array always travels as BOOL. `what` names
    the argument in error messages."""
    return encode_wire(array, dtype, what).message()


def _aligned_view(raw, dtype):
    """`raw` as a read-only array of `dtype`: a view of it where its address is
    a multiple of the element's size, else a copy. A tensor's bytes sit in a
    response at an offset the fields before them decide (the model's name,
    for one); NumPy reads a misaligned view correctly, but slowly, and code
    that takes NumPy's memory as it is (C extensions, torch.from_numpy) may
    assume alignment."""
    array = np.frombuffer(raw, dtype=dtype)
    if not array.flags.aligned:
        array = array.copy()
        array.flags.writeable = False
    return array


def decode_raw(dtype, shape, raw):
    """Raw data (any bytes-like object) of a Tensor with this DataType and
    shape (a tuple) as decode() reads it; None for an empty shape. FP32 is a
    read-only view of `raw` (a copy where raw's address is not a multiple of
    4)."""
    if not shape:
        return None
    if dtype == pb.DATA_TYPE_BF16:
        return from_bf16_words(np.frombuffer(raw, dtype="<u2")).reshape(shape)
    if dtype == pb.DATA_TYPE_BOOL:
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape).astype(bool)
    return _aligned_view(raw, "<f4").reshape(shape)


def decode_raw_words(dtype, shape, raw):
    """decode_words() of raw data: a BF16 tensor's words as a read-only uint16
    view (a copy where raw's address is odd)."""
    if not shape or dtype != pb.DATA_TYPE_BF16:
        return None
    return _aligned_view(raw, "<u2").reshape(shape)


def decode(tensor):
    """A Tensor message's values as a float32 array of its shape, or None when
    it has no shape (an unset field). FP32 raw data comes back as a read-only
    view of the message's bytes (no copy); BF16 is widened into a new array;
    float_data is copied."""
    if not tensor.shape:
        return None
    if tensor.float_data:
        return np.asarray(tensor.float_data, dtype=np.float32).reshape(tuple(tensor.shape))
    return decode_raw(tensor.dtype, tuple(tensor.shape), tensor.raw_data)


def decode_words(tensor):
    """A BF16 Tensor's raw 16-bit words as a read-only uint16 array of its
    shape; None for an unset field or another dtype."""
    if tensor.float_data:
        return None
    return decode_raw_words(tensor.dtype, tuple(tensor.shape), tensor.raw_data)
