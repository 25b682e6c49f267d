"""RedisClusterStore against a real three-primary cluster, of redis-server and of valkey-server."""

from __future__ import annotations

import os
import time

import pytest
import redis
from servers import freeze, thaw

from kvstore.keys import KEY_PREFIX as _K  # keys shaped like the product's
from kvstore.stores import open_store
from kvstore.stores.redis import RedisClusterStore
from kvstore.testing.store_tests import StoreTests


@pytest.fixture(scope="module")
def redis_cluster(any_redis_cluster):
    """This module's clusters: of redis-server, then of valkey-server (conftest.any_redis_cluster)."""
    return any_redis_cluster


class TestRedisClusterStore(StoreTests):
    @pytest.fixture
    def store(self, redis_cluster):
        redis_cluster.flushall()
        with open_store(redis_cluster.url + "?prefix=c/") as store:
            assert isinstance(store, RedisClusterStore)
            yield store

    def bypass_get(self, store, key):
        return store._redis.get("c/" + key)  # the cluster client itself, no store logic

    def bypass_put(self, store, key, value):
        store._redis.set("c/" + key, value)


def test_the_cluster_runs_the_program_it_is_named_for(redis_cluster):
    for node in redis_cluster.nodes:
        with node.client() as client:
            assert ("valkey_version" in client.info("server")) == (redis_cluster.flavor == "valkey")


def test_keys_spread_over_every_node_and_batches_work_across_slots(redis_cluster):
    redis_cluster.flushall()
    keys = [f"{_K}/ns/{i:04x}" for i in range(60)]
    with open_store(redis_cluster.url) as store:
        store.put_many([(k, k.encode()) for k in keys])
        assert store.longest_prefix(keys + [f"{_K}/ns/absent"]) == 60
        assert [bytes(v) for v in store.get_many(keys)] == [k.encode() for k in keys]
        assert sorted(store.iter_keys(f"{_K}/ns/")) == sorted(keys)  # SCAN on every primary
    per_node = []
    for port in redis_cluster.ports:
        with redis.Redis(port=port) as node:
            per_node.append(node.dbsize())
    assert sum(per_node) == 60 and all(n > 0 for n in per_node), per_node


def test_cluster_url_from_any_node_with_several_startup_nodes(redis_cluster):
    hosts = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports)
    with open_store(f"redis+cluster://{hosts}") as store:
        store.put("x", b"1")
        assert store.get("x") == b"1"
        assert store.describe()["store"] == "redis+cluster"


def test_get_into_reads_every_node_at_once_into_pool_leases(redis_cluster):
    import os

    from kvstore.buffers import BufferPool

    redis_cluster.flushall()
    keys = [f"{_K}/ns/{i:04x}" for i in range(12)]
    values = {k: os.urandom(200_000 + i) for i, k in enumerate(keys)}
    pool = BufferPool(64 << 20)
    with open_store(redis_cluster.url) as store:
        store.put_many(list(values.items()))
        routes = store._direct_reads(keys)
        assert routes is not None and len(routes) == 3  # the batch's keys live on all three primaries
        got = []
        for lease in store.get_into([*keys, f"{_K}/ns/absent"], pool):
            got.append(None if lease is None else bytes(lease.view))
            if lease is not None:
                lease.release()
        assert got == [*values.values(), None]
        stats = pool.stats()
        assert stats["leases"] == len(keys) and stats["misses"] == 0 and stats["leased_bytes"] == 0


def _misroute(store, client, key):
    """Make ``client`` believe ``key``'s slot moved to another node (which answers MOVED), and
    record each ``store._rerouted`` call; returns (slot map, slot, its real home, the calls)."""
    manager = client.nodes_manager
    slot = client.keyslot(key)
    home = manager.slots_cache[slot][0]
    manager.slots_cache[slot] = [next(n for n in client.get_primaries() if n.name != home.name)]
    rerouted = []
    learn = store._rerouted
    store._rerouted = lambda told: (rerouted.append(1), learn(told))[1]
    return manager, slot, home, rerouted


def test_get_into_finishes_a_batch_whose_slots_moved_and_learns_their_homes(redis_cluster):
    redis_cluster.flushall()
    keys = [f"{_K}/mv/{i:04x}" for i in range(9)]
    with open_store(redis_cluster.url) as store:
        store.put_many([(k, k.encode()) for k in keys])
        from kvstore.buffers import BufferPool

        manager, slot, home, rerouted = _misroute(store, store._redis, keys[4])
        leases = list(store.get_into(keys, BufferPool(16 << 20)))
        assert [bytes(x.view) for x in leases] == [k.encode() for k in keys]
        assert rerouted == [1]  # the direct read was told MOVED, and the pipeline finished the batch
        for lease in leases:
            lease.release()
        assert manager.slots_cache[slot][0].name == home.name  # relearned for the next batch


