"""kvstore against its peer, LMCache 0.5.6, on one redis-server, in the same run.

Not part of the test suite, and LMCache is never a dependency of kvstore: this script runs with
a separate virtual environment that has both installed (the project's own venv stays clean).

Setting up the peer venv (Python 3.11, about 5 minutes; LMCache's CUDA packages are never
installed, its CPU standalone mode does not load them)::

    python3 -m venv /tmp/peer-venv
    P=/tmp/peer-venv/bin/pip
    $P install torch==2.13.0 numpy==2.3.5 msgpack lz4 xxhash redis hiredis
    $P install --no-deps lmcache==0.5.6
    $P install sortedcontainers aiofile aiofiles caio nvtx awscrt pyyaml requests aiohttp msgspec \
        psutil py-cpuinfo pyzmq "prometheus_client<=0.24.1" fastapi uvicorn httpx safetensors blake3 \
        cachetools "opentelemetry-api<=1.40.0" opentelemetry-sdk cryptography \
        numba==0.65.0 llvmlite==0.47.0 transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0
    $P install --no-deps -e .          # kvstore itself, from the repository root
    /tmp/peer-venv/bin/python benchmarks/bench_peer_lmcache.py [--reps 7] [--only 32MiB|3MiB]

(pip warns that lmcache wants numpy<=2.2.6, setuptools<81, cupy, cufile...: not needed here.
numpy 2.3.5, numba and transformers are pinned to the versions of the project venv.)

What one op moves: 16 chunks of 256 tokens of bf16 KV, either 32 MiB chunks (32 layers x K,V x
8 KV heads x 128) or 3 MiB chunks (24 layers x K,V x 2 heads x 64). Paths, measured round-robin
(rep i of every path runs before rep i+1 of any; the server is flushed before each path's store):

  LMCache redis://   LMCacheEngine (CPU standalone: mock GPU connector, local_cpu=False so the
                     CPU backend is only its allocator, remote_url=redis://, naive serde) store()
                     until its background batched put has finished; retrieve() of all tokens
  LMCache resp://    the same with its C++ RESP client (8 threads)
  raw zero-copy      the physical ceiling: one connection, pipelined SETs sent straight from the
                     encoded records, pipelined GETs received (recv_into) into preallocated,
                     touched buffers, as many requested ahead as kvstore's reads keep
                     (``common.raw_window``); no validation, no copy (kvstore/stores/redis/raw.py).
                     Asked for all 16 x 32 MiB at once, the server spent 1.16-1.36 CPU s per GB
                     building the replies instead of 0.82 (measured side by side in one run,
                     benchmarks/results/tiers.md): the ceiling ran at 0.66 GB/s and kvstore read
                     as 1.5x it. Each round the same client also reads the records from a
                     process of its own (``StandaloneRaw``), stored again first: the ceiling's
                     check. Every retrieve here is the first read after its path's store; a
                     second read of the same records runs faster (3 MiB: 2.96 against 2.24 GB/s
                     for the standalone client, peer_lmcache.md run 12), so the check reads in
                     the same place
  raw + copy         the raw client's retrieve, then each record's KV bytes copied into the
                     destination (``np.copyto``, as kvstore's load sink does): the CPU a raw client
                     spends to place the bytes where a load does, without verifying them (its store
                     is the raw client's)
  raw + xxh3         the raw client plus one xxh3 pass over each value, before its SET and after its
                     GET (``RawPathChecksum``): the least a client that checksums what it stores pays
                     (kvstore hashes each slice as it is sent or lands, not in a pass of its own)
  raw, 4 connections the same client over kvstore's 4 connections, a thread and every 4th record
                     each (``RawPathSpread``): the ceiling of a client with four connections
  kvstore cache      PrefixCache.save (lookup to skip stored chunks, xxh3 over the payload, the
                     header sent beside the payload, no copy; one batch over as many of the
                     store's connections as it learned pay, after ``ADAPT_WARMUP`` untimed
                     batches) / PrefixCache.load (each record's header received and checked
                     (namespace, key, token ids, dtype, shapes), its KV landed straight in a
                     preallocated tensor, its checksum checked as its last byte arrives, while
                     the next ones arrive)
  ... from leases    the same load with no ``land``: records received into pooled buffers, each
                     verified there, then copied into the tensor
  ... 1 connection   the same save and load over a RedisStore of ``connections=1``: no width
                     to learn, no probes
  kvstore store      bare RedisStore.put_many / get_many of the same encoded records

Lookups of the 16 stored chunks: LMCache ``engine.lookup(tokens)`` (token hashing included);
kvstore ``PrefixCache.keys(tokens)`` + ``lookup(keys)`` (chunk hashing included), and ``lookup``
alone (one pipelined EXISTS round trip).

LMCache 0.5.6's ``resp://`` lookups can hang forever (a race in its native client wrapper, see
``_fix_lmcache_resp_sync_race``): this script patches that race before building any engine.

Then a verification contrast: one stored chunk's value is overwritten in Redis with random bytes of
the same length, and each path retrieves again.

LMCache's standalone mode copies nothing from or to a KV cache (its mock connector's
from_gpu/to_gpu do nothing), so its store sends whatever its allocator buffers hold and its
retrieve ends when the bytes are in its buffers. kvstore's save includes hashing (the KV is the
record's payload as it is), and its load the verification, with the bytes landed in the
destination tensor (from leases: plus a copy into it).

CPU s/GB beside every GB/s figure: this process's user+system time (``getrusage(RUSAGE_SELF)``,
every thread, LMCache's included) over each timed store and retrieve, per GB of KV, the median
round's (a round the shared machine slowed down does not move it); the redis-server's is not
counted. The standalone raw client's is its own process's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its per-op INFO lines cost time

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import servers
from common import cpu_self, machine, memory_limits, raw_get_window, raw_window

from kvstore.errors import CorruptRecordError
from kvstore.keys import Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import decode_record
from kvstore.stores.redis import RedisStore
from kvstore.stores.redis.raw import RawRedis

N_CHUNKS = 16
SHAPES = {  # name: (layers, kv heads, head size, tokens per chunk)
    "32MiB": (32, 8, 128, 256),
    "3MiB": (24, 2, 64, 256),
}
LOOKUP_REPS = 15  # lookups per path per round
# Untimed save+load batches of the default store before round 0. Its widths are learned
# (``adapt_writes``, ``adapt_reads``): a young store probes a wider width every 2, 4, 8...
# batches, a long-running one every 64 at most. The rounds measure the long-running engine.
ADAPT_WARMUP = 40


class Data:
    """The KV of ``N_CHUNKS`` chunks of one shape, its tokens, and a destination for loads."""

    def __init__(self, name: str) -> None:
        layers, heads, head, tokens = SHAPES[name]
        self.name, self.layers, self.heads, self.head, self.tokens_per_chunk = name, layers, heads, head, tokens
        self.n = N_CHUNKS
        g = torch.Generator().manual_seed(0)
        self.kv = torch.randn(self.n, layers, 2, tokens, heads, head, generator=g).to(torch.bfloat16)
        self.kv_u8 = self.kv.view(torch.uint8).numpy().reshape(self.n, -1)
        self.chunk_bytes = self.kv_u8.shape[1]
        self.nbytes = self.n * self.chunk_bytes
        self.token_ids = (np.arange(tokens * self.n, dtype=np.uint32) * 7919 + 11) % 32000
        self.shapes = [(2, tokens, heads, head)] * layers
        self.dest = np.ones_like(self.kv_u8)  # touched: loads write into resident memory


# -- LMCache ------------------------------------------------------------------------------------
def _fix_lmcache_resp_sync_race() -> None:
    """Close a race in LMCache 0.5.6's native RESP client wrapper (``resp://``) that hangs lookups.

    ``ConnectorClientBase.batch_exists_sync`` (and the other ``*_sync`` calls) submit to the C++
    client first and register their future afterwards, from the caller's thread. If the event-loop
    thread drains the completion in between, ``_on_ready`` finds no entry, drops the completion,
    and ``fut.result()`` (no timeout) waits forever. Seen here after a few hundred ``lookup`` calls
    on 2 cores. The fix: a completion that arrives before its future is kept, and registration
    takes it under a lock. It adds one uncontended lock per completion.
    """
    import concurrent.futures

    from lmcache.v1.storage_backend.native_clients import connector_client_base as ccb

    base = ccb.ConnectorClientBase
    lock = threading.Lock()

    def resolve(entry, item) -> None:
        fut, op = entry[0], entry[1]
        _, ok, error, result_bools = item
        if fut.done():
            return
        if not ok:
            fut.set_exception(RuntimeError(str(error)))
        elif op == "exists":
            fut.set_result(bool(result_bools[0]) if result_bools else False)
        elif op == "batch_exists":
            fut.set_result(list(result_bools) if result_bools is not None else [])
        else:
            fut.set_result(None)

    def _on_ready(self) -> None:
        if self._closed:
            return
        early = self.__dict__.setdefault("_early_completions", {})
        try:
            while True:
                items = self._client.drain_completions()
                if not items:
                    return
                for item in items:
                    with lock:
                        entry = self._pending.pop(int(item[0]), None)
                        if entry is None:
                            early[int(item[0])] = item
                            continue
                    resolve(entry, item)
        except Exception as e:  # as the original: the native layer is broken
            self._fail_all(RuntimeError(f"native drain_completions failed: {e}"))
            self._shutdown_native(best_effort=True)

    def _register_future_sync(self, op, future_id, keepalive=()):
        fut = concurrent.futures.Future()
        with lock:
            item = self.__dict__.setdefault("_early_completions", {}).pop(int(future_id), None)
            if item is None:
                self._pending[int(future_id)] = (fut, op, keepalive)
                return fut
        resolve((fut, op), item)
        return fut

    base._on_ready = _on_ready
    base._register_future_sync = _register_future_sync


class LMCachePath:
    """One LMCacheEngine in CPU standalone mode whose remote backend is ``url``."""

    def __init__(self, scheme: str, port: int, data: Data) -> None:
        from lmcache.utils import EngineType, mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import CreateGPUConnector
        from lmcache.v1.metadata import LMCacheMetadata

        self.name = f"LMCache {scheme}://"
        self.data = data
        instance = f"bench-{scheme}-{data.name}"
        # Room for a store's and a retrieve's buffers at once, plus slack.
        cpu_gb = 2.5 * data.nbytes / 2**30 + 0.1
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=data.tokens_per_chunk, local_cpu=False, max_local_cpu_size=cpu_gb,
            remote_url=f"{scheme}://127.0.0.1:{port}", remote_serde="naive", save_unfull_chunk=False,
            lmcache_instance_id=instance)
        kv_shape = (data.layers, 2, data.tokens_per_chunk, data.heads, data.head)
        metadata = LMCacheMetadata(model_name=f"bench-{data.name}", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=kv_shape, use_mla=False,
                                   role="worker")
        self.connector = CreateGPUConnector(self.config, metadata, EngineType.MOCK)
        self.engine = LMCacheEngineBuilder.get_or_create(instance, self.config, metadata, self.connector,
                                                         mock_up_broadcast_fn, mock_up_broadcast_object_fn)
        self.engine.post_init()
        backend = self.engine.storage_manager.storage_backends["RemoteBackend"]
        # store() only queues the put on the backend's event loop; wrap the connection's batched
        # put to learn when the data is in Redis (store time = call + background put).
        conn = backend.connection
        self._put_done = threading.Event()
        original = conn.batched_put

        async def batched_put(keys, memory_objs):
            try:
                await original(keys, memory_objs)
            finally:
                self._put_done.set()

        conn.batched_put = batched_put
        self.tokens = torch.from_numpy(data.token_ids.astype(np.int64))
        self.captured: dict[int, bytes] | None = None  # start token -> bytes, for the noise test
        original_to_gpu = self.connector.batched_to_gpu

        def batched_to_gpu(memory_objs, starts, ends, **kwargs):
            if self.captured is not None:
                for obj, start in zip(memory_objs, starts):
                    self.captured[start] = bytes(memoryview(obj.byte_array).cast("B"))
            return original_to_gpu(memory_objs, starts, ends, **kwargs)

        self.connector.batched_to_gpu = batched_to_gpu

    def store(self) -> None:
        self._put_done.clear()
        self.engine.store(tokens=self.tokens)
        if not self._put_done.wait(60):
            raise TimeoutError(f"{self.name}: store did not finish")

    def retrieve(self) -> int:
        return int(self.engine.retrieve(self.tokens).sum())

    def get(self) -> None:
        got = self.retrieve()
        assert got == len(self.tokens), f"{self.name} retrieved {got} of {len(self.tokens)} tokens"

    def lookup(self) -> None:
        got = self.engine.lookup(self.tokens)
        assert got == len(self.tokens), f"{self.name} lookup found {got} tokens"



# -- kvstore ------------------------------------------------------------------------------------
class KVStorePath:
    """PrefixCache save/load over a RedisStore, and the bare store calls on the same records."""

    def __init__(self, url: str, data: Data) -> None:
        self.data = data
        self.ns = Namespace(model=f"bench-{data.name}", kv_dtype="bfloat16", layout="bench", block_size=16,
                            chunk_tokens=data.tokens_per_chunk, layer_end=data.layers)
        self.store = RedisStore.from_url(url)
        self.cache = PrefixCache(self.store, self.ns)
        self.keys = self.cache.keys(data.token_ids)
        shapes = data.shapes
        self._payloads = [ChunkPayload(shapes=shapes, kv=data.kv_u8[i]) for i in range(data.n)]
        self._shapes = lambda chunk: shapes
        # The bare rows move the records PrefixCache writes (encoded once, untimed).
        self.cache.save(data.token_ids, self.keys, self._payload, skip_stored=False)
        self.records = [bytes(v) for v in self.store.get_many([k.key for k in self.keys])]
        self.items = list(zip([k.key for k in self.keys], self.records))
        self.record_bytes = sum(len(r) for r in self.records)

    def _payload(self, chunk) -> ChunkPayload:
        return self._payloads[chunk.index]

    def _sink(self, chunk, record) -> None:
        if not record.landed:
            np.copyto(self.data.dest[chunk.index], np.frombuffer(record.kv, dtype=np.uint8))

    def _land(self, chunk) -> list[memoryview]:
        return [memoryview(self.data.dest[chunk.index])]

    def save(self) -> None:
        n = self.cache.save(self.data.token_ids, self.keys, self._payload)
        assert n == self.data.n, f"saved {n} chunks"

    def load(self, land: bool = True):
        return self.cache.load(self.data.token_ids, self.keys, self._sink, shapes=self._shapes,
                               land=self._land if land else None)

    def get(self) -> None:
        result = self.load()
        assert result.num_chunks == self.data.n, f"loaded {result.num_chunks} chunks ({result.reason})"

    def get_leased(self) -> None:
        result = self.load(land=False)
        assert result.num_chunks == self.data.n, f"loaded {result.num_chunks} chunks ({result.reason})"

    def put_bare(self) -> None:
        self.store.put_many(self.items)

    def get_bare(self) -> None:
        values = self.store.get_many([k for k, _ in self.items])
        assert all(v is not None for v in values)

    def lookup(self) -> None:
        keys = self.cache.keys(self.data.token_ids)
        assert self.cache.lookup(keys) == self.data.n

    def lookup_only(self) -> None:
        assert self.cache.lookup(self.keys) == self.data.n


class RawPath:
    """The ceiling: the same records through a raw zero-copy client (see ``kvstore.stores.redis.raw``)."""

    def __init__(self, port: int, kv: KVStorePath) -> None:
        self.client = RawRedis(port=port)
        self.items = [(k.encode(), memoryview(v)) for k, v in kv.items]
        self.buffers = [memoryview(np.ones(len(v), dtype=np.uint8)) for _, v in kv.items]  # touched
        self.window = raw_window(max(len(v) for _, v in kv.items))

    def put(self) -> None:
        self.client.set_many(self.items)

    def get(self) -> None:
        raw_get_window(self.client, [k for k, _ in self.items], self.buffers, self.window)  # raises on a miss


class RawPathCopy(RawPath):
    """The raw client, then each record's KV bytes copied into the destination (``np.copyto``,
    as kvstore's load sink does): what a raw client pays to put the bytes where a load puts them,
    without verifying them. The same connection and records as ``RawPath``."""

    def __init__(self, raw: RawPath, data: Data) -> None:
        self.client, self.items, self.buffers, self.window = raw.client, raw.items, raw.buffers, raw.window
        self.dest = data.dest
        size = data.chunk_bytes
        # A record's KV bytes sit just before its 8-byte checksum trailer: the copy reads the
        # same bytes kvstore's sink reads.
        self.sources = [np.frombuffer(b, dtype=np.uint8)[len(b) - 8 - size:len(b) - 8] for b in raw.buffers]

    def get(self) -> None:
        super().get()
        for i, src in enumerate(self.sources):
            np.copyto(self.dest[i], src)


class RawPathChecksum(RawPath):
    """The raw client plus one xxh3 pass over each value (all but its 8-byte trailer: what a
    record's checksum covers): the least a client that checksums what it stores pays on top of
    the raw one. Hashed in a pass of its own, before the SETs and after the GETs; kvstore hashes
    each slice as it is sent or lands instead. The same connection and records as ``RawPath``."""

    def __init__(self, raw: RawPath) -> None:
        self.client, self.items, self.buffers, self.window = raw.client, raw.items, raw.buffers, raw.window
        self.digests: list[bytes] = []

    def put(self) -> None:
        self.digests = [xxhash.xxh3_64_digest(v[:len(v) - 8]) for _, v in self.items]
        super().put()

    def get(self) -> None:
        super().get()
        self.digests = [xxhash.xxh3_64_digest(b[:len(b) - 8]) for b in self.buffers]


class RawPathSpread(RawPath):
    """The raw client over as many connections as kvstore's RedisStore uses (``connections``,
    4), each with a thread of its own and every n-th record: redis 7.0 without ``maxmemory``
    stops writing to a connection once a pass of its event loop has sent it more than 64 KiB
    (``NET_MAX_WRITES_PER_EVENT``), so one connection is no ceiling for a client with four."""

    def __init__(self, port: int, kv: KVStorePath, n: int) -> None:
        super().__init__(port, kv)
        self.client.close()
        self.clients = [RawRedis(port=port) for _ in range(n)]
        self.window = raw_window(max(len(v) for _, v in kv.items), n)
        self.pool = ThreadPoolExecutor(n)

    def _each(self, fn) -> None:
        n = len(self.clients)
        for fut in [self.pool.submit(fn, c, r, n) for r, c in enumerate(self.clients)]:
            fut.result()

    def put(self) -> None:
        self._each(lambda c, r, n: c.set_many(self.items[r::n]))

    def get(self) -> None:
        self._each(lambda c, r, n: raw_get_window(c, [k for k, _ in self.items[r::n]], self.buffers[r::n],
                                                  self.window))

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.pool.shutdown()


class StandaloneRaw:
    """The raw client of ``RawPath`` in a process of its own (no LMCache, none of this script's
    buffers), reading the records ``RawPath`` put: the check that the in-process ceiling runs at
    the speed of a raw client alone. Each ``get`` returns the
    seconds and the CPU seconds the child measured."""

    _CHILD = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from common import cpu_self, raw_get_window
from kvstore.stores.redis.raw import RawRedis
port, window, keys, sizes = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5].split(",")
client = RawRedis(port=port)
buffers = [memoryview(np.ones(int(n), dtype=np.uint8)) for n in sizes]
for _ in sys.stdin:
    c = cpu_self()
    t = time.perf_counter()
    raw_get_window(client, keys, buffers, window)
    print(time.perf_counter() - t, cpu_self() - c, flush=True)
"""

    def __init__(self, port: int, raw: RawPath) -> None:
        keys = ",".join(k.decode() for k, _ in raw.items)
        sizes = ",".join(str(len(v)) for _, v in raw.items)
        self.proc = subprocess.Popen([sys.executable, "-c", self._CHILD, str(Path(__file__).resolve().parent),
                                      str(port), str(raw.window), keys, sizes],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def get(self) -> tuple[float, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("get\n")
        self.proc.stdin.flush()
        wall, cpu = self.proc.stdout.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


# -- measuring ----------------------------------------------------------------------------------
def stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


RAW = "raw zero-copy client"
RAW4 = "raw zero-copy client, 4 connections"
RAWC = "raw zero-copy client + copy into the destination"
RAWH = "raw zero-copy client + xxh3 of each value"
KV_CACHE = "kvstore PrefixCache save/load"
KV_LEASED = "kvstore PrefixCache, loads from leases (no land)"
KV_ONE = "kvstore PrefixCache save/load, 1 connection"
KV_STORE = "kvstore RedisStore put_many/get_many"
LM_RESP, LM_REDIS = "LMCache resp://", "LMCache redis://"


def run_size(name: str, server: servers.RedisServer, reps: int, results: dict, peer: bool) -> None:
    import redis

    data = Data(name)
    raw = redis.Redis(port=server.port)
    raw.flushall()
    lm = {scheme: LMCachePath(scheme, server.port, data) for scheme in ("redis", "resp")} if peer else {}
    kv = KVStorePath(server.url, data)
    ceiling = RawPath(server.port, kv)
    standalone = StandaloneRaw(server.port, ceiling)
    alone_t: list[float] = []
    alone_cpu: list[float] = []
    # name: (put, get, lookups {label: fn})
    spread = RawPathSpread(server.port, kv, kv.store.config.connections)
    copying = RawPathCopy(ceiling, data)
    checksumming = RawPathChecksum(ceiling)
    paths = {RAW: (ceiling.put, ceiling.get, {}), RAWC: (ceiling.put, copying.get, {}),
             RAWH: (checksumming.put, checksumming.get, {}), RAW4: (spread.put, spread.get, {})}
    if peer:
        paths[LM_REDIS] = (lm["redis"].store, lm["redis"].get, {"LMCache redis:// lookup": lm["redis"].lookup})
        paths[LM_RESP] = (lm["resp"].store, lm["resp"].get, {"LMCache resp:// lookup": lm["resp"].lookup})
    paths[KV_CACHE] = (kv.save, kv.get, {"kvstore keys+lookup": kv.lookup, "kvstore lookup": kv.lookup_only})
    paths[KV_LEASED] = (kv.save, kv.get_leased, {})
    one = KVStorePath(server.url + "?connections=1", data)
    for _ in range(ADAPT_WARMUP):
        raw.flushall()
        kv.save()
        kv.get()
    paths[KV_ONE] = (one.save, one.get, {})
    paths[KV_STORE] = (kv.put_bare, kv.get_bare, {})
    put_t = {p: [] for p in paths}
    get_t = {p: [] for p in paths}
    cpu: dict[str, tuple[list[float], list[float]]] = {p: ([], []) for p in paths}  # store, retrieve: CPU s per round
    look_t: dict[str, list[float]] = {label: [] for _, _, ls in paths.values() for label in ls}
    loads = [os.getloadavg()[0]]
    print(f"\n{name}: {data.n} chunks, {data.nbytes / 2**20:.0f} MiB of KV per op "
          f"(kvstore records {kv.record_bytes / 2**20:.2f} MiB)", flush=True)
    for rep in range(reps + 1):  # rep 0 warms up
        for pname, (put, get, lookups) in paths.items():
            raw.flushall()
            c = cpu_self()
            t = time.perf_counter()
            put()
            t_put = time.perf_counter() - t
            c_put = cpu_self() - c
            lk = {}
            for label, fn in lookups.items():
                lk[label] = []
                for _ in range(LOOKUP_REPS):
                    t = time.perf_counter()
                    fn()
                    lk[label].append(time.perf_counter() - t)
            c = cpu_self()
            t = time.perf_counter()
            get()
            t_get = time.perf_counter() - t
            c_get = cpu_self() - c
            if pname == RAW:  # the same records, stored again: a first read after a store, as every path's
                raw.flushall()
                put()
                t_alone, c_alone = standalone.get()
                if rep:
                    alone_t.append(t_alone)
                    alone_cpu.append(c_alone)
            if rep:
                put_t[pname].append(t_put)
                get_t[pname].append(t_get)
                cpu[pname][0].append(c_put)
                cpu[pname][1].append(c_get)
                for label, ts in lk.items():
                    look_t[label].extend(ts)
        loads.append(os.getloadavg()[0])
        print(f"  round {rep}{' (warm-up)' if not rep else ''} done, load average {loads[-1]:.2f}", flush=True)
    raw.flushall()
    res = {"paths": {}, "lookups": {}, "loads": loads, "nbytes": data.nbytes, "record_bytes": kv.record_bytes,
           "standalone": stats([data.nbytes / t / 1e9 for t in alone_t]), "cpu": {},
           "standalone_cpu": statistics.median(alone_cpu) / (data.nbytes / 1e9)}
    standalone.close()
    a = res["standalone"]
    print(f"  {'raw zero-copy client, own process':<38} retrieve {a[0]:5.2f} [{a[1]:.2f}-{a[2]:.2f}] GB/s, "
          f"{res['standalone_cpu']:.3f} CPU s/GB", flush=True)
    for pname in paths:
        # GB/s of KV moved (10^9 B/s); kvstore's records carry ~1 KiB of header more per chunk.
        res["paths"][pname] = (stats([data.nbytes / t / 1e9 for t in put_t[pname]]),
                               stats([data.nbytes / t / 1e9 for t in get_t[pname]]))
        # The median round's CPU: one round the shared machine slowed down does not move it.
        res["cpu"][pname] = [statistics.median(c) / (data.nbytes / 1e9) for c in cpu[pname]]
        p, g = res["paths"][pname]
        cp, cg = res["cpu"][pname]
        print(f"  {pname:<38} store {p[0]:5.2f} [{p[1]:.2f}-{p[2]:.2f}] GB/s {cp:.3f} CPU s/GB  "
              f"retrieve {g[0]:5.2f} [{g[1]:.2f}-{g[2]:.2f}] GB/s {cg:.3f} CPU s/GB", flush=True)
    for label, ts in look_t.items():
        res["lookups"][label] = stats([t * 1e3 for t in ts])
        m = res["lookups"][label]
        print(f"  {label:<38} {m[0]:.3f} [{m[1]:.3f}-{m[2]:.3f}] ms", flush=True)
    res["noise"] = noise_contrast(data, lm, kv, raw)
    ceiling.client.close()
    spread.close()
    # LMCache engines are left open: LMCacheEngineBuilder.destroy() hangs in 0.5.6 (RemoteBackend.close
    # waits forever on its connection's close()); the process ends with os._exit instead.
    kv.store.close()
    one.store.close()
    raw.flushall()
    results[name] = res


def noise_contrast(data: Data, lm: dict, kv: KVStorePath, raw) -> list[str]:
    """Overwrite chunk ``bad``'s stored value with noise of the same length; retrieve through each."""
    bad = 5
    start = bad * data.tokens_per_chunk
    lines = []
    for scheme, path in lm.items():
        raw.flushall()
        path.store()
        names = sorted(k for k in raw.keys() if not k.endswith(b"metadata"))
        # Find chunk ``bad``'s key: LMCache's key strings carry the chunk hash, not its index.
        target = _lmcache_key_of(path, bad, scheme)
        assert target in names, (target, names[:3])
        size = raw.strlen(target)
        noise = os.urandom(size)
        raw.set(target, noise)
        path.captured = {}
        got = path.retrieve()
        returned = path.captured.get(start)
        path.captured = None
        same = returned is not None and returned[:size] == noise
        lines.append(f"{path.name}: value of chunk {bad} ({size} B) overwritten with noise; retrieve returned "
                     f"{got}/{len(path.tokens)} tokens; chunk {bad}'s bytes handed to the connector "
                     f"{'ARE the noise' if same else 'are not the noise'}")
        print("  " + lines[-1], flush=True)
    for variant in ("whole value", "payload only"):
        raw.flushall()
        kv.save()
        key = kv.keys[bad].key
        value = raw.get(key)
        header_end = len(value) - (data.chunk_bytes)
        noise = os.urandom(len(value)) if variant == "whole value" else value[:header_end] + os.urandom(data.chunk_bytes)
        raw.set(key, noise)
        try:
            decode_record(noise, namespace=kv.ns, chunk=kv.keys[bad], tokens=data.token_ids[start:start + data.tokens_per_chunk],
                          dtype="bfloat16")
            why = "accepted (!)"
        except CorruptRecordError as exc:
            why = f"CorruptRecordError reason={exc.reason!r}"
        data.dest[:] = 1
        result = kv.load()
        intact = all(np.array_equal(data.dest[i], data.kv_u8[i]) for i in range(result.num_chunks))
        untouched = not np.any(data.dest[bad] != 1)
        lines.append(f"kvstore PrefixCache.load, {variant} of chunk {bad} ({len(value)} B) overwritten with noise: "
                     f"loaded {result.num_chunks}/{data.n} chunks (reason {result.reason!r}; decode: {why}); "
                     f"chunks 0-{result.num_chunks - 1} equal the saved KV: {intact}; chunk {bad}'s destination "
                     f"left untouched: {untouched} (a payload under a valid header lands before its checksum "
                     f"is known, and is not counted); the bad record was deleted: {not raw.exists(key)}")
        print("  " + lines[-1], flush=True)
    raw.flushall()
    return lines


def _lmcache_key_of(path: LMCachePath, index: int, scheme: str) -> bytes:
    """The Redis key under which ``path`` stores chunk ``index``."""
    keys = [key for _, _, key in path.engine.token_database.process_tokens(tokens=path.tokens)]
    key = keys[index].to_string()
    return (key + ("kv_bytes" if scheme == "redis" else "")).encode()


# -- report -------------------------------------------------------------------------------------
def versions(peer: bool = True) -> str:
    import hiredis
    import redis

    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    lm = ""
    if peer:
        import lmcache

        lm = f"lmcache {lmcache.__version__}, "
    return (f"{lm}redis-py {redis.__version__}, hiredis {hiredis.__version__}, "
            f"redis-server {server}, numpy {np.__version__}, {platform.platform()}")


def render(results: dict, reps: int, peer: bool = True, limits: str = "") -> str:
    out = [f"Machine: {machine()}", *([f"Memory: {limits}"] if limits else []), f"Versions: {versions(peer)}",
           f"{reps} measured rounds (+1 warm-up), "
           f"{N_CHUNKS} chunks per op, GB/s of KV (10^9 B/s), median [min-max].", ""]
    for name, res in results.items():
        loads = res["loads"]
        out += [f"### {N_CHUNKS} x {name} chunks ({res['nbytes'] / 2**20:.0f} MiB of KV per op)", "",
                f"Load average (1 min) while measuring: {min(loads):.2f}-{max(loads):.2f}.", "",
                "| path | store | retrieve |", "|---|---|---|"]
        for pname, (p, g) in res["paths"].items():
            out.append(f"| {pname} | {p[0]:.2f} [{p[1]:.2f}-{p[2]:.2f}] | {g[0]:.2f} [{g[1]:.2f}-{g[2]:.2f}] |")
        if "cpu" in res:
            out += ["", "CPU seconds per GB of KV (this process, user+system, every thread; the median round), same rounds:", "",
                    "| path | store CPU s/GB | retrieve CPU s/GB | store CPU x raw | retrieve CPU x raw |",
                    "|---|---|---|---|---|"]
            rc = res["cpu"][RAW]
            for pname, (cp, cg) in res["cpu"].items():
                out.append(f"| {pname} | {cp:.3f} | {cg:.3f} | {cp / rc[0]:.2f} | {cg / rc[1]:.2f} |")
        if "standalone" in res:
            a, g = res["standalone"], res["paths"][RAW][1]
            out += ["", f"The raw client in a process of its own (no LMCache, no benchmark buffers), reading the same "
                        f"records, stored again just before (as every path reads): retrieve {a[0]:.2f} [{a[1]:.2f}-{a[2]:.2f}]; "
                        f"in-process / own process = {g[0] / a[0]:.2f}"
                        + (f"; its CPU {res['standalone_cpu']:.3f} s/GB." if "standalone_cpu" in res else ".")]
        out += ["", "Ratios of medians (above 1: the first path is faster):", "",
                "| path | vs | store | retrieve |", "|---|---|---|---|"]
        for kpath in (KV_CACHE, KV_STORE):
            for other in (RAW, RAWC, RAWH, RAW4, LM_REDIS, LM_RESP):
                if other not in res["paths"]:
                    continue
                kp, kg = res["paths"][kpath]
                op, og = res["paths"][other]
                out.append(f"| {kpath} | {other} | {kp[0] / op[0]:.2f} | {kg[0] / og[0]:.2f} |")
        out += ["", f"Lookup of {N_CHUNKS} stored chunks, ms, median [min-max] of {reps * LOOKUP_REPS}:", "",
                "| lookup | ms |", "|---|---|"]
        for label, m in res["lookups"].items():
            out.append(f"| {label} | {m[0]:.3f} [{m[1]:.3f}-{m[2]:.3f}] |")
        lk = res["lookups"]
        if "LMCache resp:// lookup" in lk:
            out += ["", "LMCache / kvstore keys+lookup latency: "
                    f"redis:// {lk['LMCache redis:// lookup'][0] / lk['kvstore keys+lookup'][0]:.1f}x, "
                    f"resp:// {lk['LMCache resp:// lookup'][0] / lk['kvstore keys+lookup'][0]:.1f}x"]
        out += ["", "Noise contrast:", ""] + [f"- {line}" for line in res["noise"]] + [""]
    out += ["Summary, kvstore end to end (PrefixCache save/load) as ratios of medians:", ""]
    out += summary_lines(results)
    return "\n".join(out)


def summary_lines(results: dict) -> list[str]:
    """The last lines of the output: end-to-end ratios to the raw ceiling and to LMCache resp://."""
    lines = []
    for name, res in results.items():
        kp, kg = res["paths"][KV_CACHE]
        rp, rg = res["paths"][RAW]
        line = f"{name}: ratio_to_raw store={kp[0] / rp[0]:.2f} load={kg[0] / rg[0]:.2f}"
        if "cpu" in res:
            kc, rc = res["cpu"][KV_CACHE], res["cpu"][RAW]
            line += f" cpu_per_gb_ratio_to_raw store={kc[0] / rc[0]:.2f} load={kc[1] / rc[1]:.2f}"
            if RAWC in res["cpu"]:
                line += f" load_cpu_ratio_to_raw_plus_copy={kc[1] / res['cpu'][RAWC][1]:.2f}"
            if RAWH in res["cpu"]:
                hc = res["cpu"][RAWH]
                line += f" cpu_ratio_to_raw_plus_checksum store={kc[0] / hc[0]:.2f} load={kc[1] / hc[1]:.2f}"
        if KV_ONE in res["paths"]:
            op, og = res["paths"][KV_ONE]
            line += f" one_connection_ratio_to_raw store={op[0] / rp[0]:.2f} load={og[0] / rg[0]:.2f}"
            if "cpu" in res:
                oc = res["cpu"][KV_ONE]
                line += f" one_connection_cpu_ratio_to_raw store={oc[0] / rc[0]:.2f} load={oc[1] / rc[1]:.2f}"
        if RAW4 in res["paths"]:
            sp, sg = res["paths"][RAW4]
            line += f" ratio_to_raw_4conn store={kp[0] / sp[0]:.2f} load={kg[0] / sg[0]:.2f}"
        if LM_RESP in res["paths"]:
            lp, lg = res["paths"][LM_RESP]
            line += f" ratio_to_lmcache_resp store={kp[0] / lp[0]:.2f} load={kg[0] / lg[0]:.2f}"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--only", choices=sorted(SHAPES))
    parser.add_argument("--out", help="also write the markdown tables here")
    parser.add_argument("--json", help="also write the figures as JSON here (for benchmarks/report.py)")
    parser.add_argument("--no-peer", action="store_true", help="leave LMCache out (kvstore vs the raw ceiling only)")
    args = parser.parse_args()
    print(machine(), flush=True)
    limits = memory_limits()
    print(f"memory: {limits}", flush=True)
    peer = not args.no_peer
    if peer:
        _fix_lmcache_resp_sync_race()  # before any engine exists: add_reader binds _on_ready
    server = servers.RedisServer()
    results: dict = {}
    try:
        for name in SHAPES:
            if args.only and name != args.only:
                continue
            run_size(name, server, args.reps, results, peer)
    finally:
        server.close()
    text = render(results, args.reps, peer, limits)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        import json

        doc = {"machine": machine(), "memory": limits, "versions": versions(peer), "reps": args.reps, "chunks": N_CHUNKS,
               "sizes": {name: {"nbytes": r["nbytes"], "loads": r["loads"],
                                "paths": {p: {"store": list(v[0]), "retrieve": list(v[1])} for p, v in r["paths"].items()},
                                "lookups_ms": {k: list(v) for k, v in r["lookups"].items()},
                                "cpu_s_per_gb": {p: {"store": v[0], "retrieve": v[1]} for p, v in r["cpu"].items()}}
                         for name, r in results.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    sys.stdout.flush()
    os._exit(0)  # LMCache's non-daemon threads would keep the process alive


if __name__ == "__main__":
    main()
