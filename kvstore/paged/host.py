"""``HostCopies``: how ``KVTransfer`` moves a CPU paged cache's KV to and from records.

* Save: each chunk is gathered from the paged cache straight into a leased pool buffer, which
  becomes the record's payload as it is: the header goes beside it and the store sends both
  pieces (a background writer keeps the lease until the bytes are out). On a cache of whole-block
  items, a store that sends or copies values before ``put`` returns (every store but a tiered
  one with background writers: ``Store.queues_writes``) is handed the blocks themselves as the
  payload's pieces: no gather, the send reads the cache.
* Load: records arrive in leased pool buffers, are verified in place, and are scattered into the
  paged cache straight from there (the numpy kernels, ``kvstore.paged.kernels``). A store that
  receives piece by piece (Redis, files) lands each record's KV in the blocks themselves, once
  its header passed every check; its checksum and tag are checked when its last byte is in, and
  a record that fails them is a miss like any other. A record of other KV heads than the cache
  holds (another TP size's) lands the same way on vLLM CPU's pages, its heads' pages into the
  blocks' and any head the cache does not hold into a leased scratch buffer; elsewhere it is
  verified in its lease and the heads both hold scattered (torch, through host staging).

Layouts the numpy kernels cannot address (token rows at odd strides) are copied with the
layout's torch ``gather`` / ``scatter`` through host staging.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.buffers import BufferPool, Lease
from kvstore.keys import ChunkKey, InputSpan, Namespace
from kvstore.paged.kernels import BlockBytes, host_bytes, host_copy, host_layers
from kvstore.paged.layouts import HeadSlice, PagedLayout
from kvstore.paged.tensors import HiddenOf, tensor_bytes
from kvstore.prefix_cache import ChunkPayload, LoadResult, PrefixCache
from kvstore.record import Record
from kvstore.types import Buffer

__all__ = ["HostCopies"]


class HostCopies:
    """The copy path of a ``KVTransfer`` over CPU caches (see the module docstring)."""

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout, *,
                 land: bool, save_from_blocks: bool) -> None:
        self.cache = cache
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.pool: BufferPool = cache.pool
        self.dtype = self.kv_caches[0].dtype
        # numpy item views of every layer, built once: per chunk, one index for all layers.
        self._host = host_layers([layout.host_layer(c) for c in self.kv_caches])
        # The cache's whole blocks as bytes: loads land records in them, saves send from them.
        blocks = BlockBytes(self._host) if self._host is not None and self._host[0].blocks is not None else None
        if blocks is not None and not blocks.rows:
            blocks = None
        self._landing = blocks if land else None
        self._sources = blocks if save_from_blocks else None
        # One head's page of one block, per token (records of other heads land by pages).
        first = self.kv_caches[0]
        self._heads = layout.num_heads(first)
        self._page_bytes = first[0].numel() * first.element_size() // max(1, self._heads * layout.block_size(first)) \
            if layout.head_pages else 0

    @property
    def lands_in_cache(self) -> bool:
        return self._landing is not None

    def _shapes(self, num_tokens: int, part: HeadSlice | None = None) -> list[tuple[int, ...]]:
        cache = self.kv_caches[0]
        shape = self.layout.chunk_shape(cache, num_tokens) if part is None else \
            self.layout.record_shape(cache, num_tokens, part.record_heads)
        return [shape] * len(self.kv_caches)

    def _staging_shape(self, num_tokens: int, part: HeadSlice | None = None) -> tuple[int, ...]:
        return (len(self.kv_caches), *self._shapes(num_tokens, part)[0])

    def _host_staging(self, num_tokens: int, part: HeadSlice | None = None) -> tuple[torch.Tensor, Lease | None]:
        """Host memory for one chunk of every layer (of a record of ``part``'s heads): a pool lease
        (the caller releases it), or, when the pool is full, a tensor of its own (``None`` lease)."""
        shape = self._staging_shape(num_tokens, part)
        nbytes = math.prod(shape) * self.kv_caches[0].element_size()
        lease = self.pool.lease(nbytes)
        if lease is None:
            return torch.empty(shape, dtype=self.dtype), None
        return torch.frombuffer(lease.view, dtype=torch.uint8).view(self.dtype).view(shape), lease

    # -- save ------------------------------------------------------------------------------
    def save(self, tokens: np.ndarray, keys: Sequence[ChunkKey], slots: torch.Tensor, hidden: HiddenOf, *,
             from_token: int | None, namespace: Namespace | None, spans: Sequence[InputSpan],
             announce: tuple[int, int] | None = None) -> int:
        """``KVTransfer.save_sequence``'s writes of ``keys`` (``slots``: int64, every token's)."""
        # A store that keeps values past put_many would copy borrowed blocks anyway: gather once
        # into a lease it can retain. Codecs read one contiguous buffer.
        sources = None if self.cache.store.queues_writes or self.cache.chain else self._sources

        def payload(chunk: ChunkKey) -> ChunkPayload:
            chunk_slots = slots[chunk.start:chunk.end]
            lease = None
            blocks = sources.targets(chunk_slots) if sources is not None else None
            kv: Buffer | Sequence[Buffer]
            if blocks is not None:
                kv = blocks
            else:
                staging, lease = self._host_staging(chunk.num_tokens)
                try:
                    self._gather(chunk_slots, staging)
                except BaseException:
                    if lease is not None:
                        lease.release()
                    raise
                kv = lease.view if lease is not None else tensor_bytes(staging)
            data, dtype, shape = hidden(chunk)
            return ChunkPayload(shapes=self._shapes(chunk.num_tokens), kv=kv, hidden=data, hidden_dtype=dtype,
                                hidden_shape=shape, owner=lease)

        return self.cache.save(tokens, keys, payload, from_token=from_token, namespace=namespace, spans=spans,
                               announce=announce)

    def _gather(self, slots: torch.Tensor, host: torch.Tensor) -> None:
        """Copy the KV of ``slots`` in every layer into ``host`` (``_staging_shape(len(slots))``).
        The record's checksum is computed later, as the store sends the bytes (``Pieces.stream``)."""
        staging = host_bytes(host) if self._host is not None else None
        if self._host is None or staging is None or not host_copy(self._host, slots, staging, False):
            for layer, cache in enumerate(self.kv_caches):
                self.layout.gather(cache, slots, host[layer])

    # -- load ------------------------------------------------------------------------------
    def load(self, tokens: np.ndarray, keys: Sequence[ChunkKey], slots: torch.Tensor, skip_tokens: int, *,
             namespace: Namespace | None, before_place: Callable[[ChunkKey, Record], None] | None,
             hidden_dtype: str | None, hidden_shape: Sequence[int] | None, part: HeadSlice | None = None,
             counted: bool = True) -> LoadResult:
        """``KVTransfer.load_sequence``'s load of ``keys`` (all ending after ``skip_tokens``); with
        ``part``, of records holding other heads than the cache, of which ``part`` is copied (each
        record verified whole in its lease first, then those heads scattered)."""
        def sink(chunk: ChunkKey, record: Record) -> None:
            if before_place is not None:
                before_place(chunk, record)
            if record.landed:
                return
            if part is not None:
                self._scatter_part(slots[chunk.start:chunk.end], record.kv, max(0, skip_tokens - chunk.start), part)
            else:
                self._scatter(slots[chunk.start:chunk.end], record.kv, max(0, skip_tokens - chunk.start))

        landing = self._landing if part is None or self.layout.head_pages else None
        land = None
        scratch: list[Lease] = []  # where the heads of a record this cache does not hold land
        if landing is not None and part is None:
            def land(chunk: ChunkKey) -> list[memoryview] | None:
                # Never into blocks before skip_tokens: they may be shared with other requests.
                return landing.targets(slots[chunk.start:chunk.end]) if chunk.start >= skip_tokens else None
        elif landing is not None and part is not None:
            def land(chunk: ChunkKey) -> list[memoryview] | None:
                if chunk.start < skip_tokens:
                    return None
                unneeded = (part.record_heads - part.count) * self._page_bytes * chunk.num_tokens * len(self.kv_caches)
                lease = self.pool.lease(unneeded) if unneeded else None
                if unneeded and lease is None:
                    return None  # no room: received whole, then scattered
                if lease is not None:
                    scratch.append(lease)
                return landing.part_targets(slots[chunk.start:chunk.end], self._heads, part.record_heads, part.src_at,
                                            part.dst_at, part.count,
                                            lease.view if lease is not None else memoryview(b""))

        try:
            return self.cache.load(tokens, keys, sink, land=land, shapes=lambda c: self._shapes(c.num_tokens, part),
                                   namespace=namespace, hidden_dtype=hidden_dtype, hidden_shape=hidden_shape,
                                   counted=counted)
        finally:
            for lease in scratch:
                lease.release()

    def _scatter_part(self, slots: torch.Tensor, kv: Buffer, skip: int, part: HeadSlice) -> None:
        """``part``'s heads of a record's KV bytes into the cache at ``slots[skip:]`` (staged first:
        torch's copies need the bytes typed and aligned)."""
        host, lease = self._host_staging(slots.numel(), part)
        try:
            np.copyto(host.view(-1).view(torch.uint8).numpy(), np.frombuffer(kv, dtype=np.uint8))
            layout = self.layout
            for layer, cache in enumerate(self.kv_caches):
                rows = self._token_rows(host[layer], slots.numel(), skip) if skip else host[layer]
                src = layout.narrow_heads(rows, part.src_at, part.count, staging=True)
                layout.scatter(layout.narrow_heads(cache, part.dst_at, part.count), slots[skip:], src.contiguous())
        finally:
            if lease is not None:
                lease.release()

    def _token_rows(self, staging: torch.Tensor, num_tokens: int, skip: int) -> torch.Tensor:
        """The part of one layer's staging (``chunk_shape(num_tokens)``) after its first ``skip`` tokens."""
        axis = self.layout.token_axis(self.kv_caches[0])
        full = self.layout.chunk_shape(self.kv_caches[0], num_tokens)[axis]
        rest = self.layout.chunk_shape(self.kv_caches[0], num_tokens - skip)[axis]
        return staging.narrow(axis, full - rest, rest).contiguous()

    def _scatter(self, slots: torch.Tensor, kv: Buffer, skip: int = 0) -> None:
        n = slots.numel()
        # Straight from the record's bytes (numpy items have no alignment needs).
        if self._host is not None and host_copy(self._host, slots, np.frombuffer(kv, dtype=np.uint8), True, skip):
            return
        # Staged first: torch's copies need the record's bytes typed and aligned.
        host, lease = self._host_staging(n)
        try:
            np.copyto(host.view(-1).view(torch.uint8).numpy(), np.frombuffer(kv, dtype=np.uint8))
            for layer, cache in enumerate(self.kv_caches):
                rows = self._token_rows(host[layer], n, skip) if skip else host[layer]
                self.layout.scatter(cache, slots[skip:], rows)
        finally:
            if lease is not None:
                lease.release()
