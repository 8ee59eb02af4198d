"""Channel set-up shared by the blocking and the asyncio client: TLS
credentials, the bearer token's metadata and message-size options, and the
process's allocator set to reuse message buffers (_heap)."""
import dataclasses
from typing import Optional, Union

import grpc

from . import _heap

DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS settings for a Client: each file a path (str or os.PathLike) or the
    PEM bytes themselves.

    ca: CA bundle to trust (None: the system's roots).
    cert, key: the client's certificate chain and key, for mutual TLS.
    server_name: the name to check the server's certificate against, when it
      is not the target's host (e.g. a test certificate for "localhost").
    """
    ca: Optional[Union[str, bytes]] = None
    cert: Optional[Union[str, bytes]] = None
    key: Optional[Union[str, bytes]] = None
    server_name: Optional[str] = None


def _read(source):
    if source is None or isinstance(source, bytes):
        return source
    with open(source, "rb") as f:
        return f.read()


def _credentials(tls):
    """(channel credentials or None for plaintext, extra channel options)."""
    if tls is None or tls is False:
        return None, []
    if tls is True:
        return grpc.ssl_channel_credentials(), []
    if isinstance(tls, grpc.ChannelCredentials):
        return tls, []
    if isinstance(tls, Tls):
        if (tls.cert is None) != (tls.key is None):
            raise ValueError("tls: cert and key go together (mutual TLS)")
        credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls.ca),
                                                   private_key=_read(tls.key),
                                                   certificate_chain=_read(tls.cert))
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        return credentials, options
    raise TypeError(f"tls: expected None, True, attnserve.Tls or grpc.ChannelCredentials, got {tls!r}")


def make_channel(module, target, tls, options, max_receive_message_bytes):
    """A channel of `module` (grpc or grpc.aio) to target; the first one also
    sets the process's allocator to keep freed message buffers (_heap)."""
    _heap.keep_freed_buffers()
    credentials, tls_options = _credentials(tls)
    options = [("grpc.max_receive_message_length", max_receive_message_bytes),
               ("grpc.max_send_message_length", -1), *tls_options, *(options or [])]
    if credentials is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, credentials, options=options)


def token_metadata(token):
    """The call metadata that carries a bearer token (None: no token)."""
    if token is None:
        return None
    token = token.strip()
    if not token:
        raise ValueError("token: empty")
    return (("authorization", f"Bearer {token}"),)


ROUTING_KEY_HEADER = "attnserve-routing-key"
REPLICA_HEADER = "attnserve-replica"


def call_metadata(token_md, routing_key):
    """A call's metadata: the bearer token's (token_metadata) and, for a decode
    session's calls, its routing key (None: none)."""
    if routing_key is None:
        return token_md
    if not isinstance(routing_key, str) or not routing_key or not all(" " <= c <= "~" for c in routing_key):
        raise ValueError(f"routing_key: a non-empty string of printable ASCII, got {routing_key!r}")
    return (*(token_md or ()), (ROUTING_KEY_HEADER, routing_key))


def replica_of(initial_metadata):
    """The replica an answer names in its attnserve-replica header, or None."""
    # (key, value) pairs: a tuple (grpc) or grpc.aio.Metadata, which iterates as pairs.
    for key, value in initial_metadata or ():
        if key == REPLICA_HEADER:
            return value
    return None
