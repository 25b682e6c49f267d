"""Thin engine adapters over kvstore.

* ``connectors.agent``: the V0-style agent API (``send_kv_caches_and_hidden_states`` /
  ``recv_kv_caches_and_hidden_states`` / ``close``), ``KVStoreAgent``.
* vLLM's V1 connector API lives beside it.

Adapters only translate an engine's batch description into per-sequence (tokens, slots) and
call ``kvstore.paged.KVTransfer``; keys, records, verification and stores live in ``kvstore``.
Modules are imported on use (``from connectors.agent import KVStoreAgent``), so importing this
package pulls in neither torch nor vLLM.
"""
