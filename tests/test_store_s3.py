"""S3Store against a real S3 server (rclone serve s3)."""

from __future__ import annotations

import os
import time

import pytest
from servers import freeze, thaw

from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.keys import KEY_PREFIX as _K  # keys shaped like the product's
from kvstore.stores import open_store
from kvstore.stores.s3 import S3Config, S3Store
from kvstore.testing.store_tests import StoreTests


class TestS3Store(StoreTests):
    large_value_bytes = 8 << 20

    @pytest.fixture
    def store(self, s3_server):
        s3_server.clear()
        with open_store(s3_server.url) as store:
            assert isinstance(store, S3Store)
            yield store

    def bypass_get(self, store, key):
        client = store._client
        try:
            return client.get_object(Bucket=store.config.bucket, Key="kv/" + key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    def bypass_put(self, store, key, value):
        store._client.put_object(Bucket=store.config.bucket, Key="kv/" + key, Body=value)


def test_large_record_and_views(s3_server):
    value = bytearray(os.urandom(33 << 20))
    with open_store(s3_server.url_for("big")) as store:
        store.put("whole", memoryview(value))  # a view of a whole bytearray: sent without a copy
        store.put("part", memoryview(value)[5:])
        assert store.get("whole") == value
        assert store.get("part") == value[5:]


def test_longest_prefix_spans_several_windows_and_stops_at_a_gap(s3_server):
    keys = [f"{_K}/w/{i:03d}" for i in range(40)]
    with open_store(s3_server.url_for("win", max_workers="8")) as store:
        store.put_many([(k, b"v") for k in keys[:29] + keys[30:]])
        assert store.longest_prefix(keys) == 29
        store.put(keys[29], b"v")
        assert store.longest_prefix(keys) == 40


def test_a_failed_put_many_returns_once_no_upload_reads_its_values(s3_server):
    """The first error of a batch is raised only after the uploads already running have ended
    and the rest were cancelled: the caller may reuse the values' memory (a paged cache's
    blocks) as soon as ``put_many`` returns."""
    events: list[tuple[str, str]] = []

    class OneRefused(S3Store):
        def put(self, key, value):
            if key == "k0":
                time.sleep(0.05)  # k1 is under way when k0 fails
                events.append(("refused", key))
                raise StoreUnavailableError("refused")
            events.append(("started", key))
            time.sleep(0.3)
            super().put(key, value)
            events.append(("ended", key))

    with OneRefused.from_url(s3_server.url_for("refused", max_workers="2")) as store:
        with pytest.raises(StoreUnavailableError, match="refused"):
            store.put_many([(f"k{i}", b"v") for i in range(6)])
        events.append(("returned", ""))
        time.sleep(0.5)  # long enough for any upload left behind to show itself
        assert events[-1] == ("returned", ""), events  # nothing ran on after put_many raised
        started = [k for what, k in events if what == "started"]
        assert {"k1"} <= set(started) and {k for what, k in events if what == "ended"} == set(started), events
        assert "k5" not in started, events  # those still queued were cancelled, not run
        assert store.get("k1") == b"v"


def test_no_negative_caching(s3_server):
    with open_store(s3_server.url_for("neg")) as a, open_store(s3_server.url_for("neg")) as b:
        assert a.get("k") is None and a.longest_prefix(["k"]) == 0
        b.put("k", b"now")
        assert a.get("k") == b"now" and a.longest_prefix(["k"]) == 1


def test_stopped_server_is_unavailable_within_the_deadline(s3_server_factory):
    server = s3_server_factory(persistent=True)
    with open_store(server.url_for("x", timeout="1s", connect_timeout="300ms", retries="0")) as store:
        store.put("k", b"v")
        server.stop()
        start = time.monotonic()
        for op in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.longest_prefix(["k", "j"])):
            with pytest.raises(StoreUnavailableError) as info:
                op()
            assert info.value.__cause__ is not None
        assert time.monotonic() - start < 5
        server.start()
        assert store.get("k") == b"v"


