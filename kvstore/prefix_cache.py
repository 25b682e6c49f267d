"""Engine-agnostic save and load of token-prefix KV through a store.

``PrefixCache`` knows keys, records and stores; it knows nothing of paged caches. Engine
adapters give it, per chunk, the bytes to save (``save``) and take, per verified chunk, the
bytes to place (``load``'s sink). Its promises:

* ``lookup`` costs one ``longest_prefix_by_tier`` call (one round trip per tier)
  (``stored_by_tier``, for several shards at once); the vLLM scheduler's lookup, which covers
  KV heads from records of any head range, is ``covered_by_tier`` (one ``exists_by_tier`` call,
  one more for other writers' ranges when its own fall short). Each lookup is counted once in
  ``kvstore_lookups_total``.
* ``load`` receives the records into leased pool buffers (``Store.get_into``: a Redis tier
  receives record i+1 while record i is verified and placed), verifies each record (namespace,
  key, token ids, dtype, shapes, hidden state, checksum and, with a deployment key, its tag)
  in place before handing it to the sink, in prefix order, and stops at the first chunk that
  is missing or fails. The record handed to the sink is valid only during that call.
  ``load_staged`` is the same load for a reader that moves records elsewhere first (a GPU's
  memory): each record's KV goes to its ``Staging`` as soon as its header passed, while its
  checksum and tag are verified on a pool of threads; only the verified leading chunks are
  placed, in one call (no byte of a failed record is ever placed). With
  ``land`` the store may land each record's KV in the caller's destination as it arrives,
  after its header passed every check and before its checksum and tag are known (``load``). A failed
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
* **Key spaces.** With ``auth`` every namespace this cache is given is taken in the current
  key's space (``Namespace.key_space``): its keys, lookups, loads and saves never touch
  another key's records (nor keyless ones), so deployments with different keys share a store
  without overwriting each other. During the rotation window (``RecordAuth.previous_key_spaces``)
  ``keys`` attaches each chunk's keys in the previous spaces (``ChunkKey.previous``): a lookup
  counts the longer of the spaces' stored prefixes (one more round trip per tier and previous
  key), a load continues in a previous space from the first chunk the current one lacks, and
  the next save covering chunks loaded from there re-signs them into the current space.
* **Announcements.** With an event sink (``announce``: ``kvstore.events``' publisher of KV
  events for routers), every save that reached the store announces the full chunks it wrote,
  once per medium given (the store's tiers: a background-written tier is announced when the
  save is accepted), or, where its caller says so (``save``'s ``announce``), the full chunks
  of a token range: a model whose hit also needs other records (a recurrent state, a window)
  announces a prefix only once those are stored too. Only text is announced: chunks from the
  first multimodal input on are not (a router keys blocks by token ids). A sink's failure
  never fails a save.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from kvstore.buffers import BufferPool, Lease, Pieces, default_pool, lease_or_fresh, thread_pool
from kvstore.errors import ConfigError, CorruptRecordError, KVStoreError
from kvstore.heads import covered_count
from kvstore.keys import ChunkKey, HeadRange, InputSpan, Namespace, TokenIds, chunk_keys, prefix_keys, tokens_to_array
from kvstore.metrics import catalog as metrics
from kvstore.record import (
    DTYPES,
    CheckedRecord,
    Landing,
    Record,
    RecordHeader,
    check_record,
    decode_record,
    encode_record_pieces,
    land_record,
    verify_landed,
    verify_record,
)
from kvstore.record.auth import RecordAuth, TagKeys
from kvstore.record.codecs import resolve_chain
from kvstore.stores.base import Store, takes_place
from kvstore.types import Buffer

if TYPE_CHECKING:
    from kvstore.events import EventSink

__all__ = ["PrefixCache", "ChunkPayload", "LoadResult", "Staging", "stored_by_tier", "covered_by_tier", "count_lookup_tokens", "Covered",
           "Source"]

log = logging.getLogger(__name__)

_REWRITE_MAX = 4096  # chunk keys a cache remembers to rewrite until a save does


@dataclass(frozen=True)
class ChunkPayload:
    """What to store for one chunk: tensors of ``shapes`` in ``dtype``, back to back in ``kv``
    (one buffer, or a list of buffers that hold those bytes in order, e.g. a paged cache's
    blocks: valid only during ``save``)."""

    shapes: Sequence[Sequence[int]]
    kv: Buffer | Sequence[Buffer]
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


class Staging(Protocol):
    """Where ``PrefixCache.load_staged`` moves each record's KV before its verdict (a device's
    staging memory: never the destination), and how it places the verified prefix."""

    def stage(self, index: int, chunk: ChunkKey, kv: memoryview, lease: Lease, *, decoded: bool = False) -> None:
        """Start moving chunk ``index``'s KV bytes ``kv`` (uncompressed; a view of ``lease``,
        whose frame, header and expectations passed, its checksum and tag not yet known; with
        ``decoded``, a record decompressed on the host, verified already). Indexes come in
        order from 0. The caller releases ``lease`` after ``place`` returns: a staging that
        reads it later retains it."""

    def place(self, count: int) -> None:
        """The first ``count`` staged chunks are verified: place them, and nothing staged after
        them (``count`` may be 0). Called once, after the last ``stage``."""


@dataclass
class _Staged:
    """A record handed to a ``Staging``, waiting for its verdict."""

    chunk: ChunkKey
    lease: Lease
    checked: CheckedRecord
    verdict: Future[None] | None  # None: verified already
    #: Its lease goes back when its verdict is done (a load that stopped before it never waits).
    later: bool = False


def _verifiers() -> ThreadPoolExecutor:
    """Threads that verify records for ``load_staged``: a task may wait for a digest a store is
    computing on ``kvstore.buffers.hashers()``, so it runs on a pool of its own (never
    waiting on its own pool's tasks)."""
    return thread_pool("verify")


@dataclass(frozen=True)
class _Expect:
    """What one load's reader expects of every record (see ``decode_record``)."""

    namespace: Namespace
    shapes: Callable[[ChunkKey], Sequence[Sequence[int]]] | None
    hidden_dtype: str | None
    hidden_shape: Sequence[int] | None
    auth: TagKeys | None


def stored_by_tier(store: Store, shards: Sequence[Sequence[ChunkKey]], *, counted: bool = True) -> list[int]:
    """How many leading chunks of a prompt each of ``store.tiers`` holds for every shard in
    ``shards`` (the same chunks under each shard's namespace, e.g. one per TP rank: a hit needs
    them all), the minimum over shards; zeros when the store is unavailable. One lookup, counted
    once (``counted=False``: not in the lookup metrics, for a poll that asks again and again);
    shards after one that nothing holds are not asked."""
    start = time.perf_counter()
    if counted:
        metrics.LOOKUPS.inc()
    held = [0] * len(store.tiers)
    first = shards[0] if shards else ()
    try:
        for i, keys in enumerate(shards):
            if not keys:
                held = [0] * len(held)
                break
            counts = store.longest_prefix_by_tier([k.key for k in keys])
            for j in range(len(keys[0].previous)):  # a rotation's window: the previous keys' spaces too
                older = store.longest_prefix_by_tier([k.previous[j].key for k in keys])
                counts = [max(a, b) for a, b in zip(counts, older)]
            held = counts if i == 0 else [min(a, b) for a, b in zip(held, counts)]
            if not any(held):
                break
    except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
        log.debug("lookup failed: %s", exc)
        if counted:
            metrics.LOOKUP_FAILURES.inc(reason="error")
        held = [0] * len(held)
    if not counted:
        return held
    metrics.LATENCY.observe(time.perf_counter() - start, op="lookup")
    count_lookup_tokens(first, max(held, default=0))
    return held


def count_lookup_tokens(keys: Sequence[ChunkKey], found: int) -> None:
    """The tokens of a lookup in the metrics: those of the prompt chunked as ``keys``, and those of
    its first ``found`` chunks, which it found stored (the lookup itself is counted where it starts)."""
    if keys:
        metrics.LOOKUP_TOKENS.inc(keys[-1].end)
        metrics.LOOKUP_HIT_TOKENS.inc(keys[found - 1].end if found else 0)


#: One way a lookup may find a group's records: the units they cover (the KV heads of a head range;
#: one TP rank's shard of records not cut by head, as unit ``r`` of ``tp_size``) and their keys, in
#: chunk order.
Source = tuple[HeadRange, Sequence[ChunkKey]]


@dataclass(frozen=True)
class Covered:
    """What ``covered_by_tier`` found: per tier, the leading chunks every group covers there; over
    all tiers together, the leading chunks each source holds (per group, by its units)."""

    per_tier: list[int]
    counts: list[dict[HeadRange, int]]

    @property
    def chunks(self) -> int:
        """Leading chunks every group covers, taking each source from any tier."""
        return min((covered_count(c, next(iter(c)).total) for c in self.counts if c), default=0)

    def found(self, group: int, chunks: int) -> list[HeadRange]:
        """The sources of ``group`` that hold at least ``chunks`` leading chunks."""
        return sorted(u for u, n in self.counts[group].items() if n >= chunks)


def covered_by_tier(store: Store, groups: Sequence[Sequence[Source]], *, more: Sequence[Sequence[Source]] = (),
                    counted: bool = True) -> Covered:
    """How many leading chunks of a prompt each of ``store.tiers`` holds for every group of
    ``groups`` (a chunk counts for a group when its sources there cover every unit: every KV head
    by some head range, or every TP rank's shard), the least over groups; and how many each source
    holds. One ``exists_by_tier`` call for every key of every source (a rotation's previous key
    spaces included); then, only when that does not cover every chunk, one more for the sources in
    ``more`` (per group, other ways to cover it: other writers' head ranges). Zeros when the store
    is unavailable. One lookup, counted once (``counted=False``: not in the lookup metrics)."""
    start = time.perf_counter()
    if counted:
        metrics.LOOKUPS.inc()
    tiers = len(store.tiers)
    num = max((len(keys) for g in groups for _, keys in g), default=0)
    per_source: list[dict[HeadRange, list[list[bool]]]] = [{} for _ in groups]  # per tier presence
    try:
        _ask(store, groups, per_source, tiers)
        result = _covered(per_source, tiers, num)
        if result.chunks < num and any(more):
            _ask(store, more, per_source, tiers)
            result = _covered(per_source, tiers, num)
    except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
        log.debug("lookup failed: %s", exc)
        if counted:
            metrics.LOOKUP_FAILURES.inc(reason="error")
        result = Covered([0] * tiers, [{} for _ in groups])
    if counted:
        metrics.LATENCY.observe(time.perf_counter() - start, op="lookup")
        first = next((keys for g in groups for _, keys in g if keys), ())
        count_lookup_tokens(first, min(max(result.per_tier, default=0), len(first)))
    return result


def _ask(store: Store, groups: Sequence[Sequence[Source]], per_source: list[dict[HeadRange, list[list[bool]]]],
         tiers: int) -> None:
    """One ``exists_by_tier`` call for every key of ``groups``' sources (and their previous key
    spaces'); each source's presence per tier and chunk merged into ``per_source``."""
    names: list[str] = []
    for g in groups:
        for _, keys in g:
            names.extend(k.key for k in keys)
            for j in range(len(keys[0].previous) if keys else 0):
                names.extend(k.previous[j].key for k in keys)
    present = store.exists_by_tier(names) if names else [[] for _ in range(tiers)]
    at = 0
    for held, g in zip(per_source, groups):
        for units, keys in g:
            spaces = 1 + (len(keys[0].previous) if keys else 0)
            rows = held.setdefault(units, [[False] * len(keys) for _ in range(tiers)])
            for t in range(tiers):
                for s in range(spaces):
                    here = present[t][at + s * len(keys):at + (s + 1) * len(keys)]
                    rows[t] = [a or b for a, b in zip(rows[t], here)]
            at += spaces * len(keys)


def _leading(flags: Sequence[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))


def _covered(per_source: list[dict[HeadRange, list[list[bool]]]], tiers: int, num: int) -> Covered:
    per_tier = [num] * tiers
    counts: list[dict[HeadRange, int]] = []
    for held in per_source:
        if not held:
            counts.append({})
            continue
        total = next(iter(held)).total
        for t in range(tiers):
            per_tier[t] = min(per_tier[t], covered_count({u: _leading(rows[t]) for u, rows in held.items()}, total))
        counts.append({u: _leading([any(col) for col in zip(*rows)]) for u, rows in held.items()})
    return Covered(per_tier if per_source else [0] * tiers, counts)


class PrefixCache:
    """Chunked, verified save/load of token-prefix KV under one namespace.

    ``heads``: the KV heads of this cache's records (its keys' suffix and their headers' ``heads``;
    ``kvstore.keys``), None for records not cut by head."""

    def __init__(self, store: Store, namespace: Namespace, *, codec: str = "raw",
                 pool: BufferPool | None = None, auth: RecordAuth | None = None,
                 count_tokens: bool = True, heads: HeadRange | None = None) -> None:
        self.store = store
        self.auth = auth
        self.heads = heads
        #: Whether loads and saves count tokens (``kvstore_tokens_loaded_total`` and ``..._saved_``):
        #: an engine that stores one prompt in several caches (KV cache groups) counts it in one.
        self.count_tokens = count_tokens
        #: The key space of this cache's records: the current key's id (keyless: "").
        self.key_space = auth.key_space if auth is not None else ""
        self.namespace = namespace.with_key_space(self.key_space)
        #: Where loads receive records (and transfers gather chunks): resident, reused buffers.
        self.pool = pool or default_pool()
        itemsize = DTYPES.get(namespace.kv_dtype)
        if itemsize is None:
            raise ConfigError(f"kv_dtype={namespace.kv_dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        self.chain = resolve_chain(codec, itemsize)
        self._events: EventSink | None = None
        self._event_mediums: tuple[str, ...] = ()
        # Chunks to rewrite (oldest first): True where a load rejected the record ("Healing"),
        # False where it took the chunk from a previous key's space ("Key spaces").
        self._rewrite: OrderedDict[str, bool] = OrderedDict()
        self._rewrite_lock = threading.Lock()

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens

    def keys(self, tokens: TokenIds, *, namespace: Namespace | None = None, include_partial: bool = True,
             max_tokens: int | None = None, spans: Sequence[InputSpan] = ()) -> list[ChunkKey]:
        """Chunk keys of ``tokens`` (optionally only chunks ending at or before ``max_tokens``), in
        this cache's key space, of the records of its ``heads`` (``ChunkKey.with_heads`` names
        another range's); during a rotation window each carries its previous-space keys.
        ``spans``: the prompt's non-text inputs (``kvstore.keys``)."""
        ns = self.in_space(namespace or self.namespace)
        keys = chunk_keys(ns, tokens, include_partial=include_partial, spans=spans, heads=self.heads)
        if max_tokens is not None:
            keys = [k for k in keys if k.end <= max_tokens]
        older = self.auth.previous_key_spaces() if self.auth is not None else []
        if older and keys:
            spaces = [chunk_keys(ns.with_key_space(space), tokens, include_partial=include_partial,
                                 spans=spans, heads=self.heads)[:len(keys)]
                      for space in older]
            keys = [replace(k, previous=tuple(space[i] for space in spaces)) for i, k in enumerate(keys)]
        return keys

    def announce(self, sink: EventSink | None, mediums: Sequence[str] = ()) -> None:
        """Announce every later save to ``sink`` (None: stop), as stored in each of ``mediums``."""
        self._events, self._event_mediums = sink, tuple(mediums)

    def in_space(self, namespace: Namespace) -> Namespace:
        """``namespace`` in this cache's key space (what every key, load and save here uses)."""
        return namespace.with_key_space(self.key_space)

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
        land: Callable[[ChunkKey], Sequence[memoryview] | None] | None = None,
        counted: bool = True,
    ) -> LoadResult:
        """Fetch ``keys`` in one batch, verify each, and call ``sink(chunk, record)`` in order.

        ``shapes(chunk)`` gives the tensor shapes the reader expects for a chunk, and
        ``hidden_dtype``/``hidden_shape`` the hidden state its model would consume (a record
        carrying another is rejected; one carrying none is fine); all are checked before the
        sink runs. Stops at the first missing or invalid chunk.

        ``land(chunk)``: where the chunk's KV bytes go, in record order (the caller's
        destination, e.g. the paged cache's blocks; None: not there). A store that receives
        values piece by piece then lands each uncompressed record's KV there as it arrives,
        once its header passed every check (``record.land_record``), and the sink gets a
        ``Record`` with ``landed`` set. Those bytes are verified only after they landed: a
        record that then fails leaves its bytes in the destination, which the caller must
        treat as holding nothing (it stays past the loaded prefix, like every chunk not
        placed). Chunks of other stores, and records that cannot land, come as before.
        ``counted=False``: the tokens are not counted as loaded (the same tokens' other heads were).
        """
        ns = self.in_space(namespace or self.namespace)
        result = LoadResult()
        if not keys:
            return result
        expect = _Expect(ns, shapes, hidden_dtype, hidden_shape, self._tag_keys(ns))
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        done = self._receive(keys, arr, expect, sink, result, land)
        older = self.auth.previous_key_spaces() if self.auth is not None and keys[0].previous else []
        for j, space in enumerate(older[:len(keys[0].previous)]):
            if result.reason != "miss" or done >= len(keys):
                break
            # A rotation's window: continue in a previous key's space where the current one ends;
            # what comes from there is re-signed into the current space by the next save.
            rest = keys[done:]
            result.reason = "hit"
            placed = self._receive([k.previous[j] for k in rest], arr,
                                   replace(expect, namespace=ns.with_key_space(space)), sink, result, land)
            self._remember(rest[:placed], heal=False)
            done += placed
        metrics.HITS.inc(result.num_chunks)
        metrics.MISSES.inc(len(keys) - result.num_chunks)
        if self.count_tokens and counted:
            metrics.TOKENS_LOADED.inc(result.num_tokens)
        metrics.LATENCY.observe(time.perf_counter() - start, op="load")
        return result

    def _receive(self, keys: Sequence[ChunkKey], arr: TokenIds, expect: _Expect,
                 sink: Callable[[ChunkKey, Record], None], result: LoadResult,
                 land: Callable[[ChunkKey], Sequence[memoryview] | None] | None) -> int:
        """Fetch ``keys`` in one batch and place them in order up to the first missing or bad
        one (``result.reason`` says which); how many were placed."""
        placed = 0
        names = [k.key for k in keys]
        landings = None
        if land is None or not takes_place(self.store):
            stream = self.store.get_into(names, self.pool)
        else:
            landings = [Landing() for _ in keys]

            def place(i: int, view: memoryview) -> Iterator[Sequence[memoryview]]:
                chunk = keys[i]
                return land_record(
                    view, landings[i], functools.partial(land, chunk), namespace=expect.namespace, chunk=chunk,
                    tokens=arr[chunk.start:chunk.end], dtype=expect.namespace.kv_dtype,
                    shapes=None if expect.shapes is None else expect.shapes(chunk),
                    hidden_dtype=expect.hidden_dtype, hidden_shape=expect.hidden_shape)
            stream = self.store.get_into(names, self.pool, place)
        try:
            for i, (chunk, lease) in enumerate(zip(keys, stream)):
                if lease is None:
                    result.reason = "miss"
                    break
                try:
                    landing = landings[i] if landings is not None and landings[i].landed_in(lease.view) else None
                    if not self._place(lease, chunk, arr, expect, sink, result, landing):
                        break
                finally:
                    lease.release()
                placed += 1
        except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
            log.debug("load failed: %s", exc)
            result.reason = "unavailable"
        finally:
            stream.close()
        return placed

    def load_staged(
        self,
        tokens: TokenIds,
        keys: Sequence[ChunkKey],
        staging: Staging,
        *,
        shapes: Callable[[ChunkKey], Sequence[Sequence[int]]] | None = None,
        namespace: Namespace | None = None,
        hidden_dtype: str | None = None,
        hidden_shape: Sequence[int] | None = None,
        pool: BufferPool | None = None,
        before_place: Callable[[ChunkKey, Record], None] | None = None,
        counted: bool = True,
    ) -> LoadResult:
        """``load`` for a reader that moves each record elsewhere before placing it (a GPU).

        Each record is checked (frame, header, the reader's expectations: ``check_record``) as
        it arrives and its KV handed to ``staging.stage`` at once; its checksum and tag are
        verified meanwhile on a pool of threads (against the digest its store computed, or
        hashing it there). Once every record is in and judged, ``staging.place(n)`` places the
        ``n`` leading chunks that passed: no byte of a record that failed, or came after one, is
        ever placed. Expectations, counting, healing, discarding, key spaces and the result are
        ``load``'s. ``pool``: where records are received (default: the cache's; a GPU reader
        gives a pinned one, so a DMA reads them where they arrived). ``before_place(chunk,
        record)`` runs for each verified chunk, in order, before it counts (``record.kv``: its
        KV bytes as received); an exception from it ends the load there (the chunks before it
        are placed) and propagates. ``staging.place`` is called in every case.
        """
        ns = self.in_space(namespace or self.namespace)
        result = LoadResult()
        expect = _Expect(ns, shapes, hidden_dtype, hidden_shape, self._tag_keys(ns))
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        staged: list[_Staged] = []
        last: list[_Staged] = []  # the last record placed: its hidden state is the result's
        try:
            if keys:
                self._stage(keys, arr, expect, staging, staged, result, pool or self.pool, before_place, last)
            older = self.auth.previous_key_spaces() if self.auth is not None and keys and keys[0].previous else []
            for j, space in enumerate(older[:len(keys[0].previous) if keys else 0]):
                placed = result.num_chunks
                if result.reason != "miss" or placed >= len(keys):
                    break
                rest = keys[placed:]
                result.reason = "hit"
                more = self._stage([k.previous[j] for k in rest], arr, replace(expect, namespace=ns.with_key_space(space)),
                                   staging, staged, result, pool or self.pool, before_place, last)
                self._remember(rest[:more], heal=False)
        finally:
            try:
                staging.place(result.num_chunks)
            finally:
                if last:  # one copy of a hidden state, the last record's, not one per record
                    hidden = last[0].checked.hidden
                    result.hidden = None if hidden is None else bytes(last[0].lease.view[hidden])
                for record in staged:
                    if record.later and record.verdict is not None:  # a verifier still reads it
                        record.verdict.add_done_callback(functools.partial(_release_after, record.lease))
                    else:
                        record.lease.release()
        metrics.HITS.inc(result.num_chunks)
        metrics.MISSES.inc(len(keys) - result.num_chunks)
        if self.count_tokens and counted:
            metrics.TOKENS_LOADED.inc(result.num_tokens)
        metrics.LATENCY.observe(time.perf_counter() - start, op="load")
        return result

    def _stage(self, keys: Sequence[ChunkKey], arr: TokenIds, expect: _Expect, staging: Staging,
               staged: list[_Staged], result: LoadResult, pool: BufferPool,
               before_place: Callable[[ChunkKey, Record], None] | None, last: list[_Staged]) -> int:
        """Receive ``keys`` in one batch, stage each record that passes its header checks (up to
        the first that does not), then judge them in order; how many leading ones passed
        (``result`` updated for each as it passes, ``last`` holds the last, ``result.reason`` says
        why it stopped). Verdicts still running when it stops are not waited for: their records'
        leases go back when they end (``_Staged.later``)."""
        first = len(staged)
        stream = self.store.get_into([k.key for k in keys], pool)
        try:
            for chunk, lease in zip(keys, stream):
                if lease is None:
                    result.reason = "miss"
                    break
                try:
                    record = self._stage_one(chunk, lease, arr, expect, staging, len(staged), pool)
                except CorruptRecordError as exc:
                    lease.release()
                    self._rejected(chunk, exc, result)
                    break
                except BaseException:
                    lease.release()
                    raise
                staged.append(record)
        except KVStoreError as exc:  # a store that is not tiered fails as a whole: a miss
            log.debug("load failed: %s", exc)
            result.reason = "unavailable"
        finally:
            stream.close()
        ours = staged[first:]
        try:
            for n, record in enumerate(ours):
                try:
                    if record.verdict is not None:
                        record.verdict.result()
                except CorruptRecordError as exc:
                    self._rejected(record.chunk, exc, result)
                    return n
                if before_place is not None:
                    hidden = record.checked.hidden
                    view = record.lease.view
                    before_place(record.chunk, Record(record.checked.header, view[record.checked.body],
                                                      None if hidden is None else view[hidden]))
                self._placed(record.chunk, record.checked, result)
                last[:] = [record]
            return len(ours)
        finally:
            # No verifier may still read a lease once it goes back: one still running keeps it.
            for r in ours:
                r.later = r.verdict is not None and not r.verdict.cancel() and not r.verdict.done()

    def _stage_one(self, chunk: ChunkKey, lease: Lease, arr: TokenIds, expect: _Expect, staging: Staging,
                   index: int, pool: BufferPool) -> _Staged:
        """Check one record's header, hand its KV to ``staging`` and start its verdict."""
        checked = check_record(
            lease.view, namespace=expect.namespace, chunk=chunk, tokens=arr[chunk.start:chunk.end],
            dtype=expect.namespace.kv_dtype, shapes=None if expect.shapes is None else expect.shapes(chunk),
            hidden_dtype=expect.hidden_dtype, hidden_shape=expect.hidden_shape)
        if not checked.header.codecs:
            staging.stage(index, chunk, lease.view[checked.body], lease)
            # The lease's digest, when its store computes one, is read in the verifier's thread.
            verdict = _verifiers().submit(_verify_digest, lease, checked, expect.auth)
            return _Staged(chunk, lease, checked, verdict)
        # Compressed (a slow tier's codec): decoded on the host, verified first, then staged.
        out = lease_or_fresh(pool, checked.header.raw_len, 0.05)
        try:
            decode_record(lease.view, out=out.view, auth=expect.auth, digest=lease.digest)
            staging.stage(index, chunk, out.view, out, decoded=True)
        finally:
            out.release()
        return _Staged(chunk, lease, checked, None)

    def _rejected(self, chunk: ChunkKey, exc: CorruptRecordError, result: LoadResult) -> None:
        """A record that failed: counted, logged, remembered for healing, discarded; a miss."""
        metrics.CORRUPT.inc(reason=exc.reason)
        log.warning("discarding stored record %s: %s", chunk.key, exc)
        self._remember([chunk], heal=True)
        self._discard(chunk.key)
        result.reason = "corrupt"

    def _placed(self, chunk: ChunkKey, checked: CheckedRecord, result: LoadResult) -> None:
        """``chunk`` counts as loaded (its hidden state is copied once, by ``load_staged``, if it is the last)."""
        result.num_chunks += 1
        result.num_tokens = chunk.end
        result.last_header = checked.header

    def _tag_keys(self, ns: Namespace) -> TagKeys | None:
        return self.auth.for_salt(ns.cache_salt) if self.auth is not None else None

    def _place(self, lease: Lease, chunk: ChunkKey, arr: TokenIds, expect: _Expect,
               sink: Callable[[ChunkKey, Record], None], result: LoadResult, landing: Landing | None) -> bool:
        """Verify one received (or landed) record and hand it to ``sink``; False (counted,
        discarded) if it is bad."""
        try:
            record = verify_landed(lease.view, landing, auth=expect.auth, digest=lease.digest) if landing else decode_record(
                lease.view, namespace=expect.namespace, chunk=chunk, tokens=arr[chunk.start:chunk.end],
                dtype=expect.namespace.kv_dtype, shapes=None if expect.shapes is None else expect.shapes(chunk),
                hidden_dtype=expect.hidden_dtype, hidden_shape=expect.hidden_shape, auth=expect.auth,
                digest=lease.digest,
            )
        except CorruptRecordError as exc:
            self._rejected(chunk, exc, result)
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
        spans: Sequence[InputSpan] = (),
        announce: tuple[int, int] | None = None,
    ) -> int:
        """Encode and store the chunks of ``keys``; returns how many were written.

        ``from_token``: the chunks ending at or before it are taken as stored and skipped, every
        later one is written, whether stored or not (a caller that knows how far the prefix is
        stored, or that wants a bad stretch rewritten, says where to start). Without it, with
        ``skip_stored``, one pre-check finds the stored leading chunks and skips those; with
        neither, every chunk is written. A chunk whose record a load of this cache rejected is
        written in any case, and so is every chunk after it (module docstring: "Healing").
        ``payload`` is called only for chunks written. ``spans``: the non-text inputs ``keys``
        were made with (they re-key chunks hashed in another key space, and end announcements).
        ``announce=(after, upto)``: announce the chunks of ``keys`` ending in ``(after, upto]``
        (written now or before) rather than those written; nothing when the range is empty or
        the save failed.
        """
        ns = self.in_space(namespace or self.namespace)
        if not keys:
            return 0
        keys = self._keys_in_space(ns, tokens, keys, spans)
        start = time.perf_counter()
        if from_token is not None:
            first = next((i for i, k in enumerate(keys) if k.end > from_token), len(keys))
        elif skip_stored:
            first = self._stored_prefix(keys)
        else:
            first = 0
        rewrite, heal = self._to_rewrite(keys)
        if rewrite is not None:
            first = min(first, rewrite)
        arr = tokens_to_array(tokens)
        if first >= len(keys):
            if announce is not None:
                self._announce(keys, arr, first, spans, ns, announce)
            return 0
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
        if (items or announce is not None) and self._events is not None:
            self._announce(keys, arr, first, spans, ns, announce)
        if items and self.count_tokens:
            metrics.TOKENS_SAVED.inc(keys[-1].end - keys[first].start)
        if rewrite is not None and items:
            self._forget(keys[first:])
            if heal is not None:
                metrics.HEALS.inc(len(keys) - heal)
        metrics.LATENCY.observe(time.perf_counter() - start, op="save")
        return len(items)

    def _announce(self, keys: Sequence[ChunkKey], tokens: TokenIds, first: int, spans: Sequence[InputSpan],
                  ns: Namespace, announce: tuple[int, int] | None = None) -> None:
        sink, until = self._events, min((s.offset for s in spans), default=None)
        if sink is None:
            return
        if announce is not None:
            after, upto = announce
            if upto <= after:
                return
            first = next((i for i, k in enumerate(keys) if k.end > after), len(keys))
            until = upto if until is None else min(until, upto)
        try:
            for medium in self._event_mediums:
                sink.stored(keys, tokens, medium, first=first, until=until, cache_salt=ns.cache_salt)
        except Exception:  # announcing is best effort: the save itself succeeded
            log.warning("announcing a save to the KV event sink failed", exc_info=True)

    def _stored_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are stored (a save's pre-check: counted apart from lookups)."""
        metrics.SAVE_CHECKS.inc()
        try:
            return self.store.longest_prefix([k.key for k in keys])
        except KVStoreError as exc:
            log.debug("save pre-check failed: %s", exc)
            return 0

    def _keys_in_space(self, ns: Namespace, tokens: TokenIds, keys: Sequence[ChunkKey],
                       spans: Sequence[InputSpan]) -> Sequence[ChunkKey]:
        """``keys`` (the chunks of ``tokens`` and ``spans`` a caller hashed under another key
        space, e.g. with ``prefix_keys`` and the namespace it was built with) as the same chunks in ``ns``."""
        if keys[0].key.startswith(ns.key_prefix):
            return keys
        wanted = {(k.start, k.end) for k in keys}
        return [k for k in prefix_keys(ns, tokens, [k.end for k in keys], spans=spans, heads=keys[0].heads)
                if (k.start, k.end) in wanted]

    def _remember(self, chunks: Sequence[ChunkKey], *, heal: bool) -> None:
        with self._rewrite_lock:
            for chunk in chunks:
                self._rewrite[chunk.key] = heal or self._rewrite.get(chunk.key, False)
                self._rewrite.move_to_end(chunk.key)
            while len(self._rewrite) > _REWRITE_MAX:
                self._rewrite.popitem(last=False)

    def _to_rewrite(self, keys: Sequence[ChunkKey]) -> tuple[int | None, int | None]:
        """The index of the first of ``keys`` to rewrite, and of the first to heal, if any."""
        with self._rewrite_lock:
            if not self._rewrite:
                return None, None
            marks = [(i, self._rewrite[k.key]) for i, k in enumerate(keys) if k.key in self._rewrite]
        return (marks[0][0] if marks else None), next((i for i, heal in marks if heal), None)

    def _forget(self, keys: Sequence[ChunkKey]) -> None:
        with self._rewrite_lock:
            for k in keys:
                self._rewrite.pop(k.key, None)

    def _discard(self, key: str) -> None:
        try:
            self.store.delete(key)
        except KVStoreError:
            pass


def _release_after(lease: Lease, verdict: Future[None]) -> None:
    """A staged lease goes back once the verdict that reads it is done."""
    lease.release()


def _verify_digest(lease: Lease, checked: CheckedRecord, auth: TagKeys | None) -> None:
    """``verify_record`` of a staged lease, with the digest its store computed (read here: it
    may still be hashing on ``hashers()``), or hashing it here."""
    verify_record(lease.view, checked, auth=auth, digest=lease.digest)
