"""Raw HTTP/2 for the hostile-client suite: frames built byte by byte (RFC 9113),
HPACK pieces built by hand where an attack needs a malformed or oversized one
(RFC 7541), and a client connection that answers the server's SETTINGS and
PING and records what the server sent back (GOAWAY, RST_STREAM, bytes).

Only loopback addresses are ever dialled (RawConnection refuses others)."""
import ipaddress
import socket
import struct
import threading
import time

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
CANCEL = 0x8  # RST_STREAM error code
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE every peer must accept

FRAME_NAMES = {DATA: "DATA", HEADERS: "HEADERS", RST_STREAM: "RST_STREAM", SETTINGS: "SETTINGS",
               PING: "PING", GOAWAY: "GOAWAY", WINDOW_UPDATE: "WINDOW_UPDATE"}


def frame(kind, flags, stream_id, payload=b""):
    """One frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream_id & 0x7FFFFFFF) + payload


def settings(**values):
    """A SETTINGS frame; values by RFC name, e.g. INITIAL_WINDOW_SIZE=65535."""
    ids = {"HEADER_TABLE_SIZE": 1, "ENABLE_PUSH": 2, "MAX_CONCURRENT_STREAMS": 3,
           "INITIAL_WINDOW_SIZE": 4, "MAX_FRAME_SIZE": 5, "MAX_HEADER_LIST_SIZE": 6}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items()))


def grpc_request_headers(authority, path="/attnserve.v1.AttentionService/Attend", extra=()):
    """An HPACK block of a gRPC call's request headers. Encoded by a fresh
    encoder, so it uses the static table only plus literals that add entries
    to the peer's dynamic table: the same bytes can be sent again and again."""
    return hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers"), *extra])


def hpack_int(value, prefix_bits, first_byte_flags=0, padding=0):
    """An HPACK integer (RFC 7541 5.1) with `padding` extra continuation bytes
    of value 0 before the last one: a legal encoding of the same number that
    is as long as the sender likes."""
    limit = (1 << prefix_bits) - 1
    if value < limit and padding == 0:
        return bytes([first_byte_flags | value])
    out = bytearray([first_byte_flags | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    if padding:
        out.append((value & 0x7F) | 0x80)
        out.extend(b"\x80" * (padding - 1))
        out.append(0)
    else:
        out.append(value)
    return bytes(out)


def literal_header(name, value_length, value_byte=b"a"):
    """A literal header field without indexing, new name (RFC 7541 6.2.2),
    whose value is value_length copies of value_byte (not Huffman-coded)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(value_length, 7) + \
        value_byte * value_length


def header_frames(stream_id, block, end_headers=True, chunk=MAX_FRAME, end_stream=False):
    """A header block as a HEADERS frame and as many CONTINUATION frames as it
    takes; END_HEADERS on the last one unless end_headers is False."""
    pieces = [block[i:i + chunk] for i in range(0, len(block), chunk)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        flags = (END_HEADERS if last and end_headers else 0)
        if i == 0:
            out.append(frame(HEADERS, flags | (END_STREAM if end_stream else 0), stream_id, piece))
        else:
            out.append(frame(CONTINUATION, flags, stream_id, piece))
    return out


def check_loopback(host):
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        raise ValueError(f"{host} is not a loopback address: the suite only attacks loopback")


class RawConnection:
    """A client HTTP/2 connection on a plain TCP socket. A reader thread
    parses what the server sends: it acknowledges SETTINGS and answers PING
    (so the server has no protocol reason to drop the connection), and
    records GOAWAYs, RST_STREAMs, the frames and bytes received. send() raises
    OSError (socket.timeout included) when the server stops reading for
    send_timeout seconds or has closed the connection. Not for concurrent
    senders beyond its lock's serialization."""

    def __init__(self, host, port, send_timeout=5.0, connect_timeout=5.0, initial_window=None,
                 source=""):
        check_loopback(host)
        self.sock = socket.create_connection((host, port), timeout=connect_timeout,
                                             source_address=(source, 0) if source else None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(send_timeout)
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self.goaway = None  # (last stream id, error code) of the first GOAWAY
        self.resets = 0
        self.frames = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.grpc_statuses = {}  # grpc-status of the server's answers: count
        self._decoder = hpack.Decoder()
        self.settings_seen = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        client_settings = {"ENABLE_PUSH": 0}
        if initial_window is not None:
            client_settings["INITIAL_WINDOW_SIZE"] = initial_window
        self.send(PREFACE + settings(**client_settings))
        self._reader.start()

    def send(self, data):
        with self._lock:
            self.sock.sendall(data)
            self.bytes_out += len(data)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=5)

    def _read(self):
        buffer = bytearray()
        try:
            while True:
                try:
                    chunk = self.sock.recv(1 << 16)
                except socket.timeout:  # the socket's send timeout: nothing came; read on
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                self.bytes_in += len(chunk)
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[0:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    payload = bytes(buffer[9:9 + length])
                    del buffer[:9 + length]
                    self._on_frame(kind, flags, payload)
        finally:
            self.closed.set()

    def _on_frame(self, kind, flags, payload):
        name = FRAME_NAMES.get(kind, str(kind))
        self.frames[name] = self.frames.get(name, 0) + 1
        try:
            if kind == SETTINGS and not flags & ACK:
                self.settings_seen.set()
                self.send(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self.send(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY and self.goaway is None:
                self.goaway = struct.unpack(">II", payload[:8])
            elif kind == RST_STREAM:
                self.resets += 1
            elif kind == HEADERS and flags & END_HEADERS and not flags & PADDED:
                block = payload[5:] if flags & 0x20 else payload  # PRIORITY fields
                for name, value in self._decoder.decode(block, raw=True):
                    if name == b"grpc-status":
                        status = value.decode()
                        self.grpc_statuses[status] = self.grpc_statuses.get(status, 0) + 1
        except OSError:
            pass  # the writer side is stuck or closed: the attack loop sees it
        except hpack.HPACKError:
            self.frames["undecodable HEADERS"] = self.frames.get("undecodable HEADERS", 0) + 1


def wait_until(predicate, timeout, interval=0.02):
    """Polls predicate() until true or timeout seconds passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
