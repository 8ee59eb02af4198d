"""attnserve: a Python client for the attnserve multi-head attention service.

    import attnserve, numpy as np
    client = attnserve.Client("localhost:50051")
    r = client.attend(np.random.standard_normal((2, 16, 768)), maps="per-head")
    print(r.output.shape, r.maps.shape)  # (2, 16, 768) (2, 12, 16, 16)

Client (blocking) and attnserve.aio.Client (asyncio) call Attend (NumPy arrays
in and out, BF16 on the wire when asked), the model and health RPCs, and the
decode sessions (client.open_session(), session.extend(x), fork, truncate,
latest_attention, close). Failed calls raise AttnserveError subclasses keeping the status code
and the field the server's message names. The generated protobuf and gRPC code
is attnserve.v1 (attention_pb2, attention_pb2_grpc), for every field of the API.
"""
from ._channel import Tls
from ._version import __version__
from .client import Client, Session, Step
from .errors import (AbortedError, AlreadyExistsError, AttnserveError, CancelledError, DataLossError,
                     DeadlineExceededError, FailedPreconditionError, InternalError, InvalidArgumentError,
                     NotFoundError, OutOfRangeError, PermissionDeniedError, ResourceExhaustedError,
                     UnauthenticatedError, UnavailableError, UnimplementedError, UnknownError)
from .messages import AttendResult, HeadStatistics, LatestAttention, ModelInfo, SessionInfo, StepResult, Timing
from .tensors import bf16_round, from_bf16_words, to_bf16_words
from . import aio  # noqa: E402 -- attnserve.aio.Client after `import attnserve`

__all__ = [
    "__version__", "aio", "Client", "Session", "Step", "Tls",
    "AttendResult", "HeadStatistics", "LatestAttention", "ModelInfo", "SessionInfo", "StepResult", "Timing",
    "bf16_round", "from_bf16_words", "to_bf16_words",
    "AttnserveError", "AbortedError", "AlreadyExistsError", "CancelledError", "DataLossError",
    "DeadlineExceededError", "FailedPreconditionError", "InternalError", "InvalidArgumentError",
    "NotFoundError", "OutOfRangeError", "PermissionDeniedError", "ResourceExhaustedError",
    "UnauthenticatedError", "UnavailableError", "UnimplementedError", "UnknownError",
]
