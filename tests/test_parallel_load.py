"""``PrefixCache.load`` with ``workers`` > 1 (issue 24): records verified and placed on several
threads at once give the same leading run of verified chunks as one worker, a bad record still
ends the load there (counted, deleted, healed by the next save), a sink's error still
propagates, and every lease goes back to the pool whatever happens. A CPU ``KVTransfer`` loads
this way and places the same bytes as one worker does."""

from __future__ import annotations

import os
import shutil
import threading
import uuid

import numpy as np
import pytest
import torch

from kvstore.buffers import BufferPool
from kvstore.errors import StoreUnavailableError
from kvstore.keys import Namespace
from kvstore.metrics.catalog import CORRUPT
from kvstore.paged import FlashLayout, KVTransfer, slots_from_block_table
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores.memory import MemoryStore
from kvstore.stores.shm import ShmStore
from kvstore.testing.damage import flip_byte

CHUNKS, CHUNK_BYTES = 8, 256 << 10


def _namespace() -> Namespace:
    return Namespace(model="parallel-load", kv_dtype="uint8", layout="t", block_size=16, chunk_tokens=32,
                     layer_end=1)


def _filled(store) -> tuple[PrefixCache, np.ndarray, list, list[bytes]]:
    """A cache over ``store`` holding CHUNKS chunks of distinct random KV."""
    cache = PrefixCache(store, _namespace(), pool=BufferPool(64 << 20))
    tokens = np.arange(32 * CHUNKS, dtype=np.uint32)
    keys = cache.keys(tokens)
    kvs = [os.urandom(CHUNK_BYTES) for _ in keys]
    shapes = [(CHUNK_BYTES,)]
    assert cache.save(tokens, keys, lambda c: ChunkPayload(shapes=shapes, kv=kvs[c.index]), skip_stored=False) == CHUNKS
    store.flush(10)
    return cache, tokens, keys, kvs


class _Collect:
    """A thread-safe sink: the bytes placed per chunk index, and the threads that placed them."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.placed: dict[int, bytes] = {}
        self.threads: set[str] = set()
        self.fail_at = fail_at
        self._lock = threading.Lock()

    def __call__(self, chunk, record) -> None:
        if chunk.index == self.fail_at:
            raise KeyboardInterrupt("the caller cancels")
        with self._lock:
            self.placed[chunk.index] = bytes(record.kv)
            self.threads.add(threading.current_thread().name)


def _load(cache: PrefixCache, tokens, keys, sink, workers: int):
    return cache.load(tokens, keys, sink, shapes=lambda c: [(CHUNK_BYTES,)], workers=workers)


@pytest.fixture(params=["memory", "shm"])
def store(request):
    if request.param == "memory":
        yield MemoryStore()
        return
    name = f"parallel-{uuid.uuid4().hex[:8]}"
    s = ShmStore.from_url(f"shm://{name}?max_bytes=64MiB&map_bytes=64KiB")  # every record mapped
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(s.root, ignore_errors=True)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_every_chunk_is_placed_once_with_its_own_bytes(store, workers):
    cache, tokens, keys, kvs = _filled(store)
    sink = _Collect()
    result = _load(cache, tokens, keys, sink, workers)
    assert (result.reason, result.num_chunks, result.num_tokens) == ("hit", CHUNKS, 32 * CHUNKS)
    assert sink.placed == dict(enumerate(kvs))
    assert cache.pool.stats()["leased_bytes"] == 0
    if workers > 1:
        assert all(name.startswith("kvstore-place") for name in sink.threads)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_record_ends_the_load_there_and_the_next_save_heals_it(store, workers):
    cache, tokens, keys, kvs = _filled(store)
    flip_byte(store, keys[3].key, offset=-9)  # a payload byte: the checksum fails
    before = CORRUPT.value(reason="checksum")
    sink = _Collect()
    result = _load(cache, tokens, keys, sink, workers)
    assert (result.reason, result.num_chunks, result.num_tokens) == ("corrupt", 3, 96)
    assert CORRUPT.value(reason="checksum") == before + 1
    assert 3 not in sink.placed  # never placed
    assert {i: sink.placed[i] for i in range(3)} == {i: kvs[i] for i in range(3)}
    # Chunks after the bad one may have been placed by another worker: always their own verified bytes.
    assert all(sink.placed[i] == kvs[i] for i in sink.placed)
    assert store.get(keys[3].key) is None  # deleted
    assert cache.pool.stats()["leased_bytes"] == 0
    assert cache.save(tokens, keys, lambda c: ChunkPayload(shapes=[(CHUNK_BYTES,)], kv=kvs[c.index])) == CHUNKS - 3
    store.flush(10)
    again = _Collect()
    assert _load(cache, tokens, keys, again, workers).num_chunks == CHUNKS
    assert again.placed == dict(enumerate(kvs))


def test_a_missing_record_ends_a_parallel_load_after_the_chunks_before_it(store):
    cache, tokens, keys, kvs = _filled(store)
    store.delete(keys[5].key)
    sink = _Collect()
    result = _load(cache, tokens, keys, sink, 2)
    assert (result.reason, result.num_chunks) == ("miss", 5)
    assert {i: sink.placed[i] for i in range(5)} == {i: kvs[i] for i in range(5)}
    assert cache.pool.stats()["leased_bytes"] == 0


def test_a_sinks_error_propagates_once_every_worker_has_finished(store):
    cache, tokens, keys, _ = _filled(store)
    sink = _Collect(fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        _load(cache, tokens, keys, sink, 2)
    assert 2 not in sink.placed
    assert cache.pool.stats()["leased_bytes"] == 0


class _FailsMidway(MemoryStore):
    """A memory store whose batch reads fail after ``after`` values, as a tier that goes away."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def get_into(self, keys, pool):
        for i, lease in enumerate(super().get_into(keys, pool)):
            if i == self.after:
                if lease is not None:
                    lease.release()
                raise StoreUnavailableError("gone")
            yield lease


