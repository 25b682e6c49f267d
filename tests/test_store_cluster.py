"""RedisClusterStore against a real three-primary Redis Cluster."""

from __future__ import annotations

import pytest
import redis

from kvstore.stores import open_store
from kvstore.stores.redis import RedisClusterStore
from kvstore.testing.store_tests import StoreTests


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


def test_keys_spread_over_every_node_and_batches_work_across_slots(redis_cluster):
    redis_cluster.flushall()
    keys = [f"kvs1/ns/{i:04x}" for i in range(60)]
    with open_store(redis_cluster.url) as store:
        store.put_many([(k, k.encode()) for k in keys])
        assert store.longest_prefix(keys + ["kvs1/ns/absent"]) == 60
        assert [bytes(v) for v in store.get_many(keys)] == [k.encode() for k in keys]
        assert sorted(store.iter_keys("kvs1/ns/")) == sorted(keys)  # SCAN on every primary
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
