"""Nothing queued is lost at exit (issue 22), at the store level, against a real S3 server
(``rclone serve s3``) behind a shaped link so that writes are still in flight when the store
closes: a store never shuts a pool a queued write will use, a closed store answers misses
instead of failing into a shut pool, and a process that exits right after handing over its
writes still drains them for the ``flush_timeout`` its user asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvstore.buffers import BufferPool
from kvstore.errors import StoreUnavailableError
from kvstore.metrics.catalog import ERRORS
from kvstore.stores import TieredStore, open_store
from kvstore.testing.proxy import ShapedProxy

ROOT = Path(__file__).resolve().parents[1]


def _slow_url(s3_server, proxy: ShapedProxy, prefix: str, **options: str) -> str:
    return s3_server.url_for(prefix, **options).replace(s3_server.endpoint_url, f"http://127.0.0.1:{proxy.port}")


def _keys(s3_server, prefix: str) -> set[str]:
    store = open_store(s3_server.url_for(prefix))
    try:
        return set(store.iter_keys())
    finally:
        store.close()


def test_closing_s3_under_writes_in_flight_lets_every_one_land(s3_server):
    proxy = ShapedProxy(s3_server.port, rate=2e6)
    try:
        store = open_store(_slow_url(s3_server, proxy, "closing-writes", max_workers="2"))
        values = {f"w{i}": os.urandom(1 << 20) for i in range(6)}  # two in flight, four queued
        errors: list[BaseException] = []

        def write() -> None:
            try:
                store.put_many(list(values.items()))
            except BaseException as exc:  # reported below
                errors.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 10
        while sum(proxy.bytes_sent()) < 100_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        store.close()  # while writes are in flight and queued
        writer.join(30)
        assert not writer.is_alive() and errors == []
        assert _keys(s3_server, "closing-writes") == set(values)
        with pytest.raises(StoreUnavailableError, match="closed"):
            store.get("w0")
        with pytest.raises(StoreUnavailableError, match="closed"):
            store.put_many([("late-1", b"x"), ("late-2", b"y")])
        assert store._pools == {}  # a closed store builds no new pools
    finally:
        proxy.close()


def test_reads_fall_back_inline_when_the_interpreter_shuts_executors(s3_server):
    """At interpreter exit every executor refuses new work before atexit hooks drain the
    writes; a lookup made then (a save's pre-check) still gets its answer, as writes do."""
    with open_store(s3_server.url_for("exit-reads")) as store:
        store.put_many([("r0", b"a"), ("r1", b"b")])
        assert store.exists_many(["r0", "r1", "r2"]) == [True, True, False]
        store._pool("read").shutdown()  # what concurrent.futures does to every executor at exit
        assert store.exists_many(["r0", "r1", "r2"]) == [True, True, False]
        assert store.get("r1") == b"b"


def test_a_closed_tiered_store_answers_misses_without_calling_its_closed_stores(s3_server):
    store = TieredStore.from_urls(["memory://", s3_server.url_for("closed-tiered")])
    store.put_many([(f"k{i}", b"v" * 100) for i in range(4)])
    assert store.flush(10)
    store.close()
    errors = ERRORS.total()
    assert store.get_many(["k0", "k1"]) == [None, None]
    assert store.longest_prefix_by_tier(["k0", "k1"]) == [0, 0]
    assert list(store.get_into(["k0"], BufferPool(1 << 20))) == [None]
    assert ERRORS.total() == errors and all(t.breaker.state == "closed" for t in store.tiers)


_EXITING_WRITER = textwrap.dedent("""
    import os, sys
    from kvstore.stores import shared
    store = shared.acquire(sys.argv[1:], flush_timeout=60.0)
    store.put_many([(f"x{i}", os.urandom(1 << 20)) for i in range(8)])
    print("HANDED", flush=True)
    # exits without releasing the store: the atexit hook drains it
""")


def test_a_process_that_exits_right_after_its_writes_drains_them_for_its_flush_timeout(s3_server):
    """8 MiB queued for S3 behind one 1 MB/s connection (~8 s, longer than the old fixed 5 s exit
    drain): the process exits at once, and every record reaches S3. One worker, because the proxy
    shapes each connection: 16 in parallel would carry the 8 MiB in about 1 s."""
    proxy = ShapedProxy(s3_server.port, rate=1e6)
    try:
        url = _slow_url(s3_server, proxy, "exiting", max_workers="1")
        env = dict(os.environ, **s3_server.env, PYTHONPATH=str(ROOT))
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _EXITING_WRITER, "memory://", url], env=env, cwd=str(ROOT),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "HANDED" in out.stdout, out.stderr[-3000:]
        assert time.monotonic() - start > 5.0  # the drain outlasted the old exit timeout
        assert _keys(s3_server, "exiting") == {f"x{i}" for i in range(8)}, out.stderr[-3000:]
    finally:
        proxy.close()
