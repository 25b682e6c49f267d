"""The connector's scheduler side (vLLM's EngineCore process): lookups, load decisions and plans.

Nothing here waits on the network beyond ``lookup_wait``:

* **Lookups run in the background.** ``get_num_new_matched_tokens`` starts a lookup of the
  prompt's chunk keys (cut at the last whole block that leaves one token to compute; every tier,
  every TP rank's shard) on a small thread pool and answers ``None`` ("ask again later") until it
  is done; vLLM keeps scheduling other requests meanwhile. A lookup still unanswered after
  ``lookup_timeout`` is a miss. Results are cached per request.
* **Any TP size's records.** Attention KV is stored by KV head range (``kvstore.heads``): the
  lookup asks first for the records of the ranges this engine's ranks hold (one
  ``exists_by_tier`` call); only if those do not cover every chunk, for the ranges writers of
  other TP sizes write (``writer_tp_max``), in one more call. A chunk counts only if every KV head
  of every group is covered; the ranges found go to the workers in the ``LoadSpec``, and each
  rank reads the records covering its heads (``kvstore.heads.cover``).
* **Why a lookup missed.** A lookup that found nothing asks, in a task of its own on the lookup
  pool and at most once per ``miss_probe_interval``, whether the prompt's first chunk is stored
  under a sibling configuration (another KV dtype, chunk size or CPU ISA, or record format 2) and
  counts the miss by the answer (``kvstore_lookup_misses_total{reason}``).
* **Load or recompute** (``kvstore.cost``): the lookup knows how many leading chunks each tier
  holds; the cost model picks how many are worth loading from the measured tier speeds and the
  engine's prefill speed. The workers measure both (``measure``: their reads, the forwards of
  prefill steps) and report them with their stats, which ``update_connector_output`` reads.
* **Loads run in the background** (``load_mode="async"``): the hit is reported as asynchronous,
  vLLM allocates its blocks and parks the request in ``WAITING_FOR_REMOTE_KVS``; the worker loads
  it and reports it done through ``get_finished``. A request whose load failed is never offered
  an external hit again (vLLM recomputes it).
* **Plans**: ``build_meta`` tells the worker, per step, which loads to start (block ids come
  from ``update_state_after_alloc``) and which requests save which prefixes: a chunk is saved in
  the step that completes it, so with chunked prefill a long prompt is saved chunk by chunk.
* **KV cache groups** (vLLM's hybrid allocator stays on): each full-attention group stores every
  chunk, each sliding-window (or chunked-local-attention) group only the chunks of the window
  before a few ends (``plan.window_ends``: the prompt's last hittable end and every
  ``window_interval`` tokens), each recurrent-state group (Mamba, gated delta net) the state at
  those of the same ends where vLLM holds it (``plan.state_ends``). A hit is the longest prefix
  every group can serve: the full groups' leading chunks, ending where every windowed group holds
  the window before it and every state group the state at it (one existence check for all).
  KV events announce a prefix once every group stores what such a hit needs. A model whose
  state vLLM does not keep at block boundaries (prefix caching off) is served without the cache:
  a hit without its state would be wrong.
  With ``save_mode="async"`` a finished request that had saves planned keeps its blocks until
  the worker has gathered them (``request_finished`` answers True).
* **Disaggregated prefill** (``disagg``): a prefill request (``do_remote_decode``, or any request
  of a ``kv_producer``) finishes with a promise in its ``kv_transfer_params``: how many leading
  tokens it stored, where, and a deadline. A decode request carrying one (``do_remote_prefill``)
  skips the cost model: a thread of the P/D pool polls the store until the promised prefix is
  there or the deadline passes (``get_num_new_matched_tokens`` answers ``None`` meanwhile, so the
  step never waits and no blocks are held), then the hit loads in the background like any other;
  what did not arrive in time, or failed verification, vLLM recomputes. Counted per request:
  ``kvstore_pd_wait_seconds``, ``kvstore_pd_loaded_tokens``, ``kvstore_pd_load_failures_total``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvstore.connectors.vllm.disagg import (
    BadPromise,
    Promise,
    read_promise,
    shared_tier,
    wait_for,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvstore.connectors.vllm.facts import EngineFacts, build_namespace, group_heads, input_spans, legacy_namespace
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.connectors.vllm.plan import (
    blocks_for,
    external_tokens,
    lookup_limit,
    save_ends,
    servable_ends,
    state_ends,
    window_chunks,
    window_ends,
    window_start,
)
from kvstore.connectors.vllm.stats import measurements_from_data
from kvstore.cost import CostModel
from kvstore.errors import KVStoreError
from kvstore.heads import candidate_ranges, covered_count, lookup_tp_sizes
from kvstore.keys import ChunkKey, HeadRange, InputSpan, Namespace, TokenIds, chunk_keys
from kvstore.lookup_service import register_prefix_lookup
from kvstore.metrics.catalog import (
    BYPASSED,
    DECODE_CHUNKS,
    LOOKUP_FAILURES,
    LOOKUP_MISSES,
    LOOKUPS,
    PD_LOAD_FAILURES,
    PD_LOADED_TOKENS,
    PD_PROMISES,
    PD_WAIT,
)
from kvstore.metrics.server import MetricsServer, start_on_free_port
from kvstore.prefix_cache import PrefixCache, Source, count_lookup_tokens, covered_by_tier
from kvstore.record import DTYPES
from kvstore.stores import Store
from kvstore.stores.speed import LinkSpeed

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide", "live_schedulers"]

log = logging.getLogger("kvstore.vllm")

_live: weakref.WeakSet[SchedulerSide] = weakref.WeakSet()


def live_schedulers() -> list[SchedulerSide]:
    """The scheduler sides alive in this process (an in-process engine's, for offline warming)."""
    return list(_live)


@dataclass(frozen=True)
class _Answer:
    """A lookup's answer: the tokens worth loading, and the tokens every tier already holds
    (those are never saved again, even when the cost model recomputes them); the chunks found
    (before the cost model) and, per head-ranged group, the head ranges whose records cover them."""

    load: int = 0
    everywhere: int = 0
    found: int = 0
    heads: dict[int, tuple[HeadRange, ...]] = field(default_factory=dict)


@dataclass
class _Lookup:
    """One request's lookup: running on the pool, then its answer."""

    num_tokens: int
    started: float
    future: Future[_Answer]


@dataclass
class _PDWait:
    """A decode request waiting for its prefill engine's records: the promise, and the poll
    running on the P/D pool (its answer, and when it came)."""

    promise: Promise
    started: float
    deadline: float
    future: Future[tuple[_Answer, float]]


@dataclass
class _Pending:
    """A load vLLM allocated blocks for in this step, to hand to the worker."""

    start: int
    end: int
    block_ids: list[list[int]]  # per stored KV cache group
    background: bool
    heads: dict[int, tuple[HeadRange, ...]] = field(default_factory=dict)


class SchedulerSide:
    """Lookups, decisions and plans for one engine. ``block_ids(req_id)`` reads vLLM's block
    table: one list of block ids per KV cache group, in vLLM's group order."""

    def __init__(self, store: Store, facts: EngineFacts, opts: VLLMConnectorOptions, *, loads: bool,
                 saves: bool, block_ids: Callable[[str], Sequence[Sequence[int]]], lag: int = 0,
                 clock: Callable[[], float] = time.monotonic, producer: bool = False) -> None:
        self.opts = opts
        self.store = store
        self.block_size = facts.block_size
        self.groups = facts.stored_groups
        self._bypass = facts.bypass
        if self._bypass == "recurrent_state":
            log.warning("KVStoreConnector: %s keeps recurrent state (KV cache groups %s) that vLLM does not keep at "
                        "block boundaries (it does with prefix caching on, mamba_cache_mode='align', and no "
                        "speculative state blocks): every prompt is computed, nothing is loaded or saved", facts.model,
                        [g.index for g in facts.kv_groups if g.kind == "state" and not g.aligned])
        elif self._bypass == "mla_backend":
            log.warning("KVStoreConnector: %s uses MLA on a CPU engine with prefix caching off, as vLLM leaves its "
                        "reference MLA backend (a CPU without AMX tiles), which cannot compute a prompt over cached "
                        "latents: every prompt is computed, nothing is loaded or saved", facts.model)
        if self._bypass:
            loads = saves = False
        self.do_load, self.do_save = loads, saves
        self._mm_hashed = facts.mm_hashed
        if not facts.mm_hashed:
            log.warning("KVStoreConnector: vLLM names multimodal inputs by request, not by content, when prefix "
                        "caching and the multimodal processor cache are both off: prompts with images bypass the "
                        "cache (enable either to cache them)")
        self._block_ids = block_ids
        self._lag = lag
        self._clock = clock
        # Per stored group, the prefix caches of the records this engine's ranks need, and the units
        # each covers: one per KV head range its ranks hold (attention cut by head; a hit needs every
        # head), one for MLA's single copy, one per rank's shard (recurrent state); and, for groups
        # cut by head, the ranges writers of other TP sizes write (asked only when those fall short).
        self.facts = facts
        self.group_caches: list[list[PrefixCache]] = []
        self._units: list[list[HeadRange]] = []
        self._more: list[list[HeadRange]] = []
        sizes = lookup_tp_sizes(facts.tp_size, opts.writer_tp_max)
        for group in self.groups:
            auth = opts.record_auth()
            if group.head_ranged:
                ns = build_namespace(facts, opts, 0, group)[0]
                own = sorted({group_heads(facts, group, r)[0] for r in range(facts.tp_size)} - {None})  # type: ignore[type-var]
                caches = [PrefixCache(store, ns, codec=opts.codec, auth=auth, heads=h) for h in own]
                units: list[HeadRange] = list(own)  # type: ignore[arg-type]
                more = [h for h in candidate_ranges(group.kv_heads, sizes) if h not in units]
            else:
                ranks = 1 if group.replicated else facts.tp_size
                caches = [PrefixCache(store, build_namespace(facts, opts, r, group)[0], codec=opts.codec, auth=auth)
                          for r in range(ranks)]
                units, more = [HeadRange(r, r + 1, ranks) for r in range(ranks)], []
            self.group_caches.append(caches)
            self._units.append(units)
            self._more.append(more)
        self.caches = self.group_caches[0] if self.group_caches else []  # the first group's
        self._full = [i for i, g in enumerate(self.groups) if g.every_chunk]
        self._windowed = [i for i, g in enumerate(self.groups) if g.windowed]
        self._state = [i for i, g in enumerate(self.groups) if g.kind == "state"]
        self._checkpoints = bool(self._state) and all(self.groups[i].checkpoints for i in self._state)
        self.chunk_bytes = facts.bytes_per_token * opts.chunk_tokens
        # What a hit loads beside its chunks (one rank): each state group's state at its end, each
        # windowed group's window (and the chunk it starts in).
        self.hit_bytes = (sum(self.groups[i].state_bytes for i in self._state)
                          + sum(self.groups[i].bytes_per_token * (self.groups[i].window + opts.chunk_tokens)
                                for i in self._windowed))
        self.cost = CostModel(opts.load_policy)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-lookup")
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup] = {}
        self._requests: dict[str, Request] = {}
        self._local_hit: dict[str, int] = {}  # req -> the local hit shown to get_num_new_matched_tokens
        self._pending: dict[str, _Pending] = {}
        self._loading: dict[str, LoadSpec] = {}  # background loads not yet reported done (aborted ones too)
        self._failed: set[str] = set()  # requests whose load failed: recomputed, never offered a hit again
        self._saved_upto: dict[str, int] = {}
        self._announced: dict[str, int] = {}  # req -> tokens the KV events announced (hybrid models)
        self._planned_saves: set[str] = set()  # requests a SaveSpec went out for (the worker knows them too)
        self._found: dict[str, dict[int, tuple[HeadRange, ...]]] = {}  # req -> head ranges its hit reads
        self._last_probe = float("-inf")  # when a miss last asked why (miss_probe_interval)
        self._step = 0
        # Disaggregated prefill: a producer answers every finished request with a promise; a
        # decode request's wait for one runs on its own pool (a wait may last its deadline).
        self._producer = producer
        self._tier = shared_tier([(t.name, t.store.is_local) for t in store.tiers])
        self._pd_pool = ThreadPoolExecutor(8, thread_name_prefix="kvstore-pd-wait")
        self._pd: dict[str, _PDWait] = {}
        self._pd_done: set[str] = set()  # decode requests whose promise was used (once: a recompute looks up)
        self._pd_loads: dict[str, int] = {}  # decode requests loading a promise -> the tokens promised
        # Router lookups (docs/lookup.md): the metrics server answers for this engine's namespace.
        self._unregister_lookup = register_prefix_lookup(
            [] if self._bypass else [c for i in self._full for c in self.group_caches[i]],
            store=store, limit=lambda n: lookup_limit(n, self.block_size))
        self.http: MetricsServer | None = None
        if opts.http_port:  # vllm serve has no hook of its own for it: the option starts it here
            self.http = start_on_free_port(opts.http_port, opts.http_ports, opts.http_host)
            log.info("KVStoreConnector (scheduler): router lookups and metrics at %s", self.http.base_url)
        if self.caches:
            ns = self.caches[0].namespace
            log.info("KVStoreConnector (scheduler): namespace %s (%s), KV cache groups %s, load=%s (%s, policy %s) "
                     "save=%s (%s), store %s", ns.id, ns.layout,
                     [f"{g.kind}:{g.window}" if g.window else g.kind for g in self.groups], loads, opts.load_mode,
                     opts.load_policy, saves, opts.save_mode, store.describe())
        _live.add(self)

    def close(self) -> None:
        self._unregister_lookup()
        if self.http is not None:
            self.http.close()
            self.http = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pd_pool.shutdown(wait=False, cancel_futures=True)

    def chunk_keys(self, tokens: TokenIds, salt: str = "", spans: Sequence[InputSpan] = ()) -> list[ChunkKey]:
        """Keys of every chunk a hit on ``tokens`` (with the multimodal inputs ``spans``) needs
        from the groups that store every chunk (full attention; a model of windows only: the
        window before the prompt's end), in the records of this engine's ranks (their head ranges,
        or shards)."""
        arr = list(tokens)
        limit = lookup_limit(len(arr), self.block_size)
        out: list[ChunkKey] = []
        for i in self._full or self._windowed:
            g = self.groups[i]
            for cache in self.group_caches[i]:  # the records of this engine's ranks
                keys = cache.keys(arr[:limit], namespace=cache.namespace.with_salt(salt), spans=spans)
                if not self._full and keys:
                    keys = [keys[j] for j in window_chunks(keys[-1].end, g.window, self.block_size,
                                                           self.opts.chunk_tokens, local=g.kind == "local")]
                out.extend(keys)
        return out

    # -- lookup ----------------------------------------------------------------------------------
    def _keyed(self, tokens: Sequence[int], limit: int, salt: str,
               spans: Sequence[InputSpan]) -> dict[int, list[Source]]:
        """Per stored group, the chunk keys of ``tokens[:limit]`` under ``salt`` of each record
        this engine's ranks need, with the units each covers (``_units``). The chain is hashed once
        per namespace: head ranges differ only in their keys' suffix."""
        arr = list(tokens)[:limit]
        out: dict[int, list[Source]] = {}
        for i, caches in enumerate(self.group_caches):
            if self.groups[i].head_ranged:
                first = caches[0]
                keys = first.keys(arr, namespace=first.namespace.with_salt(salt), spans=spans)
                out[i] = [(c.heads, keys if c is first else [k.with_heads(c.heads) for k in keys])  # type: ignore[misc]
                          for c in caches]
            else:
                out[i] = [(u, c.keys(arr, namespace=c.namespace.with_salt(salt), spans=spans))
                          for u, c in zip(self._units[i], caches)]
        return out

    def _other_writers(self, i: int, sources: Sequence[Source], upto: int | None = None) -> list[Source]:
        """Group ``i``'s records of the head ranges other TP sizes write (none for a group not cut by head)."""
        if not self._more[i] or not sources:
            return []
        keys = sources[0][1][:upto]
        return [(h, [k.with_heads(h) for k in keys]) for h in self._more[i]]

    def _lookup(self, tokens: list[int], limit: int, salt: str, spans: tuple[InputSpan, ...]) -> _Answer:
        """What of the stored prefix is worth loading (runs on the lookup pool; never raises). A
        lookup that found nothing asks why, in a task of its own (``_count_miss``)."""
        answer = self._answer(self._keyed(tokens, limit, salt, spans))
        if not answer.found:
            try:
                self._pool.submit(self._count_miss, tokens[:limit], salt, spans)
            except RuntimeError:  # closing
                pass
        return answer

    def _answer(self, keyed: dict[int, list[Source]], *, load_all: bool = False,
                counted: bool = True) -> _Answer:
        """What of ``keyed``'s prefix the store holds and is worth loading: as the cost model
        decides, or (``load_all``) all of it. ``counted``: a lookup in the metrics (a P/D poll is not)."""
        keys = keyed[0][0][1] if keyed and keyed[0] else []
        if not keys:
            return _Answer()
        if self._full:  # every head (or rank's shard) of every full group must be covered
            covered = covered_by_tier(self.store, [keyed[i] for i in self._full],
                                      more=[self._other_writers(i, keyed[i]) for i in self._full], counted=counted)
            per_tier = covered.per_tier
            # Heads that different tiers hold: the chunks beyond what one tier covers are counted
            # as coming from the slowest one (the cost model weighs no load as faster than it is).
            per_tier[-1] = max(per_tier[-1], covered.chunks)
        else:
            covered, per_tier = None, [len(keys)] * len(self.store.tiers)
        if not any(per_tier):
            return _Answer()
        found = max(per_tier)
        servable, windows = self._servable(keyed, found)
        if not servable:
            return _Answer(found=found)
        # Each tier's leading chunks, cut back to the last end every group can serve there: the
        # cost model weighs only loads that can be hits (a P/D decode loads them all).
        usable = [max((j + 1 for j in range(n) if keys[j].end in servable), default=0) for n in per_tier]
        if load_all:
            chunks = max(usable)
        else:
            speeds = [t.speed for t in self.store.tiers]
            chunks = self.cost.plan(list(zip(speeds, usable)), [k.num_tokens for k in keys], self.chunk_bytes,
                                    extra_bytes=self.hit_bytes).chunks
        hit = max((keys[i].end for i in range(chunks) if keys[i].end in servable), default=0)
        # Stored everywhere, and servable: a save never rewrites it. (A prefix the full groups hold
        # in every tier but no group can serve at its end is saved again: its window or state heals.)
        everywhere = min(usable) if self._full else 0
        heads: dict[int, tuple[HeadRange, ...]] = {}
        if hit:
            n = next(j + 1 for j, k in enumerate(keys) if k.end == hit)
            for pos, i in enumerate(self._full):
                if self.groups[i].head_ranged and covered is not None:
                    heads[i] = tuple(covered.found(pos, n))
            for i, found_at in windows.items():
                heads[i] = tuple(found_at(hit))
        return _Answer(hit, keys[everywhere - 1].end if everywhere else 0, found, heads)

    def _servable(self, keyed: dict[int, list[Source]], count: int) -> tuple[
            set[int], dict[int, Callable[[int], list[HeadRange]]]]:
        """Ends among the first ``count`` chunks at which every windowed group holds the window
        before the end and every state group the state at it (every end, without such groups): a
        chunk counts for a group when its records there cover every head (or rank's shard). One
        existence check for the records of this engine's ranges, one more for other writers' when
        those fall short. Also, per windowed group cut by head, which ranges' records hold the
        whole window before a given end."""
        ends = [k.end for k in keyed[0][0][1][:count]]
        limited = self._windowed + self._state
        if not limited:
            return set(ends), {}
        asked = {i: [(u, keys[:count]) for u, keys in keyed[i]] for i in limited}
        present: dict[int, dict[HeadRange, list[bool]]] = {i: {} for i in limited}
        try:
            self._exists(asked, present)
            short = {i: self._other_writers(i, keyed[i], count) for i in limited
                     if not all(self._held(i, present[i], len(ends)))}
            if any(short.values()):
                self._exists(short, present)
        except KVStoreError as exc:
            log.debug("lookup of window and state records failed: %s", exc)
            LOOKUP_FAILURES.inc(reason="error")
            return set(), {}
        servable = set(ends)
        windows: dict[int, Callable[[int], list[HeadRange]]] = {}
        for i in limited:
            group = self.groups[i]
            held = self._held(i, present[i], len(ends))
            if group.kind == "state":  # the state at exactly that end
                servable &= {e for e, here in zip(ends, held) if here}
                continue
            local = group.kind == "local"
            servable &= servable_ends(ends, held, group.window, self.block_size, self.opts.chunk_tokens, local=local)
            if group.head_ranged:
                def found_at(end: int, flags: dict[HeadRange, list[bool]] = present[i], g: Any = group) -> list[HeadRange]:
                    span = window_chunks(end, g.window, self.block_size, self.opts.chunk_tokens, local=g.kind == "local")
                    return sorted(u for u, f in flags.items() if all(f[span.start:span.stop]))
                windows[i] = found_at
        return servable, windows

    def _exists(self, asked: dict[int, list[Source]], present: dict[int, dict[HeadRange, list[bool]]]) -> None:
        """One ``exists_many`` for every key of ``asked``; each source's flags into ``present``."""
        flat = [k.key for sources in asked.values() for _, keys in sources for k in keys]
        answers = self.store.exists_many(flat) if flat else []
        at = 0
        for i, sources in asked.items():
            for units, keys in sources:
                present[i][units] = answers[at:at + len(keys)]
                at += len(keys)

    def _held(self, i: int, flags: dict[HeadRange, list[bool]], count: int) -> list[bool]:
        """Per chunk of the first ``count``, whether group ``i``'s records there cover every unit."""
        if not flags:
            return [False] * count
        total = next(iter(flags)).total
        return [covered_count({u: int(f[j]) for u, f in flags.items() if j < len(f)}, total) > 0
                for j in range(count)]

    def _count_miss(self, tokens: list[int], salt: str, spans: tuple[InputSpan, ...]) -> None:
        """Runs on the lookup pool after a lookup that found nothing: whether the prompt's first
        chunk is stored under a sibling configuration, counted as the miss's reason
        (``kvstore_lookup_misses_total``); at most once per ``miss_probe_interval``, else counted
        ``unprobed``. One ``exists_many`` call; never raises."""
        interval = self.opts.miss_probe_interval
        now = self._clock()
        with self._lock:
            probe = interval > 0 and now - self._last_probe >= interval
            if probe:
                self._last_probe = now
        reason = "unprobed"
        if probe:
            try:
                reason = self._miss_reason(tokens, salt, spans)
            except Exception:  # a store outage, or a sibling that cannot be named: the reason stays unknown
                log.debug("KVStoreConnector: probing why a lookup missed failed", exc_info=True)
        LOOKUP_MISSES.inc(reason=reason)

    def _miss_reason(self, tokens: list[int], salt: str, spans: tuple[InputSpan, ...]) -> str:
        """``kv_dtype``, ``chunk_tokens``, ``cpu_isa`` or ``format``: the first sibling configuration
        under which the prompt's first chunk is stored; ``absent`` if none."""
        i = next((j for j, g in enumerate(self.groups) if g.kind != "state"), None)
        if i is None or not tokens:
            return "absent"
        group, cache = self.groups[i], self.group_caches[i][0]
        ns = cache.in_space(cache.namespace.with_salt(salt))
        ranges: list[HeadRange | None] = [*self._units[i], *self._more[i]] if group.head_ranged else [None]
        siblings: list[tuple[str, Namespace]] = []
        for dtype in sorted(d for d in DTYPES if d.startswith(("float", "bfloat")) and d != ns.kv_dtype):
            siblings.append(("kv_dtype", replace(ns, kv_dtype=dtype)))
        for size in (64, 128, 256, 512, 1024, 2048, 4096):
            if size != ns.chunk_tokens and size % ns.block_size == 0:
                siblings.append(("chunk_tokens", replace(ns, chunk_tokens=size)))
        if ns.layout.startswith("vllm-cpu-"):
            for isa in ("vec", "vec16", "amx", "neon"):
                if ns.layout != f"vllm-cpu-{isa}":
                    siblings.append(("cpu_isa", replace(ns, layout=f"vllm-cpu-{isa}")))
        names: list[tuple[str, str]] = []
        for reason, sibling in siblings:
            first = chunk_keys(sibling, tokens, max_chunks=1, spans=spans)
            names.extend((reason, first[0].with_heads(h).key) for h in ranges if first)
        for size in lookup_tp_sizes(self.facts.tp_size, self.opts.writer_tp_max):
            old = cache.in_space(legacy_namespace(self.facts, self.opts, 0, size, group).with_salt(salt))
            first = chunk_keys(old, tokens, max_chunks=1, spans=spans)
            names.extend(("format", k.key) for k in first)
        present = self.store.exists_many([key for _, key in names])
        return next((reason for (reason, _), here in zip(names, present) if here), "absent")

    def _learn(self, connector_output: KVConnectorOutput) -> None:
        """Feed the cost model what the workers measured (``measure``: their reads, their prefills)."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        if stats is None:
            return
        seen = measurements_from_data(getattr(stats, "data", None) or {})
        self.cost.observe_prefill(seen.prefill_tokens, seen.prefill_seconds)
        tiers = {t.name: t.speed for t in self.store.tiers}
        for name, (nbytes, seconds, reads) in seen.reads.items():
            self.cost.observe_reads(tiers.get(name) or LinkSpeed(name), nbytes, seconds, reads)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        tokens = request.prompt_token_ids
        spans = input_spans(request, content_hashed=self._mm_hashed)
        bypass = self._bypass or ("multimodal" if spans is None else "")
        if bypass:  # a multimodal input the keys cannot name: the request bypasses the cache
            if req_id not in self._local_hit:
                BYPASSED.inc(reason=bypass)
                self._local_hit[req_id] = num_computed_tokens  # counted once per request
            return 0, False
        if not self.do_load or tokens is None or req_id in self._failed:
            return 0, False
        limit = lookup_limit(len(tokens), self.block_size)
        if limit < self.block_size:
            return 0, False
        params = getattr(request, "kv_transfer_params", None)
        if req_id not in self._pd_done and wants_remote_prefill(params):
            return self._remote_prefill(request, params, limit, spans or (), num_computed_tokens)
        job = self._lookups.get(req_id)
        if job is None or job.num_tokens != len(tokens):
            future = self._pool.submit(self._lookup, list(tokens), limit, request.cache_salt or "", spans or ())
            job = self._lookups[req_id] = _Lookup(len(tokens), self._clock(), future)
            # Only the first ask waits (a nearby tier answers within it and the schedule is unchanged);
            # later asks only look, so a frozen tier never costs a step more than once.
            try:
                job.future.result(timeout=self.opts.lookup_wait)
            except Exception:  # noqa: BLE001 - not answered yet (or failed: handled below)
                pass
        if not job.future.done():
            if self._clock() - job.started < self.opts.lookup_timeout:
                return None, False  # ask again next step; other requests go on meanwhile
            log.debug("KVStoreConnector: lookup of %s not answered in %gs: a miss", req_id, self.opts.lookup_timeout)
            LOOKUP_FAILURES.inc(reason="timeout")
            answer = _Answer()
        elif job.future.exception() is not None:  # a bug, not an outage (``_lookup`` answers those)
            log.warning("KVStoreConnector: lookup of %s failed: a miss", req_id, exc_info=job.future.exception())
            LOOKUP_FAILURES.inc(reason="error")
            answer = _Answer()
        else:
            answer = job.future.result()
        self._local_hit[req_id] = num_computed_tokens
        if answer.everywhere:
            self._saved_upto[req_id] = max(self._saved_upto.get(req_id, 0), answer.everywhere)
        ext = external_tokens(answer.load, num_computed_tokens, self.opts.min_load_tokens)
        if ext > 0:
            self._found[req_id] = answer.heads
        return ext, ext > 0 and self.opts.load_mode == "async"

    # -- disaggregated prefill: the decode side ------------------------------------------------------
    def _remote_prefill(self, request: Request, params: Any, limit: int, spans: tuple[InputSpan, ...],
                        num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` of a request whose prefill engine promised its records:
        ``None`` while they are awaited, then the promised prefix (what arrived by the deadline)."""
        req_id = request.request_id
        wait = self._pd.get(req_id)
        if wait is None:
            try:
                promise = read_promise(params, namespace=self.caches[0].namespace.id if self.caches else "",
                                       max_tokens=limit, block_size=self.block_size)
            except BadPromise as exc:
                return self._pd_refused(request, num_computed_tokens, exc)
            now = self._clock()
            deadline = now + min(self.opts.pd_deadline, promise.deadline_s)
            tokens = list(request.prompt_token_ids or ())
            future = self._pd_pool.submit(self._await_promise, tokens, limit, request.cache_salt or "", spans,
                                          promise, deadline)
            wait = self._pd[req_id] = _PDWait(promise, now, deadline, future)
        if not wait.future.done():
            if self._clock() < wait.deadline + self.opts.lookup_timeout:
                return None, False  # ask again next step; nothing is allocated meanwhile
            # A store call that overran its own deadline: the request is recomputed now.
            answer, waited = _Answer(), self._clock() - wait.started
        elif isinstance(wait.future.exception(), BadPromise):
            del self._pd[req_id]
            return self._pd_refused(request, num_computed_tokens, wait.future.exception())  # type: ignore[arg-type]
        elif wait.future.exception() is not None:  # a bug, not an outage (``_answer`` answers those)
            log.warning("KVStoreConnector: P/D wait of %s failed: recomputed", req_id, exc_info=wait.future.exception())
            answer, waited = _Answer(), self._clock() - wait.started
        else:
            answer, waited = wait.future.result()
        del self._pd[req_id]
        self._pd_done.add(req_id)
        PD_WAIT.observe(waited)
        promised = wait.promise.tokens
        if answer.load < promised:
            PD_LOAD_FAILURES.inc(reason="timeout")
            log.info("KVStoreConnector: P/D request %s: %d of %d promised tokens visible after %.3fs (deadline); "
                     "the rest is recomputed", req_id, answer.load, promised, waited)
        self._local_hit[req_id] = num_computed_tokens
        if answer.everywhere:
            self._saved_upto[req_id] = max(self._saved_upto.get(req_id, 0), answer.everywhere)
        ext = external_tokens(answer.load, num_computed_tokens)
        if ext > 0:
            self._pd_loads[req_id] = promised
            self._found[req_id] = answer.heads
        else:
            PD_LOADED_TOKENS.observe(0)
        return ext, ext > 0 and self.opts.load_mode == "async"

    def _pd_refused(self, request: Request, num_computed_tokens: int, exc: BadPromise) -> tuple[int | None, bool]:
        """A promise this engine cannot use: counted, logged, and the request looked up as any other."""
        PD_LOAD_FAILURES.inc(reason=exc.reason)
        log.info("KVStoreConnector: P/D request %s: its kv_transfer_params are not usable here (%s): looked up "
                 "as any other", request.request_id, exc)
        self._pd_done.add(request.request_id)
        return self.get_num_new_matched_tokens(request, num_computed_tokens)

    def _await_promise(self, tokens: list[int], limit: int, salt: str, spans: tuple[InputSpan, ...],
                       promise: Promise, deadline: float) -> tuple[_Answer, float]:
        """Runs on the P/D pool: polls the store until it holds the promised prefix (or the deadline
        passes); returns the hit then, and how long it waited. ``BadPromise`` when the promise names
        another prefix than this prompt's (another prompt or cache salt)."""
        start = self._clock()
        keyed = self._keyed(tokens, limit, salt, spans)
        first = keyed[0][0][1] if keyed and keyed[0] else []
        end = next((k for k in first if k.end == promise.tokens), None)
        if end is None or end.digest.hex() != promise.digest:
            raise BadPromise("mismatch", f"the promised prefix of {promise.tokens} tokens is not this prompt's")
        answer = _Answer()

        def probe() -> int:
            nonlocal answer
            answer = self._answer(keyed, load_all=True, counted=False)
            return answer.load

        wait_for(probe, promise.tokens, deadline, clock=self._clock)
        # The polls are not lookups; the request's one lookup is what the last of them found.
        LOOKUPS.inc()
        count_lookup_tokens(first, sum(1 for k in first if k.end <= answer.load))
        return answer, self._clock() - start

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks | None,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._lookups.pop(req_id, None)
        local = self._local_hit.pop(req_id, None)
        if num_external_tokens > 0 and local is not None:
            # vLLM places the external tokens right after the (block-aligned) local hit it showed
            # get_num_new_matched_tokens, in the blocks it just allocated.
            ids = self._group_ids(blocks.get_block_ids() if blocks is not None else self._block_ids(req_id))
            self._pending[req_id] = _Pending(local, local + num_external_tokens, ids,
                                             self.opts.load_mode == "async", self._found.pop(req_id, {}))

    def _group_ids(self, per_vllm_group: Sequence[Sequence[int]]) -> list[list[int]]:
        """The block ids of the stored groups, out of vLLM's per-group lists."""
        return [list(per_vllm_group[g.index]) for g in self.groups]

    # -- per-step plans --------------------------------------------------------------------------
    def build_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        self._step += 1
        meta = KVStoreConnectorMetadata(step=self._step, lag=self._lag,
                                        preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        for req_id, pending in self._pending.items():
            request = self._requests.get(req_id)
            if request is None or request.prompt_token_ids is None:
                continue
            used = blocks_for(pending.end, self.block_size)
            spec = LoadSpec(req_id, list(request.prompt_token_ids[:pending.end]),
                            [ids[:used] for ids in pending.block_ids], pending.start, pending.end,
                            request.cache_salt or "", background=pending.background,
                            spans=input_spans(request, content_hashed=self._mm_hashed) or (),
                            heads=[list(pending.heads.get(i, ())) for i in range(len(self.groups))])
            meta.loads.append(spec)
            if pending.background:
                self._loading[req_id] = spec
        self._pending.clear()
        computed = 0
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_saves(meta, new.req_id, new.num_computed_tokens, scheduler_output)
            computed += self._prompt_tokens(new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_saves(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
            computed += self._prompt_tokens(req_id, cached.num_computed_tokens[i], scheduler_output)
        meta.prefill_tokens = computed
        return meta

    def _prompt_tokens(self, req_id: str, num_computed: int, scheduler_output: SchedulerOutput) -> int:
        """Prompt tokens this step computes for ``req_id`` (its prefill part)."""
        request = self._requests.get(req_id)
        if request is None or request.prompt_token_ids is None:
            return 0
        scheduled = int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return max(0, min(num_computed + scheduled, len(request.prompt_token_ids)) - num_computed)

    def _plan_saves(self, meta: KVStoreConnectorMetadata, req_id: str, num_computed: int,
                    scheduler_output: SchedulerOutput) -> None:
        request = self._requests.get(req_id)
        if not self.do_save or request is None or request.prompt_token_ids is None:
            return
        prompt = request.prompt_token_ids
        # With save_decode, generated tokens join the chain: all_token_ids is the prompt and what
        # was sampled so far (the last sampled token's KV is computed by the step that feeds it).
        tokens = getattr(request, "all_token_ids", None) if self.opts.save_decode else None
        known = len(tokens) if tokens is not None else None
        after = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        done = self._saved_upto.get(req_id, 0)
        ends = save_ends(len(prompt), after, done, chunk_tokens=self.opts.chunk_tokens,
                         block_size=self.block_size, save_partial=self.opts.save_partial_chunks, num_tokens=known)
        # Read the multimodal inputs only for a step that saves (most decode steps do not).
        spans = input_spans(request, content_hashed=self._mm_hashed) if ends else None
        if spans is not None:  # None: nothing to save, or bypassed (get_num_new_matched_tokens counted it)
            top = max(ends)
            source = prompt if top <= len(prompt) or tokens is None else tokens
            used = blocks_for(top, self.block_size)
            blocks = [ids[:used] for ids in self._group_ids(self._block_ids(req_id))]
            windows = self._window_ends(ends, len(prompt), num_computed)
            states = self._state_ends(ends, len(prompt), num_computed, after)
            promise = top >= lookup_limit(len(prompt), self.block_size) > done and self._promises(request)
            meta.saves.append(SaveSpec(req_id, list(source[:top]), blocks, ends, request.cache_salt or "",
                                       start=done, window_ends=windows, spans=spans, state_ends=states,
                                       announce=self._announce(req_id, ends, windows, states), promise=promise))
            decoded = sum(1 for e in ends if e > len(prompt))
            if decoded:
                DECODE_CHUNKS.inc(decoded)
            self._saved_upto[req_id] = top
            self._planned_saves.add(req_id)

    def _window_ends(self, ends: list[int], num_prompt_tokens: int, num_computed: int) -> list[int]:
        """Of a save's ``ends``, those at which the windowed groups store their window:
        ``plan.window_ends``, and only where vLLM still holds every block of that window
        (it frees a windowed group's blocks before the window of the step's first token)."""
        if not self._windowed:
            return []
        local = {i: self.groups[i].kind == "local" for i in self._windowed}
        held = {i: window_start(num_computed, self.groups[i].window, self.block_size, local=local[i])
                for i in self._windowed}
        chunk = self.opts.chunk_tokens
        return [e for e in window_ends(ends, num_prompt_tokens, self.block_size, chunk, self.opts.window_interval)
                if all(window_chunks(e, self.groups[i].window, self.block_size, chunk, local=local[i]).start * chunk
                       >= held[i] for i in self._windowed)]

    def _state_ends(self, ends: list[int], num_prompt_tokens: int, before: int, after: int) -> list[int]:
        """Of a save's ``ends``, those at which the state groups store their state (``plan.state_ends``)."""
        if not self._state:
            return []
        return state_ends(ends, num_prompt_tokens, before, after, block_size=self.block_size,
                          chunk_tokens=self.opts.chunk_tokens, interval=self.opts.window_interval,
                          checkpoints=self._checkpoints)

    def _announce(self, req_id: str, ends: list[int], windows: list[int], states: list[int]) -> tuple[int, int] | None:
        """What a save's KV events announce: its written chunks (None) when every group stores
        every chunk; else the prefix up to the last of its ends where every windowed and state
        group stores its part too (from where the request's last announcement ended)."""
        if not self._windowed and not self._state:
            return None
        served = [e for e in ends if (not self._windowed or e in windows) and (not self._state or e in states)]
        after = self._announced.get(req_id, 0)
        upto = max(served, default=0)
        if upto > after:
            self._announced[req_id] = upto
        return after, max(after, upto)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._learn(connector_output)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        invalid = connector_output.invalid_block_ids or set()
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            spec = self._loading.pop(req_id, None)
            ok = spec is not None and req_id not in failed and not invalid.intersection(spec.block_ids[0])
            if spec is not None and ok:
                # Those chunks are in the store (and were announced): nothing before spec.end needs saving again.
                self._saved_upto[req_id] = max(self._saved_upto.get(req_id, 0), spec.end)
                self._announced[req_id] = max(self._announced.get(req_id, 0), spec.end)
            promised = self._pd_loads.pop(req_id, None)
            if spec is not None and promised is not None:
                self._pd_loaded(req_id, spec, promised, ok, req_id in failed, invalid)
        for req_id in failed:
            self._failed.add(req_id)
            self._saved_upto[req_id] = 0
        if not invalid:
            return
        # A failed load (or a local hit on a block that failed) is recomputed by vLLM; plan the
        # affected requests' saves again so the recomputed chunks reach the store.
        for req_id in list(self._requests):
            try:
                blocks = self._block_ids(req_id)[0]  # block-level errors come for one-group engines only
            except Exception:  # noqa: BLE001 - the request left the cache manager
                continue
            if invalid.intersection(blocks):
                self._saved_upto[req_id] = 0
                self._failed.add(req_id)

    def _pd_loaded(self, req_id: str, spec: LoadSpec, promised: int, ok: bool, failed: bool,
                   invalid: set[int]) -> None:
        """A P/D request's load ended: the tokens it got (up to its first block that failed)."""
        if ok:
            loaded = spec.end - spec.start
        elif failed:
            loaded = 0
        else:
            bad = next((i for i, b in enumerate(spec.block_ids[0]) if b in invalid), len(spec.block_ids[0]))
            loaded = max(0, min(spec.end, bad * self.block_size) - spec.start)
        PD_LOADED_TOKENS.observe(loaded)
        if not ok and spec.end >= promised:  # short of the promise by the deadline: counted there already
            PD_LOAD_FAILURES.inc(reason="load_error")
            log.info("KVStoreConnector: P/D request %s loaded %d of %d promised tokens (a record missing, corrupt "
                     "or forged); the rest is recomputed", req_id, spec.start + loaded, promised)

    # -- disaggregated prefill: the prefill side -----------------------------------------------------
    def _promise(self, request: Request) -> dict[str, Any] | None:
        """The params a finished prefill request returns (``disagg``): the prefix its saves cover."""
        tokens = request.prompt_token_ids
        status = getattr(getattr(request, "status", None), "name", "")
        stored = min(self._saved_upto.get(request.request_id, 0), lookup_limit(len(tokens or ()), self.block_size))
        spans = input_spans(request, content_hashed=self._mm_hashed) if tokens is not None else None
        if (stored < self.block_size or self._tier is None or spans is None or not self.caches
                or status not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")):
            PD_PROMISES.inc(result="none")
            return None
        assert tokens is not None
        cache = self.caches[0]
        keys = cache.keys(list(tokens[:stored]), namespace=cache.namespace.with_salt(request.cache_salt or ""),
                          spans=spans)
        last = keys[-1]
        PD_PROMISES.inc(result="promised")
        return Promise(namespace=cache.namespace.id, tokens=last.end, chunks=len(keys), digest=last.digest.hex(),
                       tier=self._tier, deadline_s=self.opts.pd_deadline).to_params()

    def _promises(self, request: Request) -> bool:
        """Whether ``request`` is a prefill whose finish answers with a promise."""
        return self.do_save and (self._producer or wants_remote_decode(getattr(request, "kv_transfer_params", None)))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        had_saves = req_id in self._planned_saves
        params = self._promise(request) if self._promises(request) else None
        self._planned_saves.discard(req_id)
        for table in (self._requests, self._lookups, self._local_hit, self._pending, self._saved_upto,
                      self._announced, self._pd, self._pd_loads, self._found):
            table.pop(req_id, None)
        self._failed.discard(req_id)
        self._pd_done.discard(req_id)
        # A background load still running keeps its entry until the worker reports it (vLLM keeps
        # the blocks until then). With background saves, the worker may still be gathering this
        # request's blocks: vLLM keeps them until it reports the request in finished_sending (the
        # worker reports every request it saw a SaveSpec for: the same rule as here).
        return had_saves and self.opts.save_mode == "async", params
