"""Attend's messages on the wire without copying their tensors through protobuf.

Python's protobuf copies a tensor's bytes at every step: ndarray.tobytes(),
the Tensor message's raw_data, CopyFrom into the request, SerializeToString;
and on the way back ParseFromString and reading raw_data. Each copy costs
about as much as moving the bytes over a loopback socket. Here:

- a request is its small fields, serialized by protobuf, followed by its big
  tensors' (tag, length, Tensor{dtype, shape, raw_data}) framing written here
  around the arrays' own memory, all joined into one bytes object (the one
  copy before gRPC's own);
- a response's output and attention maps are found inside the received bytes
  and read with np.frombuffer (no copy); protobuf parses everything else.

Protobuf lets fields come in any order, so the request parses to exactly the
message protobuf's setters build (tests/client/python/package_test.py checks
it). The response reader knows AttendResponse's fields as the package's
attention.proto has them; anything else (an unknown or repeated field, a
tensor with float_data or an unpacked shape, a wire type it does not expect,
truncated bytes) makes it hand the whole bytes to protobuf instead, so an
answer never differs from protobuf's parse of the same bytes.
"""
from .v1 import attention_pb2 as pb

__all__ = ["WireTensor", "AttendWire", "AttendWireResponse", "serialize", "parse_attend_response"]

_VARINT, _LEN = 0, 2


