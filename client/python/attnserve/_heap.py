"""Keeps a call's freed message buffers in the process's heap for the next call.

grpcio and protobuf allocate each call's request and response buffers with
malloc. With glibc's defaults a freed buffer of a few MB goes back to the
system (blocks past the dynamic M_MMAP_THRESHOLD are unmapped, and the top
of the heap past M_TRIM_THRESHOLD is trimmed), so the next call faults every
page of its buffers in again. On the virtual machines attnserve is measured on
a first touch costs ~11 us per 4 KiB page: a B=1 S=2048 round trip (6.3 MB
each way) lost 20-90 ms in a quarter of its calls to that
(docs/measurements.md, "The Python client's page faults"). Raising both
thresholds, once per process, lets those pages be reused.

What it costs: the process keeps up to TRIM_THRESHOLD bytes of freed heap at
the top of each of its heaps instead of returning them at once (what it kept
is still reused by any later allocation), and blocks up to MMAP_THRESHOLD
come from the heap. Set ATTNSERVE_KEEP_FREED_BUFFERS=0 to leave the
process's allocator as it is; it is left alone too where the C library is not
glibc, or when GLIBC_TUNABLES already sets a glibc.malloc tunable.
"""
import ctypes
import os
import platform
import sys
import threading

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc's largest M_MMAP_THRESHOLD on 64-bit systems; larger blocks are always mapped afresh.
MMAP_THRESHOLD = 32 << 20
# Freed heap kept for reuse: the default largest message a Client receives.
TRIM_THRESHOLD = 256 << 20

_lock = threading.Lock()
_state = None  # None: not yet decided; otherwise why (a str) or "kept"


def _reason_to_leave_alone():
    """None when the allocator may be set; otherwise why not."""
    if os.environ.get("ATTNSERVE_KEEP_FREED_BUFFERS", "1") == "0":
        return "ATTNSERVE_KEEP_FREED_BUFFERS=0"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    return None


def keep_freed_buffers():
    """Sets glibc's thresholds (above) once per process, unless left alone;
    returns "kept" when they are set, else the reason they are not. Thread-safe."""
    global _state
    with _lock:
        if _state is None:
            _state = _reason_to_leave_alone()
            if _state is None:
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                _state = "kept" if ok else "mallopt refused"
        return _state
