"""MooncakeStore against a real ``mooncake_master`` over TCP on loopback (tests/servers.py).

The store contract, its options, its calls (one batch call per load window, one per lookup,
into registered memory), a tiered memory -> mooncake -> file store, and the faults: the master
killed or frozen (the breaker skips the tier after one deadline, writes are dropped and counted,
the tier comes back with the master), the process that owns a segment killed (its objects are
misses, and heal), objects evicted once their leases expire (misses).
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
from fault_servers import CallLog, Counting
from servers import freeze, thaw
from test_faults import FAST, GUARD, _engine_batch_with_frozen_tier, _outage, values, wait_for

from kvstore.buffers import BufferPool, Pieces
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.keys import KEY_PREFIX as _K
from kvstore.stores import open_store
from kvstore.stores.mooncake import MooncakeConfig
from kvstore.stores.tiered import TieredStore
from kvstore.testing.store_tests import StoreTests

_prefixes = itertools.count()


def fresh(master, **options):
    """A store of ``master`` under a prefix no other test uses (an empty store)."""
    from kvstore.stores.mooncake import MooncakeStore

    options.setdefault("segment", 0)
    options.setdefault("deadline", "5s")  # the tests of deadlines give their own; the rest run beside vLLM in CI
    store = open_store(master.url_for(prefix=f"t{os.getpid()}-{next(_prefixes)}/", **options))
    assert isinstance(store, MooncakeStore)
    return store


def wipe(store) -> None:
    store.delete_many(list(store.iter_keys()))
    store.close()


class Raw:
    """Mooncake's own client, for reading and writing the pool past the store under test."""

    def __init__(self, master) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        rc = self.client.setup("127.0.0.1", master.metadata_url, 0, 64 << 20, "tcp", "", f"127.0.0.1:{master.port}")
        assert rc == 0

    def get(self, name: str) -> bytes | None:
        return bytes(self.client.get(name)) if self.client.is_exist(name) == 1 else None

    def put(self, name: str, value: bytes) -> None:
        assert self.client.upsert(name, value) == 0


@pytest.fixture(scope="module")
def keeper(mooncake_master):
    """A store open for the whole module: the stores of its tests share its client (one per
    process and settings), instead of each setting one up and closing it (closing a client
    holds the interpreter's lock for a second or two, in the library)."""
    store = fresh(mooncake_master)
    yield store
    store.close()


@pytest.fixture(scope="module")
def raw(mooncake_master):
    client = Raw(mooncake_master)
    yield client
    client.client.close()


class TestMooncakeStore(StoreTests):
    @pytest.fixture
    def store(self, mooncake_master, raw, keeper):
        self.raw = raw
        store = fresh(mooncake_master)
        yield store
        wipe(store)

    def bypass_get(self, store, key):
        empty = self.raw.get(store.config.prefix + key + "\x00")
        return self.raw.get(store.config.prefix + key) or (b"" if empty is not None else None)

    def bypass_put(self, store, key, value):
        self.raw.put(store.config.prefix + key, value)


# -- options ------------------------------------------------------------------------------------------
def test_options_are_parsed_range_checked_and_unknown_ones_refused():
    c = MooncakeConfig.from_url("mooncake://10.0.0.5?segment=4GiB&replicas=2&deadline=500ms&protocol=rdma"
                                "&device=mlx5_0,mlx5_1&prefix=app/")
    assert (c.master, c.segment, c.replicas, c.deadline, c.protocol, c.device, c.prefix) == (
        "10.0.0.5:50051", 4 << 30, 2, 0.5, "rdma", "mlx5_0,mlx5_1", "app/")
    assert c.metadata_url == "http://10.0.0.5:8080/metadata" and c.admin_url == "http://10.0.0.5:9003"
    assert MooncakeConfig.from_url("mooncake://h:7000?metadata=http://m:1/metadata").metadata_url == "http://m:1/metadata"
    for url, named in [("mooncake://h?segmnt=1GiB", "'segmnt'"), ("mooncake://h?replicas=0", "replicas='?0"),
                       ("mooncake://h?replicas=9", "replicas='?9"), ("mooncake://h?deadline=0", "deadline=0"),
                       ("mooncake://h?deadline=10m", "deadline=600"), ("mooncake://h?protocol=udp", "protocol='udp'"),
                       ("mooncake://h?segment=2TiB", "segment='2TiB'"), ("mooncake://h?window=1k", "window='1k'"),
                       ("mooncake://h?workers=0", "workers='?0"), ("mooncake://h:99999", "'99999'"),
                       ("mooncake://h?metadata=etcd://e:2379", "metadata='etcd://e:2379'"),
                       ("mooncake://h?device=mlx5_0", "device='mlx5_0'"), ("mooncake://u:p@h", "credentials"),
                       ("mooncake://h/path", "'/path'"), ("mooncake://?segment=0", "names no master"),
                       ("mooncake://h?host=a%20b", "host='a b'")]:
        with pytest.raises(ConfigError, match=named):  # parsed without the client (no wheel needed)
            MooncakeConfig.from_url(url)


