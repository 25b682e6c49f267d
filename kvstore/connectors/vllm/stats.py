"""kvstore's metrics through vLLM's own ``/metrics`` (vLLM's KV-connector stats API).

vLLM asks every connector instance (the scheduler's and each worker's) for
``get_kv_connector_stats()`` once a step, sums the workers' objects with ``aggregate``, ships the
result's ``data`` to the API-server process as a plain dict, rebuilds it there with the class's
``build_kv_connector_stats(data)`` and hands it to the ``KVConnectorPromMetrics`` that
``build_prom_metrics`` made, whose ``observe`` updates ``vllm:``-prefixed Prometheus series. One
scrape of the vLLM server then shows kvstore's counters beside vLLM's.

What travels is the **change** of every metric in ``kvstore.metrics.REGISTRY`` since this
process last reported (``collect_stats``): one process-wide baseline, so a scheduler and a
worker that share a process (vLLM's single-process mode) never count the same delta twice.

* ``data``: flat ``{key: number}``; a key is ``json.dumps([kind, name, label values, field])``,
  kind ``c`` (counter: the increase), ``g`` (gauge: the current value, sent when it changed),
  ``h`` (histogram: field ``le=<bound>`` / ``le=+Inf`` per-bucket increase, ``sum``, ``count``).
  Plain str keys and numbers: vLLM pickles and msgpacks it between processes.
* ``aggregate``: counters and histograms add up; a gauge keeps the largest value (the deepest
  queue, the most-open breaker over the engine's processes).
* kind ``m`` carries what a worker measured for the scheduler's cost model
  (``kvstore.cost.Measurements``: its reads per tier, the forward time of its prefill steps;
  ``measurements_to_data`` / ``measurements_from_data``), as sums that add up over workers.
  They are not metrics: Prometheus never sees them.
* Prometheus: each kvstore metric ``kvstore_X`` becomes ``vllm:kvstore_X`` with vLLM's labels
  (``model_name``, ``engine``) followed by its own (``tier``, ``op``...), of the same type;
  histograms keep kvstore's buckets.

The connector facade exposes it with ``PublishesKVStoreStats`` (a mixin placed before
``KVConnectorBase_V1``) or by calling ``collect_stats``, ``KVStoreStats.from_data`` and
``KVStorePromMetrics`` from its own three methods. kvstore's standalone endpoint
(``kvstore.metrics.server``) is independent of this and keeps working.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstore import cost
from kvstore.metrics import REGISTRY, Counter, Gauge, Histogram, Registry

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVStoreStats", "KVStorePromMetrics", "PublishesKVStoreStats", "collect_stats", "snapshot",
           "measurements_from_data", "measurements_to_data", "PROM_PREFIX"]

#: Prefix of the republished names: vLLM unregisters only ``vllm:`` collectors when it rebuilds its
#: Prometheus logger in one process; any other name would be a duplicate time series.
PROM_PREFIX = "vllm:"

_COUNTER, _GAUGE, _HIST, _MEASURE = "c", "g", "h", "m"

# Headline figures for vLLM's "KV Transfer metrics: ..." log line (``reduce``): name -> metric.
_SUMMARY = {
    "lookups": "kvstore_lookups_total",
    "lookup_tokens": "kvstore_lookup_tokens_total",
    "hit_tokens": "kvstore_lookup_hit_tokens_total",
    "tokens_loaded": "kvstore_tokens_loaded_total",
    "tokens_saved": "kvstore_tokens_saved_total",
    "bytes_read": "kvstore_bytes_read_total",
    "bytes_written": "kvstore_bytes_written_total",
    "errors": "kvstore_errors_total",
    "corrupt_records": "kvstore_corrupt_records_total",
    "write_drops": "kvstore_write_drops_total",
}


def _key(kind: str, name: str, labels: tuple[str, ...], field: str = "") -> str:
    return json.dumps([kind, name, list(labels), field], separators=(",", ":"))


def _parse(key: str) -> tuple[str, str, tuple[str, ...], str] | None:
    try:
        kind, name, labels, field = json.loads(key)
        return str(kind), str(name), tuple(str(v) for v in labels), str(field)
    except (ValueError, TypeError):
        return None


def snapshot(registry: Registry = REGISTRY) -> dict[str, float]:
    """Every series of ``registry`` as flat keys (see the module docstring): cumulative counter
    and histogram values, current gauge values."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        if isinstance(metric, Histogram):
            for labels, (counts, total, count) in metric.samples().items():
                for bound, n in zip(metric.buckets, counts):
                    out[_key(_HIST, metric.name, labels, f"le={bound:g}")] = n
                out[_key(_HIST, metric.name, labels, "le=+Inf")] = count - sum(counts)
                out[_key(_HIST, metric.name, labels, "sum")] = total
                out[_key(_HIST, metric.name, labels, "count")] = count
        else:
            kind = _GAUGE if isinstance(metric, Gauge) else _COUNTER
            for labels, value in metric.samples().items():
                out[_key(kind, metric.name, labels)] = value
    return out


