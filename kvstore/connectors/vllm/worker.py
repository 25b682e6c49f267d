"""The connector's worker side (each vLLM worker process): loads and saves of paged KV.

* **Background loads** (``LoadSpec.background``): ``start_load`` hands each to a loader thread
  that fetches the records (received into pooled buffers), verifies each and scatters it into the
  request's own blocks; the engine keeps running other requests. ``finished`` reports the
  request once its loader is done, exactly once; the blocks a partial load could not fill are
  reported as load errors in the same step, so vLLM recomputes from the first of them. A request
  aborted while loading is stopped between chunks and reported once its loader has stopped (vLLM
  keeps its blocks until then): nothing writes into a block after it was reported.
* **Loads before the forward** (``load_mode="sync"``) run inside ``start_load``, as before.
  Tokens of vLLM's local hit are never written.
* **Saves**: the step's completed chunks are gathered from the paged cache into pooled buffers
  and handed to the store (local tiers written at once, shared tiers by background writers). In
  ``save_mode="async"`` a saver thread does the gather; vLLM keeps a finished request's blocks
  until ``finished`` reports it in ``finished_sending`` (the rule both sides share: every finished
  request that had a SaveSpec), and a preempted request's pending gathers finish in
  ``handle_preemptions`` before its blocks can be overwritten. A full save queue drops the save
  (counted), never blocks the engine.
* **After a failed synchronous load** the blocks from the failure on hold no valid KV until vLLM
  recomputes them: saves covering them, or the request, are refused when they were planned before
  the scheduler learned of the failure (the step that failed, plus ``lag`` steps planned ahead
  under async scheduling); the recompute's own saves go through, so the cache heals.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.connectors.vllm.facts import EngineFacts, build_namespace
from kvstore.connectors.vllm.measure import WorkerMeasurements
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.connectors.vllm.plan import blocks_for, failed_blocks
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.metrics.catalog import SAVE_DROPS
from kvstore.paged import KVTransfer, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.record import Record
from kvstore.stores import Store, shared  # noqa: F401 - shared's exit hook must be registered before ours

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerSide", "live_workers"]

log = logging.getLogger("kvstore.vllm")

_SAVE_QUEUE = 256  # save specs waiting for the saver thread before new ones are dropped
_live: weakref.WeakSet[WorkerSide] = weakref.WeakSet()


def live_workers() -> list[WorkerSide]:
    """The worker sides alive in this process (an in-process engine's: offline warming waits
    for their background saves)."""
    return list(_live)


@atexit.register  # after kvstore.stores.shared's (imported above): runs before it closes the stores
def _finish_saves_at_exit() -> None:
    """An offline script may end without shutting vLLM down, and the gathers still queued on the
    saver threads would die with the process; finish them while the stores are open, so their
    records reach the stores' writers, which ``shared`` drains next."""
    for worker in live_workers():
        worker.close()


class _Cancelled(Exception):
    """Internal: a background load of an aborted request stops between chunks."""


@dataclass
class _Load:
    spec: LoadSpec
    future: Future[int]
    cancel: threading.Event


