"""Stable import paths for engines: ``connectors.vllm_v1`` (vLLM's ``kv_connector_module_path``)
and ``connectors.agent`` (the agent API). The adapters themselves live in
``kvstore.connectors``; these modules only re-export them."""
