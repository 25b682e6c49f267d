"""Import paths kept for source checkouts: ``connectors.vllm_v1`` (vLLM's
``kv_connector_module_path``) and ``connectors.agent`` (the agent API).

The wheel does not ship this package (a distribution named ``connectors`` exists on the package
index); installed code imports ``kvstore.vllm`` and ``kvstore.connectors.agent``, which these
modules only re-export.
"""