def test_building_a_store_does_no_io_and_an_absent_master_costs_one_deadline():
    from conftest import require_mooncake
    from servers import free_port

    require_mooncake()
    before = threading.active_count()
    store = open_store(f"mooncake://127.0.0.1:{free_port()}?segment=0&deadline=500ms")  # nothing listens there
    try:
        assert threading.active_count() == before  # no set-up until a call needs the client
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):  # the client's set-up retries for ~90 s; the call waits 0.5 s
            store.exists("k")
        assert time.monotonic() - start < 5
    finally:
        store.close()


def test_a_key_with_a_nul_is_refused(mooncake_master):
    store = fresh(mooncake_master)
    try:
        with pytest.raises(ValueError, match="NUL"):
            store.put("a\x00b", b"x")
    finally:
        wipe(store)


# -- the calls: batch calls, into registered memory --------------------------------------------------
class CountingClient:
    """The real client, every call counted by name (nothing is changed or faked)."""

    def __init__(self, client) -> None:
        self._client, self.calls = client, []

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return call


def test_a_load_is_one_size_call_and_one_batch_read_per_window_into_registered_leases(mooncake_master):
    store = fresh(mooncake_master, window="8MiB", register="always")  # over TCP only to count them
    try:
        items = [(f"{_K}/w/{i}", os.urandom(3 << 20)) for i in range(6)]  # 18 MiB: windows of 9, 9 MiB
        store.put_many(items)
        conn = store._conn
        conn.client(time.monotonic() + GUARD)
        counting = CountingClient(conn._client)
        conn._client = counting
        pool = BufferPool(64 << 20)
        try:
            registrations = []
            for _ in range(2):
                got = []
                for lease in store.get_into([k for k, _ in items], pool):
                    got.append(bytes(lease.view))
                    lease.release()
                assert got == [v for _, v in items]
                registrations.append(counting.calls.count("register_buffer"))
            batch = [c for c in counting.calls if c.startswith("batch_")]
            assert batch == ["batch_get_replica_desc", "batch_get_into", "batch_get_into"] * 2
            # The pool's buffers are registered the first time values land in them, and only then.
            assert registrations[0] >= 3 and registrations[1] == registrations[0], registrations
            counting.calls.clear()
            assert store.longest_prefix([k for k, _ in items] + [f"{_K}/w/none"]) == 6
            assert store.exists_many([items[0][0], f"{_K}/w/none"]) == [True, False]
            assert counting.calls == ["batch_is_exist", "batch_is_exist"]  # one per lookup
            counting.calls.clear()
            store.put_many(items[:2])
            assert [c for c in counting.calls if c.startswith("batch_")] == ["batch_upsert_from"]
        finally:
            conn._client = counting._client
        assert pool.stats()["leased_bytes"] == 0
    finally:
        wipe(store)


def test_a_record_in_pieces_is_gathered_with_its_trailer_and_a_lease_is_sent_where_it_lies(mooncake_master):
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.record import decode_record, encode_record

    store = fresh(mooncake_master)
    try:
        ns = Namespace(model="m", kv_dtype="float32", layout="t", block_size=4, chunk_tokens=8, layer_end=2)
        tokens = np.arange(8, dtype=np.uint32)
        chunk = chunk_keys(ns, tokens)[0]
        kv = np.random.default_rng(0).standard_normal(2 * 2 * 8 * 4, dtype=np.float32)
        record = encode_record(namespace=ns, chunk=chunk, tokens=tokens, dtype="float32", shapes=[(2, 8, 4)] * 2, kv=kv)
        store.put(chunk.key, record)  # header, payload, trailer: gathered into the store's registered memory
        decode_record(store.get(chunk.key), namespace=ns, chunk=chunk, tokens=tokens, dtype="float32")
        pool = BufferPool(8 << 20)
        lease = pool.lease(1 << 20)
        lease.view[:] = os.urandom(1 << 20)
        expected = bytes(lease.view)
        staged = store._staging.stats()["leases"]
        store.put("leased", Pieces([lease.view], owner=lease))  # sent from the lease itself
        assert store._staging.stats()["leases"] == staged
        lease.release()
        assert bytes(store.get("leased")) == expected
    finally:
        wipe(store)