class WorkerSide:
    """Loads and saves of one worker (one TP rank)."""

    def __init__(self, store: Store, facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int) -> None:
        self.store = store
        self.opts = opts
        self.tp_rank = tp_rank
        self.block_size = facts.block_size
        self.namespace, self.layout = build_namespace(facts, opts, tp_rank)
        self.transfer: KVTransfer | None = None
        self._loader: KVTransfer | None = None  # the loader thread's own (a transfer holds per-thread staging)
        self._saver: KVTransfer | None = None
        self._load_errors: set[int] = set()
        self._loads: dict[str, _Load] = {}
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        # Saves: a queue drained by one thread; per request, gathers still to run.
        self._save_queue: queue.Queue[SaveSpec | None] = queue.Queue(_SAVE_QUEUE)
        self._save_lock = threading.Condition()
        self._pending_saves: Counter[str] = Counter()
        self._saw_saves: set[str] = set()  # requests a SaveSpec came for (reported at finish)
        self._finishing: set[str] = set()  # finished requests whose gathers may still run
        self._save_thread: threading.Thread | None = None
        # Failed synchronous loads: request/block -> the last plan step that may have used them.
        self._tainted_reqs: dict[str, int] = {}
        self._tainted_blocks: dict[int, int] = {}
        self.measure = WorkerMeasurements(store)
        self._closed = False
        _live.add(self)

    def register_kv_caches(self, names: list[str], caches: list[torch.Tensor]) -> None:
        """``caches`` of every layer, in layer order (``names`` for the log)."""
        shapes = {tuple(c.shape) for c in caches}
        if len(shapes) != 1:
            raise ConfigError(f"KVStoreConnector needs every layer's KV cache to have one shape; got {sorted(shapes)}")
        cache = PrefixCache(self.store, self.namespace, codec=self.opts.codec, auth=self.opts.record_auth())
        self.transfer = KVTransfer(cache, caches, self.layout)  # checks layout, dtype, block size, layers
        self._loader = KVTransfer(cache, caches, self.layout)
        self._saver = KVTransfer(cache, caches, self.layout)
        self.measure = WorkerMeasurements(self.store, cuda=caches[0].is_cuda)  # CUDA events time the forward
        log.info("KVStoreConnector (worker %d): %d layers %s %s, layout %s, namespace %s, load %s, save %s",
                 self.tp_rank, len(caches), dtype_name(caches[0].dtype), list(caches[0].shape),
                 self.layout.name, self.namespace.id, self.opts.load_mode, self.opts.save_mode)

    def close(self) -> None:
        """Stop loading; finish the queued gathers (at most ``flush_timeout``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for load in self._loads.values():
            load.cancel.set()
        self._load_pool.shutdown(wait=True)
        if self._save_thread is not None:
            self._save_queue.put(None)
            self._save_thread.join(timeout=self.opts.flush_timeout)

    # -- load --------------------------------------------------------------------------------------
    def step_begins(self, meta: KVStoreConnectorMetadata) -> None:
        """vLLM bound this step's plan: its forward follows (then ``save``). The forward is timed
        for the prefill speed unless a synchronous load runs inside it."""
        sync_loads = any(not spec.background for spec in meta.loads)
        self.measure.forward_starts(0 if sync_loads else meta.prefill_tokens)

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads; synchronous ones finish here."""
        if not meta.loads or self.transfer is None:
            return
        for spec in meta.loads:
            if spec.background:
                cancel = threading.Event()
                self._loads[spec.req_id] = _Load(spec, self._load_pool.submit(self._load, spec, cancel), cancel)
                continue
            present = self._run_load(self.transfer, spec, None)
            if present < spec.end:
                bad = failed_blocks(spec.block_ids, self.block_size, present, spec.end)
                self._load_errors.update(bad)
                last = meta.step + meta.lag  # plans up to this step were made before the scheduler knew
                self._tainted_reqs[spec.req_id] = last
                self._tainted_blocks.update((b, last) for b in bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens; %d blocks recomputed",
                         spec.req_id, present, spec.end, len(bad))

    def _load(self, spec: LoadSpec, cancel: threading.Event) -> int:
        assert self._loader is not None
        return self._run_load(self._loader, spec, cancel)

    def _run_load(self, transfer: KVTransfer, spec: LoadSpec, cancel: threading.Event | None) -> int:
        """Tokens of ``spec`` present after loading (``spec.start``: nothing loaded); never raises."""
        try:
            slots = slots_from_block_table(spec.block_ids, self.block_size, spec.end)
            check = None
            if cancel is not None:
                def check(chunk: ChunkKey, record: Record) -> None:
                    if cancel.is_set():
                        raise _Cancelled
            present, _ = transfer.load_sequence(
                spec.tokens, slots, max_tokens=spec.end, skip_tokens=spec.start,
                namespace=self.namespace.with_salt(spec.salt), before_place=check)
            return present
        except _Cancelled:
            return spec.start
        except Exception:
            log.exception("KVStoreConnector: load of request %s failed", spec.req_id)
            return spec.start

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` of this step; each request reported once."""
        recving: set[str] = set()
        for req_id in finished_req_ids & self._loads.keys():
            self._loads[req_id].cancel.set()  # aborted while loading: stop between chunks
        for req_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[req_id]
            recving.add(req_id)
            present = load.future.result()
            spec = load.spec
            if present < spec.end and not load.cancel.is_set():
                bad = failed_blocks(spec.block_ids, self.block_size, present, spec.end)
                self._load_errors.update(bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens in the background; %d blocks "
                         "recomputed", req_id, present, spec.end, len(bad))
        return self._finished_saves(finished_req_ids), recving

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save --------------------------------------------------------------------------------------
    def save(self, meta: KVStoreConnectorMetadata | None) -> None:
        self.measure.forward_ended()
        if meta is None or self.transfer is None:
            return
        for spec in meta.saves:
            if self.opts.save_mode == "async":
                with self._save_lock:
                    self._saw_saves.add(spec.req_id)
            if self._tainted(spec, meta.step):
                continue
            if self.opts.save_mode != "async":
                self._run_save(self.transfer, spec)
                continue
            with self._save_lock:
                self._pending_saves[spec.req_id] += 1
            try:
                self._saver_thread()
                self._save_queue.put_nowait(spec)
            except queue.Full:
                self._save_done(spec.req_id)
                SAVE_DROPS.inc(reason="queue_full")
        for step_map in (self._tainted_reqs, self._tainted_blocks):
            for key in [k for k, last in step_map.items() if last <= meta.step]:
                del step_map[key]  # type: ignore[arg-type]

    def _tainted(self, spec: SaveSpec, step: int) -> bool:
        """Whether ``spec`` (planned in ``step``) may cover KV of a failed load not yet recomputed."""
        if self._tainted_reqs.get(spec.req_id, -1) >= step:
            return True
        if self._tainted_blocks:
            used = spec.block_ids[:blocks_for(max(spec.ends), self.block_size)]
            return any(self._tainted_blocks.get(b, -1) >= step for b in used)
        return False

    def _saver_thread(self) -> None:
        if self._save_thread is None:
            self._save_thread = threading.Thread(target=self._drain_saves, name="kvstore-save", daemon=True)
            self._save_thread.start()

    def _drain_saves(self) -> None:
        assert self._saver is not None
        while (spec := self._save_queue.get()) is not None:
            try:
                self._run_save(self._saver, spec)
            finally:
                self._save_done(spec.req_id)

    def _save_done(self, req_id: str) -> None:
        with self._save_lock:
            self._pending_saves[req_id] -= 1
            if self._pending_saves[req_id] <= 0:
                del self._pending_saves[req_id]
            self._save_lock.notify_all()

    def _run_save(self, transfer: KVTransfer, spec: SaveSpec) -> None:
        try:
            top = max(spec.ends)
            slots = slots_from_block_table(spec.block_ids, self.block_size, top)
            transfer.save_sequence(spec.tokens[:top], slots, namespace=self.namespace.with_salt(spec.salt),
                                   ends=spec.ends, from_token=spec.start)
        except Exception:
            log.exception("KVStoreConnector: save of request %s failed", spec.req_id)

    def _finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose gathers are all done (background saves only)."""
        if self.opts.save_mode != "async":
            return set()
        with self._save_lock:
            self._finishing |= finished_req_ids & self._saw_saves
            done = {r for r in self._finishing if self._pending_saves.get(r, 0) == 0}
            self._finishing -= done
            self._saw_saves -= done
        return done

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for background loads and gathers to finish; True if they did."""
        for load in list(self._loads.values()):
            try:
                load.future.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - a timeout or a load's failure: reported by finished()
                return False
        with self._save_lock:
            return self._save_lock.wait_for(lambda: not self._pending_saves, timeout=timeout)

    def handle_preemptions(self, meta: KVStoreConnectorMetadata) -> None:
        """Finish the gathers of preempted requests before their freed blocks are reused."""
        with self._save_lock:
            while any(self._pending_saves.get(r, 0) for r in meta.preempted):
                self._save_lock.wait(timeout=1.0)