class _Baseline:
    """What this process reported last; one per process (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last: dict[str, float] = {}

    def deltas(self, registry: Registry) -> dict[str, float]:
        with self.lock:
            now = snapshot(registry)
            out: dict[str, float] = {}
            for key, value in now.items():
                before = self.last.get(key)
                if key.startswith(f'["{_GAUGE}"'):
                    if before != value:
                        out[key] = value
                elif value != (before or 0):
                    out[key] = value - (before or 0)
            self.last = now
            return out


def measurements_to_data(seen: cost.Measurements) -> dict[str, float]:
    """``seen`` as entries of a stats object's ``data`` (kind ``m``: sums that ``aggregate`` adds up)."""
    data: dict[str, float] = {}
    for tier, (nbytes, seconds, reads) in seen.reads.items():
        if reads:
            data.update({_key(_MEASURE, "reads", (tier,), "bytes"): nbytes,
                         _key(_MEASURE, "reads", (tier,), "seconds"): seconds,
                         _key(_MEASURE, "reads", (tier,), "count"): reads})
    if seen.prefill_tokens:
        data[_key(_MEASURE, "prefill", (), "tokens")] = seen.prefill_tokens
        data[_key(_MEASURE, "prefill", (), "seconds")] = seen.prefill_seconds
    return data


def measurements_from_data(data: dict[str, Any]) -> cost.Measurements:
    """The measurements in a stats object's ``data`` (none: empty measurements)."""
    out = cost.Measurements()
    reads: dict[str, dict[str, float]] = {}
    for key, value in data.items():
        parsed = _parse(key) if key.startswith(f'["{_MEASURE}"') else None
        if parsed is None:
            continue
        _, name, labels, fld = parsed
        if name == "reads" and len(labels) == 1:
            reads.setdefault(labels[0], {})[fld] = float(value)
        elif name == "prefill" and fld == "tokens":
            out.prefill_tokens = int(value)
        elif name == "prefill" and fld == "seconds":
            out.prefill_seconds = float(value)
    out.reads = {tier: (int(f.get("bytes", 0)), f.get("seconds", 0.0), int(f.get("count", 0)))
                 for tier, f in reads.items()}
    return out


# Keyed by the registry itself, weakly: an id() outlives its registry, and a new registry given
# the same id would start from the dead one's baseline (deltas against counts it never had).
_BASELINES: weakref.WeakKeyDictionary[Registry, _Baseline] = weakref.WeakKeyDictionary()
_BASELINES_LOCK = threading.Lock()


def collect_stats(registry: Registry = REGISTRY) -> KVStoreStats | None:
    """What changed in ``registry`` since this process last asked, or ``None`` if nothing did.

    What ``get_kv_connector_stats`` returns, on both roles.
    """
    with _BASELINES_LOCK:
        baseline = _BASELINES.setdefault(registry, _Baseline())
    data = baseline.deltas(registry)
    return KVStoreStats(data=data) if data else None


