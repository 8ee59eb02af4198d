"""The asyncio client on grpc.aio: attnserve.aio.Client, the twin of
attnserve.Client with the same arguments and results, each call a coroutine.

    async with attnserve.aio.Client("localhost:50051") as client:
        r = await client.attend(x, maps="per-head")
        async with await client.open_session() as session:
            step = await session.extend(prompt)

A client belongs to the event loop it was created in.
"""
from typing import List

import grpc
import grpc.aio

from . import _health, _wire, messages
from ._channel import DEFAULT_MAX_RECEIVE_MESSAGE_BYTES, call_metadata, make_channel, replica_of, token_metadata
from .client import SessionState, Step, record_steps, step_tuples, steps_routing_key
from .errors import NotFoundError, UnavailableError, error_from_rpc
from .v1 import attention_pb2 as pb, attention_pb2_grpc as pb_grpc

__all__ = ["Client", "Session"]


class Client:
    """attnserve.Client's asyncio twin: see there for the arguments."""

    def __init__(self, target, *, tls=None, token=None, timeout=30.0, options=(),
                 max_receive_message_bytes=DEFAULT_MAX_RECEIVE_MESSAGE_BYTES):
        self.target = target
        self.timeout = timeout
        self._metadata = token_metadata(token)
        self._channel = make_channel(grpc.aio, target, tls, options, max_receive_message_bytes)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._check, self._watch = _health.callables(self._channel)
        # Attend, AttendStream and Extend write and read the tensors themselves (_wire).
        self._attend, self._attend_stream, self._extend = _wire.callables(self._channel)

    async def close(self):
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    @property
    def stub(self):
        """The generated AttentionServiceStub on this client's grpc.aio channel."""
        return self._stub

    async def _call(self, method, request, timeout, routing_key=None, **kwargs):
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout,
                                metadata=call_metadata(self._metadata, routing_key), **kwargs)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e

    async def _call_with_replica(self, method, request, timeout, routing_key=None, **kwargs):
        """(response, the replica its attnserve-replica header names or None)."""
        try:
            call = method(request, timeout=self.timeout if timeout is None else timeout,
                          metadata=call_metadata(self._metadata, routing_key), **kwargs)
            response = await call
            return response, replica_of(await call.initial_metadata())
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e

    async def attend(self, x=None, *, model="default", lengths=None, packed=None, causal=False, context=None,
                     context_lengths=None, mask=None, mask_kind=None, head_mask=None, position_offsets=None,
                     maps=None, heads=None, rows=None, stats=False, precision=None, input_dtype=None,
                     output_dtype=None, bf16_words=False, layer=None, projected=None, stream_maps=False,
                     timeout=None) -> messages.AttendResult:
        """attnserve.Client.attend, awaited."""
        request = messages.build_attend_wire(
            x, model=model, lengths=lengths, packed=packed, causal=causal, context=context,
            context_lengths=context_lengths, mask=mask, mask_kind=mask_kind, head_mask=head_mask,
            position_offsets=position_offsets, maps=maps, heads=heads, rows=rows, stats=stats,
            precision=precision, input_dtype=input_dtype, output_dtype=output_dtype, layer=layer,
            projected=projected).SerializeToString()  # now: grpc.aio serializes later, in a task of its own
        return await self.attend_request(request, bf16_words=bf16_words, stream_maps=stream_maps,
                                         timeout=timeout)

    async def attend_request(self, request, *, bf16_words=False, stream_maps=False, timeout=None):
        """attnserve.Client.attend_request, awaited."""
        if not stream_maps:
            return messages.read_attend_response(await self._call(self._attend, request, timeout),
                                                 bf16_words)
        assembler = messages.MapAssembler(bf16_words)
        try:
            async for message in self._attend_stream(
                    request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata):
                assembler.add(message)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return assembler.result()

    async def models(self, *, timeout=None) -> List[messages.ModelInfo]:
        """attnserve.Client.models, awaited."""
        response = await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [messages.ModelInfo.from_message(m) for m in response.models]

    async def model(self, name="default", *, timeout=None) -> messages.ModelInfo:
        """attnserve.Client.model, awaited."""
        return messages.ModelInfo.from_message(
            await self._call(self._stub.GetModel, pb.GetModelRequest(name=name), timeout))

    async def load(self, name, *, timeout=None):
        """attnserve.Client.load, awaited."""
        return messages.loaded_models(
            await self._call(self._stub.LoadModel, pb.LoadModelRequest(name=name), timeout))

    async def unload(self, name, *, timeout=None):
        """attnserve.Client.unload, awaited."""
        await self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name), timeout)

    async def health(self, service="", *, timeout=None) -> str:
        """attnserve.Client.health, awaited."""
        response = await self._call(self._check, _health.HealthCheckRequest(service=service), timeout)
        return _health.STATUS_NAMES.get(response.status, str(response.status))

    async def wait_until_serving(self, service="", *, timeout=60.0):
        """attnserve.Client.wait_until_serving, awaited."""
        call = self._watch(_health.HealthCheckRequest(service=service), timeout=timeout,
                           metadata=self._metadata, wait_for_ready=True)
        try:
            async for response in call:
                if response.status == _health.SERVING:
                    call.cancel()
                    return
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "health: the watch ended before SERVING")

    async def open_session(self, models="default", *, kv_dtype=None, max_tokens=0, idle_ttl=None,
                           first_position=0, routing_key=None, timeout=None) -> "Session":
        """attnserve.Client.open_session, awaited; the Session's methods are coroutines."""
        request = messages.build_open_session_request(models, kv_dtype, max_tokens, idle_ttl, first_position)
        response, replica = await self._call_with_replica(self._stub.OpenSession, request, timeout, routing_key)
        return Session(self, messages.SessionInfo.from_message(response), routing_key, replica)

    async def extend(self, steps, *, precision=None, input_dtype=None, output_dtype=None, bf16_words=False,
                     timeout=None) -> List[messages.StepResult]:
        """attnserve.Client.extend, awaited."""
        steps = list(steps)
        key = steps_routing_key(steps)
        request = messages.build_extend_wire(step_tuples(steps), precision, input_dtype,
                                             output_dtype).SerializeToString()  # now, as attend's
        results = messages.read_extend_response(await self._call(self._extend, request, timeout, key),
                                                bf16_words)
        record_steps(steps, results)
        return results


