"""What distance does to a batch: 16-record loads, saves and lookups through a shaped link.

Redis sits behind ``proxy.ShapedProxy`` (a one-way delay per direction and a bandwidth cap per
connection). For each round-trip time and connection count, one batch of 16 records of 1 MiB:

  naive              one GET per record, one after the other (redis-py): 16 round trips
  raw pipelined      the raw zero-copy client, all 16 GETs on one connection: 1 round trip,
                     the bytes over one connection's cap
  kvstore get_into   kvstore's Redis store spreading the batch over N connections
                     (``connections=N&adapt_reads=false``): 1 round trip plus the bytes over N
                     connections' caps; and the default (``connections=4``, widths learned:
                     ``adapt_reads``) after ``ADAPT_WARMUP`` untimed batches, with its width
  kvstore lookup     ``longest_prefix`` of the 16 keys (pipelined EXISTS): 1 round trip

and the same batch written: the raw client's 16 pipelined SETs on one connection against
kvstore's ``put_many`` over N connections (``connections=N&adapt_writes=false``), and the
default (``connections=4``, widths learned: ``adapt_writes``) after ``ADAPT_WARMUP`` untimed
batches, with the width it settled at. The model of both tables: ``RTT + bytes / (N x cap)``.

Then a three-primary Redis Cluster, each node behind its own shaped proxy (the nodes announce
the proxies' ports, so every client reaches them only through the link). The same batch spreads
over the nodes by hash slot; kvstore's ``get_into`` and ``put_many`` use every node at once, with
1 or 4 connections per node (``connections`` 3 or 12, widths not learned), against the raw client with one
connection and thread per node, and one GET per record through redis-py's cluster client. The
model: ``RTT + the largest node's bytes / (connections per node x cap)``.

Milliseconds, median of ``--reps``.

    python benchmarks/bench_distance.py [--reps 5] [--rate-mbps 2000] [--only server|cluster]
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
from kvstore.stores.redis import RedisClusterStore, RedisStore
from kvstore.stores.redis.raw import RawRedis
from kvstore.testing.proxy import ShapedProxy

N, SIZE = 16, 1 << 20
ADAPT_WARMUP = 10  # batches the default's read or write width has to settle before it is timed


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
    parser.add_argument("--only", choices=("server", "cluster"), help="one server's tables, or the cluster's")
    args = parser.parse_args()
    rate = args.rate_mbps * 1e6 / 8
    print(machine())
    if args.only != "cluster":
        server_tables(args.reps, rate)
    if args.only != "server":
        cluster_tables(args.reps, rate)


def server_tables(reps: int, rate: float) -> None:
    server = servers.RedisServer()
    try:
        keys = [f"kvs1/dist/{i:02d}" for i in range(N)]
        with redis.Redis(port=server.port) as r:
            for k in keys:
                r.set(k, np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8).tobytes())
        pool = BufferPool(256 << 20)
        values = [bytes(memoryview(np.full(SIZE, i, np.uint8))) for i in range(N)]
        writes: list[tuple[float, float, list[float], list[float]]] = []
        print(f"\n{N} records of {SIZE >> 20} MiB per batch; cap {rate * 8 / 1e6:.0f} Mbit/s per connection; "
              f"ms, median of {reps}\n")
        print("| RTT ms | naive (16 GETs) | raw pipelined (1 conn) | kvstore get_into 1 / 2 / 4 conns | "
              "kvstore get_into, default (width settled at) | model 1 / 2 / 4 | kvstore lookup |")
        print("|---|---|---|---|---|---|---|")
        for rtt in (0.0, 1.0, 2.0, 5.0):
            proxy = ShapedProxy(server.port, delay=rtt / 2e3, rate=rate)
            try:
                naive_client = redis.Redis(port=proxy.port)
                raw = RawRedis(port=proxy.port)
                bufs = [memoryview(np.ones(SIZE, np.uint8)) for _ in keys]
                naive = ms(lambda: [naive_client.get(k) for k in keys], reps)
                rawt = ms(lambda: raw.get_many_into([k.encode() for k in keys], bufs), reps)
                ours, lookups = [], []
                for options in ("connections=1&adapt_reads=false", "connections=2&adapt_reads=false",
                                "connections=4&adapt_reads=false", "connections=4"):
                    store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}?{options}&timeout=30s")

                    def load(store=store) -> None:
                        for lease in store.get_into(keys, pool):
                            assert lease is not None
                            lease.release()

                    if "adapt" not in options:
                        for _ in range(ADAPT_WARMUP):
                            load()
                    ours.append(ms(load, reps))
                    width = store.describe()["read_connections"]
                    if options.startswith("connections=1"):
                        lookups.append(ms(lambda store=store: store.longest_prefix(keys), reps))
                    store.close()
                model = [rtt + N * SIZE / (c * rate) * 1e3 for c in (1, 2, 4)]
                print(f"| {rtt:.0f} | {naive:.1f} | {rawt:.1f} | {' / '.join(f'{t:.1f}' for t in ours[:3])} | "
                      f"{ours[3]:.1f} ({width}) | {' / '.join(f'{t:.1f}' for t in model)} | {lookups[0]:.2f} |",
                      flush=True)
                writes.append((rtt, ms(lambda: raw.set_many(zip(keys, values)), reps),
                               [_put_ms(proxy.port, f"connections={conns}&adapt_writes=false", keys, values, reps)
                                for conns in (1, 2, 4)], model,
                               _put_ms(proxy.port, "connections=4", keys, values, reps, warmup=ADAPT_WARMUP)))
                raw.close()
                naive_client.close()
            finally:
                proxy.close()
        print("\n| RTT ms | raw pipelined SETs (1 conn) | kvstore put_many 1 / 2 / 4 conns | "
              "kvstore put_many, default (width settled at) | model 1 / 2 / 4 |")
        print("|---|---|---|---|---|")
        for rtt, rawt, ours, model, (adaptive, width) in writes:
            print(f"| {rtt:.0f} | {rawt:.1f} | {' / '.join(f'{t:.1f}' for t, _ in ours)} | {adaptive:.1f} ({width}) | "
                  f"{' / '.join(f'{t:.1f}' for t in model)} |")
    finally:
        server.close()


def cluster_tables(reps: int, rate: float) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cluster = servers.RedisCluster()
    proxies = [ShapedProxy(node.port) for node in cluster.nodes]
    try:
        _announce(cluster, proxies)
        keys = [f"kvs1/dist/{i:02d}" for i in range(N)]
        values = [bytes(memoryview(np.full(SIZE, i, np.uint8))) for i in range(N)]
        with redis.RedisCluster(host="127.0.0.1", port=proxies[0].port) as client:
            shares: dict[int, list[int]] = {}
            for i, k in enumerate(keys):
                shares.setdefault(client.get_node_from_key(k).port, []).append(i)
            for k, v in zip(keys, values):
                client.set(k, v)
        largest = max(len(share) for share in shares.values())
        pool = BufferPool(256 << 20)
        threads = ThreadPoolExecutor(len(shares))
        print(f"\nRedis Cluster, 3 primaries, each behind its own link; the batch's records per node: "
              f"{sorted(len(s) for s in shares.values())}; ms, median of {reps}\n")
        print("| RTT ms | naive (16 GETs) | raw, a connection per node: GET / SET | "
              "kvstore get_into 1 / 4 conns per node | kvstore put_many 1 / 4 | model 1 / 4 |")
        print("|---|---|---|---|---|---|")
        for rtt in (0.0, 1.0, 2.0, 5.0):
            for proxy in proxies:
                proxy.shape(delay=rtt / 2e3, rate=rate)
            naive_client = redis.RedisCluster(host="127.0.0.1", port=proxies[0].port)
            raws = {port: RawRedis(port=port) for port in shares}
            bufs = [memoryview(np.ones(SIZE, np.uint8)) for _ in keys]

            def raw_get() -> None:
                list(threads.map(lambda port: raws[port].get_many_into(
                    [keys[i].encode() for i in shares[port]], [bufs[i] for i in shares[port]]), shares))

            def raw_set() -> None:
                list(threads.map(lambda port: raws[port].set_many(
                    [(keys[i], values[i]) for i in shares[port]]), shares))

            naive = ms(lambda: [naive_client.get(k) for k in keys], reps)
            raw = (ms(raw_get, reps), ms(raw_set, reps))
            loads, saves = [], []
            for per_node in (1, 4):
                store = RedisClusterStore.from_url(f"redis+cluster://127.0.0.1:{proxies[0].port}"
                                                   f"?connections={3 * per_node}&adapt_writes=false&adapt_reads=false"
                                                   "&timeout=30s&write_timeout=30s")

                def load(store=store) -> None:
                    for lease in store.get_into(keys, pool):
                        assert lease is not None
                        lease.release()

                loads.append(ms(load, reps))
                saves.append(ms(lambda store=store: store.put_many(zip(keys, values)), reps))
                store.close()
            model = [rtt + largest * SIZE / (min(c, largest) * rate) * 1e3 for c in (1, 4)]
            print(f"| {rtt:.0f} | {naive:.1f} | {raw[0]:.1f} / {raw[1]:.1f} | "
                  f"{' / '.join(f'{t:.1f}' for t in loads)} | {' / '.join(f'{t:.1f}' for t in saves)} | "
                  f"{' / '.join(f'{t:.1f}' for t in model)} |", flush=True)
            for r in raws.values():
                r.close()
            naive_client.close()
        threads.shutdown()
    finally:
        for proxy in proxies:
            proxy.close()
        cluster.close()


def _announce(cluster: servers.RedisCluster, proxies: list[ShapedProxy]) -> None:
    """Make every node announce its proxy's port (its cluster bus stays where it is), and wait
    until every node's slot map says so."""
    for node, proxy in zip(cluster.nodes, proxies):
        with node.client() as c:
            c.config_set("cluster-announce-port", proxy.port)
            c.config_set("cluster-announce-bus-port", node.port + 10000)
    want = {proxy.port for proxy in proxies}

    def announced() -> bool:
        for node in cluster.nodes:
            with node.client() as c:
                if {entry[2][1] for entry in c.execute_command("CLUSTER SLOTS")} != want:
                    return False
        return True

    servers.wait_until(announced, 30, "the cluster's nodes announcing their proxies")


def _put_ms(port: int, options: str, keys: list[str], values: list[bytes], reps: int,
            warmup: int = 0) -> tuple[float, int]:
    """``put_many`` of the batch through a store of ``options``, after ``warmup`` untimed
    batches: milliseconds, and the write width the store settled at."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}?{options}&write_timeout=30s")
    try:
        for _ in range(warmup):
            store.put_many(zip(keys, values))
        return ms(lambda: store.put_many(zip(keys, values)), reps), store.describe()["write_connections"]
    finally:
        store.close()


if __name__ == "__main__":
    main()
