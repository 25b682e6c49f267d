"""The host-shared memory tier (``shm://``): conformance, several processes at once, killed writers."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
import uuid

import pytest
import xxhash

from kvstore import ConfigError, open_store
from kvstore.buffers import BufferPool
from kvstore.stores.shm import ShmStore
from kvstore.stores.tiered import TieredStore
from kvstore.testing.store_tests import StoreTests


@pytest.fixture
def shm_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


class TestShmStore(StoreTests):
    @pytest.fixture
    def store(self, shm_name):
        with open_store(f"shm://{shm_name}?max_bytes=256MiB") as s:
            yield s

    def bypass_get(self, store, key):
        path = store._path(key)
        return path.read_bytes() if path.exists() else None

    def bypass_put(self, store, key, value):
        path = store._path(key)  # a record another process renamed into place
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".bypass")
        tmp.write_bytes(value)
        os.replace(tmp, path)


def test_url_options_are_checked(shm_name):
    for bad in ("shm://", "shm:///x", f"shm://{shm_name}/x", f"shm://{shm_name}?nope=1", "shm://.hidden",
                f"shm://{shm_name}?max_bytes=0", f"shm://{shm_name}?max_bytes=1000TiB", "shm://a%2Fb"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_processes_opening_one_name_share_it(shm_name):
    url = f"shm://{shm_name}?max_bytes=64MiB"
    with open_store(url) as a:
        a.put("kvs/k", b"from a")
        with mp.get_context("spawn").Pool(1) as p:
            assert p.apply(_read_one, (url, "kvs/k")) == b"from a"
            p.apply(_write_one, (url, "kvs/other", b"from b"))
        assert bytes(a.get("kvs/other")) == b"from b"


def _read_one(url, key):
    with open_store(url) as s:
        value = s.get(key)
        return None if value is None else bytes(value)


def _write_one(url, key, value):
    with open_store(url) as s:
        s.put(key, value)


def test_large_values_are_views_of_a_mapping_and_survive_overwrite_and_eviction(shm_name):
    with open_store(f"shm://{shm_name}?max_bytes=8MiB&low_water=0.5") as store:
        first, second = os.urandom(3 << 20), os.urandom(3 << 20)
        store.put("kvs/big", first)
        pool = BufferPool(16 << 20)
        lease = next(store.get_into(["kvs/big"], pool))
        held = store.get("kvs/big")
        assert isinstance(held, memoryview) and held.readonly
        assert pool.stats()["leased_bytes"] == 0  # a borrowed view, not a copy
        store.put("kvs/big", second)  # overwritten, then evicted: the held mappings stay whole
        for i in range(4):
            store.put(f"kvs/fill{i}", os.urandom(3 << 20))
        assert bytes(lease.view) == first and bytes(held) == first
        lease.release()
        assert store.get("kvs/big") in (None, second) or bytes(store.get("kvs/big")) == second


def test_eviction_keeps_the_tier_bounded_across_processes(shm_name):
    url = f"shm://{shm_name}?max_bytes=16MiB"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fill, args=(url, p)) for p in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with open_store(url) as store:
        assert store._scan_total() <= 16 << 20
        assert len(list(store.iter_keys("kvs/"))) > 0


def _fill(url, p):
    with open_store(url) as s:
        for i in range(40):
            s.put(f"kvs/p{p}-{i}", os.urandom(1 << 20))


def _value_for(key: str, gen: int, size: int) -> bytes:
    """A self-checked value: ``gen`` repeated, then the xxh3-64 of the bytes before it."""
    body = (key.encode() + gen.to_bytes(8, "little")) * (size // (len(key) + 8))
    return body + xxhash.xxh3_64_digest(body)


def _hammer(url, worker, seconds, keys, result):
    pool = BufferPool(64 << 20)
    mismatches = reads = writes = 0
    with open_store(url) as s:
        end = time.monotonic() + seconds
        gen = 0
        while time.monotonic() < end:
            gen += 1
            key = keys[(worker + gen) % len(keys)]
            size = (1 << 20) * (1 + gen % 3) + gen % 7  # mapped and copied reads both
            if gen % 2:
                s.put(key, _value_for(key, gen, size))
                writes += 1
            for lease in s.get_into(keys, pool):
                if lease is None:
                    continue
                view = lease.view
                reads += 1
                if len(view) < 8 or xxhash.xxh3_64_digest(view[:-8]) != bytes(view[-8:]):
                    mismatches += 1
                lease.release()
            small = s.get(keys[gen % len(keys)] + "/small")
            if small is not None and xxhash.xxh3_64_digest(small[:-8]) != bytes(small[-8:]):
                mismatches += 1
            s.put(keys[gen % len(keys)] + "/small", _value_for(key, gen, 100 + gen % 50))
    result.put((worker, mismatches, reads, writes))


def test_concurrent_processes_never_see_a_torn_value(shm_name):
    # Several processes write and read the same keys at once, under eviction pressure; every
    # value read must be whole (its trailing digest matches its bytes).
    url = f"shm://{shm_name}?max_bytes=24MiB&map_bytes=2MiB"
    keys = [f"kvs/shared{i}" for i in range(6)]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(url, w, 4.0, keys, result)) for w in range(4)]
    for p in procs:
        p.start()
    outcomes = [result.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(m == 0 for _, m, _, _ in outcomes), outcomes
    assert sum(r for _, _, r, _ in outcomes) > 20 and sum(w for _, _, _, w in outcomes) > 10, outcomes


def _write_forever(url, ready):
    store = open_store(url)
    big = os.urandom(8 << 20)
    ready.set()
    i = 0
    while True:
        store.put(f"kvs/w{i % 4}", big)
        i += 1


def test_a_writer_killed_mid_record_leaves_the_tier_consistent(shm_name):
    url = f"shm://{shm_name}?max_bytes=128MiB"
    ctx = mp.get_context("spawn")
    for _ in range(3):
        ready = ctx.Event()
        writer = ctx.Process(target=_write_forever, args=(url, ready))
        writer.start()
        assert ready.wait(60)
        time.sleep(0.3)  # mid-write, most likely: each record takes milliseconds
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
    tmp = f"/dev/shm/kvstore-{shm_name}/tmp"
    dead = [n for n in os.listdir(tmp) if n.endswith(".alive")]
    assert len(dead) == 1  # the last killed writer's (each new writer's start reaped the one before)
    with open_store(url) as store:
        # Whatever the writers left: whole records only, and their temporary files reaped.
        for key in store.iter_keys("kvs/"):
            assert len(store.get(key)) == 8 << 20
        left = [e.name for e in os.scandir(tmp) if not e.name.startswith(store._writer_dir.name)]
        assert left == [], left
        store.put("kvs/after", b"still writable")  # no lock was left held
        assert store.evict() >= 0
        assert bytes(store.get("kvs/after")) == b"still writable"


def test_lookup_of_16_chunks_is_fast(shm_name):
    with open_store(f"shm://{shm_name}?max_bytes=64MiB") as store:
        keys = [f"kvs/v1/ns/{i:064x}" for i in range(16)]
        store.put_many((k, b"x" * 1000) for k in keys)
        best = float("inf")
        for _ in range(50):
            t0 = time.perf_counter()
            assert store.longest_prefix(keys) == 16
            best = min(best, time.perf_counter() - t0)
        assert best < 1e-3, best  # the figure is 0.1 ms; a shared 2-core CI box gets slack


def test_it_is_a_local_tier_before_redis_in_a_tiered_store(shm_name, redis_server):
    redis_server.flushall()
    with open_store([f"shm://{shm_name}?max_bytes=64MiB", redis_server.url]) as tiered:
        assert isinstance(tiered, TieredStore)
        assert tiered.tiers[0].name == "shm"
        tiered.put("kvs/t", b"value")  # written synchronously to the shm tier
        assert isinstance(tiered.tiers[0].store, ShmStore)
        assert bytes(tiered.tiers[0].store.get("kvs/t")) == b"value"


def test_a_cached_mapping_is_never_stale_after_another_process_overwrites(shm_name):
    url = f"shm://{shm_name}?max_bytes=64MiB"
    first, second = os.urandom(2 << 20), os.urandom(2 << 20)
    with open_store(url) as store, open_store(url + "&map_cache=0") as uncached:
        store.put("kvs/k", first)
        assert bytes(store.get("kvs/k")) == first  # mapped, and kept for the next read
        assert store.get("kvs/k").obj is store.get("kvs/k").obj  # the same mapping, reused
        with mp.get_context("spawn").Pool(1) as p:
            p.apply(_write_one, (url, "kvs/k", second))
        assert bytes(store.get("kvs/k")) == second
        assert bytes(next(store.get_into(["kvs/k"], BufferPool(8 << 20))).view) == second
        assert bytes(uncached.get("kvs/k")) == second
        assert uncached.get("kvs/k").obj is not uncached.get("kvs/k").obj
        store.delete("kvs/k")
        assert store.get("kvs/k") is None and store._maps._bytes == 0
