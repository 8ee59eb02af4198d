"""Attend's and Extend's messages on the wire without copying their tensors
through protobuf.

Python's protobuf copies a tensor's bytes at every step: ndarray.tobytes(),
the Tensor message's raw_data, CopyFrom into the request, SerializeToString;
and on the way back ParseFromString and reading raw_data (about 0.3 ms per
copy of 3 MB; docs/measurements.md). Here:

- a request is its small fields, serialized by protobuf, followed by its big
  tensors' (tag, length, Tensor{dtype, shape, raw_data}) framing written here
  around the arrays' own memory, all joined into one bytes object (the one
  copy before gRPC's own);
- a response's tensors (Attend's output and maps, AttendStream's map chunks,
  each Extend result's) are
  found inside the received bytes and read with np.frombuffer (no copy);
  protobuf parses everything else. Responses under IN_PLACE_MIN_BYTES, and
  Extend requests whose tensors are, go through protobuf: for a few decode
  tokens protobuf's C++ is faster than framing them in Python.

Protobuf lets fields come in any order, so a request parses to exactly the
message protobuf's setters build (tests/client/python/package_test.py checks
it). The response reader knows the response fields as the package's
attention.proto has them; anything else (an unknown or repeated field, a
tensor with float_data or an unpacked shape, a wire type it does not expect,
truncated bytes) makes it hand the whole bytes to protobuf instead, so an
answer never differs from protobuf's parse of the same bytes.
"""
from .v1 import attention_pb2 as pb

__all__ = ["WireTensor", "MessageWire", "WireMessage", "serialize", "parse_attend_response", "parse_extend_response",
           "parse_attend_stream_response", "callables"]

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


class MessageWire:
    """A message as its small fields (`small`, a protobuf message holding none
    of the fields below) and its big parts (`parts`: {field number: a
    WireTensor, a MessageWire, or a list of MessageWire for a repeated field},
    in the order they go on the wire). SerializeToString() gives bytes that
    protobuf parses to the whole message; message() builds it with protobuf."""

    def __init__(self, small, parts):
        self.small = small
        self.parts = dict(parts)

    def message(self):
        """The whole message, built by protobuf's setters (copies every tensor)."""
        whole = type(self.small)()
        whole.CopyFrom(self.small)
        fields = whole.DESCRIPTOR.fields_by_number
        for number, part in self.parts.items():
            target = getattr(whole, fields[number].name)
            if isinstance(part, list):
                for element in part:
                    target.add().CopyFrom(element.message())
            else:
                target.CopyFrom(part.message())
        return whole

    def pieces(self):
        """([the encoding's pieces], their total length); the arrays are pieces
        of their own, not copied."""
        small = self.small.SerializeToString()
        pieces, size = [small], len(small)
        for number, part in self.parts.items():
            for element in part if isinstance(part, list) else [part]:
                parts, part_size = element.pieces()
                head = _key(number, _LEN) + _varint(part_size)
                pieces += [head, *parts]
                size += len(head) + part_size
        return pieces, size

    def SerializeToString(self):  # noqa: N802 (protobuf's name: gRPC's serializer takes a message or this)
        """The wire bytes: the small fields, then each big part's field, with
        the arrays' memory joined in once."""
        return b"".join(self.pieces()[0])


def serialize(request):
    """gRPC's request serializer: a protobuf message, a MessageWire, or bytes
    already serialized (grpc.aio serializes in a task of its own, after the
    caller has gone on: its callers pass bytes, taken while the arrays are as
    they were at the call)."""
    return request if isinstance(request, bytes) else request.SerializeToString()


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


# Responses smaller than this are parsed by protobuf: below it, copying the
# bytes costs less than reading the fields in Python (about 5 us).
IN_PLACE_MIN_BYTES = 64 << 10

# The layouts the fast reader knows: {field number: the wire type of a field
# protobuf parses (_VARINT, _LEN), _TENSOR for a Tensor read in place, or
# (message class, layout, repeated) for a message field read the same way}.
_TENSOR = "tensor"
_ATTEND_RESPONSE = {1: _LEN, 2: _TENSOR, 3: _TENSOR, 4: _LEN, 5: _LEN, 6: _LEN, 7: _VARINT}
_EXTEND_RESULT = {1: _VARINT, 2: _LEN, 3: _TENSOR, 4: _TENSOR, 5: _VARINT, 6: _VARINT, 7: _LEN}
_EXTEND_RESPONSE = {1: (pb.ExtendResult, _EXTEND_RESULT, True), 2: _LEN, 3: _LEN, 4: _VARINT}
# AttendStreamResponse: the response (no map values in it) parsed by protobuf; a map chunk's maps in place.
_MAP_CHUNK = {1: _VARINT, 2: _VARINT, 3: _VARINT, 4: _TENSOR}
_ATTEND_STREAM_RESPONSE = {1: _LEN, 2: (pb.AttentionMapChunk, _MAP_CHUNK, False)}