# -- a tiered store: memory -> mooncake -> file ----------------------------------------------------------
def test_tiered_memory_mooncake_file(mooncake_master, tmp_path):
    url = mooncake_master.url_for(prefix=f"tiered{os.getpid()}/", segment=0, deadline="5s")
    items = [(f"{_K}/tier/{i}", os.urandom(1 << 20)) for i in range(8)]
    writer = open_store(["memory://?max_bytes=64MiB", url, f"file://{tmp_path}"])
    try:
        writer.put_many(items)
        assert writer.flush(GUARD)
    finally:
        writer.close()
    reader = open_store(["memory://?max_bytes=64MiB", url, f"file://{tmp_path}"])
    try:
        assert [t.name for t in reader.tiers] == ["memory", "mooncake", "file"]
        assert reader.longest_prefix_by_tier([k for k, _ in items]) == [0, 8, 0]
        pool = BufferPool(64 << 20)
        got = []
        for lease in reader.get_into([k for k, _ in items], pool):
            got.append(bytes(lease.view))
            lease.release()
        assert got == [v for _, v in items]
        mooncake = reader.tiers[1].store
        mooncake.delete_many([k for k, _ in items[4:]])  # gone from the pool: the file tier has them
        assert [bytes(v) for v in reader.get_many([k for k, _ in items])] == [v for _, v in items]
    finally:
        reader.tiers[1].store.delete_many([k for k, _ in items])
        reader.close()


# -- faults -----------------------------------------------------------------------------------------------
def test_a_call_to_a_frozen_master_ends_at_its_deadline(mooncake_master_factory):
    # client_ttl: a freeze longer than it (a loaded machine) would make the thawed master drop
    # the owner's segment, and "k" with it: the tier is back, empty (test_master_killed...'s case).
    master = mooncake_master_factory(client_ttl=60)
    master.owner("64MB")
    store = settled(fresh(master, deadline="1s"))
    try:
        assert wait_for(lambda: _answers(store.put, "k", b"v") is None)
        freeze(master.pid)
        try:
            for call in (lambda: store.get("k"), lambda: store.exists("k"), lambda: store.put("k2", b"v")):
                start = time.monotonic()
                with pytest.raises(StoreTimeoutError):
                    call()
                assert time.monotonic() - start < 5  # the client's own would be 30 s
        finally:
            thaw(master.pid)
        assert wait_for(lambda: _answers(store.get, "k") == b"v")
    finally:
        store.close()


def settled(store):
    """``store`` once its client is set up and answers (a loaded machine may take longer than a
    short deadline for the first call)."""
    def answers() -> bool:
        try:
            store.exists("settle")
        except StoreUnavailableError:
            return False
        return True

    assert wait_for(answers)
    return store


def _answers(fn, *args):
    try:
        value = fn(*args)
    except StoreUnavailableError:
        return "unavailable"
    return None if value is None else bytes(value)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed-and-restarted", "frozen"])
def test_master_killed_or_frozen_mid_batch_then_back(mooncake_master_factory, sig):
    master = mooncake_master_factory()
    master.owner("128MB")
    log = CallLog()
    tier = Counting(settled(fresh(master, deadline="500ms")), log)
    store = TieredStore([open_store("memory://?max_bytes=1MiB"), tier], **FAST)  # reads reach Mooncake
    data = values(32, 64 << 10)
    try:
        store.put_many(data.items())
        assert store.flush(GUARD)
        if sig == signal.SIGKILL:  # refused at once: breaker_failures of them; back on the same ports, empty
            _outage(store, data, log, master.stop, master.start, allowed=FAST["breaker_failures"],
                    outcome="unavailable")
        else:  # frozen: the first call's deadline expires, and that opens the breaker
            _outage(store, data, log, lambda: freeze(master.pid), lambda: thaw(master.pid), allowed=1,
                    outcome="timeout")
        writer = store.tiers[1].writer
        assert writer is not None and writer.dropped > 0  # the hammer's writes while it was out: counted

        def lands() -> bool:  # a restarted master has no segment until its owner mounts it again
            store.put(f"{_K}/fault/after", b"back")
            return store.flush(GUARD) and _answers(tier.get, f"{_K}/fault/after") == b"back"
        assert wait_for(lands)
    finally:
        if sig == signal.SIGSTOP:
            thaw(master.pid)
        store.close(timeout=2)


