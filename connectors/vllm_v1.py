"""The vLLM connector at the module path engines load: ``kv_connector_module_path="connectors.vllm_v1"``.

The implementation is ``kvstore.connectors.vllm``; this module only names it where vLLM looks.
"""

from kvstore.connectors.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
