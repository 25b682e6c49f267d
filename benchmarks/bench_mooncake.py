"""Mooncake Store through kvstore against Mooncake's own client, in one run on a master and a
segment owner this script starts on loopback (TCP), with Redis rows and memcpy beside them.

One op saves or loads 16 encoded chunk records (``bench_stores.Chunks``: 32 MiB, a Llama-8B-shaped
chunk of 256 tokens, or 3 MiB) in one batch. The pool's memory belongs to a standalone
``mooncake_client`` process (the benchmark contributes no segment), so every byte crosses a TCP
connection, as it would from another host.

Rows (round-robin: rep i of every path before rep i+1 of any, so load from other work on the
machine hits every path alike):

  raw Mooncake client     ``batch_upsert_from`` / ``batch_get_into`` of registered numpy buffers,
                          no verification: the ceiling the ratios are taken against
  kvstore store           ``MooncakeStore.put_many`` of the records / ``get_into`` into leases of
                          a buffer pool (what a load does before it verifies)
  kvstore register=always the same, every buffer registered with the transfer engine as over RDMA
  kvstore + verify        ``get_into``, then ``decode_record`` (every record's checksum checked)
  Redis store / raw       ``RedisStore.put_many`` / ``get_into`` and ``RawRedis`` (zero-copy,
                          pipelined) on one redis-server, if there is one
  memcpy                  ``np.copyto`` of the same bytes between resident buffers: the physical line

    python benchmarks/bench_mooncake.py [--reps 5] [--only 32MiB|3MiB] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from bench_stores import Chunks, Table
from common import machine, memory_limits, report

from kvstore.buffers import BufferPool
from kvstore.types import array_view

N = 16  # records per op


def versions() -> str:
    from importlib.metadata import version

    return (f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')}, "
            f"numpy {np.__version__}, {platform.platform()}")


def _drain(stream) -> None:
    for lease in stream:
        assert lease is not None
        lease.release()


def bench(data: Chunks, reps: int, master: servers.MooncakeMaster) -> str:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    from kvstore.stores import open_store

    table = Table(f"{data.n} x {data.name} records per op ({data.nbytes / 2**20:.0f} MiB)", data.nbytes)
    print(table.title, flush=True)
    items = list(zip(data.keys, data.records))
    pool = BufferPool(max(1 << 30, 2 * data.nbytes))

    # Mooncake's own client, as its documentation shows it: registered buffers, no checks.
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", master.metadata_url, 0, 0, "tcp", "", f"127.0.0.1:{master.port}") == 0
    sources = [np.frombuffer(r, dtype=np.uint8).copy() for r in data.records]
    sinks = [np.zeros(len(r), dtype=np.uint8) for r in data.records]
    for buf in sources + sinks:
        assert raw.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    raw_keys = ["raw/" + k for k in data.keys]
    sizes = [len(r) for r in data.records]
    replicate = ReplicateConfig()

    def raw_put() -> None:
        assert raw.batch_upsert_from(raw_keys, [b.ctypes.data for b in sources], sizes, replicate) == [0] * data.n

    def raw_get() -> None:
        assert raw.batch_get_into(raw_keys, [b.ctypes.data for b in sinks], sizes) == sizes

    table.add("raw Mooncake client (registered, no verification)", raw_put, raw_get)

    store = open_store(master.url_for(segment=0, prefix="kv/"))
    table.add("kvstore store (put_many / get_into)", lambda: store.put_many(items),
              lambda: _drain(store.get_into(data.keys, pool)))
    registered = open_store(master.url_for(segment=0, prefix="reg/", register="always"))
    table.add("kvstore store, register=always", lambda: registered.put_many(items),
              lambda: _drain(registered.get_into(data.keys, pool)))

    def load_verified() -> None:
        for i, lease in enumerate(store.get_into(data.keys, pool)):
            assert lease is not None
            data.decode(i, lease.view)
            lease.release()

    table.add("kvstore store + verify (decode_record)", lambda: store.put_many(items), load_verified)

    redis_server = None
    if servers.find_binary("redis-server"):
        from kvstore.stores.redis import RedisStore
        from kvstore.stores.redis.raw import RawRedis

        redis_server = servers.RedisServer()
        rstore = RedisStore.from_url(redis_server.url + "?timeout=10s")  # 512 MiB batches on a busy 2-core machine
        table.add("Redis store (put_many / get_into)", lambda: rstore.put_many(items),
                  lambda: _drain(rstore.get_into(data.keys, pool)))
        raw_redis = RawRedis(port=redis_server.port)
        views = [array_view(b) for b in sinks]
        table.add("Redis raw zero-copy (RawRedis)", lambda: raw_redis.set_many(items),
                  lambda: raw_redis.get_many_into(data.keys, views))
    else:
        print("  (no redis-server: no Redis rows)", flush=True)

    def memcpy() -> None:
        for src, dst in zip(sources, sinks):
            np.copyto(dst, src)

    table.add("memcpy (np.copyto, resident buffers)", memcpy, memcpy)
    try:
        table.run(reps)
    finally:
        store.close()
        registered.close()
        if redis_server is not None:
            redis_server.close()
    return table.render("raw Mooncake client (registered, no verification)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=("32MiB", "3MiB"))
    parser.add_argument("--out", help="also write the tables (markdown) here")
    args = parser.parse_args()
    for name, value in servers.MOONCAKE_ENV.items():  # the transfer engine announces loopback
        os.environ.setdefault(name, value)
    header = (f"machine: {machine()}\nmemory: {memory_limits()}\nversions: {versions()}\n"
              f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(header, flush=True)
    master = servers.MooncakeMaster(lease_ttl="10s")  # the master's default: a 512 MiB batch outlasts the tests' 2 s
    sections = []
    try:
        master.owner("2000MB")  # 16 x 32 MiB, three times over (raw, kvstore, register=always), and room
        for shape in ("32MiB", "3MiB"):
            if args.only and shape != args.only:
                continue
            data = Chunks(shape, N)
            sections.append(bench(data, args.reps, master))
            del data
    finally:
        master.close()
    text = header + "\n" + "\n".join(sections)
    report(text, args.out)


if __name__ == "__main__":
    main()
