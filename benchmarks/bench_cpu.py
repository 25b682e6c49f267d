"""CPU seconds per GB of a load, per backend, against the same backend's raw read in the same
run, and the read path before and after hashing on arrival (issue 24, item 3).

What one op moves: ``--chunks`` records of 32 MiB of KV (256 tokens of a Llama-3-8B-shaped model:
32 layers, K and V, 8 KV heads of 128, bf16), loaded by ``PrefixCache.load`` (records received
into pooled buffers, verified, copied into a resident destination by the sink, as in
bench_peer_lmcache.py). Paths, round-robin per round:

  raw                 the backend's bytes into preallocated, touched buffers and nothing else:
                      Redis: the raw zero-copy client (64 MiB of GETs ahead); file: ``readinto``
                      of each file; S3: boto3 ``get_object`` of each object, ``readinto``
  raw + copy          the same, then each record's KV bytes copied into the destination
                      (``np.copyto``, as the load's sink does): placement without verification
  kvstore load        ``PrefixCache.load`` as shipped: every backend here hashes each value as
                      it arrives (``Lease.digest``) and the decoder compares digests
  kvstore load, no host copy (CUDA)  the same with a sink that copies nothing on the CPU: on a
                      CUDA engine the verified (pinned) lease goes to the device by DMA, so this is
                      the host CPU such an engine pays
  kvstore, hash again the same load with each lease's digest dropped, so the decoder hashes the
                      record in a pass of its own: how the S3 reader worked before this change
                      (and what the Redis reader's arrival hash saves)
  kvstore, file before file only: the store's generic ``get_into`` (``get`` -> ``bytes``,
                      borrowed, no digest): how the file store read before this change

CPU s/GB: this process's user+system time (``getrusage(RUSAGE_SELF)``, every thread) over the
timed calls, per GB of KV; servers (redis-server, rclone) are not counted. GB/s = 10^9 bytes of
KV per second. Median [min-max] of ``--reps`` rounds after a warm-up.

    python benchmarks/bench_cpu.py [--reps 5] [--chunks 8] [--only redis,file,s3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import cpu_self, machine, memory_limits, raw_get_window, raw_window

from kvstore.buffers import BufferPool
from kvstore.keys import Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores import open_store
from kvstore.stores.base import LeaseStream, Place, Store, WrapperStore
from kvstore.stores.redis.raw import RawRedis

LAYERS, HEADS, HEAD, TOKENS = 32, 8, 128, 256


class HashAgain(WrapperStore):
    """The inner store's ``get_into`` with every lease's digest dropped: the decoder hashes."""

    def get_into(self, keys, pool: BufferPool, place: Place | None = None) -> LeaseStream:
        for lease in self.inner.get_into(keys, pool):
            if lease is not None:
                lease.digest = None
            yield lease


class GenericRead(WrapperStore):
    """The store contract's default ``get_into`` over the inner store's ``get_many``."""

    def get_into(self, keys, pool: BufferPool, place: Place | None = None) -> LeaseStream:
        return Store.get_into(self.inner, keys, pool)


class Load:
    """PrefixCache save (untimed) and load of ``n`` chunks over one store."""

    def __init__(self, store: Store, n: int, dest: np.ndarray, kv: np.ndarray, tokens: np.ndarray) -> None:
        self.ns = Namespace(model="bench-cpu", kv_dtype="bfloat16", layout="bench", block_size=16,
                            chunk_tokens=TOKENS, layer_end=LAYERS)
        self.store, self.n, self.dest, self.kv, self.tokens = store, n, dest, kv, tokens
        self.shapes = [(2, TOKENS, HEADS, HEAD)] * LAYERS
        self.cache = PrefixCache(store, self.ns)
        self.keys = self.cache.keys(tokens)
        self.cache.save(tokens, self.keys, lambda c: ChunkPayload(shapes=self.shapes, kv=kv[c.index]),
                        skip_stored=False)
        store.flush(60)

    def over(self, store: Store, *, copy: bool = True) -> Callable[[], None]:
        cache = PrefixCache(store, self.ns)

        def sink(chunk, record) -> None:
            if copy:
                np.copyto(self.dest[chunk.index], np.frombuffer(record.kv, dtype=np.uint8))

        def load() -> None:
            result = cache.load(self.tokens, self.keys, sink, shapes=lambda c: self.shapes)
            assert result.num_chunks == self.n, (result.num_chunks, result.reason)
        return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--only", default="redis,file,s3")
    parser.add_argument("--json")
    parser.add_argument("--saves", action="store_true",
                        help="measure saves into one redis-server instead of loads (see save_paths)")
    args = parser.parse_args()
    print(machine(), flush=True)
    print(f"memory: {memory_limits()}", flush=True)
    g = torch.Generator().manual_seed(0)
    kv_t = torch.randn(args.chunks, LAYERS * 2 * TOKENS * HEADS * HEAD, generator=g).to(torch.bfloat16)
    kv = kv_t.view(torch.uint8).numpy()
    dest = np.ones_like(kv)
    tokens = (np.arange(TOKENS * args.chunks, dtype=np.uint32) * 7919 + 11) % 32000
    nbytes = kv.nbytes
    results = {}
    if args.saves:
        with Backend("redis") as b:
            store = open_store(b.url)
            load = Load(store, args.chunks, dest, kv, tokens)
            results["redis saves"] = measure("redis saves", save_paths(b, store, load, kv), nbytes, args.reps)
            store.close()
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
        return
    for backend in args.only.split(","):
        with Backend(backend) as b:
            store = open_store(b.url)
            load = Load(store, args.chunks, dest, kv, tokens)
            records = [bytes(v) for v in store.get_many([k.key for k in load.keys])]
            size = len(kv[0])
            buffers = [np.ones(len(r), dtype=np.uint8) for r in records]
            raw = b.raw([k.key for k in load.keys], buffers)

            def raw_copy(raw=raw, buffers=buffers) -> None:
                raw()
                for i, buf in enumerate(buffers):
                    np.copyto(dest[i], buf[len(buf) - 8 - size:len(buf) - 8])

            paths = {"raw": raw, "raw + copy": raw_copy, "kvstore load": load.over(store),
                     "kvstore load, no host copy (CUDA)": load.over(store, copy=False),
                     "kvstore, hash again": load.over(HashAgain(store))}
            if backend == "file":
                paths["kvstore, file before (generic get_into)"] = load.over(GenericRead(store))
            results[backend] = measure(backend, paths, nbytes, args.reps)
            store.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


def save_paths(b: Backend, store: Store, load: Load, kv: np.ndarray) -> dict[str, Callable[[], None]]:
    """Saves of the same records into one redis-server, every chunk written each time:

      raw                 the raw client's pipelined SETs of the encoded records (bytes ready)
      raw + copy          the same after copying each chunk's KV into a resident buffer first
                          (the gather a CPU engine does out of its paged cache)
      kvstore save        PrefixCache.save of KV already resident (a CUDA engine's: the device
                          gathers, and a DMA lands the bytes in a pinned lease): encode the header,
                          hash the record as it is sent, send
      kvstore save + copy the same with each chunk copied into a pool lease first (a CPU engine's)
    """
    client = RawRedis(port=b._server.port)
    records = [bytes(v) for v in store.get_many([k.key for k in load.keys])]
    staged = np.empty_like(kv)
    cache = PrefixCache(store, load.ns)

    def raw() -> None:
        client.set_many(zip([k.key for k in load.keys], records))

    def raw_copy() -> None:
        np.copyto(staged, kv)
        raw()

    def save(copy: bool) -> Callable[[], None]:
        def fn() -> None:
            if copy:
                np.copyto(staged, kv)
            source = staged if copy else kv
            assert cache.save(load.tokens, load.keys, lambda c: ChunkPayload(shapes=load.shapes, kv=source[c.index]),
                              skip_stored=False) == load.n
        return fn

    return {"raw": raw, "raw + copy": raw_copy, "kvstore save": save(False), "kvstore save + copy": save(True)}


def measure(backend: str, paths: dict[str, Callable[[], None]], nbytes: int, reps: int) -> dict:
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu = {p: 0.0 for p in paths}
    loads = [os.getloadavg()[0]]
    for rep in range(reps + 1):
        for name, fn in paths.items():
            c = cpu_self()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            dc = cpu_self() - c
            if rep:
                times[name].append(dt)
                cpu[name] += dc
        loads.append(os.getloadavg()[0])
    gb = nbytes / 1e9
    rates = {p: sorted(gb / t for t in ts) for p, ts in times.items()}
    per_gb = {p: c / (reps * gb) for p, c in cpu.items()}
    print(f"\n{backend}: {nbytes / 2**20:.0f} MiB of KV per op; load average {min(loads):.2f}-{max(loads):.2f}\n")
    print("| path | GB/s | CPU s/GB | CPU x raw | CPU x raw + copy |")
    print("|---|---|---|---|---|")
    for p, r in rates.items():
        print(f"| {p} | {statistics.median(r):.2f} [{r[0]:.2f}-{r[-1]:.2f}] | {per_gb[p]:.3f} | "
              f"{per_gb[p] / per_gb['raw']:.2f} | {per_gb[p] / per_gb['raw + copy']:.2f} |", flush=True)
    return {"rates": rates, "cpu_s_per_gb": per_gb, "loads": loads}


class Backend:
    """A real server (or directory) for one backend, its store URL and its raw reader."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._server = None
        self._dir = None

    def __enter__(self) -> Backend:
        if self.kind == "redis":
            self._server = servers.RedisServer()
            self.url = self._server.url
        elif self.kind == "file":
            self._dir = tempfile.mkdtemp(prefix="bench-cpu-")
            self.url = f"file://{self._dir}"
        elif self.kind == "s3":
            os.environ.update(servers.s3_env())  # boto3's chain, isolated from ~/.aws
            self._server = servers.S3Server()
            self.url = self._server.url_for("bench-cpu")
        else:
            raise SystemExit(f"unknown backend {self.kind}")
        return self

    def raw(self, keys: list[str], buffers: list[np.ndarray]) -> Callable[[], None]:
        views = [memoryview(b) for b in buffers]
        if self.kind == "redis":
            client = RawRedis(port=self._server.port)
            window = raw_window(max(len(b) for b in buffers))
            return lambda: raw_get_window(client, keys, views, window)
        if self.kind == "file":
            store = open_store(self.url)
            paths = [store._path(k) for k in keys]

            def read_files() -> None:
                for path, view in zip(paths, views):
                    with open(path, "rb", buffering=0) as f:
                        f.readinto(view)
            return read_files
        store = open_store(self.url)
        client, bucket, prefix = store._client, store.config.bucket, store.config.prefix

        def read_objects() -> None:
            for key, view in zip(keys, views):
                body = client.get_object(Bucket=bucket, Key=prefix + key)["Body"]
                done = 0
                while done < len(view):
                    done += body.readinto(view[done:])
                body.close()
        return read_objects

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    main()
