"""Requests built from Python arguments and responses read into Python objects,
shared by the blocking client (attnserve.Client) and the asyncio one
(attnserve.aio.Client). No I/O here."""
import dataclasses
import datetime
import inspect
from typing import List, Optional, Tuple

import numpy as np

from . import _wire, tensors
from .errors import error_for_status
from .v1 import attention_pb2 as pb

__all__ = ["AttendResult", "HeadStatistics", "Timing", "ModelInfo", "SessionInfo", "StepResult", "LatestAttention",
           "build_attend_request", "read_attend_response", "MapAssembler"]

_MAP_MODES = {None: pb.ATTENTION_MAP_MODE_NONE, False: pb.ATTENTION_MAP_MODE_NONE,
              "none": pb.ATTENTION_MAP_MODE_NONE, True: pb.ATTENTION_MAP_MODE_PER_HEAD,
              "per-head": pb.ATTENTION_MAP_MODE_PER_HEAD, "per_head": pb.ATTENTION_MAP_MODE_PER_HEAD,
              "mean": pb.ATTENTION_MAP_MODE_MEAN}
_PRECISIONS = {None: pb.PRECISION_UNSPECIFIED, "fp32": pb.PRECISION_FP32, "bf16": pb.PRECISION_BF16}
_PRECISION_NAMES = {pb.PRECISION_UNSPECIFIED: "fp32", pb.PRECISION_FP32: "fp32", pb.PRECISION_BF16: "bf16"}
_DTYPE_NAMES = {pb.DATA_TYPE_FP32: "fp32", pb.DATA_TYPE_BF16: "bf16", pb.DATA_TYPE_BOOL: "bool"}
_STATE_NAMES = {pb.MODEL_STATE_UNSPECIFIED: "UNSPECIFIED", pb.MODEL_STATE_LOADING: "LOADING",
                pb.MODEL_STATE_READY: "READY", pb.MODEL_STATE_FAILED: "FAILED"}


def _seconds(duration):
    return duration.seconds + duration.nanos * 1e-9


def _output_dtype(name):
    """The DataType of output_dtype; unset (the server's FP32) when None, so a
    request that does not ask says nothing."""
    return pb.DATA_TYPE_UNSPECIFIED if name is None else tensors.wire_dtype(name, "output_dtype")


def precision_enum(name):
    """The Precision enum of "fp32"/"bf16" (None: the server's default, FP32)."""
    key = None if name is None else str(name).lower()
    if key not in _PRECISIONS:
        raise ValueError(f"precision: {name!r} is not 'fp32' or 'bf16'")
    return _PRECISIONS[key]


@dataclasses.dataclass(frozen=True)
class Timing:
    """The server's timing of a call: queue_seconds (arrival to compute),
    compute_seconds (the compute batch the call ran in), batch_size (calls in
    that batch) and batch_tokens (its query tokens)."""
    queue_seconds: float
    compute_seconds: float
    batch_size: int
    batch_tokens: int

    @classmethod
    def from_message(cls, timing):
        return cls(_seconds(timing.queue), _seconds(timing.compute), timing.batch_size, timing.batch_tokens)


@dataclasses.dataclass(frozen=True)
class HeadStatistics:
    """Per-head statistics: from Attend, float32 [batch, heads] each: mean
    entropy of the attention weights (nats), mean max weight, and each head's
    contribution to the output (None for projected requests). From a session
    step (StepResult.stats), float32 [heads, n] each: the entropy and max
    weight of each new row; contribution None."""
    entropy: np.ndarray
    max_weight: np.ndarray
    contribution: Optional[np.ndarray]


@dataclasses.dataclass(frozen=True)
class AttendResult:
    """What Attend answered.

    output: float32 [batch, seq, d_model] (packed: [tokens, d_model]; projected:
      [batch, heads, seq_q, head_dim]). FP32 on the wire comes back as a
      read-only view of the response's bytes (no copy: `.copy()` it to write);
      BF16 is widened to float32. A view keeps the whole response's bytes
      alive (maps included): copy what you keep if you drop the rest.
    maps: float32 attention maps ([batch, heads, seq_q, seq_kv] per head,
      [batch, seq_q, seq_kv] mean), or None when none were asked for.
    stats: HeadStatistics, or None when not asked for.
    timing: Timing. kernel_path: e.g. "fp32/blocked". precision: the precision
      that ran, "fp32" or "bf16" (BF16 falls back to FP32 on CPUs without it).
    model: the model that ran ("" for an ad-hoc layer).
    output_words, maps_words: with bf16_words=True and BF16 on the wire, the raw
      bfloat16 words (uint16 arrays of the same shapes); None otherwise.
    message: the AttendResponse message itself (when the output was read in
      place from the received bytes, protobuf parses them when this is first
      read).
    """
    output: np.ndarray
    maps: Optional[np.ndarray]
    stats: Optional[HeadStatistics]
    timing: Timing
    kernel_path: str
    precision: str
    model: str
    output_words: Optional[np.ndarray] = None
    maps_words: Optional[np.ndarray] = None
    message: Optional[pb.AttendResponse] = dataclasses.field(default=None, repr=False)


