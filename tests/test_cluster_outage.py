"""A dead Redis Cluster is an outage everywhere: the store raises ``StoreUnavailableError``,
a tiered store counts ``kvstore_errors_total{kind="unavailable"}``, and the commands end in one
line with exit status 2 (for ``cp``, 1 would mean "invalid records").

redis-py 7 and later raise the cluster client's ``RedisClusterException`` family (no startup
node reachable) outside ``RedisError``. The cluster here is real: three primaries, all stopped.
"""

from __future__ import annotations

import pytest
import servers
from conftest import _REDIS_HINT

from kvstore.cli import main
from kvstore.errors import StoreUnavailableError
from kvstore.metrics.catalog import ERRORS
from kvstore.stores import open_store
from kvstore.stores.tiered import TieredStore

FAST = "?connect_timeout=500ms&timeout=500ms"


@pytest.fixture(scope="module")
def dead_cluster():
    """A cluster that served a store, then had every node stopped: ``(url, store that saw it live)``."""
    servers.require_binary("redis-server", _REDIS_HINT)
    servers.require_binary("redis-cli", _REDIS_HINT)
    cluster = servers.RedisCluster(masters=3)
    try:
        url = cluster.url + FAST
        seen = open_store(url)
        seen.put("kvs2/live/key", b"value")
        assert bytes(seen.get("kvs2/live/key")) == b"value"
        for node in cluster.nodes:
            node.stop()
        yield url, seen
        seen.close()
    finally:
        cluster.close()


CALLS = {
    "get": lambda s: s.get("k"),
    "get_many": lambda s: s.get_many(["a", "b"]),
    "exists": lambda s: s.exists("k"),
    "longest_prefix": lambda s: s.longest_prefix(["a", "b"]),
    "size_many": lambda s: s.size_many(["a"]),
    "put_many": lambda s: s.put_many([("a", b"x")]),
    "delete_many": lambda s: s.delete_many(["a"]),
    "iter_keys": lambda s: list(s.iter_keys("")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_store_opened_on_a_dead_cluster_is_unavailable(dead_cluster, call):
    url, _ = dead_cluster
    with open_store(url) as store, pytest.raises(StoreUnavailableError, match="Cluster cannot be connected"):
        CALLS[call](store)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_store_that_saw_the_cluster_die_is_unavailable(dead_cluster, call):
    _, seen = dead_cluster
    with pytest.raises(StoreUnavailableError):
        CALLS[call](seen)


def test_a_tiered_store_counts_a_dead_cluster_as_unavailable_and_misses(dead_cluster):
    url, _ = dead_cluster
    with TieredStore.from_urls(["memory://", url]) as store:
        tier = store.tiers[1].name
        before = {kind: ERRORS.value(tier=tier, kind=kind) for kind in ("unavailable", "error")}
        assert store.get_many(["a", "b"]) == [None, None]
        assert ERRORS.value(tier=tier, kind="unavailable") > before["unavailable"]
        assert ERRORS.value(tier=tier, kind="error") == before["error"]


@pytest.mark.parametrize("argv", [["stats"], ["ls"], ["gc", "--dry-run"], ["inspect", "kvs2/x/y"]])
def test_store_commands_on_a_dead_cluster_are_one_line_and_exit_2(dead_cluster, capsys, argv):
    url, _ = dead_cluster
    rc = main([*argv, "--store", url])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"kvstore {argv[0]}: error: ") and "Cluster cannot be connected" in err
    assert "unexpected" not in err and len(err.strip().splitlines()) == 1


def test_cp_to_a_dead_cluster_is_unreachable_exit_2(dead_cluster, tmp_path, capsys):
    url, _ = dead_cluster
    (tmp_path / "kv").mkdir()
    rc = main(["cp", "--from", f"file://{tmp_path}/kv", "--to", url])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("kvstore cp: error: destination ") and "is unreachable" in err
