"""Engine adapters over kvstore: they translate an engine's hooks into ``KVTransfer`` and
``PrefixCache`` calls, and hold no storage logic of their own.

* ``agent``: the V0-style agent API (``send_kv_caches_and_hidden_states`` /
  ``recv_kv_caches_and_hidden_states`` / ``close``), ``KVStoreAgent``.
* ``vllm``: vLLM's V1 connector API (``KVConnectorBase_V1``), ``KVStoreConnector``: a facade over
  a scheduler side and a worker side.
* ``roles``: producer / consumer / both, shared by both adapters.

Engines find the vLLM connector by name (the ``vllm.general_plugins`` entry point, or
``import kvstore.vllm`` in a process that builds its own ``VllmConfig``) or by module path
(``kv_connector_module_path="kvstore.vllm"``). Importing this package pulls in neither
torch nor vLLM.
"""
