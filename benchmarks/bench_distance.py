"""What distance does to a batch: 16-record loads, saves and lookups through a shaped link.

Redis sits behind ``proxy.ShapedProxy`` (a one-way delay per direction and a bandwidth cap per
connection). For each round-trip time and connection count, one batch of 16 records of 1 MiB:

  naive              one GET per record, one after the other (redis-py): 16 round trips
  raw pipelined      the raw zero-copy client, all 16 GETs on one connection: 1 round trip,
                     the bytes over one connection's cap
  kvstore get_into   kvstore's Redis store spreading the batch over N connections: 1 round trip
                     plus the bytes over N connections' caps
  kvstore lookup     ``longest_prefix`` of the 16 keys (pipelined EXISTS): 1 round trip

and the same batch written: the raw client's 16 pipelined SETs on one connection against
kvstore's ``put_many`` over N connections (``connections``). The model of both tables:
``RTT + bytes / (N x cap)``. Milliseconds, median of ``--reps``.

    python benchmarks/bench_distance.py [--reps 5] [--rate-mbps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import machine

from kvstore.buffers import BufferPool
from kvstore.stores.redis import RedisStore
from kvstore.testing.proxy import ShapedProxy
from kvstore.testing.rawredis import RawRedis

N, SIZE = 16, 1 << 20


def ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rate-mbps", type=float, default=2000.0, help="bandwidth cap per connection, Mbit/s")
    args = parser.parse_args()
    rate = args.rate_mbps * 1e6 / 8
    print(machine())
    server = servers.RedisServer()
    try:
        keys = [f"kvs1/dist/{i:02d}" for i in range(N)]
        with redis.Redis(port=server.port) as r:
            for k in keys:
                r.set(k, np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8).tobytes())
        pool = BufferPool(256 << 20)
        values = [bytes(memoryview(np.full(SIZE, i, np.uint8))) for i in range(N)]
        writes: list[tuple[float, float, list[float], list[float]]] = []
        print(f"\n{N} records of {SIZE >> 20} MiB per batch; cap {args.rate_mbps:.0f} Mbit/s per connection; "
              f"ms, median of {args.reps}\n")
        print("| RTT ms | naive (16 GETs) | raw pipelined (1 conn) | kvstore get_into 1 / 2 / 4 conns | "
              "model 1 / 2 / 4 | kvstore lookup |")
        print("|---|---|---|---|---|---|")
        for rtt in (0.0, 1.0, 2.0, 5.0):
            proxy = ShapedProxy(server.port, delay=rtt / 2e3, rate=rate)
            try:
                naive_client = redis.Redis(port=proxy.port)
                raw = RawRedis(port=proxy.port)
                bufs = [memoryview(np.ones(SIZE, np.uint8)) for _ in keys]
                naive = ms(lambda: [naive_client.get(k) for k in keys], args.reps)
                rawt = ms(lambda: raw.get_many_into([k.encode() for k in keys], bufs), args.reps)
                ours, lookups = [], []
                for conns in (1, 2, 4):
                    store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}?connections={conns}&timeout=30s")

                    def load(store=store) -> None:
                        for lease in store.get_into(keys, pool):
                            assert lease is not None
                            lease.release()

                    ours.append(ms(load, args.reps))
                    if conns == 1:
                        lookups.append(ms(lambda store=store: store.longest_prefix(keys), args.reps))
                    store.close()
                model = [rtt + N * SIZE / (c * rate) * 1e3 for c in (1, 2, 4)]
                print(f"| {rtt:.0f} | {naive:.1f} | {rawt:.1f} | {' / '.join(f'{t:.1f}' for t in ours)} | "
                      f"{' / '.join(f'{t:.1f}' for t in model)} | {lookups[0]:.2f} |", flush=True)
                writes.append((rtt, ms(lambda: raw.set_many(zip(keys, values)), args.reps),
                               [_put_ms(proxy.port, conns, keys, values, args.reps) for conns in (1, 2, 4)], model))
                raw.close()
                naive_client.close()
            finally:
                proxy.close()
        print("\n| RTT ms | raw pipelined SETs (1 conn) | kvstore put_many 1 / 2 / 4 conns | model 1 / 2 / 4 |")
        print("|---|---|---|---|")
        for rtt, rawt, ours, model in writes:
            print(f"| {rtt:.0f} | {rawt:.1f} | {' / '.join(f'{t:.1f}' for t in ours)} | "
                  f"{' / '.join(f'{t:.1f}' for t in model)} |")
    finally:
        server.close()


def _put_ms(port: int, conns: int, keys: list[str], values: list[bytes], reps: int) -> float:
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}?connections={conns}&write_timeout=30s")
    try:
        return ms(lambda: store.put_many(zip(keys, values)), reps)
    finally:
        store.close()


if __name__ == "__main__":
    main()
