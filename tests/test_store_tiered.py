"""TieredStore: the conformance suite over [memory, redis, s3] and over a single Redis tier,
plus fall-through, promotion, the write queue, the breaker and the statistics."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvstore.buffers import BufferPool
from kvstore.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from kvstore.metrics.catalog import WRITE_DROPS
from kvstore.stores import open_store
from kvstore.stores.base import Store
from kvstore.stores.memory import MemoryStore
from kvstore.stores.tiered import TieredStore
from kvstore.stores.tiered.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvstore.testing.store_tests import StoreTests


class TestTieredMemoryRedisS3(StoreTests):
    @pytest.fixture
    def store(self, redis_server, s3_server):
        redis_server.flushall()
        s3_server.clear()
        store = open_store(["memory://?max_bytes=64MiB", redis_server.url, s3_server.url])
        assert isinstance(store, TieredStore)
        yield store
        store.close()

    def bypass_get(self, store, key):
        store.flush(10)
        value = store.tiers[-1].store.get(key)  # the last tier: every write reaches it
        return None if value is None else bytes(value)

    def bypass_put(self, store, key, value):
        store.tiers[1].store.put(key, value)  # another replica's write: in Redis, not in our memory tier


class TestTieredSingleRedis(StoreTests):
    """The engine connectors wrap even one Redis URL: writes are asynchronous there too."""

    @pytest.fixture
    def store(self, redis_server):
        redis_server.flushall()
        store = TieredStore([open_store(redis_server.url)])
        yield store
        store.close()

    def bypass_get(self, store, key):
        store.flush(10)
        with redis_server_client(store) as client:
            return client.get(key)

    def bypass_put(self, store, key, value):
        with redis_server_client(store) as client:
            client.set(key, value)


def redis_server_client(store):
    import redis

    return redis.Redis(port=store.tiers[0].store.config.hosts[0][1])


def wait_until(check, timeout: float = 10.0) -> bool:
    """Poll ``check`` until it holds (a condition to reach, not a delay to sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.005)
    return False


class SlowStore(MemoryStore):
    """A shared (non-local) tier that takes ``delay`` seconds per write: fills the queue."""

    is_local = False

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

        self.gate_waiters = 0

    def put(self, key, value):
        self.gate_waiters += 1
        self.gate.wait(10)
        self.gate_waiters -= 1
        time.sleep(self.delay)
        super().put(key, value)

    def describe(self):
        return {"store": "slow"}