@dataclass
class KVStoreStats(KVConnectorStats):  # type: ignore[misc]
    """Per-step changes of kvstore's metrics (``data``: see the module docstring)."""

    @classmethod
    def from_data(cls, data: dict[str, Any] | None = None) -> KVStoreStats:
        """What ``build_kv_connector_stats(data)`` returns: the object for a shipped dict."""
        return cls(data={str(k): v for k, v in (data or {}).items() if isinstance(v, (int, float))})

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVStoreStats:
        for key, value in other.data.items():
            if key.startswith(f'["{_GAUGE}"'):
                self.data[key] = max(self.data.get(key, value), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Headline sums over labels, for vLLM's periodic log line."""
        by_name: dict[str, float] = {}
        for key, value in self.data.items():
            parsed = _parse(key)
            if parsed is not None and parsed[0] == _COUNTER:
                by_name[parsed[1]] = by_name.get(parsed[1], 0) + value
        return {short: int(by_name.get(name, 0)) for short, name in _SUMMARY.items()}

    def is_empty(self) -> bool:
        return not self.data


class KVStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Every metric of ``registry`` as a ``vllm:kvstore_*`` Prometheus metric of vLLM's classes."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *, registry: Registry = REGISTRY) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engine_labels = {idx: [str(v) for v in values] for idx, values in per_engine_labelvalues.items()}
        self._metrics: dict[str, tuple[Counter | Gauge | Histogram, Any]] = {}
        self._children: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        for metric in registry.collect():
            own = [f"kvstore_{n}" if n in labelnames else n for n in metric.labelnames]
            names = [*labelnames, *own]
            prom_name = PROM_PREFIX + metric.name
            if isinstance(metric, Histogram):
                prom = self._histogram_cls(name=prom_name, documentation=metric.help, labelnames=names,
                                           buckets=list(metric.buckets))
            elif isinstance(metric, Gauge):
                prom = self._gauge_cls(name=prom_name, documentation=metric.help, labelnames=names)
            else:
                prom = self._counter_cls(name=prom_name, documentation=metric.help, labelnames=names)
            self._metrics[metric.name] = (metric, prom)

    def _child(self, name: str, engine_idx: int, labels: tuple[str, ...]) -> Any:
        key = (name, engine_idx, labels)
        child = self._children.get(key)
        if child is None:
            engine = self._engine_labels.get(engine_idx) or self._engine_labels.get(0, [])
            child = self._children[key] = self._metrics[name][1].labels(*engine, *labels)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        histograms: dict[tuple[str, tuple[str, ...]], dict[str, float]] = {}
        for key, value in transfer_stats_data.items():
            parsed = _parse(key)
            if parsed is None or parsed[1] not in self._metrics:
                continue  # another kvstore version's metric, or not ours
            kind, name, labels, field = parsed
            if len(labels) != len(self._metrics[name][0].labelnames):
                continue
            if kind == _HIST:
                histograms.setdefault((name, labels), {})[field] = float(value)
            elif kind == _GAUGE:
                self._child(name, engine_idx, labels).set(value)
            elif value > 0:  # counters only grow; a restarted process starts a new baseline
                self._child(name, engine_idx, labels).inc(value)
        for (name, labels), fields in histograms.items():
            metric = self._metrics[name][0]
            assert isinstance(metric, Histogram)
            _observe_deltas(self._child(name, engine_idx, labels), metric.buckets, fields)


def _observe_deltas(child: Any, buckets: tuple[float, ...], fields: dict[str, float]) -> None:
    """Add per-bucket counts and a sum to a prometheus_client histogram child.

    prometheus_client keeps a non-cumulative counter per bucket (``_buckets``) and ``_sum``;
    adding to them is exact. Another histogram class (vLLM's Ray wrappers) gets ``count``
    observations of the mean: exact count and sum, buckets approximate.
    """
    count = int(fields.get("count", 0))
    total = fields.get("sum", 0.0)
    if count <= 0:
        return
    counts = [int(fields.get(f"le={b:g}", 0)) for b in buckets] + [int(fields.get("le=+Inf", 0))]
    inner = getattr(child, "_buckets", None)
    upper = getattr(child, "_upper_bounds", None)
    if inner is not None and hasattr(child, "_sum") and upper is not None and len(inner) == len(counts) \
            and list(upper[:-1]) == [float(b) for b in buckets]:
        for bucket, n in zip(inner, counts):
            if n > 0:
                bucket.inc(n)
        child._sum.inc(total)
        return
    mean = total / count
    for _ in range(count):
        child.observe(mean)


class PublishesKVStoreStats:
    """Mixin for the connector facade: the three stats hooks of ``KVConnectorBase_V1``.

    ``class KVStoreConnector(PublishesKVStoreStats, KVConnectorBase_V1)``: vLLM then polls
    kvstore's metric deltas from every connector instance and publishes them at its /metrics.
    """

    def get_kv_connector_stats(self) -> KVStoreStats | None:
        return collect_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreStats:
        return KVStoreStats.from_data(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
