"""``DeviceCopies``: how ``KVTransfer`` moves an accelerator's paged KV to and from records.

Load (``PrefixCache.load_staged``):

* Records are read where they lie: a ``shm://`` record's mapping and a ``memory://`` value are
  registered with the device once (``Store.pin_host_memory``), a Redis or file record is
  received into a lease of a pinned pool. Each record's KV goes to device staging in one DMA as
  soon as its header passed its checks, on a side stream; no host copy (``kvstore_device_copies_total``
  counts any: pageable memory, a decompressed record).
* Meanwhile its checksum and tag are verified on a pool of threads (or against the digest its
  store computed as it arrived). Nothing is scattered before every verdict is in: the verified
  leading records are scattered into the paged cache in one pass per layer
  (``PagedLayout.scatter_chunks``, an indexed write reading the staging where it lies), and no
  byte of a record that failed, or came after one, reaches the cache.
* No synchronisation per record: the host waits once per window for the DMAs to finish (so the
  records' memory can be reused), never for the scatter. The scatter first waits for the
  compute stream (work queued on these blocks lands before it; the DMAs into staging do not
  wait for the forward), and the compute stream waits for the scatter at the end (the next
  forward reads the loaded KV). The compute stream is the engine's
  (``DeviceCopies.compute_stream``), also for a load or save on a background thread.
* A load larger than ``staging_bytes`` runs in windows of records, each one load of the store.

Save: the chunks to write are gathered on the device in one pass per layer
(``PagedLayout.gather_chunks``) into record order, copied to a pinned pool lease in one D2H
copy, and handed to the store as views of it (each record owning a reference); the host waits
for the gather and the copy, nothing else. Local stores write (and checksum) the records on
several threads (``put_many``).

Runs on any device: on the CPU (the tests) the copies are plain, synchronous ``copy_``.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from kvstore.buffers import BufferPool, Lease
from kvstore.keys import ChunkKey, InputSpan, Namespace
from kvstore.metrics import catalog as metrics
from kvstore.paged.layouts import HeadSlice, PagedLayout
from kvstore.paged.tensors import HiddenOf
from kvstore.pinned import HostPinner, cuda_pinner
from kvstore.prefix_cache import ChunkPayload, LoadResult, PrefixCache
from kvstore.record import Record
from kvstore.types import array_view

__all__ = ["DeviceCopies", "DEFAULT_STAGING_BYTES"]

#: Device memory a load or a save stages at most at once (larger ones run in windows).
DEFAULT_STAGING_BYTES = 512 << 20

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
    received into ``pool``, a pinned one. ``stats`` counts records by ``(op, memory)``."""

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout, *,
                 pinner: HostPinner | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
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
        # One load or save at a time: they share the device staging and the side stream.
        self._lock = threading.Lock()
        # torch leaves torch.cuda.Stream's constructor unannotated.
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None  # type: ignore[no-untyped-call]
        # The engine's compute stream: the current stream of the thread that builds this (the
        # engine's, in register_kv_caches). A load or save on another thread (a background loader
        # or saver) orders itself against that stream, not against its own thread's current one.
        self._engine_thread = threading.get_ident()
        self._engine_stream = torch.cuda.current_stream(self.device) if self.on_cuda else None
        self._buf: torch.Tensor | None = None
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

    def compute_stream(self) -> torch.cuda.Stream:
        """The stream whose work a load or save is ordered against: the calling thread's current
        stream on the engine's thread, the engine's compute stream on any other (CUDA only)."""
        if threading.get_ident() == self._engine_thread or self._engine_stream is None:
            return torch.cuda.current_stream(self.device)
        return self._engine_stream

    def _on_stream(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device staging (uint8), reused: every use is ordered on the side stream."""
        buf = self._buf
        if buf is None or buf.numel() < nbytes:
            self._buf = buf = None  # the smaller buffer goes back before the larger one is allocated
            with self._on_stream():  # allocated for the side stream, where it is used
                self._buf = buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _windows(self, keys: Sequence[ChunkKey], part: HeadSlice | None = None) -> Iterator[Sequence[ChunkKey]]:
        """``keys`` in runs whose records fit ``staging_bytes`` (at least one chunk each)."""
        start, size = 0, 0
        for i, chunk in enumerate(keys):
            n = self.chunk_bytes(chunk.num_tokens, part)
            if i > start and size + n > self.staging_bytes:
                yield keys[start:i]
                start, size = i, 0
            size += n
        if start < len(keys):
            yield keys[start:]

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
        gathered: dict[int, tuple[memoryview, Lease | None]] = {}
        held: list[Lease] = []

        def payload(chunk: ChunkKey) -> ChunkPayload:
            if chunk.start not in gathered:  # the first chunk of a window: gather it all
                window = next(self._windows(keys[index[chunk.start]:]))
                gathered.update(self._gather(window, slots, held))
            kv, owner = gathered.pop(chunk.start)
            data, dtype, shape = hidden(chunk)
            shapes = [self.layout.chunk_shape(self.kv_caches[0], chunk.num_tokens)] * len(self.kv_caches)
            return ChunkPayload(shapes=shapes, kv=kv, hidden=data, hidden_dtype=dtype, hidden_shape=shape,
                                owner=None if owner is None else owner.retain())

        try:
            with self._lock:
                return self.cache.save(tokens, keys, payload, from_token=from_token, namespace=namespace, spans=spans,
                                       announce=announce)
        finally:
            for lease in held:
                lease.release()

    def _gather(self, window: Sequence[ChunkKey], slots: torch.Tensor,
                held: list[Lease]) -> dict[int, tuple[memoryview, Lease | None]]:
        """The KV of ``window`` in record order in host memory: one gather pass per layer on the
        device, one copy to a pinned lease (``held`` gets it); each chunk's bytes by its start."""
        sizes = [self.chunk_bytes(c.num_tokens) for c in window]
        total = sum(sizes)
        buf = self._device_buffer(total)
        lease = self.pool.lease(total)
        host = _host_tensor(lease.view) if lease is not None else \
            torch.empty(total, dtype=torch.uint8, pin_memory=self.on_cuda)
        if lease is not None:
            held.append(lease)
        pinned = lease.pinned if lease is not None else self.on_cuda
        if self.stream is not None:
            self.stream.wait_stream(self.compute_stream())  # the forward wrote these blocks
        offset = 0
        with self._on_stream():
            for first, k in self._runs(window):
                chunk = window[first]
                records = self._records(buf, offset, k, chunk.num_tokens)
                run = slots[chunk.start:window[first + k - 1].end]
                for layer, cache in enumerate(self.kv_caches):
                    self.layout.gather_chunks(cache, run, records[:, layer])
                offset += k * sizes[first]
            host.copy_(buf, non_blocking=pinned)
        if self.stream is not None:
            self.stream.synchronize()  # the records are read next, on the host
        self.stats["save", "pinned" if pinned else "pageable"] += len(window)
        metrics.DEVICE_COPIES.inc(len(window), op="save", memory="pinned" if pinned else "pageable")
        view = lease.view if lease is not None else array_view(host.numpy())
        out: dict[int, tuple[memoryview, Lease | None]] = {}
        offset = 0
        for chunk, n in zip(window, sizes):
            out[chunk.start] = (view[offset:offset + n], lease)
            offset += n
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

        try:
            for window in self._windows(keys, part):
                staging = _Staging(self, window, slots, skip_tokens, part)
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
        finally:
            if self.stream is not None:  # the next forward reads what was scattered
                self.compute_stream().wait_stream(self.stream)
        return done


class _Staging:
    """One window of a load: each record's KV DMA'd into device staging as it arrives, the
    verified ones scattered in one pass (``kvstore.prefix_cache.Staging``)."""

    def __init__(self, copies: DeviceCopies, window: Sequence[ChunkKey], slots: torch.Tensor, skip_tokens: int,
                 part: HeadSlice | None = None) -> None:
        self.copies = copies
        self.window = window
        self.slots = slots
        self.skip = skip_tokens
        self.part = part
        self.sizes = [copies.chunk_bytes(c.num_tokens, part) for c in window]
        self.offsets = [0, *np.cumsum(self.sizes).tolist()]
        self.buf = copies._device_buffer(self.offsets[-1])
        self.held: list[Lease] = []
        stream = copies.stream
        self.dma_done = torch.cuda.Event() if stream is not None else None  # type: ignore[no-untyped-call]

    def stage(self, index: int, chunk: ChunkKey, kv: memoryview, lease: Lease, *, decoded: bool = False) -> None:
        if len(kv) != self.sizes[index]:
            raise ValueError(f"chunk {index} holds {len(kv)} KV bytes, its record should {self.sizes[index]}")
        copies = self.copies
        dst = self.buf[self.offsets[index]:self.offsets[index + 1]]
        memory = "decoded" if decoded else "pinned" if lease.pinned else "pageable"
        self.held.append(lease.retain())  # the DMA may read it after this returns
        with copies._on_stream():
            dst.copy_(_host_tensor(kv), non_blocking=lease.pinned)
            if self.dma_done is not None:
                self.dma_done.record()
        copies.stats["load", memory] += 1
        metrics.DEVICE_COPIES.inc(op="load", memory=memory)

    def place(self, count: int) -> None:
        copies = self.copies
        try:
            if count:
                if copies.stream is not None:  # compute queued on these blocks lands before the scatter
                    copies.stream.wait_stream(copies.compute_stream())  # (the DMAs into staging need not wait)
                with copies._on_stream():
                    self._scatter(count)
        finally:
            if self.dma_done is not None:
                self.dma_done.synchronize()  # the DMAs only (recorded before the scatter): their memory goes back
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
            for layer, cache in enumerate(caches):
                layout.scatter_chunks(cache, run, records[:, layer])