class WireMessage:
    """A message read from data[start:end]: `rest` (protobuf's parse of every
    field but the tensors and repeated messages read here), `tensors`
    ({field number: (dtype, shape, raw start, raw end) into `data`}),
    `children` ({field number: [WireMessage]}, for a message field)
    and `data` (the received bytes). `message` parses the whole message with
    protobuf when first read."""
    __slots__ = ("data", "start", "end", "rest", "tensors", "children", "_message")

    def __init__(self, data, start, end, rest, tensors, children):
        self.data, self.start, self.end = data, start, end
        self.rest, self.tensors, self.children = rest, tensors, children
        self._message = None

    @property
    def message(self):
        if self._message is None:
            whole = self.data if (self.start, self.end) == (0, len(self.data)) else self.data[self.start:self.end]
            self._message = type(self.rest).FromString(whole)
        return self._message

    def tensor(self, field):
        """(dtype, shape, raw_data as a memoryview of `data`) of a tensor field
        ((0, (), empty) when absent)."""
        dtype, shape, start, end = self.tensors.get(field, (0, (), 0, 0))
        return dtype, shape, memoryview(self.data)[start:end]


def _read(data, pos, end, message_class, layout):
    """The WireMessage of the message_class encoded in data[pos:end]."""
    start, tensors, children, spans = pos, {}, {}, []  # spans: [start, stop) of fields protobuf parses
    while pos < end:
        field_start = pos
        key, pos = _read_varint(data, pos, end)
        field, wire_type = key >> 3, key & 7
        kind = layout.get(field)
        if kind == _TENSOR or isinstance(kind, tuple):
            if wire_type != _LEN or field in tensors or (field in children and not kind[2]):
                raise _Unexpected()  # a second occurrence of a singular field would merge
            length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise _Unexpected()
            if kind == _TENSOR:
                tensors[field] = _read_tensor(data, pos, pos + length)
            else:
                children.setdefault(field, []).append(_read(data, pos, pos + length, kind[0], kind[1]))
            pos += length
        elif kind == wire_type:
            pos = _skip(data, pos, end, wire_type)
            if spans and spans[-1][1] == field_start:
                spans[-1][1] = pos
            else:
                spans.append([field_start, pos])
        else:
            raise _Unexpected()
    view = memoryview(data)
    rest = message_class.FromString(b"".join(view[a:b] for a, b in spans))
    return WireMessage(data, start, end, rest, tensors, children)


def _parse(message_class, layout, data):
    if not isinstance(data, bytes) or len(data) < IN_PLACE_MIN_BYTES:
        return message_class.FromString(data)
    try:
        return _read(data, 0, len(data), message_class, layout)
    except _Unexpected:
        return message_class.FromString(data)


def parse_attend_response(data):
    """gRPC's response deserializer for Attend: a WireMessage of the
    AttendResponse, or protobuf's AttendResponse when the bytes are small or
    hold anything the fast reader does not expect (see the module's comment).
    `data` must be immutable (gRPC hands over bytes)."""
    return _parse(pb.AttendResponse, _ATTEND_RESPONSE, data)


def parse_extend_response(data):
    """parse_attend_response for Extend: a WireMessage of the ExtendResponse
    (its results children, each with its output and maps in place) or
    protobuf's ExtendResponse."""
    return _parse(pb.ExtendResponse, _EXTEND_RESPONSE, data)


def parse_attend_stream_response(data):
    """parse_attend_response for AttendStream's messages: a WireMessage of
    the AttendStreamResponse (a map chunk's maps in place, in children[2][0])
    or protobuf's AttendStreamResponse."""
    message = _parse(pb.AttendStreamResponse, _ATTEND_STREAM_RESPONSE, data)
    if isinstance(message, WireMessage) and message.children and message.rest.HasField("response"):
        return pb.AttendStreamResponse.FromString(data)  # both parts of the oneof: protobuf keeps the last
    return message


def callables(channel):
    """(Attend, AttendStream, Extend) on `channel` (grpc or grpc.aio), each
    taking a protobuf request or a MessageWire of one. Attend and Extend answer
    with parse_attend_response's and parse_extend_response's result,
    AttendStream with parse_attend_stream_response's."""
    service = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
    attend = channel.unary_unary(f"/{service}/Attend", request_serializer=serialize,
                                 response_deserializer=parse_attend_response)
    stream = channel.unary_stream(f"/{service}/AttendStream", request_serializer=serialize,
                                  response_deserializer=parse_attend_stream_response)
    extend = channel.unary_unary(f"/{service}/Extend", request_serializer=serialize,
                                 response_deserializer=parse_extend_response)
    return attend, stream, extend
