"""The connector of a vLLM engine running in this process, as offline tools use it.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's engine core (and, with one worker, the worker)
runs in the caller's process, so a tool such as ``kvstore warm`` can ask the connector which keys
it saves for a prompt, which store it writes, and wait for its background saves. This module is
that seam; nothing else outside the connector reaches into its scheduler or worker sides.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.connectors.vllm.scheduler import SchedulerSide, live_schedulers
from kvstore.connectors.vllm.worker import live_workers
from kvstore.keys import ChunkKey
from kvstore.stores import Store

__all__ = ["InProcessConnector", "connectors_now"]


def connectors_now() -> set[int]:
    """Identities of the connectors alive now (pass to ``InProcessConnector.started_after``)."""
    return set(map(id, live_schedulers()))


class InProcessConnector:
    """One in-process engine's connector (its scheduler side, and the workers of this process)."""

    def __init__(self, scheduler: SchedulerSide) -> None:
        self._scheduler = scheduler

    @classmethod
    def started_after(cls, before: set[int], store: Sequence[str]) -> InProcessConnector | None:
        """The connector started since ``before`` (``connectors_now()``) on the store URLs
        ``store``, or None (the engine runs its core in another process)."""
        mine = [s for s in live_schedulers() if id(s) not in before and s.opts.store == tuple(store)]
        return cls(mine[-1]) if mine else None

    @property
    def store(self) -> Store:
        return self._scheduler.store

    @property
    def namespace_id(self) -> str:
        """The namespace of the first KV cache group's first TP rank (what a summary names)."""
        caches = self._scheduler.caches
        return caches[0].namespace.id if caches else ""

    def chunk_keys(self, tokens: Sequence[int], salt: str = "") -> list[ChunkKey]:
        """Every key a hit on ``tokens`` needs (``SchedulerSide.chunk_keys``)."""
        return self._scheduler.chunk_keys(tokens, salt)

    def wait_saved(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for this process's workers' background gathers, then flush their
        stores' writes; False if a gather was still running."""
        done = True
        for worker in live_workers():
            done = worker.wait_idle(timeout) and done
            worker.store.flush()
        return done
