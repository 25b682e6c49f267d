"""The metrics endpoint: scrape it after real traffic through a PrefixCache and see the counters move."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import numpy as np
import pytest

import kvstore
from kvstore import ConfigError, open_store
from kvstore.keys import Namespace
from kvstore.metrics import REGISTRY, Registry
from kvstore.metrics.server import CONTENT_TYPE, start_metrics_server
from kvstore.prefix_cache import ChunkPayload, PrefixCache

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> tuple[str, dict[str, float]]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        content_type = resp.headers["Content-Type"]
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return content_type, samples


@pytest.fixture
def server():
    s = start_metrics_server(0)
    yield s
    s.close()


def _traffic() -> None:
    ns = Namespace(model="metrics-test", kv_dtype="float16", layout="t", block_size=16, chunk_tokens=32, layer_end=1)
    tokens = np.arange(100)
    with open_store("memory://") as store:
        cache = PrefixCache(store, ns)
        keys = cache.keys(tokens)
        cache.save(tokens, keys, lambda c: ChunkPayload(shapes=[(c.num_tokens, 4)],
                                                        kv=np.zeros((c.num_tokens, 4), np.float16)))
        assert cache.lookup_tokens(keys) == 100
        assert cache.load(tokens, keys, lambda c, r: None).num_tokens == 100
        other = cache.keys(np.arange(1000, 1064))
        assert cache.load(np.arange(1000, 1064), other, lambda c, r: None).num_tokens == 0  # misses


def test_endpoint_serves_counters_that_move(server):
    content_type, before = scrape(server.url)
    assert content_type == CONTENT_TYPE
    _traffic()
    _, after = scrape(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvstore_lookups_total") >= 1  # the lookup; the save's pre-check is counted apart
    assert delta("kvstore_save_checks_total") >= 1
    assert delta("kvstore_hits_total") == 4
    assert delta("kvstore_misses_total") == 2
    assert delta("kvstore_tokens_loaded_total") == 100
    assert delta("kvstore_tokens_saved_total") == 100
    assert delta("kvstore_lookup_tokens_total") >= 100
    for op in ("lookup", "load", "save"):
        assert delta(f'kvstore_op_seconds_count{{op="{op}"}}') >= 1
        assert f'kvstore_op_seconds_bucket{{op="{op}",le="+Inf"}}' in after
    assert after[f'kvstore_info{{version="{kvstore.__version__}",format_version="{kvstore.FORMAT_VERSION}"}}'] == 1


def test_every_documented_family_is_registered():
    """What operators alert on must exist before the first request (HELP/TYPE lines)."""
    import kvstore.metrics  # noqa: F401
    text = REGISTRY.render()
    for family in ("kvstore_lookups_total", "kvstore_hits_total", "kvstore_misses_total",
                   "kvstore_tokens_loaded_total", "kvstore_tokens_saved_total", "kvstore_bytes_read_total",
                   "kvstore_bytes_written_total", "kvstore_errors_total", "kvstore_corrupt_records_total",
                   "kvstore_op_seconds", "kvstore_warm_prompts_total"):
        assert f"# TYPE {family} " in text, family


def test_tiered_store_metrics_move_when_a_tier_is_down(server):
    """Breaker state, trips, errors, queue depth and drops: a shared tier that refuses connections."""
    from kvstore.stores.tiered import TieredStore

    text = REGISTRY.render()
    for family in ("kvstore_tier_state", "kvstore_tier_trips_total", "kvstore_write_queue_items",
                   "kvstore_write_queue_bytes", "kvstore_write_drops_total"):
        assert f"# TYPE {family} " in text, family
    ns = Namespace(model="metrics-tiered", kv_dtype="float16", layout="t", block_size=16, chunk_tokens=32, layer_end=1)
    tokens = np.arange(256)
    store = TieredStore.from_urls(["memory://", "redis://127.0.0.1:1/0?connect_timeout=0.2s&timeout=0.2s"],
                                  breaker_failures=2, breaker_cooldown=60, close_timeout=1)
    try:
        cache = PrefixCache(store, ns)
        keys = cache.keys(tokens)
        for _ in range(3):
            cache.save(tokens, keys, lambda c: ChunkPayload(shapes=[(c.num_tokens, 4)],
                                                            kv=np.zeros((c.num_tokens, 4), np.float16)))
            store.flush(timeout=5)
            cache.lookup(keys)
        _, samples = scrape(server.url)
    finally:
        store.close()

    def labelled(family: str) -> dict[str, float]:
        return {k: v for k, v in samples.items() if k.startswith(family + "{")}

    assert any('tier="redis' in k and v == 2 for k, v in labelled("kvstore_tier_state").items())
    assert sum(v for k, v in labelled("kvstore_tier_trips_total").items() if 'tier="redis' in k) >= 1
    assert sum(v for k, v in labelled("kvstore_errors_total").items() if 'tier="redis' in k) >= 1
    assert sum(v for k, v in labelled("kvstore_write_drops_total").items() if 'tier="redis' in k) >= 1
    assert any('tier="redis' in k for k in labelled("kvstore_write_queue_items"))
    assert sum(v for k, v in labelled("kvstore_bytes_written_total").items() if 'tier="memory' in k) > 0


def test_other_paths_and_errors(server):
    with urllib.request.urlopen(server.url.replace("/metrics", "/healthz"), timeout=5) as resp:
        assert resp.read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url.replace("/metrics", "/nope"), timeout=5)
    assert err.value.code == 404
    # The same port twice gives the running server; a taken port is a ConfigError naming it.
    assert start_metrics_server(server.port) is server
    with pytest.raises(ConfigError, match=str(server.port)):
        start_metrics_server(server.port, registry=Registry(), host="0.0.0.0")
    with pytest.raises(ConfigError):
        start_metrics_server(70000)


def test_custom_registry():
    reg = Registry()
    reg.counter("demo_total", "A demo.", ("kind",)).inc(3, kind='a"b')
    s = start_metrics_server(0, registry=reg)
    try:
        _, samples = scrape(s.url)
        assert samples == {'demo_total{kind="a\\"b"}': 3.0}
    finally:
        s.close()


def test_a_metric_is_defined_once():
    reg = Registry()
    lookups = reg.counter("demo_total", "A demo.", ("kind",))
    assert reg.counter("demo_total", "A demo.", ("kind",)) is lookups
    for again in (lambda: reg.counter("demo_total", "Another help.", ("kind",)),
                  lambda: reg.counter("demo_total", "A demo."),
                  lambda: reg.gauge("demo_total", "A demo.", ("kind",))):
        with pytest.raises(ValueError, match="demo_total"):
            again()


def test_the_catalog_defines_each_name_once():
    import ast
    import inspect

    from kvstore.metrics import catalog

    names = [node.args[0].value for node in ast.walk(ast.parse(inspect.getsource(catalog)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("counter", "gauge", "histogram")
             and node.args and isinstance(node.args[0], ast.Constant)]
    assert names and len(names) == len(set(names))


def test_start_from_env_takes_the_next_free_port():
    import kvstore.metrics.server as ms

    first = start_metrics_server(0)
    saved = ms._env_server
    ms._env_server = None
    try:
        assert ms.start_from_env({}) is None
        env = {"KVSTORE_METRICS_PORT": str(first.port), "KVSTORE_METRICS_HOST": "0.0.0.0"}
        with pytest.raises(ConfigError):
            ms.start_from_env({**env, "KVSTORE_METRICS_PORT_RANGE": "1"})
        for _ in range(20):  # a neighbouring port may be busy on a shared machine: try another base
            try:
                second = ms.start_from_env(env)
                break
            except ConfigError:
                first.close()
                first = start_metrics_server(0)
                env["KVSTORE_METRICS_PORT"] = str(first.port)
        assert second.port != first.port and first.port < second.port < first.port + 4
        assert ms.start_from_env(env) is second  # once per process
        second.close()
        with pytest.raises(ConfigError, match="KVSTORE_METRICS_PORT"):
            ms._env_server = None
            ms.start_from_env({"KVSTORE_METRICS_PORT": "lots"})
    finally:
        ms._env_server = saved
        first.close()
