"""Put/get throughput of real chunk records through the Redis and S3 stores, against the raw
clients and the naive baselines, all in the same run on servers this script starts.

Records: a 32 MiB chunk (32 layers x K,V x 256 tokens x 8 KV heads x 128 head size, bf16) and a
3 MiB small-model chunk (24 layers x K,V x 256 tokens x 2 heads x 64), encoded with
``encode_record``. One "op" moves a prompt's worth of chunks (``--chunks``) in one batch.

Redis rows (one connection each, pipelined):
  store            RedisStore.put_many / get_many of the encoded records
  store+codec      encode_record (into a reused buffer) + put; get + decode_record (verified)
  raw default      redis-py pipeline SET/GET of the same bytes, default (hiredis) packer
  raw python-packer  same with redis-py's PythonRespSerializer (sends big values uncopied) and
                   1 MiB socket reads: the best raw redis-py found, the ceiling for the ratios
  naive torch.save one torch.save blob per chunk -> SET; GET -> torch.load
  naive per-layer  pickle.dumps per layer -> pipelined SETs; GETs -> pickle.loads
Redis Cluster rows (three primaries): the store's put_many and its reads by the client's pipeline
(get_many) and by get_into (every node at once, into pool leases), against a raw zero-copy client
per node on a thread each.
S3 rows: the store's parallel put_many/get_many, its get_into (values received into pool leases,
objects over ``part_size`` as parallel ranged GETs), raw boto3 put_object/get_object on the same
number of threads (default client config, and the tuned one the store uses), and torch.save ->
put_object / get_object -> torch.load.

Benchmark code only: the naive rows pickle and torch.load bytes they just wrote themselves.
Library code never does either.

    python benchmarks/bench_stores.py [--reps 5] [--only redis|cluster|s3]
"""

from __future__ import annotations

import argparse
import io
import pickle
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import gbps, machine, report

from kvstore.buffers import BufferPool
from kvstore.keys import Namespace, chunk_keys
from kvstore.record import decode_record, encode_record

SHAPES = {  # name: (layers, kv heads, head size, tokens)
    "32MiB": (32, 8, 128, 256),
    "3MiB": (24, 2, 64, 256),
}


class Chunks:
    """``n`` encoded records of one shape, their layers as tensors, and their keys."""

    def __init__(self, name: str, n: int) -> None:
        layers, heads, head, tokens = SHAPES[name]
        self.name, self.n = name, n
        self.ns = Namespace(model=f"bench-{name}", kv_dtype="bfloat16", layout="bench", block_size=16,
                            chunk_tokens=tokens, layer_end=layers)
        self.tokens = np.arange(tokens * n, dtype=np.uint32) % 32000
        self.chunks = chunk_keys(self.ns, self.tokens)
        self.shapes = [(2, tokens, heads, head)] * layers
        g = torch.Generator().manual_seed(0)
        self.kv = [torch.randn(layers, 2, tokens, heads, head, generator=g).to(torch.bfloat16) for _ in range(n)]
        # A per-layer engine cache holds each layer as its own tensor (pickling a view would
        # pickle the whole underlying storage).
        self.layers = [[layer.clone() for layer in kv] for kv in self.kv]
        self.records = [bytes(self.encode(i)) for i in range(n)]
        self.keys = [c.key for c in self.chunks]
        self.nbytes = sum(len(r) for r in self.records)
        self._buf = bytearray(len(self.records[0]) + 4096)

    def encode(self, i: int, out: bytearray | None = None) -> memoryview:
        c = self.chunks[i]
        return encode_record(namespace=self.ns, chunk=c, tokens=self.tokens[c.start:c.end], dtype="bfloat16",
                             shapes=self.shapes, kv=self.kv[i].view(torch.uint8).numpy().reshape(-1), out=out)

    def decode(self, i: int, value) -> None:
        c = self.chunks[i]
        decode_record(value, namespace=self.ns, chunk=c, tokens=self.tokens[c.start:c.end], dtype="bfloat16")


def versions() -> str:
    import boto3
    import hiredis
    import redis

    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    rclone = subprocess.run([servers.find_binary("rclone") or "rclone", "version"], capture_output=True,
                            text=True).stdout.split("\n")[0]
    return (f"redis-py {redis.__version__}, hiredis {hiredis.__version__}, redis-server {server}, "
            f"boto3 {boto3.__version__}, {rclone}, numpy {np.__version__}, {platform.platform()}")


