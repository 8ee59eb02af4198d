"""Channel set-up shared by the blocking and the asyncio client: TLS
credentials, the bearer token's metadata and message-size options."""
import dataclasses
from typing import Optional, Union

import grpc

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
    """A channel of `module` (grpc or grpc.aio) to target."""
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
