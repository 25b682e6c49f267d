"""Counters, gauges and histograms with labels, rendered in the Prometheus text format.

Dependency-free on purpose: the hot path only increments numbers under a lock; rendering
happens when someone scrapes. A name is registered once per ``Registry`` with one type, one set
of label names and one help text; registering it again with the same returns the same metric,
with any other raises ``ValueError`` (a second definition would otherwise be silently ignored).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

# Latency buckets in seconds: 100 us .. 30 s.
DEFAULT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_M = TypeVar("_M", bound="_Metric")


def _label_key(labelnames: tuple[str, ...], labels: dict[str, str]) -> tuple[str, ...]:
    if set(labels) != set(labelnames):
        raise ValueError(f"labels {sorted(labels)} do not match declared {list(labelnames)}")
    return tuple(str(labels[n]) for n in labelnames)


def _fmt_labels(labelnames: Iterable[str], values: Iterable[str], extra: str = "") -> str:
    parts = [f'{n}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
             for n, v in zip(labelnames, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _label_key(self.labelnames, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(_label_key(self.labelnames, labels), 0.0)

    def total(self) -> float:
        return sum(self._values.values())

    def samples(self) -> dict[tuple[str, ...], float]:
        """A copy of every series: label values (in ``labelnames`` order) -> value."""
        with self._lock:
            return dict(self._values)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_fmt_labels(self.labelnames, k)} {v:g}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = _label_key(self.labelnames, labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets))
        self._data: dict[tuple[str, ...], list[float]] = {}  # key -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = _label_key(self.labelnames, labels)
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            d = self._data.get(key)
            if d is None:
                d = self._data[key] = [0] * len(self.buckets) + [0.0, 0]
            if i < len(self.buckets):
                d[i] += 1
            d[-2] += value
            d[-1] += 1

    def count(self, **labels: str) -> int:
        d = self._data.get(_label_key(self.labelnames, labels))
        return 0 if d is None else int(d[-1])

    def samples(self) -> dict[tuple[str, ...], tuple[list[float], float, int]]:
        """A copy of every series: label values -> (per-bucket counts, not cumulative, one per
        ``buckets`` entry; sum; count). Observations above the last bucket are in count only."""
        with self._lock:
            return {k: (list(d[:-2]), float(d[-2]), int(d[-1])) for k, d in self._data.items()}

    def render(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        for key, d in items:
            cumulative: float = 0
            for bound, n in zip(self.buckets, d):
                cumulative += n
                le = f'le="{bound:g}"'
                out.append(f"{self.name}_bucket{_fmt_labels(self.labelnames, key, le)} {cumulative}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_fmt_labels(self.labelnames, key, inf)} {d[-1]}")
            out.append(f"{self.name}_sum{_fmt_labels(self.labelnames, key)} {d[-2]:g}")
            out.append(f"{self.name}_count{_fmt_labels(self.labelnames, key)} {d[-1]}")
        return out


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _get(self, cls: type[_M], name: str, help: str, labelnames: tuple[str, ...], **kw: Any) -> _M:
        with self._lock:
            m = self._metrics.get(name)
            if m is None:
                m = self._metrics[name] = cls(name, help, tuple(labelnames), **kw)
            elif type(m) is not cls or m.labelnames != tuple(labelnames) or m.help != help:
                # A second definition would be silently ignored (the first one's help is what
                # /metrics shows): refuse it, so each metric is defined once (``catalog``).
                raise ValueError(f"metric {name} already registered with another type, labels or help")
            return m

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        return self._get(Counter, name, help, tuple(labelnames))

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        return self._get(Gauge, name, help, tuple(labelnames))

    def histogram(self, name: str, help: str, labelnames: Iterable[str] = (),
                  buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> Histogram:
        return self._get(Histogram, name, help, tuple(labelnames), buckets=buckets)

    def collect(self) -> list[Counter | Gauge | Histogram]:
        """Every registered metric, by name (for exporters that republish them)."""
        with self._lock:
            metrics = list(self._metrics.values())
        return [m for m in sorted(metrics, key=lambda m: m.name) if isinstance(m, (Counter, Histogram))]

    def get(self, name: str) -> Counter | Gauge | Histogram | None:
        """The metric registered as ``name``, or ``None``."""
        with self._lock:
            m = self._metrics.get(name)
        return m if isinstance(m, (Counter, Histogram)) else None

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for m in sorted(metrics, key=lambda m: m.name):
            lines.extend(m.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


REGISTRY = Registry()
"""The process-wide registry every kvstore metric lives in (``kvstore.metrics.catalog``)."""
