"""Engine adapters over kvstore: they translate an engine's hooks into ``KVTransfer`` and
``PrefixCache`` calls, and hold no storage logic of their own.

* ``agent``: the V0-style agent API (``send_kv_caches_and_hidden_states`` /
  ``recv_kv_caches_and_hidden_states`` / ``close``), ``KVStoreAgent``.
* ``vllm``: vLLM's V1 connector API (``KVConnectorBase_V1``), ``KVStoreConnector``: a facade over
  a scheduler side and a worker side.
* ``roles``: producer / consumer / both, shared by both adapters.

Engines load the vLLM connector by module path through the top-level ``connectors`` package
(``kv_connector_module_path="connectors.vllm_v1"``). Importing this package pulls in neither
torch nor vLLM.
"""
