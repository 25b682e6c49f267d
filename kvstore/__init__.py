"""kvstore: a shared, tiered KV-cache store for LLM inference.

The public surface, by layer (``docs/architecture.md`` draws them):

* stores: ``open_store`` (a store from a URL, a tiered store from a list), ``Store``,
  ``WrapperStore``, ``TieredStore``;
* keys and records: ``Namespace``, ``chunk_keys``, ``encode_record`` / ``decode_record`` /
  ``read_header``, ``RecordAuth`` (the deployment key of authenticated records);
* the prefix cache: ``PrefixCache`` (engine-agnostic, verified save/load of token prefixes);
* paged caches: ``KVTransfer`` and ``get_layout`` (import torch; loaded on first use);
* engine adapters: ``KVStoreAgent`` and ``AgentConfig`` (the agent API), and the vLLM connector
  at ``kvstore.vllm`` (imports vLLM; importing it registers the name);
* the error family: ``KVStoreError``, ``ConfigError``, ``CorruptRecordError``,
  ``StoreUnavailableError`` (``StoreTimeoutError``: a deadline expired).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore._version import FORMAT_VERSION, __version__
from kvstore.connectors.agent.config import AgentConfig
from kvstore.errors import ConfigError, CorruptRecordError, KVStoreError, StoreTimeoutError, StoreUnavailableError
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.prefix_cache import ChunkPayload, LoadResult, PrefixCache
from kvstore.record import Record, RecordAuth, RecordHeader, decode_record, encode_record, read_header
from kvstore.stores import Store, TieredStore, WrapperStore, open_store, register_backend

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers
    from kvstore.connectors.agent.agent import KVStoreAgent
    from kvstore.paged import KVTransfer, get_layout

# Names that import torch: resolved on first use, so ``import kvstore`` stays light.
_LAZY = {
    "KVTransfer": "kvstore.paged",
    "get_layout": "kvstore.paged",
    "KVStoreAgent": "kvstore.connectors.agent.agent",
}

__all__ = [
    "AgentConfig", "ChunkKey", "ChunkPayload", "ConfigError", "CorruptRecordError", "FORMAT_VERSION", "KVStoreAgent",
    "KVStoreError", "KVTransfer", "LoadResult", "Namespace", "PrefixCache", "Record", "RecordAuth", "RecordHeader", "Store",
    "StoreTimeoutError", "StoreUnavailableError", "TieredStore", "WrapperStore", "__version__", "chunk_keys", "decode_record",
    "encode_record", "get_layout", "open_store", "read_header", "register_backend",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
