"""Engine-agnostic save and load of token-prefix KV through a store.

``PrefixCache`` knows keys, records and stores; it knows nothing of paged caches. Engine
adapters give it, per chunk, the bytes to save (``save``) and take, per verified chunk, the
bytes to place (``load``'s sink). Its promises:

* ``lookup`` costs one ``longest_prefix_by_tier`` call (one round trip per tier) and is the one
  lookup every adapter makes (``stored_by_tier``: the vLLM scheduler asks it for every TP rank's
  shard at once); each is counted once in ``kvstore_lookups_total``.
* ``load`` receives the records into leased pool buffers (``Store.get_into``: a Redis tier
  receives record i+1 while record i is verified and placed), verifies each record (namespace,
  key, token ids, dtype, shapes, hidden state, checksum and, with a deployment key, its tag)
  in place before handing it to the sink, in prefix order, and stops at the first chunk that
  is missing or fails. The record handed to the sink is valid only during that call. A failed
  record is counted, deleted from the store (best effort) and becomes a miss; a store outage
  is a miss. ``load`` never raises a storage or record error.
* **Healing.** A cache remembers (a bounded set) the chunks whose record a load rejected; the
  next ``save`` that covers one writes from it on unconditionally, whatever the pre-check or
  ``from_token`` says is stored: the damaged record and every later chunk of that save (a bad
  writer or node damages runs of records, and a deleted record may have failed to go) are
  replaced by the recompute, so the next reader hits the whole prefix. Counted in
  ``kvstore_heals_total`` (chunks rewritten that way).
* ``save`` writes the chunks ending after ``from_token`` (a caller that knows how far the
  prefix is stored says so: no lookup), or, without it, those after the stored prefix (one
  pre-check, counted in ``kvstore_save_checks_total``, not as a lookup); it encodes each record as pieces (its header
  beside the payload, which is never copied into a joined buffer) and never raises a storage
  error; record encoding errors (a caller bug) do raise. A payload may be owned by a lease
  (``ChunkPayload.owner``): ``save`` releases it once the store has taken what it keeps.
* With ``auth`` (a ``RecordAuth``: the deployment's keys) every record saved is signed with
  the key derived for its namespace's cache salt, and ``load`` accepts only records whose tag
  verifies under an accepted key: unsigned, forged and other-key records are counted
  (``kvstore_corrupt_records_total{reason="auth"}``), deleted and missed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.buffers import BufferPool, Lease, Pieces, default_pool
from kvstore.errors import ConfigError, CorruptRecordError, KVStoreError
from kvstore.keys import ChunkKey, Namespace, TokenIds, chunk_keys, tokens_to_array
from kvstore.metrics import catalog as metrics
from kvstore.record import DTYPES, Record, RecordHeader, decode_record, encode_record_pieces
from kvstore.record.auth import RecordAuth, TagKeys
from kvstore.record.codecs import resolve_chain
from kvstore.stores.base import Store
from kvstore.types import Buffer

__all__ = ["PrefixCache", "ChunkPayload", "LoadResult", "stored_by_tier"]

log = logging.getLogger(__name__)

_REJECTED_MAX = 4096  # chunk keys a cache remembers as rejected until a save rewrites them


@dataclass(frozen=True)
class ChunkPayload:
    """What to store for one chunk: tensors of ``shapes`` in ``dtype``, back to back in ``kv``."""

    shapes: Sequence[Sequence[int]]
    kv: Buffer
    hidden: Buffer | None = None
    hidden_dtype: str | None = None
    hidden_shape: Sequence[int] | None = None
    #: The lease ``kv`` and ``hidden`` live in, if any: released by ``save`` (the store retains it
    #: when it keeps the value for a background write).
    owner: Lease | None = None


@dataclass
class LoadResult:
    """Outcome of ``PrefixCache.load``: how many leading chunks/tokens were placed."""

    num_chunks: int = 0
    num_tokens: int = 0
    #: The header of the last record placed, and a copy of its hidden state (the hidden state of
    #: the last loaded token), if it carries one.
    last_header: RecordHeader | None = None
    hidden: bytes | None = None
    #: Why loading stopped: "hit" (every chunk placed), "miss", "corrupt" or "unavailable".
    reason: str = "hit"


@dataclass(frozen=True)
class _Expect:
    """What one load's reader expects of every record (see ``decode_record``)."""

    namespace: Namespace
    shapes: Callable[[ChunkKey], Sequence[Sequence[int]]] | None
    hidden_dtype: str | None
    hidden_shape: Sequence[int] | None
    auth: TagKeys | None


