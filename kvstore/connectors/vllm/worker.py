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
* **KV heads**: attention records hold KV head ranges (``kvstore.heads``): each rank saves the
  records of the heads it holds (of ranks that replicate a head, only the first), and loads from
  the records the scheduler found covering the hit (``LoadSpec.heads``): its own range's, or
  finer ones joined, or a coarser one sliced (``kvstore.heads.cover``).
* **KV cache groups**: one ``KVTransfer`` per stored group over that group's layers (a
  ``StateTransfer`` for a recurrent-state group); a load fills every group (a sliding-window or
  chunked-local group from the start of its window only, a state group with the state at the
  hit's end, in the block vLLM allocated for the hit's last block) and counts only if every
  group loaded; with several groups a failed load is reported as a failed request
  (``failed_loads``: vLLM cannot map block ids of several groups back to requests) and recomputed.
  Windows and states are gathered inside the step, whatever ``save_mode``: vLLM frees (or
  moves on from) those blocks as the request moves on, so a background gather could read reused ones.
* **After a failed synchronous load** the blocks from the failure on hold no valid KV until vLLM
  recomputes them: saves covering them, or the request, are refused when they were planned before
  the scheduler learned of the failure (the step that failed, plus ``lag`` steps planned ahead
  under async scheduling); the recompute's own saves go through, so the cache heals.
* **P/D promises** (``SaveSpec.promise``): once the save that completes a prefill's promised
  prefix is handed to the store, a watcher thread waits for the shared tiers' writers to send
  its records and observes the time from the end of that step's forward
  (``kvstore_pd_prefill_to_visible_seconds``); records not visible within ``pd_deadline`` are
  counted (``kvstore_pd_promises_total{result="late"}``). The engine's step never waits for it.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.connectors.vllm.facts import EngineFacts, build_namespace, group_heads
from kvstore.connectors.vllm.measure import WorkerMeasurements
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.connectors.vllm.plan import blocks_for, failed_blocks, state_block, window_chunks, window_start
from kvstore.errors import ConfigError
from kvstore.events import KVEventPublisher, mediums
from kvstore.heads import cover
from kvstore.keys import ChunkKey, HeadRange
from kvstore.metrics.catalog import LATENCY, PD_PROMISES, PD_VISIBLE, SAVE_DROPS
from kvstore.paged import KVTransfer, StateTransfer, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.record import Record
from kvstore.stores import Store, shared  # noqa: F401 - shared's exit hook must be registered before ours

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerSide", "allow_amx_tiles", "live_workers"]

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


