"""The connector's scheduler side (vLLM's EngineCore process): lookups and per-step plans.

``get_num_new_matched_tokens`` computes the chunk keys of the prompt (cut at the last whole
block that still leaves one token to compute) and asks the store for the longest stored prefix:
one ``longest_prefix`` round trip per tier (and per TP rank with tensor parallelism). It
reports the hit beyond vLLM's own local prefix hit. ``build_meta`` tells the worker, per step,
which request loads which token range into which blocks (new requests with a hit) and which
requests save which prefixes: a chunk is saved in the step that completes it, so with chunked
prefill a long prompt is saved chunk by chunk as its blocks become fully computed.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.connectors.vllm.facts import EngineFacts, build_namespace
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.connectors.vllm.plan import blocks_for, external_tokens, lookup_limit, save_ends
from kvstore.keys import ChunkKey, TokenIds
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import Store

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide", "live_schedulers"]

log = logging.getLogger("kvstore.vllm")

_LOOKUP_TTL = 1.0  # seconds a lookup result is reused while a request waits to be scheduled
_live: weakref.WeakSet[SchedulerSide] = weakref.WeakSet()


def live_schedulers() -> list[SchedulerSide]:
    """The scheduler sides alive in this process (an in-process engine's, for offline warming)."""
    return list(_live)


class SchedulerSide:
    """Lookups and plans for one engine. ``block_ids(req_id)`` reads vLLM's block table."""

    def __init__(self, store: Store, facts: EngineFacts, opts: VLLMConnectorOptions, *, loads: bool,
                 saves: bool, block_ids: Callable[[str], list[int]]) -> None:
        self.opts = opts
        self.store = store
        self.block_size = facts.block_size
        self.do_load, self.do_save = loads, saves
        self._block_ids = block_ids
        # One prefix cache per TP rank: a hit needs every rank's shard.
        self.caches = [PrefixCache(store, build_namespace(facts, opts, rank)[0], codec=opts.codec,
                                   auth=opts.record_auth())
                       for rank in range(facts.tp_size)]
        self._lookups: dict[str, tuple[int, int, float]] = {}  # req -> (num_tokens, hit, when)
        self._requests: dict[str, Request] = {}
        self._local_hit: dict[str, int] = {}  # req -> local hit shown to get_num_new_matched_tokens
        self._pending_loads: dict[str, tuple[int, int]] = {}
        self._saved_upto: dict[str, int] = {}
        ns = self.caches[0].namespace
        log.info("KVStoreConnector (scheduler): namespace %s (%s), role load=%s save=%s, store %s",
                 ns.id, ns.layout, loads, saves, store.describe())
        _live.add(self)

    def chunk_keys(self, tokens: TokenIds, salt: str = "") -> list[ChunkKey]:
        """Keys of every chunk this engine saves for a prompt of ``tokens``, for every TP rank."""
        arr = list(tokens)
        limit = lookup_limit(len(arr), self.block_size)
        return [k for cache in self.caches for k in cache.keys(arr[:limit], namespace=cache.namespace.with_salt(salt))]

    # -- lookup ----------------------------------------------------------------------------------
    def _hit_tokens(self, request: Request) -> int:
        tokens = request.prompt_token_ids or []
        limit = lookup_limit(len(tokens), self.block_size)
        if limit < self.block_size:
            return 0
        cached = self._lookups.get(request.request_id)
        now = time.monotonic()
        if cached is not None and cached[0] == len(tokens) and now - cached[2] < _LOOKUP_TTL:
            return cached[1]
        salt = request.cache_salt or ""
        hit = limit
        for cache in self.caches:  # every TP rank must hold its shard
            ns = cache.namespace.with_salt(salt)
            keys = cache.keys(tokens[:limit], namespace=ns)
            hit = min(hit, cache.lookup_tokens(keys))
            if hit == 0:
                break
        self._lookups[request.request_id] = (len(tokens), hit, now)
        return hit

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.do_load or request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return 0, False  # keys cover token ids only: multimodal prompts bypass the cache
        hit = self._hit_tokens(request)
        self._local_hit[request.request_id] = num_computed_tokens
        return external_tokens(hit, num_computed_tokens, self.opts.min_load_tokens), False

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._lookups.pop(req_id, None)
        local = self._local_hit.pop(req_id, None)
        if num_external_tokens > 0 and local is not None:
            # vLLM places the external tokens right after the (block-aligned) local hit it
            # showed get_num_new_matched_tokens.
            self._pending_loads[req_id] = (local, local + num_external_tokens)

    # -- per-step plans --------------------------------------------------------------------------
    def build_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            self._plan(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        self._pending_loads.clear()
        return meta

    def _plan(self, meta: KVStoreConnectorMetadata, req_id: str, num_computed: int,
              scheduler_output: SchedulerOutput) -> None:
        request = self._requests.get(req_id)
        if request is None or request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return
        prompt = request.prompt_token_ids
        salt = request.cache_salt or ""
        load = self._pending_loads.get(req_id)
        blocks: list[int] | None = None
        if load is not None:
            start, end = load
            blocks = self._block_ids(req_id)
            meta.loads.append(LoadSpec(req_id, list(prompt[:end]), blocks[:blocks_for(end, self.block_size)],
                                       start, end, salt))
        if not self.do_save:
            return
        after = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        done = self._saved_upto.get(req_id, 0)
        ends = save_ends(len(prompt), after, done, chunk_tokens=self.opts.chunk_tokens,
                         block_size=self.block_size, save_partial=self.opts.save_partial_chunks)
        if ends:
            blocks = blocks if blocks is not None else self._block_ids(req_id)
            top = max(ends)
            meta.saves.append(SaveSpec(req_id, list(prompt[:top]), blocks[:blocks_for(top, self.block_size)],
                                       ends, salt))
            self._saved_upto[req_id] = top

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        # A failed load (or a local hit on a block that failed) is recomputed by vLLM; plan the
        # affected requests' saves again so the recomputed chunks reach the store.
        for req_id in list(self._saved_upto):
            try:
                blocks = self._block_ids(req_id)
            except Exception:  # noqa: BLE001 - the request left the cache manager
                continue
            if invalid.intersection(blocks):
                self._saved_upto[req_id] = 0

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        for table in (self._requests, self._lookups, self._local_hit, self._pending_loads, self._saved_upto):
            table.pop(req_id, None)
        return False, None  # saves gather synchronously in the step that computed the blocks
