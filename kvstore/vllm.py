"""kvstore's entry point for vLLM: ``import kvstore.vllm`` registers ``KVStoreConnector`` by name.

vLLM checks ``kv_connector`` against its connector registry wherever a ``KVTransferConfig``
meets a ``VllmConfig``: in the engine's processes, where kvstore's ``vllm.general_plugins``
entry point registers the name, and in the process that builds the config, where vLLM loads no
plugin by itself. Importing this module there (or calling ``vllm.plugins.load_general_plugins()``)
makes ``kv_connector="KVStoreConnector"`` valid in that process too.

It is also a module path: ``kv_connector_module_path="kvstore.vllm"`` loads the connector in
every process with no registry at all (vLLM prefers a module path when one is given).

Importing this module imports vLLM's connector API (and torch).
"""

from __future__ import annotations

from kvstore.connectors.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata
from kvstore.connectors.vllm.plugin import CONNECTOR_NAME, register

__all__ = ["CONNECTOR_NAME", "KVStoreConnector", "KVStoreConnectorMetadata", "register"]

register()
