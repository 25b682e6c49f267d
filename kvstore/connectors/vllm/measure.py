"""What a worker measures for the scheduler's load-or-recompute decision.

The decision is made in the scheduler (EngineCore process), but both of its inputs are only
seen by the workers, which may be other processes:

* **how fast loads read**: each tier's reads, as the worker's tiered store timed them
  (``LinkSpeed.take_reads``);
* **how fast the engine prefills**: the forward of a step that computes at least
  ``PREFILL_SAMPLE_TOKENS`` prompt tokens and loads nothing synchronously, from
  ``bind_connector_metadata`` (vLLM binds the plan right before the forward; ``start_load_kv``
  comes after it unless a load is synchronous) to ``wait_for_save``. On CUDA the forward is
  queued, not run, by then: CUDA events time it and are read once they have completed, so
  measuring never synchronizes the stream. A wall clock between two scheduler steps would count
  the idle time between requests as prefill.

``take()`` returns what was measured since the last call; the connector ships it in its
``KVConnectorStats`` and the scheduler's ``update_connector_output`` feeds the cost model.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvstore.cost import Measurements
from kvstore.stores import Store

__all__ = ["PREFILL_SAMPLE_TOKENS", "WorkerMeasurements"]

#: Steps computing fewer prompt tokens than this say little about prefill speed (decode dominates).
PREFILL_SAMPLE_TOKENS = 128
_MAX_PENDING = 16  # CUDA forwards timed but not completed yet; more are not timed


class WorkerMeasurements:
    """One worker's measurements; ``cuda`` times forwards with CUDA events. Thread-safe."""

    def __init__(self, store: Store, *, cuda: bool = False) -> None:
        self._store = store
        self._cuda = cuda
        self._lock = threading.Lock()
        self._started: tuple[int, Any] | None = None  # prompt tokens, start time or event
        self._pending: list[tuple[int, Any, Any]] = []  # CUDA: tokens, start event, end event
        self._tokens = 0
        self._seconds = 0.0

    def forward_starts(self, prompt_tokens: int) -> None:
        """The step's forward starts now and computes ``prompt_tokens`` prompt tokens."""
        if prompt_tokens < PREFILL_SAMPLE_TOKENS or (self._cuda and len(self._pending) >= _MAX_PENDING):
            self._started = None
            return
        self._started = (prompt_tokens, self._mark())

    def forward_ended(self) -> None:
        """The forward started by ``forward_starts`` is done (on CUDA: queued)."""
        started, self._started = self._started, None
        if started is None:
            return
        tokens, start = started
        end = self._mark()
        with self._lock:
            if self._cuda:
                self._pending.append((tokens, start, end))
            else:
                self._tokens += tokens
                self._seconds += end - start

    def take(self) -> Measurements:
        """What was measured since the last call."""
        out = Measurements()
        reads = {t.name: t.speed.take_reads() for t in self._store.tiers}
        out.reads = {name: r for name, r in reads.items() if r[2]}
        with self._lock:
            if self._cuda:
                self._collect_completed()
            out.prefill_tokens, out.prefill_seconds = self._tokens, self._seconds
            self._tokens, self._seconds = 0, 0.0
        return out

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _collect_completed(self) -> None:
        waiting = []
        for tokens, start, end in self._pending:
            if end.query():
                self._tokens += tokens
                self._seconds += start.elapsed_time(end) / 1e3
            else:
                waiting.append((tokens, start, end))
        self._pending = waiting