class Table:
    """Paths measured round-robin: rep i of every path runs before rep i+1 of any, so load from
    other work on a shared machine hits every path alike (the ratios stay meaningful)."""

    def __init__(self, title: str, nbytes: int, setup=lambda: None) -> None:
        self.title, self.nbytes, self.rows, self.setup = title, nbytes, [], setup
        self.paths: list = []

    def add(self, name: str, put, get) -> None:
        self.paths.append((name, put, get))

    def run(self, reps: int) -> None:
        times = {name: ([], []) for name, _, _ in self.paths}
        for rep in range(reps + 1):  # rep 0 warms up
            for name, put, get in self.paths:
                self.setup()
                t = time.perf_counter()
                put()
                t_put = time.perf_counter() - t
                t = time.perf_counter()
                get()
                t_get = time.perf_counter() - t
                if rep:
                    times[name][0].append(t_put)
                    times[name][1].append(t_get)
        for name, _, _ in self.paths:
            self.rows.append((name, gbps(self.nbytes, times[name][0]), gbps(self.nbytes, times[name][1])))
            print(f"  {name:<28} put {self.rows[-1][1][0]:6.2f}  get {self.rows[-1][2][0]:6.2f} GB/s", flush=True)

    def render(self, ceiling: str) -> str:
        best = {r[0]: r for r in self.rows}[ceiling]
        lines = [f"### {self.title}", "",
                 f"GB/s, median [min-max]; ratio = median / `{ceiling}` median.", "",
                 "| path | put | put ratio | get | get ratio |", "|---|---|---|---|---|"]
        for name, put, get in self.rows:
            lines.append(f"| {name} | {put[0]:.2f} [{put[1]:.2f}-{put[2]:.2f}] | {put[0] / best[1][0]:.2f} "
                         f"| {get[0]:.2f} [{get[1]:.2f}-{get[2]:.2f}] | {get[0] / best[2][0]:.2f} |")
        return "\n".join(lines) + "\n"


def bench_redis(data: Chunks, reps: int) -> str:
    import redis
    from redis.connection import PythonRespSerializer

    from kvstore.stores.redis import RedisStore

    server = servers.RedisServer()
    try:
        table = Table(f"Redis, {data.n} x {data.name} records per op ({data.nbytes / 2**20:.0f} MiB)", data.nbytes,
                      setup=server.flushall)
        print(table.title, flush=True)
        items = list(zip(data.keys, data.records))

        store = RedisStore.from_url(server.url)
        table.add("store", lambda: store.put_many(items), lambda: store.get_many(data.keys))

        def put_codec() -> None:
            for i in range(data.n):
                store.put(data.keys[i], data.encode(i, out=data._buf))

        def get_codec() -> None:
            for i, v in enumerate(store.get_many(data.keys)):
                data.decode(i, v)

        table.add("store+codec (encode/verify)", put_codec, get_codec)

        def raw(client):
            def put() -> None:
                pipe = client.pipeline(transaction=False)
                for k, v in items:
                    pipe.set(k, v)
                pipe.execute()

            def get() -> None:
                pipe = client.pipeline(transaction=False)
                for k in data.keys:
                    pipe.get(k)
                pipe.execute()
            return put, get

        default = redis.Redis(port=server.port)
        put, get = raw(default)
        table.add("raw redis-py default", put, get)
        pool = redis.ConnectionPool(port=server.port, socket_read_size=1 << 20)
        packer_client = redis.Redis(connection_pool=pool)
        pool.connection_kwargs["command_packer"] = PythonRespSerializer(6000, redis.connection.Encoder("utf-8", "strict", False).encode)
        put, get = raw(packer_client)
        table.add("raw redis-py python-packer", put, get)

        def naive_save_put() -> None:
            for k, kv in zip(data.keys, data.kv):
                buf = io.BytesIO()
                torch.save(kv, buf)
                default.set(k, buf.getvalue())

        def naive_save_get() -> None:
            for k in data.keys:
                torch.load(io.BytesIO(default.get(k)))

        table.add("naive torch.save blob", naive_save_put, naive_save_get)

        def naive_layers_put() -> None:
            pipe = default.pipeline(transaction=False)
            for k, layers in zip(data.keys, data.layers):
                for i, layer in enumerate(layers):
                    pipe.set(f"{k}/{i}", pickle.dumps(layer))
            pipe.execute()

        def naive_layers_get() -> None:
            pipe = default.pipeline(transaction=False)
            for k, layers in zip(data.keys, data.layers):
                for i in range(len(layers)):
                    pipe.get(f"{k}/{i}")
            for v in pipe.execute():
                pickle.loads(v)

        table.add("naive per-layer pickle", naive_layers_put, naive_layers_get)
        table.run(reps)
        store.close()
        return table.render("raw redis-py python-packer")
    finally:
        server.close()


