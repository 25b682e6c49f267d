"""``kvstore bench --store URL``: what a store gives this machine, by record size.

For each record size it writes ``count`` values under a private ``kvstore-bench/<random>/`` key
prefix with one ``put_many``, reads them back with one ``get_many``, and times
``longest_prefix`` over their keys (the lookup an engine does per prompt: one round trip per
tier). Each figure is the median of ``--reps`` repetitions. On a ``redis://`` URL the same bytes
also go through ``kvstore.stores.redis.raw.RawRedis`` (pipelined, zero-copy sends, reads into
preallocated buffers): the ceiling the store is measured against, on the same connection
parameters. Every key it wrote is deleted at the end, also after an error.

It writes up to ``count x size`` bytes at a time into the store: on a shared production Redis
with ``maxmemory`` that can evict real records; point it at a staging store, or lower
``--count``. Use the result to size ``chunk_tokens`` (the record size) and to see what the
network gives: operations.md explains how.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import numpy as np

from kvstore.cli.common import number
from kvstore.cli.tiers import emit_json, human_bytes, print_table, unavailable_as_error
from kvstore.config import parse_size, redact_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores import Store, open_store
from kvstore.types import array_view

if TYPE_CHECKING:  # the redis package of kvstore.stores.redis needs redis-py: `kvstore` runs without it
    from kvstore.stores.redis.raw import RawRedis

__all__ = ["register", "cmd_bench", "raw_redis_target"]

DEFAULT_SIZES = "256KiB,1MiB,4MiB,16MiB"
MAX_BATCH_BYTES = 256 << 20  # per size, at most this much is written at once by default


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


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(store: Store, raw: RawRedis | None, raw_prefix: str, keys: list[str], arrays: list[np.ndarray],
             reps: int) -> list[dict[str, Any]]:
    """One record size: the store's row, and the raw client's when there is one."""
    size, count = arrays[0].nbytes, len(arrays)
    total = size * count
    values = [array_view(a) for a in arrays]
    put = _median_seconds(lambda: store.put_many(zip(keys, values)), reps)
    store.flush(60.0)
    get = _median_seconds(lambda: store.get_many(keys), reps)
    lookup = _median_seconds(lambda: store.longest_prefix(keys), max(reps, 5))
    rows = [{"size": size, "count": count, "path": "kvstore store", "put_gbps": total / put / 1e9,
             "get_gbps": total / get / 1e9, "lookup_ms": lookup * 1e3}]
    if raw is not None:
        raw_keys = [raw_prefix + k for k in keys]  # the store adds its URL's prefix= the same way
        buffers = [np.empty(size, dtype=np.uint8) for _ in range(count)]
        put = _median_seconds(lambda: raw.set_many(zip(raw_keys, values)), reps)
        get = _median_seconds(lambda: raw.get_many_into(raw_keys, buffers), reps)
        rows.append({"size": size, "count": count, "path": "raw RESP (zero-copy)", "put_gbps": total / put / 1e9,
                     "get_gbps": total / get / 1e9, "lookup_ms": None})
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
    print(f"{name}: median of {args.reps} (GB/s = 10^9 bytes/s; one batch of COUNT records per op)")
    table = [[human_bytes(r["size"]), r["count"], r["path"], f"{r['put_gbps']:.2f}", f"{r['get_gbps']:.2f}",
              "" if r["lookup_ms"] is None else f"{r['lookup_ms']:.2f}"] for r in rows]
    print_table(table, ["RECORD", "COUNT", "PATH", "PUT GB/s", "GET GB/s", "LOOKUP ms"], right=(0, 1, 3, 4, 5))
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
