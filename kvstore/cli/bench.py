"""``kvstore bench --store URL``: what a store gives this machine, by record size.

For each record size it writes ``count`` values under a private ``kvstore-bench/<random>/`` key
prefix with one ``put_many``, reads them back with one ``get_into`` (the engine's read: into a
pool of resident buffers kept from one repetition to the next, each value hashed as it arrives),
and times ``longest_prefix`` over their keys (the lookup an engine does per prompt: one round
trip per tier). Each figure is the median of ``--reps`` repetitions after untimed warm-up ones
(``WARM_UP_ROUNDS``); beside each GB/s is this process's CPU per GB (user + system, every
thread; the servers' is not counted). On a ``redis://`` URL the same bytes also go through
``kvstore.stores.redis.raw.RawRedis`` (pipelined, zero-copy sends, reads into preallocated
resident buffers, no hash): the ceiling the store is measured against, on the same connection
parameters. Every key it wrote is deleted at the end, also after an error.

It writes up to ``count x size`` bytes at a time into the store: on a shared production Redis
with ``maxmemory`` that can evict real records; point it at a staging store, or lower
``--count``. Use the result to size ``chunk_tokens`` (the record size) and to see what the
network gives: operations.md explains how.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import numpy as np

from kvstore.buffers import BufferPool, footprint
from kvstore.cli.common import number
from kvstore.cli.tiers import emit_json, human_bytes, print_table, unavailable_as_error
from kvstore.config import parse_size, redact_url
from kvstore.errors import ConfigError, KVStoreError, StoreUnavailableError
from kvstore.stores import Store, open_store
from kvstore.stores.base import LeaseStream
from kvstore.types import array_view

if TYPE_CHECKING:  # the redis package of kvstore.stores.redis needs redis-py: `kvstore` runs without it
    from kvstore.stores.redis.raw import RawRedis

__all__ = ["register", "cmd_bench", "raw_redis_target"]

DEFAULT_SIZES = "256KiB,1MiB,4MiB,16MiB"
MAX_BATCH_BYTES = 256 << 20  # per size, at most this much is written at once by default
# Untimed rounds before each figure: connections open, the pool's buffers allocated, and a Redis
# store's read and write widths learned (it probes wider ones at its 2nd, 4th and 8th batch, then
# ever more rarely): what an engine's long-lived store has long done. At least one, at most
# WARM_UP_ROUNDS or as many as fit in WARM_UP_SECONDS (a slow S3 link).
WARM_UP_ROUNDS = 8
WARM_UP_SECONDS = 2.0


def raw_redis_target(url: str) -> dict[str, Any] | None:
    """``RawRedis`` arguments for a plain ``redis://`` URL, ``None`` for any other store."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        return None
    db = parts.path.strip("/")
    return {"host": parts.hostname or "127.0.0.1", "port": parts.port or 6379,
            "password": unquote(parts.password) if parts.password else None,
            "username": unquote(parts.username) if parts.username else None,
            "db": int(db) if db.isdigit() else 0, "prefix": _query(parts.query, "prefix")}


def _query(query: str, name: str) -> str:
    for item in query.split("&"):
        k, _, v = item.partition("=")
        if k == name:
            return unquote(v)
    return ""


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _median_timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """The median wall seconds and the median CPU seconds of ``reps`` calls of ``fn``, after
    untimed ones (``WARM_UP_ROUNDS``)."""
    end = time.monotonic() + WARM_UP_SECONDS
    for _ in range(WARM_UP_ROUNDS):
        fn()
        if time.monotonic() > end:
            break
    times, cpu = [], []
    for _ in range(reps):
        c = _cpu_seconds()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        cpu.append(_cpu_seconds() - c)
    return statistics.median(times), statistics.median(cpu)


def _drain(stream: LeaseStream, keys: list[str]) -> None:
    """Take every value of a ``get_into`` stream and give its buffer back, as an engine does once
    it has placed the value."""
    with closing(stream):
        for key, lease in zip(keys, stream):
            if lease is None:
                raise KVStoreError(f"{key} vanished before kvstore bench read it back (evicted? maxmemory)")
            lease.release()


def _row(size: int, count: int, path: str, put: tuple[float, float], get: tuple[float, float],
         lookup_ms: float | None) -> dict[str, Any]:
    gb = size * count / 1e9
    return {"size": size, "count": count, "path": path, "put_gbps": gb / put[0], "get_gbps": gb / get[0],
            "put_cpu_s_per_gb": put[1] / gb, "get_cpu_s_per_gb": get[1] / gb, "lookup_ms": lookup_ms}


