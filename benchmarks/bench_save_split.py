"""Where a save's time goes beyond the wire: PrefixCache.save against the bare store call and the
raw zero-copy client, over 1, 2 and 4 connections.

    python benchmarks/bench_save_split.py [--reps 7]

16 chunks per batch at the two shapes of bench_peer_lmcache.py (3 MiB and 32 MiB). For each, in
one run against one redis-server, medians of ``--reps`` rounds (after one warm-up round):

* ``raw put``: the raw zero-copy client (``kvstore.stores.redis.raw``) SETting the records;
* ``put_bare c=N``: ``RedisStore.put_many`` of the same encoded records over N connections;
* ``save c=N``: ``PrefixCache.save`` (lookup, encode with the checksum, put_many) over N.

* ``raw, checksum first``: the raw client after hashing every record (xxh3, as the encoder
  does: the checksum sits in the header, so it must be known before the payload is sent);
* ``raw, checksum as it sends``: the raw client hashing each 1 MiB slice right before sending
  it, what a checksum written after the payload (a trailer) would allow: the send then reads
  bytes the hash has just brought into the CPU's cache.

``save`` over ``put_bare`` is what encoding costs; ``put_bare`` over ``raw`` what the store's
pipelining costs; the two checksum rows bound what a trailer checksum could win back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "tests")]

import bench_peer_lmcache as peer
import redis
import servers
import xxhash
from common import machine, memory_limits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"memory: {memory_limits()}")
    server = servers.RedisServer()
    try:
        for name in ("3MiB", "32MiB"):
            data = peer.Data(name)
            client = redis.Redis(port=server.port)
            paths = {c: peer.KVStorePath(f"{server.url}?connections={c}&adapt_writes=false", data) for c in (1, 2, 4)}
            raw = peer.RawPath(server.port, paths[4])
            calls = {"raw put": raw.put, "raw, checksum first": lambda raw=raw: _hash_first(raw),
                     "raw, checksum as it sends": lambda raw=raw: _hash_as_sent(raw)}
            for c, kv in paths.items():
                calls[f"put_bare c={c}"] = kv.put_bare
                calls[f"save c={c}"] = kv.save
            times: dict[str, list[float]] = {label: [] for label in calls}
            for rep in range(args.reps + 1):  # round 0 warms up
                for label, call in calls.items():
                    client.flushall()
                    start = time.perf_counter()
                    call()
                    if rep:
                        times[label].append(time.perf_counter() - start)
            raw_median = statistics.median(times["raw put"])
            print(f"\n{name}: 16 chunks, {data.nbytes / 2**20:.0f} MiB per batch, load average {os.getloadavg()[0]:.2f}")
            print("| path | GB/s | ratio to raw |\n|---|---|---|")
            for label, ts in times.items():
                m = statistics.median(ts)
                print(f"| {label} | {data.nbytes / m / 1e9:.2f} | {raw_median / m:.2f} |")
    finally:
        server.close()


def _hash_first(raw: peer.RawPath) -> None:
    for _, value in raw.items:
        xxhash.xxh3_64_digest(value)
    raw.put()


def _hash_as_sent(raw: peer.RawPath) -> None:
    hasher = xxhash.xxh3_64()  # one running hash: what it costs, not which record it belongs to
    raw.client.set_many(raw.items, before_send=hasher.update)


if __name__ == "__main__":
    main()