def bench_cluster(data: Chunks, reps: int) -> str:
    """A three-primary Redis Cluster: the store's reads against the client's pipeline and a raw
    zero-copy client per node (one thread each, all nodes at once: the ceiling)."""
    from concurrent.futures import ThreadPoolExecutor as Threads

    import redis

    from kvstore.stores.redis import RedisClusterStore
    from kvstore.stores.redis.raw import RawRedis

    cluster = servers.RedisCluster()
    try:
        table = Table(f"Redis Cluster (3 primaries), {data.n} x {data.name} records per op "
                      f"({data.nbytes / 2**20:.0f} MiB)", data.nbytes, setup=cluster.flushall)
        print(table.title, flush=True)
        items = list(zip(data.keys, data.records))
        store = RedisClusterStore.from_url(cluster.url)
        pool = BufferPool(256 << 20)

        def get_into() -> None:  # what a load does: every node at once, into pool leases
            for lease in store.get_into(data.keys, pool):
                assert lease is not None
                lease.release()

        table.add("store put_many / get_many (pipeline)", lambda: store.put_many(items),
                  lambda: store.get_many(data.keys))
        table.add("store put_many / get_into", lambda: store.put_many(items), get_into)
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        by_port: dict[int, list[int]] = {}
        for i, k in enumerate(data.keys):
            by_port.setdefault(client.get_node_from_key(k).port, []).append(i)
        raws = {port: RawRedis(port=port) for port in by_port}
        buffers = [memoryview(np.ones(len(r), dtype=np.uint8)) for r in data.records]
        threads = Threads(len(raws))

        def raw_put() -> None:
            list(threads.map(lambda p: raws[p].set_many([items[i] for i in by_port[p]]), by_port))

        def raw_get() -> None:
            list(threads.map(lambda p: raws[p].get_many_into([data.keys[i] for i in by_port[p]],
                                                             [buffers[i] for i in by_port[p]]), by_port))

        table.add("raw zero-copy, a thread per node", raw_put, raw_get)
        table.run(reps)
        store.close()
        threads.shutdown()
        return table.render("raw zero-copy, a thread per node")
    finally:
        cluster.close()


def bench_s3(data: Chunks, reps: int) -> str:
    import boto3
    from botocore.config import Config

    from kvstore.stores.s3 import S3Store

    server = servers.S3Server()
    env = servers.s3_env()
    import os

    os.environ.update(env)
    try:
        table = Table(f"S3 (rclone serve s3), {data.n} x {data.name} records per op "
                      f"({data.nbytes / 2**20:.0f} MiB)", data.nbytes, setup=server.clear)
        print(table.title, flush=True)
        items = list(zip(data.keys, data.records))
        store = S3Store.from_url(server.url_for("bench"))
        table.add("store", lambda: store.put_many(items), lambda: store.get_many(data.keys))
        pool = BufferPool(256 << 20)

        def get_into() -> None:  # what a load does: values into pool leases, large ones in ranged parts
            for lease in store.get_into(data.keys, pool):
                assert lease is not None
                lease.release()

        table.add("store get_into", lambda: store.put_many(items), get_into)
        threads = ThreadPoolExecutor(min(16, data.n))

        def raw(config: Config):
            client = boto3.client("s3", endpoint_url=server.endpoint_url, config=config)

            def put() -> None:
                list(threads.map(lambda kv: client.put_object(Bucket=server.bucket, Key="raw/" + kv[0], Body=kv[1]),
                                 items))

            def get() -> None:
                list(threads.map(lambda k: client.get_object(Bucket=server.bucket, Key="raw/" + k)["Body"].read(),
                                 data.keys))
            return client, put, get

        _, put, get = raw(Config(s3={"addressing_style": "path"}, max_pool_connections=16))
        table.add("raw boto3 default", put, get)
        tuned = Config(s3={"addressing_style": "path", "payload_signing_enabled": False}, max_pool_connections=16,
                       request_checksum_calculation="when_required", response_checksum_validation="when_required")
        client, put, get = raw(tuned)
        table.add("raw boto3 tuned", put, get)

        def naive_put() -> None:
            for k, kv in zip(data.keys, data.kv):
                buf = io.BytesIO()
                torch.save(kv, buf)
                client.put_object(Bucket=server.bucket, Key="naive/" + k, Body=buf.getvalue())

        def naive_get() -> None:
            for k in data.keys:
                torch.load(io.BytesIO(client.get_object(Bucket=server.bucket, Key="naive/" + k)["Body"].read()))

        table.add("naive torch.save blob", naive_put, naive_get)
        table.run(reps)
        store.close()
        threads.shutdown()
        return table.render("raw boto3 tuned")
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=("redis", "cluster", "s3"))
    parser.add_argument("--out", help="also write the tables (markdown) here")
    args = parser.parse_args()
    header = f"machine: {machine()}\nversions: {versions()}\n"
    print(header)
    sections = []
    plans = [("redis", "32MiB", 4), ("redis", "3MiB", 16), ("cluster", "32MiB", 6), ("cluster", "3MiB", 16),
             ("s3", "32MiB", 4), ("s3", "3MiB", 16)]
    benches = {"redis": bench_redis, "cluster": bench_cluster, "s3": bench_s3}
    for backend, shape, n in plans:
        if args.only and backend != args.only:
            continue
        data = Chunks(shape, n)
        sections.append(benches[backend](data, args.reps))
        del data
    text = header + "\n" + "\n".join(sections)
    report(text, args.out)


if __name__ == "__main__":
    main()
