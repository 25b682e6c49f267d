"""kvstore's metrics: the registry types (``registry``), every metric kvstore publishes
(``catalog``) and an opt-in Prometheus endpoint (``server``)."""

from kvstore.metrics.catalog import *  # noqa: F403 - the catalog is this package's public surface
from kvstore.metrics.catalog import __all__ as _catalog_all
from kvstore.metrics.registry import REGISTRY, Counter, Gauge, Histogram, Registry

__all__ = ["REGISTRY", "Counter", "Gauge", "Histogram", "Registry", *_catalog_all]
