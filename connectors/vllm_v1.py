"""The vLLM connector at its source-checkout module path: ``kv_connector_module_path="connectors.vllm_v1"``.

The top-level ``connectors`` package is not in the wheel (another distribution owns that name);
installed users write ``kv_connector_module_path="kvstore.vllm"``, which this module re-exports.
"""

from kvstore.vllm import KVStoreConnector, KVStoreConnectorMetadata

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
