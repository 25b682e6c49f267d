"""kvstore over 1, 2 and 4 redis-servers (``redis+shards://``) against the raw zero-copy client
on the same servers, in one run; and one server with ``io-threads`` against one without.

One op saves or loads 16 encoded records of 32 MiB (``bench_stores.Chunks``) in one batch. The
servers are real ``redis-server`` processes this script starts on loopback (``tests/servers.py``),
no persistence.

Rows of each table (round-robin, rep i of every path before rep i+1 of any):

  kvstore     ``ShardedRedisStore.put_many`` / ``get_into`` into leases of a buffer pool
              (``redis+shards://``; ``redis://`` for one server)
  raw         ``RawRedis`` (pipelined, ``recv_into`` preallocated buffers: no copy, no checksum),
              one connection per server, every server at once on a thread each, each holding the
              keys the store places on it, GETs kept ``raw_window`` ahead as the store keeps them:
              the ceiling

The io-threads table runs both rows against one server started with ``--io-threads 2
--io-threads-do-reads yes`` and against one without: Redis 6+ writes (and, with the second flag,
reads) clients' sockets on extra threads, its commands still on one. On a 2-core machine the
client and the servers share the cores: read the ratios, not the GB/s.

    python benchmarks/bench_redis_servers.py [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from bench_stores import Chunks, Table
from common import machine, memory_limits, raw_get_window, raw_window, report

from kvstore.buffers import BufferPool
from kvstore.types import array_view

N = 16


def _drain(stream) -> None:
    for lease in stream:
        assert lease is not None
        lease.release()


def table(title: str, data: Chunks, group: list[servers.RedisServer], reps: int, pool: BufferPool) -> str:
    from kvstore.stores import open_store
    from kvstore.stores.redis.raw import RawRedis

    hosts = ",".join(f"127.0.0.1:{s.port}" for s in group)
    url = f"redis://127.0.0.1:{group[0].port}" if len(group) == 1 else f"redis+shards://{hosts}"
    store = open_store(url + "?timeout=10s")  # 512 MiB batches on a busy 2-core machine
    shard_of = getattr(store, "shard_of", lambda key: 0)
    by_server: dict[int, list[int]] = {}
    for i, key in enumerate(data.keys):
        by_server.setdefault(shard_of(key), []).append(i)
    raws = [RawRedis(port=s.port) for s in group]
    sinks = [array_view(np.ones(len(r), dtype=np.uint8)) for r in data.records]
    threads = ThreadPoolExecutor(len(group))
    items = list(zip(data.keys, data.records))
    window = raw_window(len(data.records[0]))

    def raw_put() -> None:
        list(threads.map(lambda s: raws[s].set_many([items[i] for i in by_server[s]]), by_server))

    def raw_get() -> None:
        list(threads.map(lambda s: raw_get_window(raws[s], [data.keys[i] for i in by_server[s]],
                                                  [sinks[i] for i in by_server[s]], window), by_server))

    t = Table(title, data.nbytes, setup=lambda: [s.flushall() for s in group])
    print(t.title, flush=True)
    t.add("kvstore", lambda: store.put_many(items), lambda: _drain(store.get_into(data.keys, pool)))
    t.add("raw zero-copy", raw_put, raw_get)
    try:
        t.run(reps)
    finally:
        store.close()
        threads.shutdown()
    shares = ", ".join(str(len(by_server.get(s, []))) for s in range(len(group)))
    return t.render("raw zero-copy") + f"\nRecords per server: {shares}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="also write the tables (markdown) here")
    args = parser.parse_args()
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    header = (f"machine: {machine()}\nmemory: {memory_limits()}\nredis-server {version}\n"
              f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(header, flush=True)
    data = Chunks("32MiB", N)
    pool = BufferPool(1 << 30)
    sections = []
    for n in (1, 2, 4):
        group = [servers.RedisServer() for _ in range(n)]
        try:
            sections.append(table(f"{n} server{'s' if n > 1 else ''}, {N} x 32 MiB records per op "
                                  f"({data.nbytes / 2**20:.0f} MiB)", data, group, args.reps, pool))
        finally:
            for server in group:
                server.close()
    threaded = servers.RedisServer("--io-threads", "2", "--io-threads-do-reads", "yes")
    try:
        sections.append(table(f"1 server with --io-threads 2 --io-threads-do-reads yes, {N} x 32 MiB records per op",
                              data, [threaded], args.reps, pool))
    finally:
        threaded.close()
    text = header + "\n" + "\n".join(sections)
    report(text, args.out)


if __name__ == "__main__":
    main()
