#!/usr/bin/python3
"""Churns a real server's decode sessions and watches its memory.

Starts the build's attnserve (port 0; a small KV cache and session table, so
that sessions are evicted for memory and for --max_sessions) and runs
`attnctl bench --decode --churn` against it for --duration seconds: sessions
opened, extended (decode tokens, short prefills), forked, truncated, closed,
left to expire (a quarter with a 0.25 s TTL) and evicted, at random, every answer's length
checked by attnctl (no token lost or duplicated; every refusal NOT_FOUND for
a session the server ended or RESOURCE_EXHAUSTED). Meanwhile it samples the
server's RSS (/proc/PID/status) twice a second and its metrics every
--scrape_every seconds, and prints:

  RSS after the first --first_minute seconds, at the end, their ratio
  (target: the end within 5% of the first minute's level), the peak;
  the pool's bookkeeping per pool byte at the fullest sample: blocks in use x
  (16 bytes of the pool's record + 16 bytes of a block table's handle + 4
  bytes of a free-list id, core/decode/kv_block_pool.h) over the bytes in use
  (attnserve_kv_cache_blocks, attnserve_kv_cache_used_bytes) -- a count from
  the pool's own accounting, not a measurement of the heap (target <= 2%);
  what attnctl counted and the server's evictions and expiries.

Exit status 1 when attnctl found a failure, or (--check) when the churn did
not see what it is meant to exercise: forks, truncations, expiries and
evictions (the server's counters). The RSS ratio is printed, never asserted
(a busy machine's allocator may keep more or less).

Usage:
  /usr/bin/python3 tests/benchmarks/session_churn.py [--build build]
      [--duration 600] [--first_minute 60] [--check]
"""
import argparse
import atexit
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from harness import Server, metric, wait_until  # noqa: E402

