"""Faults against real servers, asserted by counts, never by wall-clock times.

A frozen (SIGSTOP) or dead tier costs a caller at most the one call that found it so: that call
ends with one expired deadline (no retry after a timeout), the breaker then skips the tier, and
only the tier's own prober thread calls it until it answers again. Reads never wait behind
writes (separate connections and pools), nothing returns a wrong value, and a tier comes back
by itself. Every wait here is a condition with a generous hang guard. The Redis faults run
against redis-server and valkey-server both (conftest.any_redis_factory).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
from fault_servers import BlackHole, CallLog, Counting, HoldingProxy
from servers import freeze, thaw

from kvstore.connectors.agent import KVStoreAgent
from kvstore.errors import CorruptRecordError, StoreTimeoutError, StoreUnavailableError
from kvstore.keys import Namespace, chunk_keys
from kvstore.metrics.catalog import ERRORS
from kvstore.record import decode_record, encode_record
from kvstore.reference import PRESETS, ModelRunner
from kvstore.stores import open_store
from kvstore.stores.memory import MemoryStore
from kvstore.stores.tiered import CLOSED, TieredStore
from kvstore.testing.damage import flip_byte, truncate


@pytest.fixture(scope="module")
def redis_server_factory(any_redis_factory):
    return any_redis_factory


@pytest.fixture(scope="module")
def redis_server(redis_server_factory):
    return redis_server_factory()


FAST = dict(breaker_failures=2, breaker_cooldown="200ms", breaker_max_cooldown="500ms")
GUARD = 30.0  # seconds: a hang guard only (a healthy run needs a fraction of it)


def values(n: int, size: int = 256 << 10) -> dict[str, bytes]:
    return {f"kvs1/fault/{i:03d}": os.urandom(size) for i in range(n)}


def wait_for(check, timeout: float = GUARD) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def errors(tier: str) -> float:
    return ERRORS.value(tier=tier, kind="unavailable")


# -- one call to a frozen server: one deadline, no retry -------------------------------------------
def test_redis_call_to_a_frozen_server_is_one_attempt_without_retry():
    hole = BlackHole()
    store = open_store(f"redis://127.0.0.1:{hole.port}/0?timeout=100ms&connect_timeout=100ms&write_timeout=100ms&retries=3")
    try:
        for i, call in enumerate([lambda: store.get_many(["a", "b"]), lambda: store.longest_prefix(["a"]),
                                  lambda: store.exists("a"), lambda: store.delete("a"),
                                  lambda: store.put_many([("a", b"x")])]):
            with pytest.raises(StoreTimeoutError):
                call()
            assert hole.connections == i + 1  # retries=3 is for connection errors, never after a timeout
    finally:
        store.close()
        hole.close()


def test_s3_call_returns_at_its_deadline_whatever_the_socket_timeout(s3_credentials):
    hole = BlackHole()
    # Each attempt may wait 30 s for a byte; the call as a whole gives up after 300 ms.
    store = open_store(f"s3://b/p?endpoint_url=http://127.0.0.1:{hole.port}&deadline=300ms&timeout=30s&retries=2")
    try:
        for call in (lambda: store.get_many(["a", "b", "c"]), lambda: store.longest_prefix(["a", "b"]),
                     lambda: store.get("a"), lambda: store.exists("a")):
            outcome: list[BaseException] = []

            def run(c=call, into=outcome):
                try:
                    c()
                except StoreTimeoutError as exc:
                    into.append(exc)

            t = threading.Thread(target=run)
            t.start()
            t.join(10)  # the hang guard: without the call's own deadline this waits 30 s and more
            assert not t.is_alive() and len(outcome) == 1
    finally:
        store.close()
        hole.close()


# -- reads never wait behind writes ----------------------------------------------------------------
def test_redis_reads_do_not_wait_for_a_stuck_write(redis_server):
    redis_server.flushall()
    proxy = HoldingProxy(redis_server.port, b"$3\r\nSET\r\n")
    store = open_store(f"redis://127.0.0.1:{proxy.port}/0?max_connections=1&timeout=5s")
    try:
        store.get_many(["warm"])  # the read pool's one connection exists before the write starts
        writer = threading.Thread(target=store.put_many, args=([("k", b"v" * 1000)],))
        writer.start()
        assert wait_for(lambda: proxy.held == 1)  # the write is stuck on its own connection
        done: list[object] = []
        reader = threading.Thread(target=lambda: done.append((store.get_many(["k", "x"]), store.longest_prefix(["k"]))))
        reader.start()
        reader.join(GUARD)
        assert done == [([None, None], 0)]  # answered while the write was held (one shared pool: it waited)
        proxy.release()
        writer.join(GUARD)
        assert store.get("k") == b"v" * 1000
    finally:
        proxy.close()
        store.close()


def test_s3_lookups_do_not_queue_behind_uploads(s3_server):
    s3_server.clear()
    proxy = HoldingProxy(s3_server.port, b"PUT ")
    url = s3_server.url_for("pools", max_workers="2", deadline="10s").replace(
        f":{s3_server.port}", f":{proxy.port}")
    with open_store(s3_server.url_for("pools")) as direct:
        direct.put("ready", b"r")
    store = open_store(url)
    try:
        uploads = threading.Thread(target=store.put_many, args=([(f"u{i}", b"x" * 1000) for i in range(4)],))
        uploads.start()
        assert wait_for(lambda: proxy.held >= 2)  # both upload threads are stuck
        done: list[object] = []
        reader = threading.Thread(target=lambda: done.append(
            (store.longest_prefix(["ready", "u0"]), [v is not None for v in store.get_many(["ready", "u1"])])))
        reader.start()
        reader.join(GUARD)
        assert done == [(1, [True, False])]
        proxy.release()
        uploads.join(GUARD)
        assert store.exists("u3")
    finally:
        proxy.close()
        store.close()


# -- a tiered store under load while a tier dies or freezes ---------------------------------------
def hammer(store, expected: dict[str, bytes], stop: threading.Event, report: dict) -> None:
    """Read and write in batches until ``stop``; count calls and wrong values."""
    keys = list(expected)
    report.update(wrong=0, calls=0)
    i = 0
    while not stop.is_set():
        batch = keys[i % len(keys):][:16] or keys[:16]
        i += 16
        got = store.get_many(batch)
        store.put_many([(k, expected[k]) for k in batch[:4]])
        store.longest_prefix(batch)
        report["calls"] += 1
        report["wrong"] += sum(1 for k, v in zip(batch, got) if v is not None and bytes(v) != expected[k])


def _outage(store, data: dict[str, bytes], log: CallLog, down, up, *, allowed: int, outcome: str) -> None:
    """Hammer ``store``; take its second tier ``down``; count what reached it; bring it ``up``."""
    stop, report = threading.Event(), {}
    worker = threading.Thread(target=hammer, args=(store, data, stop, report), name="hammer")
    worker.start()
    try:
        assert wait_for(lambda: report.get("calls", 0) > 3)
        state = store.tiers[1].breaker
        # In use before the outage: on a loaded host (CI runs this beside vLLM) a call may outlast
        # a short deadline before ``down``; the breaker it opened closes at the next probe.
        start = len(log)
        assert wait_for(lambda: state.state == CLOSED and log.count(thread="hammer", outcome="ok", since=start) > 0)
        with log.lock:
            mark = len(log.calls)
            in_flight = [i for i, (_, _, o) in enumerate(log.calls) if o == "pending"]  # may end in the outage
        calls_at_down = report["calls"]
        down()
        assert wait_for(lambda: state.state != CLOSED)
        assert wait_for(lambda: report["calls"] > calls_at_down + 20)  # the hammer goes on, missing
        # A call answered "ok" since the mark was answered before ``down`` took the tier away.
        reached = log.count(thread="hammer", since=mark) - log.count(thread="hammer", outcome="ok", since=mark)
        assert reached <= allowed, log.summary(mark)
        ended = [log.calls[i][2] for i in in_flight] + [o for _, _, o in log.calls[mark:]]
        assert outcome in ended, log.summary(mark)  # the hammer's, or the writer's
        # From the first probe on, nobody but the tier's prober calls it (the writer drops while it is open).
        assert wait_for(lambda: log.count(thread="kvstore-probe", since=mark) >= 1)
        busy = log.count(thread="hammer", since=mark) + log.count(thread="kvstore-writer", since=mark)
        assert wait_for(lambda: log.count(thread="kvstore-probe", since=mark) >= 2)
        assert log.count(thread="hammer", since=mark) + log.count(thread="kvstore-writer", since=mark) == busy
        up()
        assert wait_for(lambda: state.state == CLOSED), store.stats()
        assert wait_for(lambda: log.count(thread="hammer", outcome="ok", since=mark) > 0)  # in use again
    finally:
        stop.set()
        worker.join(GUARD)
    assert not worker.is_alive() and report["wrong"] == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_redis_killed_or_frozen_mid_batch_then_back(redis_server_factory, sig):
    server = redis_server_factory()
    log = CallLog()
    redis = Counting(open_store(server.url + "?timeout=300ms&connect_timeout=300ms"), log)
    store = TieredStore([open_store("memory://?max_bytes=1MiB"), redis], **FAST)  # reads reach Redis
    data = values(64)
    try:
        store.put_many(data.items())
        assert store.flush(GUARD)
        before = errors("redis")
        if sig == signal.SIGKILL:  # refused: fast failures, breaker_failures of them
            _outage(store, data, log, server.stop, server.start, allowed=FAST["breaker_failures"],
                    outcome="unavailable")
        else:  # frozen: the first call's deadline expires, and that opens the breaker
            pid = server._proc.proc.pid
            _outage(store, data, log, lambda: freeze(pid), lambda: thaw(pid), allowed=1, outcome="timeout")
        assert errors("redis") > before
        store.put("kvs1/fault/after", b"back")  # writes resume too
        assert store.flush(GUARD)
        with server.client() as raw:
            assert wait_for(lambda: raw.get("kvs1/fault/after") == b"back")
    finally:
        store.close(timeout=2)


def _landed(store, tier, data: dict[str, bytes]) -> bool:
    """Whether ``tier`` holds every value of ``data``; those it lacks are written through
    ``store`` again (a loaded host may time out a first write, and the breaker drops the rest)."""
    try:
        got = tier.get_many(list(data))
    except StoreUnavailableError:
        return False
    missing = [k for k, v in zip(data, got) if v is None]
    store.put_many((k, data[k]) for k in missing)
    return store.flush(GUARD) and not missing


@pytest.mark.parametrize("how", ["stopped", "frozen"])
def test_s3_stopped_or_frozen_then_back(s3_server_factory, how):
    # Stopped: the objects must come back with the server, as a real S3's do (a directory, not
    # rclone's memory backend; the hammer never rewrites the key checked at the end).
    server = s3_server_factory(persistent=how == "stopped")
    log = CallLog()
    s3 = Counting(open_store(server.url_for("faults", deadline="500ms", timeout="300ms", connect_timeout="300ms",
                                            retries="1")), log)
    store = TieredStore([open_store("memory://?max_bytes=1MiB"), s3], **FAST)
    data = values(32, 64 << 10)
    try:
        first = next(iter(data))
        store.put(first, data[first])  # alone: concurrent PUTs into a new directory race in rclone (servers.py)
        assert store.flush(GUARD)
        store.put_many(data.items())
        assert store.flush(GUARD)
        assert wait_for(lambda: _landed(store, s3, data))
        if how == "stopped":
            _outage(store, data, log, server.stop, server.start, allowed=FAST["breaker_failures"],
                    outcome="unavailable")
        else:
            pid = server._proc.proc.pid
            _outage(store, data, log, lambda: freeze(pid), lambda: thaw(pid), allowed=1, outcome="timeout")
        key = next(reversed(data))
        assert wait_for(lambda: store.get(key) == data[key])
    finally:
        store.close(timeout=2)


# -- the engine: a batch of requests while a shared tier is frozen ---------------------------------
CFG = PRESETS["tiny"]


def _engine_batch_with_frozen_tier(tier_store, pid: int, log: CallLog) -> None:
    """Reference-engine requests while the tier is frozen: each pays at most one deadline."""
    store = TieredStore([MemoryStore(), tier_store], breaker_failures=3, breaker_cooldown="300ms",
                        breaker_max_cooldown="1s")
    agent = KVStoreAgent(dict(store="memory://", model=CFG.name, model_fingerprint=CFG.fingerprint,
                              chunk_tokens=32), store=store)
    runner = ModelRunner(CFG, agent)
    rng = random.Random(3)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(70)] for _ in range(10)]
    baseline = ModelRunner(CFG).generate(prompts, 3).tokens
    try:
        assert runner.generate([prompts[0]], 3).tokens == [baseline[0]]  # healthy: it reaches the tier
        assert store.flush(GUARD) and log.count(thread="MainThread", outcome="ok") >= 2
        freeze(pid)
        per_request = []
        for i, p in enumerate(prompts[1:-1], 1):
            mark = len(log)
            out = runner.generate([p], 3)
            assert out.tokens == [baseline[i]]  # a frozen tier never changes the output
            per_request.append((log.count(thread="MainThread", since=mark),
                                log.count(thread="MainThread", outcome="timeout", since=mark)))
        # The first request pays one expired deadline; with the breaker open, no request calls it.
        assert per_request[0] == (1, 1) and all(r == (0, 0) for r in per_request[1:]), per_request
        assert store.tiers[1].breaker.state != CLOSED
        assert wait_for(lambda: log.count(thread="kvstore-probe") >= 1)  # probed off the engine thread
        thaw(pid)
        assert wait_for(lambda: store.tiers[1].breaker.state == CLOSED)
        mark = len(log)
        assert runner.generate([prompts[-1]], 3).tokens == [baseline[-1]]  # not in the memory tier yet
        assert log.count(thread="MainThread", outcome="ok", since=mark) >= 1  # in use again
    finally:
        thaw(pid)
        agent.close()


def test_engine_requests_while_redis_is_frozen(redis_server_factory):
    server = redis_server_factory()
    log = CallLog()
    redis = Counting(open_store(server.url + "?timeout=200ms&connect_timeout=200ms"), log)
    _engine_batch_with_frozen_tier(redis, server._proc.proc.pid, log)


def test_engine_requests_while_s3_is_frozen(s3_server_factory):
    server = s3_server_factory()
    log = CallLog()
    s3 = Counting(open_store(server.url_for("engine", deadline="400ms", timeout="300ms", connect_timeout="200ms")),
                  log)
    _engine_batch_with_frozen_tier(s3, server._proc.proc.pid, log)


# -- records that change under a reader ------------------------------------------------------------
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
