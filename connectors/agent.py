"""The agent API at its historical import path (``from connectors.agent import KVStoreAgent``).

The implementation is ``kvstore.connectors.agent``.
"""

from kvstore.connectors.agent import AgentConfig, AgentStats, KVStoreAgent

__all__ = ["AgentConfig", "AgentStats", "KVStoreAgent"]
