"""ShardedRedisStore (``redis+shards://``) against three real redis-servers: the conformance suite,
placement (every shard used, stable, ~1/N moved when a server is added), batches spread over
every shard, and a frozen shard costing a batch one deadline."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import redis
from servers import freeze, thaw

from kvstore.buffers import BufferPool
from kvstore.errors import ConfigError, StoreTimeoutError
from kvstore.keys import KEY_PREFIX as _K
from kvstore.stores import open_store
from kvstore.stores.redis import ShardedRedisStore
from kvstore.testing.store_tests import StoreTests


@pytest.fixture(scope="module")
def shard_servers(redis_server_factory):
    return [redis_server_factory() for _ in range(3)]


def _url(servers, query=""):
    return "redis+shards://" + ",".join(f"127.0.0.1:{s.port}" for s in servers) + query


def _client(store, key):
    """A raw client of the server ``key`` lives on (not through the store under test)."""
    host, port = store.config.hosts[store.shard_of(key)]
    return redis.Redis(host=host, port=port)


class TestShardedRedisStore(StoreTests):
    @pytest.fixture
    def store(self, shard_servers):
        for s in shard_servers:
            s.flushall()
        with open_store(_url(shard_servers)) as store:
            assert isinstance(store, ShardedRedisStore)
            yield store

    def bypass_get(self, store, key):
        with _client(store, key) as client:
            return client.get(key)

    def bypass_put(self, store, key, value):
        with _client(store, key) as client:
            client.set(key, value)


class TestShardedRedisStoreWithPrefix(TestShardedRedisStore):
    @pytest.fixture
    def store(self, shard_servers):
        for s in shard_servers:
            s.flushall()
        with open_store(_url(shard_servers, "/2?prefix=app/&ttl=1h&connections=2")) as store:
            yield store

    def bypass_get(self, store, key):
        host, port = store.config.hosts[store.shard_of(key)]
        with redis.Redis(host=host, port=port, db=2) as client:
            return client.get("app/" + key)

    def bypass_put(self, store, key, value):
        host, port = store.config.hosts[store.shard_of(key)]
        with redis.Redis(host=host, port=port, db=2) as client:
            client.set("app/" + key, value)


def test_url_is_checked():
    for bad in ("redis+shards://", "redis+shards://127.0.0.1:1,127.0.0.1:1", "redis+shards://h:1?nope=2",
                "redis+shards://h:1/x", "redis+shards://h:0,h:2", "redis+shard://h:1"):
        with pytest.raises(ConfigError):
            open_store(bad)
    store = open_store("rediss+shards://u:secret@a:1,b:2/1?ttl=1m")
    assert store.config.tls and store.config.db == 1 and store.config.hosts == (("a", 1), ("b", 2))
    assert "secret" not in repr(store) and "rediss+shards://u:***@a:1,b:2/1" in repr(store)
    store.close()


def test_placement_is_stable_even_and_moves_about_one_in_n_when_a_server_is_added():
    keys = [f"{_K}/ns/{i:032x}" for i in range(6000)]
    three = open_store("redis+shards://a:1,b:2,c:3")
    reordered = open_store("redis+shards://c:3,a:1,b:2")
    four = open_store("redis+shards://a:1,b:2,c:3,d:4")
    try:
        def names(store):
            return [store.config.hosts[store.shard_of(k)] for k in keys]

        before, after = names(three), names(four)
        assert names(reordered) == before  # the list's order does not matter
        counts = {h: before.count(h) for h in set(before)}
        assert len(counts) == 3 and min(counts.values()) > 0.28 * len(keys), counts
        moved = sum(b != a for b, a in zip(before, after))
        assert all(a == ("d", 4) for b, a in zip(before, after) if b != a)  # only to the new server
        assert 0.18 < moved / len(keys) < 0.32, moved  # about 1/4
    finally:
        for s in (three, reordered, four):
            s.close()


def test_a_batch_spreads_over_every_shard(shard_servers):
    for s in shard_servers:
        s.flushall()
    with open_store(_url(shard_servers)) as store:
        # 24 keys, as many on each shard (the ports, and so the placement, change from run to
        # run: 24 fixed names leave a shard empty in about 1 run of 5,000).
        names, per_shard = [], [0] * len(shard_servers)
        quota = 24 // len(shard_servers)
        for name in (f"{_K}/spread/{i}" for i in itertools.count()):
            shard = store.shard_of(name)
            if per_shard[shard] < quota:
                names.append(name)
                per_shard[shard] += 1
            if len(names) == quota * len(shard_servers):
                break
        items = [(name, os.urandom(256 << 10)) for name in names]
        store.put_many(items)
        per_server = []
        for s in shard_servers:
            with s.client() as c:
                per_server.append(c.dbsize())
        assert per_server == per_shard and min(per_server) >= 4, (per_server, per_shard)
        for (key, value) in items:
            with _client(store, key) as c:
                assert c.get(key) == value  # each on the server its hash names
        pool = BufferPool(64 << 20)
        got = []
        for lease in store.get_into([k for k, _ in items], pool):
            got.append(bytes(lease.view))
            lease.release()
        assert got == [v for _, v in items]
        assert store.longest_prefix([k for k, _ in items]) == 24
        assert store.delete_many([k for k, _ in items[:10]] + [f"{_K}/spread/none"]) == 10


@pytest.mark.parametrize("op", ["get_into", "get_many", "longest_prefix", "get_heads"])
def test_a_frozen_shard_costs_a_batch_one_deadline(shard_servers, op):
    servers = shard_servers
    with open_store(_url(servers, "?timeout=300ms&connect_timeout=300ms")) as store:
        keys = [f"{_K}/frozen/{i}" for i in range(30)]
        store.put_many((k, os.urandom(64 << 10)) for k in keys)
        victim = servers[1]
        assert any(store.shard_of(k) == 1 for k in keys)
        pid = _pid_of(victim)
        freeze(pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeoutError):
                if op == "get_into":
                    pool = BufferPool(64 << 20)
                    for lease in store.get_into(keys, pool):
                        lease.release()
                elif op == "get_many":
                    store.get_many(keys)
                elif op == "get_heads":  # what kvstore gc reads
                    store.get_heads(keys, 4096)
                else:
                    store.longest_prefix(keys)
            elapsed = time.monotonic() - t0
            assert elapsed < 1.5 * store.deadline + 0.3, elapsed  # one deadline, not one per shard or key
        finally:
            thaw(pid)
        # The other shards kept serving their keys throughout, and the thawed one is back.
        assert store.longest_prefix(keys) == len(keys)


def _pid_of(server):
    with server.client() as c:
        return int(c.info("server")["process_id"])


def test_shards_below_a_shm_tier_in_a_tiered_store(shard_servers):
    import shutil
    import uuid

    for s in shard_servers:
        s.flushall()
    name = f"test-{uuid.uuid4().hex[:12]}"
    try:
        with open_store([f"shm://{name}?max_bytes=64MiB", _url(shard_servers)]) as tiered:
            shm, shards = (t.store for t in tiered.tiers)
            assert [t.name for t in tiered.tiers] == ["shm", "redis+shards"]
            # Three keys per shard: which shard a key lands on depends on the servers' ports.
            by_shard: dict[int, list[str]] = {0: [], 1: [], 2: []}
            for key in (f"{_K}/tiered/{i}" for i in range(1000)):
                if len(by_shard[shards.shard_of(key)]) < 3:
                    by_shard[shards.shard_of(key)].append(key)
            items = [(k, os.urandom((1 << 20) + i)) for i, k in enumerate(k for share in by_shard.values() for k in share)]
            assert len(items) == 9
            tiered.put_many(items)
            assert tiered.flush(10)  # the shards tier is written in the background
            keys = [k for k, _ in items]
            assert [bytes(v) for v in shards.get_many(keys)] == [v for _, v in items]
            assert len({shards.shard_of(k) for k in keys}) == 3
            shm.delete_many(keys)  # now only the shards hold them
            pool = BufferPool(64 << 20)
            got = []
            for lease in tiered.get_into(keys, pool):
                got.append(bytes(lease.view))
                lease.release()
            assert got == [v for _, v in items]
            assert tiered.flush(10) and all(shm.exists_many(keys))  # hits promoted into the host tier
    finally:
        shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)


def test_adding_a_real_server_remaps_about_one_in_n_of_the_keys(shard_servers, redis_server_factory):
    """Keys written over 3 real servers, then read through the same 3 plus a 4th: every key the
    4th does not win is still found where it was, and the 4th wins about 1/4 of them."""
    for s in shard_servers:
        s.flushall()
    fourth = redis_server_factory()
    keys = [f"{_K}/remap/{i:05d}" for i in range(400)]
    items = [(k, k.encode() * 3) for k in keys]
    with open_store(_url(shard_servers)) as three, open_store(_url([*shard_servers, fourth])) as four:
        three.put_many(items)
        assert [bytes(v) for v in three.get_many(keys)] == [v for _, v in items]
        moved = [four.shard_of(k) == 3 for k in keys]
        assert all(three.config.hosts[three.shard_of(k)] == four.config.hosts[four.shard_of(k)]
                   for k, m in zip(keys, moved) if not m)  # a key not moved keeps its server
        got = four.get_many(keys)
        assert [v is None for v in got] == moved  # only the moved keys miss, read over real sockets
        assert [bytes(v) for v, m in zip(got, moved) if not m] == [v for (_, v), m in zip(items, moved) if not m]
        assert 0.17 < sum(moved) / len(keys) < 0.33, sum(moved)  # about 1/4, at most ~1/N
        with fourth.client() as c:
            assert c.dbsize() == 0
        four.put_many([item for item, m in zip(items, moved) if m])  # re-saved, they land on the 4th
        with fourth.client() as c:
            assert c.dbsize() == sum(moved)
        assert all(v is not None for v in four.get_many(keys))