class Session(SessionState):
    """attnserve.Session's asyncio twin (`async with`, awaited methods)."""

    def __init__(self, client, info, routing_key=None, replica=None):
        super().__init__(info, routing_key, replica)
        self._client = client

    async def _call(self, method, request, timeout):
        return await self._client._call(method, request, timeout, self.routing_key)

    def step(self, x, *, layer=0, maps=False, head_mask=None, stats=False) -> Step:
        """A Step of this session, for Client.extend's micro-batches."""
        return Step(self, x, layer, maps, head_mask, stats)

    async def extend(self, x, *, layer=0, maps=False, head_mask=None, stats=False, precision=None,
                     input_dtype=None, output_dtype=None, bf16_words=False,
                     timeout=None) -> messages.StepResult:
        """attnserve.Session.extend, awaited."""
        result = (await self._client.extend([self.step(x, layer=layer, maps=maps, head_mask=head_mask,
                                                       stats=stats)],
                                            precision=precision, input_dtype=input_dtype,
                                            output_dtype=output_dtype, bf16_words=bf16_words,
                                            timeout=timeout))[0]
        if result.error is not None:
            raise result.error
        return result

    async def info(self, *, timeout=None) -> messages.SessionInfo:
        """attnserve.Session.info, awaited."""
        return messages.SessionInfo.from_message(await self._call(
            self._client._stub.GetSession, pb.GetSessionRequest(session_id=self.id), timeout))

    async def fork(self, *, timeout=None) -> "Session":
        """attnserve.Session.fork, awaited."""
        response, replica = await self._client._call_with_replica(
            self._client._stub.ForkSession, pb.ForkSessionRequest(session_id=self.id), timeout, self.routing_key)
        return Session(self._client, messages.SessionInfo.from_message(response), self.routing_key, replica)

    async def truncate(self, length, *, layer=None, timeout=None) -> messages.SessionInfo:
        """attnserve.Session.truncate, awaited."""
        request = pb.TruncateSessionRequest(session_id=self.id, layer=layer or 0, all_layers=layer is None,
                                            length=int(length))
        info = messages.SessionInfo.from_message(
            await self._call(self._client._stub.TruncateSession, request, timeout))
        self.lengths = list(info.layer_lengths)
        return info

    async def latest_attention(self, layer=0, *, timeout=None) -> messages.LatestAttention:
        """attnserve.Session.latest_attention, awaited."""
        request = pb.LatestAttentionRequest(session_id=self.id, layer=int(layer))
        return messages.LatestAttention.from_message(
            await self._call(self._client._stub.GetLatestAttention, request, timeout))

    async def close(self, *, timeout=None):
        """attnserve.Session.close, awaited."""
        await self._call(self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id), timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        try:
            await self.close()
        except NotFoundError:  # already gone
            pass