class BrokenStore(Store):
    """A shared tier that is down until ``up`` is set; counts the calls that reached it."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0
        self.inner = MemoryStore()

    def _check(self):
        self.calls += 1
        if not self.up:
            raise StoreUnavailableError("broken tier is down")

    def get(self, key):
        self._check()
        return self.inner.get(key)

    def put(self, key, value):
        self._check()
        self.inner.put(key, value)

    def delete(self, key):
        self._check()
        return self.inner.delete(key)

    def iter_keys(self, prefix=""):
        self._check()
        return self.inner.iter_keys(prefix)

    def describe(self):
        return {"store": "broken"}


def test_reads_fall_through_and_promote(redis_server, s3_server):
    redis_server.flushall()
    s3_server.clear()
    mem, red, s3 = open_store("memory://"), open_store(redis_server.url), open_store(s3_server.url)
    store = TieredStore([mem, red, s3])
    try:
        s3.put("k1", b"from-s3")
        red.put("k2", b"from-redis")
        assert store.get_many(["k1", "k2", "k3"]) == [b"from-s3", b"from-redis", None]
        assert mem.get("k1") == b"from-s3" and mem.get("k2") == b"from-redis"  # local tier: at once
        assert store.flush(10)
        assert red.get("k1") == b"from-s3"  # shared tier above: through its queue
        assert s3.get("k2") is None  # never pushed down by a read
    finally:
        store.close()


def test_loads_measure_each_tiers_read_speed_even_when_the_reader_stops_early():
    """The cost model's input: a reader that ``zip``s its keys with the stream never asks past the
    last value (the stream is closed, not exhausted); that read must still be timed."""
    class SlowReads(MemoryStore):
        is_local = False

        def get_into(self, keys, pool, place=None):
            time.sleep(0.05)
            return super().get_into(keys, pool, place)

    fast, slow = MemoryStore(), SlowReads()
    store = TieredStore([fast, slow])
    pool = BufferPool(16 << 20)
    try:
        fast.put("a", bytes(2 << 20))
        slow.put("b", bytes(2 << 20))
        slow.put("tiny", b"x")
        for keys in (["a", "b"], ["tiny"]):
            stream = store.get_into(keys, pool)
            for _, lease in zip(keys, stream):
                assert lease is not None
                lease.release()
            stream.close()
        mem, shared = store.tiers
        assert mem.speed.take_reads()[::2] == (2 << 20, 1) and mem.speed.take_reads() == (0, 0.0, 0)
        nbytes, seconds, reads = shared.speed.take_reads()
        assert (nbytes, reads) == (2 << 20, 1) and seconds >= 0.05  # the 1-byte read says nothing of bandwidth
        assert mem.speed.bandwidth is not None and shared.speed.bandwidth < mem.speed.bandwidth
    finally:
        store.close()


def test_longest_prefix_is_the_max_over_tiers_and_stops_early():
    a, b = MemoryStore(), MemoryStore()
    calls = []
    b.longest_prefix = lambda keys: calls.append(keys) or MemoryStore.longest_prefix(b, keys)
    store = TieredStore([a, b])
    keys = [f"k{i}" for i in range(6)]
    a.put_many([(k, b"v") for k in keys[:2]])
    b.put_many([(k, b"v") for k in keys[:4]])
    assert store.longest_prefix(keys) == 4 and len(calls) == 1
    a.put_many([(k, b"v") for k in keys])
    assert store.longest_prefix(keys) == 6 and len(calls) == 1  # the first tier covered everything


def test_writes_local_now_shared_later_and_flush():
    slow = SlowStore(0.05)
    mem = MemoryStore()
    store = TieredStore([mem, slow])
    try:
        store.put_many([(f"k{i}", b"v") for i in range(4)])
        assert all(mem.get(f"k{i}") == b"v" for i in range(4))
        assert store.get("k3") == b"v" and store.longest_prefix([f"k{i}" for i in range(4)]) == 4
        assert store.flush(5)
        assert all(slow.get(f"k{i}") == b"v" for i in range(4))
        assert store.stats()["tiers"][1]["queue_items"] == 0
    finally:
        store.close()


def test_full_queue_drops_and_counts_without_blocking(caplog):
    slow = SlowStore(0)
    slow.gate.clear()  # the writer blocks on its first batch
    store = TieredStore([slow], queue_items=4)
    drops = WRITE_DROPS
    before = drops.value(tier="slow", reason="queue_full")
    try:
        store.put("k0", b"x" * 100)
        assert wait_until(lambda: slow.gate_waiters > 0)  # the writer holds k0 and waits: the queue stays full
        with caplog.at_level(logging.WARNING, logger="kvstore.stores"):
            for i in range(1, 50):
                store.put(f"k{i}", b"x" * 100)  # never blocks: a full queue drops
        stats = store.stats()["tiers"][0]
        assert stats["dropped"] >= 40 and drops.value(tier="slow", reason="queue_full") - before == stats["dropped"]
        assert len([r for r in caplog.records if "queue full" in r.message]) == 1  # one line, not fifty
        slow.gate.set()
        assert store.flush(5)
    finally:
        store.close()


def test_wait_written_says_when_a_writer_sent_keys_or_dropped_them():
    slow = SlowStore(0)
    slow.gate.clear()
    store = TieredStore([MemoryStore(), slow], queue_items=2)
    try:
        store.put_many([("a", b"1"), ("b", b"2")])
        assert wait_until(lambda: slow.gate_waiters > 0)
        store.put_many([("c", b"3"), ("d", b"4"), ("e", b"5")])  # e: over the queue's 2 items, dropped
        assert not store.wait_written(["a", "b"], 0.05)  # still in flight
        slow.gate.set()
        assert store.wait_written(["a", "b", "c", "d"], 5)
        assert not store.wait_written(["c", "e"], 5)  # e was dropped, and the writer remembers
        assert store.wait_written(["never-written"], 0)  # nothing to wait for
        store.put("e", b"5")
        assert store.wait_written(["e"], 5)  # written the second time
    finally:
        store.close()


def test_queue_coalesces_writes_of_one_key_and_bounds_bytes():
    slow = SlowStore(0)
    slow.gate.clear()
    store = TieredStore([slow], queue_bytes="1KiB")
    try:
        store.put("first", b"x")  # the writer takes it and blocks on the gate
        assert wait_until(lambda: slow.gate_waiters > 0)
        for i in range(5):
            store.put("same", bytes([i]) * 100)
        store.put("big", b"y" * 2000)  # would pass queue_bytes: dropped
        assert store.stats()["tiers"][0]["queue_items"] == 2 and store.stats()["tiers"][0]["dropped"] == 1
        slow.gate.set()
        assert store.flush(5)
        assert slow.get("same") == bytes([4]) * 100 and slow.get("big") is None
    finally:
        store.close()


def test_breaker_skips_a_failing_tier_logs_once_and_resumes(caplog):
    broken = BrokenStore()
    mem = MemoryStore()
    now = [0.0]
    store = TieredStore([mem, broken], breaker_failures=2, breaker_cooldown="100ms", clock=lambda: now[0])
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.stores"):
            for i in range(20):
                assert store.get(f"missing{i}") is None  # never an exception
            assert broken.calls == 2  # then skipped
            assert store.stats()["tiers"][1]["state"] == OPEN
            broken.up = True
            broken.inner.put("there", b"v")
            assert store.get("there") is None  # still skipped within the cooldown
            assert broken.calls == 2 and store.tiers[1].probes == 0
            now[0] += 0.1
            # The tier's prober, not a caller, probes once the cooldown is over; it succeeds.
            assert wait_until(lambda: store.stats()["tiers"][1]["state"] == CLOSED)
            assert store.tiers[1].probes == 1 and broken.calls == 3
            assert store.get("there") == b"v"
        lines = [r for r in caplog.records if "tier broken" in r.message and r.levelno >= logging.INFO]
        assert [r.levelno for r in lines] == [logging.WARNING, logging.INFO], [r.message for r in lines]
    finally:
        store.close()


def test_expired_deadline_opens_the_breaker_at_once_and_callers_never_probe():
    class Frozen(BrokenStore):
        def _check(self):
            self.calls += 1
            if not self.up:
                raise StoreTimeoutError("no answer within its deadline")

    frozen = Frozen()
    now = [0.0]
    store = TieredStore([MemoryStore(), frozen], breaker_failures=3, breaker_cooldown="1s", clock=lambda: now[0])
    try:
        for i in range(10):
            assert store.get(f"k{i}") is None
        assert frozen.calls == 1 and store.stats()["tiers"][1]["state"] == OPEN  # one deadline, not three
        now[0] += 1.0  # the cooldown is over: only the prober probes (and fails again)
        assert wait_until(lambda: store.tiers[1].probes == 1 and store.tiers[1].breaker.state == OPEN)
        for i in range(10):
            assert store.get(f"k{i}") is None
        assert frozen.calls == 2  # callers still skipped; the probe was the one more call
    finally:
        store.close()


def test_breaker_state_machine():
    now = [0.0]
    b = CircuitBreaker("t", failures=2, cooldown=1.0, max_cooldown=4.0, clock=lambda: now[0])
    b.failure("x")
    assert b.state == CLOSED and b.allow()
    b.failure("x")
    assert b.state == OPEN and not b.allow()
    now[0] = 1.0
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # only one prober
    b.failure("still down")
    assert b.state == OPEN
    now[0] = 2.5
    assert not b.allow()  # the cooldown doubled to 2s
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()


def test_delete_withdraws_queued_writes():
    slow = SlowStore(0)
    slow.gate.clear()
    store = TieredStore([slow])
    try:
        store.put("a", b"1")
        assert wait_until(lambda: slow.gate_waiters > 0)  # "a" is in flight, blocked
        store.put("b", b"2")  # queued
        threading.Timer(0.2, slow.gate.set).start()
        assert store.delete_many(["a", "b"]) == 2
        assert store.flush(5)
        assert store.get("a") is None and store.get("b") is None
    finally:
        store.close()


def test_close_drains_with_a_bound():
    slow = SlowStore(0)
    slow.gate.clear()
    store = TieredStore([slow])
    store.put_many([(f"k{i}", b"v") for i in range(3)])
    assert wait_until(lambda: slow.gate_waiters > 0)
    store.close(timeout=0.3)  # returns although the writer is stuck (a hang here fails the run)
    assert store.flush(0) is False  # the stuck batch is still in flight: close did not wait for it
    slow.gate.set()


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_background_writes_still_queued_at_interpreter_exit_reach_the_store(backend, request):
    """A script that ends right after saving: Python's executors refuse work before ``atexit``
    hooks run, and the exit drain must still send every queued write."""
    import subprocess
    import sys

    server = request.getfixturevalue(f"{backend}_server")
    server.flushall() if backend == "redis" else server.clear()
    script = ("from kvstore.stores import shared\n"
              f"store = shared.acquire([{server.url!r}])\n"
              "store.put_many([(f'k{i}', bytes(4 << 20)) for i in range(12)])\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    with open_store(server.url) as store:
        assert sorted(store.iter_keys()) == sorted(f"k{i}" for i in range(12))


def test_stats_and_describe_are_json_and_hide_secrets(redis_server_factory):
    import json

    server = redis_server_factory("--requirepass", "tiered-pw")
    store = TieredStore.from_urls(["memory://", f"redis://:tiered-pw@127.0.0.1:{server.port}"])
    try:
        store.put("k", b"v")
        assert store.flush(5)
        text = json.dumps(store.describe())
        assert "tiered-pw" not in text and "tiered-pw" not in repr(store)
        names = [t["name"] for t in store.stats()["tiers"]]
        assert names == ["memory", "redis"]
        assert store.stats()["tiers"][1]["written"] == 1
    finally:
        store.close()


def test_bad_tiered_options_are_loud():
    with pytest.raises(ConfigError) as info:
        TieredStore.from_urls(["memory://"], queue_itemz=3)
    assert "queue_items" in str(info.value)
    with pytest.raises(ConfigError):
        TieredStore([])