def stored_by_tier(store: Store, shards: Sequence[Sequence[ChunkKey]]) -> list[int]:
    """How many leading chunks of a prompt each of ``store.tiers`` holds for every shard in
    ``shards`` (the same chunks under each shard's namespace, e.g. one per TP rank: a hit needs
    them all), the minimum over shards; zeros when the store is unavailable. One lookup, counted
    once; shards after one that nothing holds are not asked."""
    start = time.perf_counter()
    metrics.LOOKUPS.inc()
    held = [0] * len(store.tiers)
    first = shards[0] if shards else ()
    try:
        for i, keys in enumerate(shards):
            if not keys:
                held = [0] * len(held)
                break
            counts = store.longest_prefix_by_tier([k.key for k in keys])
            held = counts if i == 0 else [min(a, b) for a, b in zip(held, counts)]
            if not any(held):
                break
    except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
        log.debug("lookup failed: %s", exc)
        metrics.LOOKUP_FAILURES.inc(reason="error")
        held = [0] * len(held)
    metrics.LATENCY.observe(time.perf_counter() - start, op="lookup")
    if first:
        found = max(held, default=0)
        metrics.LOOKUP_TOKENS.inc(first[-1].end)
        metrics.LOOKUP_HIT_TOKENS.inc(first[found - 1].end if found else 0)
    return held