BOOKKEEPING_BYTES_PER_BLOCK = 16 + 16 + 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--first_minute", type=float, default=60,
                        help="the RSS baseline is sampled this long into the churn")
    parser.add_argument("--sessions", type=int, default=48, help="attnctl's live sessions")
    parser.add_argument("--context", type=int, default=512, help="tokens a session may hold")
    parser.add_argument("--max_sessions", type=int, default=44,
                        help="the server's flag (a little under --sessions: some opens evict)")
    parser.add_argument("--ttl", type=float, default=0.25,
                        help="the short idle TTL a quarter of the sessions ask for")
    parser.add_argument("--kv_cache_bytes", type=int, default=16 << 20, help="the server's flag")
    parser.add_argument("--scrape_every", type=float, default=30,
                        help="seconds between scrapes of the server's metrics")
    parser.add_argument("--check", action="store_true",
                        help="also fail unless forks, truncations, expiries and evictions happened")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    server = Server(os.path.join(args.build, "server", "attnserve"),
                    f"--kv_cache_bytes={args.kv_cache_bytes}", f"--max_sessions={args.max_sessions}",
                    "--compute_threads=2")
    atexit.register(server.stop)
    server.wait_serving(120)
    churn = subprocess.Popen(
        [os.path.join(args.build, "client", "attnctl"), "bench", "--decode", "--churn",
         f"--target={server.target}", f"--duration={args.duration}",
         f"--sessions={args.sessions}", f"--context={args.context}", f"--ttl_seconds={args.ttl}",
         f"--seed={int(time.time())}", "--json"],
        stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    samples = []  # (seconds, RSS KiB, blocks, used bytes, allocator cache KiB, KV held KiB)
    stop = threading.Event()

    def sample():
        # RSS twice a second from /proc; the metrics only every --scrape_every
        # seconds: each scrape opens a connection that one of the metrics
        # server's worker threads serves, and what a scrape costs should not
        # read as churn's (a worker kept about half a MiB of allocator cache
        # after its first scrape until it gave its cache back after each
        # request; now about 0.05 MiB a scrape).
        m, scraped = {}, -args.scrape_every
        while not stop.is_set():
            try:
                now = time.monotonic() - start
                rss = server.memory_kib()["VmRSS"]
                if now - scraped >= args.scrape_every:
                    m, scraped = server.scrape(), now
                samples.append((now, rss,
                                metric(m, "attnserve_kv_cache_blocks"),
                                metric(m, "attnserve_kv_cache_used_bytes"),
                                metric(m, "attnserve_allocator_cached_bytes") / 1024,
                                metric(m, "attnserve_kv_cache_held_bytes") / 1024))
            except (OSError, KeyError):
                pass
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = churn.communicate()
    stop.set()
    sampler.join()
    final = server.scrape()
    # Idle now: once the server has given its allocator's cache back (it does
    # after --allocator_cache_idle_ms without calls), what is left.
    try:
        wait_until("the allocator's cache given back", lambda: metric(
            server.scrape(), "attnserve_allocator_cached_bytes") == 0, 30)
        idle_rss = server.memory_kib()["VmRSS"]
    except AssertionError:
        idle_rss = None
    server.stop()
    result = json.loads(out.strip().splitlines()[-1])

    baseline = next((s for s in samples if s[0] >= args.first_minute), None)
    end = samples[-1] if samples else None
    peak = max(s[1] for s in samples) if samples else 0
    fullest = max(samples, key=lambda s: s[3]) if samples else None
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"churn: {result['seconds']:.0f} s; operations {result['operations']}; "
          f"{result['steps']} steps, {result['tokens_appended']} tokens appended")
    print(f"refusals {result['refusals']}; sessions the server ended {result['ended']}")
    evictions = sum(v for (name, _), v in final.items()
                    if name == "attnserve_session_evictions_total")
    expiries = metric(final, "attnserve_session_expiries_total")
    print(f"server: {evictions:.0f} evictions, {expiries:.0f} expiries")
    if baseline and end:
        print(f"RSS: {baseline[1] / 1024:.1f} MiB at {baseline[0]:.0f} s, {end[1] / 1024:.1f} MiB "
              f"at the end ({end[0]:.0f} s): end / first = {end[1] / baseline[1]:.3f} "
              f"(target <= 1.05); peak {peak / 1024:.1f} MiB")
    if samples:
        print("RSS over the run (MiB): seconds, RSS, and from the latest scrape: the allocator's "
              "cache of freed memory (attnserve_allocator_cached_bytes, kept for reuse up to "
              "--max_allocator_cache_bytes), RSS less that cache, the KV pool's held bytes")
        marks = [args.duration * i / 10 for i in range(1, 11)]
        for mark in marks:
            s = next((x for x in samples if x[0] >= mark), samples[-1])
            print(f"  {s[0]:6.0f} {s[1] / 1024:8.1f} {s[4] / 1024:8.1f} {(s[1] - s[4]) / 1024:8.1f} "
                  f"{s[5] / 1024:8.1f}")
        if baseline and end:
            print(f"RSS less the allocator's cache: end / first = "
                  f"{(end[1] - end[4]) / (baseline[1] - baseline[4]):.3f}")
    if idle_rss and baseline:
        print(f"RSS idle after the churn, the allocator's cache given back: {idle_rss / 1024:.1f} MiB "
              f"({idle_rss / baseline[1]:.3f} of the first minute's)")
    if fullest and fullest[3] > 0:
        print(f"pool bookkeeping at the fullest sample: {fullest[2]:.0f} blocks x "
              f"{BOOKKEEPING_BYTES_PER_BLOCK} B over {fullest[3] / 2**20:.1f} MiB in use = "
              f"{100 * fullest[2] * BOOKKEEPING_BYTES_PER_BLOCK / fullest[3]:.3f}% (target <= 2%)")
    problems = []
    if churn.returncode != 0 or result["failures"]:
        problems.append(f"attnctl: exit {churn.returncode}, failures {result['first_failures']}")
    if args.check:
        for kind in ("extend", "fork", "truncate", "close"):
            if not result["operations"].get(kind):
                problems.append(f"no {kind} ran")
        if not result["steps"]:
            problems.append("no step was answered")
        if not evictions:
            problems.append("no session was evicted")
        if not expiries:
            problems.append("no session expired")
    if problems:
        sys.exit("; ".join(problems))


if __name__ == "__main__":
    main()
