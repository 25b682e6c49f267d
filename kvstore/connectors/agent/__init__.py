"""The agent API (vLLM V0's KV-transfer agent contract): ``KVStoreAgent`` (``agent``), its
options (``config``), V0 batch handling (``batch``) and ``KVTransferAgent`` (``v0``: V0's exact
``KVTransferAgent(rank, local_rank, config)`` constructor over ``KVStoreAgent``). ``config``
imports no torch; the other names are loaded on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.connectors.agent.config import AgentConfig

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers
    from kvstore.connectors.agent.agent import AgentStats, KVStoreAgent
    from kvstore.connectors.agent.batch import rebuild_model_input
    from kvstore.connectors.agent.v0 import KVTransferAgent

_LAZY = {"KVStoreAgent": "agent", "AgentStats": "agent", "rebuild_model_input": "batch", "KVTransferAgent": "v0"}

__all__ = ["AgentConfig", "AgentStats", "KVStoreAgent", "KVTransferAgent", "rebuild_model_input"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