class PrefixCache:
    """Chunked, verified save/load of token-prefix KV under one namespace."""

    def __init__(self, store: Store, namespace: Namespace, *, codec: str = "raw",
                 pool: BufferPool | None = None, auth: RecordAuth | None = None) -> None:
        self.store = store
        self.namespace = namespace
        #: Where loads receive records (and transfers gather chunks): resident, reused buffers.
        self.pool = pool or default_pool()
        self.auth = auth
        itemsize = DTYPES.get(namespace.kv_dtype)
        if itemsize is None:
            raise ConfigError(f"kv_dtype={namespace.kv_dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        self.chain = resolve_chain(codec, itemsize)
        # Chunks a load rejected (oldest first): saves rewrite from them on (see "Healing").
        self._rejected: OrderedDict[str, None] = OrderedDict()
        self._rejected_lock = threading.Lock()

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
        """How many leading ``keys`` are stored in some tier (0 if the store is unavailable)."""
        return max(self.lookup_by_tier(keys), default=0)

    def lookup_by_tier(self, keys: Sequence[ChunkKey]) -> list[int]:
        """How many leading ``keys`` each of the store's tiers holds (``stored_by_tier``)."""
        return stored_by_tier(self.store, [keys])

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
        result = LoadResult()
        if not keys:
            return result
        expect = _Expect(ns, shapes, hidden_dtype, hidden_shape, self._tag_keys(ns))
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        stream = self.store.get_into([k.key for k in keys], self.pool)
        try:
            for chunk, lease in zip(keys, stream):
                if lease is None:
                    result.reason = "miss"
                    break
                try:
                    if not self._place(lease, chunk, arr, expect, sink, result):
                        break
                finally:
                    lease.release()
        except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
            log.debug("load failed: %s", exc)
            result.reason = "unavailable"
        finally:
            stream.close()
        metrics.HITS.inc(result.num_chunks)
        metrics.MISSES.inc(len(keys) - result.num_chunks)
        metrics.TOKENS_LOADED.inc(result.num_tokens)
        metrics.LATENCY.observe(time.perf_counter() - start, op="load")
        return result

    def _tag_keys(self, ns: Namespace) -> TagKeys | None:
        return self.auth.for_salt(ns.cache_salt) if self.auth is not None else None

    def _place(self, lease: Lease, chunk: ChunkKey, arr: TokenIds, expect: _Expect,
               sink: Callable[[ChunkKey, Record], None], result: LoadResult) -> bool:
        """Verify one received record and hand it to ``sink``; False (counted, discarded) if it is bad."""
        try:
            record = decode_record(
                lease.view, namespace=expect.namespace, chunk=chunk, tokens=arr[chunk.start:chunk.end],
                dtype=expect.namespace.kv_dtype, shapes=None if expect.shapes is None else expect.shapes(chunk),
                hidden_dtype=expect.hidden_dtype, hidden_shape=expect.hidden_shape, auth=expect.auth,
                digest=lease.digest,
            )
        except CorruptRecordError as exc:
            metrics.CORRUPT.inc(reason=exc.reason)
            log.warning("discarding stored record %s: %s", chunk.key, exc)
            self._remember_rejected(chunk.key)
            self._discard(chunk.key)
            result.reason = "corrupt"
            return False
        sink(chunk, record)
        result.num_chunks += 1
        result.num_tokens = chunk.end
        result.last_header = record.header
        result.hidden = None if record.hidden is None else bytes(record.hidden)
        return True

    def save(
        self,
        tokens: TokenIds,
        keys: Sequence[ChunkKey],
        payload: Callable[[ChunkKey], ChunkPayload],
        *,
        from_token: int | None = None,
        skip_stored: bool = True,
        namespace: Namespace | None = None,
    ) -> int:
        """Encode and store the chunks of ``keys``; returns how many were written.

        ``from_token``: the chunks ending at or before it are taken as stored and skipped, every
        later one is written, whether stored or not (a caller that knows how far the prefix is
        stored, or that wants a bad stretch rewritten, says where to start). Without it, with
        ``skip_stored``, one pre-check finds the stored leading chunks and skips those; with
        neither, every chunk is written. A chunk whose record a load of this cache rejected is
        written in any case, and so is every chunk after it (module docstring: "Healing").
        ``payload`` is called only for chunks written.
        """
        ns = namespace or self.namespace
        if not keys:
            return 0
        start = time.perf_counter()
        if from_token is not None:
            first = next((i for i, k in enumerate(keys) if k.end > from_token), len(keys))
        elif skip_stored:
            first = self._stored_prefix(keys)
        else:
            first = 0
        heal = self._first_rejected(keys)
        if heal is not None:
            first = min(first, heal)
        if first >= len(keys):
            return 0
        arr = tokens_to_array(tokens)
        tag_keys = self._tag_keys(ns)
        made: list[Pieces] = []

        def records() -> Iterator[tuple[str, Pieces]]:
            # Lazily: a store that sends while it iterates overlaps gathering chunk i+1 with sending chunk i.
            for chunk in keys[first:]:
                p = payload(chunk)
                try:
                    record = encode_record_pieces(
                        namespace=ns, chunk=chunk, tokens=arr[chunk.start:chunk.end], dtype=ns.kv_dtype,
                        shapes=p.shapes, kv=p.kv, hidden=p.hidden, hidden_dtype=p.hidden_dtype,
                        hidden_shape=p.hidden_shape, chain=self.chain, owner=p.owner, auth=tag_keys,
                    )
                except BaseException:
                    if p.owner is not None:
                        p.owner.release()
                    raise
                made.append(record)
                yield chunk.key, record

        try:
            self.store.put_many(records())
        except KVStoreError as exc:
            log.debug("save failed: %s", exc)
            return 0
        finally:
            for record in made:
                record.release()
        items = made
        if items:
            metrics.TOKENS_SAVED.inc(keys[-1].end - keys[first].start)
        if heal is not None and items:
            self._forget_rejected(keys[heal:])
            metrics.HEALS.inc(len(keys) - heal)
        metrics.LATENCY.observe(time.perf_counter() - start, op="save")
        return len(items)

    def _stored_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are stored (a save's pre-check: counted apart from lookups)."""
        metrics.SAVE_CHECKS.inc()
        try:
            return self.store.longest_prefix([k.key for k in keys])
        except KVStoreError as exc:
            log.debug("save pre-check failed: %s", exc)
            return 0

    def _remember_rejected(self, key: str) -> None:
        with self._rejected_lock:
            self._rejected[key] = None
            self._rejected.move_to_end(key)
            while len(self._rejected) > _REJECTED_MAX:
                self._rejected.popitem(last=False)

    def _first_rejected(self, keys: Sequence[ChunkKey]) -> int | None:
        """The index of the first of ``keys`` a load rejected, if any."""
        with self._rejected_lock:
            if not self._rejected:
                return None
            return next((i for i, k in enumerate(keys) if k.key in self._rejected), None)

    def _forget_rejected(self, keys: Sequence[ChunkKey]) -> None:
        with self._rejected_lock:
            for k in keys:
                self._rejected.pop(k.key, None)

    def _discard(self, key: str) -> None:
        try:
            self.store.delete(key)
        except KVStoreError:
            pass
