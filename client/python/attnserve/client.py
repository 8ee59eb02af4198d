"""The blocking client: attnserve.Client and its decode sessions."""
import dataclasses
from typing import Any, List, Optional, Sequence

import grpc

from . import _health, _wire, messages
from ._channel import DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, call_metadata, make_channel, replica_of, token_metadata
from .errors import NotFoundError, UnavailableError, error_from_rpc
from .v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc

__all__ = ["Client", "Session", "Step"]


@dataclasses.dataclass
class Step:
    """One step of a micro-batch (Client.extend): new tokens `x` [n, d_model]
    for `layer` of `session`; maps: return the new rows' per-head maps;
    head_mask: one gate per query head; stats: return the new rows' per-head
    entropy and max weight (StepResult.stats)."""
    session: Any
    x: Any
    layer: int = 0
    maps: bool = False
    head_mask: Optional[Sequence[float]] = None
    stats: bool = False


class SessionState:
    """What a session object knows, whichever client it belongs to: its id,
    models (layers), the length of each layer as this client last saw it
    (each step sends it as expected_length), the routing key its calls carry
    (None: none) and the replica that opened it (its attnserve-replica
    header; None when the server sent none)."""

    def __init__(self, info, routing_key=None, replica=None):
        self.id = info.id
        self.models = info.models
        self.lengths = list(info.layer_lengths)
        self.routing_key = routing_key
        self.replica = replica

    def __repr__(self):
        return (f"{type(self).__name__}(id={self.id!r}, models={self.models!r}, lengths={self.lengths!r}, "
                f"routing_key={self.routing_key!r}, replica={self.replica!r})")


def step_tuples(steps):
    """(session_id, layer, expected_length, x, maps, head_mask, stats) of each Step."""
    return [(s.session.id, s.layer, s.session.lengths[s.layer], s.x, s.maps, s.head_mask, s.stats)
            for s in steps]


def steps_routing_key(steps):
    """The routing key an Extend of `steps` carries: their sessions' one key
    (None if they have none). ValueError when they differ: sessions routed
    apart may live on different replicas, so they cannot share a call."""
    keys = {s.session.routing_key for s in steps}
    if len(keys) > 1:
        raise ValueError(f"steps: sessions with different routing keys ({sorted(map(str, keys))}) cannot share "
                         "an Extend call; send one call per key")
    return keys.pop() if keys else None


def record_steps(steps, results):
    """Moves each session's known length on after its successful steps."""
    for step, result in zip(steps, results):
        if result.ok:
            step.session.lengths[step.layer] = result.length


