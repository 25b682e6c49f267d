"""Conformance of the local stores (memory, file) plus their own behaviour."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kvstore import ConfigError, open_store
from kvstore.buffers import Lease, Pieces
from kvstore.stores import WrapperStore
from kvstore.stores.memory import MemoryStore
from kvstore.testing.store_tests import StoreTests
from kvstore.warm import CountingStore


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self):
        with open_store("memory://?max_bytes=64MiB") as s:
            yield s

    def bypass_get(self, store, key):
        value = store._data.get(key)  # the LRU dict itself: no recency update, no copy
        return bytes(value.view) if isinstance(value, Lease) else value  # 64 KiB and more: kept in a lease

    def bypass_put(self, store, key, value):
        with store._lock:
            store._data[key] = bytes(value)
            store._bytes += len(value)


class TestFileStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        with open_store(f"file://{tmp_path}/kv?max_bytes=256MiB") as s:
            yield s

    def bypass_get(self, store, key):
        path = store._path(key)
        return path.read_bytes() if path.exists() else None

    def bypass_put(self, store, key, value):
        path = store._path(key)  # a file dropped in place, as another process's writer leaves it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)


class _Recording(WrapperStore):
    """A wrapper that adds nothing but a count of calls: every operation must still behave."""

    def __init__(self, inner):
        super().__init__(inner)
        self.puts = 0

    def put(self, key, value):
        self.puts += 1
        super().put(key, value)


class TestWrapperStore(StoreTests):
    """A ``WrapperStore`` forwards the whole contract (the warm counter and later wrappers)."""

    @pytest.fixture(params=["plain", "counting"])
    def store(self, request, tmp_path):
        inner = open_store(f"file://{tmp_path}/kv?max_bytes=256MiB")
        store = _Recording(inner) if request.param == "plain" else CountingStore(inner)
        with store:
            assert store.is_local and store.deadline is None and store.flush(1)
            yield store

    def bypass_get(self, store, key):
        path = store.inner._path(key)
        return path.read_bytes() if path.exists() else None

    def bypass_put(self, store, key, value):
        store.inner.put(key, value)


def test_counting_store_counts_bytes_put(tmp_path):
    with CountingStore(open_store("memory://")) as store:
        store.put("a", b"123")
        store.put_many([("b", bytearray(5)), ("c", memoryview(b"xy"))])
        assert store.bytes_put == 10 and store.get_many(["a", "b", "c"]) == [b"123", bytes(5), b"xy"]


def test_memory_lru_evicts_least_recently_used():
    store = MemoryStore(MemoryStore.Config(max_bytes=300))
    for k in "abc":
        store.put(k, bytes(100))
    store.get("a")  # a is now the most recently used
    store.put("d", bytes(100))
    assert store.get("b") is None
    assert all(store.get(k) is not None for k in "acd")
    assert store.used_bytes == 300


def test_memory_value_larger_than_capacity_is_not_kept():
    store = MemoryStore(MemoryStore.Config(max_bytes=10))
    store.put("small", b"12345")
    store.put("big", bytes(11))
    assert store.get("big") is None and store.get("small") == b"12345"


def test_file_store_evicts_to_low_water(tmp_path):
    store = open_store(f"file://{tmp_path}?max_bytes=1000&low_water=0.5")
    for i in range(12):
        store.put(f"k{i}", bytes(100))
        os.utime(store._path(f"k{i}"), (i, i))  # deterministic LRU order
    remaining = sorted(store.iter_keys())
    total = sum(store.size_many(remaining))
    assert total <= 1000
    assert "k11" in remaining and "k0" not in remaining


def _writer(path: str, worker: int) -> None:
    store = open_store(f"file://{path}")
    for i in range(50):
        store.put(f"kvs1/w/{i}", bytes([worker]) * 4096)


def _run_processes(ctx, target, args_list) -> None:
    """Start one spawned process per argument tuple, wait for all, and require clean exits."""
    procs = [ctx.Process(target=target, args=args) for args in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


@pytest.mark.parametrize("most", [None, 5000])
def test_a_value_of_many_parts_is_written_whole(tmp_path, monkeypatch, most):
    """A value in more parts than one ``writev`` takes (a record landed in a paged cache's
    blocks, promoted from there), written whole in order, and counted whole against the
    store's budget; with ``most`` every call writes at most that many bytes, as a signal or a
    full disk can make it."""
    import kvstore.stores.file as file_store

    if most is not None:
        real = os.writev
        monkeypatch.setattr(file_store.os, "writev", lambda fd, bufs: real(fd, _first_bytes(bufs, most)))
    parts = [os.urandom(n) for n in [1, 7, 0, 32768, 4099] * 300]  # 1,500 parts, more than _IOV_MAX
    with open_store(f"file://{tmp_path}/kv?max_bytes=1GiB") as store:
        store.put("k", Pieces(parts))
        assert bytes(store.get("k")) == b"".join(parts)
        store.put("k2", Pieces(parts))
    counted = int.from_bytes((tmp_path / "kv" / ".usage").read_bytes()[:8], "little")
    assert counted == 2 * len(b"".join(parts))  # the shared usage counter, bytes of both files


def _first_bytes(buffers, n):
    out = []
    for b in buffers:
        view = memoryview(b)[:n]
        if len(view):
            out.append(view)
        n -= len(view)
        if n <= 0:
            break
    return out


def test_file_store_many_processes_write_whole_values(tmp_path):
    _run_processes(mp.get_context("spawn"), _writer, [(str(tmp_path), w) for w in range(3)])
    store = open_store(f"file://{tmp_path}")
    for i in range(50):
        value = store.get(f"kvs1/w/{i}")
        assert value is not None and len(value) == 4096 and len(set(value)) == 1


def _bounded_writer(path: str, worker: int, barrier) -> None:
    store = open_store(f"file://{path}?max_bytes=64KiB&low_water=0.5")
    store.put(f"kvs1/w{worker}/0", bytes(4096))
    barrier.wait()  # every writer has seen the directory (nearly empty) before the rest
    for i in range(1, 12):
        store.put(f"kvs1/w{worker}/{i}", bytes(4096))


def test_file_store_budget_holds_across_processes(tmp_path):
    # Each writer alone stays under the budget (12 values of 4 KiB); four together write 192 KiB.
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    _run_processes(ctx, _bounded_writer, [(str(tmp_path), w, barrier) for w in range(4)])
    store = open_store(f"file://{tmp_path}")
    assert sum(store.size_many(list(store.iter_keys()))) <= 64 * 1024


@pytest.mark.parametrize("url, fragment", [
    ("nosuch://x", "unknown store scheme 'nosuch://'"),
    ("memory://?max_bytes=lots", "max_bytes='lots' is not a size"),
    ("memory://?maxbytes=1GiB", "unknown parameter 'maxbytes' for memory://; accepted: max_bytes"),
    ("file://", "has no path"),
    ("file:///tmp/x?fsync=maybe", "fsync='maybe' is not a boolean"),
    ("file:///tmp/x?low_water=2", "low_water='2' (2) is out of range; accepted: 0.01 to 1"),
    ("file:///tmp/x?max_bytes=9EiB", "max_bytes='9EiB'"),
    ("shm://t?max_bytes=0", "max_bytes='0' (0 bytes) is out of range; accepted: 1 byte to 16 TiB"),
    ("shm://t?map_cache=-1", "map_cache"),
    ("localhost:6379", "has no scheme"),
])
def test_bad_urls_name_the_value_and_what_is_accepted(url, fragment):
    with pytest.raises(ConfigError) as err:
        open_store(url)
    assert fragment in str(err.value)
    assert isinstance(err.value, ValueError)


def test_size_units():
    assert MemoryStore.from_url("memory://?max_bytes=8GiB").config.max_bytes == 8 << 30
    assert MemoryStore.from_url("memory://?max_bytes=1.5MB").config.max_bytes == 1_500_000
    assert isinstance(open_store(["memory://"]), MemoryStore)
