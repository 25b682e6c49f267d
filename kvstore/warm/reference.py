"""``ReferenceWarmEngine``: warm with the in-package reference engine through the agent API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.connectors.agent import AgentConfig, KVStoreAgent
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.lookup_service import register_prefix_lookup
from kvstore.reference import PRESETS, ModelRunner
from kvstore.stores import Store, TieredStore
from kvstore.warm.engine import CountingStore, WarmEngine

__all__ = ["ReferenceWarmEngine"]


class ReferenceWarmEngine(WarmEngine):
    """The in-package reference engine with the agent connector (``connectors.agent``), in-process.

    The model and namespace are those a serving reference engine with the same ``preset`` (or
    ``config``), ``chunk_tokens`` and store builds, so what this writes is what it looks up.
    While it is open, the process's metrics server answers router lookups for its namespace
    (``docs/lookup.md``).
    """

    name = "reference"

    def __init__(self, store: str | Sequence[str], *, preset: str = "tiny", config: Any = None,
                 chunk_tokens: int | None = None, codec: str = "raw",
                 store_options: dict[str, Any] | None = None) -> None:
        if config is None:
            if preset not in PRESETS:
                raise ConfigError(f"--preset {preset!r} is not known; accepted: {', '.join(PRESETS)}")
            config = PRESETS[preset]
        self.config = config
        urls = [store] if isinstance(store, str) else list(store)
        # Without an explicit chunk size, use the agent's own default: a serving replica built
        # with default settings must find what this writes.
        sizing: dict[str, Any] = {"chunk_tokens": chunk_tokens} if chunk_tokens else {}
        agent_config = AgentConfig(store=tuple(urls), model=config.name, model_fingerprint=config.fingerprint,
                                   codec=codec, **sizing)
        self._store = CountingStore(TieredStore.from_urls(urls, **(store_options or {})))
        self.agent = KVStoreAgent(agent_config, store=self._store)
        self.runner = ModelRunner(config, agent=self.agent)
        self.transfer = self.agent.transfer(self.runner.model, self.runner.kv_caches)
        self._max_tokens = config.num_blocks * config.block_size - 1
        # `kvstore warm --metrics-port` then tells a router (or an operator) what is stored so far.
        self._unregister_lookup = register_prefix_lookup([self.transfer.cache], limit=self.transfer.usable_tokens)

    @property
    def store(self) -> Store:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return self.transfer.keys(list(tokens))

    def prefill(self, tokens: Sequence[int]) -> None:
        if len(tokens) > self._max_tokens:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds the engine's cache of {self._max_tokens} tokens")
        if max(tokens) >= self.config.vocab_size:
            sizes = ", ".join(f"{name}: {c.vocab_size}" for name, c in PRESETS.items())
            raise ConfigError(
                f"token id {max(tokens)} is outside the reference engine's vocabulary of {self.config.vocab_size} "
                f"(presets: {sizes}). It is kvstore's small built-in model, for demos and tests; to warm your "
                "model's cache, run it: --engine vllm --model DIR, or --engine server --url URL")
        self.runner.generate([list(tokens)], max_new_tokens=1)

    def bytes_written(self) -> int:
        return self._store.bytes_put

    def flush(self) -> None:
        self.agent.flush()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.config.name, "fingerprint": self.config.fingerprint,
                "namespace": self.transfer.cache.namespace.id, "store": self._store.describe()}

    def close(self) -> None:
        self._unregister_lookup()
        self.agent.close()
