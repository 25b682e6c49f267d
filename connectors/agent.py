"""The agent API at its historical import path (``from connectors.agent import KVStoreAgent``),
and vLLM V0's entry point with its exact constructor (``KVTransferAgent(rank, local_rank, config)``).

The implementation is ``kvstore.connectors.agent``.
"""

from kvstore.connectors.agent import AgentConfig, AgentStats, KVStoreAgent, KVTransferAgent

__all__ = ["AgentConfig", "AgentStats", "KVStoreAgent", "KVTransferAgent"]
