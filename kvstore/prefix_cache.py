"""Engine-agnostic save and load of token-prefix KV through a store.

``PrefixCache`` knows keys, records and stores; it knows nothing of paged caches. Engine
adapters give it, per chunk, the bytes to save (``save``) and take, per verified chunk, the
bytes to place (``load``'s sink). Its promises:

* ``lookup`` costs one ``longest_prefix`` call (one round trip per tier).
* ``load`` verifies each record (namespace, key, token ids, dtype, shapes, hidden state,
  checksum and, with a deployment key, its tag) before handing it to the sink, in prefix
  order, and stops at the first chunk that is missing or fails. A failed record is counted, deleted from the store (best effort) and becomes a miss;
  a store outage is a miss. ``load`` never raises a storage or record error.
* ``save`` skips chunks that are already stored and never raises a storage error; record
  encoding errors (a caller bug) do raise.
* With ``auth`` (a ``RecordAuth``: the deployment's keys) every record saved is signed with
  the key derived for its namespace's cache salt, and ``load`` accepts only records whose tag
  verifies under an accepted key: unsigned, forged and other-key records are counted
  (``kvstore_corrupt_records_total{reason="auth"}``), deleted and missed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, CorruptRecordError, KVStoreError
from kvstore.keys import ChunkKey, Namespace, TokenIds, chunk_keys, tokens_to_array
from kvstore.metrics import catalog as metrics
from kvstore.record import DTYPES, Record, decode_record, encode_record
from kvstore.record.auth import RecordAuth
from kvstore.record.codecs import resolve_chain
from kvstore.stores.base import Store
from kvstore.types import Buffer

__all__ = ["PrefixCache", "ChunkPayload", "LoadResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkPayload:
    """What to store for one chunk: tensors of ``shapes`` in ``dtype``, back to back in ``kv``."""

    shapes: Sequence[Sequence[int]]
    kv: Buffer
    hidden: Buffer | None = None
    hidden_dtype: str | None = None
    hidden_shape: Sequence[int] | None = None


@dataclass
class LoadResult:
    """Outcome of ``PrefixCache.load``: how many leading chunks/tokens were placed."""

    num_chunks: int = 0
    num_tokens: int = 0
    #: The last record placed (its ``hidden`` is the hidden state of the last loaded token).
    last_record: Record | None = None
    #: Why loading stopped: "hit" (every chunk placed), "miss", "corrupt" or "unavailable".
    reason: str = "hit"


class PrefixCache:
    """Chunked, verified save/load of token-prefix KV under one namespace."""

    def __init__(self, store: Store, namespace: Namespace, *, codec: str = "raw",
                 auth: RecordAuth | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self.auth = auth
        itemsize = DTYPES.get(namespace.kv_dtype)
        if itemsize is None:
            raise ConfigError(f"kv_dtype={namespace.kv_dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        self.chain = resolve_chain(codec, itemsize)

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens

    def keys(self, tokens: TokenIds, *, namespace: Namespace | None = None,
             include_partial: bool = True, max_tokens: int | None = None) -> list[ChunkKey]:
        """Chunk keys of ``tokens`` (optionally only chunks ending at or before ``max_tokens``)."""
        ns = namespace or self.namespace
        keys = chunk_keys(ns, tokens, include_partial=include_partial)
        if max_tokens is not None:
            keys = [k for k in keys if k.end <= max_tokens]
        return keys

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are stored (0 if the store is unavailable)."""
        start = time.perf_counter()
        metrics.LOOKUPS.inc()
        try:
            n = self.store.longest_prefix([k.key for k in keys]) if keys else 0
        except KVStoreError as exc:
            log.debug("lookup failed: %s", exc)
            n = 0
        metrics.LATENCY.observe(time.perf_counter() - start, op="lookup")
        if keys:
            metrics.LOOKUP_TOKENS.inc(keys[-1].end)
            metrics.LOOKUP_HIT_TOKENS.inc(keys[n - 1].end if n else 0)
        return n

    def lookup_tokens(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading tokens covered by stored chunks among ``keys``."""
        n = self.lookup(keys)
        return keys[n - 1].end if n else 0

    def load(
        self,
        tokens: TokenIds,
        keys: Sequence[ChunkKey],
        sink: Callable[[ChunkKey, Record], None],
        *,
        shapes: Callable[[ChunkKey], Sequence[Sequence[int]]] | None = None,
        namespace: Namespace | None = None,
        hidden_dtype: str | None = None,
        hidden_shape: Sequence[int] | None = None,
    ) -> LoadResult:
        """Fetch ``keys`` in one batch, verify each, and call ``sink(chunk, record)`` in order.

        ``shapes(chunk)`` gives the tensor shapes the reader expects for a chunk, and
        ``hidden_dtype``/``hidden_shape`` the hidden state its model would consume (a record
        carrying another is rejected; one carrying none is fine); all are checked before the
        sink runs. Stops at the first missing or invalid chunk.
        """
        ns = namespace or self.namespace
        tag_keys = self.auth.for_salt(ns.cache_salt) if self.auth is not None else None
        result = LoadResult()
        if not keys:
            return result
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        try:
            values = self.store.get_many([k.key for k in keys])
        except KVStoreError as exc:
            log.debug("load failed: %s", exc)
            values = [None] * len(keys)
            result.reason = "unavailable"
        for chunk, value in zip(keys, values):
            if value is None:
                if result.reason == "hit":
                    result.reason = "miss"
                break
            try:
                record = decode_record(
                    value, namespace=ns, chunk=chunk, tokens=arr[chunk.start:chunk.end],
                    dtype=ns.kv_dtype, shapes=None if shapes is None else shapes(chunk),
                    hidden_dtype=hidden_dtype, hidden_shape=hidden_shape, auth=tag_keys,
                )
            except CorruptRecordError as exc:
                metrics.CORRUPT.inc(reason=exc.reason)
                log.warning("discarding stored record %s: %s", chunk.key, exc)
                self._discard(chunk.key)
                result.reason = "corrupt"
                break
            sink(chunk, record)
            result.num_chunks += 1
            result.num_tokens = chunk.end
            result.last_record = record
        metrics.HITS.inc(result.num_chunks)
        metrics.MISSES.inc(len(keys) - result.num_chunks)
        metrics.TOKENS_LOADED.inc(result.num_tokens)
        metrics.LATENCY.observe(time.perf_counter() - start, op="load")
        return result

    def save(
        self,
        tokens: TokenIds,
        keys: Sequence[ChunkKey],
        payload: Callable[[ChunkKey], ChunkPayload],
        *,
        skip_stored: bool = True,
        namespace: Namespace | None = None,
    ) -> int:
        """Encode and store the chunks of ``keys``; returns how many were written.

        With ``skip_stored`` the leading chunks already in the store are not rebuilt or
        rewritten (``payload`` is not called for them).
        """
        ns = namespace or self.namespace
        if not keys:
            return 0
        start = time.perf_counter()
        first = self.lookup(keys) if skip_stored else 0
        arr = tokens_to_array(tokens)
        tag_keys = self.auth.for_salt(ns.cache_salt) if self.auth is not None else None
        items: list[tuple[str, Buffer]] = []
        for chunk in keys[first:]:
            p = payload(chunk)
            record = encode_record(
                namespace=ns, chunk=chunk, tokens=arr[chunk.start:chunk.end], dtype=ns.kv_dtype,
                shapes=p.shapes, kv=p.kv, hidden=p.hidden, hidden_dtype=p.hidden_dtype,
                hidden_shape=p.hidden_shape, chain=self.chain, auth=tag_keys,
            )
            items.append((chunk.key, record))
        try:
            self.store.put_many(items)
        except KVStoreError as exc:
            log.debug("save failed: %s", exc)
            return 0
        if items:
            metrics.TOKENS_SAVED.inc(keys[-1].end - keys[first].start)
        metrics.LATENCY.observe(time.perf_counter() - start, op="save")
        return len(items)

    def _discard(self, key: str) -> None:
        try:
            self.store.delete(key)
        except KVStoreError:
            pass