def test_get_into_reads_large_objects_in_parallel_parts_into_one_lease(s3_server):
    from kvstore.buffers import BufferPool

    sizes = [0, 10, 1 << 20, (1 << 20) + 1, 5 << 20, 3_333_333]
    values = {f"p{i}": os.urandom(n) for i, n in enumerate(sizes)}
    pool = BufferPool(64 << 20)
    with open_store(s3_server.url_for("parts", part_size="1MiB", deadline="20s")) as store:
        store.put_many(list(values.items()))
        keys = [*values, "missing"]
        got = []
        for lease in store.get_into(keys, pool):
            got.append(None if lease is None else bytes(lease.view))
            if lease is not None:
                lease.release()
        assert got == [*values.values(), None]
        assert pool.stats()["leased_bytes"] == 0 and pool.stats()["misses"] == 0
        stream = store.get_into(keys, pool)  # abandoned after one value: the rest come back too
        next(stream).release()
        stream.close()
        deadline = time.monotonic() + 10
        while pool.stats()["leased_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.stats()["leased_bytes"] == 0


def test_closing_the_store_under_a_get_into_is_unavailable_and_frees_its_leases(s3_server):
    from kvstore.buffers import BufferPool

    pool = BufferPool(64 << 20)
    store = open_store(s3_server.url_for("closing", part_size="1MiB", max_workers="2", deadline="20s"))
    keys = [f"c{i}" for i in range(8)]
    store.put_many([(k, os.urandom(3 << 20)) for k in keys])
    stream = store.get_into(keys, pool)
    next(stream).release()
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        for lease in stream:
            lease.release()
    deadline = time.monotonic() + 10
    while pool.stats()["leased_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats()["leased_bytes"] == 0


def test_a_frozen_server_costs_get_into_one_deadline(s3_server_factory):
    import signal

    from kvstore.buffers import BufferPool

    server = s3_server_factory()
    pool = BufferPool(64 << 20)
    with open_store(server.url_for("frozen", part_size="1MiB", deadline="1s", retries="0")) as store:
        store.put_many([("a", os.urandom(3 << 20)), ("b", os.urandom(100))])
        pid = server._proc.proc.pid
        os.kill(pid, signal.SIGSTOP)  # the socket accepts, nothing answers
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="deadline"):
                list(store.get_into(["a", "b"], pool))
            assert time.monotonic() - start < 2.5
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 15  # the stuck GETs end by their socket timeouts, then release
        while pool.stats()["leased_bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.stats()["leased_bytes"] == 0
        (lease,) = store.get_into(["b"], pool)  # the server answers again
        assert bytes(lease.view) == store.get("b")
        lease.release()


def test_a_frozen_server_costs_get_heads_one_deadline(s3_server_factory):
    server = s3_server_factory()
    with open_store(server.url_for("frozen-heads", deadline="1s", retries="0")) as store:
        keys = [f"h{i}" for i in range(8)]
        store.put_many((k, os.urandom(256 << 10)) for k in keys)
        pid = server._proc.proc.pid
        freeze(pid)  # the socket accepts, nothing answers
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="deadline"):
                store.get_heads(keys, 4096)  # what kvstore gc reads
            assert time.monotonic() - start < 2.5
        finally:
            thaw(pid)
        assert [h[0] for h in store.get_heads(keys, 4096)] == [256 << 10] * len(keys)  # answered again


def test_wrong_credentials_are_unavailable_not_a_miss(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with open_store(s3_server.url_for("cred", retries="0")) as store:
        with pytest.raises(StoreUnavailableError):
            store.get("k")
        assert "not-the-secret" not in repr(store)


@pytest.mark.parametrize("url, fragment", [
    ("s3:///prefix", "bucket"),
    ("s3://b/p?max_workers=0", "max_workers"),
    ("s3://b/p?addressing_style=sideways", "addressing_style"),
    ("s3://b/p?endpoint_url=ftp://x", "endpoint_url"),
    ("s3://key:secret@b/p", "standard chain"),
    ("s3://b/p?access=1", "accepted: "),
    ("s3://b/p?timeout=forever", "timeout"),
    ("s3://b/p?part_size=4KiB", "part_size"),
])
def test_bad_urls_name_the_parameter(url, fragment, s3_credentials):
    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert fragment in str(info.value)
    assert "secret" not in str(info.value) or fragment == "standard chain"


def test_url_forms():
    c = S3Config.from_url("s3://bucket/a/b?endpoint_url=http://127.0.0.1:9000&region=eu-west-1&max_workers=4")
    assert (c.bucket, c.prefix, c.endpoint_url, c.region, c.max_workers) == (
        "bucket", "a/b/", "http://127.0.0.1:9000", "eu-west-1", 4)
    assert S3Config.from_url("s3://bucket").prefix == ""


def test_a_pieces_body_reads_any_span_of_many_parts():
    """botocore reads a body in blocks of its own, seeking back on a retry: every read from any
    position gives the value's bytes, whatever the parts (a thousand from a cache's blocks, some empty)."""
    import random

    from kvstore.buffers import Pieces
    from kvstore.stores.s3.bodies import PiecesBody

    rng = random.Random(7)
    parts = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 64, 300]))) for _ in range(1000)]
    whole = b"".join(parts)
    body = PiecesBody(Pieces(parts))
    for _ in range(100):
        start = rng.randrange(len(whole) + 1)
        assert body.seek(start) == start
        got = bytearray()
        while n := body.readinto(buf := bytearray(rng.randrange(1, 5000))):
            got += buf[:n]
        assert bytes(got) == whole[start:] and body.tell() == len(whole)