def allow_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, through
    torch) on a CPU with AMX tiles; whether it is granted. Idempotent.

    vLLM CPU 0.32's own AMX kernels (its ``amx`` attention, its small-weight GEMMs) execute tile
    instructions without asking; torch's matmuls ask on their first large product. A process
    whose first tile instruction is vLLM's dies of SIGILL: vLLM alone does when a fresh engine's
    first prompt is a few tokens long (``tests/test_vllm_hosts.py`` shows it, without a
    connector), and with a connector so does a fresh engine whose first forward is a prefix hit's
    short suffix, which only a connector makes. Asking first makes both ordinary.
    """
    import torch

    cpu = torch.cpu
    if not (hasattr(cpu, "_is_amx_tile_supported") and hasattr(cpu, "_init_amx")) or not cpu._is_amx_tile_supported():
        return False
    return bool(cpu._init_amx())


class WorkerSide:
    """Loads and saves of one worker (one TP rank)."""

    def __init__(self, store: Store, facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int) -> None:
        if facts.device_type == "cpu" and allow_amx_tiles():
            log.debug("KVStoreConnector (worker %d): AMX tile state requested for vLLM's AMX kernels", tp_rank)
        self.store = store
        self.opts = opts
        self.tp_rank = tp_rank
        self.block_size = facts.block_size
        self.groups = facts.stored_groups
        # A failed load is reported per request (and recomputed whole) when block ids cannot say
        # what failed: several groups' ids overlap, a windowed group's earlier blocks are already
        # gone (recomputing from a later block would need them), and a state is all or nothing.
        self._failures_by_request = len(self.groups) > 1 or any(not g.every_chunk for g in self.groups)
        if self._failures_by_request and opts.load_mode == "sync":
            raise ConfigError(f"load_mode='sync' needs a model with one full-attention KV cache group; this one has "
                              f"{[g.kind for g in self.groups]} (vLLM recovers a failed synchronous load by block "
                              f"id, which these groups make ambiguous): use load_mode='async'")
        spaces = [build_namespace(facts, opts, tp_rank, g) for g in self.groups]
        self.namespaces = [ns for ns, _ in spaces]
        self._layouts = [layout for _, layout in spaces]
        # Per stored group: the KV heads this rank holds (None: records not cut by head) and
        # whether it writes their records (of ranks replicating a head or MLA's latent, the first).
        held = [group_heads(facts, g, tp_rank) for g in self.groups]
        self.heads: list[HeadRange | None] = [h for h, _ in held]
        self._writes = [w for _, w in held]
        # Per stored KV group, one transfer for the step's own work and one per background thread
        # (a transfer holds per-thread staging); None for a state group, whose StateTransfer
        # (``states``, by group position) holds none.
        self.transfers: list[KVTransfer | None] = []
        self._loaders: list[KVTransfer | None] = []
        self._savers: list[KVTransfer | None] = []
        self.states: dict[int, StateTransfer] = {}
        self._registered = False
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._loads: dict[str, _Load] = {}
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        # Saves: a queue drained by one thread; per request, gathers still to run.
        self._save_queue: queue.Queue[SaveSpec | None] = queue.Queue(_SAVE_QUEUE)
        self._save_lock = threading.Condition()
        self._pending_saves: Counter[str] = Counter()
        self._saw_saves: set[str] = set()  # requests a SaveSpec came for (reported at finish)
        self._finishing: set[str] = set()  # finished requests whose gathers may still run
        self._save_thread: threading.Thread | None = None
        # P/D promises: request -> when the forward of its promise's save ended; one watcher thread.
        self._promised_at: dict[str, float] = {}
        self._visibility = ThreadPoolExecutor(1, thread_name_prefix="kvstore-pd-visible")
        # Failed synchronous loads: request/block -> the last plan step that may have used them.
        self._tainted_reqs: dict[str, int] = {}
        self._tainted_blocks: dict[int, int] = {}
        self.measure = WorkerMeasurements(store)
        self._events_config = opts.events_config(facts.block_size, facts.data_parallel_rank) if tp_rank == 0 else None
        self.events: KVEventPublisher | None = None
        self._closed = False
        _live.add(self)

    @property
    def transfer(self) -> KVTransfer | None:
        """The first stored KV group's transfer (None until ``register_kv_caches``)."""
        return next((t for t in self.transfers if t is not None), None)

    def register_kv_caches(self, names: list[str], caches: list[torch.Tensor]) -> None:
        """``caches`` of every layer, in layer order, ``names`` their vLLM layer names: each stored
        group takes its own layers (an engine with one group, every layer)."""
        if not self.groups:
            log.info("KVStoreConnector (worker %d): nothing is stored for this model", self.tp_rank)
            return
        by_name = dict(zip(names, caches))
        # Device staging is outside vLLM's memory budget: one budget per copy path, shared out
        # among the groups that stage (state groups do not).
        staging_groups = sum(g.kind != "state" and lay is not None for g, lay in zip(self.groups, self._layouts))
        staging = max(1 << 20, self.opts.device_staging_bytes // max(1, staging_groups))
        land = self.opts.land_in_cache
        for pos, (group, namespace, layout) in enumerate(zip(self.groups, self.namespaces, self._layouts)):
            if all(n in by_name for n in group.layers):
                layers = [by_name[n] for n in group.layers]
            elif len(self.groups) == 1:
                layers = caches
            else:
                raise ConfigError(f"KV cache group {group.index} names layers vLLM did not register: "
                                  f"{sorted(set(group.layers) - by_name.keys())[:4]}")
            if group.kind == "state" or layout is None:
                state_cache = PrefixCache(self.store, namespace, codec=self.opts.codec, auth=self.opts.record_auth(),
                                          count_tokens=False)
                self.states[pos] = StateTransfer(state_cache, layers, group.state_tensor_bytes)
                self.transfers.append(None)
                self._loaders.append(None)
                self._savers.append(None)
                continue
            if group.kind == "mla":  # a latent cache with a heads axis of 1 (vLLM CPU): the same rows without it
                layers = [c[:, 0] if c.dim() == 4 and c.shape[1] == 1 else c for c in layers]
            shapes = {tuple(c.shape) for c in layers}
            if len(shapes) != 1:
                raise ConfigError(f"KVStoreConnector needs every layer of a KV cache group to have one shape; "
                                  f"group {group.index} has {sorted(shapes)}")
            # Tokens are counted once per prompt: by the first group that stores every chunk.
            counts = group.index == next((g.index for g in self.groups if g.every_chunk), self.groups[0].index)
            cache = PrefixCache(self.store, namespace, codec=self.opts.codec, auth=self.opts.record_auth(),
                                count_tokens=counts, heads=self.heads[pos])
            # KVTransfer checks layout, dtype, block size and layer count against the namespace.
            for paths in (self.transfers, self._loaders, self._savers):
                paths.append(KVTransfer(cache, layers, layout, land=land, staging_bytes=staging))
            if counts and group.every_chunk and self._events_config is not None and self.events is None:
                self._publish_events(cache)
        self._registered = True
        self.measure = WorkerMeasurements(self.store, cuda=caches[0].is_cuda)  # CUDA events time the forward
        log.info("KVStoreConnector (worker %d): %d layers %s %s, layouts %s, KV cache groups %s, namespace %s, "
                 "load %s%s, save %s", self.tp_rank, len(caches), dtype_name(caches[0].dtype), list(caches[0].shape),
                 sorted({ns.layout for ns in self.namespaces}), [f"{g.kind}:{len(g.layers)}" for g in self.groups],
                 self.namespaces[0].id, self.opts.load_mode,
                 " (landing in the blocks)" if any(t is not None and t.lands_in_cache for t in self.transfers) else "",
                 self.opts.save_mode)

    def _publish_events(self, cache: PrefixCache) -> None:
        """KV events for routers (``kv_events_endpoint``): rank 0 announces the saves of the first
        group that stores every chunk (one announcement per prompt; other ranks' and groups' keys
        name the same prefix; a model of sliding windows only announces nothing, its chunks
        being no chain a router could follow) and every tier's evictions (Redis: its keyspace
        notifications)."""
        assert self._events_config is not None
        self.events = KVEventPublisher(self._events_config)
        self.events.watch(self.store, redis=True)
        cache.announce(self.events, mediums(self.store))
        log.info("KVStoreConnector (worker %d): KV events on %s (replay %s), topic %r, %s form, %d blocks per chunk",
                 self.tp_rank, self.events.endpoint, self.events.replay_endpoint or "off",
                 self._events_config.topic, self._events_config.encoding, self._events_config.blocks_per_chunk)

    def close(self) -> None:
        """Stop loading; finish the queued gathers (at most ``flush_timeout``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for load in self._loads.values():
            load.cancel.set()
        self._load_pool.shutdown(wait=True)
        if self._save_thread is not None:
            end = time.monotonic() + self.opts.flush_timeout
            try:
                self._save_queue.put(None, timeout=self.opts.flush_timeout)
            except queue.Full:
                pass  # the saver is behind: what it has not taken when the time is up is dropped below
            self._save_thread.join(timeout=max(0.0, end - time.monotonic()))
            lost = 0
            while True:
                try:
                    spec = self._save_queue.get_nowait()
                except queue.Empty:
                    break
                if spec is not None:
                    lost += 1
                    self._save_done(spec.req_id)
            if lost:
                SAVE_DROPS.inc(lost, reason="shutdown")
                log.warning("KVStoreConnector: %d saves still queued after flush_timeout=%gs were dropped",
                            lost, self.opts.flush_timeout)
        self._visibility.shutdown(wait=False, cancel_futures=True)
        if self.events is not None:
            self.events.close()  # after the saves: what they announced is sent

    # -- load --------------------------------------------------------------------------------------
    def step_begins(self, meta: KVStoreConnectorMetadata) -> None:
        """vLLM bound this step's plan: its forward follows (then ``save``). The forward is timed
        for the prefill speed unless a synchronous load runs inside it."""
        sync_loads = any(not spec.background for spec in meta.loads)
        self.measure.forward_starts(0 if sync_loads else meta.prefill_tokens)

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads; synchronous ones finish here."""
        if not meta.loads or not self._registered:
            return
        for spec in meta.loads:
            if spec.background:
                cancel = threading.Event()
                self._loads[spec.req_id] = _Load(spec, self._load_pool.submit(self._load, spec, cancel), cancel)
                continue
            present = self._run_load(self.transfers, spec, None)
            if present < spec.end:  # one group (sync loads need one): its block ids say what failed
                bad = failed_blocks(spec.block_ids[0], self.block_size, present, spec.end)
                self._load_errors.update(bad)
                last = meta.step + meta.lag  # plans up to this step were made before the scheduler knew
                self._tainted_reqs[spec.req_id] = last
                self._tainted_blocks.update((b, last) for b in bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens; %d blocks recomputed",
                         spec.req_id, present, spec.end, len(bad))

    def _load(self, spec: LoadSpec, cancel: threading.Event) -> int:
        return self._run_load(self._loaders, spec, cancel)

    def _run_load(self, transfers: list[KVTransfer | None], spec: LoadSpec, cancel: threading.Event | None) -> int:
        """Tokens of ``spec`` present in every group after loading (``spec.start``: nothing
        loaded); never raises. Groups load in turn: states first (one small record each), then
        full-attention groups, then windows; a group that falls short ends the load there (the
        request is recomputed from what every group holds)."""
        check = None
        if cancel is not None:
            def check(chunk: ChunkKey, record: Record) -> None:
                if cancel.is_set():
                    raise _Cancelled
        present = spec.end
        order = sorted(range(len(self.groups)),
                       key=lambda i: (self.groups[i].kind != "state", not self.groups[i].every_chunk))
        try:
            for i in order:
                group = self.groups[i]
                namespace = self.namespaces[i].with_salt(spec.salt)
                state = self.states.get(i)
                if state is not None:  # the state after spec.end, into the block vLLM allocated for it
                    if not state.load(spec.tokens, spec.end, state_block(spec.block_ids[i], spec.end, group.block_size
                                                                         or self.block_size),
                                      namespace, spans=spec.spans, before_place=check):
                        present = spec.start
                        break
                    continue
                transfer = transfers[i]
                assert transfer is not None
                skip = spec.start
                if group.windowed:  # vLLM holds, and the next token attends to, the window only
                    skip = max(skip, window_start(spec.end, group.window, self.block_size, local=group.kind == "local"))
                slots = slots_from_block_table(spec.block_ids[i], self.block_size, spec.end)
                got, _ = transfer.load_sequence(
                    spec.tokens, slots, max_tokens=spec.end, skip_tokens=skip,
                    namespace=namespace, spans=spec.spans, before_place=check, sources=self._sources(i, spec))
                if got < spec.end:
                    # A full group holds a shorter prefix; a windowed group short of its window
                    # holds nothing usable (a shorter hit needs an earlier window).
                    present = got if group.every_chunk else spec.start
                    break
            return present
        except _Cancelled:
            return spec.start
        except Exception:
            log.exception("KVStoreConnector: load of request %s failed", spec.req_id)
            return spec.start

    def _sources(self, i: int, spec: LoadSpec) -> list[HeadRange] | None:
        """The head ranges whose records group ``i``'s load reads: those of the ranges the
        scheduler found that cover this rank's heads (None: its own range's, or not cut by head)."""
        own = self.heads[i]
        found = spec.heads[i] if i < len(spec.heads) else []
        if own is None or not found:
            return None
        return cover(own, found) or None

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
                if self._failures_by_request:
                    self._failed_loads.add(req_id)
                    log.info("KVStoreConnector: request %s loaded %d of %d tokens in the background; recomputed",
                             req_id, present, spec.end)
                    continue
                bad = failed_blocks(spec.block_ids[0], self.block_size, present, spec.end)
                self._load_errors.update(bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens in the background; %d blocks "
                         "recomputed", req_id, present, spec.end, len(bad))
        return self._finished_saves(finished_req_ids), recving

    def failed_loads(self) -> set[str]:
        """Requests reported in ``finished`` whose background load fell short, on an engine whose
        failures are reported per request (reported once; vLLM recomputes them)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save --------------------------------------------------------------------------------------
    def save(self, meta: KVStoreConnectorMetadata | None) -> None:
        self.measure.forward_ended()
        if meta is None or not self._registered:
            return
        ended = time.monotonic()
        for spec in meta.saves:
            if spec.promise:
                self._promised_at[spec.req_id] = ended
            if self.opts.save_mode == "async":
                with self._save_lock:
                    self._saw_saves.add(spec.req_id)
            if self._tainted(spec, meta.step):
                continue
            if spec.window_ends or spec.state_ends:
                self._run_save(self.transfers, spec, windows=True)  # now, before vLLM frees or reuses those blocks
            if self.opts.save_mode != "async":
                self._run_save(self.transfers, spec)
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
        if meta.saves:  # what this step spent on saves (handing them over, with save_mode="async")
            LATENCY.observe(time.monotonic() - ended, op="step_save")

    def _tainted(self, spec: SaveSpec, step: int) -> bool:
        """Whether ``spec`` (planned in ``step``) may cover KV of a failed load not yet recomputed."""
        if self._tainted_reqs.get(spec.req_id, -1) >= step:
            return True
        if self._tainted_blocks:
            used = spec.block_ids[0][:blocks_for(max(spec.ends), self.block_size)]
            return any(self._tainted_blocks.get(b, -1) >= step for b in used)
        return False

    def _saver_thread(self) -> None:
        if self._save_thread is None:
            self._save_thread = threading.Thread(target=self._drain_saves, name="kvstore-save", daemon=True)
            self._save_thread.start()

    def _drain_saves(self) -> None:
        while (spec := self._save_queue.get()) is not None:
            try:
                self._run_save(self._savers, spec)
            finally:
                self._save_done(spec.req_id)

    def _save_done(self, req_id: str) -> None:
        with self._save_lock:
            self._pending_saves[req_id] -= 1
            if self._pending_saves[req_id] <= 0:
                del self._pending_saves[req_id]
            self._save_lock.notify_all()

    def _run_save(self, transfers: list[KVTransfer | None], spec: SaveSpec, windows: bool = False) -> None:
        """Save ``spec`` into the full-attention groups (``windows=False``), or the windowed
        groups' windows before ``spec.window_ends`` and the state groups' states at
        ``spec.state_ends`` (``windows=True``: inside the step)."""
        try:
            top = max(spec.ends)
            chunk = self.opts.chunk_tokens
            for i, group in enumerate(self.groups):
                if group.every_chunk == windows or not self._writes[i]:
                    continue  # a replicated head (or MLA's latent) is saved by its first rank only, loaded by every rank
                namespace = self.namespaces[i].with_salt(spec.salt)
                state = self.states.get(i)
                if state is not None:
                    size = group.block_size or self.block_size
                    state.save(spec.tokens, {e: state_block(spec.block_ids[i], e, size) for e in spec.state_ends},
                               namespace, spans=spec.spans)
                    continue
                transfer = transfers[i]
                assert transfer is not None
                slots = slots_from_block_table(spec.block_ids[i], self.block_size, top)
                if group.every_chunk:
                    transfer.save_sequence(spec.tokens[:top], slots, namespace=namespace, ends=spec.ends,
                                           from_token=spec.start, spans=spec.spans, announce=spec.announce)
                    continue
                for end in spec.window_ends:  # the window's chunks are rewritten: what a reader needs
                    first = window_chunks(end, group.window, self.block_size, chunk, local=group.kind == "local").start
                    transfer.save_sequence(spec.tokens[:end], slots, namespace=namespace, ends=[end],
                                           from_token=first * chunk, spans=spec.spans)
        except Exception:
            log.exception("KVStoreConnector: save of request %s failed", spec.req_id)
        if spec.promise and not windows:
            ended = self._promised_at.pop(spec.req_id, None)
            if ended is not None:
                try:
                    self._visibility.submit(self._watch_visible, spec, ended)
                except RuntimeError:  # closing: the store drains what was queued, unwatched
                    pass

    def _watch_visible(self, spec: SaveSpec, ended: float) -> None:
        """Runs on the watcher thread: when the promised prefix's records (this rank's shard of
        the first group that stores every chunk) are in every shared tier, observe the time since
        the forward ``ended``; ``pd_deadline`` after it, count them late."""
        found = next(((j, t) for j, t in enumerate(self.transfers)
                      if t is not None and self.groups[j].every_chunk and self._writes[j]), None)
        if found is None:  # no group stores every chunk (or this rank writes none of its heads): nothing to watch
            return
        i, transfer = found
        cache = transfer.cache
        keys = cache.keys(spec.tokens[:max(spec.ends)], namespace=self.namespaces[i].with_salt(spec.salt),
                          spans=spec.spans)
        left = max(0.0, ended + self.opts.pd_deadline - time.monotonic())
        if self.store.wait_written([k.key for k in keys], left):
            PD_VISIBLE.observe(time.monotonic() - ended)
        else:
            PD_PROMISES.inc(result="late")
            log.info("KVStoreConnector: the records of P/D request %s were not in every shared tier within "
                     "pd_deadline=%gs of its prefill", spec.req_id, self.opts.pd_deadline)

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