def test_engine_requests_while_the_master_is_frozen(mooncake_master_factory):
    master = mooncake_master_factory()
    master.owner("64MB")
    log = CallLog()
    _engine_batch_with_frozen_tier(Counting(settled(fresh(master, deadline="500ms")), log), master.pid, log)


def test_the_segment_owner_killed_its_objects_are_misses_that_heal(mooncake_master_factory):
    master = mooncake_master_factory(client_ttl=2)
    first = master.owner("64MB")
    store = fresh(master)
    items = [(f"{_K}/owner/{i}", os.urandom(256 << 10)) for i in range(8)]
    keys = [k for k, _ in items]
    pool = BufferPool(16 << 20)

    def load() -> list[bytes | None]:
        out = []
        for lease in store.get_into(keys, pool):
            out.append(None if lease is None else bytes(lease.view))
            if lease is not None:
                lease.release()
        return out

    try:
        store.put_many(items)
        assert load() == [v for _, v in items]
        first.stop()  # SIGKILL: the segment, and every object in it, is gone
        assert load() == [None] * len(items)  # misses, never an error: the master still answers
        assert store.get_many(keys) == [None] * len(items)
        master.owner("64MB")  # another owner: the pool has room again
        assert wait_for(lambda: not any(store.exists_many(keys)))  # the master dropped the dead segment
        store.put_many(items)  # the reader's recompute, saved again
        assert load() == [v for _, v in items]
        assert pool.stats()["leased_bytes"] == 0
    finally:
        wipe(store)


def test_objects_evicted_or_read_past_their_leases_are_misses(mooncake_master_factory):
    master = mooncake_master_factory(lease_ttl="50ms")
    master.owner("32MB")
    store = fresh(master)
    keys = [f"{_K}/evict/{i:03d}" for i in range(80)]
    value = os.urandom(1 << 20)
    try:
        for i in range(0, len(keys), 4):  # 80 MiB into a 32 MB pool: it evicts at its watermark
            store.put_many([(k, value) for k in keys[i:i + 4]])
            time.sleep(0.06)  # their leases expire: evictable
        present = store.exists_many(keys)
        assert not all(present) and any(present), present
        # Which ones went is Mooncake's choice; and a read slower than the 50 ms lease it is granted
        # (a loaded machine) is refused whole (LEASE_EXPIRED): misses, never an error, never wrong bytes.
        got = store.get_many(keys)
        assert all(v is None or bytes(v) == value for v in got)
        pool = BufferPool(64 << 20)
        for lease in store.get_into(keys, pool):  # sizes asked before: some may go in between, still misses
            if lease is not None:
                assert bytes(lease.view) == value
                lease.release()
    finally:
        wipe(store)


def test_a_late_read_keeps_its_leases_until_it_ends(mooncake_master_factory):
    """A load whose read outlives its deadline (a frozen master) gives its leases back to the
    pool only once the call has ended: nothing ever writes into a buffer someone else holds."""
    master = mooncake_master_factory()
    master.owner("64MB")
    store = settled(fresh(master, deadline="1s"))
    pool = BufferPool(16 << 20)
    try:
        items = [(f"k{i}", os.urandom(1 << 20)) for i in range(4)]
        assert wait_for(lambda: _answers(store.put_many, items) is None)
        stream = store.get_into([f"k{i}" for i in range(4)], pool)
        sizes_asked = threading.Event()
        original = store._sizes

        def sizes_then_freeze(names):
            out = original(names)
            freeze(master.pid)
            sizes_asked.set()
            return out

        store._sizes = sizes_then_freeze
        try:
            with pytest.raises(StoreTimeoutError):
                next(stream)
            assert sizes_asked.is_set()
            assert pool.stats()["leased_bytes"] > 0  # the read still holds them
        finally:
            thaw(master.pid)
        assert wait_for(lambda: pool.stats()["leased_bytes"] == 0)
    finally:
        thaw(master.pid)
        store.close()