class _ResponseMessage:
    """AttendResult.message: the AttendResponse. Given an _wire.WireMessage
    (the output read in place from the received bytes), protobuf parses the whole response the first time it is read, so
    that a caller who never reads it never pays for that copy."""

    def __get__(self, result, owner=None):
        if result is None:
            return None  # the field's default
        value = result.__dict__.get("_message")
        return value.message if isinstance(value, _wire.WireMessage) else value

    def __set__(self, result, value):
        result.__dict__["_message"] = value


# After the dataclass is made: its __init__ (default None) sets the field through this.
AttendResult.message = _ResponseMessage()


def _list(values, what, cast):
    if values is None:
        return []
    if np.isscalar(values):
        values = [values]
    try:
        return [cast(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{what}: expected a sequence of numbers, got {values!r}") from None


def build_attend_request(*args, **kwargs):
    """An AttendRequest from Client.attend's arguments (see there)."""
    return build_attend_wire(*args, **kwargs).message()


def build_attend_wire(x=None, *, model="default", lengths=None, packed=None, causal=False, context=None,
                      context_lengths=None, mask=None, mask_kind=None, head_mask=None, position_offsets=None,
                      maps=None, heads=None, rows=None, stats=False, precision=None, input_dtype=None,
                      output_dtype=None, layer=None, projected=None):
    """The AttendRequest of Client.attend's arguments as an _wire.MessageWire:
    its tensors are written around the arrays' memory when it is serialized."""
    big = {}  # AttendRequest's field number -> WireTensor or MessageWire
    request = pb.AttendRequest(causal=bool(causal), precision=precision_enum(precision),
                               output_dtype=_output_dtype(output_dtype))
    if layer is not None:
        request.layer.CopyFrom(layer)
    elif model is not None:
        request.model = model
    if x is not None:
        x = np.asarray(x)
        if packed is not None and x.ndim != (2 if packed else 3):
            raise ValueError(f"x: packed={packed} needs a {'[tokens, d_model]' if packed else '[batch, seq, d_model]'}"
                             f" array, got shape {x.shape}")
        big[2] = tensors.encode_wire(x, input_dtype, "x")  # hidden_states
    if projected is not None:
        q, k, v = projected
        big[14] = _wire.MessageWire(pb.ProjectedHeads(), {  # projected: q, k, v
            number: tensors.encode_wire(t, input_dtype, "projected") for number, t in ((1, q), (2, k), (3, v))})
    request.sequence_lengths.extend(_list(lengths, "lengths", int))
    if context is not None:
        big[5] = tensors.encode_wire(context, input_dtype, "context")
    request.context_lengths.extend(_list(context_lengths, "context_lengths", int))
    if mask is not None:
        mask = np.asarray(mask)
        kind = mask_kind
        if kind is None:
            if mask.dtype.kind not in "bf":
                raise ValueError(f"mask_kind: say 'allowed' or 'additive' for a mask of dtype {mask.dtype} "
                                 "(a bool mask is 'allowed', a float one 'additive')")
            kind = "allowed" if mask.dtype == np.bool_ else "additive"
        kinds = {"allowed": pb.AttentionMask.KIND_ALLOWED, "additive": pb.AttentionMask.KIND_ADDITIVE}
        if kind not in kinds:
            raise ValueError(f"mask_kind: {mask_kind!r} is not 'allowed' or 'additive'")
        big[8] = _wire.MessageWire(pb.AttentionMask(kind=kinds[kind]), {2: tensors.encode_wire(mask, None, "mask")})
    request.head_mask.extend(_list(head_mask, "head_mask", float))
    request.position_offsets.extend(_list(position_offsets, "position_offsets", int))
    key = maps.lower() if isinstance(maps, str) else maps
    if key not in _MAP_MODES:
        raise ValueError(f"maps: {maps!r} is not None, 'per-head' or 'mean'")
    if key not in (None, False, "none") or heads is not None or rows is not None or stats:
        request.attention_maps.mode = _MAP_MODES[key]
        request.attention_maps.heads.extend(_list(heads, "heads", int))
        request.attention_maps.query_rows.extend(_list(rows, "rows", int))
        request.attention_maps.head_statistics = bool(stats)
    return _wire.MessageWire(request, big)


build_attend_request.__signature__ = inspect.signature(build_attend_wire)  # for help(): the same arguments


def read_attend_response(response, bf16_words=False, maps=None, maps_words=None):
    """An AttendResult from an AttendResponse, or from an _wire.WireMessage of
    one (its output and maps then are views of the received bytes). `maps` (and
    `maps_words`), when given, are maps assembled from a stream (the response
    then has none)."""
    if isinstance(response, _wire.WireMessage):
        return _read_wire_response(response, bf16_words, maps, maps_words)
    stats = _head_statistics(response)
    if maps is None and (response.attention_maps.raw_data or response.attention_maps.float_data):
        maps = tensors.decode(response.attention_maps)
        maps_words = tensors.decode_words(response.attention_maps) if bf16_words else None
    return AttendResult(
        output=tensors.decode(response.output), maps=maps, stats=stats,
        timing=Timing.from_message(response.timing), kernel_path=response.kernel_path,
        precision=_PRECISION_NAMES.get(response.precision, "fp32"), model=response.model,
        output_words=tensors.decode_words(response.output) if bf16_words else None,
        maps_words=maps_words if bf16_words else None, message=response)


def _head_statistics(response):
    if not response.HasField("head_statistics"):
        return None
    s = response.head_statistics
    return HeadStatistics(tensors.decode(s.entropy), tensors.decode(s.max_weight), tensors.decode(s.contribution))


def _read_wire_response(response, bf16_words, maps, maps_words):
    """read_attend_response of a WireMessage: the same AttendResult, its
    message parsed only when read."""
    rest = response.rest
    output_dtype, output_shape, output_raw = response.tensor(2)
    maps_dtype, maps_shape, maps_raw = response.tensor(3)
    if maps is None and maps_raw:
        maps = tensors.decode_raw(maps_dtype, maps_shape, maps_raw)
        maps_words = tensors.decode_raw_words(maps_dtype, maps_shape, maps_raw) if bf16_words else None
    return AttendResult(
        output=tensors.decode_raw(output_dtype, output_shape, output_raw), maps=maps,
        stats=_head_statistics(rest), timing=Timing.from_message(rest.timing), kernel_path=rest.kernel_path,
        precision=_PRECISION_NAMES.get(rest.precision, "fp32"), model=rest.model,
        output_words=tensors.decode_raw_words(output_dtype, output_shape, output_raw) if bf16_words else None,
        maps_words=maps_words if bf16_words else None, message=response)


class MapAssembler:
    """Puts an AttendStream's messages back together: feed each message to
    add(), then result() gives the AttendResult with the whole maps. Each chunk
    is placed as it arrives (the stream never holds more than one)."""

    def __init__(self, bf16_words=False):
        self._bf16_words = bf16_words
        self._response = None
        self._maps = None
        self._words = None

    def add(self, message):
        """Takes the stream's next message: an AttendStreamResponse, or an
        _wire.WireMessage of one (its chunk's maps read in place)."""
        wire = isinstance(message, _wire.WireMessage)
        if (message.rest if wire else message).HasField("response"):
            self._response = (message.rest if wire else message).response
            shape = tuple(self._response.attention_maps.shape)
            if shape:
                self._maps = np.empty(shape, np.float32)
                if self._bf16_words and self._response.attention_maps.dtype == pb.DATA_TYPE_BF16:
                    self._words = np.empty(shape, "<u2")
            return
        if wire and message.children:
            chunk_wire = message.children[2][0]
            chunk, maps = chunk_wire.rest, chunk_wire.tensor(4)
            part = tensors.decode_raw(*maps)[0]  # [heads, rows, keys], or [rows, keys] for mean maps
            words = tensors.decode_raw_words(*maps) if self._words is not None else None
        else:
            chunk = (message.rest if wire else message).map_chunk
            part = tensors.decode(chunk.maps)[0]
            words = tensors.decode_words(chunk.maps) if self._words is not None else None
        if self._maps.ndim == 4:
            where = (chunk.sequence, slice(chunk.first_head, chunk.first_head + part.shape[0]),
                     slice(chunk.first_row, chunk.first_row + part.shape[1]))
        else:
            where = (chunk.sequence, slice(chunk.first_row, chunk.first_row + part.shape[0]))
        self._maps[where] = part
        if words is not None:
            self._words[where] = words[0]

    def result(self):
        if self._response is None:
            raise RuntimeError("AttendStream ended without its response")
        return read_attend_response(self._response, self._bf16_words, self._maps, self._words)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """A model as ListModels/GetModel describe it. state: "READY", "LOADING" or
    "FAILED" (failure_reason says why); LOADING and FAILED models carry only
    name, state and failure_reason. message: the ModelInfo message itself."""
    name: str
    state: str
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary_dim: int
    rope_theta: float
    context_dim: int
    causal: bool
    max_batch: int
    max_seq_len: int
    max_attention_map_bytes: int
    input_dtypes: Tuple[str, ...]
    description: str
    failure_reason: str
    message: Optional[pb.ModelInfo] = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_message(cls, m):
        h = m.head_config
        return cls(name=m.name, state=_STATE_NAMES.get(m.state, str(m.state)), d_model=h.d_model,
                   num_heads=h.num_heads, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, scale=h.scale,
                   rotary_dim=h.rotary.rotary_dim, rope_theta=h.rotary.theta, context_dim=h.context_dim,
                   causal=m.causal, max_batch=m.limits.max_batch, max_seq_len=m.limits.max_seq_len,
                   max_attention_map_bytes=m.limits.max_attention_map_bytes,
                   input_dtypes=tuple(_DTYPE_NAMES.get(d, str(d)) for d in m.input_dtypes),
                   description=m.description, failure_reason=m.failure_reason, message=m)


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """A decode session as the server describes it: id, models (its layers),
    layer_lengths (tokens each layer holds), kv_dtype ("fp32"/"bf16"),
    max_tokens, idle_ttl_seconds, first_position, kv_blocks, kv_bytes,
    last_used (a UTC datetime)."""
    id: str
    models: Tuple[str, ...]
    layer_lengths: Tuple[int, ...]
    kv_dtype: str
    max_tokens: int
    idle_ttl_seconds: float
    first_position: int
    kv_blocks: int
    kv_bytes: int
    last_used: Optional[datetime.datetime]

    @classmethod
    def from_message(cls, s):
        last_used = None
        if s.HasField("last_used"):
            last_used = datetime.datetime.fromtimestamp(s.last_used.seconds + s.last_used.nanos * 1e-9,
                                                        datetime.timezone.utc)
        return cls(id=s.session_id, models=tuple(s.models), layer_lengths=tuple(s.layer_lengths),
                   kv_dtype=_DTYPE_NAMES.get(s.kv_dtype, "fp32"), max_tokens=s.max_tokens,
                   idle_ttl_seconds=_seconds(s.idle_ttl), first_position=s.first_position,
                   kv_blocks=s.kv_blocks, kv_bytes=s.kv_bytes, last_used=last_used)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step of an Extend call.

    error: None when the step succeeded, else the AttnserveError it got (its
      own status: one failed step never fails its neighbours); the fields
      below are then empty.
    output: float32 [n, d_model], the layer's output for the new tokens (FP32 a
      read-only view of the response's bytes, which it keeps alive, every
      step's and their maps; a copy where they are not aligned; BF16
      widened). maps: float32 [heads, n, length] when
      asked for (not on a replay). stats: HeadStatistics with entropy and
      max_weight float32 [heads, n], each new row's, after head_mask, when
      asked for (not on a replay); None otherwise. length: the layer's
      length after the step.
    replayed: the step repeated one whose answer was lost; nothing was appended.
    timing, kernel_path, precision: the whole micro-batch's.
    output_words, maps_words: the raw BF16 words, with bf16_words=True.
    """
    error: Optional[Exception]
    output: Optional[np.ndarray]
    maps: Optional[np.ndarray]
    length: int
    replayed: bool
    timing: Timing
    kernel_path: str
    precision: str
    output_words: Optional[np.ndarray] = None
    maps_words: Optional[np.ndarray] = None
    stats: Optional[HeadStatistics] = None

    @property
    def ok(self):
        return self.error is None


@dataclasses.dataclass(frozen=True)
class LatestAttention:
    """What a session layer's latest token attends to (GetLatestAttention):
    maps float32 [heads, length], each head's softmax weights over every key
    the layer holds (its own last), before any head mask; length (tokens the
    layer holds); position (the latest token's RoPE position); entropy and
    max_weight, float32 [heads] each (per row of maps)."""
    session_id: str
    layer: int
    length: int
    position: int
    maps: np.ndarray
    entropy: np.ndarray
    max_weight: np.ndarray

    @classmethod
    def from_message(cls, m):
        stats = m.head_statistics
        return cls(session_id=m.session_id, layer=m.layer, length=m.length, position=m.position,
                   maps=tensors.decode(m.maps), entropy=tensors.decode(stats.entropy),
                   max_weight=tensors.decode(stats.max_weight))


def loaded_models(response):
    """What a LoadModelResponse loaded: the folder's ModelInfo, or for a folder
    of layers a list of its layers' ModelInfo, in order."""
    if response.layers:
        return [ModelInfo.from_message(m) for m in response.layers]
    return ModelInfo.from_message(response.model)


def build_extend_request(steps, precision=None, input_dtype=None, output_dtype=None):
    """An ExtendRequest from (session_id, layer, expected_length, x, maps,
    head_mask[, stats]) tuples."""
    request = build_extend_wire(steps, precision, input_dtype, output_dtype)
    return request.message() if isinstance(request, _wire.MessageWire) else request


def build_extend_wire(steps, precision=None, input_dtype=None, output_dtype=None):
    """build_extend_request's ExtendRequest as an _wire.MessageWire (each
    step's hidden states written around the array's memory when it is
    serialized), or as the message itself when the steps' tensors are smaller
    than _wire.IN_PLACE_MIN_BYTES."""
    request = pb.ExtendRequest(precision=precision_enum(precision), output_dtype=_output_dtype(output_dtype))
    steps_read = []  # (ExtendStep's small fields, its hidden states as a WireTensor)
    for i, (session_id, layer, expected_length, x, maps, head_mask, *stats) in enumerate(steps):
        layer, expected_length = int(layer), int(expected_length)
        x = tensors.encode_wire(x, input_dtype, f"steps[{i}].x")
        steps_read.append((dict(session_id=session_id, layer=layer, expected_length=expected_length,
                                attention_maps=bool(maps), head_mask=_list(head_mask, "head_mask", float),
                                head_statistics=bool(stats and stats[0])), x))
    if sum(x.data.nbytes for _, x in steps_read) < _wire.IN_PLACE_MIN_BYTES:
        # A few decode tokens: protobuf writes them faster than Python frames them.
        for fields, x in steps_read:
            request.steps.add(hidden_states=x.message(), **fields)
        return request
    return _wire.MessageWire(request, {1: [_wire.MessageWire(pb.ExtendStep(**fields), {4: x})  # steps, hidden_states
                                           for fields, x in steps_read]})


def read_extend_response(response, bf16_words=False) -> List[StepResult]:
    """StepResults of an ExtendResponse (or of an _wire.WireMessage of one:
    the outputs and maps then are views of the received bytes), in the
    request's order."""
    wire = isinstance(response, _wire.WireMessage)
    top = response.rest if wire else response
    timing = Timing.from_message(top.timing)
    precision = _PRECISION_NAMES.get(top.precision, "fp32")
    results = []
    for r in response.children.get(1, []) if wire else response.results:
        if wire:
            output, maps, r = r.tensor(3), r.tensor(4), r.rest
            output_values, maps_values = tensors.decode_raw(*output), tensors.decode_raw(*maps)
            output_words = tensors.decode_raw_words(*output) if bf16_words else None
            maps_words = tensors.decode_raw_words(*maps) if bf16_words else None
        else:
            output_values, maps_values = tensors.decode(r.output), tensors.decode(r.attention_maps)
            output_words = tensors.decode_words(r.output) if bf16_words else None
            maps_words = tensors.decode_words(r.attention_maps) if bf16_words else None
        error = error_for_status(r.code, r.message) if r.code != 0 else None
        results.append(StepResult(
            error=error, output=output_values, maps=maps_values, length=r.length, replayed=r.replayed,
            timing=timing, kernel_path=top.kernel_path, precision=precision, output_words=output_words,
            maps_words=maps_words,
            stats=HeadStatistics(tensors.decode(r.head_statistics.entropy),
                                 tensors.decode(r.head_statistics.max_weight), None)
            if r.HasField("head_statistics") else None))
    return results


def build_open_session_request(models, kv_dtype=None, max_tokens=0, idle_ttl=None, first_position=0):
    """An OpenSessionRequest: models a name or a list of names (the layers)."""
    if isinstance(models, str):
        models = [models]
    request = pb.OpenSessionRequest(models=list(models), kv_dtype=tensors.wire_dtype(kv_dtype, "kv_dtype"),
                                    max_tokens=int(max_tokens), first_position=int(first_position))
    if idle_ttl is not None:
        request.idle_ttl.FromTimedelta(datetime.timedelta(seconds=float(idle_ttl)))
    return request