def _varint(value):
    """Protobuf's base-128 varint of a non-negative integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field, wire_type):
    return _varint(field << 3 | wire_type)


class WireTensor:
    """A Tensor message not yet built: its DataType enum, shape (a tuple of
    non-negative ints) and raw data (a 1-D uint8 array over the values'
    little-endian bytes, possibly the caller's own memory)."""
    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.data = data

    def message(self):
        """The pb.Tensor, built by protobuf (copies the data)."""
        return pb.Tensor(dtype=self.dtype, shape=self.shape, raw_data=self.data.tobytes())

    def pieces(self):
        """([the Tensor's encoding's pieces], their total length): the data
        itself is a piece, not copied. Fields with default values are left
        out, as protobuf leaves them out."""
        header = bytearray()
        if self.dtype:
            header += _key(1, _VARINT) + _varint(self.dtype)
        if self.shape:
            packed = b"".join(_varint(d) for d in self.shape)
            header += _key(2, _LEN) + _varint(len(packed)) + packed
        size = self.data.nbytes
        if not size:
            return [bytes(header)], len(header)
        header += _key(3, _LEN) + _varint(size)
        return [bytes(header), self.data], len(header) + size


class AttendWire:
    """An AttendRequest as its small fields (`request`, a message without the
    big tensors) and its big tensors (`tensors`: [(path, WireTensor)], a path
    the field numbers from AttendRequest down to the Tensor, e.g. (2,) for
    hidden_states, (8, 2) for mask.values). SerializeToString() gives bytes
    that protobuf parses to the whole request; message() builds it."""

    def __init__(self, request, tensors):
        self.request = request
        self.tensors = list(tensors)

    def message(self):
        """The whole AttendRequest, built by protobuf's setters."""
        whole = pb.AttendRequest()
        whole.CopyFrom(self.request)
        for path, tensor in self.tensors:
            target = whole
            for number in path:
                target = getattr(target, target.DESCRIPTOR.fields_by_number[number].name)
            target.CopyFrom(tensor.message())
        return whole

    def SerializeToString(self):  # noqa: N802 (protobuf's name, so that gRPC's serializer takes either)
        """The request's wire bytes: its small fields, then each tensor's field
        (a nested one, such as mask.values, inside its parent's field with the
        parent's small fields), with the arrays' memory joined in once."""
        small = pb.AttendRequest()
        small.CopyFrom(self.request)
        nested = {}  # parent field number -> [(child number, tensor)]
        top = []
        for path, tensor in self.tensors:
            if len(path) == 1:
                top.append((path[0], tensor))
            elif len(path) == 2:
                nested.setdefault(path[0], []).append((path[1], tensor))
            else:
                raise ValueError(f"tensor path {path}: at most one message between the request and the tensor")
        pieces = []
        for parent, children in nested.items():
            # The parent's own small fields (mask.kind) go in the same field
            # occurrence; the small message then leaves the parent out.
            name = small.DESCRIPTOR.fields_by_number[parent].name
            prefix = getattr(small, name).SerializeToString() if small.HasField(name) else b""
            small.ClearField(name)
            inner, inner_size = [prefix], len(prefix)
            for number, tensor in children:
                parts, size = tensor.pieces()
                head = _key(number, _LEN) + _varint(size)
                inner += [head, *parts]
                inner_size += len(head) + size
            pieces += [_key(parent, _LEN) + _varint(inner_size), *inner]
        for number, tensor in top:
            parts, size = tensor.pieces()
            pieces += [_key(number, _LEN) + _varint(size), *parts]
        return b"".join([small.SerializeToString(), *pieces])


def serialize(request):
    """gRPC's request serializer for Attend: a pb.AttendRequest or an AttendWire."""
    return request.SerializeToString()


class _Unexpected(Exception):
    """The bytes are not laid out as the fast reader expects: protobuf reads them."""


def _read_varint(data, pos, end):
    """(value, next position) of the varint at data[pos]; at most 10 bytes."""
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise _Unexpected()
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip(data, pos, end, wire_type):
    """The position after a field's value of this wire type (varint or length-delimited)."""
    if wire_type == _VARINT:
        return _read_varint(data, pos, end)[1]
    if wire_type == _LEN:
        length, pos = _read_varint(data, pos, end)
        if pos + length > end:
            raise _Unexpected()
        return pos + length
    raise _Unexpected()


def _read_tensor(data, pos, end):
    """(dtype, shape tuple, raw_data start, raw_data end) of a Tensor encoded
    in data[pos:end]; _Unexpected for float_data, an unpacked shape, a repeated
    field, a value past int32/int64, an unknown field."""
    dtype, shape, raw, seen = 0, (), (0, 0), set()
    while pos < end:
        key, pos = _read_varint(data, pos, end)
        field, wire_type = key >> 3, key & 7
        if field in seen:
            raise _Unexpected()
        seen.add(field)
        if field == 1 and wire_type == _VARINT:
            dtype, pos = _read_varint(data, pos, end)
            if dtype > 0x7FFFFFFF:  # a negative enum value: protobuf reads it as such
                raise _Unexpected()
        elif field == 2 and wire_type == _LEN:
            length, pos = _read_varint(data, pos, end)
            stop, dims = pos + length, []
            if stop > end:
                raise _Unexpected()
            while pos < stop:
                dim, pos = _read_varint(data, pos, stop)
                if dim >= 1 << 63:
                    raise _Unexpected()
                dims.append(dim)
            shape = tuple(dims)
        elif field == 3 and wire_type == _LEN:
            length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise _Unexpected()
            raw = (pos, pos + length)
            pos += length
        else:
            raise _Unexpected()
    return dtype, shape, raw[0], raw[1]


# AttendResponse: the tensors read in place, and the other fields' wire types.
_TENSORS = (2, 3)  # output, attention_maps
_OTHERS = {1: _LEN, 4: _LEN, 5: _LEN, 6: _LEN, 7: _VARINT}  # model, timing, kernel_path, head_statistics, precision


class AttendWireResponse:
    """An AttendResponse read from its bytes: `rest` (protobuf's parse of every
    field but the output and the maps), `tensors` ({2: output, 3: maps}, each
    (dtype, shape, raw start, raw end) into `data`), `data` (the bytes).
    `message` parses the whole response with protobuf when first read."""
    __slots__ = ("data", "rest", "tensors", "_message")

    def __init__(self, data, rest, tensors):
        self.data = data
        self.rest = rest
        self.tensors = tensors
        self._message = None

    @property
    def message(self):
        if self._message is None:
            self._message = pb.AttendResponse.FromString(self.data)
        return self._message

    def raw(self, field):
        """A memoryview of a tensor's raw_data inside `data` (empty when absent)."""
        _, _, start, end = self.tensors.get(field, (0, (), 0, 0))
        return memoryview(self.data)[start:end]


def parse_attend_response(data):
    """gRPC's response deserializer for Attend: an AttendWireResponse, or
    protobuf's AttendResponse when the bytes hold anything the fast reader
    does not expect (see the module's comment). `data` must be immutable
    (gRPC hands over bytes)."""
    if not isinstance(data, bytes):
        return pb.AttendResponse.FromString(data)
    try:
        return _parse_fast(data)
    except _Unexpected:
        return pb.AttendResponse.FromString(data)


def _parse_fast(data):
    end, pos = len(data), 0
    tensors, spans = {}, []  # spans: the other fields' [start, stop), neighbours merged
    while pos < end:
        start = pos
        key, pos = _read_varint(data, pos, end)
        field, wire_type = key >> 3, key & 7
        if field in _TENSORS:
            if wire_type != _LEN or field in tensors:
                raise _Unexpected()
            length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise _Unexpected()
            tensors[field] = _read_tensor(data, pos, pos + length)
            pos += length
        elif _OTHERS.get(field) == wire_type:
            pos = _skip(data, pos, end, wire_type)
            if spans and spans[-1][1] == start:
                spans[-1][1] = pos
            else:
                spans.append([start, pos])
        else:
            raise _Unexpected()
    view = memoryview(data)
    rest = pb.AttendResponse.FromString(b"".join(view[a:b] for a, b in spans))
    return AttendWireResponse(data, rest, tensors)


def attend_callables(channel):
    """(Attend, AttendStream) on `channel` (grpc or grpc.aio) taking a
    pb.AttendRequest or an AttendWire; Attend answers with
    parse_attend_response's result, AttendStream with AttendStreamResponse
    messages."""
    service = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
    attend = channel.unary_unary(f"/{service}/Attend", request_serializer=serialize,
                                 response_deserializer=parse_attend_response)
    stream = channel.unary_stream(f"/{service}/AttendStream", request_serializer=serialize,
                                  response_deserializer=pb.AttendStreamResponse.FromString)
    return attend, stream
