"""What ``warm`` needs from an engine (``WarmEngine``), and a store wrapper that counts bytes."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.buffers import Pieces
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.stores import Store, WrapperStore
from kvstore.stores.base import WriteValue

__all__ = ["EngineUnavailableError", "WarmEngine", "CountingStore"]


class EngineUnavailableError(KVStoreError, ConnectionError):
    """The engine (a server, a model directory) could not be reached or started."""



class WarmEngine(ABC):
    """What ``warm`` needs from an engine.

    ``prefill`` runs one prompt so that the engine's connector saves its KV, raising on failure.
    ``keys`` names the chunks the engine saves for a prompt (``None`` when unknown) and
    ``store`` is where they land; together they make runs resumable.
    """

    name: str = "engine"
    #: Prompts that may run at the same time (threads calling ``prefill``).
    concurrency: int = 1
    #: Prompts handed to ``prefill_batch`` at once (engines that batch internally, like vLLM).
    batch_size: int = 1

    @property
    def store(self) -> Store | None:
        return None

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        return None

    @abstractmethod
    def prefill(self, tokens: Sequence[int]) -> None:
        """Compute (or load) the KV of ``tokens`` and let the connector save it."""

    def prefill_batch(self, batch: Sequence[Sequence[int]]) -> list[BaseException | None]:
        """Prefill several prompts; the error of each (``None`` on success). Default: one by one."""
        errors: list[BaseException | None] = []
        for tokens in batch:
            try:
                self.prefill(tokens)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - reported per prompt
                errors.append(exc)
        return errors

    def bytes_written(self) -> int | None:
        """Record bytes this engine has written so far, when it can tell."""
        return None

    def flush(self) -> None:
        """Wait for writes still on their way to shared tiers."""
        if self.store is not None:
            self.store.flush()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name}

    def close(self) -> None:
        pass



class CountingStore(WrapperStore):
    """Forwards to ``inner`` and counts the bytes put through it (for the warm summary)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.bytes_put = 0

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_put += nbytes

    def put(self, key: str, value: WriteValue) -> None:
        self.inner.put(key, value)
        self._count(_nbytes(value))

    def put_many(self, items: Iterable[tuple[str, WriteValue]]) -> None:
        items = list(items)
        self.inner.put_many(items)
        self._count(sum(_nbytes(v) for _, v in items))


def _nbytes(value: WriteValue) -> int:
    return len(value) if isinstance(value, Pieces) else memoryview(value).nbytes
