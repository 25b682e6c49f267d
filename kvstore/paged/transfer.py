"""``KVTransfer``: save and load token prefixes of a sequence between a paged cache and a store.

The engine-agnostic core the agent API and the vLLM connector both use: per sequence (tokens,
slots) it saves chunks through a ``PrefixCache`` and loads the longest stored prefix back.

* Save: each chunk is gathered from the paged cache straight into a leased pool buffer (resident,
  pinned on CUDA), which becomes the record's payload as it is: the header goes beside it and
  the store sends both pieces (a background writer keeps the lease until the bytes are out).
  On a CPU cache of whole-block items, a store that sends or copies values before ``put``
  returns (every store but a tiered one with background writers: ``Store.queues_writes``) is
  handed the blocks themselves as the payload's pieces: no gather, the send reads the cache.
* Load: records arrive in leased pool buffers, are verified in place, and are scattered into the
  paged cache straight from there (on an accelerator: one host-to-device copy of the record's
  bytes from the pinned buffer they arrived in, on a side stream, then the scatter on the device).
  On a CPU cache a store that receives piece by piece (Redis, files) lands each record's KV in the
  blocks themselves, once its header passed every check; its checksum and tag are checked
  when its last byte is in, and a record that fails them is a miss like any other.

The copy path is chosen once, when the transfer is built: the numpy kernels for CPU caches, the
layout's torch copies on an accelerator.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.buffers import BufferPool, Lease
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, InputSpan, Namespace, TokenIds, prefix_keys, tokens_to_array
from kvstore.paged.kernels import BlockBytes, host_bytes, host_copy, host_layers
from kvstore.paged.layouts import PagedLayout, get_layout
from kvstore.paged.tensors import dtype_name, tensor_bytes
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import Record
from kvstore.types import Buffer, array_view

__all__ = ["KVTransfer"]

log = logging.getLogger(__name__)


class KVTransfer:
    """Save and load token prefixes of a sequence between a paged KV cache and a store.

    ``kv_caches`` are this rank's layers (``layout`` describes each), all of one dtype and
    device. Every record holds all these layers for one chunk (``shapes``: one
    ``chunk_shape`` per layer) plus, when known, the hidden state of the chunk's last token.
    The ``PrefixCache``'s namespace must name this layout, dtype, block size and layer range;
    ``KVTransfer`` checks what it can at construction.

    Block-granular layouts save and load whole blocks only (a final partial block is neither
    stored nor loaded). Nothing here raises a storage or record error: a failed load is a
    shorter (or zero) hit.

    On a CPU cache whose blocks are whole items (every layout here but token rows at odd
    strides), loads land records straight in the blocks (``PrefixCache.load``'s ``land``:
    no copy out of a pool buffer); ``land=False`` keeps every record in its lease until
    verified, then scatters it. Either way the blocks past the loaded prefix hold nothing the
    caller may use: stale KV, or a failed record's bytes. Saves into a store that does not queue
    writes send such a cache's blocks as they are (``save_from_blocks``; off: gathered into a
    pool buffer first, as for every other store).
    """

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout | str, *,
                 land: bool = True, save_from_blocks: bool = True) -> None:
        if not kv_caches:
            raise ValueError("KVTransfer needs at least one layer's KV cache")
        self.cache = cache
        self.kv_caches = list(kv_caches)
        self.layout = get_layout(layout)
        first = self.kv_caches[0]
        self.device, self.dtype = first.device, first.dtype
        self.block_size = self.layout.block_size(first)
        for i, c in enumerate(self.kv_caches):
            if c.dtype != self.dtype or c.device != self.device or c.shape != first.shape:
                raise ValueError(f"layer {i} cache is {c.dtype}{list(c.shape)} on {c.device}; "
                                 f"layer 0 is {self.dtype}{list(first.shape)} on {self.device}")
        ns = cache.namespace
        problems = []
        if ns.layout != self.layout.name:
            problems.append(f"layout={ns.layout!r} (cache is {self.layout.name!r})")
        if ns.kv_dtype != dtype_name(self.dtype):
            problems.append(f"kv_dtype={ns.kv_dtype!r} (cache is {dtype_name(self.dtype)!r})")
        if ns.block_size != self.block_size:
            problems.append(f"block_size={ns.block_size} (cache has {self.block_size})")
        if ns.layer_end - ns.layer_start != len(self.kv_caches):
            problems.append(f"layer range [{ns.layer_start}, {ns.layer_end}) for {len(self.kv_caches)} layers")
        if problems:
            raise ConfigError("namespace does not describe the KV cache: " + "; ".join(problems))
        self.on_cuda = self.device.type == "cuda"
        # Host staging comes from the prefix cache's pool; device-to-host copies overlap only
        # from pinned memory, so an accelerator gets a pinned pool of the same budget.
        pool = cache.pool
        self.pool = pool if not self.on_cuda or pool.pin else BufferPool(pool.max_bytes, pin=True)
        self._dev_buf: torch.Tensor | None = None
        # numpy item views of every layer, built once (CPU caches): per chunk, one index for all layers.
        self._host = host_layers([self.layout.host_layer(c) for c in self.kv_caches]) if self.device.type == "cpu" else None
        # The cache's whole blocks as bytes (CPU caches): loads land records in them, saves send from them.
        blocks = (BlockBytes(self._host) if self._host is not None and self._host[0].blocks is not None
                  else None)
        if blocks is not None and not blocks.rows:
            blocks = None
        self._landing = blocks if land else None
        self._sources = blocks if save_from_blocks else None
        # torch leaves torch.cuda.Stream's constructor unannotated.
        self._stream = torch.cuda.Stream(self.device) if self.on_cuda else None  # type: ignore[no-untyped-call]

    @property
    def lands_in_cache(self) -> bool:
        """Whether loads land records straight in the cache's blocks (a store that receives piece
        by piece permitting): a CPU cache of whole-block items, and ``land`` not turned off."""
        return self._landing is not None

    # -- helpers ---------------------------------------------------------------------------
    def usable_tokens(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence this layout can store or load."""
        if self.layout.granularity == "block":
            return num_tokens - num_tokens % self.block_size
        return num_tokens

    def keys(self, tokens: TokenIds, max_tokens: int | None = None,
             namespace: Namespace | None = None, *, spans: Sequence[InputSpan] = ()) -> list[ChunkKey]:
        """Chunk keys of the storable part of ``tokens`` (up to ``max_tokens``), under
        ``namespace`` (default: the cache's; e.g. ``namespace.with_salt(...)`` per tenant), with
        the prompt's non-text inputs ``spans`` (``kvstore.keys.InputSpan``)."""
        arr = tokens_to_array(tokens)
        n = self.usable_tokens(arr.shape[0])
        return self.cache.keys(arr[:n], max_tokens=max_tokens, namespace=namespace, spans=spans)

    def _shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        return [self.layout.chunk_shape(self.kv_caches[0], num_tokens)] * len(self.kv_caches)

    def _staging_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (len(self.kv_caches), *self.layout.chunk_shape(self.kv_caches[0], num_tokens))

    def _host_staging(self, num_tokens: int) -> tuple[torch.Tensor, Lease | None]:
        """Host memory for one chunk of every layer: a pool lease (the caller releases it), or,
        when the pool is full, a tensor of its own (``None`` lease)."""
        shape = self._staging_shape(num_tokens)
        nbytes = math.prod(shape) * self.kv_caches[0].element_size()
        lease = self.pool.lease(nbytes)
        if lease is None:
            return torch.empty(shape, dtype=self.dtype, pin_memory=self.on_cuda), None
        return torch.frombuffer(lease.view, dtype=torch.uint8).view(self.dtype).view(shape), lease

    def _device_staging(self, num_tokens: int) -> torch.Tensor:
        shape = self._staging_shape(num_tokens)
        buf = self._dev_buf
        if buf is None or buf.numel() < math.prod(shape):
            self._dev_buf = buf = torch.empty(math.prod(shape), dtype=self.dtype, device=self.device)
        return buf[:math.prod(shape)].view(shape)

    def lookup(self, tokens: TokenIds, max_tokens: int | None = None, *, spans: Sequence[InputSpan] = ()) -> int:
        """Tokens of the longest stored prefix (one lookup round trip; nothing is loaded)."""
        return self.cache.lookup_tokens(self.keys(tokens, max_tokens, spans=spans))

    # -- save ------------------------------------------------------------------------------
    def save_sequence(self, tokens: TokenIds, slots: torch.Tensor,
                      hidden_states: torch.Tensor | None = None, start_token: int = 0,
                      namespace: Namespace | None = None, *, ends: Sequence[int] | None = None,
                      from_token: int | None = None, spans: Sequence[InputSpan] = (),
                      announce: tuple[int, int] | None = None) -> int:
        """Store the chunks of ``tokens`` whose KV sits at ``slots`` (one slot per token).

        ``hidden_states[i]`` (optional) is the hidden state of token ``start_token + i``; each
        chunk whose last token has one stores it. ``ends`` saves the prefixes ``tokens[:e]``
        for each ``e`` (default: the whole of ``tokens``), the chain hashed once for all of them.
        ``from_token`` says how far the prefix is known to be stored: chunks ending after it are
        written, no lookup is made (``PrefixCache.save``); without it, chunks already stored are
        found by one pre-check and not rebuilt or rewritten. ``namespace`` overrides the cache's
        (same layout, e.g. another cache salt); ``spans`` are the prompt's non-text inputs;
        ``announce``: what to announce to the cache's event sink (``PrefixCache.save``).
        The KV at ``slots`` must not change until this returns: chunks are read from the cache
        as the store takes them (gathered, or sent from the blocks themselves). Returns the
        number of chunks written (handed to the store).
        """
        arr = tokens_to_array(tokens)
        if slots.numel() < arr.shape[0]:
            raise ValueError(f"{arr.shape[0]} tokens need as many slots, got {slots.numel()}")
        if ends is None:
            keys = self.keys(arr, namespace=namespace, spans=spans)
        else:
            n = arr.shape[0]
            keys = prefix_keys(self.cache.in_space(namespace or self.cache.namespace), arr,
                               [self.usable_tokens(min(int(e), n)) for e in ends], spans=spans)
        if not keys:
            return 0
        slots = slots.to(self.device, torch.int64)
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
            hidden = hidden_dtype = hidden_shape = None
            row = chunk.end - 1 - start_token
            if hidden_states is not None and 0 <= row < hidden_states.shape[0]:
                h = hidden_states[row].detach().to("cpu").contiguous()
                hidden, hidden_dtype, hidden_shape = tensor_bytes(h), dtype_name(h.dtype), tuple(h.shape)
            return ChunkPayload(shapes=self._shapes(chunk.num_tokens), kv=kv, hidden=hidden,
                                hidden_dtype=hidden_dtype, hidden_shape=hidden_shape, owner=lease)

        return self.cache.save(arr[:max(k.end for k in keys)], keys, payload, from_token=from_token,
                               namespace=namespace, spans=spans, announce=announce)

    def _gather(self, slots: torch.Tensor, host: torch.Tensor) -> None:
        """Copy the KV of ``slots`` in every layer into ``host`` (``_staging_shape(len(slots))``).
        The record's checksum is computed later, as the store sends the bytes (``Pieces.stream``)."""
        n = slots.numel()
        if not self.on_cuda:
            staging = host_bytes(host) if self._host is not None else None
            if self._host is None or staging is None or not host_copy(self._host, slots, staging, False):
                for layer, cache in enumerate(self.kv_caches):
                    self.layout.gather(cache, slots, host[layer])
            return
        dev = self._device_staging(n)
        stream = self._stream
        assert stream is not None  # built with the transfer on CUDA
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for layer, cache in enumerate(self.kv_caches):
                self.layout.gather(cache, slots, dev[layer])
            host.copy_(dev, non_blocking=True)
        stream.synchronize()  # the record encoder reads the host bytes next

    # -- load ------------------------------------------------------------------------------
    def load_sequence(self, tokens: TokenIds, slots: torch.Tensor,
                      max_tokens: int | None = None, *, skip_tokens: int = 0,
                      namespace: Namespace | None = None, spans: Sequence[InputSpan] = (),
                      before_place: Callable[[ChunkKey, Record], None] | None = None,
                      hidden_dtype: torch.dtype | str | None = None,
                      hidden_shape: Sequence[int] | None = None) -> tuple[int, torch.Tensor | None]:
        """Load the longest stored prefix of ``tokens`` into ``slots``.

        Only chunks ending at or before ``max_tokens`` are considered. Each chunk is verified
        before it counts as loaded (before its KV is scattered, or, landed in the blocks, once
        its last byte is in). Slots past the returned prefix hold nothing usable. ``skip_tokens``
        leading tokens are already in the cache (an engine's local prefix hit, possibly shared
        blocks): chunks ending there are not fetched and those slots are never written
        (``slots`` may hold anything for them); on a block-granular layout it must be a whole
        number of blocks. ``namespace`` overrides the cache's; ``spans`` are the prompt's
        non-text inputs. ``before_place(chunk, record)`` runs for each verified chunk before it
        is counted (and its KV scattered, if it did not land); an exception from it stops the
        load there and propagates (a caller's cancellation). ``hidden_dtype``/``hidden_shape`` are what the caller's model consumes: a
        record carrying another hidden state is a miss there, never a tensor the model cannot
        take. Returns ``(tokens present: skip_tokens or the end of the loaded prefix, hidden
        state of the last loaded token or None)``; the hidden state is a new CPU tensor.
        One batch read, no separate lookup: the records are fetched up to the first missing one.
        """
        arr = tokens_to_array(tokens)
        if skip_tokens < 0 or (self.layout.granularity == "block" and skip_tokens % self.block_size):
            raise ValueError(f"skip_tokens={skip_tokens} must be a non-negative multiple of "
                             f"block_size={self.block_size} for {self.layout.name}")
        keys = [k for k in self.keys(arr, max_tokens, namespace=namespace, spans=spans) if k.end > skip_tokens]
        if not keys:
            return min(skip_tokens, arr.shape[0]), None
        slots = slots.to(self.device, torch.int64)

        def sink(chunk: ChunkKey, record: Record) -> None:
            if before_place is not None:
                before_place(chunk, record)
            if not record.landed:
                self._scatter(slots[chunk.start:chunk.end], record.kv, max(0, skip_tokens - chunk.start))

        landing = self._landing
        land = None
        if landing is not None:
            def land(chunk: ChunkKey) -> list[memoryview] | None:
                # Never into blocks before skip_tokens: they may be shared with other requests.
                return landing.targets(slots[chunk.start:chunk.end]) if chunk.start >= skip_tokens else None

        result = self.cache.load(arr[:keys[-1].end], keys, sink, land=land,
                                 shapes=lambda c: self._shapes(c.num_tokens), namespace=namespace,
                                 hidden_dtype=dtype_name(hidden_dtype) if isinstance(hidden_dtype, torch.dtype)
                                 else hidden_dtype,
                                 hidden_shape=hidden_shape)
        if self.on_cuda:
            assert self._stream is not None  # built with the transfer on CUDA
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        hidden = None
        header = result.last_header
        if result.num_tokens and header is not None and result.hidden is not None and header.hidden_shape is not None:
            dt = getattr(torch, header.hidden_dtype or "", None)
            if isinstance(dt, torch.dtype):
                hidden = torch.frombuffer(bytearray(result.hidden), dtype=dt).view(header.hidden_shape)
        return (result.num_tokens if result.num_tokens else min(skip_tokens, arr.shape[0])), hidden

    def _token_rows(self, staging: torch.Tensor, num_tokens: int, skip: int) -> torch.Tensor:
        """The part of one layer's staging (``chunk_shape(num_tokens)``) after its first ``skip`` tokens."""
        full = self.layout.chunk_shape(self.kv_caches[0], num_tokens)
        rest = self.layout.chunk_shape(self.kv_caches[0], num_tokens - skip)
        axis = next(i for i, (a, b) in enumerate(zip(full, rest)) if a != b)
        return staging.narrow(axis, full[axis] - rest[axis], rest[axis]).contiguous()

    def _scatter(self, slots: torch.Tensor, kv: Buffer, skip: int = 0) -> None:
        n = slots.numel()
        # On the CPU, straight from the record's bytes (numpy items have no alignment needs).
        if self._host is not None and host_copy(self._host, slots, np.frombuffer(kv, dtype=np.uint8), True, skip):
            return
        view = memoryview(kv)
        if self.on_cuda and not view.readonly:
            self._scatter_bytes(slots, view, skip)
            return
        # Staged first: torch's CPU copies need the record's bytes typed and aligned, and torch
        # cannot wrap read-only memory (a memory tier's value) for the device copy.
        host, lease = self._host_staging(n)
        try:
            staged = host.view(-1).view(torch.uint8)
            np.copyto(staged.numpy(), np.frombuffer(kv, dtype=np.uint8))
            if self.on_cuda:
                self._scatter_bytes(slots, array_view(staged.numpy()), skip)
                return
            for layer, cache in enumerate(self.kv_caches):
                rows = self._token_rows(host[layer], n, skip) if skip else host[layer]
                self.layout.scatter(cache, slots[skip:], rows.to(self.device))
        finally:
            if lease is not None:
                lease.release()

    def _scatter_bytes(self, slots: torch.Tensor, kv: memoryview, skip: int) -> None:
        """The record's bytes to the device in one copy, straight from the buffer they arrived in
        (a pinned pool lease: a DMA, no host copy; copied as bytes, so the payload's alignment in
        the record does not matter), then the layout's scatter from device staging. On the side
        stream on CUDA; runs on any device (the CPU tests run it)."""
        n = slots.numel()
        dev = self._device_staging(n)
        src = torch.frombuffer(kv, dtype=torch.uint8)
        stream = self._stream
        if stream is not None:  # as in _gather: the compute stream's queued work on these blocks comes first
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dev.view(-1).view(torch.uint8).copy_(src, non_blocking=True)
            for layer, cache in enumerate(self.kv_caches):
                rows = self._token_rows(dev[layer], n, skip) if skip else dev[layer]
                self.layout.scatter(cache, slots[skip:], rows)
        if stream is not None:
            stream.synchronize()  # the lease is released after this returns

