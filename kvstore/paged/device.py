"""``DeviceCopies``: how ``KVTransfer`` moves an accelerator's paged KV to and from records.

Load (``PrefixCache.load_staged``):

* Records are read where they lie: a ``shm://`` record's mapping and a ``memory://`` value are
  registered with the device once (``Store.pin_host_memory``), a Redis or file record is
  received into a lease of a pinned pool. Each record's KV goes to device staging in one DMA as
  soon as its header passed its checks, on the path's copy stream; no host copy
  (``kvstore_device_copies_total`` counts any: pageable memory, a decompressed record).
* Meanwhile its checksum and tag are verified on a pool of threads (or against the digest its
  store computed as it arrived). Nothing is scattered before every verdict is in: the verified
  leading records are scattered into the paged cache in one pass per layer
  (``PagedLayout.scatter_chunks``, an indexed write reading the staging where it lies), and no
  byte of a record that failed, or came after one, reaches the cache.
* No synchronisation per record: the host waits once per window for the DMAs to finish (so the
  records' memory can be reused), never for the scatter. The scatter, on the side stream, first
  waits for the DMAs and for the compute stream (work queued on these blocks lands before it; the
  DMAs themselves never wait for a forward), and the compute stream waits for the scatter (the
  next forward reads the loaded KV). The compute stream is the engine's, also for a load or save
  on a background thread; slots given on the host (vLLM's) go to the device from pinned memory
  on the side stream, never by a copy on the caller's stream (``kvstore.paged.streams``).
* A load larger than ``staging_bytes`` runs in windows of records, each one load of the store,
  in two halves of the staging used in turn: window i+1's DMAs wait only for window i-1's
  scatter, not for window i's (which waits for the forward).

Save: the chunks to write are gathered on the device in one pass per layer
(``PagedLayout.gather_chunks``) into record order, then copied to a pinned pool lease one record
at a time, each copy marked; a record is handed to the store (a view of the lease owning a
reference) once its own copy is done, while the later ones still copy, and the next window is
gathered and copied while the store writes this one (the two halves of the staging again). The
host waits for each record's copy, nothing else. Local stores write (and checksum) the records
on several threads (``put_many``).

``kernel``: how a window's records move between the staging and every layer's cache: ``"torch"``
(the default: one launch per layer, ``PagedLayout.scatter_chunks`` / ``gather_chunks``) or
``"triton"`` (one launch for all layers, ``kvstore.paged.triton_copy``, where Triton runs and
takes the caches; the torch path otherwise, and for the records of a local hit's first chunk or
of another head range).

Runs on any device: on the CPU (the tests) the copies are plain, synchronous ``copy_``, and the
streams' calls can be recorded (``kvstore.testing.streams``).
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from kvstore.buffers import BufferPool, Lease
from kvstore.keys import ChunkKey, InputSpan, Namespace
from kvstore.metrics import catalog as metrics
from kvstore.paged.layouts import HeadSlice, PagedLayout
from kvstore.paged.streams import Mark, Streams, streams_for
from kvstore.paged.tensors import HiddenOf
from kvstore.pinned import HostPinner, cuda_pinner
from kvstore.prefix_cache import ChunkPayload, LoadResult, PrefixCache
from kvstore.record import Record
from kvstore.types import array_view

__all__ = ["DeviceCopies", "DEFAULT_STAGING_BYTES", "KERNELS"]

log = logging.getLogger(__name__)

#: Device memory a load or a save stages at most at once (larger ones run in windows).
DEFAULT_STAGING_BYTES = 512 << 20
#: The kernels that move a window's records between the staging and the layers (``kernel``).
KERNELS = ("torch", "triton")
_ALIGN = 4096  # staging halves start on this boundary: every dtype's (and int64 views') alignment

# torch warns once per process that a read-only buffer is wrapped as if writable; a record in a
# read-only mapping is only read. The warning is used up here, at import (warnings' filters are
# process-wide: swapping them while other threads run could drop or restore theirs).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(memoryview(b"\0"), dtype=torch.uint8)


def _host_tensor(view: memoryview) -> torch.Tensor:
    """``view``'s bytes as a uint8 CPU tensor, no copy (a read-only record's is only read)."""
    return torch.frombuffer(view, dtype=torch.uint8)


_twins_lock = threading.Lock()
_twins: weakref.WeakKeyDictionary[BufferPool, list[tuple[HostPinner, BufferPool]]] = weakref.WeakKeyDictionary()


def _pinned_twin(pool: BufferPool, pinner: HostPinner) -> BufferPool:
    """A pool of ``pool``'s budget whose buffers ``pinner`` registers: one per pool and pinner,
    shared by every ``DeviceCopies`` over it (a worker's step, loader and saver paths of every KV
    cache group draw on one budget of page-locked memory, not one each)."""
    with _twins_lock:
        twins = _twins.setdefault(pool, [])
        for known, twin in twins:
            if known is pinner:
                return twin
        twin = BufferPool(pool.max_bytes, pin=pinner)
        twins.append((pinner, twin))
        return twin


class DeviceCopies:
    """The copy path of a ``KVTransfer`` over accelerator caches (see the module docstring).

    ``pinner`` registers host memory with the device (default: CUDA's on a CUDA device, none
    elsewhere); the cache's store is asked to pin its host memory with it, and records are
    received into ``pool``, a pinned one. ``stats`` counts records by ``(op, memory)``. Build
    it on the engine's thread: its current stream is the compute stream (``streams``)."""

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout, *,
                 pinner: HostPinner | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 kernel: str = "torch") -> None:
        self.cache = cache
        self.kv_caches = list(kv_caches)
        self.layout = layout
        first = self.kv_caches[0]
        self.device, self.dtype = first.device, first.dtype
        self.on_cuda = self.device.type == "cuda"
        self.pinner = pinner if pinner is not None else cuda_pinner(self.device) if self.on_cuda else None
        pool = cache.pool
        self.pool: BufferPool = pool if self.pinner is None or pool.pinner is not None else \
            _pinned_twin(pool, self.pinner)
        if self.pinner is not None:
            cache.store.pin_host_memory(self.pinner)
        self.staging_bytes = staging_bytes
        self.stats: Counter[tuple[str, str]] = Counter()
        # One load or save at a time: they share the device staging and the streams.
        self._lock = threading.Lock()
        #: Where the device work is ordered (``kvstore.paged.streams``): built here, on the engine's
        #: thread, whose current stream is the compute stream for every thread's loads and saves.
        self.streams: Streams = streams_for(self.device)
        # The staging: one allocation, used whole by a single window or as two halves in turn;
        # the side stream's last use of each half (a DMA into it waits for that).
        self._arena: torch.Tensor | None = None
        self._half = max(_ALIGN, staging_bytes // 2 // _ALIGN * _ALIGN)
        self._slot = 0  # the halves' size so far
        self._used: list[Mark] = [None, None]
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
        self.kernel = kernel
        self._layer_copies = self._kernel(kernel)
        self._token_bytes = len(self.kv_caches) * first.element_size() * math.prod(
            layout.chunk_shape(first, layout.block_size(first))) // layout.block_size(first)

    # -- shared ----------------------------------------------------------------------------
    def chunk_bytes(self, num_tokens: int, part: HeadSlice | None = None) -> int:
        """A record's KV bytes for a chunk of ``num_tokens`` tokens (every layer; of ``part``'s
        record, when it holds other heads than the cache)."""
        if part is None:
            return self._token_bytes * num_tokens
        shape = self.layout.record_shape(self.kv_caches[0], num_tokens, part.record_heads)
        return len(self.kv_caches) * self.kv_caches[0].element_size() * math.prod(shape)

    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream whose work a load or save is ordered against: the calling thread's current
        stream on the engine's thread, the engine's compute stream on any other (None off CUDA)."""
        return self.streams.compute()

    def device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` (int64 or int32, on the host or the device) as the side stream reads them:
        host slots copied from pinned memory, non-blocking, on the side stream (no copy on the
        caller's stream, which would wait for its queued forwards)."""
        return self.streams.slots(slots)

    def _on_stream(self) -> AbstractContextManager[Any]:
        return self.streams.side()

    def _kernel(self, kernel: str) -> tuple[Callable[[torch.Tensor, torch.Tensor], None],
                                            Callable[[torch.Tensor, torch.Tensor], None]] | None:
        """The one-launch scatter and gather over every layer (``kernel="triton"``), or None: the
        torch path (also where Triton cannot run or take these caches: said once, in the log)."""
        if kernel == "torch":
            return None
        try:
            from kvstore.paged import triton_copy
        except ImportError as exc:
            log.warning("kernel=triton: Triton cannot be imported (%s); the torch path copies", exc)
            return None
        if not triton_copy.available(self.device) or not triton_copy.supports(self.kv_caches, self.layout):
            log.warning("kernel=triton: not for these caches (%s on %s); the torch path copies",
                        self.layout.name, self.device)
            return None
        return (triton_copy.LayerScatter(self.kv_caches, self.layout),
                triton_copy.LayerGather(self.kv_caches, self.layout))

    def _staging(self, nbytes: int, half: int | None) -> torch.Tensor:
        """``nbytes`` of device staging (uint8): from its start (``half`` None: a window that
        takes it whole), or in one of its two halves; the copy stream's next DMAs wait for the
        side stream's last use of that memory. One allocation for the side and copy streams,
        grown as needed (halves as large as the largest window seen, up to ``staging_bytes / 2``:
        where they grow they move, and the DMAs wait for every earlier use)."""
        used = self._used
        if half is None:
            start, wait = 0, used[self._last_half]  # the later mark: the side stream is in order
        else:
            if nbytes > self._slot:
                self._slot = min(self._half, -(-nbytes // _ALIGN) * _ALIGN)
                wait = used[self._last_half]
            else:
                wait = used[half]
            start = half * self._slot
        arena = self._arena
        if arena is None or arena.numel() < start + nbytes:
            self._arena = arena = None  # the smaller one goes back before the larger one is allocated
            self._arena = arena = self.streams.staging(start + nbytes)
        self.streams.copy_waits(wait)
        return arena[start:start + nbytes]

    _last_half = 0  # which half's mark is the later one (the side stream is in order: it covers both)

    def _staging_used(self, half: int | None) -> None:
        """The side stream has issued its last use of ``half`` (None: of the whole staging)."""
        mark = self.streams.side_done()
        if half is None:
            self._used = [mark, mark]
        else:
            self._used[half] = mark
            self._last_half = half

    def _plan(self, keys: Sequence[ChunkKey], part: HeadSlice | None = None
              ) -> list[tuple[Sequence[ChunkKey], int | None]]:
        """``keys`` in windows, each with the staging half it uses: one window in the half the
        last one did not use where every record fits in it (a load or save right after another
        does not wait for the other's scatter or copies), one of the whole staging where they fit
        in that, else windows of half of it in turn (0, 1, 0, ...: one is staged while the other is
        scattered or copied out), or, where a single record outgrows a half, windows of the whole
        staging one after another."""
        sizes = [self.chunk_bytes(c.num_tokens, part) for c in keys]
        if not keys:
            return []
        if sum(sizes) <= self._half:
            return [(keys, 1 - self._last_half)]
        if sum(sizes) <= self.staging_bytes:
            return [(keys, None)]
        budget = self._half if max(sizes) <= self._half else self.staging_bytes
        windows: list[Sequence[ChunkKey]] = []
        start, size = 0, 0
        for i, n in enumerate(sizes):
            if i > start and size + n > budget:
                windows.append(keys[start:i])
                start, size = i, 0
            size += n
        windows.append(keys[start:])
        halves = budget == self._half
        return [(w, (1 - self._last_half + i) % 2 if halves else None) for i, w in enumerate(windows)]

    def _records(self, buf: torch.Tensor, offset: int, k: int, num_tokens: int,
                 part: HeadSlice | None = None) -> torch.Tensor:
        """``k`` records of ``num_tokens`` tokens at ``offset`` of ``buf``: ``[k, layers, *chunk_shape]``
        (``part``: of records holding ``part.record_heads`` heads)."""
        cache = self.kv_caches[0]
        shape = self.layout.chunk_shape(cache, num_tokens) if part is None else \
            self.layout.record_shape(cache, num_tokens, part.record_heads)
        nbytes = k * self.chunk_bytes(num_tokens, part)
        return buf[offset:offset + nbytes].view(self.dtype).view(k, len(self.kv_caches), *shape)

    def _runs(self, chunks: Sequence[ChunkKey]) -> Iterator[tuple[int, int]]:
        """``(first, count)`` of each run of consecutive chunks of one size."""
        i = 0
        while i < len(chunks):
            j = i + 1
            while j < len(chunks) and chunks[j].num_tokens == chunks[i].num_tokens:
                j += 1
            yield i, j - i
            i = j

    # -- save ------------------------------------------------------------------------------
    def save(self, tokens: np.ndarray, keys: Sequence[ChunkKey], slots: torch.Tensor, hidden: HiddenOf, *,
             from_token: int | None, namespace: Namespace | None, spans: Sequence[InputSpan],
             announce: tuple[int, int] | None = None) -> int:
        """``KVTransfer.save_sequence``'s writes of ``keys`` (``slots``: int64 on the device)."""
        index = {chunk.start: i for i, chunk in enumerate(keys)}
        gathered: dict[int, tuple[memoryview, Lease | None, Mark]] = {}
        plan: list[tuple[Sequence[ChunkKey], int | None]] = []
        starts: dict[int, int] = {}  # the first chunk of each window of the plan: its index there
        launched: set[int] = set()
        held: list[Lease] = []
        last: list[Mark] = [None]  # the last copy issued: every lease is written once it is done

        def payload(chunk: ChunkKey) -> ChunkPayload:
            if not plan:  # the first chunk the cache writes (those before it are stored): windows from it
                plan.extend(self._plan(keys[index[chunk.start]:]))
                starts.update((window[0].start, j) for j, (window, _) in enumerate(plan))
            j = starts.get(chunk.start)
            if j is not None:  # a window's first chunk: it and the next are gathered (the next while this is written)
                for window, half in plan[j:j + 2]:
                    if window[0].start not in launched:
                        launched.add(window[0].start)
                        gathered.update(self._gather(window, slots, held, half, last))
            kv, owner, copied = gathered.pop(chunk.start)
            self.streams.host_waits(copied)  # this record's copy only: later ones are still copying
            data, dtype, shape = hidden(chunk)
            shapes = [self.layout.chunk_shape(self.kv_caches[0], chunk.num_tokens)] * len(self.kv_caches)
            return ChunkPayload(shapes=shapes, kv=kv, hidden=data, hidden_dtype=dtype, hidden_shape=shape,
                                owner=None if owner is None else owner.retain())

        try:
            with self._lock:
                return self.cache.save(tokens, keys, payload, from_token=from_token, namespace=namespace, spans=spans,
                                       announce=announce)
        finally:
            self.streams.host_waits(last[0])  # no copy may still write a lease that goes back
            for lease in held:
                lease.release()

    def _gather(self, window: Sequence[ChunkKey], slots: torch.Tensor, held: list[Lease], half: int | None,
                last: list[Mark]) -> dict[int, tuple[memoryview, Lease | None, Mark]]:
        """The KV of ``window`` in record order on its way to host memory: one gather pass per
        layer on the device (into the staging, or ``half`` of it), then one copy per record to a
        pinned lease (``held`` gets it), each marked (``last[0]``: the last); each chunk's bytes,
        lease and mark by its start. Nothing here waits."""
        streams = self.streams
        sizes = [self.chunk_bytes(c.num_tokens) for c in window]
        total = sum(sizes)
        buf = self._staging(total, half)
        lease = self.pool.lease(total)
        host = _host_tensor(lease.view) if lease is not None else \
            torch.empty(total, dtype=torch.uint8, pin_memory=self.on_cuda)
        if lease is not None:
            held.append(lease)
        pinned = lease.pinned if lease is not None else self.on_cuda
        streams.side_waits_for_compute()  # the forward wrote these blocks
        offset = 0
        with streams.side():
            for first, k in self._runs(window):
                chunk = window[first]
                records = self._records(buf, offset, k, chunk.num_tokens)
                run = slots[chunk.start:window[first + k - 1].end]
                if self._layer_copies is not None:
                    self._layer_copies[1](run, records)
                else:
                    for layer, cache in enumerate(self.kv_caches):
                        self.layout.gather_chunks(cache, run, records[:, layer])
                offset += k * sizes[first]
        view = lease.view if lease is not None else array_view(host.numpy())
        out: dict[int, tuple[memoryview, Lease | None, Mark]] = {}
        offset = 0
        for chunk, n in zip(window, sizes):  # one copy per record: the store takes each once it is in
            last[0] = streams.d2h(host[offset:offset + n], buf[offset:offset + n], pinned=pinned)
            out[chunk.start] = (view[offset:offset + n], lease, last[0])
            offset += n
        self._staging_used(half)
        self.stats["save", "pinned" if pinned else "pageable"] += len(window)
        metrics.DEVICE_COPIES.inc(len(window), op="save", memory="pinned" if pinned else "pageable")
        return out

    # -- load ------------------------------------------------------------------------------
    def load(self, tokens: np.ndarray, keys: Sequence[ChunkKey], slots: torch.Tensor, skip_tokens: int, *,
             namespace: Namespace | None, before_place: Callable[[ChunkKey, Record], None] | None,
             hidden_dtype: str | None, hidden_shape: Sequence[int] | None, part: HeadSlice | None = None,
             counted: bool = True) -> LoadResult:
        """``KVTransfer.load_sequence``'s load of ``keys`` (all ending after ``skip_tokens``); with
        ``part``, of records holding other heads than the cache, of which ``part`` is scattered."""
        total = LoadResult()
        done = 0
        with self._lock:
            done = self._load_windows(tokens, keys, slots, skip_tokens, total, namespace=namespace,
                                      before_place=before_place, hidden_dtype=hidden_dtype, hidden_shape=hidden_shape,
                                      part=part, counted=counted)
        if done < len(keys):
            metrics.MISSES.inc(len(keys) - done)  # windows never asked for: the load stopped before them
        return total

    def _load_windows(self, tokens: np.ndarray, keys: Sequence[ChunkKey], slots: torch.Tensor, skip_tokens: int,
                      total: LoadResult, *, namespace: Namespace | None,
                      before_place: Callable[[ChunkKey, Record], None] | None, hidden_dtype: str | None,
                      hidden_shape: Sequence[int] | None, part: HeadSlice | None, counted: bool) -> int:
        """``load``'s windows, one ``load_staged`` each, until one falls short; how many keys were asked for."""
        done = 0
        cache = self.kv_caches[0]

        def shapes(chunk: ChunkKey) -> list[tuple[int, ...]]:
            shape = self.layout.chunk_shape(cache, chunk.num_tokens) if part is None else \
                self.layout.record_shape(cache, chunk.num_tokens, part.record_heads)
            return [shape] * len(self.kv_caches)

        for window, half in self._plan(keys, part):
            staging = _Staging(self, window, slots, skip_tokens, part, half)
            result = self.cache.load_staged(
                tokens, window, staging, shapes=shapes, namespace=namespace, hidden_dtype=hidden_dtype,
                hidden_shape=hidden_shape, pool=self.pool, before_place=before_place, counted=counted)
            done += len(window)
            total.reason = result.reason
            if result.num_chunks:
                total.num_chunks += result.num_chunks
                total.num_tokens, total.last_header, total.hidden = \
                    result.num_tokens, result.last_header, result.hidden
            if result.num_chunks < len(window):
                break
        return done


class _Staging:
    """One window of a load: each record's KV DMA'd into device staging as it arrives, the
    verified ones scattered in one pass (``kvstore.prefix_cache.Staging``)."""

    def __init__(self, copies: DeviceCopies, window: Sequence[ChunkKey], slots: torch.Tensor, skip_tokens: int,
                 part: HeadSlice | None = None, half: int | None = None) -> None:
        self.copies = copies
        self.window = window
        self.slots = slots
        self.skip = skip_tokens
        self.part = part
        self.sizes = [copies.chunk_bytes(c.num_tokens, part) for c in window]
        self.offsets = [0, *np.cumsum(self.sizes).tolist()]
        self.half = half
        self.buf = copies._staging(self.offsets[-1], half)
        self.held: list[Lease] = []

    def stage(self, index: int, chunk: ChunkKey, kv: memoryview, lease: Lease, *, decoded: bool = False) -> None:
        if len(kv) != self.sizes[index]:
            raise ValueError(f"chunk {index} holds {len(kv)} KV bytes, its record should {self.sizes[index]}")
        copies = self.copies
        dst = self.buf[self.offsets[index]:self.offsets[index + 1]]
        memory = "decoded" if decoded else "pinned" if lease.pinned else "pageable"
        self.held.append(lease.retain())  # the DMA may read it after this returns
        copies.streams.h2d(dst, _host_tensor(kv), pinned=lease.pinned)
        copies.stats["load", memory] += 1
        metrics.DEVICE_COPIES.inc(op="load", memory=memory)

    def place(self, count: int) -> None:
        copies = self.copies
        streams = copies.streams
        dmas = streams.copies_done()  # every DMA of this window
        try:
            streams.side_waits(dmas)  # the scatter reads what they wrote (and the staging's next user follows)
            if count:
                streams.side_waits_for_compute()  # compute queued on these blocks lands before the scatter
                with streams.side():
                    self._scatter(count)
                streams.compute_waits_for_side()  # the next forward reads what was scattered
        finally:
            copies._staging_used(self.half)
            streams.host_waits(dmas)  # the DMAs only, not the scatter: their memory goes back
            for lease in self.held:
                lease.release()
            self.held.clear()

    def _scatter(self, count: int) -> None:
        """The first ``count`` staged records into the cache, one pass per layer and run of
        equally long chunks; tokens before ``skip`` (already in the cache) never written. Of
        records holding other heads (``part``), only the heads the cache holds are written."""
        copies, chunks, part = self.copies, self.window[:count], self.part
        layout, first_cache = copies.layout, copies.kv_caches[0]
        axis = layout.token_axis(first_cache)
        caches = copies.kv_caches if part is None else \
            [layout.narrow_heads(c, part.dst_at, part.count) for c in copies.kv_caches]
        for first, k in copies._runs(chunks):
            chunk = chunks[first]
            records = copies._records(self.buf, self.offsets[first], k, chunk.num_tokens, part)
            if part is not None:  # [k, layers, *record_shape]: the heads both hold, one copy on the device
                records = layout.narrow_heads(records, part.src_at, part.count, staging=True, lead=2).contiguous()
            run = self.slots[chunk.start:chunks[first + k - 1].end]
            skip = max(0, self.skip - chunk.start)
            if skip:  # only a run's first chunk can start inside the local hit: on its own
                rest = chunk.num_tokens - skip
                units = layout.chunk_shape(first_cache, chunk.num_tokens)[axis]
                kept = layout.chunk_shape(first_cache, rest)[axis]
                head = records[:1].narrow(axis + 2, units - kept, kept)
                for layer, cache in enumerate(caches):
                    layout.scatter_chunks(cache, run[skip:chunk.num_tokens], head[:, layer])
                if k == 1:
                    continue
                records, run = records[1:], run[chunk.num_tokens:]
            if copies._layer_copies is not None and part is None:
                copies._layer_copies[0](run, records)  # every layer in one launch
                continue
            for layer, cache in enumerate(caches):
                layout.scatter_chunks(cache, run, records[:, layer])