class Client:
    """A connection to an attnserve server (blocking calls; attnserve.aio.Client
    is the asyncio twin). Thread-safe: one Client may serve many threads.

      client = attnserve.Client("localhost:50051")
      r = client.attend(np.random.standard_normal((2, 16, 768)), maps="per-head")
      r.output.shape, r.maps.shape   # (2, 16, 768) (2, 12, 16, 16)

    target: "host:port". tls: None/False for plaintext, True for TLS with the
    system's roots, an attnserve.Tls (CA, client certificate, server name) or
    grpc.ChannelCredentials. token: a bearer token sent with every call (use
    TLS: over plaintext it can be read off the network). timeout: the deadline
    of each call in seconds unless the call gives its own (None: no deadline,
    a call may then wait forever). max_receive_message_bytes: the largest
    response accepted (gRPC's default is 4 MiB; maps are larger:
    attend(stream_maps=True) takes maps of any size in chunks). options: more
    gRPC channel options.

    Every failed call raises an attnserve.AttnserveError subclass with the
    status code, the server's message and the field it names.
    """

    def __init__(self, target, *, tls=None, token=None, timeout=30.0, options=(),
                 max_receive_message_bytes=DEFAULT_MAX_RECEIVE_MESSAGE_BYTES):
        self.target = target
        self.timeout = timeout
        self._metadata = token_metadata(token)
        self._channel = make_channel(grpc, target, tls, options, max_receive_message_bytes)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._check, self._watch = _health.callables(self._channel)
        # Attend, AttendStream and Extend write and read the tensors themselves (_wire).
        self._attend, self._attend_stream, self._extend = _wire.callables(self._channel)

    def close(self):
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def stub(self):
        """The generated AttentionServiceStub on this client's channel, for what
        the methods here do not cover (pass metadata and timeout yourself)."""
        return self._stub

    def _call(self, method, request, timeout, routing_key=None, **kwargs):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout,
                          metadata=call_metadata(self._metadata, routing_key), **kwargs)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e

    # --- Attend ---

    def attend(self, x=None, *, model="default", lengths=None, packed=None, causal=False, context=None,
               context_lengths=None, mask=None, mask_kind=None, head_mask=None, position_offsets=None,
               maps=None, heads=None, rows=None, stats=False, precision=None, input_dtype=None,
               output_dtype=None, bf16_words=False, layer=None, projected=None, stream_maps=False,
               timeout=None) -> messages.AttendResult:
        """Runs a model's attention layer on hidden states; returns an AttendResult.

        x: hidden states, [batch, seq, d_model], or packed [tokens, d_model]
          with `lengths`; any real dtype (float64, float16, ...: sent as
          float32, or as bfloat16 with input_dtype="bf16", rounded to nearest
          even).
        model: a loaded model's name ("default": the built-in model), unless
          `layer` (an attention_pb2.LayerSpec: an ad-hoc layer) is given.
        lengths: per-sequence lengths (ragged batches; padding never influences
          a result and is 0 in the output). packed: True/False checks x's rank
          (None: x's rank says it).
        causal: query i sees keys j <= i only (decoders).
        context, context_lengths: cross-attention to these states.
        mask: [batch or 1, seq_q or 1, seq_kv or 1]; a bool array says which
          keys each query may attend to (True = may; the opposite of torch's
          boolean attn_mask), a float one is added to the scaled scores
          (-inf forbids); mask_kind "allowed"/"additive" overrides, and an
          integer mask needs it (ValueError otherwise).
        head_mask: one gate per head (0 removes a head). position_offsets:
          RoPE position of each sequence's first token.
        maps: None, "per-head" (or True) or "mean"; heads, rows: only these
          heads and query rows of them. stats: per-head entropy, max weight,
          contribution (result.stats).
        precision: "fp32" or "bf16" compute (result.precision says what ran).
        output_dtype: "fp32" or "bf16" for output and maps on the wire (BF16
          halves the bytes; widened to float32 here). bf16_words: also return
          the raw BF16 words (result.output_words, result.maps_words).
        projected: (q, k, v) already-projected heads for the attention core
          alone ([batch, heads, seq, head_dim] each) instead of x.
        stream_maps: call AttendStream, which sends the maps in chunks of at
          most 1 MiB after the output (for maps larger than a message; same
          result).
        timeout: this call's deadline in seconds (default: the client's).
        """
        request = messages.build_attend_wire(
            x, model=model, lengths=lengths, packed=packed, causal=causal, context=context,
            context_lengths=context_lengths, mask=mask, mask_kind=mask_kind, head_mask=head_mask,
            position_offsets=position_offsets, maps=maps, heads=heads, rows=rows, stats=stats,
            precision=precision, input_dtype=input_dtype, output_dtype=output_dtype, layer=layer,
            projected=projected)
        return self.attend_request(request, bf16_words=bf16_words, stream_maps=stream_maps, timeout=timeout)

    def attend_request(self, request, *, bf16_words=False, stream_maps=False, timeout=None):
        """Sends a ready attention_pb2.AttendRequest (every field of the API)
        and returns its AttendResult."""
        if not stream_maps:
            return messages.read_attend_response(self._call(self._attend, request, timeout), bf16_words)
        assembler = messages.MapAssembler(bf16_words)
        try:
            for message in self._attend_stream(request, timeout=self.timeout if timeout is None else timeout,
                                                   metadata=self._metadata):
                assembler.add(message)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return assembler.result()

    # --- Models and health ---

    def models(self, *, timeout=None) -> List[messages.ModelInfo]:
        """The server's models (ListModels), each a ModelInfo."""
        response = self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [messages.ModelInfo.from_message(m) for m in response.models]

    def model(self, name="default", *, timeout=None) -> messages.ModelInfo:
        """One model's ModelInfo (GetModel); NotFoundError if it is not loaded."""
        return messages.ModelInfo.from_message(self._call(self._stub.GetModel, pb.GetModelRequest(name=name),
                                                          timeout))

    def load(self, name, *, timeout=None):
        """Admin: loads (or retries) a folder of the server's --model_repository
        and answers once it is READY (FailedPreconditionError with the reason
        when it cannot be loaded) with its ModelInfo; a folder of layers
        (config.json's "layers") with a list of its layers' ModelInfo, in order
        (models "<folder>.0", ...). Loading may take longer than the default
        timeout: give one."""
        return messages.loaded_models(
            self._call(self._stub.LoadModel, pb.LoadModelRequest(name=name), timeout))

    def unload(self, name, *, timeout=None):
        """Admin: removes a model (calls running on it finish)."""
        self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name), timeout)

    def health(self, service="", *, timeout=None) -> str:
        """The health service's answer for `service` ("": the process;
        "attnserve.v1.AttentionService": ready to serve): "SERVING",
        "NOT_SERVING", ..."""
        response = self._call(self._check, _health.HealthCheckRequest(service=service), timeout)
        return _health.STATUS_NAMES.get(response.status, str(response.status))

    def wait_until_serving(self, service="", *, timeout=60.0):
        """Returns once the server reports SERVING (it may still be starting:
        waits for the connection, then watches the health service, without
        polling); DeadlineExceededError after `timeout` seconds."""
        request = _health.HealthCheckRequest(service=service)
        try:
            call = self._watch(request, timeout=timeout, metadata=self._metadata, wait_for_ready=True)
            for response in call:
                if response.status == _health.SERVING:
                    call.cancel()
                    return
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "health: the watch ended before SERVING")

    # --- Decode sessions ---

    def open_session(self, models="default", *, kv_dtype=None, max_tokens=0, idle_ttl=None, first_position=0,
                     routing_key=None, timeout=None) -> "Session":
        """Opens a decode session (the server keeps its keys and values) over
        one model or a list of models (a network's layers, in order).
        kv_dtype: "fp32" or "bf16" keys and values; max_tokens: per layer (0:
        the server's limit); idle_ttl: seconds idle before it ends (None: the
        server's default); first_position: the RoPE position of its first
        token. routing_key: sent as the attnserve-routing-key metadata on every
        call of the session (and of its forks), so that a proxy hashing it
        (deploy/haproxy) keeps them on one replica; session.replica names the
        replica that opened it. A context manager: `with client.open_session()
        as s:` closes it."""
        request = messages.build_open_session_request(models, kv_dtype, max_tokens, idle_ttl, first_position)
        response, call = self._call(self._stub.OpenSession.with_call, request, timeout, routing_key)
        return Session(self, messages.SessionInfo.from_message(response), routing_key,
                       replica_of(call.initial_metadata()))

    def extend(self, steps, *, precision=None, input_dtype=None, output_dtype=None, bf16_words=False,
               timeout=None) -> List[messages.StepResult]:
        """Runs a micro-batch of session steps (attnserve.Step, or
        session.step(...)) in one Extend call and returns a StepResult per step,
        in order. A step that failed has its own `error` (nothing raised: its
        neighbours are fine); each successful step moves its session's length on.
        Raises only when the call as a whole fails; the same steps may then be
        sent again (steps the server appended are replayed, not appended twice).
        The steps' sessions must share one routing key (ValueError otherwise)."""
        steps = list(steps)
        key = steps_routing_key(steps)
        request = messages.build_extend_wire(step_tuples(steps), precision, input_dtype, output_dtype)
        results = messages.read_extend_response(self._call(self._extend, request, timeout, key), bf16_words)
        record_steps(steps, results)
        return results


