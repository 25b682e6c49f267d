"""Values hashed as they arrive (``Lease.digest``, issue 24): every backend that sets a digest
(Redis, redis+shards, S3, file)
sets exactly the xxh3-64 of all but the value's last 8 bytes, whatever the order its parts land
in, and a record corrupted in the store is still rejected when the reader trusts that digest."""

from __future__ import annotations

import os
import shutil
import threading
import uuid

import numpy as np
import pytest
import xxhash

from kvstore.buffers import SELF_CHECK_BYTES, BufferPool
from kvstore.errors import CorruptRecordError
from kvstore.keys import KEY_PREFIX as _K
from kvstore.keys import Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import decode_record
from kvstore.stores import open_store
from kvstore.stores.s3.bodies import PartsDigest


def _expected(value: bytes) -> bytes | None:
    return xxhash.xxh3_64_digest(value[:-SELF_CHECK_BYTES]) if len(value) >= SELF_CHECK_BYTES else None


@pytest.mark.parametrize("order", ["in order", "reversed", "shuffled", "threads"])
def test_parts_digest_is_the_whole_values_digest_in_any_landing_order(order):
    value = os.urandom((5 << 20) + 12345)
    view = memoryview(value)
    first = 1 << 20
    bounds = [(s, min(len(value), s + (1 << 20))) for s in range(first, len(value), 1 << 20)]
    digest = PartsDigest(view, bounds)
    for s in range(0, first, 300_000):
        digest.arrived(view[s:min(first, s + 300_000)])
    indices = list(range(len(bounds)))
    if order == "reversed":
        indices.reverse()
    elif order == "shuffled":
        np.random.default_rng(1).shuffle(indices)
    if order == "threads":
        threads = [threading.Thread(target=digest.landed, args=(i,)) for i in indices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for k, i in enumerate(indices):
            assert (digest.digest() is None) == (k < len(indices))  # not before every part is in
            digest.landed(i)
    assert digest.digest() == _expected(value)


@pytest.mark.parametrize("size", [0, 7, 8, 9, 1 << 20, (1 << 20) + 1, (3 << 20) + 77])
def test_s3_leases_carry_the_digest_of_what_arrived(s3_server, size):
    with open_store(s3_server.url_for("digest", part_size="1MiB", max_workers="4", deadline="20s")) as store:
        value = os.urandom(size)
        store.put(f"{_K}/d/{size}", value)
        pool = BufferPool(64 << 20)
        (lease,) = list(store.get_into([f"{_K}/d/{size}"], pool))
        assert lease is not None and bytes(lease.view) == value
        assert lease.digest == _expected(value)
        lease.release()


def _namespace() -> Namespace:
    return Namespace(model="digest-test", kv_dtype="uint8", layout="bench", block_size=16, chunk_tokens=16,
                     layer_end=1)


@pytest.mark.parametrize("size", [0, 7, 8, 9, (1 << 20) + 1, (3 << 20) + 77])
def test_file_leases_carry_the_digest_of_what_was_read(tmp_path, size):
    with open_store(f"file://{tmp_path}") as store:
        value = os.urandom(size)
        store.put(f"{_K}/d/{size}", value)
        pool = BufferPool(64 << 20)
        lease, missing = list(store.get_into([f"{_K}/d/{size}", f"{_K}/d/none"], pool))
        assert missing is None and lease is not None and bytes(lease.view) == value
        assert lease.digest == _expected(value)
        lease.release()
        assert pool.stats()["leased_bytes"] == 0


@pytest.mark.parametrize("backend", ["s3", "redis", "shards", "file", "shm"])
def test_a_record_corrupted_in_the_store_is_rejected_with_the_arrival_digest(backend, s3_server, redis_server,
                                                                              tmp_path):
    shm_name = f"digest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    url = {"s3": s3_server.url_for("corrupt", part_size="1MiB", deadline="20s"), "redis": redis_server.url,
           "shards": f"redis+shards://127.0.0.1:{redis_server.port}", "file": f"file://{tmp_path}",
           "shm": f"shm://{shm_name}?max_bytes=64MiB"}[backend]  # mapped reads, hashed one ahead
    try:
        _corrupt_and_load(url)
    finally:
        shutil.rmtree(f"/dev/shm/kvstore-{shm_name}", ignore_errors=True)


def _corrupt_and_load(url: str) -> None:
    with open_store(url) as store:
        cache = PrefixCache(store, _namespace())
        tokens = np.arange(32, dtype=np.uint32)
        keys = cache.keys(tokens)
        kv = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
        shapes = [(kv.size,)]
        cache.save(tokens, keys, lambda chunk: ChunkPayload(shapes=shapes, kv=kv), skip_stored=False)
        pool = BufferPool(64 << 20)
        record = bytes(store.get(keys[1].key))
        for leases in [list(store.get_into([keys[1].key], pool))]:
            assert leases[0].digest == _expected(record)  # set, and right
            leases[0].release()
        damaged = bytearray(record)
        damaged[len(record) // 2] ^= 1  # one bit of the payload, the trailer intact
        store.put(keys[1].key, bytes(damaged))
        (lease,) = list(store.get_into([keys[1].key], pool))
        out = np.zeros(kv.size, dtype=np.uint8)
        with pytest.raises(CorruptRecordError) as caught:
            decode_record(lease.view, namespace=cache.namespace, chunk=keys[1], out=memoryview(out),
                          digest=lease.digest)
        assert caught.value.reason == "checksum" and not out.any()  # rejected before a byte reached out
        lease.release()


@pytest.mark.parametrize("size", [0, 1, (1 << 16) - 1, 1 << 16, (3 << 20) + 5])
def test_copy_bytes_copies_exactly_and_refuses_a_size_mismatch(size):
    from kvstore.buffers import copy_bytes

    src = os.urandom(size)
    dst = bytearray(size)
    copy_bytes(memoryview(dst), src)
    assert dst == src
    with pytest.raises(ValueError):
        copy_bytes(memoryview(bytearray(size + 1)), src)


@pytest.mark.parametrize("backend", ["redis", "file"])
def test_an_empty_value_gives_its_pool_lease_back(backend, redis_server, tmp_path):
    """A lease of 0 bytes is falsy (``len``): reading one must not swap it for a fresh buffer and
    leave the pool's bytes leased forever."""
    url = {"redis": redis_server.url, "file": f"file://{tmp_path}"}[backend]
    with open_store(url) as store:
        store.put(f"{_K}/empty", b"")
        pool = BufferPool(8 << 20)
        for _ in range(3):
            (lease,) = list(store.get_into([f"{_K}/empty"], pool))
            assert lease is not None and bytes(lease.view) == b""
            lease.release()
        assert pool.stats()["leased_bytes"] == 0
