"""Python exceptions for attnserve's gRPC status codes.

Every failed call raises an AttnserveError subclass chosen by the status code
(InvalidArgumentError, NotFoundError, ResourceExhaustedError, ...), keeping the
code, the server's message, the request field the message names (the server
starts a message about a field with its path, e.g.
"hidden_states.shape[2] (d_model): ..." or "steps[1].hidden_states: ..."), the
server flag it names (e.g. "--max_seq_len"), and the call's x-request-id. The
original grpc.RpcError is the exception's __cause__.
"""
import re

import grpc

__all__ = ["AttnserveError", "CancelledError", "UnknownError", "InvalidArgumentError",
           "DeadlineExceededError", "NotFoundError", "AlreadyExistsError", "PermissionDeniedError",
           "ResourceExhaustedError", "FailedPreconditionError", "AbortedError", "OutOfRangeError",
           "UnimplementedError", "InternalError", "UnavailableError", "DataLossError",
           "UnauthenticatedError", "error_for_status", "error_from_rpc"]

# A message that starts with a field path: names with optional indices, joined
# by dots, optionally followed by a parenthesized dimension name, then ": ".
_FIELD = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\])*(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])*)*)(?: \([^)]*\))?: ")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_]*)")


class AttnserveError(Exception):
    """A call to attnserve failed.

    Attributes:
      code: the grpc.StatusCode.
      message: the server's message (gRPC's details).
      field: the request field the message names ("hidden_states.shape[2]",
        "steps[0].hidden_states", "model", ...), or None when it names none.
      flag: the first server flag the message names ("--max_seq_len"), or None.
      request_id: the call's x-request-id (the server's access log has it), or None.
    """

    def __init__(self, code, message, field=None, flag=None, request_id=None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.flag = flag
        self.request_id = request_id


class CancelledError(AttnserveError):
    """CANCELLED: the call was cancelled (by the client, or the server saw it go)."""


class UnknownError(AttnserveError):
    """UNKNOWN."""


class InvalidArgumentError(AttnserveError):
    """INVALID_ARGUMENT: a field is malformed, fields do not fit together, or the
    request passes a fixed limit of the server (retrying cannot help)."""


class DeadlineExceededError(AttnserveError):
    """DEADLINE_EXCEEDED: the deadline passed before the work was done."""


class NotFoundError(AttnserveError):
    """NOT_FOUND: the model is not loaded, or the session is unknown, expired,
    evicted or closed."""


class AlreadyExistsError(AttnserveError):
    """ALREADY_EXISTS: LoadModel of a model that is loading or ready."""


class PermissionDeniedError(AttnserveError):
    """PERMISSION_DENIED: an admin RPC with a token that is not an admin's."""


class ResourceExhaustedError(AttnserveError):
    """RESOURCE_EXHAUSTED: load (queue full, memory budget in use, KV cache);
    may pass on a retry later or on another replica."""


class FailedPreconditionError(AttnserveError):
    """FAILED_PRECONDITION: e.g. a model whose load failed (the message says why)."""


class AbortedError(AttnserveError):
    """ABORTED: e.g. a session step whose expected length is not the layer's."""


class OutOfRangeError(AttnserveError):
    """OUT_OF_RANGE: e.g. a session step past the session's max_tokens."""


class UnimplementedError(AttnserveError):
    """UNIMPLEMENTED: the server does not have this RPC."""


class InternalError(AttnserveError):
    """INTERNAL: a broken invariant in the server (a bug: please report it)."""


class UnavailableError(AttnserveError):
    """UNAVAILABLE: the server is starting, loading the model or shutting down,
    or cannot be reached (retry, perhaps elsewhere)."""


class DataLossError(AttnserveError):
    """DATA_LOSS."""


class UnauthenticatedError(AttnserveError):
    """UNAUTHENTICATED: no token, or one the server does not know."""


_CLASSES = {
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNKNOWN: UnknownError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def parse_field(message):
    """The request field a server message starts with, or None."""
    m = _FIELD.match(message or "")
    return m.group(1) if m else None


def parse_flag(message):
    """The first server flag (--name) a message names, or None."""
    m = _FLAG.search(message or "")
    return m.group(1) if m else None


def error_for_status(code, message, request_id=None):
    """The AttnserveError subclass instance for a status: `code` a
    grpc.StatusCode or its number (as in ExtendResult.code)."""
    if not isinstance(code, grpc.StatusCode):
        code = _BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _CLASSES.get(code, AttnserveError)
    return cls(code, message, field=parse_field(message), flag=parse_flag(message), request_id=request_id)


def error_from_rpc(error):
    """The AttnserveError for a grpc.RpcError (of grpc or grpc.aio)."""
    request_id = None
    try:
        for key, value in error.trailing_metadata() or ():
            if key == "x-request-id":
                request_id = value
    except Exception:  # an error raised before the call had metadata
        pass
    return error_for_status(error.code(), error.details() or "", request_id)