class Session(SessionState):
    """A decode session of a Client: the server holds its keys and values, and
    each step sends only new tokens. `lengths[layer]` is each layer's length
    as this client last saw it. A context manager (closes on exit). Not
    thread-safe: one thread drives a session (its steps follow each other)."""

    def __init__(self, client, info, routing_key=None, replica=None):
        super().__init__(info, routing_key, replica)
        self._client = client

    def step(self, x, *, layer=0, maps=False, head_mask=None, stats=False) -> Step:
        """A Step of this session, for Client.extend's micro-batches."""
        return Step(self, x, layer, maps, head_mask, stats)

    def _call(self, method, request, timeout):
        return self._client._call(method, request, timeout, self.routing_key)

    def extend(self, x, *, layer=0, maps=False, head_mask=None, stats=False, precision=None, input_dtype=None,
               output_dtype=None, bf16_words=False, timeout=None) -> messages.StepResult:
        """Appends new tokens x [n, d_model] to `layer` and returns their
        StepResult (output [n, d_model]; maps [heads, n, length] with maps=True;
        stats.entropy and stats.max_weight [heads, n] with stats=True);
        raises the step's error. New token i attends to every cached token
        and to new tokens 0..i. After a failed call, calling again with the same
        x replays the answer if the server had appended it."""
        result = self._client.extend([self.step(x, layer=layer, maps=maps, head_mask=head_mask, stats=stats)],
                                     precision=precision, input_dtype=input_dtype, output_dtype=output_dtype,
                                     bf16_words=bf16_words, timeout=timeout)[0]
        if result.error is not None:
            raise result.error
        return result

    def info(self, *, timeout=None) -> messages.SessionInfo:
        """The server's description (GetSession): lengths, KV blocks and bytes, last use."""
        return messages.SessionInfo.from_message(
            self._call(self._client._stub.GetSession, pb.GetSessionRequest(session_id=self.id), timeout))

    def fork(self, *, timeout=None) -> "Session":
        """A new session with the same tokens, sharing the cached blocks (copy on write)."""
        response, call = self._call(self._client._stub.ForkSession.with_call,
                                    pb.ForkSessionRequest(session_id=self.id), timeout)
        return Session(self._client, messages.SessionInfo.from_message(response), self.routing_key,
                       replica_of(call.initial_metadata()))

    def truncate(self, length, *, layer=None, timeout=None) -> messages.SessionInfo:
        """Keeps the first `length` tokens of `layer`, or of every layer when
        layer is None (speculative decoding, beam search)."""
        request = pb.TruncateSessionRequest(session_id=self.id, layer=layer or 0, all_layers=layer is None,
                                            length=int(length))
        info = messages.SessionInfo.from_message(self._call(self._client._stub.TruncateSession, request, timeout))
        self.lengths = list(info.layer_lengths)
        return info

    def latest_attention(self, layer=0, *, timeout=None) -> messages.LatestAttention:
        """What `layer`'s latest token attends to, per head, over everything
        the layer holds (GetLatestAttention), without extending the session:
        a LatestAttention (maps float32 [heads, length], length, position,
        entropy, max_weight). FailedPreconditionError when the layer holds no
        tokens or was truncated since its last step (extend it first)."""
        request = pb.LatestAttentionRequest(session_id=self.id, layer=int(layer))
        return messages.LatestAttention.from_message(
            self._call(self._client._stub.GetLatestAttention, request, timeout))

    def close(self, *, timeout=None):
        """Ends the session (its memory goes back to the server's KV cache)."""
        self._call(self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id), timeout)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except NotFoundError:  # already gone (expired, evicted, server restarted)
            pass
