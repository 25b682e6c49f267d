"""``KVStoreConnector`` with kvstore's metrics published through vLLM's stats API, for the tests.

This is what the connector facade becomes once it mixes in ``PublishesKVStoreStats``
(``kvstore.connectors.vllm.stats``); until then the real-vLLM metrics test loads this class by
module path (``kv_connector_module_path="vllm_stats_connector"``, ``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

from kvstore.connectors.vllm.connector import KVStoreConnector
from kvstore.connectors.vllm.stats import PublishesKVStoreStats

__all__ = ["KVStoreStatsConnector"]


class KVStoreStatsConnector(PublishesKVStoreStats, KVStoreConnector):  # type: ignore[misc]
    """The facade plus the three stats hooks (get_kv_connector_stats, build_kv_connector_stats,
    build_prom_metrics)."""
