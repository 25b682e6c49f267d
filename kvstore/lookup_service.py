"""Router lookups over prefix caches: what ``POST /v1/lookup`` answers (``docs/lookup.md``).

``PrefixLookup`` answers "how many leading tokens of these token ids does the store hold, per
tier" for one deployment: the prefix caches of its shards (one per TP rank, or per KV cache
group and rank: a load needs every shard, as ``prefix_cache.stored_by_tier`` counts it), all on
one store. ``register_prefix_lookup`` registers one with the process's metrics server
(``kvstore.metrics.lookup.LOOKUPS``). Its promises:

* **Read-only.** A lookup hashes the tokens into the caches' chunk keys (``PrefixCache.keys``:
  their key spaces and a rotation's previous spaces included) and asks the store
  ``longest_prefix_by_tier`` (one round trip per tier and shard, plus one per previous key
  space); nothing is read, promoted or written.
* **Bounded.** A tiered store answers within its tiers' deadlines and skips a tier whose
  breaker is open, so a frozen server costs one lookup at most its deadline and later lookups
  nothing; a store that fails as a whole (not tiered) is a miss. ``lookup`` never raises for a
  storage outage.
* Router lookups are not engine lookups: they are not counted in ``kvstore_lookups_total``
  and its token counters, which measure what engines asked before loading.

The answer (``Answer.to_dict``) says, per tier, how many leading tokens that tier holds for
every shard (``None`` where a faster tier held every chunk asked, so the tier was not asked),
and ``tokens``: what a load would get (each chunk from the fastest tier holding it), before an
engine's cost model, which may recompute a short prefix, and before verification.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey, InputSpan
from kvstore.metrics.lookup import LOOKUPS, LookupInput, LookupRegistry
from kvstore.prefix_cache import PrefixCache
from kvstore.stores.base import Store

__all__ = ["Answer", "PrefixLookup", "TierAnswer", "register_prefix_lookup"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierAnswer:
    name: str
    #: Leading tokens this tier holds for every shard; ``None``: not asked (a faster tier held all).
    tokens: int | None


@dataclass(frozen=True)
class Answer:
    namespace: str
    chunk_tokens: int
    #: Tokens the lookup asked about (the request's, cut by the provider's ``limit``).
    asked: int
    tiers: tuple[TierAnswer, ...]
    #: What a load would get: the longest prefix, over tiers, that every shard holds.
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "chunk_tokens": self.chunk_tokens, "asked_tokens": self.asked,
                "tiers": [{"name": t.name, "tokens": t.tokens} for t in self.tiers], "tokens": self.tokens}


class PrefixLookup:
    """The ``LookupProvider`` of one deployment: ``shards`` (its prefix caches; the first names it)
    on ``store`` (by default the first shard's). ``limit(n)`` cuts a prompt of ``n`` tokens to
    the tokens an engine would look up (vLLM leaves the last one to compute); ``model`` names it
    in ``GET /v1/namespaces`` (default: the namespace's model)."""

    def __init__(self, shards: Sequence[PrefixCache], *, store: Store | None = None,
                 limit: Callable[[int], int] | None = None, model: str | None = None) -> None:
        if not shards:
            raise ConfigError("a prefix lookup needs at least one prefix cache (shards=[...])")
        sizes = {c.chunk_tokens for c in shards}
        if len(sizes) != 1:
            raise ConfigError(f"the shards of a prefix lookup must share chunk_tokens, got {sorted(sizes)}")
        self.shards = list(shards)
        self.store = store if store is not None else shards[0].store
        self._limit = limit
        ns = shards[0].namespace
        self._namespace = ns
        self._model = model or ns.model

    @property
    def namespace_id(self) -> str:
        return self._namespace.id

    def describe(self) -> dict[str, Any]:
        ns = self._namespace
        return {"model": self._model, "chunk_tokens": ns.chunk_tokens, "block_size": ns.block_size,
                "kv_dtype": ns.kv_dtype, "layout": ns.layout, "tp_size": ns.tp_size, "shards": len(self.shards),
                "tiers": [t.name for t in self.store.tiers]}

    def keys(self, tokens: Sequence[int], cache_salt: str = "",
             spans: Sequence[InputSpan] = ()) -> list[list[ChunkKey]]:
        """Every shard's chunk keys of ``tokens`` (cut by ``limit``, with the multimodal inputs
        ``spans``) under ``cache_salt``."""
        n = len(tokens)
        top = max(0, min(n, self._limit(n))) if self._limit is not None else n
        return [c.keys(tokens[:top], namespace=c.namespace.with_salt(cache_salt), spans=spans) for c in self.shards]

    def answer(self, tokens: Sequence[int], cache_salt: str = "", spans: Sequence[InputSpan] = ()) -> Answer:
        """What the store holds of ``tokens`` (see the module docstring); never raises for an outage."""
        keyed = self.keys(tokens, cache_salt, spans)
        names = [t.name for t in self.store.tiers]
        first = keyed[0]
        asked = first[-1].end if first else 0
        held: list[int | None] = [0] * len(names)
        loadable = 0
        if first:
            try:
                held, loadable = self._held(keyed, len(names))
            except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
                log.debug("router lookup failed: %s", exc)
                held, loadable = [0] * len(names), 0

        def tokens_of(chunks: int | None) -> int | None:
            return None if chunks is None else (first[chunks - 1].end if chunks else 0)

        return Answer(self.namespace_id, self._namespace.chunk_tokens, asked,
                      tuple(TierAnswer(name, tokens_of(c)) for name, c in zip(names, held)),
                      tokens_of(loadable) or 0)

    def _held(self, keyed: list[list[ChunkKey]], num_tiers: int) -> tuple[list[int | None], int]:
        """Leading chunks each tier holds for every shard (``None``: unknown, a shard did not ask
        that tier because a faster one held all its chunks) and the leading chunks a load would get."""
        known: list[list[int]] = [[] for _ in range(num_tiers)]
        skipped = [False] * num_tiers
        loadable = len(keyed[0])
        for keys in keyed:
            counts = self.store.longest_prefix_by_tier([k.key for k in keys])
            for j in range(len(keys[0].previous)):  # a rotation's window: the previous keys' spaces too
                older = self.store.longest_prefix_by_tier([k.previous[j].key for k in keys])
                counts = [max(a, b) for a, b in zip(counts, older)]
            full = next((i for i, c in enumerate(counts) if c >= len(keys)), num_tiers)
            for i, c in enumerate(counts):
                if i > full:
                    skipped[i] = True
                else:
                    known[i].append(c)
            loadable = min(loadable, max(counts, default=0))
            if not loadable:  # a load needs every shard: this one holds nothing, so no tier holds any for all
                return [0] * num_tiers, 0
        per_tier: list[int | None] = []
        for i in range(num_tiers):
            low = min(known[i], default=None)
            per_tier.append(None if low is None or (skipped[i] and low > 0) else low)
        return per_tier, loadable

    # -- LookupProvider --------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], cache_salt: str, inputs: Sequence[LookupInput] = ()) -> dict[str, Any]:
        spans = [InputSpan(i.offset, i.length, i.identity, i.modality) for i in inputs]
        return self.answer(tokens, cache_salt, spans).to_dict()


def register_prefix_lookup(shards: Sequence[PrefixCache], *, store: Store | None = None,
                           limit: Callable[[int], int] | None = None, model: str | None = None,
                           registry: LookupRegistry = LOOKUPS) -> Callable[[], None]:
    """Register a ``PrefixLookup`` of ``shards`` with ``registry`` (the metrics server's);
    returns the function that unregisters it (call it when the caches close). No shards (an
    engine that stores nothing): nothing is registered, and the function does nothing."""
    if not shards:
        return lambda: None
    return registry.register(PrefixLookup(shards, store=store, limit=limit, model=model))
