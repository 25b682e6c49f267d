"""Faults against real servers: the tiered store keeps answering (misses) within a bounded
delay, never returns a wrong value, and resumes a tier by itself when it comes back. The Redis
faults run against redis-server and valkey-server both (conftest.any_redis_factory)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvstore.errors import CorruptRecordError
from kvstore.keys import Namespace, chunk_keys
from kvstore.record import decode_record, encode_record
from kvstore.stores import open_store
from kvstore.stores.tiered import TieredStore
from kvstore.testing.damage import flip_byte, truncate


@pytest.fixture(scope="module")
def redis_server_factory(any_redis_factory):
    return any_redis_factory


@pytest.fixture(scope="module")
def redis_server(redis_server_factory):
    return redis_server_factory()


FAST = dict(breaker_failures=2, breaker_cooldown="200ms", breaker_max_cooldown="500ms")
BOUND = 2.0  # seconds: the longest any call may take while a tier is down or hung


def values(n: int, size: int = 256 << 10) -> dict[str, bytes]:
    return {f"kvs1/fault/{i:03d}": os.urandom(size) for i in range(n)}


def hammer(store, expected: dict[str, bytes], stop: threading.Event, report: dict) -> None:
    """Read and write in batches until ``stop``; record wrong values and the slowest call."""
    keys = list(expected)
    report.setdefault("wrong", 0)
    report.setdefault("slowest", 0.0)
    report.setdefault("calls", 0)
    i = 0
    while not stop.is_set():
        batch = keys[i % len(keys):][:16] or keys[:16]
        i += 16
        start = time.monotonic()
        got = store.get_many(batch)
        store.put_many([(k, expected[k]) for k in batch[:4]])
        store.longest_prefix(batch)
        report["slowest"] = max(report["slowest"], time.monotonic() - start)
        report["calls"] += 1
        report["wrong"] += sum(1 for k, v in zip(batch, got) if v is not None and bytes(v) != expected[k])


def wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signal_to_send", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_redis_killed_or_hung_mid_batch_then_back(redis_server_factory, signal_to_send):
    server = redis_server_factory()
    data = values(64)
    redis_url = server.url + "?timeout=300ms&connect_timeout=300ms"
    store = TieredStore.from_urls(["memory://?max_bytes=4MiB", redis_url], **FAST)
    try:
        store.put_many(data.items())
        assert store.flush(10)
        stop, report = threading.Event(), {}
        worker = threading.Thread(target=hammer, args=(store, data, stop, report))
        worker.start()
        time.sleep(0.3)
        if signal_to_send == signal.SIGKILL:
            server.stop()
        else:
            os.kill(server._proc.proc.pid, signal.SIGSTOP)
        time.sleep(1.5)  # the tier is down: calls keep coming back, as misses
        calls_while_down = report["calls"]
        assert wait_for(lambda: store.stats()["tiers"][1]["state"] != "closed", 5)
        if signal_to_send == signal.SIGKILL:
            server.start()  # back, empty
        else:
            os.kill(server._proc.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: store.stats()["tiers"][1]["state"] == "closed", 10), store.stats()
        stop.set()
        worker.join(10)
        assert report["wrong"] == 0
        assert report["slowest"] < BOUND, report
        assert calls_while_down > 3, report
        # Use resumed: a new write reaches Redis again.
        store.put("kvs1/fault/after", b"back")
        assert store.flush(5)
        with server.client() as raw:
            assert wait_for(lambda: raw.get("kvs1/fault/after") == b"back", 5)
    finally:
        store.close(timeout=2)


def test_s3_server_stopped_then_back(s3_server_factory):
    server = s3_server_factory()
    data = values(32, 64 << 10)
    s3_url = server.url_for("faults", timeout="500ms", connect_timeout="300ms", retries="0")
    store = TieredStore.from_urls(["memory://?max_bytes=1MiB", s3_url], **FAST)
    try:
        store.put_many(data.items())
        assert store.flush(20)
        stop, report = threading.Event(), {}
        worker = threading.Thread(target=hammer, args=(store, data, stop, report))
        worker.start()
        time.sleep(0.3)
        server.stop()
        time.sleep(1.0)
        assert store.stats()["tiers"][1]["state"] != "closed"
        server.start()  # objects live on disk: they come back with the server
        assert wait_for(lambda: store.stats()["tiers"][1]["state"] == "closed", 10), store.stats()
        stop.set()
        worker.join(10)
        assert report["wrong"] == 0 and report["slowest"] < BOUND, report
        key = next(reversed(data))
        assert wait_for(lambda: store.get(key) == data[key], 5)
    finally:
        store.close(timeout=2)


def _records(n: int, tokens_per_chunk: int = 16):
    ns = Namespace(model="fault-test", kv_dtype="bfloat16", layout="test", block_size=16, chunk_tokens=tokens_per_chunk)
    tokens = np.arange(n * tokens_per_chunk, dtype=np.uint32)
    chunks = chunk_keys(ns, tokens)
    shapes = [(2, tokens_per_chunk, 2, 8)]
    out = []
    for c in chunks:
        kv = np.random.default_rng(c.index).standard_normal(2 * tokens_per_chunk * 2 * 8).astype(np.float16).view(np.uint16)
        rec = bytes(encode_record(namespace=ns, chunk=c, tokens=tokens[c.start:c.end], dtype="bfloat16",
                                  shapes=shapes, kv=kv))
        out.append((c, rec))
    return ns, tokens, out


def test_records_deleted_or_evicted_between_lookup_and_get(redis_server_factory):
    # A tiny maxmemory with LRU eviction: the server throws records away on its own.
    server = redis_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    ns, tokens, records = _records(8)
    store = TieredStore.from_urls([server.url], **FAST)
    try:
        store.put_many((c.key, rec) for c, rec in records)
        assert store.flush(5)
        keys = [c.key for c, _ in records]
        assert store.longest_prefix(keys) == 8
        with server.client() as raw:
            raw.delete(keys[3])  # another replica's cleanup
            for i in range(40):  # evicts the older records
                raw.set(f"filler{i}", os.urandom(200 << 10))
        got = store.get_many(keys)
        assert got[3] is None
        assert sum(v is None for v in got) > 1, "the server evicted nothing: the test proves nothing"
        for (c, rec), value in zip(records, got):
            if value is not None:
                decoded = decode_record(value, namespace=ns, chunk=c, tokens=tokens[c.start:c.end])
                assert bytes(decoded.kv) == bytes(decode_record(rec).kv)
    finally:
        store.close(timeout=2)


def test_damaged_record_in_a_shared_tier_is_detected_not_returned_as_kv(redis_server):
    redis_server.flushall()
    ns, tokens, records = _records(2)
    (c0, r0), (c1, r1) = records
    with open_store(redis_server.url) as red:
        red.put_many([(c0.key, r0), (c1.key, r1)])
        truncate(red, c0.key, len(r0) // 2)  # a crash mid-write elsewhere
        flip_byte(red, c1.key, offset=-3)  # a bit flip
        store = TieredStore([open_store("memory://"), red])
        try:
            for c in (c0, c1):
                value = store.get(c.key)
                with pytest.raises(CorruptRecordError):
                    decode_record(value, namespace=ns, chunk=c, tokens=tokens[c.start:c.end])
        finally:
            store.close(timeout=2)
