"""The store conformance suite: subclass ``StoreTests`` once per backend.

A subclass provides the ``store`` fixture (a fresh, empty store, large enough for every value
the suite writes) and implements ``bypass_get``/``bypass_put``, which read and write the backend
*without going through the store under test* (a raw client, the files on disk, another tier):
that is how the suite checks that the store really persisted a value, and that it reads values
another writer put there. Every backend — memory, file, Redis, Redis Cluster, S3, the tiered
store and wrappers — must pass every test here.
"""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABC, abstractmethod
from typing import Any

import xxhash

from kvstore.buffers import BufferPool, Pieces
from kvstore.keys import KEY_PREFIX
from kvstore.stores.base import Store

#: The stem of the product's keys and its format version (``kvs<format version>/...``).
_K = KEY_PREFIX


class _Sha256Seal:
    """A trailer for tests: the sha256 of every part but the first (a header's place)."""

    nbytes = 32
    first = 1

    def start(self) -> Any:
        return _Sha256Sealing()


class _Sha256Sealing:
    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: memoryview) -> None:
        self._hash.update(data)

    def finish(self) -> bytes:
        return self._hash.digest()


def _value(store: Store, key: str) -> bytes:
    """``store.get(key)`` as bytes; the key must be present."""
    value = store.get(key)
    assert value is not None, f"{key} is missing"
    return bytes(value)