def test_a_store_that_fails_midway_keeps_the_chunks_received_before():
    store = _FailsMidway(after=4)
    cache, tokens, keys, kvs = _filled(store)
    sink = _Collect()
    result = _load(cache, tokens, keys, sink, 2)
    assert (result.reason, result.num_chunks) == ("unavailable", 4)
    assert {i: sink.placed[i] for i in range(4)} == {i: kvs[i] for i in range(4)}
    assert cache.pool.stats()["leased_bytes"] == 0


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2", True])
def test_workers_must_be_a_positive_integer(workers):
    cache = PrefixCache(MemoryStore(), _namespace())
    with pytest.raises(ValueError, match="workers"):
        cache.load([1] * 32, cache.keys(np.arange(32, dtype=np.uint32)), lambda c, r: None, workers=workers)


def test_a_cpu_transfer_places_the_same_bytes_with_two_workers_as_with_one():
    layers, blocks, bs = 4, 40, 16
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(2, blocks, bs, 2, 64, generator=g).to(torch.bfloat16) for _ in range(layers)]
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=bs, chunk_tokens=32,
                   layer_end=layers)
    cache = PrefixCache(MemoryStore(), ns)
    tokens = list(range(1000, 1000 + 512))
    order = np.random.default_rng(0).permutation(blocks)[:32].tolist()
    assert KVTransfer(cache, src, FlashLayout()).save_sequence(tokens, slots_from_block_table(order, bs, 512)) == 16
    dst_slots = slots_from_block_table(order[::-1], bs, 512)
    loaded = []
    for workers in (1, 2):
        dst = [torch.zeros_like(c) for c in src]
        xfer = KVTransfer(cache, dst, FlashLayout(), placers=workers)
        assert xfer.load_sequence(tokens, dst_slots)[0] == 512
        loaded.append(dst)
    assert all(torch.equal(a, b) for a, b in zip(*loaded))
    assert KVTransfer(cache, src, FlashLayout()).placers == min(2, os.cpu_count() or 1)
    with pytest.raises(ValueError, match="placers"):
        KVTransfer(cache, src, FlashLayout(), placers=0)