def test_put_many_writes_every_node_at_once_over_direct_sockets(redis_cluster):
    redis_cluster.flushall()
    keys = [f"{_K}/dw/{i:04x}" for i in range(12)]
    values = {k: os.urandom(100_000 + i) for i, k in enumerate(keys)}
    with open_store(redis_cluster.url) as store:
        store._put_pipelined = lambda items: pytest.fail(f"pipelined: {list(items)}")
        store.put_many(iter(values.items()))  # a generator, as PrefixCache.save passes
    for port in redis_cluster.ports:
        with redis.Redis(port=port) as node:
            assert node.dbsize() > 0  # the batch's keys live on all three primaries
    with redis.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0]) as client:
        assert [client.get(k) for k in keys] == list(values.values())


def test_put_many_resends_a_value_whose_slot_moved_and_learns_its_home(redis_cluster):
    redis_cluster.flushall()
    keys = [f"{_K}/wm/{i:04x}" for i in range(9)]
    with open_store(redis_cluster.url) as store:
        store.put("warm", b"up")  # the write client knows the slots
        manager, slot, home, rerouted = _misroute(store, store._redis_writes, keys[4])
        store.put_many([(k, k.encode()) for k in keys])
        assert rerouted == [1]  # told MOVED once, and the pipeline resent the value
        assert manager.slots_cache[slot][0].name == home.name
        assert [bytes(v) for v in store.get_many(keys)] == [k.encode() for k in keys]


# A frozen node (SIGSTOP: its socket accepts, nothing answers) must cost a batch one deadline,
# not one per key it holds. These are the only wall-clock bounds in the suite's fault tests, so
# they are made hard to miss by accident: the clients and their connections to every node are up
# before the freeze (a cold client adds work that a starved CPU stretches, as under `make test`
# beside the vLLM run), and the batch puts about ten keys on the frozen node, so that a deadline
# per key would cost ~2 s against a bound of 1.5 s, while one deadline is 0.2 s.
DEADLINE_OPTIONS = "?timeout=200ms&write_timeout=200ms&connect_timeout=200ms"  # retries (default 1) follow connection errors only
FROZEN_BOUND = 1.5  # seconds: one 0.2 s deadline plus room for a starved CPU


def test_a_frozen_node_costs_get_into_one_short_deadline(redis_cluster):
    from kvstore.buffers import BufferPool
    from kvstore.errors import StoreUnavailableError

    redis_cluster.flushall()
    keys = [f"{_K}/fz/{i:04x}" for i in range(30)]
    value = b"v" * 100_000
    pool = BufferPool(16 << 20)
    with open_store(redis_cluster.url + DEADLINE_OPTIONS) as store:
        store.put_many([(k, value) for k in keys])
        assert store.get_many(keys) == [value] * len(keys)  # the read client and its connections are up
        pid = redis_cluster.nodes[1]._proc.proc.pid
        freeze(pid)  # thawed long before the cluster's node timeout (15 s, tests/servers.py) could mark it failed
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                for lease in store.get_into(keys, pool):
                    lease.release()
            assert time.monotonic() - start < FROZEN_BOUND
        finally:
            thaw(pid)
        assert pool.stats()["leased_bytes"] == 0
        assert [bytes(v) for v in store.get_many(keys)] == [value] * len(keys)


def test_a_frozen_node_costs_a_pipelined_batch_one_short_deadline(redis_cluster):
    # The client's pipeline (reads other than get_into, lookups, deletes) must not resend each
    # failed command to the silent node, a deadline each.
    from kvstore.errors import StoreUnavailableError

    redis_cluster.flushall()
    keys = [f"{_K}/fp/{i:04x}" for i in range(30)]
    with open_store(redis_cluster.url + DEADLINE_OPTIONS) as store:
        store.put_many([(k, b"v") for k in keys])
        assert store.get_many(keys) == [b"v"] * len(keys)  # connections to every node are up
        pid = redis_cluster.nodes[2]._proc.proc.pid
        freeze(pid)
        try:
            for call in (store.get_many, store.exists_many):
                start = time.monotonic()
                with pytest.raises(StoreUnavailableError):
                    call(keys)
                assert time.monotonic() - start < FROZEN_BOUND, call
        finally:
            thaw(pid)
        assert store.get_many(keys) == [b"v"] * len(keys)


def test_a_frozen_node_costs_a_write_batch_one_short_deadline(redis_cluster):
    from kvstore.errors import StoreUnavailableError

    redis_cluster.flushall()
    keys = [f"{_K}/fw/{i:04x}" for i in range(30)]
    value = b"w" * 100_000
    with open_store(redis_cluster.url + DEADLINE_OPTIONS) as store:
        store.put_many([(k, value) for k in keys])  # the write client and a connection to every node are up
        pid = redis_cluster.nodes[0]._proc.proc.pid
        freeze(pid)
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                store.put_many([(k, b"x" * 100_000) for k in keys])
            assert time.monotonic() - start < FROZEN_BOUND
        finally:
            thaw(pid)
        store.put_many([(k, value) for k in keys])
        assert [bytes(v) for v in store.get_many(keys)] == [value] * len(keys)