class StoreTests(ABC):
    """Conformance tests. Subclasses define a ``store`` fixture yielding an empty store."""

    #: Largest value the suite writes; backends with a smaller limit lower it.
    large_value_bytes = 8 << 20

    @abstractmethod
    def bypass_get(self, store: Store, key: str) -> bytes | None:
        """The value of ``key`` read from the backend directly (not through ``store``)."""

    @abstractmethod
    def bypass_put(self, store: Store, key: str, value: bytes) -> None:
        """Write ``value`` under ``key`` into the backend directly, as another writer would."""

    # -- get / put / delete / exists ------------------------------------------------------------
    def test_get_missing_is_none(self, store: Store) -> None:
        assert store.get(f"{_K}/test/missing") is None
        assert store.exists(f"{_K}/test/missing") is False

    def test_put_then_get(self, store: Store) -> None:
        store.put(f"{_K}/test/a", b"hello")
        assert _value(store, f"{_K}/test/a") == b"hello"
        assert store.exists(f"{_K}/test/a")
        assert self.bypass_get(store, f"{_K}/test/a") == b"hello"

    def test_put_accepts_bytearray_and_memoryview(self, store: Store) -> None:
        buf = bytearray(b"0123456789")
        store.put(f"{_K}/test/ba", buf)
        store.put(f"{_K}/test/mv", memoryview(buf)[2:6])
        buf[:] = b"xxxxxxxxxx"  # callers may reuse their buffers once put returns
        assert _value(store, f"{_K}/test/ba") == b"0123456789"
        assert _value(store, f"{_K}/test/mv") == b"2345"

    def test_overwrite(self, store: Store) -> None:
        store.put(f"{_K}/test/k", b"one")
        store.put(f"{_K}/test/k", b"two!")
        assert _value(store, f"{_K}/test/k") == b"two!"

    def test_empty_value(self, store: Store) -> None:
        store.put(f"{_K}/test/empty", b"")
        value = store.get(f"{_K}/test/empty")
        assert value is not None and bytes(value) == b""

    def test_delete(self, store: Store) -> None:
        store.put(f"{_K}/test/d", b"x")
        assert store.delete(f"{_K}/test/d") is True
        assert store.get(f"{_K}/test/d") is None
        assert store.delete(f"{_K}/test/d") is False

    def test_large_value_roundtrip(self, store: Store) -> None:
        value = os.urandom(self.large_value_bytes)
        store.put(f"{_K}/test/large", value)
        assert _value(store, f"{_K}/test/large") == value

    def test_value_written_directly_is_read(self, store: Store) -> None:
        self.bypass_put(store, f"{_K}/test/planted", b"planted")
        assert _value(store, f"{_K}/test/planted") == b"planted"

    # -- batch forms ----------------------------------------------------------------------------
    def test_put_many_get_many(self, store: Store) -> None:
        items = [(f"{_K}/test/m{i}", os.urandom(100 + i)) for i in range(20)]
        store.put_many(items)
        got = store.get_many([k for k, _ in items] + [f"{_K}/test/absent"])
        assert [g if g is None else bytes(g) for g in got[:-1]] == [v for _, v in items]
        assert got[-1] is None

    def test_get_many_empty(self, store: Store) -> None:
        assert store.get_many([]) == []

    def test_exists_many(self, store: Store) -> None:
        store.put_many([(f"{_K}/test/e0", b"0"), (f"{_K}/test/e2", b"2")])
        assert store.exists_many([f"{_K}/test/e0", f"{_K}/test/e1", f"{_K}/test/e2"]) == [True, False, True]

    def test_longest_prefix(self, store: Store) -> None:
        keys = [f"{_K}/test/p{i}" for i in range(10)]
        assert store.longest_prefix(keys) == 0
        store.put_many([(k, b"v") for k in keys[:6]])
        store.put(keys[8], b"v")  # present but after a gap: not part of the prefix
        assert store.longest_prefix(keys) == 6
        assert store.longest_prefix(keys[:3]) == 3
        assert store.longest_prefix([]) == 0

    def test_delete_many(self, store: Store) -> None:
        store.put_many([(f"{_K}/test/x{i}", b"v") for i in range(4)])
        assert store.delete_many([f"{_K}/test/x{i}" for i in range(6)]) == 4
        assert store.get(f"{_K}/test/x0") is None

    def test_size_many(self, store: Store) -> None:
        store.put(f"{_K}/test/s", b"12345")
        assert store.size_many([f"{_K}/test/s", f"{_K}/test/none"]) == [5, None]

    def test_get_heads(self, store: Store) -> None:
        big = os.urandom(3 << 20)
        store.put_many([(f"{_K}/test/h-big", big), (f"{_K}/test/h-small", b"abc"), (f"{_K}/test/h-empty", b"")])
        keys = [f"{_K}/test/h-big", f"{_K}/test/h-small", f"{_K}/test/h-none", f"{_K}/test/h-empty"]
        assert store.get_heads(keys, 1000) == [(len(big), big[:1000]), (3, b"abc"), None, (0, b"")]
        assert store.get_heads(keys[:2], 1) == [(len(big), big[:1]), (3, b"a")]
        assert store.get_heads([], 10) == []
        try:
            store.get_heads(keys, 0)
        except ValueError:
            pass
        else:
            raise AssertionError("get_heads(keys, 0) must raise ValueError")

    def test_iter_keys(self, store: Store) -> None:
        store.put_many([(f"{_K}/aa/1", b"1"), (f"{_K}/aa/2", b"2"), (f"{_K}/bb/1", b"3")])
        assert sorted(store.iter_keys(f"{_K}/aa/")) == [f"{_K}/aa/1", f"{_K}/aa/2"]
        assert set(store.iter_keys()) >= {f"{_K}/aa/1", f"{_K}/aa/2", f"{_K}/bb/1"}

    # -- values in pieces, reads into leased buffers ----------------------------------------------
    def test_put_pieces_stores_them_joined(self, store: Store) -> None:
        big = os.urandom(3 << 20)
        store.put(f"{_K}/test/pc", Pieces([b"head:", bytearray(b"body:"), memoryview(b"tail")]))
        store.put_many([(f"{_K}/test/pc-big", Pieces([b"h" * 100, memoryview(big)]))])
        assert _value(store, f"{_K}/test/pc") == b"head:body:tail"
        assert _value(store, f"{_K}/test/pc-big") == b"h" * 100 + big
        store.flush(10)
        assert self.bypass_get(store, f"{_K}/test/pc") == b"head:body:tail"

    def test_sealed_pieces_end_with_their_trailer(self, store: Store) -> None:
        # A record's checksum is such a trailer: computed as the store sends the pieces.
        big = os.urandom((3 << 20) + 5)
        expected = {f"{_K}/test/seal": b"head" + big + hashlib.sha256(big).digest(),
                    f"{_K}/test/seal-small": b"h" + b"body" + hashlib.sha256(b"body").digest()}
        store.put(f"{_K}/test/seal", Pieces([b"head", memoryview(big)], seal=_Sha256Seal()))
        store.put_many([(f"{_K}/test/seal-small", Pieces([b"h", b"body"], seal=_Sha256Seal()))])
        for key, value in expected.items():
            assert _value(store, key) == value
        store.flush(10)
        assert self.bypass_get(store, f"{_K}/test/seal") == expected[f"{_K}/test/seal"]

    def test_a_leased_value_outlives_its_writers_release(self, store: Store) -> None:
        pool = BufferPool(8 << 20)
        expected = os.urandom(1 << 20)
        lease = pool.lease(len(expected))
        assert lease is not None
        lease.view[:] = expected
        store.put(f"{_K}/test/lease", Pieces([b"hdr", lease.view], owner=lease))
        lease.release()  # the caller is done; a store that keeps the value must have retained it
        again = pool.lease(len(expected))  # the same buffer, unless the store still holds it
        assert again is not None
        again.view[:] = bytes(len(expected))
        store.flush(10)
        assert _value(store, f"{_K}/test/lease") == b"hdr" + expected
        again.release()

    def test_get_into_yields_leases_in_key_order(self, store: Store) -> None:
        items = [(f"{_K}/test/gi{i}", os.urandom(1000 + (i % 3) * (1 << 20))) for i in range(6)]
        store.put_many(items)
        pool = BufferPool(64 << 20)
        keys = [k for k, _ in items[:3]] + [f"{_K}/test/gi-missing"] + [k for k, _ in items[3:]]
        want = [v for _, v in items[:3]] + [None] + [v for _, v in items[3:]]
        got = []
        for lease in store.get_into(keys, pool):
            got.append(None if lease is None else bytes(lease.view))
            if lease is not None:
                lease.release()
        assert got == want
        assert pool.stats()["leased_bytes"] == 0
        assert list(store.get_into([], pool)) == []

    def test_a_digest_set_on_a_lease_is_exactly_the_values(self, store: Store) -> None:
        # Readers check records against it: a wrong one would pass a corrupt record, or reject a good one.
        sizes = [0, 7, 8, 9, 1000, (3 << 20) + 3]
        items = [(f"{_K}/test/dg{i}", os.urandom(n)) for i, n in enumerate(sizes)]
        store.put_many(items)
        pool = BufferPool(64 << 20)
        for (_, value), lease in zip(items, store.get_into([k for k, _ in items], pool)):
            assert lease is not None and bytes(lease.view) == value
            if lease.digest is not None:
                assert len(value) >= 8 and lease.digest == xxhash.xxh3_64_digest(value[:-8])
            lease.release()

    def test_get_into_closed_early_releases_what_it_prefetched(self, store: Store) -> None:
        items = [(f"{_K}/test/ge{i}", os.urandom(2 << 20)) for i in range(8)]
        store.put_many(items)
        pool = BufferPool(64 << 20)
        stream = store.get_into([k for k, _ in items], pool)
        first = next(stream)
        assert first is not None and bytes(first.view) == items[0][1]
        first.release()
        stream.close()
        assert pool.stats()["leased_bytes"] == 0

    # -- flush and deadline ---------------------------------------------------------------------
    def test_flush_says_every_accepted_write_landed(self, store: Store) -> None:
        # Callers that shut down or hand a store over rely on True meaning "nothing is pending".
        assert store.flush(10) is True  # nothing written yet
        items = [(f"{_K}/test/fl{i}", os.urandom(1000 + i)) for i in range(8)]
        store.put_many(items)
        store.put(f"{_K}/test/fl-one", b"one")
        assert store.flush(10) is True
        for key, value in items:
            assert self.bypass_get(store, key) == value
        assert self.bypass_get(store, f"{_K}/test/fl-one") == b"one"
        assert store.flush(0) is True  # idle again: even a zero timeout has nothing to wait for

    def test_deadline_is_none_or_a_positive_bound(self, store: Store) -> None:
        # The tiered store and the cost model size their waits from it: it must be a real bound.
        deadline = store.deadline
        assert deadline is None or (isinstance(deadline, float | int) and 0 < deadline < 3600), deadline
        assert store.deadline == deadline  # a property of the configuration, not of the moment

    # -- concurrency and description ------------------------------------------------------------
    def test_concurrent_writers_and_readers(self, store: Store) -> None:
        errors: list[BaseException] = []
        written: dict[str, bytes] = {}
        lock = threading.Lock()

        def work(t: int) -> None:
            try:
                for i in range(25):
                    key = f"{_K}/test/t{t}-{i}"
                    value = bytes([t, i]) * 500
                    store.put(key, value)
                    with lock:
                        written[key] = value
                    got = store.get(key)
                    assert got is not None and bytes(got) == value, key
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert len(written) == 100
        store.flush(10)
        got = store.get_many(list(written))
        assert [None if v is None else bytes(v) for v in got] == list(written.values())
        for key in list(written)[::10]:
            assert self.bypass_get(store, key) == written[key]

    def test_concurrent_write_batches_all_land(self, store: Store) -> None:
        # Batches from several threads at once: a store that spreads a batch over threads of its
        # own must never leave one batch waiting on a thread another batch holds.
        errors: list[BaseException] = []

        def batch(t: int, b: int) -> list[tuple[str, bytes]]:
            return [(f"{_K}/test/cb{t}-{b}-{i}", bytes([t, b, i]) * 20_000) for i in range(8)]

        def work(t: int) -> None:
            try:
                for b in range(6):
                    store.put_many(batch(t, b))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "write batches stopped making progress"
        assert not errors, errors
        store.flush(10)
        for t in range(6):
            for b in range(6):
                items = batch(t, b)
                got = store.get_many([k for k, _ in items])
                assert [None if v is None else bytes(v) for v in got] == [v for _, v in items], (t, b)

    def test_describe_is_json(self, store: Store) -> None:
        import json

        json.dumps(store.describe())
        assert type(store).__name__ in repr(store)