def _measure(store: Store, raw: RawRedis | None, raw_prefix: str, keys: list[str], arrays: list[np.ndarray],
             reps: int) -> list[dict[str, Any]]:
    """One record size: the store's row, and the raw client's when there is one."""
    size, count = arrays[0].nbytes, len(arrays)
    values = [array_view(a) for a in arrays]
    put = _median_timed(lambda: store.put_many(zip(keys, values)), reps)
    store.flush(60.0)
    pool = BufferPool(footprint(size) * count)  # the whole batch at once: no read waits for a buffer
    get = _median_timed(lambda: _drain(store.get_into(keys, pool), keys), reps)
    lookup = _median_timed(lambda: store.longest_prefix(keys), max(reps, 5))[0]
    rows = [_row(size, count, "kvstore store", put, get, lookup * 1e3)]
    if raw is not None:
        from kvstore.stores.redis.raw import store_window

        raw_keys = [raw_prefix + k for k in keys]  # the store adds its URL's prefix= the same way
        buffers = [np.ones(size, dtype=np.uint8) for _ in range(count)]  # resident, as the pool's are
        put = _median_timed(lambda: raw.set_many(zip(raw_keys, values)), reps)
        window = store_window(size)  # the store's reads keep as much requested ahead
        get = _median_timed(lambda: raw.get_many_into(raw_keys, buffers, ahead=window), reps)
        rows.append(_row(size, count, "raw RESP (zero-copy)", put, get, None))
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    urls = args.store or []
    if len(urls) != 1:
        raise ConfigError("kvstore bench measures one store: give exactly one --store URL")
    url = urls[0]
    sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes {args.sizes!r} must be a comma-separated list of positive sizes")
    if args.reps < 1 or (args.count is not None and args.count < 1):
        raise ConfigError("--reps and --count must be at least 1")
    try:
        store = open_store(url)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"store URL {redact_url(url)!r} is not valid: {exc}") from exc
    raw_args = raw_redis_target(url)
    prefix = f"kvstore-bench/{uuid.uuid4().hex[:12]}/"
    rows: list[dict[str, Any]] = []
    written: list[str] = []
    name = redact_url(url)
    try:
        with unavailable_as_error(name):
            store.size_many([prefix + "probe"])
    except StoreUnavailableError as exc:
        store.close()
        raise StoreUnavailableError(f"{name} is unreachable: {exc}") from None
    raw: RawRedis | None = None
    try:
        if raw_args is not None:
            from kvstore.stores.redis.raw import RawRedis

            with unavailable_as_error(name):
                raw = RawRedis(raw_args["host"], raw_args["port"], password=raw_args["password"],
                               username=raw_args["username"], db=raw_args["db"])
        rng = np.random.default_rng(0)
        for size in sizes:
            count = args.count or max(2, min(16, MAX_BATCH_BYTES // size))
            keys = [f"{prefix}{size}/{i:04d}" for i in range(count)]
            written += keys
            with unavailable_as_error(name):
                rows += _measure(store, raw, raw_args["prefix"] if raw_args else "", keys,
                                 [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)], args.reps)
    finally:
        try:
            if written:
                store.delete_many(written)
        except Exception:  # noqa: BLE001 - a failed cleanup must not hide the measurement's error
            pass
        if raw is not None:
            raw.close()
        store.close()
    if args.json:
        emit_json({"store": name, "reps": args.reps, "pid": os.getpid(), "rows": rows})
        return 0
    print(f"{name}: median of {args.reps} (GB/s = 10^9 bytes/s; one batch of COUNT records per op; "
          f"CPU s/GB: this process's user + system seconds per GB, servers not counted)")
    table = [[human_bytes(r["size"]), r["count"], r["path"], f"{r['put_gbps']:.2f}", f"{r['put_cpu_s_per_gb']:.2f}",
              f"{r['get_gbps']:.2f}", f"{r['get_cpu_s_per_gb']:.2f}",
              "" if r["lookup_ms"] is None else f"{r['lookup_ms']:.2f}"] for r in rows]
    print_table(table, ["RECORD", "COUNT", "PATH", "PUT GB/s", "PUT CPU s/GB", "GET GB/s", "GET CPU s/GB",
                        "LOOKUP ms"], right=(0, 1, 3, 4, 5, 6, 7))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="measure a store: put/get GB/s by record size, lookup latency")
    p.add_argument("--store", action="append", metavar="URL", required=True, help="the store to measure")
    p.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LIST",
                   help=f"record sizes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--count", type=number(int, 1, 4096), default=None, metavar="N",
                   help="records per batch (default: up to 16, at most 256 MiB per batch)")
    p.add_argument("--reps", type=number(int, 1, 1000), default=3, metavar="N", help="repetitions per figure (median; default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    p.set_defaults(func=cmd_bench)
