"""The connector's worker side (each vLLM worker process): loads and saves of paged KV.

``start_load`` runs the step's loads synchronously before the forward (the scheduler marks such
steps ``has_sync_kv_loads``). Every record is verified before a byte reaches the cache; a chunk
that is missing or fails verification stops the load, and the blocks it should have filled are
reported through ``block_ids_with_load_errors`` so vLLM recomputes them. Tokens of vLLM's local
hit are never written. ``save`` gathers the step's completed chunks into host staging memory
and hands the encoded records to the store: the local tiers are written at once, shared tiers
(Redis, S3) by the tiered store's background writers, so the forward never waits on the network.

Blocks are never freed under a save: the gather finishes inside the step that computed the
blocks, and the worker runs steps in order, so a block freed after ``request_finished`` can only
be rewritten by a later step, after its copy is taken.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.connectors.vllm.facts import EngineFacts, build_namespace
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.connectors.vllm.plan import blocks_for, failed_blocks
from kvstore.errors import ConfigError
from kvstore.paged import KVTransfer, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores import Store

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerSide"]

log = logging.getLogger("kvstore.vllm")


class WorkerSide:
    """Loads and saves of one worker (one TP rank)."""

    def __init__(self, store: Store, facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int) -> None:
        self.store = store
        self.opts = opts
        self.tp_rank = tp_rank
        self.block_size = facts.block_size
        self.namespace, self.layout = build_namespace(facts, opts, tp_rank)
        self.transfer: KVTransfer | None = None
        self._load_errors: set[int] = set()
        # After a failed load, blocks from the failure on hold no valid KV until vLLM recomputes
        # them. vLLM learns of the failure from this step's output; with async scheduling the
        # next step was already planned without knowing it. So for this step and the next, no
        # save may cover a failed block or a request whose load failed (value: last step).
        self._step = 0
        self._tainted_reqs: dict[str, int] = {}
        self._tainted_blocks: dict[int, int] = {}

    def register_kv_caches(self, names: list[str], caches: list[torch.Tensor]) -> None:
        """``caches`` of every layer, in layer order (``names`` for the log)."""
        shapes = {tuple(c.shape) for c in caches}
        if len(shapes) != 1:
            raise ConfigError(f"KVStoreConnector needs every layer's KV cache to have one shape; got {sorted(shapes)}")
        cache = PrefixCache(self.store, self.namespace, codec=self.opts.codec, auth=self.opts.record_auth())
        self.transfer = KVTransfer(cache, caches, self.layout)  # checks layout, dtype, block size, layers
        log.info("KVStoreConnector (worker %d): %d layers %s %s, layout %s, namespace %s",
                 self.tp_rank, len(caches), dtype_name(caches[0].dtype), list(caches[0].shape),
                 self.layout.name, self.namespace.id)

    # -- load --------------------------------------------------------------------------------------
    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        if not meta.loads or self.transfer is None:
            return
        for spec in meta.loads:
            present = self._load(spec)
            if present < spec.end:
                bad = failed_blocks(spec.block_ids, self.block_size, present, spec.end)
                self._load_errors.update(bad)
                self._tainted_reqs[spec.req_id] = self._step + 1
                self._tainted_blocks.update((b, self._step + 1) for b in bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens; %d blocks recomputed",
                         spec.req_id, present, spec.end, len(bad))

    def _load(self, spec: LoadSpec) -> int:
        assert self.transfer is not None
        try:
            slots = slots_from_block_table(spec.block_ids, self.block_size, spec.end)
            present, _ = self.transfer.load_sequence(
                spec.tokens, slots, max_tokens=spec.end, skip_tokens=spec.start,
                namespace=self.namespace.with_salt(spec.salt))
            return present
        except Exception:
            log.exception("KVStoreConnector: load of request %s failed", spec.req_id)
            return spec.start

    def block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save --------------------------------------------------------------------------------------
    def save(self, meta: KVStoreConnectorMetadata | None) -> None:
        try:
            if meta is not None and self.transfer is not None:
                for spec in meta.saves:
                    if not self._tainted(spec):
                        self._save(spec)
        finally:
            self._step += 1
            if self._tainted_reqs or self._tainted_blocks:
                self._tainted_reqs = {r: s for r, s in self._tainted_reqs.items() if s >= self._step}
                self._tainted_blocks = {b: s for b, s in self._tainted_blocks.items() if s >= self._step}

    def _tainted(self, spec: SaveSpec) -> bool:
        if spec.req_id in self._tainted_reqs:
            return True
        if self._tainted_blocks:
            used = spec.block_ids[:blocks_for(max(spec.ends), self.block_size)]
            return any(b in self._tainted_blocks for b in used)
        return False

    def _save(self, spec: SaveSpec) -> None:
        assert self.transfer is not None
        try:
            slots = slots_from_block_table(spec.block_ids, self.block_size, max(spec.ends))
            for end in spec.ends:
                self.transfer.save_sequence(spec.tokens[:end], slots[:end], namespace=self.namespace.with_salt(spec.salt))
        except Exception:
            log.exception("KVStoreConnector: save of request %s failed", spec.req_id)
